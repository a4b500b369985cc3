"""Python's cyclic garbage collection on the GUI thread only, while a window with an engine thread is open.

A collection runs on whichever thread happens to allocate when a threshold is crossed. On the engine's thread it
can reach Qt objects of the GUI (a closed dialog, a menu, a window in a reference cycle): their C++ destructors then
run there, call back into Python for the GIL while holding Qt's object locks, and the GUI thread, holding the GIL
while it deletes another object, waits for one of those locks: both hang (seen in the test suite, with py-spy
showing the engine thread in gc_collect_main under json.load inside the tokenizer's loading). So while a window
runs, automatic collection is off and a timer on the GUI thread collects the generations whose thresholds were
crossed, as the interpreter would have done. (pyqtgraph ships the same remedy.) With the engine in a process of its
own only the pipe's reader allocates here, and the timer ticks once a second (PROCESS_INTERVAL_MS): each tick wakes
the GUI thread, ~0.3 ms of a core on the 2-core CPU, where the engine loses every time slice the window takes.
"""
from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

THREAD_INTERVAL_MS = 200     # how often the timer collects what is due, with the engine on a thread of this process
PROCESS_INTERVAL_MS = 1000   # ... and without one (see above)
_users = 0           # windows using it: automatic collection comes back when the last one stops
_was_enabled = True


class GuiThreadCollector(QObject):
    def __init__(self, parent: QObject | None = None, engine_thread: bool = True):
        """`engine_thread`: an engine runs on a thread of this process (else it runs in a process of its own)."""
        global _users, _was_enabled
        super().__init__(parent)
        if _users == 0:
            _was_enabled = gc.isenabled()
        _users += 1
        gc.disable()
        self._active = True
        self.collections = 0
        self.timer = QTimer(self, interval=THREAD_INTERVAL_MS if engine_thread else PROCESS_INTERVAL_MS)
        self.timer.timeout.connect(self.collect_due)
        self.timer.start()

    def collect_due(self) -> None:
        """Collect the oldest generation whose count passed its threshold (nothing when none did)."""
        counts, limits = gc.get_count(), gc.get_threshold()
        due = [g for g in range(3) if counts[g] > limits[g]]
        if due:
            gc.collect(max(due))
            self.collections += 1

    def stop(self) -> None:
        """Back to automatic collection (once no other window needs this)."""
        global _users
        if not self._active:
            return
        self._active = False
        self.timer.stop()
        _users -= 1
        if _users == 0 and _was_enabled:
            gc.enable()
