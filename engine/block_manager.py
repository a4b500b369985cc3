"""Paged KV blocks with a prefix cache.

A full block is keyed by a chained xxhash: hash(previous block's key, this block's token ids). Equal prefixes
give equal keys, so a second question about the same document finds the document's blocks already computed.
A freed block keeps its key and contents until it is handed out again, so the cache outlives the request.

New blocks come first from the never-cached free blocks, lowest id first (a fresh prompt gets consecutive
ids: in offload modes a layer's blocks then move in one copy), then from freed cached blocks, oldest first.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np
import xxhash

from engine.sequence import Sequence


def block_hash(token_ids: list[int], prefix: int = -1) -> int:
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    """`exact`: its KV is what a dense prefill computes (False once a sparse decode step wrote a token's KV into it:
    attention over a subset of the context; such a block is kept from the disk tier and from other policies)."""
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "exact")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count, self.hash, self.token_ids, self.exact = block_id, 0, -1, [], True


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.clean: list[int] = list(range(num_blocks))     # heap of free blocks without a cache key
        self.cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a key, in the order freed
        self.used_ids: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.clean) + len(self.cached)

    @property
    def num_used(self) -> int:
        return len(self.used_ids)

    def _take(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its old contents are about to be overwritten
        block.ref_count, block.hash, block.token_ids, block.exact = 1, -1, [], True
        self.cached.pop(block_id, None)  # a clean block is only ever taken from the top of the heap
        self.used_ids.add(block_id)
        return block

    def _new(self) -> Block:
        if self.clean:
            return self._take(heapq.heappop(self.clean))
        return self._take(next(iter(self.cached)))

    def _register(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.hash, block.token_ids = h, list(token_ids)
        self.hash_to_block[h] = block.block_id

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for the whole prompt; full blocks found in the prefix cache are shared, not recomputed.
        The block holding the last prompt token is always computed (its logits start the answer)."""
        assert not seq.block_table
        seq.num_cached_tokens = 0
        h, cache_open = -1, True
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = block_hash(tokens, h) if full else -1
            hit = self.hash_to_block.get(h, -1) if full else -1
            reusable = hit != -1 and self.blocks[hit].token_ids == tokens
            cache_open = cache_open and reusable and (i + 1) * self.block_size < len(seq)
            if cache_open:
                seq.num_cached_tokens += self.block_size
                if hit in self.used_ids:
                    self.blocks[hit].ref_count += 1
                    block = self.blocks[hit]
                else:
                    block = self._take(hit)
            else:
                block = self._new()
            if full:
                self._register(block, h, tokens)
            seq.block_table.append(block.block_id)

    def invalidate(self, seq: Sequence) -> None:
        """A prefill that did not finish (stopped, out of memory): the blocks it was computing hold no valid KV,
        so they must not be found by the prefix cache."""
        for block_id in seq.block_table[seq.num_cached_tokens // self.block_size:]:
            block = self.blocks[block_id]
            if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = -1, []

    def mark_inexact(self, seqs: list[Sequence]) -> None:
        """A sparse decode step wrote each sequence's newest token's KV (attention over a subset of the context)."""
        for seq in seqs:
            self.blocks[seq.block_table[(len(seq) - 1) // self.block_size]].exact = False

    def cached_ids(self) -> list[int]:
        """The blocks the prefix cache can hand out (in use or free), ascending."""
        return sorted(self.hash_to_block.values())

    def forget_cached(self, keep: dict[int, int] | None = None, inexact_only: bool = False) -> None:
        """Drop every prefix-cache key but those of `keep` (a copy of `hash_to_block` taken earlier) whose block
        still holds them (`inexact_only`: the keys of blocks that are not `exact`); blocks in use keep their
        contents, free ones without a key become clean."""
        keep = keep or {}
        for block in self.blocks:
            if block.hash != -1 and keep.get(block.hash) != block.block_id and not (inexact_only and block.exact):
                if self.hash_to_block.get(block.hash) == block.block_id:
                    del self.hash_to_block[block.hash]
                block.hash, block.token_ids = -1, []
                if block.block_id in self.cached:
                    del self.cached[block.block_id]
                    heapq.heappush(self.clean, block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in seq.block_table:  # in order: cached blocks are handed out again in ascending runs
            self.release(block_id)
        seq.block_table = []

    def hold(self, block_id: int) -> None:
        """One more reference to a block in use (the disk tier's writer, until its write is acknowledged)."""
        assert self.blocks[block_id].ref_count > 0
        self.blocks[block_id].ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at none the block is free (kept findable by the prefix cache when it has a key)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_ids.discard(block_id)
            if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
                self.cached[block_id] = None
            else:
                heapq.heappush(self.clean, block_id)

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of the last token (a new block only when the previous one is full)."""
        return self.num_free >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step writes the KV of token len-1: open a block if it starts one, and register
        the block just completed so later requests can reuse it (e.g. the next turn of a chat)."""
        if len(seq) % self.block_size == 1 and len(seq) > 1:
            full = self.blocks[seq.block_table[-1]]
            if full.hash == -1:
                prev = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else -1
                tokens = seq.block(len(seq.block_table) - 1)
                self._register(full, block_hash(tokens, prev), tokens)
            seq.block_table.append(self._new().block_id)
