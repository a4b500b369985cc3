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

Intervals = list[tuple[float, float]]


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


def merge(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint union of intervals (empty and reversed ones dropped; touching ones joined).

    Vectorised (the timeline asks for thousands of spans a few times a second): sorted by start, an interval
    begins a new run when it starts after every earlier end; a run ends at the largest end in it."""
    if not isinstance(intervals, (list, np.ndarray)):
        intervals = list(intervals)
    a = np.asarray(intervals, dtype=np.float64).reshape(-1, 2)
    a = a[a[:, 1] > a[:, 0]]
    if not len(a):
        return []
    a = a[np.argsort(a[:, 0], kind="stable")]
    reach = np.maximum.accumulate(a[:, 1])
    first = np.flatnonzero(np.r_[True, a[1:, 0] > reach[:-1]])
    last = np.r_[first[1:] - 1, len(a) - 1]
    return list(zip(a[first, 0].tolist(), reach[last].tolist()))


def clip(merged: Intervals, t0: float, t1: float) -> Intervals:
    return [(max(a, t0), min(b, t1)) for a, b in merged if b > t0 and a < t1]


def intersect(x: Intervals, y: Intervals) -> Intervals:
    """Intersection of two merged interval lists (two pointers)."""
    out: Intervals = []
    i = j = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def total(merged: Intervals) -> float:
    return sum(b - a for a, b in merged)


def summarize(trace: StepTrace | Iterable[StepTrace] | Iterable[Span], t0: float | None = None,
              t1: float | None = None) -> TraceSummary:
    """Summary of a step, steps or spans over [t0, t1] (default: the steps' extent, or the spans')."""
    if isinstance(trace, StepTrace):
        trace = [trace]
    spans: list[Span] = []
    lo, hi = float("inf"), float("-inf")
    detailed, gaps = [], False       # steps without a timeline (TraceRecorder's detail) are left out of the window
    for item in trace:
        if isinstance(item, StepTrace):
            timeline = item.timeline
            if timeline != [(item.t0_us, item.t1_us)]:
                gaps = True
            if not timeline:
                continue
            spans += item.spans
            detailed += timeline
        else:
            spans.append(item)
        lo, hi = min(lo, item.t0_us), max(hi, item.t1_us)
    t0 = (lo if lo <= hi else 0.0) if t0 is None else t0
    t1 = (hi if lo <= hi else 0.0) if t1 is None else t1
    window = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in detailed) if gaps else t1 - t0

    by_lane: dict[str, list[Span]] = {lane: [] for lane in LANES}
    for s in spans:
        by_lane.setdefault(s.lane, []).append(s)
    ends = {lane: np.array([(s.t0_us, s.t1_us) for s in ss], dtype=np.float64).reshape(-1, 2)
            for lane, ss in by_lane.items()}
    unions = {lane: clip(merge(e), t0, t1) for lane, e in ends.items()}
    busy = {lane: total(u) for lane, u in unions.items()}
    counts = {lane: int(((e[:, 1] >= t0) & (e[:, 0] <= t1)).sum()) for lane, e in ends.items()}

    copy = merge(iv for lane in COPY_LANES for iv in unions[lane])
    copy_us = total(copy)
    overlap_us = total(intersect(copy, unions[COMPUTE]))

    nbytes: dict[str, float] = {}
    for lane in COPY_LANES:
        n = 0.0
        for s in by_lane[lane]:
            if s.bytes:
                d = s.t1_us - s.t0_us
                if d <= 0:
                    n += s.bytes if t0 <= s.t0_us <= t1 else 0
                else:
                    n += s.bytes * min(1.0, max(0.0, min(s.t1_us, t1) - max(s.t0_us, t0)) / d)
        nbytes[lane] = n
    gbps = {lane: nbytes[lane] / (busy[lane] * 1e3) if busy[lane] > 0 else 0.0 for lane in COPY_LANES}
    return TraceSummary(
        t0_us=t0, t1_us=t1,
        busy_fraction={lane: (b / window if window > 0 else 0.0) for lane, b in busy.items()},
        busy_us=busy, span_count=counts,
        overlap_fraction=overlap_us / copy_us if copy_us > 0 else 0.0,
        copy_us=copy_us, exposed_copy_us=copy_us - overlap_us, bytes=nbytes, gbps=gbps)
