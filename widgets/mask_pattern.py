"""Sparse prefill masks as pictures: which (query, key) pairs a policy computed, binned to a small grid (numpy only).

A `MaskSummary` (engine/trace/events.py) of one (layer, query head) is turned into two [R, C] arrays over token
bins (rows = query positions, columns = key positions, at most MAX_BINS each): `kept`, the pairs computed in each
cell, and `causal`, the causal pairs the cell holds (0 above the diagonal). kept / causal is the cell's density;
over the whole grid it is the policy's recorded density (exact while every query row is sampled, i.e. up to
MAX_ROWS computed rows; beyond that, evenly spaced rows stand for their neighbours).

The patterns are the kernels' (engine/ops/sparse_prefill.py). Queries are the last Tq of the n keys (offset =
n - Tq: rows before it came from the prefix cache and are empty here); a query block holds BM rows from m0.
- MInference (vertical, slash): (row r, key c) is computed iff c <= r and (m0 - c lies in some [d - BM + 1, d]
  for a slash diagonal d, or c is a vertical column). BM is the policy's default block (64); the summary does
  not record it.
- XAttention (image): the recorded picture of kept key blocks, binned by an integer factor f (rows: query blocks,
  columns: key blocks of B tokens); one picture cell spans f*B tokens, inferred from its width and n. A cell's
  value / 255 is the share of its blocks kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.trace.events import MaskSummary, StepTrace

MAX_BINS = 256       # grid rows and columns at most
MAX_ROWS = 1024      # query rows evaluated at most (all of them below this)
VS_BLOCK = 64        # MInferencePolicy's default block (BM)
XA_IMAGE = 128       # XAttentionPolicy's picture size at most (its _IMAGE)
MINFERENCE, XATTENTION = "minference", "xattention"
MEAN_HEADS = -1       # a head index that stands for all the heads: their mean, or their sum
NAMES = {MINFERENCE: "MInference", XATTENTION: "XAttention"}


def kind_of(m: MaskSummary) -> str:
    return XATTENTION if m.image is not None else MINFERENCE


def bin_edges(n: int, max_bins: int = MAX_BINS) -> np.ndarray:
    """Token boundaries of min(n, max_bins) bins of (nearly) equal width: strictly increasing, 0 .. n."""
    k = max(1, min(n, max_bins))
    return (np.arange(k + 1, dtype=np.int64) * n) // k


def sample_rows(n: int, offset: int, max_rows: int = MAX_ROWS) -> np.ndarray:
    """The query rows evaluated: all of offset .. n-1, or max_rows of them evenly spaced."""
    if n - offset <= max_rows:
        return np.arange(offset, n, dtype=np.int64)
    return np.unique(np.linspace(offset, n - 1, max_rows).round().astype(np.int64))


def _grid(rows: np.ndarray, edges: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum per-row counts [len(rows), C] into row bins; the causal pairs of each (row, column bin) likewise."""
    lo, hi = edges[:-1][None], np.minimum(edges[1:][None], rows[:, None] + 1)
    causal_rows = np.clip(hi - lo, 0, None)
    rb = np.searchsorted(edges, rows, side="right") - 1                   # rows are sorted: runs of equal bins
    starts = np.flatnonzero(np.r_[True, rb[1:] != rb[:-1]])
    kept_g, causal_g = np.zeros((len(edges) - 1,) * 2), np.zeros((len(edges) - 1,) * 2)
    kept_g[rb[starts]] = np.add.reduceat(kept, starts, axis=0)
    causal_g[rb[starts]] = np.add.reduceat(causal_rows, starts, axis=0)
    return kept_g, causal_g


