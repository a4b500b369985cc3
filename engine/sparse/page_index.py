"""What Quest keeps of every key on the device to score pages with: `PageBounds` (the paper's key min/max per
page) or `KeySketch` (every key in a few leading dimensions). Both take a block's keys as they are written
(`write`) and score a sequence's pages for a query (`scores` -> [Hkv, G, n] per query head, -inf for no
candidate), which engine/ops/quest_select.py turns into the choice.

Why two. A page's min/max bound assumes every dimension of the query meets its extreme in one key: with post-RoPE
keys, whose rotating pairs reach both signs within a page, it overshoots the page's best logit several times over
(the default model, a needle's copy head: bound 32.9 where the needle's key scores 8.5, 38 pages bounded higher),
so it ranks pages by how spread their keys are more than by the query. The sketch keeps each key's coordinates in
the r leading directions of its layer's keys (per kv head, the span of the leading eigenvectors of their second
moment, found by subspace iteration: keys are low-rank, as Loki found) and scores a page by the largest of its
tokens' logits estimated there, q·k ≈ (qP)·(kP).
r values a token cost what the bounds cost at 16-token pages when r = head_dim / 8.
"""
from __future__ import annotations

import numpy as np
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

    def write(self, layer: int, block_ids: list[int], keys: torch.Tensor, start: int, end: int) -> None:
        """keys [n, Hkv, block_size, D] of blocks (laid end to end) whose tokens start..end-1 were just written: the
        bounds of the pages they complete (at decode: one page every page_size tokens; a prompt's blocks at once)."""
        ps = self.page_size
        first, last = start // ps, end // ps                             # pages first..last-1: complete and new
        if last <= first:
            return
        at = _rows(block_ids, first, last, self.pages_per_block, self.parts, self.kb.device)
        if keys.shape[0] == 1:                                           # one block (decode): only its new pages
            keys, first, last = keys[:, :, first * ps:last * ps], 0, last - first
        n, hkv, t, d = keys.shape
        parts = keys.unflatten(2, (t // ps, self.parts, ps // self.parts))        # [n, Hkv, page, part, token, D]
        stats = [parts.amin(dim=4), parts.amax(dim=4)] + ([parts.float().mean(dim=4).to(parts.dtype)]
                                                          if self.centroid else [])
        rows = torch.cat(stats, -1).permute(0, 2, 3, 1, 4).reshape(n * t // ps * self.parts, hkv, -1)
        rows = rows[first * self.parts:last * self.parts]                # [(last - first) * parts, Hkv, 2-3 D]
        if isinstance(at, int):
            self.kb[layer, at:at + rows.shape[0]] = rows
        else:
            self.kb[layer].index_copy_(0, at, rows)

    def forget(self) -> None:
        """Nothing learned beyond each page's own keys (a page's bounds are written again with its block)."""

    def prepare(self, layer: int) -> None:
        """Nothing to make before a layer's pages are scored."""

    def scores(self, layer: int, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor,
               live: torch.Tensor | None = None) -> torch.Tensor:
        return page_scores(self.kb[layer], q, pages, valid, self.parts, self.centroid, self.kernels, live)


class KeySketch:
    """Every key in the r leading directions of its layer's keys. A layer's basis comes from its first keys
    (up to CALIBRATION tokens: the prompt's; kept aside until then, or until the layer is first scored) and stays
    for the policy's life, so projections written earlier stay comparable with later ones, also for blocks back
    from the prefix cache or the disk tier. A page's score is one kernel on CUDA (engine/ops/quest_score.py:
    `sketch_scores`, captured in Quest's selection graph), a gather, a matmul and a max in torch on the CPU."""
    CALIBRATION = 4096

    def __init__(self, rank: int, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device, kernels: bool = False):
        """A key's row: its host block * block_size + its offset (the host pool's token rows). Stored head-major
        ([layer, Hkv, row, r]: a page's keys of one head are one contiguous run, which the score kernel reads per
        head; row-major, each row's r values of a head lay Hkv * r apart) and used as [row, Hkv, r] (`rows`)."""
        self.rank, self.page_size, self.block_size, self.kernels = min(rank, head_dim), page_size, block_size, kernels
        self.keys = torch.zeros(num_layers, num_kv_heads, num_blocks * block_size, self.rank, dtype=dtype,
                                device=device)
        self.basis = torch.zeros(num_layers, num_kv_heads, head_dim, self.rank, dtype=dtype, device=device)
        self.pending: list[list | None] = [[] for _ in range(num_layers)]   # (row, keys) before the basis; None after

    def write(self, layer: int, block_ids: list[int], keys: torch.Tensor, start: int, end: int) -> None:
        """keys [n, Hkv, block_size, D] of blocks (laid end to end) whose tokens start..end-1 were just written:
        those of the pages they complete, projected (kept aside while the layer's basis is not made yet). Only
        whole pages are ever scored, so a page's keys are projected once, when it completes (at decode: one page
        every page_size tokens, not a projection per token; a prompt's blocks in one matmul)."""
        ps = self.page_size
        first, last = start // ps * ps, end // ps * ps                   # the tokens of the pages completed
        if last <= first:
            return
        rows = _rows(block_ids, first, last, keys.shape[2], 1, self.keys.device)
        if keys.shape[0] == 1:                                           # one block (decode): only its new pages
            keys, first, last = keys[:, :, first:last], 0, last - first
        waiting = self.pending[layer]
        if waiting is None:
            n, hkv, t, _ = keys.shape
            projected = (keys.to(self.basis.dtype) @ self.basis[layer]).transpose(1, 2).reshape(n * t, hkv, -1)
            return self._put(layer, rows, projected[first:last])
        waiting.append((rows, keys.transpose(0, 1).flatten(1, 2)[:, first:last].clone()))     # [Hkv, tokens, D]
        if sum(k.shape[1] for _, k in waiting) >= self.CALIBRATION:
            self._calibrate(layer)

    def forget(self) -> None:
        """Every layer's basis is made again from the next keys written (a warm-up's throwaway prompt gave a
        basis that kept 81-92% of the energy of a real document's keys that the document's own basis keeps, on the
        default model). The keys projected so far are of blocks the engine dropped. The basis is zeroed in place
        (the selection graphs read it where it is)."""
        self.pending = [[] for _ in self.pending]
        self.basis.zero_()

    def prepare(self, layer: int) -> None:
        """Before a layer's pages are scored: its basis, if its keys are still kept aside (a prompt shorter than
        CALIBRATION). Called eagerly before a selection graph is replayed: a replay runs no Python, so a basis made
        inside `scores` would never be made again after `forget` (the warm-up's graphs would score with zeros)."""
        if self.pending[layer]:
            self._calibrate(layer)

    def _calibrate(self, layer: int) -> None:
        """The layer's basis from the first CALIBRATION keys kept aside (the leading eigenvectors of their second
        moment), then theirs stored."""
        waiting, self.pending[layer] = self.pending[layer], None
        k = torch.cat([keys for _, keys in waiting], dim=1)[:, :self.CALIBRATION].float()   # [Hkv, n, D]
        self.basis[layer] = leading_directions(k.transpose(1, 2) @ k, self.rank).to(self.basis.dtype)
        for rows, keys in waiting:
            self._put(layer, rows, (keys.to(self.basis.dtype) @ self.basis[layer]).transpose(0, 1))

    def _put(self, layer: int, rows: int | torch.Tensor, projected: torch.Tensor) -> None:
        """projected keys [n, Hkv, r] into `rows` (the first of n in a row, or one each)."""
        if isinstance(rows, int):
            self.rows(layer)[rows:rows + projected.shape[0]] = projected
        else:
            self.rows(layer).index_copy_(0, rows, projected)

    def rows(self, layer: int) -> torch.Tensor:
        """The layer's projected keys as [pool row, Hkv, r] (a view)."""
        return self.keys[layer].transpose(0, 1)

    def scores(self, layer: int, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor,
               live: torch.Tensor | None = None) -> torch.Tensor:
        """q [Hq, D], pool pages [n] -> each page's largest estimated logit per query head [Hkv, G, n] (float32),
        -inf where not `valid` (live: a device scalar, no candidate at or after it; the kernel reads nothing there)."""
        self.prepare(layer)                                                       # (direct calls: eager)
        hkv, d, _ = self.basis.shape[1:]
        qr = q.reshape(hkv, -1, d).to(self.basis.dtype) @ self.basis[layer]    # [Hkv, G, r]
        return sketch_scores(self.rows(layer), qr, pages, valid, self.page_size, self.kernels, live)


def leading_directions(m: torch.Tensor, r: int, passes: int = 24) -> torch.Tensor:
    """An orthonormal basis [B, D, r] of the span of the r leading eigenvectors of symmetric positive semi-definite
    m [B, D, D] (keys' second moments): subspace iteration, each pass a matmul and a Cholesky QR, in float64.
    torch.linalg.eigh took 13.5 ms a layer on the H100 (8 heads of 128) and waited for the device: a third of
    the prefill at 32K on the Qwen3-4B shape; this is ~150 small launches and no host sync, on CUDA one graph
    replay (captured once per shape: eager, the launches took ~4 ms a layer of host time for ~1 ms of GPU work,
    so a fresh Quest policy's first prompt took 140 ms longer on the default model's shape). The shift by a small
    multiple of I keeps the eigenvectors and the Gram matrices positive definite when the keys have rank < r.
    Passes: on the default model's keys 12 keep >= 99.7% of the energy the exact eigenvectors keep, but the
    eigenvalues around the r-th are close (ratios 1.02-1.18), so the span converges slowly there, and the H100's
    needle grid lost a near-tie cell at 12 that it keeps at 24 and 64, as with the exact basis (README, Quest).
    `tests/engine/test_quest_sketch.py` pins the subspace on a spectrum with a gap."""
    if not m.is_cuda or torch.cuda.is_current_stream_capturing():
        return _subspace(m, _start(m, r), passes)
    key = (tuple(m.shape), r, passes, m.device)
    if key not in _GRAPHS:
        with torch.inference_mode(False):                                # (updated in place in and out of it)
            m_in, q0 = torch.empty(m.shape, dtype=torch.float64, device=m.device), _start(m, r)
        m_in.copy_(m)
        _subspace(m_in, q0, passes)                                      # (its libraries' handles, before capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            q_out = _subspace(m_in, q0, passes)
        _GRAPHS[key] = graph, m_in, q0, q_out                           # (q0 too: the replays read it)
    graph, m_in, _, q_out = _GRAPHS[key]
    m_in.copy_(m)
    graph.replay()
    return q_out.clone()


_GRAPHS: dict[tuple, tuple] = {}   # (m's shape, r, passes, device) -> (graph, its input, its start, its output)


def _start(m: torch.Tensor, r: int) -> torch.Tensor:
    """The iteration's seeded start [D, r] (float64), made where m is (no host copy)."""
    seed = torch.Generator(m.device).manual_seed(0)
    return torch.randn(m.shape[-1], r, generator=seed, dtype=torch.float64, device=m.device)


def _subspace(m: torch.Tensor, q: torch.Tensor, passes: int) -> torch.Tensor:
    """leading_directions' passes from the start q [D, r] (float64)."""
    m = m.double()
    trace = m.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    m = m / (trace + 1e-30) + 1e-4 * eye
    q = q.expand(m.shape[0], -1, -1)
    for i in range(passes + 1):
        y = m @ q if i < passes else q                           # the last: q once more (Cholesky QR twice)
        chol, _info = torch.linalg.cholesky_ex(y.transpose(-1, -2) @ y)
        q = torch.linalg.solve_triangular(chol, y.transpose(-1, -2), upper=False).transpose(-1, -2)
    return q


def _rows(block_ids: list[int], first: int, last: int, per_block: int, parts: int, device: torch.device):
    """Pool rows of items first..last-1 (tokens or pages, per_block of them a block) of blocks laid end to end, each
    split in `parts` rows: the first row when they are consecutive (one block: decode's case, no index tensor),
    else an index tensor of every row (made on the host, sent from pinned memory: no host sync)."""
    if (first // per_block) == (last - 1) // per_block:
        return (block_ids[first // per_block] * per_block + first % per_block) * parts
    items = np.arange(first, last)
    base = np.asarray(block_ids, dtype=np.int64)[items // per_block] * per_block + items % per_block
    rows = torch.from_numpy((base[:, None] * parts + np.arange(parts)).ravel())
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows
