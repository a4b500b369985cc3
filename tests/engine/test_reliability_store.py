"""Reliability of the disk KV tier (issue 17): page files damaged in more ways than test_storage.py's are never
used; two processes (or two stores) on one folder never read a wrong page and keep the size limit together; on
the real engine a truncated page is skipped, recomputed and rewritten. tools/reliability.py measures the same
with two engines at once."""
import json
import os
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.offload.storage import KVStore
from tests.engine.storage_pages import FMT, LAYOUT, REPO, key, page, page_file_size, page_files

TOOL = REPO / "tools" / "reliability_disk.py"


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    head = 12 + int.from_bytes(data[8:12], "little")        # magic + length + JSON header: the payload's offset
    if how == "empty file":
        data = bytearray()
    elif how == "cut inside the header":
        data = data[:head // 2]
    elif how == "header only":
        data = data[:head]
    elif how == "flipped checksum digit":
        at = data.index(b'"checksum": "') + len(b'"checksum": "')
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    elif how == "bytes appended":
        data += b"\0" * 64
    elif how == "last byte flipped":
        data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["empty file", "cut inside the header", "header only", "flipped checksum digit",
                                 "bytes appended", "last byte flipped"])
def test_a_damaged_page_file_is_never_used(tmp_path, how):
    store = KVStore(tmp_path, FMT, 1 << 20)
    assert store.write(key(0), page(0))
    (path,) = page_files(tmp_path)
    _damage(path, how)
    out = torch.full(LAYOUT, -3.0)
    assert not store.read(key(0), out)
    assert torch.all(out == -3.0) and not path.exists() and store.usage() == (0, 0)
    assert store.write(key(0), page(0)) and store.read(key(0), out) and torch.equal(out, page(0))


def test_two_stores_on_one_folder_keep_the_limit_together(tmp_path):
    """Two stores on one folder (two app instances): each learns the pages the other wrote, so together they stay
    within the limit; each one's usage is what is on disk."""
    size = page_file_size()
    a, b = KVStore(tmp_path, FMT, 12 * size), KVStore(tmp_path, FMT, 12 * size)
    for i in range(8):
        assert a.write(key(i), page(i))
    for i in range(100, 108):
        assert b.write(key(i), page(i))
    files = page_files(tmp_path)
    assert len(files) == 12 and b.usage() == (12, 12 * size)
    assert a.write(key(8), page(8))                         # a learns too: it evicts from what is really there
    assert len(page_files(tmp_path)) == 12 and a.usage() == (12, 12 * size)
    out = torch.empty(LAYOUT)
    for path in page_files(tmp_path):
        i = next(i for i in [*range(9), *range(100, 108)] if key(i) == path.stem)
        assert a.read(key(i), out) and torch.equal(out, page(i))


def _hammer(store, seed: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(TOOL), "hammer", str(store), str(seed), "3000"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)


def test_two_processes_hammering_one_store_never_read_a_wrong_page(tmp_path):
    """Two processes write and read 120 pages at random in a store that holds 40 (evictions all the time, by
    both): every page read is the page written for its key, every file left verifies, and the limit holds (give
    or take what each wrote since it last listed the folder)."""
    procs = [_hammer(tmp_path, seed) for seed in (1, 2)]
    counts = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for c in counts:
        assert c["wrong"] == 0 and c["reads_ok"] > 0 and c["writes"] > 0 and c["store_enabled"]
    sys.path.insert(0, str(TOOL.parent))
    try:
        from reliability_disk import HAMMER_LIMIT_PAGES, verify_store
    finally:
        sys.path.remove(str(TOOL.parent))
    check = verify_store(tmp_path)
    assert check["bad"] == [] and check["tmp"] == 0
    assert 0 < check["pages"] <= HAMMER_LIMIT_PAGES * 1.25


def test_a_truncated_page_is_skipped_recomputed_and_rewritten(default_model_dir, tmp_path):
    prompt = list(range(2000, 2000 + 700))                   # 10 full 64-token blocks + 60 tokens
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(device="cpu", kv_block_size=64, max_model_len=2048, kv_store=str(tmp_path))

    def run() -> tuple:
        with LLM(str(default_model_dir), **kw) as llm:
            out = llm.generate([prompt], params)[0]
            llm.tier.flush()
            return out.token_ids, out.stats.disk_cached_tokens

    computed, disk = run()
    pages = sorted(page_files(tmp_path), key=lambda p: p.stat().st_mtime_ns)   # written in block order
    assert disk == 0 and len(pages) == 11
    pages[6].write_bytes(pages[6].read_bytes()[:-4096])
    assert run() == (computed, 6 * 64)                       # read up to the bad page, the rest computed
    assert len(page_files(tmp_path)) == 11 and pages[6].stat().st_size == pages[5].stat().st_size   # rewritten
    assert run() == (computed, 640)
