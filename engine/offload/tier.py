"""DiskTier: the third KV tier. GPU -> host -> disk, with pages keyed by chained hashes (engine/offload/storage.py).

One page = one full KV block of one sequence across all layers. The tier sits between the block manager, the
runner's KV memory and the page store:

- Read: before a prompt's prefill, the full blocks after its in-memory prefix-cache hits are looked up on disk, in
  order, and read (verified) straight into the blocks the scheduler gave it: the host pool in offload modes (the
  prefill then loads them to the device like any cached block), the device KV cache in gpu mode. The first miss
  or bad page ends the run; only the rest of the prompt is computed. The block holding the last prompt token is
  always computed (its logits start the answer).
- Write-back: when a prefill ends, and whenever decode fills a block, the full blocks not yet on disk are handed
  to a background writer (engine/offload/store_writer.py). Each such block is held (one more reference in the
  block manager) until its write is acknowledged, so its memory is neither reused nor overwritten while the
  writer reads it. The partly filled last block of a finished request is not a page and is not written.
- Identity: the store's namespace digests the model (config.json, weight file names, sizes and first/last MiB),
  dtype, block layout and, for sparse prefill policies (whose KV differs from dense), the policy and its
  parameters, so a page can only ever be read back by the engine that would have computed it.
"""
from __future__ import annotations

import json
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from engine.offload.storage import KVStore, PageFormat, chain_keys, default_store_dir
from engine.offload.store_writer import StoreWriter
from engine.sequence import Sequence
from engine.trace.events import HOST, Span
from engine.trace.recorder import NULL_RECORDER, Recorder

_SAMPLE = 1 << 20   # bytes hashed from each end of a weight file
READERS = 8         # pages read (and checksummed) in parallel


