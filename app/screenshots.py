"""Screenshots of the real app: `python -m app.screenshots OUTDIR` (`make screenshots` writes docs/screenshots/).

Runs the main window on the real engine and the default model (offscreen or under Xvfb), opens the bundled sample
document, asks the sample question in gpu mode, in layerwise mode, with Quest (layerwise, its dock in front) and
with MInference (gpu mode, dense below 1024 tokens so the ~5K-token sample runs sparse, the Masks dock in front),
and saves the whole window after each answer as OUTDIR/window-{gpu,layerwise,quest,minference}.png. The user's
settings are not touched.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def wait_until(app, condition, timeout_s: float, what: str, poll_ms: int = 50, wake=None) -> None:
    """Run the event loop until `condition()` holds (checked every `poll_ms`, and whenever the GUI-thread signal
    `wake` is emitted); TimeoutError after `timeout_s`."""
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    deadline = time.monotonic() + timeout_s
    result = {"ok": False}

    def check() -> None:
        if condition():
            result["ok"] = True
            loop.quit()
        elif time.monotonic() > deadline:
            loop.quit()

    timer = QTimer(interval=poll_ms)
    timer.timeout.connect(check)
    timer.start()
    if wake is not None:
        wake.connect(check)
    check()
    if not result["ok"]:
        loop.exec()
    timer.stop()
    if wake is not None:
        wake.disconnect(check)
    if not result["ok"]:
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def settle(app, seconds: float) -> None:
    """Let timers and repaints run for a moment (the telemetry drain, the throttled Markdown render)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.02)


def ask_and_wait(app, window, question: str, timeout_s: float, poll_ms: int = 50) -> dict:
    """Type `question` into the chat, send it, and wait for the answer to finish (checked when the chat ends an
    answer, and every `poll_ms`: each check wakes the GUI thread); returns its stats."""
    window.chat.input.setPlainText(question)
    window.chat.send_button.click()
    wait_until(app, lambda: not window.chat.is_streaming() and not window.is_busy(), timeout_s, "the answer", poll_ms,
               wake=window.chat.answer_ended)
    settle(app, 0.5)
    last = window.chat.messages()[-1]
    if last["role"] != "assistant":
        raise RuntimeError(f"the turn failed: {last['text']}")
    for view in (window.timeline, window.ring):
        view.fit_burst()                   # the turn just answered, not the idle time since the one before
    settle(app, 0.3)
    return last["stats"] or {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.screenshots", description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for each step")
    p.add_argument("--size", default="1600x1000", help="window size WxH")
    args = p.parse_args(argv)
    from engine.paths import output_folder_problem
    if (problem := output_folder_problem(args.outdir)) is not None:   # before the model loads
        print(f"error: {args.outdir}: {problem}", file=sys.stderr)
        return 2

    from PySide6.QtWidgets import QApplication

    from app.samples import SAMPLE, SAMPLE_QUESTION
    from app.main_window import MainWindow

    args.outdir.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("kvscope")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVSCOPE_KV_STORE"] = str(Path(tmp) / "kv")   # a fresh disk KV tier: each shot computes its prefill
        window = MainWindow({"settings_path": str(Path(tmp) / "kvscope.ini"), "document": str(SAMPLE),
                             "max_new_tokens": args.max_new_tokens, "restore": False, "engine_process": True})
        width, height = (int(v) for v in args.size.lower().split("x"))
        window.resize(width, height)
        window.show()
        try:
            wait_until(app, lambda: window.model_info and window.document_info and not window.is_busy(),
                       args.timeout, "the model and the document")
            shots = [("gpu", {"mode": "gpu", "policy": "full"}, None),
                     ("layerwise", {"mode": "layerwise", "policy": "full"}, None),
                     ("quest", {"mode": "layerwise", "policy": "quest",
                                "policy_params": {"token_budget": 1024, "page_size": 16, "min_context": 0, "min_layer_mb": 0}}, "quest"),
                     ("minference", {"mode": "gpu", "policy": "minference",
                                     "policy_params": {"min_len": 1024, "vertical": 256, "slash": 512,   # sparse
                                                       "cpu_dense_above": 1.0, "gpu_dense_above": 1.0}}, "masks")]
            for name, config, dock in shots:
                window.policy_panel.set_config(config)
                if dock is not None:
                    window.docks[dock].raise_()
                stats = ask_and_wait(app, window, SAMPLE_QUESTION, args.timeout)
                mode = f"{config['mode']} + {config['policy']}"
                path = args.outdir / f"window-{name}.png"
                if not window.grab().save(str(path), "PNG"):
                    raise OSError(f"could not write {path}")
                steps = sorted(s.dur_us / 1e3 for s in window.worker.turn_steps if s.phase == "decode")
                at = f" (steps {steps[len(steps) // 2]:.2f} ms median, {steps[-1]:.2f} ms longest)" if steps else ""
                print(f"{path}: {mode}, prompt {stats.get('prompt_tokens')} tok, TTFT {stats.get('ttft_s', 0):.2f} s, "
                      f"decode {stats.get('decode_tok_s') or 0:.1f} tok/s{at}, finish {stats.get('finish_reason')}",
                      flush=True)
        finally:
            window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
