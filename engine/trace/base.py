"""The no-op recorder: what the engine reports to when nobody watches (see recorder.py for the one that records).

Every method does nothing and keeps nothing; `span()` returns one shared null context, so a call costs nothing
but the call. `enabled` (record at all) and `detail` (record the per-layer timeline of this step) are False.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.trace.events import StepTrace


class _NullSpan:
    """The context `Recorder.span()` returns: shared, stateless, free."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


NULL_SPAN = _NullSpan()


class Recorder:
    """The no-op recorder: every method does nothing and keeps nothing."""
    enabled = False
    detail = False
    steps: tuple | deque = ()
    last: StepTrace | None = None
    on_step: Callable[[StepTrace], None] | None = None

    def begin_step(self, phase: str, n_tokens: int = 0, timeline: bool = True) -> None:
        pass

    def next_detailed(self) -> bool:
        return False

    def begin_part(self, i: int, n: int) -> None:
        pass

    def span(self, lane: str, name: str, layer: int | None = None, *, stream=None, bytes: int = 0,
             slot: int | None = None, **args):
        return NULL_SPAN

    def add_span(self, span: Span) -> None:
        pass

    def mark(self, stream=None):
        return None

    def add_event_span(self, lane: str, name: str, start_event, end_event, layer: int | None = None, *,
                       bytes: int = 0, slot: int | None = None, **args) -> None:
        pass

    def slot_state(self, slot: int, layer: int | None, state: str, tokens: int, capacity: int, *,
                   stream=None, event=None) -> None:
        pass

    def quest_pick(self, layer: int, kv_head: int, blocks, scores, n_blocks: int, positions=None,
                   page_size: int = 0) -> None:
        pass

    def quest_picks(self, layers: list[int], pages, scores, n_pages: list[int], positions, page_size: int) -> None:
        pass

    def mask_summaries(self, layer: int, vertical, slash, n: int, density, images=None) -> None:
        pass

    def end_step(self, metrics: dict | None = None, defer: bool = False) -> StepTrace | None:
        return None

    def resolve_deferred(self) -> StepTrace | None:
        return None

    def flush(self) -> StepTrace | None:
        return None

    def now_us(self) -> float:
        return 0.0

    def clear(self) -> None:
        pass


NULL_RECORDER = Recorder()
