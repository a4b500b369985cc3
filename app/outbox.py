"""The engine process's outbox: everything it says to the window, in order, sent by a thread of its own.

Qt-free, so the tools that measure what watching costs (tools/trace_cost.py's `send`) use the app's own sending.
"""
from __future__ import annotations

import queue
import threading
import time

SEND_EVERY_S = 0.02  # the engine's process sends what it has to say at most this often (one batch)
CLOSE_S = 30.0       # close() waits this long for the last batch to go


class Outbox:
    """Everything the child says to the window, in order, sent by a thread of its own: the engine never waits for
    a full pipe (the window's process reads it only when its GUI thread lets go of the GIL). Also the child's
    telemetry 'deque': `append(step)` queues an engine step."""

    def __init__(self, conn):
        self.conn, self.queue = conn, queue.SimpleQueue()
        self.backlog = 0                                   # the most messages waiting at once since the last request
        self.thread = threading.Thread(target=self._run, name="kvscope-outbox", daemon=True)
        self.thread.start()

    def put(self, message: tuple) -> None:
        self.queue.put(message)

    def append(self, step) -> None:
        self.queue.put(("step", step))
        self.backlog = max(self.backlog, self.queue.qsize())

    def signal(self, name: str, *args) -> None:
        self.queue.put(("signal", name, args))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(CLOSE_S)

    def _run(self) -> None:
        """Send what is queued, at most every SEND_EVERY_S, as one batch: at a few hundred steps a second one send
        per step woke this thread (and took the GIL from the engine's thread) that often."""
        last = 0.0
        while True:
            batch = [self.queue.get()]
            time.sleep(max(0.0, last + SEND_EVERY_S - time.monotonic()))     # let the steps of a moment gather
            while not self.queue.empty():
                batch.append(self.queue.get())
            end = batch.index(None) if None in batch else len(batch)
            try:
                if end:
                    self.conn.send(("batch", batch[:end]))
            except OSError:                                # the window's process is gone: nothing to tell
                return
            if end < len(batch):
                return
            last = time.monotonic()
