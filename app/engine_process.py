"""The engine in a process of its own: `ProcessWorker`, the window's worker with the LLM in a child process.

Why: the engine's decode loop is Python (per layer: waits, copies, graph replays), and so is the window's drawing.
In one process they share the GIL, and a GPU engine in the offload modes lost about as much time as the GUI
thread was busy (H100, the default model: layerwise decode 185 tok/s alone, 154 with the window drawing; chunked
261 and 160) however little the window drew. In a process of its own the engine shares no GIL with the window.
(Measured with tools/app_overhead.py on the H100: with full attention the window costs no measurable decode speed
in any mode; with Quest in the offload modes it still cost 12-22%, cause not found: docs/benchmarks.md, "With Quest".)

`ProcessWorker` has the `EngineWorker`'s signals, slots, `drain()`, `turn_steps`, `engine_config`, `history`,
`stop()` and `close_engine()` (`llm` is None here). Its slots, on the window's engine thread, send the request to
the child and relay what comes back until the child says the request is done: the signals as they were emitted
there, and each engine step into the telemetry deque. The child (`serve`) runs a plain `EngineWorker` on its main
thread, the one that runs in the window's process otherwise. Stop is a flag in shared memory, read after every layer.

If the child dies (a crash in a driver, killed by the system), the request that was running reports it in one
line, and the next request starts a new child, which loads the last model and document and gets the chat back
(the parent keeps a copy of the history after every request): nothing the user had is lost.

The child's messages go out through a thread of its own (`app.outbox.Outbox`), so the engine never blocks on a full pipe
while the window's process is slow to read it, in batches (at most one send per SEND_EVERY_S; steps wait for the
next signal, at most HOLD_S), so that thread wakes, and takes the GIL from the engine's, at most ~50 times a second
rather than once per step, and the window's process wakes with the text, not for every step besides it. Pickled per
step: a step without a timeline ~10 µs, one with it 0.1-0.8 ms (10 per second at most, the live detail rate), under
1% of a GPU decode's time.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
from functools import partial

from PySide6.QtCore import Slot

from app import pyside_guard
from app.outbox import Outbox
from app.worker import EngineWorker, WorkerBase

CLOSE_S = 30.0       # closing waits this long for the child to close the engine (the disk tier's last writes)


class SharedFlag:
    """A threading.Event-like flag in shared memory (set in the window's process, read by the engine's): a read
    is one memory load, cheap enough to check after every layer."""

    def __init__(self, ctx):
        self._v = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._v.value = 1

    def clear(self) -> None:
        self._v.value = 0

    def is_set(self) -> bool:
        return bool(self._v.value)


def serve(conn, cancel: SharedFlag) -> None:
    """The child's main loop: (request, args) in, signals and steps out, then ("done", state) per request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C is the window's: it closes this process in order
    pyside_guard.install()                             # its signals lose references too (app/pyside_guard.py)
    worker = EngineWorker()
    worker._cancel = cancel
    out = worker.telemetry = Outbox(conn)
    for name in worker.SIGNALS:
        getattr(worker, name).connect(partial(out.signal, name))
    try:
        while True:
            try:
                request, args = conn.recv()
            except EOFError:                               # the window's process is gone
                break
            if request == "close":
                break
            if request == "restore":
                worker.history = list(args[0])
            else:
                getattr(worker, request)(*args)
            out.put(("done", {"engine_config": worker.engine_config, "history": list(worker.history),
                              "document": str(worker.document.path) if worker.document is not None else None,
                              "backlog": out.backlog}))
            out.backlog = 0
            pyside_guard.top_up()
    finally:
        worker.close_engine()                              # the disk tier's writes finish, pinned memory freed
        out.put(("closed", None))
        out.close()


