"""The memory part of tools/reliability.py: chat turns through the engine worker on its thread (`memory`) or through
the engine process as `python main.py` runs it (`memory-process`); resident memory at turn 20 and at the last
turn (goal: growth <= 5 %), threads and open files (goal: no growth), of each process."""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

SHORT_DOC = ("# Harbour log\n\nThe harbour office keeps a log of every ship that enters the port: its name, its "
             "flag, the berth it was given and the hour it arrived. The log is kept by Ingrid Solberg, who has "
             "run the office since 2011. Ships longer than two hundred metres berth at the north quay; the rest "
             "use the inner basin. The office closes at eight in the evening, and late arrivals wait at the "
             "outer buoy until six in the morning.\n")
QUESTIONS = ("Who keeps the log?", "Where do long ships berth?", "When does the office close?",
             "What does the log record?", "Where do late arrivals wait?", "Since when has the office been run?")


def proc_figures(pid: int | None = None) -> dict:
    """A process's resident memory (KiB), open file descriptors and threads (OS; and Python's, for this one)."""
    try:
        import psutil
        p = psutil.Process(pid)
        rss, fds, tasks = p.memory_info().rss // 1024, p.num_fds(), p.num_threads()
    except ImportError:
        where = Path(f"/proc/{pid or 'self'}")
        status = (where / "status").read_text()
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        fds, tasks = len(os.listdir(where / "fd")), len(os.listdir(where / "task"))
    return {"rss_kib": rss, "fds": fds, "threads": tasks, "py_threads": threading.active_count() if pid is None else 0}


class WorkerHarness:
    """An EngineWorker on its own long-lived EngineThread, as the window runs it: requests go in by queued signals, the
    worker's signals are heard on its thread (direct connections), so the caller needs no event loop."""

    def __init__(self):
        from PySide6.QtCore import QObject, Qt, Signal

        from app.worker import EngineThread, EngineWorker

        class Requests(QObject):
            load = Signal(dict)
            open = Signal(str)
            ask = Signal(str, dict, str)
            new_chat = Signal()

        self.requests, self.thread, self.worker = Requests(), EngineThread(), EngineWorker()
        self.thread.setObjectName("kvscope-engine")
        self.worker.moveToThread(self.thread)
        q, d = Qt.ConnectionType.QueuedConnection, Qt.ConnectionType.DirectConnection
        self.requests.load.connect(self.worker.load_model, q)
        self.requests.open.connect(self.worker.open_document, q)
        self.requests.ask.connect(self.worker.ask, q)
        self.requests.new_chat.connect(self.worker.new_chat, q)
        self.done, self.errors, self.answers = threading.Event(), [], []
        self.worker.model_ready.connect(lambda _: self.done.set(), d)
        self.worker.document_ready.connect(lambda _: self.done.set(), d)
        self.worker.answer_done.connect(lambda s: (self.answers.append(s), self.done.set()), d)
        self.worker.error.connect(lambda m: (self.errors.append(m), self.done.set()), d)
        self.thread.start()

    def call(self, signal, *args, timeout: float = 900) -> None:
        self.done.clear()
        signal.emit(*args)
        if not self.done.wait(timeout):
            raise TimeoutError(f"the worker did not answer in {timeout:.0f} s")
        if self.errors:
            raise RuntimeError(f"the worker reported: {self.errors[-1]}")

    def close(self) -> None:
        self.thread.quit()
        self.thread.wait()
        self.worker.close_engine()


class ProcessHarness:
    """The engine in a process of its own, as `python main.py` runs it (app/engine_process.py's ProcessWorker): its
    slots relay a request to the engine process and return when it is done, here on the calling thread."""

    def __init__(self):
        from types import SimpleNamespace

        from app import pyside_guard
        from app.engine_process import ProcessWorker
        pyside_guard.install()                         # as the window does (busy(True) is emitted here)
        self.worker = ProcessWorker()
        self.errors, self.answers = [], []
        self.worker.answer_done.connect(self.answers.append)
        self.worker.error.connect(self.errors.append)
        w = self.worker
        self.requests = SimpleNamespace(**{k: SimpleNamespace(emit=f) for k, f in (
            ("load", w.load_model), ("open", w.open_document), ("ask", w.ask), ("new_chat", w.new_chat))})

    def call(self, signal, *args, timeout: float = 900) -> None:
        signal.emit(*args)
        if self.errors:
            raise RuntimeError(f"the worker reported: {self.errors[-1]}")

    def close(self) -> None:
        self.worker.close_engine()


