"""Layerwise offload: each step runs all its tokens through one layer at a time (DESIGN.md §2.1).

Per layer l (buffer = its resident buffer, or ring slot j % N for the j-th streamed layer of the run):
  wait until the buffer's load has landed (the host blocks before this step) and its last offload read it
  -> copy the decode buffer's partly filled block in after them (decode only)
  -> q, k, v for the new tokens (in row chunks at prefill), k, v written into the buffer
  -> attention over the buffer (the policy's prefill hook / paged decode attention), o_proj, MLP
  -> offload the blocks this step completed (D2H, async), keep the partly filled block in the decode buffer
  -> release the buffer and load the layer N streamed layers ahead into it (at decode, wrapping around to the
     next step's first layers, so the next token's loads start while this one computes).
Prefill reads nothing from the host unless the prompt starts with cached blocks (prefix cache).
"""
from __future__ import annotations

import torch

from engine.ops.attention import decode_attention, store_kv
from engine.offload.planner import ResidencyPlan, plan_residency
from engine.offload.runner import OffloadRunner
from engine.offload.streams import wait_on
from engine.sequence import Sequence
from engine.trace.events import COMPUTE, COMPUTING


class LayerwiseRunner(OffloadRunner):
    mode = "layerwise"

    def _make_offload_engine(self):
        a, cfg = self.args, self.config
        layer_bytes = self.max_blocks_per_seq * self.block_bytes // a.num_layers
        budget = None if cfg.gpu_kv_budget_gb is None else int(cfg.gpu_kv_budget_gb * 2**30)
        self.plan: ResidencyPlan = plan_residency(a.num_layers, cfg.ring_slots, layer_bytes,
                                                  self.block_bytes, budget)
        self.streamed = self.plan.streamed
        self._steps = 0  # ring positions continue across steps: streamed layer j of step k is at k * S + j
        self.table = torch.arange(self.max_blocks_per_seq, dtype=torch.int32, device=self.device)[None]
        return self._engine(self.plan.ring_slots, self.max_blocks_per_seq, self.plan.resident)

    def _buffer(self, layer: int) -> int:
        j = self.streamed.index(layer) if layer not in self.oe.resident else 0
        return self.oe.buffer_for(layer, self._steps * len(self.streamed) + j)

    def forward(self, seq: Sequence, is_prefill: bool) -> torch.Tensor:
        oe, bs, rec, model = self.oe, self.block_size, self.recorder, self.model
        start = seq.num_cached_tokens if is_prefill else len(seq) - 1
        end = len(seq)
        n_host, n_done = start // bs, end // bs      # complete blocks before / after this step
        table = seq.block_table
        h, residual, pos, (cos, sin) = self._inputs(seq, start, end)
        slots = torch.stack([pos // bs, pos % bs])
        context = None if is_prefill else torch.full((1,), end, dtype=torch.long, device=self.device)
        S, N = len(self.streamed), oe.ring_slots
        for layer in oe.resident:                    # cached prefix of resident layers (no-op once held)
            oe.load(oe.resident[layer], layer, table[:n_host])
        for j in range(min(N, S)):                   # no-op where last step's prefetch already did it
            oe.load(self._buffer(self.streamed[j]), self.streamed[j], table[:n_host])
        for l, layer in enumerate(model.layers):
            buf = self._buffer(l)
            with rec.span(COMPUTE, model.layer_names[l], l, slot=buf if buf < N else None):
                for ev in oe.ready(buf):
                    wait_on(ev, self.device, rec, l, buf if buf < N else None)
                if rec.enabled and buf < N:
                    rec.slot_state(buf, l, COMPUTING, end, oe.capacity_tokens)
                oe.writing(buf, n_host)
                K, V = oe.kv_views(buf)
                if start > n_host * bs:              # decode: the partly filled block, kept on the device
                    oe.buffers[buf][n_host].copy_(oe.dbuf[l])
                with rec.span(COMPUTE, "attention", l):
                    q = self._qkv(model.layers[l], h, residual, cos, sin, K, V, slots)
                    if is_prefill:
                        o = self._prefill_attention(q, buf, end, l)
                    else:
                        o = decode_attention(q, K, V, self.table[:, :n_done + 1], context, self.scale)
                    del q  # long prompts: q and o are 1 GiB each at 128K; the MLP needs only o
                self._finish_layer(model.layers[l], h, residual, o, l)
                self._after_layer(seq, l, buf, n_host, n_done, end, is_prefill)
            if buf < N:
                self._prefetch(seq, self.streamed.index(l), n_host, n_done, is_prefill)
            if model.task is not None:
                model.task.layer_done(l + 1, len(model.layers))
        self._steps += 1
        return self._logits(h, residual)

    def _qkv(self, layer, h, residual, cos, sin, K, V, slots) -> torch.Tensor:
        T = h.shape[0]
        a_ = layer.self_attn
        q = torch.empty((T, a_.nq, a_.d), dtype=h.dtype, device=h.device)
        for a in range(0, T, self.chunk_tokens):
            b = min(T, a + self.chunk_tokens)
            q[a:b], k, v = self._project(layer, h, residual, cos, sin, a, b)
            store_kv(k, v, K, V, slots[:, a:b])
        return q

    def _prefill_attention(self, q, buf: int, end: int, l: int) -> torch.Tensor:
        """The policy's prefill attention over the layer's whole K, V (cached prefix + new tokens)."""
        nb = -(-end // self.block_size)
        b = self.oe.buffers[buf][:nb]                                  # [nb, 2, Hkv, bs, D]
        hkv, d = b.shape[2], b.shape[4]
        k = b[:, 0].transpose(0, 1).reshape(hkv, -1, d)[:, :end]      # head-major copies [Hkv, end, D]
        v = b[:, 1].transpose(0, 1).reshape(hkv, -1, d)[:, :end]
        return self.policy.prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), l, self.scale)

    def _after_layer(self, seq, l, buf, n_host, n_done, end, is_prefill) -> None:
        oe, bs = self.oe, self.block_size
        if n_done > n_host:                                             # blocks completed in this step
            oe.offload(buf, l, list(range(n_host, n_done)), seq.block_table[n_host:n_done])
            hook = self.policy.on_prefill_offload if is_prefill else self.policy.on_decode_offload
            for i in range(n_host, n_done):
                hook(seq.block_table[i], l, oe.buffers[buf][i, 0], bs)
        if end % bs:                                                    # the partly filled block stays here
            oe.dbuf[l].copy_(oe.buffers[buf][n_done])
        oe.release(buf, l, end)

    def _prefetch(self, seq, j: int, n_host: int, n_done: int, is_prefill: bool) -> None:
        """Slot of streamed layer j is free: load streamed layer j + N into it (this step, or the next one)."""
        S, N = len(self.streamed), self.oe.ring_slots
        nxt = j + N
        if nxt < S:
            layer, blocks, k = self.streamed[nxt], seq.block_table[:n_host], self._steps
        elif not is_prefill and len(seq) < self.max_model_len:         # the next decode step's layers
            layer, blocks, k = self.streamed[nxt - S], seq.block_table[:n_done], self._steps + 1
        else:
            return
        self.oe.load(self.oe.buffer_for(layer, k * S + self.streamed.index(layer)), layer, blocks)
