"""A layerwise decode step as one CUDA graph: every layer's compute and the loads between them, one launch.

The eager step issues, per layer, the waits for its buffer's load, the partly filled block's copy, the layer's
graph replay (engine/offload/decode_graphs.py), the buffer's release and the next layer's load into it: ~1.8 ms
of host time a step for the default model on an H200, whose copies take ~2.5 ms. Where the host's CPUs run at
half speed (the H200 machine's do, more often while other CPUs work, e.g. the app's window), the host, not the
copies, then sets the pace. Between two block boundaries every decode step of a sequence issues the same work:
the same layers into the same ring slots, the same host blocks copied, the partly filled block in the same place;
only the token and its position differ, and those are on the device. So such a step is recorded once and then
replayed: one launch (a graph of this shape, 30 layers' kernels and copies on two streams, launched in 0.12 ms
of host time on the H200, against 1.3 ms for per-layer replays with eager copies).

A step qualifies (`key`) when it is a decode step with no timeline recorded (a detailed step records each layer's
spans: it runs eagerly), under a policy that does not plan loads (Quest's pages change every step), with no block
filling in it or before it (offloads stay eager) and the next step's loads to make. It is recorded on the second
step alike in a row (the first, eager, leaves the ring as every later one finds it) where enough steps alike may
follow to pay for the recording (`_pays`), and replayed while the buffers hold what they held when it was
recorded, in the host blocks' current version (else it is recorded again). The replay waits for every copy left
pending; after it the offload engine holds what the recorded step left, and every event is the replay's end. The
next step's first loads (into the slots of the step's last layers) are left out of the graph and issued after its
launch, so that they overlap the sampling and the next launch, as in an eager step (inside the graph they delayed
its end: 3.04 against 2.92 ms a step, H200, default model's shape at 5.9K tokens). Each layer's compute goes into
the capture as its own recorded graph, one child node (`DecodeGraphs.prepare` records the ones missing first):
the capture then runs only the loads' Python, not every layer's kernels' launches.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.offload.decode_graphs import POSITION
from engine.offload.streams import compute_done, wait_on
from engine.step import QUIET
from engine.trace.recorder import NULL_RECORDER

KEEP = 8   # graphs kept (least recently used dropped): one per block count, ring phase and block table
RECORD_MIN_STEPS = 32    # recorded only where at least this many steps alike may follow (see `_pays`)


@dataclass
class _Step:
    graph: torch.cuda.CUDAGraph
    before: list      # the buffers' holdings the step was recorded from (StepGraphs._holdings)
    after: list       # ... and what it left
    packed: list      # the runner's packed-buffer entries it left
    bytes_h2d: int    # host-to-device bytes of one step


class StepGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.enabled = True
        self.steps: OrderedDict[tuple, _Step] = OrderedDict()
        self.replays = self.captures = 0
        self._seen = None      # the last eager step's key, its ring phase left out
        self._pool = None
        self._stream = None

    def clear(self) -> None:
        self.steps.clear()
        self._seen = None
        self._pool = None    # (a pool no graph holds any more cannot be captured into again)

    def key(self, seq, rec) -> tuple | None:
        """What makes two decode steps alike, or None where this one must run eagerly."""
        r, oe = self.runner, self.runner.oe
        bs, end = r.block_size, len(seq)
        start = end - 1
        if (not self.enabled or rec.detail or r.policy.plans_loads or start % bs == 0 or end % bs == 0
                or end >= r.max_model_len or oe._ahead):
            return None
        n_host = start // bs
        return (n_host, r._steps * len(r.streamed) % oe.ring_slots, tuple(seq.block_table[:n_host]),
                tuple(oe.resident.items()))

    def run(self, seq, ctx) -> bool:
        """Run this decode step's layers as one graph replay (recording it first where due) -> False: run it
        eagerly (it does not qualify, or is the first of its kind)."""
        key = self.key(seq, ctx.recorder)
        if key is None:
            self._seen = None
            return False
        alike = key[:1] + key[2:]
        step = self.steps.get(key)
        if step is None or not self._holds(step.before):   # (a prefill's ring, or blocks written since)
            step = self._record(key, seq, ctx) if self._seen == alike and self._pays(seq) else None
        if step is None:
            self._seen = alike
            return False
        self.steps.move_to_end(key)
        self._replay(step, seq, ctx)
        self._seen = None
        return True

    def _pays(self, seq) -> bool:
        """Recording costs ~11 ms of host time (H200, default model: each layer's graph is added to the capture as
        one node, engine/offload/child_graph.py; from Python, the layers' bodies took ~50 ms), a few steps' worth;
        a replay saves 0.2-1.4 ms a step (more where the host is slow). So a step is recorded only where enough
        steps alike may follow: before its block fills and the answer's `max_tokens` ends."""
        left = min(self.runner.block_size - len(seq) % self.runner.block_size,
                   seq.params.max_tokens - seq.num_completion_tokens)
        return left >= RECORD_MIN_STEPS

    def _holds(self, before: list) -> bool:
        """The buffers hold the blocks they held when the step was recorded, in their current version (an eager
        step would load nothing more into them than the recorded one did)."""
        oe = self.runner.oe
        ver = oe.versions
        for o, held, (o2, blocks, _) in zip(oe.owner, oe.held, before):
            if o != o2 or len(held) != len(blocks):
                return False
            for p, (layer, blk, v) in held.items():
                if blocks.get(p) != (layer, blk) or ver[layer].get(blk, 0) != v:
                    return False
        return True

    def _holdings(self) -> list:
        """The buffers' holdings without the blocks' versions (a new request's prefill writes blocks again: the
        step stays the same)."""
        return [(o, {p: (layer, blk) for p, (layer, blk, _) in held.items()}, None if same is None else same[1:])
                for o, held, same in self.runner.oe.holdings()]

    def _hold(self, holdings: list, done) -> None:
        oe = self.runner.oe
        ver, n = oe.versions, oe._rewrites
        oe.hold([(o, {p: (layer, blk, ver[layer].get(blk, 0)) for p, (layer, blk) in blocks.items()},
                  None if same is None else (n, *same)) for o, blocks, same in holdings], done)

    def _record(self, key: tuple, seq, ctx) -> _Step | None:
        r, oe, graphs = self.runner, self.runner.oe, self.runner.decode_graphs
        events = oe.loaded, oe.free, oe.read, oe.dbuf_read, oe.layer_written   # (hold() makes new lists)
        before, packed, bytes0 = self._holdings(), list(r._packed), oe.bytes_h2d
        graphs.prepare([POSITION] + [(l, r._buffer(l), 0, "all") for l in range(len(r.model.layers))], r.block_size)
        oe.hold(oe.holdings(), None)         # no event made before the capture is waited for inside it
        if self._stream is None:
            self._stream = torch.cuda.Stream(r.device)
        graph = torch.cuda.CUDAGraph()
        graphs.inline = True
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    oe.begin_step(NULL_RECORDER)
                    graphs.inputs_from_position(r.block_size)
                    r._layers(seq, False, QUIET, graphs, graphs.h, graphs.residual, None, None, None, ahead=False)
                    for e in oe.pending():        # the copy streams join the capture's stream
                        oe.compute.wait_event(e)
                finally:
                    graph.capture_end()
            after, packed_after = self._holdings(), list(r._packed)
        except Exception as e:   # noqa: BLE001 - the step runs eagerly, and so do all later ones
            self.enabled = False
            warnings.warn(f"layerwise decode: recording a whole step as a CUDA graph failed ({type(e).__name__}: "
                          f"{e}); decode steps run layer by layer from now on", stacklevel=2)
            return None
        finally:                             # the capture ran nothing: back to the state before it
            graphs.inline = False
            oe.begin_step(ctx.recorder)
            self._hold(before, None)
            oe.loaded, oe.free, oe.read, oe.dbuf_read, oe.layer_written = events
            r._packed[:] = packed
            step_bytes, oe.bytes_h2d = oe.bytes_h2d - bytes0, bytes0
        self._pool = graph.pool()
        step = self.steps[key] = _Step(graph, before, after, packed_after, step_bytes)
        if len(self.steps) > KEEP:
            self.steps.popitem(last=False)
        self.captures += 1
        return step

    def _replay(self, step: _Step, seq, ctx) -> None:
        r, oe, graphs = self.runner, self.runner.oe, self.runner.decode_graphs
        graphs.set_token(seq.token_ids[-1], len(seq) - 1)
        for e in oe.pending():
            wait_on(e, r.device, stream=oe.compute, waited=oe.compute_waited)
        step.graph.replay()
        self._hold(step.after, compute_done(r.device, oe.compute))
        r._packed[:] = step.packed
        oe.bytes_h2d += step.bytes_h2d
        graphs._meta_now[0] = None           # meta[0] holds the position's row now
        r.prefetch_next(seq, ctx)
        self.replays += 1
