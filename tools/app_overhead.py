"""The engine with the app open vs without it, on the same turn: decode tok/s, time to first token, the GUI's refresh.

    python tools/app_overhead.py [--runs 8] [--minutes M] [--tokens 128] [--mode gpu] [--json out.json]

Without the app: a process of its own builds the LLM with the app's engine keyword arguments, warms it up as the CLI
does, answers once (the document's KV then sits in the prefix cache, as in the window after its first turn), then
answers the same chat messages on request (the sample document and question, greedy, `--tokens` answer tokens, EOS
ignored), as `main.py chat` does: untraced, and traced as the app's worker records (no window to draw it). With the
app: the main window (offscreen unless QT_QPA_PLATFORM says otherwise, shown, docks in place) asks the same question
through its chat box, its engine in a process of its own as `python main.py` runs it (`--engine-thread`: on the
window's engine thread, as before that existed). After one warm-up each, the turns (engine only, untraced and
traced; the app; the app's own engine process with View -> Watch the engine off, which records nothing as the CLI
runs: the cost of watching within one process; `--quiet-turn` adds one watched with nothing drawn, `--control` a
second engine-only process) take their turns,
`--runs` rounds, the order rotating each round, every process alive throughout: they see the same host (a GPU host's
decode in the offload modes is bound by Python on the host and varied by +-30% from turn to turn there, so the rounds
must interleave, and medians of a few are not enough; two identical processes differed by up to 17%). It reports
medians with their ratios, the telemetry pump's figures (draws/s, draw time, GUI thread share) from the app's
turns, and where each kind of turn's engine thread spent its time (/proc's per-thread clocks: on a CPU, runnable but
waiting for one, or off a CPU, e.g. waiting for the GIL), with the CPU its other threads and the window's process
used. All use the same thread settings (OPENBLAS_NUM_THREADS / OMP_WAIT_POLICY from the environment).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = "Summarise the document in detail, section by section."
POLL_MS = 2000  # a timed turn ends when the chat ends its answer (its signal); this check is the fallback. Each
#                 check wakes the GUI thread, which on a 2-core CPU takes a time slice from the engine (a user's
#                 window has no such timer: at 250 ms it was ~10 of an unwatched turn's ~40 wake-ups)

ENGINE_ONLY = r"""
import json, sys
from app import heap
from app.documents import load_document
from app.prompt import document_messages
from engine import LLM, SamplingParams
from engine.trace import NULL_RECORDER, TraceRecorder
cfg = json.loads(sys.argv[1])
llm = LLM(**cfg["engine"])
llm.warm_up()                     # as the CLI and the app do at load (CUDA: kernels compiled, graphs captured)
heap.freeze()                     # ... and as they do after it (app/heap.py)
traced = TraceRecorder.live(llm.device, mode=llm.config.mode)   # as the app's worker records (app/worker.py), with no window to draw it
doc = load_document(cfg["document"])
messages = document_messages(doc.text, cfg["question"], doc.name)
params = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], ignore_eos=True)

collections = heap.Collections()

def turn():
    collections.by.clear()
    collections.label = "turn"
    for chunk in llm.stream(messages, params):
        if chunk.stats is not None:
            collections.label = None
            n, ms = collections.total("turn")
            return {**chunk.stats.to_dict(), "gc": [n, ms]}

turn()                            # the document's KV into the prefix cache, as the app's warm-up turn
print("ready", flush=True)
for line in sys.stdin:            # "plain" or "traced": one turn, its stats as one JSON line
    llm.recorder = traced if line.strip() == "traced" else NULL_RECORDER
    print(json.dumps(turn()), flush=True)
llm.close()
"""


def thread_clocks(pid: int) -> dict[int, tuple[int, int, int]]:
    """A process's threads -> (CPU ns, ns runnable but waiting for a CPU, involuntary switches), from /proc (Linux;
    empty elsewhere). Their differences over a turn say where its engine thread's time went: on a CPU, waiting for
    one, or off it (the GIL, the GPU, a pipe)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            cpu, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
            status = (task / "status").read_text()
        except (OSError, ValueError):                  # the thread ended meanwhile, or no schedstat
            continue
        forced = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[int(task.name)] = (cpu, wait, forced)
    return out