def model_identity(model_dir: Path | None, name: str, policy: str, params: dict, sparse_prefill: bool) -> str:
    """A digest of what determines the KV: the weights and config (or random weights' shape and seed)."""
    h = xxhash.xxh3_128(name.encode())
    if model_dir is not None:
        h.update((model_dir / "config.json").read_bytes())
        for f in sorted(model_dir.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
                size = f.stat().st_size
                h.update(f"{f.name}:{size}".encode())
                with open(f, "rb") as fh:
                    h.update(fh.read(_SAMPLE))
                    fh.seek(max(0, size - _SAMPLE))
                    h.update(fh.read(_SAMPLE))
    if sparse_prefill:
        h.update(json.dumps([policy, params], sort_keys=True).encode())
    return h.hexdigest()


class DiskTier:
    def __init__(self, store: KVStore, kv, block_manager):
        """kv: the runner's KV memory (`block(id)` views, `written(ids)`, `sync()`; engine/runner.py)."""
        self.store, self.kv, self.bm = store, kv, block_manager
        self.writer = StoreWriter(store, max_pending=0)   # unbounded: a submit never makes the engine wait
        self._keys: dict[int, list[str]] = {}     # seq id -> keys of its full blocks so far
        self._written: dict[int, int] = {}        # seq id -> full blocks handed to the writer
        self.read_bytes, self.read_s = 0, 0.0     # what fill() read, and how long it took (tools/disk_tier_ttft.py)

    @property
    def fmt(self) -> PageFormat:
        return self.store.fmt

    def _keys_for(self, seq: Sequence, n_blocks: int) -> list[str]:
        keys = self._keys.setdefault(seq.seq_id, [])
        if len(keys) < n_blocks:
            bs = self.fmt.page_size
            tokens = seq.token_ids[len(keys) * bs:n_blocks * bs]
            keys += chain_keys(tokens, self.fmt, keys[-1] if keys else None)
        return keys

    # ------------------------------------------------------------------ read
    def fill(self, seq: Sequence, rec: Recorder = NULL_RECORDER) -> Span | None:
        """Read the prompt's next full blocks from disk into its blocks (counted in seq.num_cached_tokens and
        seq.disk_cached_tokens); -> the trace span of the read (None when nothing was read or nothing records)."""
        bs = self.fmt.page_size
        first, last = seq.num_cached_tokens // bs, (len(seq) - 1) // bs     # the last prompt token's block: computed
        if first >= last or not self.store.enabled:
            return None
        keys = self._keys_for(seq, last)
        t0, us0 = time.perf_counter(), rec.now_us() if rec.enabled else 0.0
        n, nxt, ahead = 0, first, deque()
        with ThreadPoolExecutor(READERS) as pool:   # reads and checksums run ahead in parallel; copies in order
            while True:
                while nxt < last and len(ahead) < 2 * READERS and self.store.contains(keys[nxt]):
                    ahead.append(pool.submit(self.store.fetch, keys[nxt]))
                    nxt += 1
                page = ahead.popleft().result() if ahead else None
                if page is None:                     # missing or bad: the rest of the prompt is computed
                    break
                self.kv.block(seq.block_table[first + n]).copy_(page)
                n += 1
            for f in ahead:
                f.cancel()
        if n:
            self.kv.written(seq.block_table[first:first + n])
            seq.num_cached_tokens += n * bs
            seq.disk_cached_tokens += n * bs
            self.read_bytes += n * self.fmt.nbytes
            self.read_s += time.perf_counter() - t0
            if rec.enabled:
                return Span(HOST, "disk read", us0, rec.now_us(), bytes=n * self.fmt.nbytes,
                            args={"pages": n, "first_block": first})
        return None

    # ------------------------------------------------------------------ write-back
    def write_back(self, seq: Sequence) -> None:
        """Hand the sequence's full blocks not yet handed over to the writer (after its prefill, and as decode
        fills blocks; called before the step's new token is appended, so every token of `seq` has its KV). Each
        is held until its write is acknowledged. Blocks a sparse decode wrote to (not `exact`) are never written:
        the store's pages are what a dense prefill computes, whatever decode policy runs."""
        bs = self.fmt.page_size
        done = self._written.get(seq.seq_id, 0)
        full = min(len(seq) // bs, len(seq.block_table))
        if full <= done or not self.store.enabled:
            return
        keys = self._keys_for(seq, full)
        self.kv.sync()                       # the host copies of these blocks have landed
        for i in range(done, full):
            block = seq.block_table[i]
            if self.store.contains(keys[i]) or not self.bm.blocks[block].exact:   # (a sparse decode's: not on disk)
                continue
            self.bm.hold(block)
            self.writer.submit(keys[i], self.kv.block(block), block)
        self._written[seq.seq_id] = full

    def poll(self) -> None:
        """Release the blocks whose writes were acknowledged."""
        for block in self.writer.acks():
            self.bm.release(block)

    def forget(self, seq: Sequence) -> None:
        self._keys.pop(seq.seq_id, None)
        self._written.pop(seq.seq_id, None)

    def metrics(self) -> dict:
        pages, nbytes = self.store.usage()
        return {"disk_pages": pages, "disk_bytes": nbytes, "disk_write_pending": self.writer.pending}

    def flush(self, timeout: float | None = None) -> None:
        self.writer.flush(timeout)
        self.poll()

    def close(self) -> None:
        self.writer.close()
        self.poll()
        self.store.close()


def open_tier(root: str, size_gb: float, identity: str, dtype: str, layout: tuple, kv, block_manager) -> DiskTier:
    """The disk KV tier in folder `root` ("default" = default_store_dir()) for KV of `identity` (model_identity),
    `dtype` and page `layout` (L, 2, Hkv, block_size, D), reading into and writing from `kv` (the runner)."""
    fmt = PageFormat(identity, dtype, layout)
    store = KVStore(default_store_dir() if root == "default" else root, fmt, int(size_gb * 2**30))
    return DiskTier(store, kv, block_manager)
