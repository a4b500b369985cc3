"""Reliability figures (issue 17): memory over many chat turns, Stop, closing the window mid-turn, the disk tier.

    python tools/reliability.py                                  # every part, 200 turns (~10 min on 2 CPU cores)
    python tools/reliability.py --turns 200 --parts memory,memory-process,cancel,close,disk --json out.json

All on the real engine with the embedded default model on the CPU (or CUDA when there is one). Each part runs in
a fresh process; this one only collects and prints a report with the measured figures and PASS/FAIL per goal.

- memory: `--turns` chat turns through app/worker.py's EngineWorker on its own EngineThread (the window's engine
  thread; a short document, 8 answer tokens, the disk tier on, a new chat every 10 turns so the context stays
  bounded). Resident memory at turn 20 and at the last turn (goal: growth <= 5 %), threads and open files (goal:
  equal). memory-process: the same through app/engine_process.py's ProcessWorker (the engine in a process of its
  own, as `python main.py` runs it), the figures of both processes.
- cancel: the main window (offscreen) in gpu, layerwise and chunked mode: Stop (`MainWindow.stop()`, the Stop
  button's path: the worker's thread-safe flag) during the prefill of a ~1.7K-token document and during decode;
  the time from Stop to the engine's next check of the flag and to the worker's busy(False) (the engine idle),
  beside the compute of the layer Stop came in, from the stopped turn's trace (chunked prefill: one chunk
  through one layer, its unit of work; a decode Stop after the last layer waits for the logits and sampling).
  Goal: the stop takes at most that layer's compute; the chat keeps the answer streamed so far.
- close: the real app (app/gui.py's `run`) in a subprocess, offscreen; a turn is started and the window closed
  mid-prefill or mid-decode (gpu and layerwise mode). Goal: exit code 0, nothing on stderr that tells of an
  abort; the disk tier's pages intact (every file verifies) and read back by the next run.
- disk: a flipped byte and a truncated page file are detected, skipped and recomputed (same greedy answer),
  then rewritten; two processes hammer one store (writes, reads, evictions), and two engines answer on one store
  at once: no page read is ever wrong, every file verifies, a third engine reads them back.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for p in (str(ROOT), str(TOOLS)):
    if p not in sys.path:
        sys.path.insert(0, p)
for k, v in (("OPENBLAS_NUM_THREADS", "1"), ("OMP_WAIT_POLICY", "PASSIVE"), ("QT_QPA_PLATFORM", "offscreen")):
    os.environ.setdefault(k, v)

PARTS = ("memory", "memory-process", "cancel", "close", "disk")
MODES = ("gpu", "layerwise", "chunked")
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


def _layers(step) -> list[float]:
    return [sp.dur_us for sp in step.spans if sp.lane == "compute" and sp.name.startswith("layer ")]


def layer_ms(steps, phase: str) -> float | None:
    """Median compute time of one layer (a "layer N" compute span) in the steps of `phase`, in ms."""
    durs = [d for s in steps if s.phase == phase for d in _layers(s)]
    return statistics.median(durs) / 1e3 if durs else None


def landed(steps, t_us: float) -> list | None:
    """[name, ms] of the layer whose compute span holds the time `t_us`; None when it fell between layers."""
    for s in steps:
        for sp in s.spans:
            if sp.lane == "compute" and sp.name.startswith("layer ") and sp.t0_us <= t_us < sp.t1_us:
                return [sp.name, sp.dur_us / 1e3]
    return None


def outside_layers_ms(steps) -> float | None:
    """Median time of a decode step outside its layers (the logits, sampling, host work), in ms: a Stop that
    comes then is seen at the next check."""
    rest = [s.dur_us - sum(_layers(s)) for s in steps if s.phase == "decode"]
    return statistics.median(rest) / 1e3 if rest else None


# ------------------------------------------------------------------ memory (child)
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


# ------------------------------------------------------------------ cancel (child)
class StopClock(threading.Event):
    """The worker's cancel flag, timed: when the engine first saw it set (its check after each layer)."""

    def __init__(self):
        super().__init__()
        self.seen_at: float | None = None

    def clear(self) -> None:
        super().clear()
        self.seen_at = None

    def is_set(self) -> bool:
        if (on := super().is_set()) and self.seen_at is None:
            self.seen_at = time.perf_counter()
        return on


