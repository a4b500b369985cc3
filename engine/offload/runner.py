"""What the two offload modes share: one sequence at a time, KV in the host pool, the model driven layer by layer.

A runner has the model runner's face (`run`, `num_blocks`, `block_bytes`, `recorder`, `sampler`), so LLM,
the scheduler and the block manager do not care where KV lives. Block ids in a sequence's block table are
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
from engine.sparse import make_policy
from engine.sparse.policy import SparsePolicy, attach
from engine.trace.events import COMPUTE, HOST
from engine.trace.recorder import NULL_RECORDER, Recorder


class OffloadRunner:
    mode = "offload"

    def __init__(self, model: CausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, recorder: Recorder = NULL_RECORDER, policy: SparsePolicy | None = None):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        a = self.args = model.args
        self.block_size = bs = config.kv_block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // bs)
        self.max_num_batched_tokens = max_model_len  # the whole prompt in one step, one sequence at a time
        self.chunk_tokens = config.prefill_chunk_tokens
        self.sampler = Sampler(device)
        self.block_bytes = a.kv_bytes_per_token * bs * dtype.itemsize  # one block, all layers (host pool)
        if config.host_kv_gb is not None:
            self.num_blocks = int(config.host_kv_gb * 2**30 // self.block_bytes)
            if self.num_blocks < 1:
                raise ConfigError(f"host_kv_gb {config.host_kv_gb} holds no block of {self.block_bytes / 2**20:.1f} MiB")
        else:
            self.num_blocks = self.max_blocks_per_seq + 1
        self._recorder = recorder
        self.set_policy(policy or make_policy(config.policy, config.policy_params, config.mode))
        with recorder.span(HOST, "allocate KV (host pool + device buffers)"):
            self.oe = self._make_offload_engine()
        self.recorder = recorder
        self.scale = model.layers[0].self_attn.attn.scale
        self.last_step_bytes = (0, 0)

    def _make_offload_engine(self) -> OffloadEngine:
        raise NotImplementedError

    def _engine(self, ring_slots: int, slot_blocks: int, resident: tuple[int, ...] = ()) -> OffloadEngine:
        a = self.args
        return OffloadEngine(a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.dtype, self.device,
                             self.num_blocks, ring_slots, slot_blocks, resident, self._recorder)

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    @recorder.setter
    def recorder(self, rec: Recorder) -> None:
        self._recorder = self.model.recorder = self.oe.recorder = self.policy.recorder = rec
        if rec.enabled and self.device.type == "cpu":
            rec.device = "cpu (threaded copies)"  # what the views print: copies overlap compute on threads

    def set_policy(self, policy: SparsePolicy) -> None:
        """The sparse policy of the next requests (between requests only)."""
        self.policy = attach(policy, self.args, self.block_size, self.device, self.dtype, self.num_blocks,
                             self._recorder)
        self._chosen: dict[int, torch.Tensor] = {}      # Quest: layer -> pages [Hkv, k] for its next load
        self._chosen_version: dict[int, int] = {}       # layer -> selections made (a load's identity)
        self._chosen_pos: dict[int, torch.Tensor] = {}  # layer -> the same pages as positions in the sequence

    @property
    def _quest(self):
        return self.policy if self.policy.requires_block_selection else None

    def _table_to_device(self, table: list[int]) -> None:
        """Quest: the block table on the device, once per step (no host sync per layer)."""
        if self._quest is not None:
            pin = self.device.type == "cuda"
            self._table_dev = torch.tensor(table, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=True)

    def _select(self, layer: int, q: torch.Tensor, n_blocks: int) -> None:
        """With this step's query of `layer`, choose its pages for the next step (the newest block is added at
        load time). Loads run N layers ahead, before that layer's next query exists: this is the fix."""
        quest = self._quest
        if not quest.applies(layer, n_blocks + 1):
            self._chosen.pop(layer, None)
            return
        k = quest.budget_pages - quest.pages_per_block
        blocks = self._table_dev[:n_blocks]
        positions, scores = quest.select(layer, q, blocks, k)
        quest.selections += 1
        pages = quest.page_ids(blocks)[positions]
        self._chosen[layer] = pages
        self._chosen_pos[layer] = positions
        self._chosen_version[layer] = self._chosen_version.get(layer, 0) + 1
        rec = self.recorder
        if rec.enabled:
            for h in range(pages.shape[0]):
                rec.quest_pick(layer, h, pages[h], scores[h], n_blocks * quest.pages_per_block, positions[h],
                               quest.page_size)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        if len(seqs) != 1:
            raise ConfigError(f"{self.mode} mode runs one sequence at a time ({len(seqs)} were scheduled together)")
        seq = seqs[0]
        if is_prefill:
            self.policy.reset()
        h2d, d2h = self.oe.bytes_h2d, self.oe.bytes_d2h
        with torch.inference_mode():
            logits = self.forward(seq, is_prefill)
        self.last_step_bytes = (self.oe.bytes_h2d - h2d, self.oe.bytes_d2h - d2h)
        seq.bytes_h2d += self.last_step_bytes[0]
        seq.bytes_d2h += self.last_step_bytes[1]
        if self.recorder.enabled:
            self.recorder.resolve_deferred()
        with self.recorder.span(HOST, "sample"):
            tokens = self.sampler(logits, [seq.params], [seq.seq_id])
        if self.device.type != "cuda" and self.recorder.enabled:
            self.oe.synchronize()  # CPU: the step's copies land in the step's trace
        return tokens

    def forward(self, seq: Sequence, is_prefill: bool) -> torch.Tensor:
        raise NotImplementedError

    # ---------------------------------------------------------------- the disk tier's view of the KV
    def kv_block(self, block_id: int) -> torch.Tensor:
        """One host block across the layers, [L, 2, Hkv, bs, D] (a view into the host pool)."""
        return self.oe.host[:, block_id]

    def kv_written(self, block_ids: list[int]) -> None:
        """Host blocks filled from outside (the disk tier): device copies of their old contents are stale, and
        Quest's key bounds of those blocks are made from their keys, as an offload after prefill makes them."""
        self.oe.host_written(block_ids)
        quest = self._quest
        if quest is not None and block_ids:
            idx = torch.tensor(block_ids, device=self.oe.host.device)
            for layer in range(self.args.num_layers):
                keys = self.oe.host[layer, idx, 0].to(self.device)          # [n, Hkv, bs, D]
                for b, k in zip(block_ids, keys):
                    quest.on_prefill_offload(b, layer, k, self.block_size)

    def kv_sync(self) -> None:
        """Every offload issued so far has landed in the host pool."""
        self.oe.synchronize()

    def step_metrics(self) -> dict:
        return {"bytes_h2d": self.last_step_bytes[0], "bytes_d2h": self.last_step_bytes[1]}

    # ---------------------------------------------------------------- shared pieces
    def _inputs(self, seq: Sequence, start: int, end: int):
        """Token ids, positions and rotary cos/sin of positions start..end-1; residual starts at zero (x + 0 == x)."""
        pin = self.device.type == "cuda"
        ids = torch.tensor(seq.token_ids[start:end], dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=True)
        pos = torch.arange(start, end, device=self.device)
        h = self.model.embed_tokens(ids)
        return h, torch.zeros_like(h), pos, self.model.rotary.cos_sin(pos, h.dtype)

    def _project(self, layer, h, residual, cos, sin, a: int, b: int):
        """Rows a..b-1: input norm (residual updated in place) -> q, k, v."""
        x, residual[a:b] = layer.input_layernorm(h[a:b], residual[a:b])
        return layer.self_attn.project(x, (cos[a:b], sin[a:b]))

    def _finish_layer(self, layer, h, residual, o, l: int) -> None:
        """Attention output o [T, Hq, D] -> o_proj, then the MLP, in chunks of rows, in place in h / residual."""
        with self.recorder.span(COMPUTE, "mlp", l):
            for a in range(0, h.shape[0], self.chunk_tokens):
                b = min(h.shape[0], a + self.chunk_tokens)
                x = layer.self_attn.o_proj(o[a:b].flatten(1))
                x, residual[a:b] = layer.post_attention_layernorm(x, residual[a:b])
                h[a:b] = layer.mlp(x)

    def _logits(self, h, residual) -> torch.Tensor:
        with self.recorder.span(COMPUTE, "logits"):
            return self.model.logits(self.model.norm(h[-1:], residual[-1:])[0])

    def close(self) -> None:
        self.oe.close()
