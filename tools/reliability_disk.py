"""The disk part of tools/reliability.py: bad page files, and two processes on one store.

    python tools/reliability_disk.py verify STORE            # every page file of a store, checked byte by byte
    python tools/reliability_disk.py hammer STORE SEED OPS   # (a child) random writes and reads, reads checked
    python tools/reliability_disk.py engine STORE PROMPTS    # (a child) an engine answering prompts on the store
    python tools/reliability_disk.py corrupt STORE           # (a child) flip a byte, truncate a file, recompute

`verify_store` checks a page file without knowing its format: the magic, the JSON header (its key is the file's
name), the payload's length and its xxh3-64 checksum; leftover temporary files are counted.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import xxhash

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAGIC = b"KVSPAGE1"
HAMMER_LAYOUT = (2, 2, 1, 16, 8)   # 2 KiB pages of float32
HAMMER_KEYS, HAMMER_LIMIT_PAGES = 120, 40
ENGINE = {"device": "cpu", "mode": "gpu", "kv_block_size": 64, "max_model_len": 2048, "torch_threads": 1}


def verify_store(root: Path) -> dict:
    """{"pages", "bad" (names), "tmp", "bytes"} of every page file under root."""
    pages, bad, nbytes = 0, [], 0
    for path in sorted(Path(root).rglob("*.kvp")):
        try:
            data = path.read_bytes()
        except FileNotFoundError:   # evicted meanwhile
            continue
        pages += 1
        nbytes += len(data)
        try:
            n = int.from_bytes(data[8:12], "little")
            head = json.loads(data[12:12 + n])
            payload = memoryview(data)[12 + n:]
            ok = (data[:8] == MAGIC and head["key"] == path.stem and len(payload) == head["nbytes"]
                  and xxhash.xxh3_64_hexdigest(payload) == head["checksum"])
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad.append(path.name)
    return {"pages": pages, "bad": bad, "tmp": len(list(Path(root).rglob("*.tmp"))), "bytes": nbytes}


# ------------------------------------------------------------------ children
def hammer(store_dir: str, seed: int, ops: int) -> dict:
    """Random writes and reads of HAMMER_KEYS pages in a store that holds HAMMER_LIMIT_PAGES (evictions all the
    time); every page read must be exactly the page written for its key (the content is a function of the key)."""
    import torch

    from engine.offload.storage import KVStore, PageFormat

    fmt = PageFormat("reliability-hammer", "float32", HAMMER_LAYOUT)
    with tempfile.TemporaryDirectory() as d:           # one page file's size, measured
        probe = KVStore(d, fmt, 1 << 30)
        assert probe.write(hammer_key(0), hammer_page(0, torch))
        size = probe.usage()[1]
    store = KVStore(store_dir, fmt, HAMMER_LIMIT_PAGES * size)
    rng, out = random.Random(seed), torch.empty(HAMMER_LAYOUT)
    counts = {"writes": 0, "reads_ok": 0, "misses": 0, "wrong": 0}
    for _ in range(ops):
        i = rng.randrange(HAMMER_KEYS)
        if rng.random() < 0.5:
            counts["writes"] += store.write(hammer_key(i), hammer_page(i, torch))
        elif store.read(hammer_key(i), out):
            good = torch.equal(out, hammer_page(i, torch))
            counts["reads_ok" if good else "wrong"] += 1
        else:
            counts["misses"] += 1
    counts["store_enabled"] = store.enabled
    return counts


def hammer_key(i: int) -> str:
    return xxhash.xxh3_128_hexdigest(f"hammer page {i}".encode())


def hammer_page(i: int, torch):
    return torch.arange(2 * 2 * 16 * 8, dtype=torch.float32).view(HAMMER_LAYOUT) * (i + 1)


def prompts(seed: int, n: int, length: int = 700) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(n)]


def engine_answers(store_dir: str, prompt_list: list[list[int]]) -> list[dict]:
    from engine import LLM, SamplingParams
    with LLM(None, kv_store=store_dir, **ENGINE) as llm:
        out = []
        for p in prompt_list:
            c = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]
            out.append({"tokens": c.token_ids, "disk": c.stats.disk_cached_tokens, "cached": c.stats.cached_tokens})
        llm.tier.flush()
    return out


def corrupt(store_dir: str) -> dict:
    """A prompt's pages written; then a flipped payload byte, then a truncated file: each run reads up to the bad
    page, computes the rest (the same greedy answer) and writes the page again; a last run reads every page."""
    (prompt,) = prompts(11, 1)
    root = Path(store_dir)
    first = engine_answers(store_dir, [prompt])[0]
    pages = sorted(root.rglob("*.kvp"), key=lambda p: p.stat().st_mtime_ns)   # written in block order
    res = {"pages": len(pages), "first_disk": first["disk"], "runs": []}
    for how, victim in (("flipped byte", 4), ("truncated file", 2)):
        path = pages[victim]
        data = bytearray(path.read_bytes())
        if how == "flipped byte":
            data[len(data) // 2] ^= 0x10
        else:
            data = data[:len(data) - 4096]
        path.write_bytes(bytes(data))
        got = engine_answers(store_dir, [prompt])[0]
        check = verify_store(root)
        res["runs"].append({"how": how, "page": victim, "disk": got["disk"], "expect_disk": victim * 64,
                            "same_answer": got["tokens"] == first["tokens"], "rewritten": check["pages"] == len(pages)
                            and not check["bad"]})
    last = engine_answers(store_dir, [prompt])[0]
    res["last_disk"], res["last_same"] = last["disk"], last["tokens"] == first["tokens"]
    return res


CHILDREN = {"hammer": lambda a: hammer(a[0], int(a[1]), int(a[2])),
            "engine": lambda a: engine_answers(a[0], json.loads(Path(a[1]).read_text())),
            "corrupt": lambda a: corrupt(a[0]), "verify": lambda a: verify_store(Path(a[0]))}


def spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def collect(p: subprocess.Popen, timeout: float = 1800):
    out, err = p.communicate(timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{p.args[2:]} failed (exit {p.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------ the part
def part_disk() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-rel-disk-"))
    res = {"corrupt": collect(spawn("corrupt", str(tmp / "corrupt")))}
    store = tmp / "hammer"
    procs = [spawn("hammer", str(store), str(seed), "4000") for seed in (1, 2)]
    res["hammer"] = [collect(p) for p in procs]
    res["hammer_store"] = verify_store(store)
    pages, nbytes = res["hammer_store"]["pages"], res["hammer_store"]["bytes"]
    res["hammer_limit_bytes"] = HAMMER_LIMIT_PAGES * (nbytes // max(1, pages))
    store = tmp / "shared"                       # two engines at once: two shared prompts, one own prompt each
    shared, own = prompts(21, 2), prompts(22, 2)
    lists = [[shared[0], own[0], shared[1]], [shared[0], own[1], shared[1]]]
    files = []
    for i, lst in enumerate(lists):
        files.append(tmp / f"prompts{i}.json")
        files[-1].write_text(json.dumps(lst))
    procs = [spawn("engine", str(store), str(f)) for f in files]
    writers = [collect(p) for p in procs]
    res["engines_store"] = verify_store(store)
    files.append(tmp / "prompts-all.json")
    files[-1].write_text(json.dumps(shared + own))
    reader = collect(spawn("engine", str(store), str(files[-1])))
    computed = {json.dumps(p): w["tokens"] for lst, ws in zip(lists, writers) for p, w in zip(lst, ws)}
    res["engines"] = {"writers_disk": [[w["disk"] for w in ws] for ws in writers],
                      "reader_disk": [r["disk"] for r in reader],
                      "reader_same": [r["tokens"] == computed[json.dumps(p)] for p, r in zip(shared + own, reader)],
                      "writers_agree": writers[0][0]["tokens"] == writers[1][0]["tokens"]
                      and writers[0][2]["tokens"] == writers[1][2]["tokens"]}
    return res


def report(r: dict) -> list[tuple[str, bool]]:
    goals = []
    c = r["corrupt"]
    print(f"disk: bad pages (a 700-token prompt, {c['pages']} pages of 64 tokens):")
    for run in c["runs"]:
        print(f"  {run['how']} in page {run['page']}: read {run['disk']} tokens from disk (expected "
              f"{run['expect_disk']}), the rest computed; same answer: {run['same_answer']}; "
              f"rewritten: {run['rewritten']}")
        goals.append((f"{run['how']} detected, skipped, recomputed, rewritten",
                      run["disk"] == run["expect_disk"] and run["same_answer"] and run["rewritten"]))
    print(f"  next run: {c['last_disk']} tokens from disk, same answer: {c['last_same']}")
    goals.append(("after the bad pages, every page is read again", c["last_disk"] == 640 and c["last_same"]))
    h, hs = r["hammer"], r["hammer_store"]
    print(f"  two processes at once on one store ({HAMMER_KEYS} keys at random, room for {HAMMER_LIMIT_PAGES} pages):")
    for i, x in enumerate(h):
        print(f"    process {i + 1}: {x['writes']} writes, {x['reads_ok']} good reads, {x['misses']} misses (evicted), "
              f"{x['wrong']} wrong")
    print(f"    then: {hs['pages']} pages ({hs['bytes']} B, limit {r['hammer_limit_bytes']} B), {len(hs['bad'])} bad, "
          f"{hs['tmp']} temporary files")
    goals.append(("two processes hammering one store: no wrong read, every file intact",
                  all(x["wrong"] == 0 and x["store_enabled"] for x in h) and not hs["bad"] and not hs["tmp"]))
    e, es = r["engines"], r["engines_store"]
    print(f"  two engines at once on one store: tokens from disk {e['writers_disk']}; store {es['pages']} pages, "
          f"{len(es['bad'])} bad; a third engine read {e['reader_disk']} tokens from disk, same answers "
          f"{e['reader_same']}")
    goals.append(("two engines on one store: store intact, a third engine reads every prompt back, same answers",
                  not es["bad"] and not es["tmp"] and all(e["reader_same"]) and e["writers_agree"]
                  and all(d == 640 for d in e["reader_disk"])))
    return goals


if __name__ == "__main__":
    print(json.dumps(CHILDREN[sys.argv[1]](sys.argv[2:])))