def cpu_set(text: str) -> set[int]:
    """"3", "3,4" or "0-3,8" -> {3}, {3, 4} or {0, 1, 2, 3, 8} (--pin, and tools/host_survey.py's --cpus)."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads made later inherit it from the thread that makes them)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:                                # the thread ended meanwhile
            pass


class TurnClock:
    """Around one turn: the CPU use of the engine's thread (the process's main thread), of the engine process's
    other threads, and of the window's process, in ms."""

    def __init__(self, engine_pid: int | None, window: bool = True):
        self.engine, self.window = engine_pid or -1, os.getpid() if window else -1   # -1: none (on the window's
        self.pids = [self.engine, self.window]                                        # engine thread: not split)
        self.before = {p: thread_clocks(p) for p in self.pids}

    def read(self) -> dict:
        engine, window = self.pids
        diff = {}
        for pid in self.pids:
            after = thread_clocks(pid)
            diff[pid] = {t: [a - b for a, b in zip(v, self.before[pid].get(t, (0, 0, 0)))] for t, v in after.items()}
        main = diff[engine].get(engine, [0, 0, 0])
        return {"engine_cpu_ms": main[0] / 1e6, "engine_wait_ms": main[1] / 1e6, "engine_forced": main[2],
                "engine_others_cpu_ms": sum(v[0] for t, v in diff[engine].items() if t != engine) / 1e6,
                "window_cpu_ms": sum(v[0] for v in diff[window].values()) / 1e6}


