"""Recorders: the engine reports spans, slot states, Quest picks and masks to one; it builds `StepTrace`s.

`Recorder` is the default and does nothing (no allocation per call: `span()` returns one shared null context).
Engine code guards heavier work with `if recorder.enabled:`. `TraceRecorder` records for real:

    rec = TraceRecorder(device=torch.device("cuda")); rec.begin_step("decode", n_tokens=1)
    with rec.span(H2D, "load kv", layer=3, stream=copy_stream, bytes=n): ...
    step = rec.end_step({"mem_gpu_allocated": ...})

Timing. On CPU (device None or not CUDA), and always for the `host` lane, spans are timed with
`time.perf_counter_ns()` on the thread that enters/exits them. On CUDA the other lanes record a pair of
timing events on `stream` (or the current stream) and nothing else: no host sync per span. `end_step`
records one end event on the current stream (in a step without a timeline only if it copied arrays to the
host), synchronizes the device ONCE, reads the host clock (`t_end`), and anchors the GPU timeline there:
every event is measured from the step-start event (recorded by `begin_step` on the current stream) with
`elapsed_time`, and the latest of them (the end event, or a side stream's last event) is placed at `t_end`,
since the sync returned when that work ended. The error of
the anchor is the wake-up latency of the sync (a few µs). `span()` must not be used inside CUDA-graph
capture: record events there yourself and hand them over with `add_event_span`, resolved the same way.
Timing events are pooled and reused from step to step. The reading is `engine/trace/event_clock.py`'s; in a step of
parts, the timed parts' records are read at the next part's start once their events have completed (no sync).

Detail. Every step is recorded with its metrics, Quest picks, masks and host spans. The per-layer timeline
(compute, copy and wait spans, ring slot states) is what costs: at a few hundred decode steps a second on a GPU
its CUDA events alone would slow the engine down by half. With `detail_hz` set (the app: the rate its views
redraw, `live_detail_hz`) a decode step gets that timeline only when 1/detail_hz seconds have passed since the last
detailed one; the others carry their metrics, picks and host-clock times (`StepTrace.detailed` says which).
Prefill and every step slower than 1/detail_hz are always detailed, but with detail_hz set a step of parts (a
chunked prefill's chunks: `begin_part`) times three parts only, its first, a middle one and its last but one (whose
records are then read while the last part runs, not by the next step): reading the events of a 6K chunked prefill's
24 chunks (7.8K spans and slot states) cost the first decode step ~55 ms on an H100 and an H200. After such a
prefill the next decode timeline comes a full 1/detail_hz after the prefill's end, not its start, except that the
second decode step after every prefill is detailed (`EARLY_DECODE`): at GPU speed a short answer in an offload mode
(32 tokens in ~0.1 s, the rate 3 a second) would otherwise show no decode timeline at all, only the prefill's. Not the
first: on CUDA it may capture graphs, and it reads the prefill's last timed records.
`StepTrace.windows` says where the timeline is. `detail` (per step, or part) tells engine code whether to record the
timeline; `enabled` whether to record at all. `mark()` records one pooled timing event (on the step's compute
stream unless given one): consecutive spans share their boundary marks.

Threads. Background copy threads may record spans concurrently with the main thread: every append goes
through one lock. A span belongs to the step that is open when it exits; records made while no step is open
are kept for the next one. With NVTX on (and CUDA), each span is also an NVTX range of the same name, and
each step a range named like the step ("decode 1 tok"). A span's `__enter__` returns None.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from engine.trace.base import NULL_RECORDER, NULL_SPAN, Recorder  # noqa: F401 - the no-op recorder, re-exported
from engine.trace.event_clock import EventClock
from engine.trace.events import (HOST, LANES, QuestPick, QuestPicks, SlotState, Span,
                                 StepTrace, live_detail_hz)
from engine.trace.grab import grab as _grab, masks_of as _masks_of, to_numpy as _to_numpy

PART_TIMELINES = 3   # the parts of a step with a timeline at a detail rate: its first, a middle one, its last but one


class _HostSpan:
    """A span timed with the host clock on the thread that enters and exits it."""
    __slots__ = ("rec", "lane", "name", "layer", "bytes", "slot", "args", "stream", "t0")

    def __init__(self, rec, lane, name, layer, nbytes, slot, args, stream=None):
        self.rec, self.lane, self.name, self.layer = rec, lane, name, layer
        self.bytes, self.slot, self.args, self.stream = nbytes, slot, args or None, stream

    def __enter__(self):
        if self.rec._nvtx is not None:
            self.rec._nvtx.range_push(self.name)
        self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc):
        t1, rec = time.perf_counter_ns(), self.rec
        span = Span(self.lane, self.name, (self.t0 - rec._base_ns) / 1e3, (t1 - rec._base_ns) / 1e3, self.layer,
                    self.bytes, self.slot, self.args)
        with rec._lock:
            rec._spans.append(span)
        if rec._nvtx is not None:
            rec._nvtx.range_pop()
        return False


class _EventSpan(_HostSpan):
    """A span timed by two CUDA events on its stream (`t0` holds the start event); resolved at end_step."""
    __slots__ = ()

    def __enter__(self):
        rec = self.rec
        if rec._nvtx is not None:
            rec._nvtx.range_push(self.name)
        self.t0 = rec.mark(self.stream)

    def __exit__(self, *exc):
        rec = self.rec
        e1 = rec.mark(self.stream)
        with rec._lock:
            rec._pending.append((self.lane, self.name, self.layer, self.bytes, self.slot, self.args, self.t0, e1))
        if rec._nvtx is not None:
            rec._nvtx.range_pop()
        return False


EARLY_DECODE = 2     # the decode step after each prefill that is detailed whatever the rate (see Detail above)


class TraceRecorder(Recorder):
    """Records steps into a bounded history (`steps`, newest last; `last`); calls `on_step` with each one."""
    enabled = True

    def __init__(self, max_steps: int = 256, device=None, nvtx: bool = True,
                 on_step: Callable[[StepTrace], None] | None = None, detail_hz: float | None = None):
        self._base_ns = time.perf_counter_ns()
        self.steps: deque[StepTrace] = deque(maxlen=max_steps)
        self.last: StepTrace | None = None
        self.on_step = on_step
        self.device = "cpu" if device is None else str(device)
        self._cuda = getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self._torch = self._nvtx = None
        if self._cuda:
            import torch
            self._torch = torch
            self._device = torch.device(device)
            if nvtx:
                self._nvtx = torch.cuda.nvtx
        self._lock = threading.Lock()
        self._pool: list = []            # reusable timing events (CUDA)
        self._step_no = 0
        self._open = False
        self._deferred = None            # a closed CUDA step whose events are read later (end_step(defer=True))
        self._stream = None              # the step's compute stream (CUDA), looked up once per step
        self._detail_every_us = 1e6 / detail_hz if detail_hz else 0.0
        self._last_detail_us = -1e18
        self._decodes = 0                # decode steps since the last prefill
        self.detail = True               # between steps (loading, tokenizing) everything is recorded
        self._step_detail = True
        self._clock: EventClock | None = None   # CUDA: the open step's timing events (a detailed step's)
        self._reset_buffers()

    @classmethod
    def live(cls, device=None, on_step: Callable[[StepTrace], None] | None = None, max_steps: int = 512,
             mode: str = "gpu") -> "TraceRecorder":
        """A recorder as the app's views use it: a decode step's per-layer timeline at their redraw rate
        (`live_detail_hz`: LIVE_DETAIL_HZ, or LOW_DETAIL_HZ on a CPU and in the offload modes on CUDA), every
        step's figures. The tools that measure what watching costs take this one too."""
        return cls(max_steps=max_steps, device=device, on_step=on_step,
                   detail_hz=live_detail_hz(str(device if device is not None else "cpu"), mode))

    def _reset_buffers(self):
        self._spans: list[Span] = []
        self._pending: list[tuple] = []       # (lane, name, layer, bytes, slot, args, e0, e1)
        self._slots: list[SlotState] = []
        self._pending_slots: list[tuple] = []  # (event, slot, layer, state, tokens, capacity)
        self._windows: list[tuple] = []         # detailed parts: (start, end) as host µs (CPU) or events (CUDA)
        self._parts = self._parts_detailed = 0
        self._part_start = None
        self._unsettled = False                 # CUDA: a timed part whose records are not read yet
        self._owned: list = []                 # this step's pooled events (back to the pool once read)
        self._quest: list[QuestPick] = []
        self._quest_bulk: list[tuple] = []
        self._masks: list[tuple] = []          # mask_summaries' entries: a layer's masks each
        self._grabbed = False                  # CUDA: arrays copied to the host asynchronously (read after an event)

    # ---------------------------------------------------------------- clock and events
    def now_us(self) -> float:
        """Host time in the recorder's time base (µs since it was created)."""
        return (time.perf_counter_ns() - self._base_ns) / 1e3

    def _event(self):
        try:
            return self._pool.pop()
        except IndexError:
            return self._torch.cuda.Event(enable_timing=True)

    # ---------------------------------------------------------------- recording
    def begin_step(self, phase: str, n_tokens: int = 0, timeline: bool = True) -> None:
        """Open a step (one that is still open is closed first, with metric `incomplete` = 1); decide whether it
        records the per-layer timeline (see Detail above; `timeline` False: not this one, a decode step whose first
        layers ran before it opened, as `next_detailed` allowed)."""
        if self._open:
            self.end_step({"incomplete": 1.0})
        self._phase, self._n_tokens, self._open = phase, int(n_tokens), True
        self._t_begin = now = self.now_us()
        self._decodes = self._decodes + 1 if phase == "decode" else 0
        self.detail = timeline and self._due(phase, now, self._decodes)
        if self.detail:
            self._last_detail_us = now
        if self._nvtx is not None:                # (CUDA only) closed by end_step
            self._nvtx.range_push(f"{phase} {n_tokens} tok")
        if self._cuda and self.detail:    # (a step without a timeline needs no stream: see end_step)
            self._stream = self._torch.cuda.current_stream(self._device)
            self._clock = EventClock(self.mark())
        elif self._cuda:
            self._clock = None
        self._step_detail = self.detail

    def _due(self, phase: str, now: float, decodes: int) -> bool:
        return phase != "decode" or now - self._last_detail_us >= self._detail_every_us or decodes == EARLY_DECODE

    def next_detailed(self) -> bool:
        """Would a decode step opened now, after the open one, record its timeline?"""
        return self._due("decode", self.now_us(), self._decodes + 1)

    def begin_part(self, i: int, n: int) -> None:
        """Part i of the open step's n begins (a chunked prefill's chunk): decide whether it records the per-layer
        timeline (see Detail above). Sets `detail`."""
        if not self._open or not self._step_detail:
            return
        self._close_part()
        if self._unsettled and self._windows[-1][1].query():   # read the timed parts' records while the step runs
            with self._lock:
                self._pending, self._pending_slots = self._clock.settle(self._pending, self._pending_slots)
            self._unsettled = False
        m = min(n, PART_TIMELINES) if self._detail_every_us else n
        self.detail = m == n or i in ({round(k * (n - 2) / (m - 1)) for k in range(m)} if m > 1 else {0})
        self._parts += 1
        if self.detail:
            self._parts_detailed += 1
            self._part_start = self.mark() if self._cuda else self.now_us()

    def _close_part(self) -> None:
        if self._part_start is not None:
            self._windows.append((self._part_start, self.mark() if self._cuda else self.now_us()))
            self._part_start = None
            self._unsettled = self._cuda

    def span(self, lane: str, name: str, layer: int | None = None, *, stream=None, bytes: int = 0,
             slot: int | None = None, **args):
        if lane != HOST:
            if not self.detail:
                return NULL_SPAN
            if self._cuda:
                return _EventSpan(self, lane, name, layer, bytes, slot, args, stream)
        return _HostSpan(self, lane, name, layer, bytes, slot, args)

    def mark(self, stream=None):
        """CUDA: a pooled timing event recorded now on `stream` (default: the step's compute stream), to bound
        spans with (`add_event_span`) and time slot states; it is this step's, read and pooled at its end.
        CPU: None."""
        if not self._cuda:
            return None
        ev = self._event()
        ev.record(stream if stream is not None else
                  self._stream if self._stream is not None else self._torch.cuda.current_stream(self._device))
        self._owned.append(ev)
        return ev

    def add_span(self, span: Span) -> None:
        """A span timed elsewhere, already in this recorder's time base (see `now_us`)."""
        with self._lock:
            self._spans.append(span)

    def add_event_span(self, lane: str, name: str, start_event, end_event, layer: int | None = None, *,
                       bytes: int = 0, slot: int | None = None, **args) -> None:
        """A span between two recorded timing CUDA events (e.g. inside a CUDA graph, or `mark()`s); resolved at
        end_step. Only in detailed steps (see Detail above)."""
        if not self.detail:
            return
        with self._lock:
            self._pending.append((lane, name, layer, bytes, slot, args or None, start_event, end_event))

    def slot_state(self, slot: int, layer: int | None, state: str, tokens: int, capacity: int, *,
                   stream=None, event=None) -> None:
        """A ring slot changed state (detailed steps only). On CUDA the time is that of `event` or of a new mark on
        `stream`."""
        if not self.detail:
            return
        if not self._cuda:
            rec = SlotState(self.now_us(), slot, layer, state, int(tokens), int(capacity))
            with self._lock:
                self._slots.append(rec)
            return
        if event is None:
            event = self.mark(stream)
        with self._lock:
            self._pending_slots.append((event, slot, layer, state, int(tokens), int(capacity)))

    def quest_pick(self, layer: int, kv_head: int, blocks, scores, n_blocks: int, positions=None,
                   page_size: int = 0) -> None:
        """Arrays may be numpy or torch (CUDA tensors are copied asynchronously, read after end_step's sync)."""
        c = self._grabbed = self._cuda
        with self._lock:
            self._quest.append(QuestPick(self._step_no, layer, kv_head, _grab(blocks, c), _grab(scores, c),
                                          int(n_blocks), None if positions is None else _grab(positions, c),
                                          int(page_size)))

    def quest_picks(self, layers: list[int], pages, scores, n_pages: list[int], positions, page_size: int) -> None:
        """A step's picks of several layers: pages, scores, positions [len(layers), Hkv, k], each to the host in one
        copy (async from CUDA); one QuestPick per (layer, kv head) when the step is read."""
        c = self._grabbed = self._cuda
        with self._lock:
            self._quest_bulk.append((list(layers), _grab(pages, c), _grab(scores, c), list(n_pages),
                                     _grab(positions, c), int(page_size), self._step_no))

    def mask_summaries(self, layer: int, vertical, slash, n: int, density, images=None) -> None:
        """A layer's masks, every head at once: vertical [Hq, NV] and slash [Hq, NS] (None: none), density [Hq],
        images [Hq, h, w] or None. One asynchronous copy each (CUDA), no host read: the step's end resolves them
        into one MaskSummary per head (a read per layer, or a copy per head, cost a sparse prefill 12-29%)."""
        c = self._grabbed = self._cuda
        bulk = (layer, None if vertical is None else _grab(vertical, c), None if slash is None else _grab(slash, c),
                int(n), _grab(density, c), None if images is None else _grab(images, c))
        with self._lock:
            self._masks.append(bulk)

    # ---------------------------------------------------------------- closing a step
    def end_step(self, metrics: dict | None = None, defer: bool = False) -> StepTrace | None:
        """Close the open step (None if none is open), store it, call `on_step`, and return it.

        defer=True (CUDA) is for a caller that has just synchronized (the engine, after reading the sampled
        tokens): the GPU is idle, so the host clock now is the step's end; the events are read later by
        `resolve_deferred()`, which the engine calls while the GPU runs the next step, keeping the reading off
        the critical path. Returns None then; `flush()` resolves whatever is still deferred."""
        if not self._open:
            return None
        self.resolve_deferred()  # steps stay in order
        self._close_part()
        metrics = dict(metrics or {})
        if self._parts:
            metrics.update(parts=float(self._parts), parts_detailed=float(self._parts_detailed))
        with self._lock:
            closing = [self._phase, self._n_tokens, self._step_no, self._t_begin, self._spans, self._pending,
                       self._slots, self._pending_slots, (self._quest, self._quest_bulk), self._masks,
                       metrics, self._owned, self._step_detail, self._windows if self._parts else None, None, None]
            grabbed = self._grabbed
            self._reset_buffers()
        self._step_no += 1
        self._open = False
        if self._phase != "decode" and self._step_detail:    # (a decode timeline waits a full interval after it)
            self._last_detail_us = self.now_us()
        self.detail = True
        if self._nvtx is not None:                # the step's range ends here, also when its events are read later
            self._nvtx.range_pop()
        if self._cuda:
            end = None            # an event after the step's work where its timeline or async copies are read after it
            if self._clock is not None or grabbed:
                end = self._event()
                end.record(self._stream if self._stream is not None else self._torch.cuda.current_stream(self._device))
            self._stream = None
            if not defer:
                self._torch.cuda.synchronize(self._device)
            closing[14:] = [self._clock, (end, self.now_us())]
            if defer:
                self._deferred = closing
                return None
        return self._finish(closing)

    def resolve_deferred(self) -> StepTrace | None:
        closing, self._deferred = self._deferred, None
        return None if closing is None else self._finish(closing)

    flush = resolve_deferred

    def _finish(self, closing) -> StepTrace:
        (phase, n_tokens, step_no, t_begin, spans, pending, slots, pending_slots, quest, masks, metrics, owned,
         detailed, windows, clock, end) = closing
        if self._cuda and clock is not None:    # (the clock's start event is a mark: owned)
            t0, windows = clock.finish(*end, pending, pending_slots, windows)
            t0, t1 = min(t0, t_begin), end[1]
            spans += clock.spans
            slots += clock.slots
            self._pool.append(end[0])
        elif self._cuda:                      # no timeline: host clock; the end event guards the async copies
            if end[0] is not None:
                end[0].synchronize()
                self._pool.append(end[0])
            t0, t1 = t_begin, end[1]
        else:
            t0, t1 = t_begin, self.now_us()
        self._pool += owned
        order = {lane: i for i, lane in enumerate(LANES)}
        spans.sort(key=lambda s: (order.get(s.lane, len(order)), s.lane, s.t0_us, -s.t1_us))
        slots.sort(key=lambda s: s.t_us)
        single, bulk = quest
        for q in single:
            q.blocks, q.scores = _to_numpy(q.blocks), _to_numpy(q.scores)
            q.positions = None if q.positions is None else _to_numpy(q.positions)
        quest = QuestPicks(single, [(step, layers, _to_numpy(pages, np.int32), _to_numpy(scores), n_pages,
                                     _to_numpy(positions, np.int32), page_size)
                                    for layers, pages, scores, n_pages, positions, page_size, step in bulk])
        masks = [m for entry in masks for m in _masks_of(entry)]
        lo = min([t0, *(s.t0_us for s in spans), *(s.t_us for s in slots)])
        hi = max([t1, *(s.t1_us for s in spans), *(s.t_us for s in slots)])
        step = StepTrace(step_no, phase, n_tokens, lo, hi, spans, slots, quest, masks, metrics, self.device, detailed,
                         windows)
        self.steps.append(step)
        self.last = step
        if self.on_step is not None:
            self.on_step(step)
        return step

    def clear(self) -> None:
        """Forget the history (step numbering goes on)."""
        self.steps.clear()
        self.last = None
