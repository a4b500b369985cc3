"""The close part of tools/reliability.py: the real app, closed in the middle of a turn.

    python tools/reliability_close.py ACTION DOCUMENT MODE RESULT.json [DEVICE]   # one app run (a child)

ACTION: `prefill` (close at the first prefill progress, before any answer text), `decode` (close once three
pieces of the answer have streamed) or `answer` (let a short answer finish, then close). The app is started the
way `python main.py` starts it (app/gui.py's `run`: the QApplication, the main window, the event loop) with its
disk KV tier on (`kv_store="default"`: $KVSCOPE_KV_STORE, set by the caller); a timer in the event loop plays the
user: choose MODE in the policy panel, ask, close the window. What it saw is written to RESULT.json, at the close
and again once the event loop has returned; the process exits with `run`'s exit code.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for p in (str(ROOT), str(TOOLS)):
    if p not in sys.path:
        sys.path.insert(0, p)

QUESTION = "Write a long story about the harbour."
ABORT_TEXT = ("terminate called", "QThread: Destroyed", "Traceback", "Fatal Python error", "Segmentation fault",
              "Aborted", "core dumped", "still running")


def app_run(action: str, document: str, mode: str, result: str, device: str | None = None) -> int:
    from PySide6.QtCore import Qt, QTimer
    from PySide6.QtWidgets import QApplication

    from app import gui
    from app.main_window import MainWindow

    app = QApplication([sys.argv[0]])
    out = Path(result)
    obs: dict = {"action": action, "mode": mode, "phase": "loading", "prefill_fraction": 0.0, "pieces": 0}

    def save() -> None:
        out.write_text(json.dumps(obs))

    def tick() -> None:
        win = next((w for w in app.topLevelWidgets() if isinstance(w, MainWindow)), None)
        if win is None or obs["phase"] == "closed":
            return
        if obs["phase"] == "loading":
            if not (win.model_info and win.document_info and not win.is_busy()):
                return
            direct = Qt.ConnectionType.DirectConnection
            win.worker.prefill_progress.connect(lambda f, _m: obs.update(prefill_fraction=f), direct)
            win.worker.answer_text.connect(lambda _t: obs.update(pieces=obs["pieces"] + 1), direct)
            win.policy_panel.set_config({"mode": mode, "policy": "full", "policy_params": {}})
            sampling = win.chat.sampling
            extra = {"ignore_eos": True, "max_tokens": 400} if action != "answer" else {"max_tokens": 4}
            win.chat.sampling = lambda: {**sampling(), "temperature": 0.0, **extra}
            win.chat.input.setPlainText(QUESTION)
            win.chat.send_button.click()
            obs["phase"] = "asked"
            return
        if action == "prefill":
            now = obs["prefill_fraction"] > 0 and obs["pieces"] == 0
        elif action == "decode":
            now = obs["pieces"] >= 3
        else:
            now = not win.is_busy() and not win.chat.is_streaming() and len(win.chat.messages()) >= 2
        if now:
            last = win.chat.messages()[-1]
            obs.update(phase="closed", t_close=time.time(), busy=win.is_busy(), streaming=win.chat.is_streaming(),
                       fraction_at_close=obs["prefill_fraction"], pieces_at_close=obs["pieces"],
                       last_role=last["role"], stats=last["stats"], engine=dict(win.worker.engine_config))
            timer.stop()
            save()
            win.close()
            obs["thread_finished"] = win.thread.isFinished()

    timer = QTimer()
    timer.setInterval(20)
    timer.timeout.connect(tick)
    timer.start()
    settings = out.with_suffix(".ini")                 # never the user's settings
    code = gui.run([sys.argv[0]], {"settings_path": str(settings), "document": document, "restore": False,
                                   "max_new_tokens": 400, **({"engine": {"device": device}} if device else {})})
    obs["t_exec_returned"] = time.time()
    obs["exec_code"] = code
    save()
    return code


# ------------------------------------------------------------------ the part (the parent)
def one_run(action: str, doc: Path, mode: str, store: Path, tmp: Path) -> dict:
    result = tmp / f"{action}-{mode}-{doc.stem}.json"
    env = dict(os.environ, KVSCOPE_KV_STORE=str(store), QT_QPA_PLATFORM="offscreen")
    t0 = time.time()
    p = subprocess.run([sys.executable, __file__, action, str(doc), mode, str(result)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    t_exit = time.time()
    obs = json.loads(result.read_text()) if result.exists() and result.stat().st_size else {}
    aborts = [line for line in p.stderr.splitlines() if any(a in line for a in ABORT_TEXT)]
    return {"action": action, "mode": mode, "doc": doc.name, "rc": p.returncode, "aborts": aborts,
            "stderr_lines": len(p.stderr.splitlines()), "stderr_tail": p.stderr[-1500:], "obs": obs,
            "close_to_exit_s": t_exit - obs["t_close"] if "t_close" in obs else None, "wall_s": t_exit - t0}


def part_close(modes: tuple[str, ...] = ("gpu", "layerwise")) -> dict:
    from app.samples import SAMPLE
    from reliability_disk import verify_store

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-rel-close-"))
    store = tmp / "kv"
    base = SAMPLE.read_text()[:6000]
    docs = {}
    for name in ("answered-gpu", "answered-layerwise", "stopped-gpu", "stopped-layerwise"):
        docs[name] = tmp / f"{name}.md"
        docs[name].write_text(f"{name}\n\n{base}")
    runs, checks = [], []
    for mode in modes:
        runs.append(one_run("decode", docs[f"answered-{mode}"], mode, store, tmp))
        runs.append(one_run("prefill", docs[f"stopped-{mode}"], mode, store, tmp))   # pages of the run before exist
        checks.append(verify_store(store))
    for mode in modes:                                 # the next run: the decode run's prompt pages come from disk
        runs.append(one_run("answer", docs[f"answered-{mode}"], mode, store, tmp))
    checks.append(verify_store(store))
    return {"runs": runs, "store_checks": checks}


def report(r: dict) -> list[tuple[str, bool]]:
    goals = []
    print("close: the real app (offscreen subprocess), window closed mid-turn")
    for run in r["runs"]:
        o = run["obs"]
        where = {"prefill": f"prefill at {o.get('fraction_at_close', 0):.0%}, {o.get('pieces_at_close', 0)} pieces",
                 "decode": f"decoding, {o.get('pieces_at_close', 0)} pieces streamed",
                 "answer": "after a short answer"}[run["action"]]
        close_s = "?"
        if run["close_to_exit_s"] is not None:
            shut = o["t_exec_returned"] - o["t_close"]
            close_s = f"{shut:.2f} s to the event loop's end, {run['close_to_exit_s']:.2f} s to the process's"
        extra = ""
        if run["action"] == "answer" and o.get("stats"):
            s, bs = o["stats"], (o.get("engine") or {}).get("kv_block_size", 256)
            expect = (s["prompt_tokens"] - 1) // bs * bs
            extra = (f"; read {s['disk_cached_tokens']} of {s['prompt_tokens']} prompt tokens from disk "
                     f"(expected {expect})")
            goals.append((f"{run['mode']}: the next run reads the closed run's pages back ({s['disk_cached_tokens']} "
                          f"tokens)", s["disk_cached_tokens"] == expect > 0))
        print(f"  {run['mode']:<9} {run['action']:<7} ({where}): exit {run['rc']}; close -> {close_s}; "
              f"abort lines {len(run['aborts'])}, stderr lines {run['stderr_lines']}{extra}")
        for line in run["aborts"][:3]:
            print(f"      {line}")
        mid = {"prefill": o.get("busy") and o.get("pieces_at_close") == 0 and 0 < o.get("fraction_at_close", 0) < 1,
               "decode": o.get("busy") and o.get("streaming") and o.get("pieces_at_close", 0) >= 3,
               "answer": o.get("last_role") == "assistant"}[run["action"]]
        when = "after the answer" if run["action"] == "answer" else "mid-" + run["action"]
        missed = "" if mid else " (NOT at the intended moment)"
        goals.append((f"{run['mode']} close {when}: exit {run['rc']}, no abort text{missed}",
                      run["rc"] == 0 and not run["aborts"] and bool(mid) and o.get("exec_code") == 0))
    for i, c in enumerate(r["store_checks"]):
        print(f"  store check {i + 1}: {c['pages']} pages, {len(c['bad'])} bad, {c['tmp']} temporary files")
    goals.append(("the disk tier's files intact after every close",
                  all(not c["bad"] and not c["tmp"] and c["pages"] > 0 for c in r["store_checks"])))
    return goals


if __name__ == "__main__":
    sys.exit(app_run(*sys.argv[1:6]))
