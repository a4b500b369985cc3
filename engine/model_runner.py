"""gpu mode's runner: one forward step over a batch of sequences: build the inputs, run the model, sample.

Owns the paged KV cache and, on CUDA, the decode CUDA graphs (embedding to logits, one per batch size); the
model's layers get their attention from `_attend` (store the new K/V, then paged attention; a prefill policy's
attention where one runs). KV cache: one tensor [2, layers, blocks + 1, Hkv, block_size, D] (head-major: a block of one head is one
contiguous matrix), handed to the layers as [block, offset, head, dim] views; the extra block is scratch for
the padded rows of a graph.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.config import EngineConfig
from engine.errors import OutOfMemoryError
from engine.layers.sampler import Sampler
from engine.models.llama import CausalLM
from engine.ops.attention import AttnMetadata, decode_attention, prefill_attention
from engine.ops.store_tokens import store_tokens
from engine.sequence import Sequence
from engine.sparse.policy import SparsePolicy, attach
from engine.step import QUIET, StepContext
from engine.trace.events import COMPUTE, HOST
from engine.trace.recorder import NULL_RECORDER, Recorder


class _GraphSpans:
    """Stands in for the recorder while a decode graph is captured: each top-level span (a layer) gets CUDA
    events recorded inside the graph, so every replay times its layers again; nested spans (attention, MLP)
    are left out there to keep the graph cheap. After a replay the spans go to the real recorder
    (`add_event_span`), read with the rest of the step. Consecutive layers share their boundary event
    (nothing runs between one layer's end and the next one's start): 37 events for 36 layers."""
    enabled = True
    detail = False   # (the model's own shared marks are for eager steps: here the spans above time the layers)

    def __init__(self):
        self.spans: list[list] = []   # [lane, name, layer, start event, end event]
        self._event = None            # the latest boundary event
        self._depth = 0

    def span(self, lane, name, layer=None, **_):
        return _GraphSpan(self, lane, name, layer)

    def _record(self):
        self._event = torch.cuda.Event(enable_timing=True, external=True)
        self._event.record()
        return self._event


class _GraphSpan:
    def __init__(self, owner: _GraphSpans, lane, name, layer):
        self.owner, self.entry = owner, [lane, name, layer, None, None]

    def __enter__(self):
        o = self.owner
        o._depth += 1
        if o._depth == 1:
            self.entry[3] = o._event if o._event is not None else o._record()
            o.spans.append(self.entry)

    def __exit__(self, *exc):
        o = self.owner
        o._depth -= 1
        if o._depth == 0:
            self.entry[4] = o._record()
        return False


def fill_decode_inputs(inputs: np.ndarray, seqs: list[Sequence], block_size: int, scratch_block: int) -> None:
    """int64 [5, rows] = ids, positions, KV block, KV offset, context lens; rows past `seqs` are padding (token 0
    at position 0, writing into the scratch block, with no context)."""
    inputs[:] = 0
    inputs[2] = scratch_block
    for i, s in enumerate(seqs):
        last = len(s) - 1
        inputs[:, i] = (s.last_token, last, s.block_table[last // block_size], last % block_size, len(s))


class GraphInputs:
    """The decode graphs' inputs, written through host buffers (pinned on CUDA) kept for the engine's life, not two
    pinned copies made per step (~8 µs each in a cProfile on the H200 host, where the GPU waits for the next step).
    Every step's ids, positions, KV slots and context lengths go in one copy; block-table rows only where they
    changed (a sequence's table only grows, and is a new list once its blocks are freed: each row holds the list it
    copied). On CUDA the buffers are rewritten once the last step's copies ran (an event after them: done by then,
    as every step but a cancelled one ends with the sampler reading its tokens on the host)."""

    def __init__(self, inputs: torch.Tensor, tables: torch.Tensor, block_size: int, scratch_block: int):
        self.inputs, self.tables, self.block_size, self.scratch_block = inputs, tables, block_size, scratch_block
        cuda = inputs.is_cuda
        self.host_inputs = torch.zeros(inputs.shape, dtype=inputs.dtype, pin_memory=cuda)
        self.host_tables = torch.zeros(tables.shape, dtype=tables.dtype, pin_memory=cuda)
        self.rows: list[tuple] = [(None, 0)] * tables.shape[0]   # (block table list, its length) each row holds
        self.copied = torch.cuda.Event() if cuda else None
        self.rows_copied = 0                                      # block-table rows copied so far

    def write(self, seqs: list[Sequence]) -> None:
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()
        fill_decode_inputs(self.host_inputs.numpy(), seqs, self.block_size, self.scratch_block)
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        rows = self.rows
        changed = [i for i, s in enumerate(seqs) if rows[i][0] is not s.block_table or rows[i][1] != len(s.block_table)]
        if changed:
            tables = self.host_tables.numpy()
            for i in changed:
                t = rows[i] = seqs[i].block_table, len(seqs[i].block_table)
                tables[i, :t[1]] = t[0]
                tables[i, t[1]:] = 0
            lo, hi = changed[0], changed[-1] + 1
            self.tables[lo:hi].copy_(self.host_tables[lo:hi], non_blocking=True)
            self.rows_copied += hi - lo
        if self.copied is not None:
            self.copied.record()


class ModelRunner:
    plan = None   # no residency plan: every layer's KV is on the device

    def issued_for(self, seqs: list[Sequence], is_prefill: bool) -> bool:
        return False

    def __init__(self, model: CausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, policy: SparsePolicy, recorder: Recorder = NULL_RECORDER):
        """`recorder` sees the loading work (KV allocation, graph capture); steps report to their context's."""
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.args = model.args
        self.block_size = config.kv_block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.max_num_batched_tokens = config.max_num_batched_tokens or min(max_model_len, 32768)
        self.scale = model.layers[0].self_attn.scale
        self.sampler = Sampler(device)
        with recorder.span(HOST, "allocate KV cache"):
            self.num_blocks = self._allocate_kv_cache()
        self.set_policy(policy)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.traced_graphs: dict[int, list[tuple]] = {}  # b -> two (graph, spans) copies with per-layer events
        self._graph_pool = None
        if device.type == "cuda" and not config.enforce_eager:
            with recorder.span(HOST, "capture decode CUDA graphs"):
                self._capture_decode_graphs()

    def set_policy(self, policy: SparsePolicy) -> None:
        """The sparse policy of the next requests (gpu mode: prefill policies; decode reads the whole cache)."""
        self.policy = attach(policy, self.args, self.block_size, self.device, self.dtype, self.num_blocks)

    def step_metrics(self) -> dict:
        return self.policy.step_metrics()

    def close(self) -> None:
        """Nothing runs in the background in gpu mode; the graphs and the cache go with the runner."""
        self.graphs.clear()
        self.traced_graphs.clear()

    def _attend(self, meta: AttnMetadata, ctx: StepContext):
        """The model's attention for one step: store the new tokens' K/V in the paged cache, then attend."""
        policy = self.policy if self.policy.supports_prefill else None

        def attend(i: int, q, k, v):
            kc, vc = self.k_caches[i], self.v_caches[i]
            store_tokens(k, v, kc, vc, meta.slots)
            if meta.is_prefill:
                sparse = None if policy is None else (
                    lambda qi, ki, vi: policy.prefill_attention(qi, ki, vi, i, self.scale, ctx))
                return prefill_attention(q, k, v, kc, vc, meta, self.scale, sparse, ctx.step)
            return decode_attention(q, kc, vc, meta.block_tables, meta.context_lens, self.scale)
        return attend

    # ---------------------------------------------------------------- KV cache
    @property
    def block_bytes(self) -> int:
        return self.args.kv_bytes_per_token * self.block_size * self.dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        cfg, a = self.config, self.args
        wanted = self.max_blocks_per_seq * cfg.max_num_seqs
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = min(wanted, self._blocks_that_fit_on_gpu())
        else:
            num_blocks = min(wanted, int(cfg.cpu_kv_cache_gb * 2**30 // self.block_bytes))
        if num_blocks < 1:
            raise OutOfMemoryError(
                f"no room for the KV cache ({self.block_bytes / 2**20:.1f} MiB per block of {self.block_size} tokens): "
                "raise gpu_memory_utilization / cpu_kv_cache_gb, lower max_num_batched_tokens, or use a smaller model")
        shape = (2, a.num_layers, num_blocks + 1, a.num_kv_heads, self.block_size, a.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError:
            raise OutOfMemoryError(f"the KV cache of {num_blocks} blocks does not fit: lower num_kv_blocks or "
                                   "gpu_memory_utilization") from None
        self.k_caches = [self.kv_cache[0, i].transpose(1, 2) for i in range(a.num_layers)]
        self.v_caches = [self.kv_cache[1, i].transpose(1, 2) for i in range(a.num_layers)]
        return num_blocks

    # ---------------------------------------------------------------- the disk tier's view of the KV
    def block(self, block_id: int) -> torch.Tensor:
        """One block's KV across the layers, [L, 2, Hkv, bs, D] (a view into the cache)."""
        return self.kv_cache[:, :, block_id].transpose(0, 1)

    def written(self, block_ids: list[int]) -> None:
        """Blocks filled from outside the model (the disk tier): nothing to invalidate in gpu mode."""

    def sync(self) -> None:
        """The KV computed so far is in memory (before a reader on another thread copies it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _blocks_that_fit_on_gpu(self) -> int:
        """Measure peak activations with one full-size prefill (no KV yet), then size the cache from what is left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttnMetadata(True, torch.zeros(2, n, dtype=torch.long, device=self.device), q_lens=[n], k_lens=[n])
        dense = lambda i, q, k, v: prefill_attention(q, k, v, None, None, meta, self.scale)  # noqa: E731 - no cache yet
        try:
            self.model.logits(self.model(ids, torch.arange(n, device=self.device), dense, QUIET)[-1:])
        except torch.OutOfMemoryError:
            raise OutOfMemoryError(f"a prefill of {n} tokens does not fit in GPU memory: lower max_num_batched_tokens "
                                   "or max_model_len") from None
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = total * self.config.gpu_memory_utilization - used - peak_extra
        return int(budget // self.block_bytes) - 1

    # ---------------------------------------------------------------- inputs
    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]):
        ids, pos, slots, q_lens, k_lens = [], [], [], [], []
        bs = self.block_size
        for s in seqs:
            start = s.num_cached_tokens
            ids += s.token_ids[start:]
            pos += range(start, len(s))
            slots += [(s.block_table[i // bs], i % bs) for i in range(start, len(s))]
            q_lens.append(len(s) - start)
            k_lens.append(len(s))
        cu_q = [0]
        for q in q_lens:
            cu_q.append(cu_q[-1] + q)
        meta = AttnMetadata(True, self._tensor(slots).T, q_lens=q_lens, k_lens=k_lens,
                            cu_seqlens_q=self._tensor(cu_q, torch.int32))
        if any(q != k for q, k in zip(q_lens, k_lens)):
            meta.block_tables = self._block_tables(seqs)
        last_rows = self._tensor([c - 1 for c in cu_q[1:]])
        return self._tensor(ids), self._tensor(pos), meta, last_rows

    def prepare_decode(self, seqs: list[Sequence]):
        width = max(len(s.block_table) for s in seqs)
        inputs, tables = np.empty((5, len(seqs)), dtype=np.int64), np.zeros((len(seqs), width), dtype=np.int32)
        fill_decode_inputs(inputs, seqs, self.block_size, self.num_blocks)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        host, tables = torch.from_numpy(inputs), torch.from_numpy(tables)
        if self.device.type == "cuda":
            host, tables = host.pin_memory(), tables.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        meta = AttnMetadata(False, dev[2:4], block_tables=tables.to(self.device, non_blocking=True), context_lens=dev[4])
        return dev[0], dev[1], meta

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def forward_logits(self, seqs: list[Sequence], is_prefill: bool, ctx: StepContext) -> torch.Tensor:
        """Logits [B, vocab] of each sequence's last position."""
        if is_prefill:
            ids, pos, meta, last_rows = self.prepare_prefill(seqs)
            hidden = self.model(ids, pos, self._attend(meta, ctx), ctx)[last_rows]
            with ctx.recorder.span(COMPUTE, "logits"):
                return self.model.logits(hidden)
        return self._decode_logits(seqs, ctx)

    def run(self, seqs: list[Sequence], is_prefill: bool, ctx: StepContext) -> list[int]:
        logits = self.forward_logits(seqs, is_prefill, ctx)
        rec = ctx.recorder
        if rec.enabled:  # the GPU is busy with this step: read the last one's events now
            rec.resolve_deferred()
        with rec.span(HOST, "sample"):
            return self.sampler(logits, [s.params for s in seqs], [s.seq_id for s in seqs])

    def _decode_logits(self, seqs: list[Sequence], ctx: StepContext) -> torch.Tensor:
        n = len(seqs)
        graph_bs = next((b for b in sorted(self.graphs) if b >= n), None)
        if graph_bs is None:
            ids, pos, meta = self.prepare_decode(seqs)
            return self.model.logits(self.model(ids, pos, self._attend(meta, ctx), ctx))
        rec = ctx.recorder
        if rec.detail and graph_bs not in self.traced_graphs:
            self._capture(graph_bs, traced=True)
            self._capture(graph_bs, traced=True)
        g = self.graph_vars
        self.graph_inputs.write(seqs)
        if rec.detail:  # two traced copies, alternating: the last step's events are read during this one
            pair = self.traced_graphs[graph_bs]
            pair.reverse()
            graph, spans = pair[0]
            graph.replay()
            for lane, name, layer, start, end in spans:
                rec.add_event_span(lane, name, start, end, layer)
        else:
            self.graphs[graph_bs].replay()
        ctx.layer_done(len(self.model.layers), len(self.model.layers))   # Stop between graph replays
        return g["logits"][:n]

    def _capture_decode_graphs(self) -> None:
        max_bs = min(self.config.max_num_seqs, 512)
        sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs + 1, 16))
        if max_bs not in sizes:
            sizes.append(max_bs)
        dev = self.device
        self.graph_vars = {
            "inputs": torch.zeros(5, max_bs, dtype=torch.long, device=dev),  # ids, pos, block, offset, context
            "block_tables": torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            "logits": torch.zeros(max_bs, self.args.vocab_size, dtype=self.dtype, device=dev),
        }
        self.graph_inputs = GraphInputs(self.graph_vars["inputs"], self.graph_vars["block_tables"], self.block_size,
                                        self.num_blocks)
        for b in sorted(sizes, reverse=True):
            self._capture(b, traced=False)

    def _capture(self, b: int, traced: bool) -> None:
        """Capture the decode step for batch size b. Inputs point at the scratch block while capturing, so the
        warm-up and capture runs write no real KV (this also makes a later, lazy capture safe)."""
        g = self.graph_vars
        ids, pos, _, _, context_lens = g["inputs"][:, :b]
        slots = g["inputs"][2:4, :b]
        slots[0].fill_(self.num_blocks)
        slots[1].zero_()
        context_lens.zero_()
        meta = AttnMetadata(False, slots, block_tables=g["block_tables"][:b], context_lens=context_lens)
        spans = _GraphSpans()

        def step(ctx: StepContext):   # nothing may raise (no task) or record on the host mid-capture
            return self.model.logits(self.model(ids, pos, self._attend(meta, ctx), ctx))
        g["logits"][:b] = step(QUIET)  # warm-up: compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self._graph_pool, capture_error_mode="thread_local"):
            g["logits"][:b] = step(StepContext(recorder=spans) if traced else QUIET)
        self._graph_pool = graph.pool()
        if traced:
            self.traced_graphs.setdefault(b, []).append((graph, spans.spans))
        else:
            self.graphs[b] = graph
        torch.cuda.synchronize()
