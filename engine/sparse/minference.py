"""MInference (Jiang et al., 2024), vertical-slash pattern: prefill attention on the columns and diagonals that matter.

Per query head, the last `last_q` queries (64) attend densely to all keys (causal); summing their attention
down each key column gives the column scores (vertical lines: keys every later query looks at), summing along
each diagonal offset d = query position - key position gives the diagonal scores (slash lines: relative
positions that matter). The top `vertical` columns and `slash` diagonals are kept, the first `sink` columns
and the `recent` nearest diagonals always. A budget of at most 1 is a fraction of the keys (adaptive; 1 = all),
otherwise a count. Below `min_len` keys the layer runs dense. The scores come from engine.ops.vs_estimate: two
Triton launches on CUDA, storing nothing of size last_q x Tk; elsewhere one kv head (its G query heads) at a time,
G x last_q x Tk floats (128 MiB at 128K tokens, G = 4).

The pattern runs in engine.ops.sparse_triton's kernel on CUDA and engine.ops.sparse_gather elsewhere,
both counting the pairs each head computed; the kept columns and diagonals and that density go to the trace per
(layer, head). Where running it would not pay, the layer runs dense and says why (engine/sparse/policy.py).
"""
from __future__ import annotations

import torch

from engine.ops.sparse_prefill import VerticalSlash, causal_pairs, vertical_slash_attention, vertical_slash_keep
from engine.ops.vs_estimate import vs_scores, vs_select
from engine.sparse.policy import SparsePrefillPolicy
from engine.sparse.specs import SPECS


class MInferencePolicy(SparsePrefillPolicy):
    spec = SPECS["minference"]

    def __init__(self, **params):
        p = self.spec.validate(params)
        super().__init__(p["min_len"], p["cpu_dense_above"], p["gpu_dense_above"])
        self.vertical, self.slash, self.last_q = p["vertical"], p["slash"], p["last_q"]
        self.sink, self.recent, self.block = p["sink"], p["recent"], p["block"]

    def budgets(self, tk: int) -> tuple[int, int]:
        """(vertical columns, slash diagonals) per head for tk keys, forced ones included."""
        def count(x, forced):
            n = int(x * tk) if x <= 1 else int(x)
            return max(min(forced, tk), min(n, tk))
        return count(self.vertical, self.sink), count(self.slash, self.recent)

    def least_density(self, tq: int, tk: int) -> float:
        """The fewest pairs the budgets can keep: the farthest diagonals (or columns), d = tk - j for j = 1..n,
        reach min(tq, j) queries each."""
        def reach(n):
            return sum(min(tq, j) for j in range(1, n + 1)) if n < 4 * tq else n * tq - tq * (tq - 1) // 2
        return max(reach(n) for n in self.budgets(tk)) / causal_pairs(tq, tk)

    @torch.no_grad()
    def estimate(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> VerticalSlash:
        """q [Tq, Hq, D] (the last Tq of Tk positions), k [Tk, Hkv, D] -> the pattern per query head."""
        tk = k.shape[0]
        scores = vs_scores(q, k, scale, min(self.last_q, q.shape[0]))
        nv, ns = self.budgets(tk)
        vertical, slash, reach = vs_select(scores, nv, ns, self.sink, self.recent, self.block, q.shape[0])
        return VerticalSlash(vertical, slash, self.block, reach)

    def kernel(self, q, k, v, pat: VerticalSlash, scale, skip=None):
        return vertical_slash_attention(q, k, v, pat, scale, skip)

    def pattern_density(self, pat: VerticalSlash, tq, tk):
        """About the share the pattern keeps (within a few percent): each distance t a slash run covers reaches
        min(tq, tk - t) queries, each vertical column c min(tq, tk - c) (overlaps counted twice)."""
        if pat.reach is not None:
            return (pat.reach.sum(dim=0).double().mean() / causal_pairs(tq, tk)).clamp(max=1.0)
        reach = torch.clamp(tk - torch.arange(tk, device=pat.slash.device), max=tq).float()
        runs = pat.covered(tk)[:, pat.block - 1:pat.block - 1 + tk].float() @ reach
        cols = reach[pat.vertical.long()].sum(dim=1)
        return ((runs + cols).mean().double() / causal_pairs(tq, tk)).clamp(max=1.0)

    def keep(self, pat: VerticalSlash, tq, tk):
        return vertical_slash_keep(pat, tq, tk)

    def record(self, recorder, layer, pat: VerticalSlash, density, n):
        recorder.mask_summaries(layer, pat.vertical, pat.slash, n, density)
