"""Sparse prefill off CUDA: only the kept (query, key) pairs are computed, so the work follows the density.

A block-sparse pattern (XAttention) whose prompt starts at a block boundary goes straight from its block table:
`gathered_blocks` moves whole blocks of K and V, and `block_keep_density` reads its share of the pairs from the
table. Any other pattern becomes one table first (engine/ops/sparse_prefill.py: `vertical_slash_keep`,
`block_sparse_keep`): `keep` [Hq, nQB, Tk] bool, the keys a block of `block` query rows may see, cut at the block's
last row; causality applies per row on top, and `gathered_attention` computes each block's kept keys only. Both
equal the references there (dense attention restricted to the same pattern); the pairs they count are the pairs
they computed.

`keep_density` / `block_keep_density` say beforehand what share of the causal pairs a pattern keeps: the policy runs
dense above the share where the gather stops paying (see engine/sparse/policy.py), and says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.attention import flash_cpu as _flash
from engine.ops.sparse_prefill import causal_pairs, kept_first

_CHUNK_FLOATS = 1 << 22    # one batch's scores: 16 MiB of fp32
_CALL_FLOATS = 1 << 20     # the K (and the V) one fused call of `gathered_blocks` gathers: 4 MiB of fp32 each (three
#                            real 7K layers, 2^18-2^22 tried: 2^20 1-8% faster than 2^22, the cache keeps them)


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


def block_keep_density(blocks: torch.Tensor, block: int, tq: int, tk: int) -> float:
    """`keep_density` of `block_sparse_keep(blocks, ...)` from the block table alone [Hq, nQB, nKB] (no [Hq, nQB,
    Tk] table made): a kept block counts its keys up to its query block's last row, for every row of the block."""
    nqb, nkb, dev = blocks.shape[1], blocks.shape[2], blocks.device
    rows = torch.clamp(tq - torch.arange(nqb, device=dev) * block, max=block)
    last = (tk - tq) + torch.clamp(torch.arange(1, nqb + 1, device=dev) * block, max=tq)     # one past the last row
    keys = torch.clamp(last[:, None] - torch.arange(nkb, device=dev)[None] * block, 0, block)  # [nQB, nKB]
    keys = torch.minimum(keys, tk - torch.arange(nkb, device=dev)[None] * block)             # a ragged last key block
    kept = (blocks.sum(dim=0, dtype=torch.int32) * keys).sum(dim=1).double() @ rows.double()
    return float(kept) / (blocks.shape[0] * causal_pairs(tq, tk))


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [H, T, D] as a new contiguous [H, n, D], rows T.. zero (F.pad would write zeros over all of it first)."""
    out = x.new_empty(x.shape[0], n, x.shape[2])
    out[:, :x.shape[1]] = x
    out[:, x.shape[1]:] = 0
    return out


@torch.no_grad()
def gathered_blocks(q, k, v, blocks: torch.Tensor, block: int, scale: float):
    """A block-sparse pattern's attention, kept pairs only: q [Tq, Hq, D] (the last Tq of Tk positions), k/v [Tk,
    Hkv, D], blocks [Hq, nQB, nKB] bool -> ([Tq, Hq, D], pairs computed per head [Hq] int64), or None where the
    prompt does not start at a block boundary or a query block's own (diagonal) block is not kept (then
    `gathered_attention` over `block_sparse_keep`). XAttention's tables always keep it.

    Each (head, query block) is one item: its earlier kept blocks and its own block, gathered as whole blocks of K
    and V into one fused call, the own block's columns causal by one mask all items of a call share. Items are
    grouped by their count of earlier blocks, so none is padded (a padded item would need a mask of its own per
    row). The last query block's rows are padded to a whole block (a padded row sees only the own block's padded
    keys and is dropped). Nothing of size [Hq, nQB, Tk] is made (on three real layers of a 7K prefill on a 2-core CPU
    the keep table, its counts and its density had cost ~8 ms a layer of ~110). q and the output go through a
    head-major copy, whose items move as whole [B, D] rows: 2-10% faster than reading and writing them in place by
    (block, head), 256 bytes at a time. (Against two calls, the earlier keys padded and the own block causal,
    merged by their log-sum-exp: 0-10% less time a layer, ~3% on average.)"""
    (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
    off = tk - tq
    nqb, nkb, dev = -(-tq // block), -(-tk // block), q.device
    m = torch.arange(nqb, device=dev)
    first = off // block
    if off % block or blocks.shape[1:] != (nqb, nkb) or not bool(blocks[:, m, first + m].all()):
        return None
    g, dtype = hq // hkv, q.dtype
    q, k, v = q.float(), k.float(), v.float()
    earlier_tab = blocks & (torch.arange(nkb, device=dev)[None] < (first + m)[:, None])    # [Hq, nQB, nKB]
    earlier = earlier_tab.sum(dim=-1, dtype=torch.int32).flatten()                       # per item h * nQB + m
    earlier, item = earlier.sort(stable=True)
    hs, ms = item // nqb, item % nqb
    counts, sizes = torch.unique_consecutive(earlier, return_counts=True)                # (ascending)
    kb, vb = (_padded(x.transpose(0, 1), nkb * block).view(hkv * nkb, block, d) for x in (k, v))
    base = (hs // g) * nkb                                                               # the item's kv head
    ids = kept_first(earlier_tab.flatten(0, 1)[item], max(1, int(counts[-1])))[1].long() + base[:, None]
    own = base + first + ms
    qh = _padded(q.transpose(0, 1), nqb * block).view(hq * nqb, block, d)        # head-major, whole blocks
    oh = torch.empty(hq * nqb, block, d, dtype=torch.float32, device=dev)
    tri = torch.zeros(block, block, device=dev).masked_fill_(
        torch.ones(block, block, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    most = max(int(counts[-1]) + 1, _CALL_FLOATS // (block * d))        # the most blocks one call gathers
    kbuf, vbuf = (torch.empty(most, block, d, device=dev) for _ in range(2))   # one buffer a layer: 2-4% less time
    #                                                                            than a new tensor per call
    a = 0
    for c, size in zip(counts.tolist(), sizes.tolist()):
        mask = torch.cat([tri.new_zeros(block, c * block), tri], dim=1)[None, None]        # [1, 1, B, (c + 1) B]
        per_call = max(1, _CALL_FLOATS // ((c + 1) * block * d))
        for a0 in range(a, a + size, per_call):
            b0 = min(a + size, a0 + per_call)
            cols = torch.cat([ids[a0:b0, :c], own[a0:b0, None]], dim=1).flatten()
            ke, ve = (torch.index_select(x, 0, cols, out=buf[:len(cols)]).view(b0 - a0, 1, (c + 1) * block, d)
                      for x, buf in ((kb, kbuf), (vb, vbuf)))
            it = item[a0:b0]                                                               # h * nQB + m
            oh.index_copy_(0, it, _flash(qh.index_select(0, it)[:, None], ke, ve, scale, mask)[0][:, 0])
        a += size
    rows = torch.clamp(tq - m * block, max=block)[ms].long()
    pairs = torch.zeros(hq, dtype=torch.int64, device=dev)
    pairs.index_add_(0, hs, earlier.long() * block * rows + rows * (rows + 1) // 2)
    out = oh.view(hq, nqb * block, d)[:, :tq].transpose(0, 1).contiguous()
    return out.to(dtype), pairs.cpu()


@torch.no_grad()
def gathered_attention(q, k, v, keep: torch.Tensor, block: int, scale: float):
    """q [Tq, Hq, D] (the last Tq of Tk positions), k/v [Tk, Hkv, D], keep [Hq, nQB, Tk] ->
    ([Tq, Hq, D], pairs computed per head [Hq] int64). (A block-sparse pattern at a block boundary takes
    `gathered_blocks`, whole blocks, instead.)

    A (head, query block) whose own rows' keys are all kept (the usual case: the newest diagonal, the
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
    for a, b, n in _chunks(earlier.tolist(), block):
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
