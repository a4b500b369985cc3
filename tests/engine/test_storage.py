"""The local-disk KV page store: chained keys, exact round trips, verification, crash safety, the size limit and
degrading on I/O errors (the background writer: test_storage_writer.py)."""
import contextlib
import errno
import math
import os
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from engine.offload import storage
from engine.offload.storage import KVStore, PageFormat, chain_keys, default_store_dir
from engine.offload.store_writer import StoreWriter
from tests.engine.storage_pages import (BIG_LAYOUT, FMT, LAYOUT, bits, key, page, page_file_size, page_files,
                                        run_python)


# ---- keys ----

def test_chain_keys_follow_the_tokens():
    tokens = list(range(100, 114))  # 3 full pages of 4 and 2 left over
    keys = chain_keys(tokens, FMT)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    # the definition: key_i = xxh3_128(key_{i-1} bytes, int64 little-endian token ids), key_-1 = namespace
    first = xxhash.xxh3_128_hexdigest(bytes.fromhex(FMT.namespace) + np.array(tokens[:4], "<i8").tobytes())
    assert keys[0] == first
    # only full pages get keys; equal prefixes share keys
    assert chain_keys(tokens[:3], FMT) == []
    assert chain_keys(tokens[:8], FMT) == keys[:2]
    assert chain_keys(tokens + [7, 7, 7], FMT)[:3] == keys
    # one changed token changes its page's key and every later one, not the earlier ones
    changed = list(tokens)
    changed[5] += 1
    other = chain_keys(changed, FMT)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    # a prefix key continues the chain
    assert chain_keys(tokens[8:], FMT, prefix_key=keys[1]) == keys[2:]
    assert chain_keys(tokens[4:], FMT, prefix_key=keys[0]) == keys[1:]


def test_other_formats_share_no_key():
    tokens = list(range(40))
    keys = set(chain_keys(tokens, FMT))
    others = [PageFormat("other-model", "float32", LAYOUT), PageFormat("tiny-model", "bfloat16", LAYOUT),
              PageFormat("tiny-model", "float32", (2, 2, 1, 4, 16)),
              PageFormat("tiny-model", "float32", (3, 2, 1, 4, 8))]
    for fmt in others:
        assert fmt.namespace != FMT.namespace
        assert keys.isdisjoint(chain_keys(tokens, fmt))
    assert PageFormat("tiny-model", "float32", list(LAYOUT)).namespace == FMT.namespace


def test_page_format():
    fmt = PageFormat("m", "bfloat16", (3, 2, 2, 16, 64))
    assert fmt.page_size == 16 and fmt.nbytes == 3 * 2 * 2 * 16 * 64 * 2
    with pytest.raises(ValueError, match="dtype"):
        PageFormat("m", "int8", LAYOUT)
    with pytest.raises(ValueError, match="layout"):
        PageFormat("m", "float32", (2, 4, 8))


