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
from engine.offload.decode_graphs import DecodeGraphs
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
        prefer = tuple(range(getattr(self.policy, "dense_layers", 0))) if self.policy.requires_block_selection else ()
        self.plan: ResidencyPlan = plan_residency(a.num_layers, cfg.ring_slots, layer_bytes,
                                                  self.block_bytes, budget, prefer)
        self.streamed = self.plan.streamed
        self._steps = 0  # ring positions continue across steps: streamed layer j of step k is at k * S + j
        self.table = torch.arange(self.max_blocks_per_seq, dtype=torch.int32, device=self.device)[None]
        oe = self._engine(self.plan.ring_slots, self.max_blocks_per_seq, self.plan.resident)
        self._graphs = (DecodeGraphs(self) if self.device.type == "cuda" and not cfg.enforce_eager else None)
        self._packed: list = [None] * len(oe.buffers)  # buffer -> (layer, packed blocks) when loaded by pages
        self._step_recall: dict[int, float] = {}       # layer -> Quest's recall measured this step
        return oe

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
        graphs = None if is_prefill else self._graphs
        if graphs is not None:       # decode: each layer's compute is one graph replay over static inputs
            graphs.begin(h, residual, cos, sin)
            h, residual = graphs.h, graphs.residual
        if is_prefill:
            self._chosen.clear()     # a new sequence: selections are made again from its own queries
        self._step_recall = {}
        self._table_to_device(table)
        S, N = len(self.streamed), oe.ring_slots
        for layer in oe.resident:                    # cached prefix of resident layers (no-op once held)
            self._load(oe.resident[layer], layer, table[:n_host], is_prefill)
        for j in range(min(N, S)):                   # no-op where last step's prefetch already did it
            self._load(self._buffer(self.streamed[j]), self.streamed[j], table[:n_host], is_prefill)
        for l, layer in enumerate(model.layers):
            buf = self._buffer(l)
            packed = self._packed[buf] if self._packed[buf] and self._packed[buf][0] == l else None
            at = n_host if packed is None else packed[1]  # where block n_host sits in the buffer
            with rec.span(COMPUTE, model.layer_names[l], l, slot=buf if buf < N else None):
                for ev in oe.ready(buf):
                    wait_on(ev, self.device, rec, l, buf if buf < N else None)
                if rec.enabled and buf < N:
                    rec.slot_state(buf, l, COMPUTING, end, oe.capacity_tokens)
                oe.writing(buf, at)
                K, V = oe.kv_views(buf)
                if start > n_host * bs:              # decode: the partly filled block, kept on the device
                    oe.buffers[buf][at].copy_(oe.dbuf[l])
                recall = packed is not None and self._quest.measure_recall
                if graphs is not None and not recall:      # decode, one replay: q out, h and residual in place
                    q = graphs.run(l, buf, packed is not None, at, start % bs, end - (n_host - at) * bs)
                    q_last = q[0] if self._quest is not None else None
                else:
                    with rec.span(COMPUTE, "attention", l):
                        where = slots if packed is None else torch.stack([slots[0] - n_host + at, slots[1]])
                        q = self._qkv(model.layers[l], h, residual, cos, sin, K, V, where)
                        q_last = q[-1].clone() if self._quest is not None else None
                        if recall:
                            self._measure_recall(l, q[0], n_host, end, buf, at)
                        if is_prefill:
                            o = self._prefill_attention(q, buf, end, l)
                        else:
                            ctx = context if packed is None else context - (n_host - at) * bs
                            o = decode_attention(q, K, V, self.table[:, :at + 1], ctx, self.scale)
                        del q  # long prompts: q and o are 1 GiB each at 128K; the MLP needs only o
                    self._finish_layer(model.layers[l], h, residual, o, l)
                self._after_layer(seq, l, buf, n_host, n_done, end, is_prefill, at)
                if q_last is not None:
                    self._select(l, q_last, max(0, n_done - 1))
            if buf < N:
                self._prefetch(seq, self.streamed.index(l), n_host, n_done, is_prefill)
            if model.task is not None:
                model.task.layer_done(l + 1, len(model.layers))
        self._steps += 1
        return self._logits(h, residual)

    def step_metrics(self) -> dict:
        """Bytes moved; with Quest's recall measured, this step's recall: the mean over the sparse layers
        (`quest_recall`), the lowest layer's (`quest_recall_min`) and each layer's (`quest_recall_l<layer>`)."""
        m = super().step_metrics()
        recall = self._step_recall
        if recall:
            m["quest_recall"] = sum(recall.values()) / len(recall)
            m["quest_recall_min"] = min(recall.values())
            m.update({f"quest_recall_l{l}": r for l, r in recall.items()})
        return m

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

    def _after_layer(self, seq, l, buf, n_host, n_done, end, is_prefill, at) -> None:
        """Offload the blocks completed in this step (block n_host sits at buffer position `at`), keep the partly
        filled one in the decode buffer, release the buffer."""
        oe, bs = self.oe, self.block_size
        if n_done > n_host:                                             # blocks completed in this step
            positions = list(range(at, at + n_done - n_host))
            oe.offload(buf, l, positions, seq.block_table[n_host:n_done])
            hook = self.policy.on_prefill_offload if is_prefill else self.policy.on_decode_offload
            for p, i in zip(positions, range(n_host, n_done)):
                hook(seq.block_table[i], l, oe.buffers[buf][p, 0], bs)
        if end % bs:                                                    # the partly filled block stays here
            oe.dbuf[l].copy_(oe.buffers[buf][at + n_done - n_host])
        oe.release(buf, l, end)

    # ---------------------------------------------------------------- block selection (Quest)
    def _load(self, buf: int, layer: int, blocks: list[int], is_prefill: bool) -> None:
        """Load a layer's host blocks into a buffer: all of them, or, where the policy selects, the pages it
        chose (at the previous step, or from the prompt's last query) plus the newest block's pages."""
        quest = self._quest
        chosen = None if quest is None or is_prefill or layer in self.oe.resident else self._chosen.get(layer)
        if chosen is None or not quest.applies(layer, len(blocks)):
            self._packed[buf] = None
            self.oe.load(buf, layer, blocks)
            return
        kb = (chosen.shape[1] + quest.pages_per_block) // quest.pages_per_block   # packed blocks
        key = (layer, kb, self._chosen_version[layer], blocks[-1])
        if self._packed[buf] == key:  # already loaded (the previous step's prefetch)
            return
        newest = quest.page_ids(self._table_dev[len(blocks) - 1:len(blocks)])[None].expand(chosen.shape[0], -1)
        self.oe.load_pages(buf, layer, torch.cat([chosen, newest], dim=1), quest.page_size)
        self._packed[buf] = key

    def _measure_recall(self, l: int, q: torch.Tensor, n_host: int, end: int, buf: int, at: int) -> None:
        """Debug: the true attention mass on what this step loaded (chosen pages, newest full block, partial
        block), from the layer's whole K read back from the host pool."""
        quest, oe, bs = self._quest, self.oe, self.block_size
        oe.synchronize()                                                  # the host copies of earlier blocks
        k = oe.host[l, self._table_dev[:n_host].to(oe.host.device), 0].to(self.device)   # [n, Hkv, bs, D]
        k = torch.cat([k.transpose(0, 1).flatten(1, 2), oe.buffers[buf][at, 0, :, :end - n_host * bs]], dim=1)
        ppb, p = quest.pages_per_block, quest.page_size
        loaded = torch.zeros(k.shape[0], end, dtype=torch.bool, device=self.device)
        pages = loaded[:, :n_host * bs].view(k.shape[0], n_host * ppb, p)
        pages.scatter_(1, self._chosen_pos[l][:, :, None].expand(-1, -1, p), True)
        loaded[:, (n_host - 1) * bs:] = True                              # newest full block + the partial one
        r = quest.recall(q, k, loaded, self.scale)
        quest.note_recall(l, r)
        self._step_recall[l] = r.mean().item()     # for this step's trace (recall already synchronises)
        now, _ = quest.select(l, q, self._table_dev[:n_host - 1], self._chosen_pos[l].shape[1])
        loaded[:, :(n_host - 1) * bs] = False
        pages.scatter_(1, now[:, :, None].expand(-1, -1, p), True)
        quest.note_recall(l, quest.recall(q, k, loaded, self.scale), "recall_current_query")

    def _prefetch(self, seq, j: int, n_host: int, n_done: int, is_prefill: bool) -> None:
        """Slot of streamed layer j is free: load streamed layer j + N into it (this step, or the next one)."""
        S, N = len(self.streamed), self.oe.ring_slots
        nxt = j + N
        if nxt < S:  # this step's: dense in a prefill (a stale selection must not leak into it)
            layer, blocks, k, prefill = self.streamed[nxt], seq.block_table[:n_host], self._steps, is_prefill
        elif not is_prefill and len(seq) < self.max_model_len:         # the next decode step's layers
            layer, blocks, k, prefill = self.streamed[nxt - S], seq.block_table[:n_done], self._steps + 1, False
        else:
            return
        self._load(self.oe.buffer_for(layer, k * S + self.streamed.index(layer)), layer, blocks, prefill)
