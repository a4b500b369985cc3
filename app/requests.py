"""The window's requests to its worker that have not finished, oldest first: "load", "open" or "ask".

The worker runs them in order and brackets each with busy(True) ... busy(False), except a question it refuses
before it begins (no model or no document yet: an error only). Stop stops the running answer at once; pressed while
a question waits behind a model load, it stops that question as soon as it begins.
"""
from __future__ import annotations

from collections import deque


class Requests:
    def __init__(self) -> None:
        self.kinds: deque[str] = deque()
        self.started = False              # the oldest has begun (busy(True) seen)
        self._stop_at_start = False       # Stop pressed before the pending question began

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def __contains__(self, kind: str) -> bool:
        return kind in self.kinds

    @property
    def head(self) -> str | None:
        return self.kinds[0] if self.kinds else None

    def add(self, kind: str) -> None:
        self.kinds.append(kind)

    def stop_pressed(self) -> None:
        """Stop was pressed: a question that has not begun yet stops as soon as it begins."""
        if "ask" in self.kinds and not (self.head == "ask" and self.started):
            self._stop_at_start = True

    def begin(self) -> bool:
        """The oldest request began (busy(True)) -> True when it is a question to stop at once."""
        self.started = True
        if self.head == "ask" and self._stop_at_start:
            self._stop_at_start = False
            return True
        return False

    def finish(self) -> str | None:
        """The oldest request ended (busy(False), or refused before it began) -> its kind."""
        self.started = False
        kind = self.kinds.popleft() if self.kinds else None
        if kind == "ask":
            self._stop_at_start = False
        return kind