def test_default_store_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_KV_STORE", str(tmp_path / "elsewhere"))      # the override (tests use it)
    assert default_store_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("KVSCOPE_KV_STORE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_store_dir() == tmp_path / "kvscope" / "kv"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(storage.sys, "platform", "linux")
    assert default_store_dir() == tmp_path / "home" / ".cache" / "kvscope" / "kv"
    monkeypatch.setattr(storage.sys, "platform", "darwin")
    assert default_store_dir() == tmp_path / "home" / "Library" / "Caches" / "kvscope" / "kv"
    monkeypatch.setattr(storage.sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert default_store_dir() == tmp_path / "local" / "kvscope" / "kv"


# ---- round trips ----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact_through_strided_views(tmp_path, dtype):
    fmt = PageFormat("tiny-model", dtype, LAYOUT)
    L, _, H, bs, D = LAYOUT
    host = torch.randn(L, 3, 2, H, bs, D).to(fmt.torch_dtype)  # [L, blocks, 2, H, bs, D] like the host pool
    store = KVStore(tmp_path, fmt, 1 << 20)
    src = host[:, 1]
    assert not src.is_contiguous()
    assert store.write(key(1), src)
    assert store.contains(key(1)) and not store.contains(key(2))

    back = torch.zeros_like(host)
    assert store.read(key(1), back[:, 2])
    assert torch.equal(bits(back[:, 2]), bits(host[:, 1]))
    assert not back[:, :2].any()  # the other blocks are untouched
    assert store.usage() == (1, page_files(tmp_path)[0].stat().st_size)


def test_a_restart_finds_the_pages_and_another_format_does_not(tmp_path):
    store = KVStore(tmp_path, FMT, 1 << 20)
    keys = chain_keys(range(12), FMT)
    for i, k in enumerate(keys):
        assert store.write(k, page(i))
    store.close()

    again = KVStore(tmp_path, FMT, 1 << 20)
    assert again.usage() == store.usage() and again.usage()[0] == 3
    for i, k in enumerate(keys):
        out = torch.empty(LAYOUT)
        assert again.contains(k) and again.read(k, out)
        assert torch.equal(out, page(i))

    other_fmt = PageFormat("another-model", "float32", LAYOUT)
    other = KVStore(tmp_path, other_fmt, 1 << 20)
    assert other.usage() == again.usage()  # the limit and usage cover the whole store
    for k in keys + chain_keys(range(12), other_fmt):
        assert not other.contains(k)
        assert not other.read(k, torch.empty(LAYOUT))
    assert again.read(keys[0], torch.empty(LAYOUT))  # nothing was deleted by the other format
    assert {s["namespace"]: s["pages"] for s in other.summary()} == {FMT.namespace[:16]: 3}


# ---- verification ----

def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip payload byte":
        data[-5] ^= 0x40
    elif how == "truncate":
        data = data[:-10]
    elif how == "other dtype in header":
        assert data.count(b'"float32"') == 1
        data = data.replace(b'"float32"', b'"float16"')
    elif how == "another key's page":
        data = bytearray(page_files(path.parents[2])[0].read_bytes())
        assert data != path.read_bytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip payload byte", "truncate", "other dtype in header", "another key's page"])
def test_a_bad_page_is_never_used_and_is_rewritten(tmp_path, how):
    store = KVStore(tmp_path, FMT, 1 << 20)
    good, bad = (key(0), key(1)) if key(0) < key(1) else (key(1), key(0))  # page_files()[0] is the good one
    assert store.write(good, page(0)) and store.write(bad, page(1))
    (path,) = tmp_path.rglob(f"{bad}.kvp")
    _corrupt(path, how)

    out = torch.full(LAYOUT, -7.0)
    assert not store.read(bad, out)
    assert torch.all(out == -7.0)  # untouched
    assert not path.exists() and not store.contains(bad)
    assert store.usage()[0] == 1

    assert store.write(bad, page(1))
    assert store.read(bad, out) and torch.equal(out, page(1))
    assert store.read(good, out) and torch.equal(out, page(0))


_KILLED_WRITER = """
import sys, torch
from engine.offload.storage import KVStore, PageFormat
layout = {layout}
store = KVStore(sys.argv[1], PageFormat("kill-test", "float32", layout), 64 << 20)
i = 0
while True:
    store.write(f"{{i:032x}}", (torch.arange(2 ** 19, dtype=torch.float32) + i).view(layout))
    i += 1
"""


def _partly_written(root: Path) -> bool:
    sizes = []
    for path in root.rglob("*.*"):
        with contextlib.suppress(OSError):  # renamed meanwhile
            sizes.append(path.stat().st_size)
    return any(size < 2 ** 21 for size in sizes)


def test_a_write_killed_midway_leaves_only_complete_pages(tmp_path):
    assert math.prod(BIG_LAYOUT) == 2 ** 19
    proc = run_python(_KILLED_WRITER.format(layout=BIG_LAYOUT), str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(page_files(tmp_path)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert len(page_files(tmp_path)) >= 3, "the writer process wrote no pages"
        deadline = time.monotonic() + 3  # aim the kill at a write in progress: a file short of its payload
        while not _partly_written(tmp_path) and time.monotonic() < deadline:
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    # besides the kill's own leftover (if it landed mid-write): one of a dead writer, one of a live one (us)
    shard = page_files(tmp_path)[0].parent
    (shard / f"{'d' * 32}.{proc.pid}.abc.tmp").write_bytes(b"KVSPAGE1 partial")
    live = shard / f"{'e' * 32}.{os.getpid()}.abc.tmp"
    live.write_bytes(b"KVSPAGE1 being written")
    fmt = PageFormat("kill-test", "float32", BIG_LAYOUT)
    store = KVStore(tmp_path, fmt, 64 << 20)
    assert page_files(tmp_path, ".tmp") == [live]
    live.unlink()
    files = page_files(tmp_path)
    assert len(files) >= 3 and store.usage()[0] == len(files)
    out = torch.empty(BIG_LAYOUT)
    for path in files:
        k = path.stem
        assert store.contains(k) and store.read(k, out), f"page {k} is not complete"
        expect = torch.arange(2 ** 19, dtype=torch.float32).view(BIG_LAYOUT) + int(k, 16)
        assert torch.equal(out, expect)


# ---- the size limit ----

def _alive(store: KVStore, ids) -> set[int]:
    return {i for i in ids if store.contains(key(i))}


def test_the_size_limit_evicts_the_least_recently_accessed(tmp_path):
    size = page_file_size()
    limit = 10 * size
    store = KVStore(tmp_path, FMT, limit)
    for i in range(10):
        assert store.write(key(i), page(i))
    assert store.usage() == (10, limit)
    assert store.read(key(0), torch.empty(LAYOUT))  # page 0 is now the most recently used
    for i in range(10, 15):
        assert store.write(key(i), page(i))
        assert store.usage()[1] <= limit
    assert _alive(store, range(50)) == {0, *range(6, 15)}
    assert len(page_files(tmp_path)) == 10

    for i in range(15, 50):
        assert store.write(key(i), page(i))
        assert store.usage()[1] <= limit
        assert sum(p.stat().st_size for p in page_files(tmp_path)) <= limit
    assert _alive(store, range(50)) == set(range(40, 50))
    out = torch.empty(LAYOUT)
    assert store.read(key(45), out) and torch.equal(out, page(45))
    assert store.clear() == limit and store.usage() == (0, 0) and page_files(tmp_path) == []


def test_the_limit_covers_every_namespace_and_uses_mtime_after_a_restart(tmp_path):
    size = page_file_size()
    store = KVStore(tmp_path, FMT, 5 * size)
    for i in range(5):
        assert store.write(key(i), page(i))
    now = time.time_ns()
    for i in range(5):  # page 4 accessed longest ago, page 0 most recently
        (path,) = tmp_path.rglob(f"{key(i)}.kvp")
        os.utime(path, ns=(now - i * 10**9, now - i * 10**9))

    other_fmt = PageFormat("another-model", "float32", LAYOUT)
    other = KVStore(tmp_path, other_fmt, 5 * size)
    assert other.usage() == (5, 5 * size)
    assert other.write(key(100), page(100))
    assert other.write(key(101), page(101))
    assert other.usage() == (5, 5 * size)
    assert _alive(KVStore(tmp_path, FMT, 5 * size), range(5)) == {0, 1, 2}
    assert {s["namespace"]: (s["pages"], s["bytes"]) for s in other.summary()} == {
        FMT.namespace[:16]: (3, 3 * size), other_fmt.namespace[:16]: (2, 2 * size)}


def test_a_page_larger_than_the_limit_is_not_written(tmp_path):
    store = KVStore(tmp_path, FMT, page_file_size() - 1)
    assert not store.write(key(0), page(0))
    assert store.enabled and store.usage() == (0, 0) and page_files(tmp_path) == []


# ---- degrading on I/O problems ----

@pytest.mark.parametrize("where, code", [("fsync", errno.ENOSPC), ("replace", errno.EDQUOT), ("replace", errno.EIO)])
def test_a_failed_write_turns_storage_off_with_one_warning(tmp_path, monkeypatch, where, code):
    store = KVStore(tmp_path, FMT, 1 << 20)
    assert store.write(key(0), page(0))

    def fail(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(storage.os, where, fail)
    with pytest.warns(UserWarning) as record:
        assert store.write(key(1), page(1)) is False
    (warning,) = record
    message = str(warning.message)
    assert str(tmp_path) in message and os.strerror(code) in message and "off" in message
    assert ("disk is full" in message) == (code != errno.EIO)
    assert not store.enabled
    assert page_files(tmp_path, ".tmp") == [] and not store.contains(key(1))
    monkeypatch.undo()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert store.write(key(2), page(2)) is False
    assert not store.contains(key(2))
    out = torch.empty(LAYOUT)
    assert store.read(key(0), out) and torch.equal(out, page(0))


def test_an_unusable_root_gives_a_disabled_store(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    root = blocker / "kv"
    with pytest.warns(UserWarning, match="cannot use") as record:
        store = KVStore(root, FMT, 1 << 20)
    assert str(root) in str(record[0].message)
    assert not store.enabled
    assert store.write(key(0), page(0)) is False
    assert not store.contains(key(0)) and not store.read(key(0), torch.empty(LAYOUT))
    assert store.usage() == (0, 0) and store.summary() == [] and store.clear() == 0

    writer = StoreWriter(store)
    writer.submit(key(0), page(0), "t0")
    writer.submit(key(1), page(1), "t1")
    assert writer.acks() == ["t0", "t1"] and writer.pending == 0
    writer.close()
    assert blocker.read_text() == "not a folder"