def part_cancel(modes: tuple[str, ...], repeats: int) -> dict:
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.samples import SAMPLE
    from app.screenshots import wait_until

    app = QApplication.instance() or QApplication([sys.argv[0]])
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-rel-cancel-"))
    base = SAMPLE.read_text()[:6000]                   # ~1.7K tokens: a prefill of seconds, layers of ~0.1 s
    docs = []
    for i in range(2 * len(modes) + 1):                # a fresh text per prefill: nothing from the prefix cache
        docs.append(tmp / f"doc{i}.md")
        docs[-1].write_text(f"Copy {i} of the primer.\n\n{base}")
    win = MainWindow({"settings_path": str(tmp / "kvscope.ini"), "document": str(docs[-1]), "restore": False,
                      "max_new_tokens": 8, "engine": {"kv_store": None}})   # the disk tier off: every prefill computed
    win.resize(1400, 900)
    win.show()
    direct = Qt.ConnectionType.DirectConnection
    clock = win.worker._cancel = StopClock()          # stop() sets it, as before; the engine's checks are timed
    seen = {"fraction": 0.0, "pieces": [], "idle_at": None, "stop_at": None}

    def on_busy(busy: bool) -> None:
        if not busy and seen["stop_at"] is not None and seen["idle_at"] is None:
            seen["idle_at"] = time.perf_counter()

    win.worker.busy.connect(on_busy, direct)
    win.worker.prefill_progress.connect(lambda f, _m: seen.update(fraction=f), direct)
    win.worker.answer_text.connect(lambda t: seen["pieces"].append((time.perf_counter(), t)), direct)
    sampling = win.chat.sampling
    win.chat.sampling = lambda: {**sampling(), "temperature": 0.0, **extra}
    extra: dict = {}
    idle = lambda: not win.chat.is_streaming() and not win.is_busy()   # noqa: E731
    wait_until(app, lambda: bool(win.model_info) and bool(win.document_info) and idle(), 600, "model and document")

    def turn(question: str, stop_when=None) -> dict:
        seen.update(fraction=0.0, pieces=[], idle_at=None, stop_at=None)
        win.chat.input.setPlainText(question)
        win.chat.send_button.click()
        if stop_when is not None:
            wait_until(app, stop_when, 600, "the moment to stop")
            stop_us = win.worker.llm.recorder.now_us()   # the trace's time base: which layer Stop came in
            seen["stop_at"] = time.perf_counter()
            win.stop()
        wait_until(app, idle, 600, "the engine idle")
        msg = win.chat.messages()[-1]
        out = {"stats": msg["stats"] or {}, "chat_text": msg["text"], "streamed": "".join(t for _, t in seen["pieces"])}
        if stop_when is not None:
            out["stop_ms"] = (seen["idle_at"] - seen["stop_at"]) * 1e3
            out["seen_ms"] = (clock.seen_at - seen["stop_at"]) * 1e3 if clock.seen_at else None
            out["pieces_after_stop"] = sum(t > seen["stop_at"] for t, _ in seen["pieces"])
            out["fraction_at_stop"] = seen["fraction"]
            out["landed"] = landed(win.worker.turn_steps, stop_us)
        return out

    result = {}
    for i, mode in enumerate(modes):
        win.policy_panel.set_config({"mode": mode, "policy": "full", "policy_params": {}})
        extra.clear()
        win.open_document(str(docs[2 * i]))
        wait_until(app, idle, 600, "the document")
        ref = turn(QUESTIONS[0])                       # a whole turn: its trace gives the layer times
        steps = list(win.worker.turn_steps)
        r = {"prefill_layer_ms": layer_ms(steps, "prefill"), "decode_layer_ms": layer_ms(steps, "decode"),
             "decode_outside_ms": outside_layers_ms(steps),
             "prompt_tokens": ref["stats"].get("prompt_tokens"), "kv_block_size": win.worker.engine_config.get(
                 "kv_block_size")}
        win.open_document(str(docs[2 * i + 1]))        # the same length, never seen: a whole prefill to stop
        wait_until(app, idle, 600, "the document")
        stopped = turn(QUESTIONS[0], lambda: seen["fraction"] >= 0.3)
        r["prefill"] = {"stop_ms": stopped["stop_ms"], "seen_ms": stopped["seen_ms"], "landed": stopped["landed"],
                        "fraction": stopped["fraction_at_stop"],
                        "finish": stopped["stats"].get("finish_reason"),
                        "tokens": stopped["stats"].get("completion_tokens")}
        extra.update(ignore_eos=True, max_tokens=400)
        win.open_document(str(docs[2 * i]))            # cached by the whole turn: decode starts at once
        wait_until(app, idle, 600, "the document")
        r["decode"] = []
        for _ in range(repeats):
            stopped = turn("Write a long story about the harbour.", lambda: len(seen["pieces"]) >= 6)
            r["decode"].append({"stop_ms": stopped["stop_ms"], "seen_ms": stopped["seen_ms"],
                                "landed": stopped["landed"], "finish": stopped["stats"].get("finish_reason"),
                                "tokens": stopped["stats"].get("completion_tokens"),
                                "after_stop": stopped["pieces_after_stop"],
                                "chat_keeps": bool(stopped["streamed"])
                                and stopped["chat_text"] == stopped["streamed"]})
        result[mode] = r
    win.close()
    return result


