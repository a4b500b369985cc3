"""What Quest keeps of every key on the device to score pages with: `PageBounds` (the paper's key min/max per
page) or `KeySketch` (every key in a few leading dimensions). Both take a block's keys as they are written
(`write`) and score a sequence's pages for a query (`scores` -> [Hkv, G, n] per query head, -inf for no
candidate), which engine/ops/quest_select.py turns into the choice.

Why two. A page's min/max bound assumes every dimension of the query meets its extreme in one key: with post-RoPE
keys, whose rotating pairs reach both signs within a page, it overshoots the page's best logit several times over
(the default model, a needle's copy head: bound 32.9 where the needle's key scores 8.5, 38 pages bounded higher),
so it ranks pages by how spread their keys are more than by the query. The sketch keeps each key's coordinates in
the r leading directions of its layer's keys (per kv head, the eigenvectors of their second moment: keys are
low-rank, as Loki found) and scores a page by the largest of its tokens' logits estimated there, q·k ≈ (qP)·(kP).
r values a token cost what the bounds cost at 16-token pages when r = head_dim / 8.
"""
from __future__ import annotations

import torch

from engine.ops.quest_score import page_scores, sketch_scores


class PageBounds:
    """Per layer, pool page part (`parts` per page, page_size / parts tokens each) and kv head: the keys'
    element-wise [min | max] (no bounds yet: +inf | -inf), with `centroid` their mean after them. A page scores
    by its bound of q·k, the largest of its parts' (engine/ops/quest_score.py: one kernel on CUDA)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 page_size: int, parts: int, centroid: bool, dtype: torch.dtype, device: torch.device, kernels: bool):
        d = head_dim
        self.page_size, self.parts, self.centroid, self.kernels = page_size, parts, centroid, kernels
        self.pages_per_block = block_size // page_size
        self.kb = torch.zeros(num_layers, num_blocks * self.pages_per_block * parts, num_kv_heads,
                              (3 if centroid else 2) * d, dtype=dtype, device=device)
        self.kmin, self.kmax = self.kb[..., :d], self.kb[..., d:2 * d]
        self.kmin.fill_(float("inf"))
        self.kmax.fill_(float("-inf"))

    def write(self, layer: int, block_id: int, keys: torch.Tensor, start: int, end: int) -> None:
        """keys [Hkv, block_size, D] of a block whose tokens start..end-1 were just written: the bounds of the
        pages they complete (at decode: one page every page_size tokens)."""
        ps = self.page_size
        first, last = start // ps, end // ps                             # pages first..last-1: complete and new
        if last <= first:
            return
        hkv, _, d = keys.shape
        n = (last - first) * self.parts                                  # bounds to write: the pages' parts
        parts = keys[:, first * ps:last * ps].reshape(hkv, n, ps // self.parts, d)
        stats = [parts.amin(dim=2), parts.amax(dim=2)] + ([parts.float().mean(dim=2).to(parts.dtype)]
                                                          if self.centroid else [])
        at = (block_id * self.pages_per_block + first) * self.parts
        self.kb[layer, at:at + n] = torch.cat(stats, -1).transpose(0, 1)

    def scores(self, layer: int, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return page_scores(self.kb[layer], q, pages, valid, self.parts, self.centroid, self.kernels)


class KeySketch:
    """Every key in the r leading directions of its layer's keys. A layer's basis comes from its first keys
    (up to CALIBRATION tokens: the prompt's; kept aside until then, or until the layer is first scored) and stays
    for the policy's life, so projections written earlier stay comparable with later ones, also for blocks back
    from the prefix cache or the disk tier. A page's score is one kernel on CUDA (engine/ops/quest_score.py:
    `sketch_scores`, captured in Quest's selection graph), a gather, a matmul and a max in torch on the CPU."""
    CALIBRATION = 4096

    def __init__(self, rank: int, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device, kernels: bool = False):
        """A key's row: its host block * block_size + its offset (the host pool's token rows)."""
        self.rank, self.page_size, self.block_size, self.kernels = min(rank, head_dim), page_size, block_size, kernels
        self.keys = torch.zeros(num_layers, num_blocks * block_size, num_kv_heads, self.rank, dtype=dtype,
                                device=device)
        self.basis = torch.zeros(num_layers, num_kv_heads, head_dim, self.rank, dtype=dtype, device=device)
        self.pending: list[list | None] = [[] for _ in range(num_layers)]   # (row, keys) before the basis; None after

    def write(self, layer: int, block_id: int, keys: torch.Tensor, start: int, end: int) -> None:
        """keys [Hkv, block_size, D] of a block whose tokens start..end-1 were just written: those of the pages
        they complete, projected (kept aside while the layer's basis is not made yet). Only whole pages are ever
        scored, so a page's keys are projected once, when it completes (at decode: one page every page_size
        tokens, not a projection per token)."""
        ps = self.page_size
        first, last = start // ps * ps, end // ps * ps                   # the tokens of the pages completed
        if last <= first:
            return
        keys, row = keys[:, first:last], block_id * self.block_size + first
        waiting = self.pending[layer]
        if waiting is None:
            return self._store(layer, row, keys)
        waiting.append((row, keys.clone()))
        if sum(k.shape[1] for _, k in waiting) >= self.CALIBRATION:
            self._calibrate(layer)

    def _calibrate(self, layer: int) -> None:
        """The layer's basis from the keys kept aside (the eigenvectors of their second moment), then theirs."""
        waiting, self.pending[layer] = self.pending[layer], None
        k = torch.cat([keys for _, keys in waiting], dim=1).float()                # [Hkv, n, D]
        vectors = torch.linalg.eigh(k.transpose(1, 2) @ k).eigenvectors            # ascending eigenvalues
        self.basis[layer] = vectors[..., -self.rank:].to(self.basis.dtype)
        for row, keys in waiting:
            self._store(layer, row, keys)

    def _store(self, layer: int, row: int, keys: torch.Tensor) -> None:
        """keys [Hkv, n, D], projected on the layer's basis, into rows row .. row + n - 1."""
        self.keys[layer, row:row + keys.shape[1]] = (keys.to(self.basis.dtype) @ self.basis[layer]).transpose(0, 1)

    def scores(self, layer: int, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q [Hq, D], pool pages [n] -> each page's largest estimated logit per query head [Hkv, G, n] (float32),
        -inf where not `valid`."""
        if self.pending[layer]:                                                   # (a prompt shorter than CALIBRATION)
            self._calibrate(layer)
        hkv, d, _ = self.basis.shape[1:]
        qr = q.reshape(hkv, -1, d).to(self.basis.dtype) @ self.basis[layer]    # [Hkv, G, r]
        return sketch_scores(self.keys[layer], qr, pages, valid, self.page_size, self.kernels)
