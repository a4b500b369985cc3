"""The sparse-policy interface (DESIGN.md §2.3) and the dense baseline every policy is compared to.

A policy decides; a runner executes. The runners call these hooks and know nothing of any policy:

- `prefill_attention(q, k, v, layer, scale, ctx)`: a layer's prefill attention over its whole K, V (compute
  policies: MInference, XAttention). The default is dense causal attention.
- `on_kv_written(layer, block_ids, keys, start, end)`: tokens start..end-1 of host blocks laid end to end were
  written (the ones before are unchanged), and their post-RoPE keys [n, Hkv, block_size, D] are on the device
  until the hook returns (metadata: Quest's page index). Called for every block a step writes to, the one being
  filled included (a prompt's completed blocks in one call per layer), and for blocks read from the disk tier
  (keys copied up for it); only for policies that `plans_loads` (the others keep no metadata of the keys).
- At decode, for policies with `plans_loads`: `plan_load(layer, context_len, ctx)` says which of the layer's
  tokens to bring to the device for a step whose sequence has context_len tokens (a `LoadPlan`, or None for
  all of them). Loads run ahead of the query, so a plan is made from an earlier query; `observe_query(layer, q,
  ctx)` then shows the policy the layer's own query before its attention, and may return a `RowFix` that
  corrects what was loaded (Quest fetches the pages the query chooses that the plan lacked). Layerwise mode
  also shows it the prompt's last query of each layer at prefill (it chooses the first decode step's pages),
  and, to policies that `look_ahead`, a guess of the next layer's query made from this layer's input:
  `observe_ahead(layer, q, ctx)` may return a `RowFix` that the runner fetches on the copy stream, ahead of
  that layer.
- `stage_step()` before the sampler's sync and `end_step(ctx)` after it, once per step; `step_metrics()`: figures
  of the step that just ran, for its trace.

A policy reports what it decided to `ctx.recorder`; it never touches a stream, a ring slot or the host pool.
Its parameters are declared in engine/sparse/specs.py (`spec`), validated there before it is made.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.ops.attention import causal_attention
from engine.ops.sparse_gather import block_keep_density, gathered_attention, gathered_blocks, keep_density
from engine.ops.sparse_prefill import causal_pairs
from engine.sparse.specs import SPECS, PolicySpec
from engine.step import QUIET, StepContext


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    num_blocks: int = 0          # host (or paged) KV blocks: the block ids the hooks are given
    max_blocks_per_seq: int = 0  # blocks one sequence can have (0: num_blocks)
    graphs: bool = False         # the runner replays CUDA graphs at decode (a policy may capture its own work)


@dataclass
class LoadPlan:
    """What one layer attends to at a decode step whose sequence has `context_len` tokens: `rows` [Hkv, n], per kv
    head, tokens of the layer's host pool (host block * block_size + offset) packed in this order, followed by the
    sequence's newest `device_tail` tokens (of the block being filled, the new token last: on the device already).
    Each kv head attends to exactly n + device_tail tokens. `key` names the plan (a buffer that holds it already
    is not loaded again)."""
    rows: torch.Tensor
    device_tail: int
    key: tuple
    moved: int | None = None     # rows per kv head that are not -1 (None: all): the bytes the load moves
    sink: int = 0                # the first rows are the sequence's first `sink` tokens at every step: a runner may
                                 # keep those on the device and, where they are all a load would move, skip it
    recent: int = 0              # the `recent` rows after the sink are the tokens right before the device tail (the
                                 # last of the block before the newest token's): a runner may keep those too


@dataclass
class RowFix:
    """A correction of a loaded plan, made with the layer's own query before its attention: host-pool rows
    [Hkv, m] replace the packed positions `dst` [Hkv, m] (rows of -1: nothing to replace). `select`, where given,
    makes rows and dst (the choice, over the policy's static tensors): the runner runs it right before the gather,
    so that on CUDA both are recorded in the attention's graph (one launch and no graph boundary between them)."""
    rows: torch.Tensor
    dst: torch.Tensor
    select: Callable[[], None] | None = None


class SparsePolicy:
    spec: PolicySpec = SPECS["full"]
    plans_loads = False          # decode: the runner asks plan_load / shows observe_query each layer's query
    sink = 0                     # plans_loads: the first tokens every plan starts with (LoadPlan.sink)
    wants_layer_keys = False     # observe_query needs ctx.layer_keys() (all of the layer's keys; slow)
    looks_ahead = False          # layerwise decode: observe_ahead gets each next layer's guessed query
    one_call_bytes = 2**29       # dense prefill: q up to 512 MiB (32K tokens of Qwen3-4B) in one call

    def __init__(self, **params):
        self.spec.validate(params)   # a policy without parameters still refuses unknown ones

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def supports_prefill(self) -> bool:
        """Its prefill differs from dense (so is its prefill KV: the disk tier keeps it apart)."""
        return self.spec.phase == "prefill"

    def initialize(self, layout: KVLayout) -> None:
        """After the KV memory is allocated (the engine's, or a new one's)."""
        self.layout = layout

    def reset(self) -> None:
        """A new sequence starts (its prefill)."""

    def forget(self) -> None:
        """The engine dropped its cached blocks after throwaway prompts (LLM.warm_up): what the policy learned from
        their keys must not shape the user's requests (Quest's sketch basis). Its kernels and graphs stay."""

    def stats(self) -> dict:
        """The policy's figures for the last request (JSON-ready): density, pages selected, ..."""
        return {}

    def step_metrics(self) -> dict:
        """Figures of the step that just ran, for its trace; read once per step."""
        return {}

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                          ctx: StepContext = QUIET) -> torch.Tensor:
        """q [Tq, Hq, D] (the last Tq of Tk positions), k/v [Tk, Hkv, D] -> [Tq, Hq, D], dense causal. q may be
        consumed: a long one is done one kv head (and its query heads) at a time, each result written over its q
        (at 128K tokens of Qwen3-4B that saves a second 1 GiB tensor; 5% slower at 32K, so short ones are not)."""
        step = None if ctx is QUIET else ctx.step
        if q.numel() * q.element_size() <= self.one_call_bytes:
            return causal_attention(q, k, v, scale, step)
        hkv = k.shape[1]
        g = q.shape[1] // hkv
        for h in range(hkv):
            q[:, h * g:(h + 1) * g] = causal_attention(q[:, h * g:(h + 1) * g], k[:, h:h + 1], v[:, h:h + 1], scale,
                                                         step)
        return q

    def warm_up_tokens(self) -> int:
        """The shortest prompt that takes the policy's sparse path (LLM.warm_up makes its prompts at least this long,
        so its kernels compile and its graphs are captured before the user's first turn). 0: any prompt."""
        return 0

    def whole_layers(self) -> tuple[int, ...]:
        """Layers whose whole KV a load-planning policy reads at every decode step (layerwise mode keeps them
        resident first when a GPU KV budget is given)."""
        return ()

    def on_kv_written(self, layer: int, block_ids: list[int], keys: torch.Tensor, start: int, end: int) -> None:
        pass

    def plan_load(self, layer: int, context_len: int, ctx: StepContext) -> LoadPlan | None:
        return None

    def observes(self, layer: int, context_len: int) -> bool:
        """At a decode step whose sequence has context_len tokens, does observe_query want `layer`'s query? False
        for every layer (and no plan): the runner runs the step as Full would, one CUDA graph per layer (a
        layer it observes is split in two around the policy's choice) and, in chunked mode, the graphed step."""
        return False

    def observe_query(self, layer: int, q: torch.Tensor, ctx: StepContext, defer: bool = False) -> RowFix | None:
        """`defer`: the caller runs the returned fix's `select` (if any) before its gather; else the choice is made
        here."""
        return None

    def defers(self, layer: int, ctx: StepContext) -> bool:
        """Would observe_query(layer, q, ctx, defer=True) leave all its device work on q to the fix it returns (its
        `select`)? Then a caller may ask it before q exists: q, the choice, the gather and the attention become
        one CUDA graph (engine/offload/decode_graphs.py)."""
        return False

    def observe_ahead(self, layer: int, q: torch.Tensor, ctx: StepContext, run=None, gather=None) -> RowFix | None:
        """With `run` and `gather` (CUDA): run the choice as `run(work)` (on the copy stream, after the compute
        issued so far) and fetch with `gather(fix)` there, returning None."""
        return None

    def fetched_rows(self) -> int:
        """Rows (one kv head's token) its `RowFix`es moved in the step `end_step` just closed: the runner adds
        their bytes to the step's host-to-device bytes (their count is known on the device only until then)."""
        return 0

    def stage_step(self) -> None:
        """Once per decode step, after its last layer and before the sampler's sync: start the copies of what
        `end_step` reads to the host (asynchronous, on the sampler's stream), so that end_step needs no sync of
        its own."""

    def end_step(self, ctx: StepContext) -> None:
        pass


