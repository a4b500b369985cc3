"""What the two offload modes share: one sequence at a time, KV in the host pool, the model driven layer by layer.

Every runner (gpu mode's too) has one face (engine/runner.py's `Runner`), so LLM, the scheduler and the block
manager do not care where KV lives. The policy plans; this executes: at decode, a policy that `plans_loads`
says per layer which pages to bring (`plan_load`) and sees each layer's query (`observe_query`). Block ids in a sequence's block table are
host pool blocks; the prefix cache works on them as in gpu mode.

Token positions are the same in every buffer: position p of a layer's KV is block p // bs, offset p % bs, in
the host pool (through the block table) and in a device buffer (directly).
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.layers.sampler import Sampler
from engine.models.llama import CausalLM
from engine.offload.offload_engine import OffloadEngine
from engine.sequence import Sequence
from engine.sparse.policy import SparsePolicy, attach
from engine.step import StepContext
from engine.trace.events import COMPUTE, HOST
from engine.trace.recorder import NULL_RECORDER, Recorder


CHUNK_MLP_BYTES = 2**28   # a layerwise prefill chunk's MLP activations ([rows, 2 x intermediate]) stay under this


def prefill_chunk(intermediate_size: int, dtype: torch.dtype) -> int:
    """Rows per QKV / MLP call of a layerwise prefill by default: at least 8192 (Qwen3-4B, Llama-3.1-8B), more for
    small models (SmolLM2: a 32K prompt in one call per layer, where 4 calls each cost host time: the layer loop of a
    sparse prefill is bound by the host on such a model)."""
    rows = CHUNK_MLP_BYTES // (2 * intermediate_size * dtype.itemsize)
    return max(8192, rows // 1024 * 1024)


class OffloadRunner:
    mode = "offload"
    plan = None   # layerwise sets its residency plan

    def __init__(self, model: CausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, policy: SparsePolicy, recorder: Recorder = NULL_RECORDER):
        """`recorder` sees the allocation; steps report to their context's recorder."""
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        a = self.args = model.args
        self.block_size = bs = config.kv_block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // bs)
        self.max_num_batched_tokens = max_model_len  # the whole prompt in one step, one sequence at a time
        self.chunk_tokens = config.prefill_chunk_tokens or prefill_chunk(a.intermediate_size, dtype)
        self.sampler = Sampler(device)
        self.block_bytes = a.kv_bytes_per_token * bs * dtype.itemsize  # one block, all layers (host pool)
        if config.host_kv_gb is not None:
            self.num_blocks = int(config.host_kv_gb * 2**30 // self.block_bytes)
            if self.num_blocks < 1:
                raise ConfigError(f"host_kv_gb {config.host_kv_gb} holds no block of {self.block_bytes / 2**20:.1f} MiB")
        else:
            self.num_blocks = self.max_blocks_per_seq + 1
        self.set_policy(policy)
        with recorder.span(HOST, "allocate KV (host pool + device buffers)"):
            self.oe = self._make_offload_engine()
        self.scale = model.layers[0].self_attn.scale
        self.last_step_bytes = (0, 0)
        self._table_of: list[int] | None = None   # the block table _device_table copied last

    def _make_offload_engine(self) -> OffloadEngine:
        raise NotImplementedError

    def _engine(self, ring_slots: int, slot_blocks: int, resident: tuple[int, ...] = ()) -> OffloadEngine:
        a = self.args
        return OffloadEngine(a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.dtype, self.device,
                             self.num_blocks, ring_slots, slot_blocks, resident)

    def set_policy(self, policy: SparsePolicy) -> None:
        """The sparse policy of the next requests (between requests only)."""
        self.policy = attach(policy, self.args, self.block_size, self.device, self.dtype, self.num_blocks,
                             self.max_blocks_per_seq, self.device.type == "cuda" and not self.config.enforce_eager)
        if getattr(self, "decode_graphs", None) is not None:   # (none yet while the runner is being made)
            self.decode_graphs.drop_work()

    def run(self, seqs: list[Sequence], is_prefill: bool, ctx: StepContext) -> list[int]:
        if len(seqs) != 1:
            raise ConfigError(f"{self.mode} mode runs one sequence at a time ({len(seqs)} were scheduled together)")
        seq, rec = seqs[0], ctx.recorder
        if is_prefill:
            self.policy.reset()
        if rec.enabled and self.device.type == "cpu":
            rec.device = "cpu (threaded copies)"  # what the views print: copies overlap compute on threads
        self.oe.begin_step(rec)
        ctx.context_len = len(seq)
        if self.policy.plans_loads:   # the block table on the device (no host sync per layer)
            ctx.block_table = self._device_table(seq.block_table)
        h2d, d2h = self.oe.bytes_h2d, self.oe.bytes_d2h
        with torch.inference_mode():
            logits = self.forward(seq, is_prefill, ctx)
        self.last_step_bytes = (self.oe.bytes_h2d - h2d, self.oe.bytes_d2h - d2h)
        seq.bytes_h2d += self.last_step_bytes[0]
        seq.bytes_d2h += self.last_step_bytes[1]
        if rec.enabled:
            rec.resolve_deferred()
        self.policy.stage_step()       # its counts start for the host: the sampler's sync brings them
        with rec.span(HOST, "sample"):
            tokens = self._sample(seq, logits, ctx)
        self.policy.end_step(ctx)      # after the sampler's sync: what the policy reads of the step is ready
        fixed = self.policy.fetched_rows() * 2 * self.args.head_dim * self.dtype.itemsize   # K and V rows
        self.last_step_bytes = (self.last_step_bytes[0] + fixed, self.last_step_bytes[1])
        seq.bytes_h2d += fixed
        self.oe.bytes_h2d += fixed
        if self.device.type != "cuda" and rec.enabled:
            self.oe.synchronize()  # CPU: the step's copies land in the step's trace
        return tokens

    def forward(self, seq: Sequence, is_prefill: bool, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def _sample(self, seq: Sequence, logits: torch.Tensor, ctx: StepContext) -> list[int]:
        return self.sampler(logits, [seq.params], [seq.seq_id])

    def issued_for(self, seqs: list[Sequence], is_prefill: bool) -> bool:
        """Did this step's first layers run already, untimed (layerwise: engine/offload/step_ahead.py)?"""
        return False

    def _device_table(self, table: list[int]) -> torch.Tensor:
        """A block table on the device, copied again only when it changed (at decode: once every block_size
        tokens; a 128K context's 513 entries took ~0.1 ms of the step's start from Python every step)."""
        if self._table_of != table:
            pin = self.device.type == "cuda"
            self._table_dev = torch.tensor(table, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=True)
            self._table_of = list(table)
        return self._table_dev

    def step_metrics(self) -> dict:
        return {"bytes_h2d": self.last_step_bytes[0], "bytes_d2h": self.last_step_bytes[1],
                **self.policy.step_metrics()}

    # ---------------------------------------------------------------- the disk tier's view of the KV
    def block(self, block_id: int) -> torch.Tensor:
        """One host block across the layers, [L, 2, Hkv, bs, D] (a view into the host pool)."""
        return self.oe.host[:, block_id]

    def written(self, block_ids: list[int]) -> None:
        """Host blocks filled from outside (the disk tier): device copies of their old contents are stale, and a
        policy that plans loads sees their keys, as an offload would have shown them."""
        self.oe.host_written(block_ids)
        if self.policy.plans_loads and block_ids:
            idx = torch.tensor(block_ids, device=self.oe.host.device)
            for layer in range(self.args.num_layers):
                keys = self.oe.host[layer, idx, 0].to(self.device)          # [n, Hkv, bs, D]
                self.policy.on_kv_written(layer, list(block_ids), keys, 0, len(block_ids) * self.block_size)

    def sync(self) -> None:
        """Every offload issued so far has landed in the host pool."""
        self.oe.synchronize()

    # ---------------------------------------------------------------- shared pieces
    def _inputs(self, seq: Sequence | None, start: int, end: int, ids: torch.Tensor | None = None):
        """Token ids, positions and rotary cos/sin of positions start..end-1; residual starts at zero (x + 0 == x).
        `ids`: the tokens on the device already (a step issued ahead: the sampled one), else seq's."""
        if ids is None:
            pin = self.device.type == "cuda"
            ids = torch.tensor(seq.token_ids[start:end], dtype=torch.long, pin_memory=pin).to(self.device,
                                                                                                non_blocking=True)
        pos = torch.arange(start, end, device=self.device)
        h = self.model.embed_tokens(ids)
        return h, torch.zeros_like(h), pos, self.model.rotary.cos_sin(pos, h.dtype)

    def _query_fix(self, l: int, buf: int, q: torch.Tensor, ctx: StepContext):
        """Decode: show the policy layer l's query (q [Hq, D]) before its attention -> the correction it asks for
        as (tag, work) for the attention's CUDA graph (engine/offload/decode_graphs.py), or None: work gathers the
        rows into buffer `buf` (first making them, where the policy left its choice to run here: `RowFix.select`);
        tag names the policy's static tensors it reads, which a graph recording it depends on."""
        fix = self.policy.observe_query(l, q, ctx, defer=True)
        if fix is None:
            return None

        def work() -> None:
            if fix.select is not None:
                fix.select()
            self.oe.fix_rows(buf, l, fix.rows, fix.dst)
        return (*((t.data_ptr(), *t.shape, *t.stride()) for t in (fix.rows, fix.dst)), fix.select is not None), work

    def _copy_tokens(self, dst: torch.Tensor, at: int, src: torch.Tensor, a: int, b: int) -> None:
        """Tokens a..b-1 of src [2, Hkv, n, D] (a block, or the layerwise runner's kept copies) -> flat token
        positions at.. of a buffer [blocks, 2, Hkv, bs, D] (a block boundary there splits the copy)."""
        bs = self.block_size
        while a < b:
            blk, off = at // bs, at % bs
            n = min(b - a, bs - off)
            dst[blk, :, :, off:off + n].copy_(src[:, :, a:a + n])
            a, at = a + n, at + n

    def _logits(self, h, residual, ctx: StepContext) -> torch.Tensor:
        with ctx.recorder.span(COMPUTE, "logits"):
            return self.model.logits(self.model.norm(h[-1:], residual[-1:])[0])

    def close(self) -> None:
        """Join the copy threads, unpin the host pool (the engine's KV is gone after this)."""
        self.oe.close()
