"""The engine process's outbox: everything it says to the window, in order, sent by a thread of its own.

Qt-free, so the tools that measure what watching costs (tools/trace_cost.py's `send`) use the app's own sending.
"""
from __future__ import annotations

import queue
import threading
import time

SEND_EVERY_S = 0.02  # the engine's process sends what it has to say at most this often (one batch)
HOLD_S = 0.25        # ... and engine steps alone wait up to this long for a signal (text, progress) to go with
CLOSE_S = 30.0       # close() waits this long for the last batch to go


class Outbox:
    """Everything the child says to the window, in order, sent by a thread of its own: the engine never waits for
    a full pipe (the window's process reads it only when its GUI thread lets go of the GIL). Also the child's
    telemetry 'deque': `append(step)` queues an engine step."""

    def __init__(self, conn):
        self.conn, self.queue = conn, queue.SimpleQueue()
        self.backlog = 0                                   # the most messages waiting at once since the last request
        self._due = threading.Event()                      # set by anything but a step: the batch goes now
        self.thread = threading.Thread(target=self._run, name="kvscope-outbox", daemon=True)
        self.thread.start()

    def put(self, message: tuple) -> None:
        self.queue.put(message)
        self._due.set()

    def append(self, step) -> None:
        self.queue.put(("step", step))
        self.backlog = max(self.backlog, self.queue.qsize())

    def signal(self, name: str, *args) -> None:
        self.queue.put(("signal", name, args))
        self._due.set()

    def close(self) -> None:
        self.put(None)
        self.thread.join(CLOSE_S)

    def _run(self) -> None:
        """Send what is queued as one batch: a signal (the answer's text, the prefill's progress, a request's end)
        at most SEND_EVERY_S after the last batch, engine steps with the next signal or at most HOLD_S after the
        first of them. Each batch wakes the window's process, and each wake of this thread takes the GIL from the
        engine's: at a few hundred steps a second one send per step did both that often; on a CPU the steps (a few
        a second) rode alone, a wake of the window's process (whose every moment on a 2-core CPU is taken from the
        engine's threads) each, besides the text's own."""
        last = 0.0
        while True:
            batch = [self.queue.get()]
            if batch[0] is not None and batch[0][0] == "step":      # steps wait for a signal, or for HOLD_S
                self._due.wait(HOLD_S)
            time.sleep(max(0.0, last + SEND_EVERY_S - time.monotonic()))     # let the messages of a moment gather
            self._due.clear()
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
