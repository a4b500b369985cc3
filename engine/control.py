"""TaskState: how a caller steers a long engine call from another thread (the idea of Orange3's TaskState).

The engine calls `layer_done()` after every layer of every step: it raises `Cancelled` once `cancel` is set
(so Stop takes effect within one layer's time, even in the middle of a long prefill) and reports prefill
progress. It is a host-side flag check: no device sync.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from engine.errors import Cancelled


class TaskState:
    def __init__(self, cancel: threading.Event | None = None,
                 on_progress: Callable[[float, str], None] | None = None):
        self.cancel = cancel if cancel is not None else threading.Event()
        self.on_progress = on_progress

    def layer_done(self, done: int, total: int, prefill: bool) -> None:
        """`done` of `total` units of this step's work are finished (layers, or chunk x layers); progress is
        reported for prefill steps only."""
        if self.cancel.is_set():
            raise Cancelled("stopped")
        if prefill and self.on_progress is not None:
            self.on_progress(done / total, f"prefill: {done} of {total} layers")