def part_memory(turns: int, process: bool = False) -> dict:
    from PySide6.QtCore import QCoreApplication
    app = QCoreApplication.instance() or QCoreApplication([sys.argv[0]])   # noqa: F841 - the threads' event loops
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-rel-mem-"))
    doc = tmp / "harbour.md"
    doc.write_text(SHORT_DOC)
    h = ProcessHarness() if process else WorkerHarness()
    h.call(h.requests.load, {"device": "cpu", "mode": "gpu", "max_model_len": 2048, "kv_block_size": 64,
                             "kv_store": str(tmp / "kv"), "policy": "full", "policy_params": {}})
    h.call(h.requests.open, str(doc))
    marks, engine_marks, t0 = {}, {}, time.perf_counter()
    checkpoints = {1, 20, turns} | set(range(50, turns + 1, 50))
    for turn in range(1, turns + 1):
        if turn % 10 == 1 and turn > 1:
            h.requests.new_chat.emit()                 # queued ahead of the next question, as the window sends it
        h.call(h.requests.ask, QUESTIONS[turn % len(QUESTIONS)], {"temperature": 0.0, "max_tokens": 8}, "")
        h.worker.drain()                               # the window's telemetry pump does this ~30 times a second
        if turn in checkpoints:
            marks[turn] = proc_figures()
            if process:
                engine_marks[turn] = proc_figures(h.worker.pid)
    elapsed = time.perf_counter() - t0
    h.close()
    cancelled = sum(a["finish_reason"] == "cancelled" for a in h.answers)
    return {"turns": turns, "seconds": elapsed, "marks": marks, "engine_marks": engine_marks, "answers": len(h.answers),
            "cancelled": cancelled, "prompt_tokens_max": max(a["prompt_tokens"] for a in h.answers),
            "engine_process": process}


def report(r: dict) -> list[tuple[str, bool]]:
    where = "the engine in a process of its own" if r.get("engine_process") else "the engine worker on its thread"
    print(f"memory ({where}): {r['turns']} turns in {r['seconds']:.0f} s ({r['seconds'] / r['turns']:.2f} s/turn; "
          f"{r['answers']} answers, {r['cancelled']} cancelled; longest prompt {r['prompt_tokens_max']} tokens)")
    goals = []
    for name, marks in (("the window's side (the ProcessWorker)" if r.get("engine_process") else "", r["marks"]),
                        ("engine process", r.get("engine_marks") or {})):
        if not marks:
            continue
        m = {int(k): v for k, v in marks.items()}
        a, b = m[20], m[r["turns"]]
        growth = (b["rss_kib"] - a["rss_kib"]) / a["rss_kib"] * 100
        label = f"{name}: " if name else ""
        for turn in sorted(m):
            v = m[turn]
            print(f"  {label}turn {turn:>4}: RSS {v['rss_kib'] / 1024:7.1f} MiB  fds {v['fds']:>3}  threads "
                  f"{v['threads']:>3}" + (f" (python {v['py_threads']})" if v["py_threads"] else ""))
        goals += [(f"{label}RSS growth turn 20 -> {r['turns']}: {growth:+.2f} % (goal <= 5 %)", growth <= 5),
                  (f"{label}threads {a['threads']} -> {b['threads']} (goal: no growth)", b["threads"] <= a["threads"]),
                  (f"{label}open files {a['fds']} -> {b['fds']} (goal: no growth)", b["fds"] <= a["fds"])]
    goals.append((f"every turn answered ({r['answers']} of {r['turns']})",
                  r["answers"] == r["turns"] and not r["cancelled"]))
    return goals