# ------------------------------------------------------------------ the parent: run the parts, print the report
def run_child(part: str, args: list[str], timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", part, "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode or not out.stat().st_size:
        raise RuntimeError(f"part {part} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report_memory(r: dict) -> list[tuple[str, bool]]:
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


def report_cancel(r: dict) -> list[tuple[str, bool]]:
    goals = []
    print("cancel: Stop (the window's stop()) -> the engine's next check -> engine idle (the worker's busy(False)),"
          "\n        beside the compute of the layer Stop came in (from the stopped turn's trace)")

    def bound(d: dict, outside: float | None) -> tuple[str, float]:
        if d["landed"]:
            return f"{d['landed'][0]} ({d['landed'][1]:.1f} ms)", d["landed"][1]
        return f"the stretch after the layers (logits, sampling: {outside or 0:.1f} ms median)", outside or 0.0

    for mode, v in r.items():
        unit = "chunk-layer" if mode == "chunked" else "layer"
        print(f"  {mode:<9} one {unit}'s compute, median: prefill {v['prefill_layer_ms']:.1f} ms, decode "
              f"{v['decode_layer_ms']:.2f} ms (a decode step outside its layers: {v['decode_outside_ms']:.1f} ms)")
        for phase, stops in (("prefill", [v["prefill"]]), ("decode", v["decode"])):
            rows = [(d, *bound(d, v["decode_outside_ms"] if phase == "decode" else None)) for d in stops]
            for d, where, _ in rows:
                at = f"{v['prompt_tokens']} tokens, Stop at {d['fraction']:.0%}, " if phase == "prefill" else ""
                print(f"  {'':<9} {phase:<7} ({at}in {where}): seen after {d['seen_ms']:.1f} ms, idle after "
                      f"{d['stop_ms']:.1f} ms (unwinding {d['stop_ms'] - d['seen_ms']:.1f} ms)")
            n = f" ({len(rows)} stops)" if len(rows) > 1 else ""
            for key, what in (("seen_ms", "the engine sees Stop by the end of the layer it came in"),
                              ("stop_ms", "Stop -> engine idle within that layer's compute")):
                figures = ", ".join(f"{d[key]:.1f} <= {b:.1f}" for d, _, b in rows)
                goals.append((f"{mode} {phase}{n}: {what} ({figures} ms)", all(d[key] <= b for d, _, b in rows)))
        p, ds = v["prefill"], v["decode"]
        kept = all(d["chat_keeps"] and d["finish"] == "cancelled" and d["tokens"] > 0 for d in ds)
        tokens = ", ".join(str(d["tokens"]) for d in ds)
        goals.append((f"{mode} the chat keeps the partial answer (decode stops: {tokens} tokens kept, "
                      f"{sum(d['after_stop'] for d in ds)} pieces after Stop; prefill stop: {p['tokens']} tokens, "
                      f"{p['finish']})", kept and p["finish"] == "cancelled" and p["tokens"] == 0))
    return goals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200, help="chat turns of the memory part (>= 20)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="modes of the cancel part")
    ap.add_argument("--repeats", type=int, default=3, help="decode stops per mode")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:                                     # one part, in this (fresh) process
        result = (part_memory(args.turns, args.child == "memory-process") if args.child.startswith("memory") else
                  part_cancel(tuple(args.modes.split(",")), args.repeats))
        args.out.write_text(json.dumps(result))
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown part(s) {', '.join(sorted(unknown))}: choose from {', '.join(PARTS)}")
    if args.turns < 20:
        ap.error("--turns must be at least 20 (memory is compared at turn 20)")
    import reliability_close
    import reliability_disk
    raw, goals = {}, []
    t0 = time.perf_counter()
    scratch = tempfile.TemporaryDirectory(prefix="kvscope-reliability-")   # every part's files, removed at the end
    os.environ["TMPDIR"] = tempfile.tempdir = scratch.name                 # (the parts' processes inherit it)
    for part in parts:
        t = time.perf_counter()
        if part.startswith("memory"):
            raw[part] = run_child(part, ["--turns", str(args.turns)], 3600)
            goals += report_memory(raw[part])
        elif part == "cancel":
            raw[part] = run_child("cancel", ["--modes", args.modes, "--repeats", str(args.repeats)], 3600)
            goals += report_cancel(raw[part])
        elif part == "close":
            raw[part] = reliability_close.part_close()
            goals += reliability_close.report(raw[part])
        else:
            raw[part] = reliability_disk.part_disk()
            goals += reliability_disk.report(raw[part])
        print(f"  ({part}: {time.perf_counter() - t:.0f} s)", flush=True)
    scratch.cleanup()
    print(f"\nverdicts ({time.perf_counter() - t0:.0f} s in all):")
    for text, ok in goals:
        print(f"  {verdict(ok)}  {text}")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
