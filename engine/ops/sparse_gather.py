"""Sparse prefill off CUDA: only the kept (query, key) pairs are computed, so the work follows the density.

Both patterns become one table first (engine/ops/sparse_prefill.py: `vertical_slash_keep`, `block_sparse_keep`):
`keep` [Hq, nQB, Tk] bool, the keys a block of `block` query rows may see, cut at the block's last row; causality
applies per row on top. `gathered_attention` then computes each block's kept keys only (see its docstring), and
equals the references there (dense attention restricted to the same table); the pairs it counts are the pairs it
computed.

`keep_density` says beforehand what share of the causal pairs a table keeps: the policy runs dense above the
share where the gather stops paying (see engine/sparse/policy.py), and says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.attention import flash_cpu as _flash
from engine.ops.sparse_prefill import causal_pairs, kept_first

_CHUNK_FLOATS = 1 << 22    # one batch's scores: 16 MiB of fp32


def keep_density(keep: torch.Tensor, block: int, tq: int, tk: int) -> float:
    """Share of the causal pairs the table keeps, counting each kept key for every row of its block (an upper
    bound: the rows of a block's own diagonal see fewer)."""
    rows = torch.full((keep.shape[1],), block, dtype=torch.float64)
    rows[-1] = tq - block * (keep.shape[1] - 1)
    kept = (keep.sum(dim=-1, dtype=torch.int32).double() * rows).sum()    # (an int32 sum: ~3x faster on a CPU)
    return float(kept) / (keep.shape[0] * causal_pairs(tq, tk))


def _chunks(counts: list[int], block: int) -> list[tuple[int, int, int]]:
    """Consecutive items (sorted by count) batched while their padded scores fit a chunk: (first, end, n)."""
    out, first = [], 0
    for i in range(1, len(counts) + 1):
        if i == len(counts) or (i - first + 1) * block * counts[i] > _CHUNK_FLOATS:
            out.append((first, i, counts[i - 1]))
            first = i
    return out


def _whole_blocks(qf, kf, vf, blocks, hs, ms, item, earlier, g: int, span: int, first: int, scale: float,
                  of) -> None:
    """gathered_attention's items (h, m) of a block-sparse pattern whose prompt starts at a block boundary: the
    earlier kept blocks and the own block of each, gathered as whole blocks into one fused call, the own block's
    columns causal by one mask all items share. Items are grouped by their count of earlier blocks, so that none is
    padded (a padded item would need a mask of its own per row). Against two calls (the earlier keys, padded; the
    own block, causal) merged by their log-sum-exp, on three real layers of a 7K prefill on a 2-core CPU
    (XAttention, density 0.15-0.24; medians of 8, alternating, two sessions): 0-10% less time a layer, ~3% on
    average, inside this host's spread of ~5%. qf / of: q and the output as [Hq * nQB, (1,) B, D], an item's row
    h * nQB + m (`item`)."""
    if not len(hs):
        return
    block, d = qf.shape[-2:]
    kb, vb = kf.view(-1, block, d), vf.view(-1, block, d)            # [Hkv * span / block, block, D]
    tri = torch.zeros(block, block, device=qf.device).masked_fill_(
        torch.ones(block, block, dtype=torch.bool, device=qf.device).triu(1), float("-inf"))
    counts, sizes = torch.unique_consecutive(earlier // block, return_counts=True)   # (sorted ascending)
    base = (hs // g) * (span // block)                                # the item's kv head's first block
    ids = kept_first(blocks[hs, ms], max(1, int(counts[-1])))[1].long() + base[:, None]   # earlier blocks first
    own = (base + first + ms)[:, None]
    a = 0
    for c, size in zip(counts.tolist(), sizes.tolist()):
        mask = torch.cat([tri.new_zeros(block, c * block), tri], dim=1)[None, None]   # [1, 1, B, (c + 1) B]
        per_call = max(1, _CHUNK_FLOATS // ((c + 1) * block * d))
        for a0 in range(a, a + size, per_call):
            b0 = min(a + size, a0 + per_call)
            cols = torch.cat([ids[a0:b0, :c], own[a0:b0]], dim=1).flatten()
            ke, ve = (x.index_select(0, cols).view(b0 - a0, 1, (c + 1) * block, d) for x in (kb, vb))
            o = _flash(qf.index_select(0, item[a0:b0]), ke, ve, scale, mask)[0]
            of.index_copy_(0, item[a0:b0], o[:, 0])
        a += size


@torch.no_grad()
def gathered_attention(q, k, v, keep: torch.Tensor, block: int, scale: float, blocks: torch.Tensor | None = None):
    """q [Tq, Hq, D] (the last Tq of Tk positions), k/v [Tk, Hkv, D], keep [Hq, nQB, Tk] ->
    ([Tq, Hq, D], pairs computed per head [Hq] int64). blocks [Hq, nQB, ceil(Tk / block)] bool: the block table
    `keep` was made from, where there is one (a block-sparse pattern): where the prompt starts at a block boundary,
    each (head, query block) with its own block kept is then one fused call over its earlier kept blocks and its own
    block, gathered as whole blocks (`_whole_blocks`).

    Otherwise a (head, query block) whose own rows' keys are all kept (the usual case: the newest diagonal, the
    diagonal block) is two attentions merged by their log-sum-exp: its earlier kept keys, gathered ([n, D], padding
    masked by one row: every row sees them all, so no per-row mask), and its own keys, causal. All heads' blocks
    go in one list sorted by count and cut in batches, so little is padded and a layer makes a few calls. The
    ragged last block goes with them, its rows padded to a whole block (a padded row sees only its own padded keys,
    causally, and is dropped). Any other block (a pattern without the newest diagonal) gets its exact [rows, n]
    mask."""
    (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
    g, nqb, dev = hq // hkv, keep.shape[1], q.device
    off, ninf = tk - tq, float("-inf")
    rows = torch.clamp(tq - torch.arange(nqb, device=dev) * block, max=block)
    qa = F.pad(q.float(), (0, 0, 0, 0, 0, nqb * block - tq)).transpose(0, 1).reshape(hq, nqb, 1, block, d)
    span = -(-(tk + 1) // block) * block                                                   # Tk + pads, whole blocks
    kf, vf = (F.pad(x.float().transpose(0, 1), (0, 0, 0, span - tk)).reshape(-1, d) for x in (k, v))  # [Hkv*span, D]
    out = torch.empty(hq, nqb, block, d, dtype=torch.float32, device=dev)   # (a block with no key: zeros, below)
    qf, of = qa.reshape(hq * nqb, 1, block, d), out.view(hq * nqb, block, d)  # (items gathered by their rows)
    pairs = torch.zeros(hq, dtype=torch.int64, device=dev)
    counts = keep.sum(dim=-1, dtype=torch.int32)                                            # [Hq, nQB]
    own_pos = off + torch.arange(nqb, device=dev)[:, None] * block + torch.arange(block, device=dev)  # [nQB, B]
    own_kept = keep.gather(2, own_pos.clamp(max=tk - 1)[None].expand(hq, -1, -1)).all(dim=-1)      # [Hq, nQB]
    hs, ms = own_kept.nonzero(as_tuple=True)
    earlier = counts[hs, ms] - rows[ms]                                # (a block's own kept keys: its rows)
    order = earlier.argsort()
    hs, ms, earlier = hs[order], ms[order], earlier[order]
    item = hs * nqb + ms
    whole = blocks is not None and off % block == 0
    if whole:
        _whole_blocks(qf, kf, vf, blocks, hs, ms, item, earlier, g, span, off // block, scale, of)
    for a, b, n in [] if whole else _chunks(earlier.tolist(), block):
        h, m, base = hs[a:b], ms[a:b], (hs[a:b] // g) * span
        qb = qf.index_select(0, item[a:b])
        if off % block == 0:                                                 # own keys: whole blocks of K
            own = (base // block + off // block + m)
            ko, vo = (x.view(-1, block, d).index_select(0, own)[:, None] for x in (kf, vf))
        else:
            own = (base[:, None] + own_pos[m].clamp(max=tk)).flatten()         # (position tk: a zero pad)
            ko, vo = (x.index_select(0, own).view(-1, 1, block, d) for x in (kf, vf))
        o, lse = _flash(qb, ko, vo, scale, causal=True)
        if n > 0:
            idx = (base[:, None] + kept_first(keep[h, m], n, fill=span - 1)[1].long()).flatten()
            ke, ve = (x.index_select(0, idx).view(-1, 1, n, d) for x in (kf, vf))
            pad = torch.zeros(b - a, 1, 1, n, device=dev).masked_fill_(
                torch.arange(n, device=dev) >= earlier[a:b, None, None, None], ninf)
            o2, lse2 = _flash(qb, ke, ve, scale, pad)
            lse2.masked_fill_((earlier[a:b] == 0)[:, None, None], ninf)           # a block with no earlier key
            o2.nan_to_num_(0.0)
            o = torch.lerp(o, o2, torch.sigmoid(lse2 - lse)[..., None])           # = (o e^lse + o2 e^lse2) / sum
        of.index_copy_(0, item[a:b], o[:, 0])
    r = rows[ms]
    pairs.index_add_(0, hs, earlier * r + r * (r + 1) // 2)
    for h, m in (~own_kept & (counts > 0)).nonzero().tolist():                              # exact mask, one block
        idx = kept_first(keep[h, m:m + 1], int(counts[h, m]), fill=span - 1)[1][0].long() + (h // g) * span
        mask = (idx[None] - (h // g) * span) <= own_pos[m][:, None]                         # pads never pass
        out[h, m] = F.scaled_dot_product_attention(qa[h, m], kf[idx][None], vf[idx][None], attn_mask=mask[None],
                                                   scale=scale).nan_to_num_(0.0)[0]
        pairs[h] += int(mask[:int(rows[m])].sum())
    out[counts == 0] = 0.0
    return out.flatten(1, 2)[:, :tq].transpose(0, 1).to(q.dtype), pairs.cpu()