class ProcessWorker(WorkerBase):
    """EngineWorker with the engine in a child process (see the module docstring). The child starts now (it
    imports torch while the window builds); `close_engine()` ends it."""

    def __init__(self, max_steps: int = 2048):
        super().__init__(max_steps)
        self._ctx = mp.get_context("spawn")                 # never fork a process with Qt (or CUDA) in it
        self._cancel = SharedFlag(self._ctx)
        self._proc = self._conn = None
        self._turn: list | None = None
        self._busy_open = False
        self._quiet = False                                # a restart's own load: no busy signals to the window
        self._loaded: dict = {}                            # the last engine config and document the child had
        self.backlog = 0                                   # the last request's most messages queued in the child
        self._watching = True                              # what a restarted child is told
        self._start()

    @property
    def pid(self) -> int | None:
        """The engine process's id (None when none runs)."""
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=serve, args=(child, self._cancel), name="kvscope-engine", daemon=True)
        self._proc.start()
        child.close()

    # ---------------------------------------------------------------- slots (the window's engine thread)
    @Slot(dict)
    def load_model(self, config: dict) -> None:
        self._request("load_model", config)

    @Slot(str)
    def open_document(self, path: str) -> None:
        self._request("open_document", path)

    @Slot()
    def new_chat(self) -> None:
        self._request("new_chat")

    @Slot(bool)
    def set_watching(self, on: bool) -> None:
        self._watching = bool(on)
        self._request("set_watching", self._watching)

    @Slot(str, dict, str)
    def ask(self, question: str, sampling: dict, system: str) -> None:
        self._ask("ask", question, sampling, system)

    @Slot(str, dict, str)
    def ask_again(self, question: str, sampling: dict, system: str) -> None:
        self._ask("ask_again", question, sampling, system)

    def _ask(self, request: str, *args) -> None:
        self._turn = []
        try:
            self._request(request, *args)
        finally:
            self.turn_steps, self._turn = self._turn, None

    def _request(self, request: str, *args) -> None:
        if self._proc is None or not self._proc.is_alive():
            if not self._restart():
                return
        try:
            self._relay(request, args)
        except (EOFError, OSError):
            self._lost()

    def _relay(self, request: str, args: tuple) -> None:
        self._conn.send((request, args))
        while True:
            _, batch = self._conn.recv()
            for message in batch:
                if self._take(message):
                    return

    def _take(self, message: tuple) -> bool:
        """Act on one message of the child; True once the request is done."""
        kind, *rest = message
        if kind == "step":
            self.telemetry.append(rest[0])
            if self._turn is not None:
                self._turn.append(rest[0])
        elif kind == "signal":
            name, values = rest
            if name == "busy":
                if self._quiet:
                    return False
                self._busy_open = bool(values[0])
                if not values[0] and self._turn is not None:   # the turn's steps are all in: readable now,
                    self.turn_steps = list(self._turn)         # before the window hears that it ended
            getattr(self, name).emit(*values)
        elif kind == "done":
            state = rest[0]
            self.engine_config, self.history = state["engine_config"], list(state["history"])
            self.backlog = state["backlog"]            # steps the engine process had queued for the window, at most
            if state["engine_config"]:
                self._loaded = {"config": state["engine_config"], "document": state["document"]}
            return True
        return False

    def _lost(self) -> None:
        """The child died during a request: say so, close what it left open, start over at the next request."""
        code = None
        if self._proc is not None:
            self._proc.join(1.0)
            code = self._proc.exitcode
        self._proc = None
        self.engine_config = {}                            # the window sees no engine loaded: its next ask reloads
        self.error.emit(f"the engine process stopped (exit code {code}) during the request; the next request "
                        "starts it again with the same model, document and chat")
        if self._busy_open:
            self._busy_open = False
            self.busy.emit(False)

    def _restart(self) -> bool:
        """A new child, given the last model, document and chat (no busy signals: it is part of a request)."""
        self._start()
        history, loaded, self._quiet = list(self.history), dict(self._loaded), True
        try:
            if not self._watching:
                self._relay("set_watching", (False,))
            if loaded:
                self._relay("load_model", (loaded["config"],))
                if loaded["document"]:
                    self._relay("open_document", (loaded["document"],))
                self._relay("restore", (history,))
        except (EOFError, OSError):
            self._lost()
            return False
        finally:
            self._quiet = False
        return True

    # ---------------------------------------------------------------- from the GUI thread
    def close_engine(self) -> None:
        """End the child (it closes the engine first). Call once the window's engine thread has finished."""
        proc, conn, self._proc = self._proc, self._conn, None
        if proc is None:
            return
        try:
            conn.send(("close", ()))
            while conn.poll(CLOSE_S) and not any(m[0] == "closed" for m in conn.recv()[1]):
                pass
        except (EOFError, OSError):
            pass
        proc.join(CLOSE_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        conn.close()
