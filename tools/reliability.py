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

import reliability_memory  # noqa: E402 - the memory part (tools/ is on the path from here)
from reliability_memory import QUESTIONS  # noqa: E402

PARTS = ("memory", "memory-process", "cancel", "close", "disk")
MODES = ("gpu", "layerwise", "chunked")
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
        result = (reliability_memory.part_memory(args.turns, args.child == "memory-process")
                  if args.child.startswith("memory") else part_cancel(tuple(args.modes.split(",")), args.repeats))
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
            goals += reliability_memory.report(raw[part])
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
