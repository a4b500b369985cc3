"""CUDA graphs of one layer's decode compute in layerwise mode, one per (layer, buffer, layout).

At batch 1 a decode layer is ~15 small kernels (norm, qkv, q/k norm + rope, KV store, split-K attention and its
reduce, o_proj, norm, MLP) whose launches cost more host time than their GPU time: measured on an H100 at 32K
tokens with Quest, ~2 ms of Python and launches per layer, 21 ms of GPU work per 36-layer step against 76 ms of
host time. A graph replays them in one launch. Everything around the compute stays eager and per step: waits
on the copy events, the partly filled block copied in, the offloads, Quest's selection, the prefetches.

Inputs are static tensors the step fills before the replays: hidden state and residual (updated in place layer
after layer), rotary cos/sin, and per layout a [3] meta row (block position of the new token in the buffer, its
offset in the block, the context length the attention sees): row 0 for buffers holding whole blocks, row 1 for
buffers packed by Quest's page gather. q comes out in a static tensor (Quest selects with it).
"""
from __future__ import annotations

import torch

from engine.ops.attention import decode_attention
from engine.trace.recorder import NULL_RECORDER


class DecodeGraphs:
    def __init__(self, runner):
        a, dev, dt = runner.args, runner.device, runner.dtype
        self.runner = runner
        self.h = torch.zeros(1, a.hidden_size, dtype=dt, device=dev)
        self.residual = torch.zeros_like(self.h)
        self.cos = torch.zeros(1, 1, a.head_dim, dtype=dt, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.q = torch.zeros(1, a.num_heads, a.head_dim, dtype=dt, device=dev)
        self.meta = torch.zeros(2, 3, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._meta_set: set[int] = set()
        self._warm: set[tuple[int, int, int]] = set()

    def begin(self, h, residual, cos, sin) -> None:
        """A new decode step: its inputs into the static tensors."""
        self.h.copy_(h)
        self.residual.copy_(residual)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self._meta_set.clear()

    def run(self, layer: int, buf: int, packed: bool, at: int, offset: int, context: int) -> torch.Tensor:
        """Replay (capturing on first use) the layer's compute over buffer `buf`; -> q [1, Hq, D] (static)."""
        v = int(packed)
        if v not in self._meta_set:       # one small copy per layout and step
            self.meta[v].copy_(torch.tensor([at, offset, context]))
            self._meta_set.add(v)
        key = (layer, buf, v)
        graph = self.graphs.get(key)
        if graph is None and key not in self._warm:   # first time: eager (compiles what the capture will record)
            self._warm.add(key)
            self._body(layer, buf, v)
            return self.q
        if graph is None:
            graph = self.graphs[key] = self._capture(layer, buf, v)
        graph.replay()
        return self.q

    def _body(self, layer: int, buf: int, v: int) -> None:
        r = self.runner
        K, V = r.oe.kv_views(buf)
        mod = r.model.layers[layer]
        q = r._qkv(mod, self.h, self.residual, self.cos, self.sin, K, V, self.meta[v, :2, None])
        self.q.copy_(q)
        o = decode_attention(q, K, V, r.table, self.meta[v, 2:3], r.scale)
        r._finish_layer(mod, self.h, self.residual, o, layer)

    def _capture(self, layer: int, buf: int, v: int) -> torch.cuda.CUDAGraph:
        r = self.runner
        rec, r._recorder = r._recorder, NULL_RECORDER   # no spans (CUDA events) inside a capture
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self._body(layer, buf, v)
        finally:
            r._recorder = rec
        self.pool = graph.pool()
        return graph
