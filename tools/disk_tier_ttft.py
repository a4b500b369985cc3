"""Time to first token with the disk KV tier after a restart, vs computing the prefill: three fresh processes.

    python tools/disk_tier_ttft.py --tokens 7000                                   # CPU, the default model
    python tools/disk_tier_ttft.py --shape qwen3-4b --tokens 32768 --mode layerwise  # GPU, random weights

1. no store: the prompt's prefill is computed (the baseline);
2. store on, empty: computed again, and its full blocks are written to disk (the writes are flushed and timed);
   then the page files are dropped from the OS page cache (posix_fadvise DONTNEED, after fsync), so the read
   comes from the disk and not from memory (--keep-page-cache to skip that);
3. store on, a new process (a restart): the prompt's pages are read from disk; only its last block is computed.
Each process first answers a short warm-up prompt (kernels compiled, memory allocated), then the measured one
(`--tokens` random token ids, 1 answer token). Prints TTFT of each, the speed-up, and the read bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, random
cfg = json.loads(sys.argv[1])
from engine import LLM, SamplingParams
llm = LLM(cfg["model"], **cfg["engine"])
one = SamplingParams(max_tokens=1, ignore_eos=True)
rng = random.Random(7)
vocab = min(llm.args.vocab_size, 30000)
warm = [rng.randrange(100, vocab) for _ in range(600)]
prompt = [rng.randrange(100, vocab) for _ in range(cfg["tokens"])]
llm.generate([warm], one)
out = llm.generate([prompt], one)[0]
res = {"ttft_s": out.stats.ttft_s, "cached": out.stats.cached_tokens, "disk": out.stats.disk_cached_tokens}
if llm.tier is not None:
    t = llm.tier
    res.update(read_bytes=t.read_bytes, read_s=t.read_s)
    t0 = time.perf_counter()
    t.flush()
    res["flush_s"] = time.perf_counter() - t0
    res["pages"], res["store_bytes"] = t.store.usage()
llm.close()
print(json.dumps(res))
"""


def child(model, engine: dict, tokens: int) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"model": model, "engine": engine, "tokens": tokens})],
                       cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def drop_page_cache(root: Path) -> int:
    n = 0
    for f in root.rglob("*.kvp"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    ap.add_argument("--shape", default=None, help="random weights of a real model's shape, e.g. qwen3-4b")
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--mode", default="gpu")
    ap.add_argument("--device", default=None)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--store", type=Path, default=None, help="store folder (default: a fresh temporary one)")
    ap.add_argument("--keep-page-cache", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    store = args.store or Path(tempfile.mkdtemp(prefix="kvscope-ttft-"))
    shutil.rmtree(store, ignore_errors=True)
    engine = {"mode": args.mode, "device": args.device, "kv_block_size": args.block_size,
              "max_model_len": args.tokens + 1024}
    if args.shape:
        from bench.shapes import shape_config
        engine["shape"] = shape_config(args.shape)
    base = child(args.model, engine, args.tokens)
    write = child(args.model, {**engine, "kv_store": str(store), "kv_store_gb": 200}, args.tokens)
    dropped = 0 if args.keep_page_cache else drop_page_cache(store)
    read = child(args.model, {**engine, "kv_store": str(store), "kv_store_gb": 200}, args.tokens)
    shutil.rmtree(store, ignore_errors=True)
    gbps = read["read_bytes"] / read["read_s"] / 1e9 if read.get("read_s") else 0.0
    result = {"tokens": args.tokens, "engine": engine, "computed": base, "write": write, "read": read,
              "speedup": base["ttft_s"] / read["ttft_s"], "read_gbps": gbps, "page_cache_dropped": dropped}
    print(f"{args.tokens} tokens, {args.shape or args.model or 'default model'}, {args.mode}: TTFT computed "
          f"{base['ttft_s']:.3f} s · from disk {read['ttft_s']:.3f} s ({read['disk']} tokens read, "
          f"{read['read_bytes'] / 2**30:.2f} GiB at {gbps:.2f} GB/s{'' if dropped else ', page cache kept'}) · "
          f"{result['speedup']:.1f}x · writing {write['pages']} pages took {write['flush_s']:.1f} s after the answer")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