class EngineOnly:
    """The engine without the app, in a process of its own that answers a turn on request."""

    def __init__(self, engine: dict, document: str, tokens: int):
        cfg = {"engine": engine, "document": document, "question": QUESTION, "tokens": tokens}
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE_ONLY, json.dumps(cfg)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._read()                                  # "ready" (or the process's failure)

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine-only process ended (exit code {self.proc.wait()})")
        return line

    def turn(self, traced: bool) -> dict:
        clock = TurnClock(self.proc.pid, window=False)
        self.proc.stdin.write("traced\n" if traced else "plain\n")
        self.proc.stdin.flush()
        return {**json.loads(self._read()), "clock": clock.read()}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def _gc_line(rows: list[dict]) -> str:
    """Python's collections a turn (means: a full one is rare and long), in the engine-only process or the window's."""
    key = "gc" if "gc" in rows[0] else "window_gc" if "window_gc" in rows[0] else None
    if key is None:
        return ""
    return (f"; GC {'engine' if key == 'gc' else 'window'} {statistics.fmean(r[key][0] for r in rows):.2f}x "
            f"{statistics.fmean(r[key][1] for r in rows):.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=None,
                    help="start no round that would end past this many minutes of rounds (a machine lent for a while)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mode", default=None, help="engine mode (default: the policy panel's default)")
    ap.add_argument("--policy", default=None, help="set in the policy panel before the first turn, as "
                    "name[:key=value...], e.g. quest:min_context=1024:min_layer_mb=0:token_budget=1024 (the sample is ~5.8K tokens)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-draw", action="store_true",
                    help="stop the telemetry pump during the timed turns (steps still cross to the window, nothing is "
                         "drawn from them): separates drawing from the rest of the window's cost")
    ap.add_argument("--quiet-turn", action="store_true",
                    help="add a turn of the window's own engine process watched but with the views' pump stopped: "
                         "watching's cost within one process, split into the engine's side and the drawing")
    ap.add_argument("--control", action="store_true",
                    help="a second engine-only process, started beside the first, answers traced turns in the rotation: "
                         "two identical processes side by side show this host's spread between processes")
    ap.add_argument("--engine-thread", action="store_true",
                    help="the engine on the window's engine thread (sharing the GIL with the GUI), not in a process "
                         "of its own as `python main.py` runs it")
    ap.add_argument("--pin", type=cpu_set, default=None, metavar="CPUS",
                    help="every engine process (the app's and the engine-only ones: their turns never overlap) on this "
                         "CPU (or these: 3,4), the window's process on the others: every kind of turn runs on the same "
                         "CPU (a GPU host's CPUs were seen to run at two speeds, and a process stays on its CPU for "
                         "long). Two CPUs let the app's engine process send on its outbox thread beside its engine "
                         "thread, as it does unpinned; on one CPU that thread takes the engine's")
    args = ap.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from PySide6.QtWidgets import QApplication

    from app import heap
    from app.samples import SAMPLE
    from app.main_window import MainWindow
    from app.screenshots import ask_and_wait, wait_until

    app = QApplication.instance() or QApplication([])
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-overhead-"))
    win = MainWindow({"settings_path": str(tmp / "kvscope.ini"), "document": str(SAMPLE), "restore": False,
                      "max_new_tokens": args.tokens, "engine_process": not args.engine_thread})
    if args.mode:
        panel = win.policy_panel
        panel.mode_combo.setCurrentIndex(panel.mode_combo.findData(args.mode))
    if args.policy:                                   # applied at the warm-up question (the window reloads then)
        from engine.sparse import parse_policy_spec
        (name, params), = parse_policy_spec(args.policy)
        win.policy_panel.set_config({"policy": name, "policy_params": params})
    win.resize(1400, 900)
    win.show()
    wait_until(app, lambda: bool(win.document_info) and not win.is_busy(), 600, "the model and the document")
    win.chat.set_sampling({"temperature": 0.0, "max_tokens": args.tokens, "seed": 0})
    sampling = win.chat.sampling
    win.chat.sampling = lambda: {**sampling(), "ignore_eos": True}           # the same answer length as without
    ask_and_wait(app, win, QUESTION, 600)                                      # warm-up (compiles, caches)
    win.new_chat()
    engine = dict(win.worker.engine_config)
    alone = EngineOnly(engine, str(SAMPLE), args.tokens)
    other = EngineOnly(engine, str(SAMPLE), args.tokens) if args.control else None
    if args.pin is not None:
        engines = [p for p in (getattr(win.worker, "pid", None), alone.proc.pid, other and other.proc.pid) if p]
        for pid in engines:
            pin(pid, args.pin)
        pin(os.getpid(), set(os.sched_getaffinity(0)) - args.pin)
        print(f"pinned: engine processes {engines} on CPUs {sorted(args.pin)}, the window's process on the others")
    with_app, without, traced, control, refresh, backlog, unwatched, quiet = [], [], [], [], [], [], [], []
    collections = heap.Collections()                                          # the window's process's own

    def window_turn(into: list, draw: bool = True, watch: bool = True) -> None:
        """One turn asked in the window: its views' pump stopped unless `draw`, View -> Watch off unless `watch`."""
        win.new_chat()                                                         # the same prompt: no history
        win.telemetry.reset_stats()
        if not draw:
            win.telemetry.stop()
        win.watch_action.setChecked(watch)
        clock = TurnClock(getattr(win.worker, "pid", None))
        collections.by.clear()
        collections.label = "turn"
        turn = ask_and_wait(app, win, QUESTION, 600, POLL_MS)
        collections.label = None
        into.append({**turn, "clock": clock.read(), "window_gc": list(collections.total("turn"))})
        win.watch_action.setChecked(True)
        win.telemetry.start()

    def app_turn() -> None:
        window_turn(with_app, draw=not args.no_draw)
        refresh.append(win.telemetry.stats())
        backlog.append(getattr(win.worker, "backlog", 0))

    def unwatched_turn() -> None:                                              # the same engine, View → Watch off
        window_turn(unwatched, watch=False)

    def quiet_turn() -> None:                                                  # watched, but the views not drawn
        window_turn(quiet, draw=False)

    turns = [lambda: without.append(alone.turn(False)), lambda: traced.append(alone.turn(True)), app_turn,
             unwatched_turn] + ([quiet_turn] if args.quiet_turn else [])
    if other is not None:
        turns.append(lambda: control.append(other.turn(True)))
    start = time.monotonic()
    for i in range(args.runs):                                                 # the order rotates every round
        for k in range(len(turns)):
            turns[(i + k) % len(turns)]()
        print(f"round {i + 1}: decode tok/s engine only {without[-1]['decode_tok_s']:.1f}, "
              f"app {with_app[-1]['decode_tok_s']:.1f}, unwatched {unwatched[-1]['decode_tok_s']:.1f}",
              file=sys.stderr, flush=True)
        if args.minutes and time.monotonic() - start > 60 * args.minutes * (i + 2) / (i + 1):
            args.runs = i + 1                                                  # the next round would pass the limit
            break
    alone.close()
    if other is not None:
        other.close()
    win.close()
    app.processEvents()

    def med(rows, key):
        return statistics.median(float(r[key]) for r in rows)
    result = {"engine": engine, "tokens": args.tokens, "runs": args.runs,
              "decode_tok_s": {"engine_only": med(without, "decode_tok_s"), "engine_traced": med(traced, "decode_tok_s"),
                               "app": med(with_app, "decode_tok_s")},
              "prefill_tok_s": {"engine_only": med(without, "prefill_tok_s"), "app": med(with_app, "prefill_tok_s")},
              "ttft_s": {"engine_only": med(without, "ttft_s"), "engine_traced": med(traced, "ttft_s"),
                         "app": med(with_app, "ttft_s")},
              "completion_tokens": [r["completion_tokens"] for r in with_app + without],
              "turns": {"engine_only": without, "engine_traced": traced, "app": with_app, "app_unwatched": unwatched,
                        **({"app_quiet": quiet} if quiet else {}),
                        **({"control_traced": control} if control else {})},
              "refresh": {k: statistics.median(r[k] for r in refresh) for k in refresh[0]}}
    d = result["decode_tok_s"]
    result["decode_slowdown"] = 1 - d["app"] / d["engine_only"]
    paired_only = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(with_app, without)]
    result["decode_paired_app_over_engine_only"] = statistics.median(paired_only)
    r = result["refresh"]
    print(f"engine {'on the window thread' if args.engine_thread else 'in its own process'}; decode tok/s: engine only {d['engine_only']:.2f} · traced as the app traces {d['engine_traced']:.2f} "
          f"({100 * (1 - d['engine_traced'] / d['engine_only']):.1f}% slower) · app open {d['app']:.2f} · slowdown "
          f"{100 * result['decode_slowdown']:.1f}% (median of {args.runs}, {args.tokens} tokens)")
    print(f"  paired round by round, app / engine only decode: median {statistics.median(paired_only):.3f}x "
          f"({min(paired_only):.2f}-{max(paired_only):.2f}; a host whose CPU runs at two speeds moves the medians "
          "of each kind of turn apart, the turns of one round see the same host more often)")
    t = result["ttft_s"]
    print(f"time to first token (the document's KV in the prefix cache, the question new): engine only "
          f"{1e3 * t['engine_only']:.1f} ms · traced {1e3 * t['engine_traced']:.1f} ms · app open "
          f"{1e3 * t['app']:.1f} ms ({t['app'] / t['engine_only']:.2f}x)")
    print(f"GUI refresh during a turn: {r['draws_per_s']:.1f} draws/s, {r['steps']:.0f} steps drawn, draw "
          f"{r['draw_ms_median']:.1f} ms median / {r['draw_ms_p95']:.1f} ms p95; GUI thread busy {100 * r['gui_cpu_share']:.1f}% "
          f"of the time ({100 * r['draw_share']:.1f}% in the pump's updates)")
    u = med(unwatched, "decode_tok_s")
    result["decode_tok_s"]["app_unwatched"] = u
    print(f"the app's own engine process with View -> Watch the engine off (it records nothing, as the CLI): decode "
          f"{u:.2f} tok/s, TTFT {1e3 * med(unwatched, 'ttft_s'):.1f} ms; watching costs it {100 * (1 - d['app'] / u):.1f}% "
          f"of decode ({d['app'] / u:.2f}x), TTFT {t['app'] / med(unwatched, 'ttft_s'):.2f}x (same process: no "
          f"difference between processes in it)")
    paired = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(with_app, unwatched)]
    print(f"  paired round by round, app / unwatched decode: median {statistics.median(paired):.3f}x "
          f"({min(paired):.2f}-{max(paired):.2f})")
    if quiet:
        q = med(quiet, "decode_tok_s")
        result["decode_tok_s"]["app_quiet"] = q
        print(f"the same process watched with its views not drawn (steps recorded, sent and received, no draw): decode "
              f"{q:.2f} tok/s ({q / u:.2f}x unwatched; watched and drawing ran at {d['app'] / q:.2f}x of it), TTFT "
              f"{1e3 * med(quiet, 'ttft_s'):.1f} ms")
    if control:
        c = med(control, "decode_tok_s")
        result["decode_tok_s"]["control_traced"] = c
        print(f"control, a second engine-only process, traced: decode {c:.2f} tok/s ({c / d['engine_traced']:.2f}x the "
              f"first one traced), TTFT {1e3 * med(control, 'ttft_s'):.1f} ms")
    print("where the engine's thread spent each turn (medians, ms: on a CPU / runnable, waiting for one / the turn's "
          "prefill and decode; involuntary switches; its process's other threads' CPU; the window process's CPU):")
    for name, rows in result["turns"].items():
        c = [r["clock"] for r in rows]
        mc = {k: statistics.median(x[k] for x in c) for k in c[0]}
        wall = statistics.median(1e3 * (r["ttft_s"] + (r["completion_tokens"] - 1) / r["decode_tok_s"]) for r in rows)
        print(f"  {name:15s} {mc['engine_cpu_ms']:8.1f} / {mc['engine_wait_ms']:6.1f} / {wall:7.1f} turn; "
              f"{mc['engine_forced']:5.0f} forced; others {mc['engine_others_cpu_ms']:7.1f}; window "
              f"{mc['window_cpu_ms']:7.1f}" + _gc_line(rows))
    if not args.engine_thread:
        print(f"engine process: at most {max(backlog)} messages queued for the window in a turn"
              + (" (the pump stopped: nothing drawn)" if args.no_draw else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
