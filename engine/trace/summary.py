"""Figures from spans: how busy each lane was, how much copying hid behind compute, copy bandwidth.

    s = summarize(step)                      # one step, a list of steps, or a list of spans
    s = summarize(rec.steps, t0=..., t1=...)  # a time window
    (steps recorded without a timeline, `StepTrace.detailed` False, are skipped: the window is then the detailed
    steps' own time inside [t0, t1]; of a step timed in some of its parts, `StepTrace.windows`, those parts' time)
    s.busy_fraction["h2d"], s.overlap_fraction, s.exposed_copy_us, s.gbps["h2d"]

All figures use interval unions (sort + merge, O(n log n)), so nested or overlapping spans of one lane (two
copy threads) count their common time once. Definitions, for a window [t0, t1]:

- busy_fraction[lane] = |union of the lane's spans ∩ window| / (t1 - t0)
- copy time = |union of h2d and d2h spans ∩ window|;  overlap time = |copy ∩ compute|
- overlap_fraction = overlap time / copy time (0 without copies); exposed_copy_us = copy time - overlap time
- bytes[lane]: a span's bytes, pro-rated by the part of it inside the window; gbps[lane] = bytes / busy time
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from engine.trace.events import COMPUTE, COPY_LANES, LANES, Span, StepTrace

@dataclass(frozen=True)
class TraceSummary:
    t0_us: float
    t1_us: float
    busy_fraction: dict[str, float]   # every lane in LANES (and any other lane seen)
    busy_us: dict[str, float]
    span_count: dict[str, int]
    overlap_fraction: float
    copy_us: float
    exposed_copy_us: float
    bytes: dict[str, float]           # copy lanes
    gbps: dict[str, float]            # copy lanes; 0 where the lane was idle

    @property
    def window_us(self) -> float:
        return self.t1_us - self.t0_us

    def to_dict(self) -> dict:
        return asdict(self)


def merge(intervals) -> np.ndarray:
    """Sorted, disjoint union of intervals ([n, 2] array or pairs -> [k, 2] float64 array; empty and reversed ones
    dropped; touching ones joined).

    Vectorised (the timeline asks for thousands of spans a few times a second): sorted by start, an interval
    begins a new run when it starts after every earlier end; a run ends at the largest end in it."""
    a = np.asarray(intervals if isinstance(intervals, (list, np.ndarray)) else list(intervals),
                   dtype=np.float64).reshape(-1, 2)
    a = a[a[:, 1] > a[:, 0]]
    if not len(a):
        return a
    a = a[np.argsort(a[:, 0], kind="stable")]
    reach = np.maximum.accumulate(a[:, 1])
    first = np.flatnonzero(np.r_[True, a[1:, 0] > reach[:-1]])
    last = np.r_[first[1:] - 1, len(a) - 1]
    return np.stack([a[first, 0], reach[last]], axis=1)


def clip(merged: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """A merged union cut to [t0, t1]."""
    c = np.clip(merged, t0, t1)
    return c[c[:, 1] > c[:, 0]]


def total(merged: np.ndarray) -> float:
    return float((merged[:, 1] - merged[:, 0]).sum())


def lane_arrays(spans: Iterable[Span]) -> dict[str, np.ndarray]:
    """Spans by lane (every lane of LANES, and any other seen) as [n, 3] float64 arrays of (t0_us, t1_us, bytes):
    what `summarize` computes from. A view that summarizes the same steps again and again keeps each step's."""
    by_lane: dict[str, list[Span]] = {lane: [] for lane in LANES}
    for s in spans:
        by_lane.setdefault(s.lane, []).append(s)
    return {lane: np.array([[s.t0_us for s in ss], [s.t1_us for s in ss], [float(s.bytes) for s in ss]],
                           dtype=np.float64).reshape(3, -1).T for lane, ss in by_lane.items()}


def summarize(trace: StepTrace | Iterable[StepTrace] | Iterable[Span], t0: float | None = None,
              t1: float | None = None, arrays: Iterable[dict[str, np.ndarray]] | None = None) -> TraceSummary:
    """Summary of a step, steps or spans over [t0, t1] (default: the steps' extent, or the spans').
    arrays: for steps, each one's `lane_arrays(step.spans)`, made before, in the same order."""
    if isinstance(trace, StepTrace):
        trace = [trace]
    made = iter(arrays) if arrays is not None else None
    spans: list[Span] = []
    parts: list[dict[str, np.ndarray]] = []
    lo, hi = float("inf"), float("-inf")
    detailed, gaps = [], False       # steps without a timeline (TraceRecorder's detail) are left out of the window
    for item in trace:
        if isinstance(item, StepTrace):
            timeline = item.timeline
            known = next(made) if made is not None else None
            if timeline != [(item.t0_us, item.t1_us)]:
                gaps = True
            if not timeline:
                continue
            if known is not None:
                parts.append(known)
            else:
                spans += item.spans
            detailed += timeline
        else:
            spans.append(item)
        lo, hi = min(lo, item.t0_us), max(hi, item.t1_us)
    t0 = (lo if lo <= hi else 0.0) if t0 is None else t0
    t1 = (hi if lo <= hi else 0.0) if t1 is None else t1
    window = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in detailed) if gaps else t1 - t0

    parts.append(lane_arrays(spans))
    names = dict.fromkeys(k for p in parts for k in p)        # LANES first, in order, then any other
    lanes = {lane: np.concatenate([p[lane] for p in parts if lane in p]) for lane in names}
    unions = {lane: clip(merge(e[:, :2]), t0, t1) for lane, e in lanes.items()}
    busy = {lane: total(u) for lane, u in unions.items()}
    counts = {lane: int(((e[:, 1] >= t0) & (e[:, 0] <= t1)).sum()) for lane, e in lanes.items()}

    copy = merge(np.concatenate([unions[lane] for lane in COPY_LANES]))
    copy_us = total(copy)
    # |copy ∩ compute| = |copy| + |compute| - |copy ∪ compute| (each a disjoint union: no double counting)
    overlap_us = copy_us + busy[COMPUTE] - total(merge(np.concatenate([copy, unions[COMPUTE]])))
    overlap_us = min(copy_us, max(0.0, overlap_us))     # (rounding)

    nbytes: dict[str, float] = {}
    for lane in COPY_LANES:          # a span's bytes pro-rated by its share inside the window (an instant: in or out)
        a, b, n = lanes[lane].T
        d = b - a
        inside = np.minimum(1.0, np.clip(np.minimum(b, t1) - np.maximum(a, t0), 0.0, None) / np.where(d > 0, d, 1.0))
        nbytes[lane] = float((n * np.where(d > 0, inside, (a >= t0) & (a <= t1))).sum())
    gbps = {lane: nbytes[lane] / (busy[lane] * 1e3) if busy[lane] > 0 else 0.0 for lane in COPY_LANES}
    return TraceSummary(
        t0_us=t0, t1_us=t1,
        busy_fraction={lane: (b / window if window > 0 else 0.0) for lane, b in busy.items()},
        busy_us=busy, span_count=counts,
        overlap_fraction=overlap_us / copy_us if copy_us > 0 else 0.0,
        copy_us=copy_us, exposed_copy_us=copy_us - overlap_us, bytes=nbytes, gbps=gbps)