def attach(policy: SparsePolicy, args, block_size: int, device, dtype, num_blocks: int, max_blocks_per_seq: int = 0,
           graphs: bool = False) -> SparsePolicy:
    """Ready `policy` for a model's KV (its layout)."""
    policy.initialize(KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, block_size, device, dtype,
                               num_blocks, max_blocks_per_seq, graphs))
    return policy


class SparsePrefillPolicy(SparsePolicy):
    """A policy that computes prefill attention on a sparse pattern (MInference, XAttention). Subclasses give
    `estimate(q, k, scale)` -> pattern, `kernel(q, k, v, pattern, scale)` -> (out, pairs computed per head) on
    CUDA, `keep(pattern, tq, tk)` -> the pattern as kept keys per query block (engine.ops.sparse_gather) for
    the other devices, and `record` (the pattern and its density per head to the trace).

    A layer runs dense, and says why (`dense_reasons`, the stats' `sparse: false, reason`), below `min_len`
    keys (0, where the spec allows it: `auto_min_len`, per device), with fewer than 64 new queries, and when its
    pattern keeps more pairs than the sparse path computes faster than dense attention: `cpu_dense_above` (the
    gathered path, measured with bench --text sample) and `gpu_dense_above` (our kernels' pace per pair, measured
    with bench --kernels), 1 = always sparse. A layer that ran dense records no mask. This keeps the density per
    layer of the last prefill."""
    block = 128
    auto_min_len = (8192, 8192)   # min_len 0 (where the spec allows it): (off CUDA, on CUDA)

    def __init__(self, min_len: int, cpu_dense_above: float, gpu_dense_above: float):  # noqa: D107
        self.min_len, self.cpu_dense_above, self.gpu_dense_above = min_len, cpu_dense_above, gpu_dense_above
        self._pairs: dict[int, tuple[torch.Tensor, int]] = {}   # layer -> (pairs per head, dense causal pairs)
        self.dense_reasons: dict[int, str] = {}                   # layer -> why it ran dense

    def reset(self) -> None:
        self._pairs.clear()
        self.dense_reasons.clear()

    def min_len_on(self, cuda: bool) -> int:
        """The prompt length below which a layer runs dense, on this device (min_len, or its auto value)."""
        return self.min_len or self.auto_min_len[bool(cuda)]

    def warm_up_tokens(self) -> int:
        layout = getattr(self, "layout", None)
        return max(self.min_len_on(layout is None or str(layout.device).startswith("cuda")), 64)

    def estimate(self, q, k, scale: float):
        raise NotImplementedError

    def kernel(self, q, k, v, pattern, scale: float, skip=None):
        """skip: a device flag; where set, the kernel computes nothing (the dense gate's answer, read later)."""
        raise NotImplementedError

    def pattern_density(self, pattern, tq: int, tk: int) -> torch.Tensor:
        """The share of causal pairs the pattern keeps (a close upper bound), from the pattern alone (CUDA): a
        float64 device scalar, read on the host only after the kernel's launch."""
        raise NotImplementedError

    def least_density(self, tq: int, tk: int) -> float:
        """A lower bound of the share of causal pairs the pattern keeps, known before estimating it."""
        return 0.0

    def keep(self, pattern, tq: int, tk: int) -> torch.Tensor:
        raise NotImplementedError

    def record(self, recorder, layer: int, pattern, density: torch.Tensor, n: int) -> None:
        """The layer's masks to the recorder, every head in one `mask_summaries` call (density [Hq], a tensor)."""
        raise NotImplementedError

    def block_table(self, pattern) -> torch.Tensor | None:
        """The pattern as kept blocks [Hq, nQB, nKB] where it is one (the gathered path then moves whole blocks)."""
        return None

    def _sparse(self, q, k, v, scale):
        """(out, pairs per head, pattern), or a string: why this layer runs dense."""
        tq, tk = q.shape[0], k.shape[0]
        if tk < (least_len := self.min_len_on(q.is_cuda)):
            auto = "" if self.min_len else " (auto)"
            return f"the prompt ({tk:,} tokens) is below min_len {least_len:,}{auto}"
        if tq < 64:
            return f"only {tq} new tokens (a cached prefix holds the rest): too few to estimate a pattern"
        limit = self.gpu_dense_above if q.is_cuda else self.cpu_dense_above
        where = "our GPU kernels are slower than dense attention" if q.is_cuda else \
            "dense attention is faster on the CPU"
        if limit < 1 and (least := self.least_density(tq, tk)) > limit:
            return f"the budgets keep at least {least:.0%} of the pairs at {tk:,} tokens: above {limit:.0%} {where}"
        pattern = self.estimate(q, k, scale)
        if not q.is_cuda:                   # a block table's own path makes no [Hq, nQB, Tk] table (gathered_blocks)
            table = self.block_table(pattern)
            keep = None if table is not None else self.keep(pattern, tq, tk)
            share = block_keep_density(table, self.block, tq, tk) if keep is None else \
                keep_density(keep, self.block, tq, tk)
            if limit < 1 and share > limit:
                return f"the pattern keeps {share:.0%} of the pairs: above {limit:.0%} {where}"
            got = gathered_blocks(q, k, v, table, self.block, scale) if table is not None else None
            if got is None:                 # (a block table off a block boundary, or without its own blocks)
                got = gathered_attention(q, k, v, self.keep(pattern, tq, tk) if keep is None else keep, self.block,
                                         scale)
            return (*got, pattern)
        if limit >= 1:
            return (*self.kernel(q, k, v, pattern, scale), pattern)
        # The gate's answer crosses to the host behind the kernel's launch: the kernel exits at once where it says
        # dense, and in a sparse layer the GPU computes while the host waits for the read (reading first left the
        # GPU idle until the host had launched it: 7-9% of a 32K prefill of the default model, 15-30% layerwise)
        share = self.pattern_density(pattern, tq, tk)
        over = share > limit
        seen = share.to("cpu", non_blocking=True)
        read = torch.cuda.Event()
        read.record()
        out, pairs = self.kernel(q, k, v, pattern, scale, skip=over)
        read.synchronize()
        if float(seen) > limit:
            del out, pairs                          # (nothing computed; its memory goes back before dense runs)
            return f"the pattern keeps {float(seen):.0%} of the pairs: above {limit:.0%} {where}"
        return out, pairs, pattern

    def prefill_attention(self, q, k, v, layer, scale, ctx=QUIET):
        got = self._sparse(q, k, v, scale)
        if isinstance(got, str):
            self._pairs.pop(layer, None)
            self.dense_reasons[layer] = got
            return super().prefill_attention(q, k, v, layer, scale, ctx)
        out, pairs, pattern = got
        self.dense_reasons.pop(layer, None)
        self._pairs[layer] = (pairs, dense := causal_pairs(q.shape[0], k.shape[0]))
        if ctx.recorder.enabled:                              # (density per head stays on the device: no read)
            self.record(ctx.recorder, layer, pattern, pairs.double() / dense, k.shape[0])
        return out

    def stats(self) -> dict:
        reasons = sorted(set(self.dense_reasons.values()), key=list(self.dense_reasons.values()).count)
        if not self._pairs:
            return {"sparse": False, "reason": reasons[-1] if reasons else "no prefill yet",
                    "sparse_layers": 0, "density": 1.0}
        layers = sorted(self._pairs)                          # (one read from the device for all layers)
        mean = torch.stack([self._pairs[l][0].double() / self._pairs[l][1] for l in layers]).mean(dim=1).tolist()
        per_layer = dict(zip(layers, mean))
        out = {"sparse": True, "sparse_layers": len(per_layer), "density": sum(per_layer.values()) / len(per_layer),
               "density_per_layer": {str(l): round(d, 4) for l, d in per_layer.items()}}
        if self.dense_reasons:
            out["dense_layers"] = {str(l): r for l, r in sorted(self.dense_reasons.items())}
        return out


class FullPolicy(SparsePolicy):
    """Attends to everything; loads everything."""