def vertical_slash_cells(vertical, slash, n: int, offset: int, edges: np.ndarray,
                         block: int = VS_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(kept, causal) [R, R] of MInference's kernel pattern over the bins `edges`."""
    v = np.unique(np.asarray(vertical, dtype=np.int64).ravel())
    d = np.asarray(slash, dtype=np.int64).ravel()
    d = d[(d >= 0) & (d < n)]
    # covered[i]: offset t = m0 - c (i = t + block - 1) lies in a diagonal's run [d - block + 1, d]
    diff = np.bincount(d, minlength=n + 2 * block + 1) - np.bincount(d + block, minlength=n + 2 * block + 1)
    covered = np.cumsum(diff)[:n + block] > 0
    cum = np.concatenate([[0], np.cumsum(covered)])
    rows = sample_rows(n, offset)
    m0 = offset + (rows - offset) // block * block
    lo, hi = edges[:-1][None], np.minimum(edges[1:][None], rows[:, None] + 1)
    hi = np.maximum(hi, lo)                                               # above the diagonal: empty ranges
    runs = cum[m0[:, None] - lo + block] - cum[m0[:, None] - hi + block]  # run keys in [lo, hi)
    v = v[(v >= 0) & (v < n)]
    alone = (v[None] <= rows[:, None]) & ~covered[np.clip(m0[:, None] - v[None] + block - 1, 0, n + block - 1)]
    vb = np.searchsorted(edges, v, side="right") - 1
    ri, vi = np.nonzero(alone)
    c = len(edges) - 1
    verts = np.bincount(ri * c + vb[vi], minlength=len(rows) * c).reshape(len(rows), c)
    return _grid(rows, edges, runs + verts)


def block_unit(n: int, cols: int) -> int:
    """Tokens per picture column of an XAttention mask over n keys: f*B for the block B (a power of two) and
    binning factor f that give `cols` columns (ceil(n / cols) if none does)."""
    b = 16
    while b < 2 * max(n, 16):
        nkb = -(-n // b)
        f = max(1, -(-nkb // XA_IMAGE))
        if -(-nkb // f) == cols:
            return f * b
        b *= 2
    return max(1, -(-n // cols))


def block_cells(image, n: int, offset: int, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept, causal) [R, R] of XAttention's recorded block picture over the bins `edges`."""
    img = np.asarray(image, dtype=np.float64)
    if img.max(initial=0) > 1.0:
        img = img / 255.0
    unit = block_unit(n, img.shape[1])
    rows = sample_rows(n, offset)
    w = img[np.clip((rows - offset) // unit, 0, img.shape[0] - 1)]         # [S, cols]: each row's picture row
    acc = np.concatenate([np.zeros((len(rows), 1)), np.cumsum(w, axis=1)], axis=1) * unit

    def kept_before(x):                                                   # kept keys in [0, x), x [S, C]
        j = np.minimum(x // unit, img.shape[1] - 1)
        return np.take_along_axis(acc, j, axis=1) + (x - j * unit) * np.take_along_axis(w, j, axis=1)
    lo = np.broadcast_to(edges[:-1][None], (len(rows), len(edges) - 1))
    hi = np.maximum(np.minimum(edges[1:][None], rows[:, None] + 1), lo)
    return _grid(rows, edges, kept_before(hi) - kept_before(lo))


@dataclass
class PrefillMasks:
    """The masks of one prefill step, by (layer, head) (a batch of several sequences shows its first)."""
    step: int
    kind: str
    n: int                       # keys (prompt tokens)
    offset: int                  # prompt tokens from the prefix cache (query rows start here)
    masks: dict[tuple[int, int], MaskSummary]
    layers: list[int] = field(default_factory=list)
    n_heads: int = 0

    @classmethod
    def from_step(cls, step: StepTrace) -> PrefillMasks | None:
        if not step.masks:
            return None
        masks: dict[tuple[int, int], MaskSummary] = {}
        for m in step.masks:
            masks.setdefault((m.layer, m.head), m)
        first = step.masks[0]
        n = int(first.n)
        offset = n - step.n_tokens if 0 < step.n_tokens <= n else 0
        return cls(step.step, kind_of(first), n, offset, masks, sorted({k[0] for k in masks}),
                   1 + max(k[1] for k in masks))

    def heads(self, layer: int, head: int = -1) -> list[MaskSummary]:
        """The masks of `layer`: every head's (head -1), or the one head's (none if it was not recorded)."""
        hs = range(self.n_heads) if head < 0 else [head]
        return [self.masks[(layer, h)] for h in hs if (layer, h) in self.masks]

    def layer_density(self, layer: int) -> float:
        return float(np.mean([m.density for m in self.heads(layer)]))

    def cells(self, layer: int, head: int, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(kept, causal) of one head, or summed over the heads for head -1."""
        r = len(edges) - 1
        kept, causal = np.zeros((r, r)), np.zeros((r, r))
        for m in self.heads(layer, head):
            if m.image is not None:
                k, c = block_cells(m.image, self.n, self.offset, edges)
            else:
                k, c = vertical_slash_cells(m.vertical, m.slash, self.n, self.offset, edges)
            kept, causal = kept + k, causal + c
        return kept, causal
