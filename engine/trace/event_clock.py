"""A step's CUDA timing events read on the host clock (TraceRecorder's CUDA path; its docstring says how).

Reading an event costs ~3.4 µs (`elapsed_time`), so a step with thousands of records costs milliseconds to read.
`settle` reads, while a long step still runs, the records whose events have completed (no sync), so that less is
left for `finish`, which runs after the step and is then on the next step's path.
"""
from __future__ import annotations

from engine.trace.events import SlotState, Span


class EventClock:
    """Records (`pending` spans as (lane, name, layer, bytes, slot, args, e0, e1), `pending_slots` as (event, slot,
    layer, state, tokens, capacity)) read as µs after the step's start event, each event once; `spans` and `slots`
    hold what is read so far."""

    def __init__(self, start):
        self.start = start
        self.spans: list[Span] = []
        self.slots: list[SlotState] = []
        self._seen: dict[int, tuple[float, object]] = {}   # id -> (µs, the event: held, so its id is not reused)

    def _rel(self, ev) -> float:
        key = id(ev)
        if key not in self._seen:
            self._seen[key] = (self.start.elapsed_time(ev) * 1e3, ev)
        return self._seen[key][0]

    def _read(self, pending: list, pending_slots: list, ready_only: bool) -> tuple[list, list]:
        """Read the records (those whose events have completed, with ready_only) -> the records left. A record
        with an event that was never recorded is dropped."""
        left, left_slots = [], []
        for rec in pending:
            if ready_only and not (rec[7].query() and rec[6].query()):
                left.append(rec)
                continue
            try:
                self.spans.append(Span(*rec[:2], self._rel(rec[6]), self._rel(rec[7]), *rec[2:6]))
            except RuntimeError:
                pass
        for rec in pending_slots:
            if ready_only and not rec[0].query():
                left_slots.append(rec)
                continue
            try:
                self.slots.append(SlotState(self._rel(rec[0]), *rec[1:]))
            except RuntimeError:
                pass
        return left, left_slots

    def settle(self, pending: list, pending_slots: list) -> tuple[list, list]:
        """While the step runs: read the records whose events have completed -> the records left."""
        if not self.start.query():
            return pending, pending_slots
        return self._read(pending, pending_slots, ready_only=True)

    def finish(self, end, t_end: float, pending: list, pending_slots: list, windows: list | None):
        """After the step (`end`: its end event, `t_end`: the host time it was synchronized at): read the rest and
        place everything on the host clock, the latest event at t_end (the sync returned when the last GPU work
        ended) -> (the step's start on the host clock, `windows` as host times)."""
        end.synchronize()
        self._read(pending, pending_slots, ready_only=False)
        last = max([self._rel(end), *(s.t1_us for s in self.spans), *(s.t_us for s in self.slots)])
        t_start = t_end - last
        for s in self.spans:
            s.t0_us += t_start
            s.t1_us += t_start
        for s in self.slots:
            s.t_us += t_start
        if windows is not None:
            windows = [(self._rel(a) + t_start, self._rel(b) + t_start) for a, b in windows]
        return t_start, windows
