"""The window's process exits cleanly: PySide6's lost references to True and None (app/pyside_guard.py) no longer
abort it."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EMITS = r"""
import sys
from PySide6.QtCore import QCoreApplication, QObject, Signal
if sys.argv[1] == "guard":
    from app import pyside_guard
    pyside_guard.install()
class Source(QObject):
    changed = Signal(bool)
    stats = Signal(dict)
class Sink(QObject):
    def take(self, d):
        pass
app = QCoreApplication([])
s, sink = Source(), Sink()
s.stats.connect(sink.take)
for _ in range(5000):
    s.changed.emit(True)
    s.stats.emit({"reason": None})
print("emitted")
"""

WINDOW = r"""
import sys, tempfile
from pathlib import Path
from PySide6.QtWidgets import QApplication
from app.main_window import MainWindow
from app.samples import SAMPLE
from app.screenshots import ask_and_wait, wait_until
if __name__ == "__main__":
    app = QApplication([])
    tmp = Path(tempfile.mkdtemp())
    doc = tmp / "primer.md"                        # the sample's first sections: its whole prefill is ~25 s on a CPU
    doc.write_text(SAMPLE.read_text()[:2400])
    win = MainWindow({"settings_path": str(tmp / "k.ini"), "document": str(doc), "restore": False,
                      "max_new_tokens": 16, "engine_process": True, "engine": {"model": sys.argv[1]}})
    win.show()
    wait_until(app, lambda: bool(win.document_info) and not win.is_busy(), 300, "the model")
    for _ in range(3):
        ask_and_wait(app, win, "Who is the archivist?", 300)
    win.close()
    print("closed")
"""

DRAWS = r"""
import sys, dataclasses, pickle
from PySide6.QtWidgets import QApplication
from app import pyside_guard
from widgets.timeline_view import TimelineView
steps, mode = pickle.load(open(sys.argv[1], "rb")), sys.argv[2]
if mode != "bare":
    pyside_guard.install(reserve=10_000)
app = QApplication([])
view = TimelineView()
view.resize(1000, 320)
view.show()
for i in range(2000):                  # a live view's draws: each loses 50-200 references to None (PySide6 6.12)
    view.append_steps([dataclasses.replace(steps[i % len(steps)], step=i)])
    app.processEvents()
    if mode == "top-up":
        pyside_guard.top_up()
print("drawn")
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"})


def test_emitting_true_many_times_exits_cleanly_with_the_guard():
    guarded = _run(EMITS, "guard")
    assert guarded.returncode == 0 and "emitted" in guarded.stdout, guarded.stderr[-2000:]
    assert "Fatal Python error" not in guarded.stderr
    if sys.version_info < (3, 12):                 # True is immortal from 3.12 on: nothing to show there
        bare = _run(EMITS, "bare")
        if bare.returncode == 0:
            pytest.skip("this PySide6 no longer drops references to True: app/pyside_guard.py can go")
        assert "_dealloc" in bare.stderr           # the bug the guard is for (bool_dealloc or none_dealloc)


def test_the_window_with_its_engine_process_exits_cleanly_after_turns(default_model_dir):
    out = _run(WINDOW, str(default_model_dir))
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-2000:]
    assert "Fatal Python error" not in out.stderr and "Traceback" not in out.stderr


def test_a_view_drawn_for_long_keeps_running_when_the_guard_tops_up(default_model_dir, tmp_path):
    """The window tops the references up at every tick of its pump (app/pyside_guard.py); the reserve alone runs
    out after enough draws (a long session), and without the guard a few hundred draws are enough. The steps are a
    real layerwise turn's (its prefill and first decode step with their timelines, the rest without, as at GPU
    speed)."""
    import dataclasses
    import pickle

    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder
    llm = LLM(str(default_model_dir), device="cpu", mode="layerwise", max_model_len=512)
    llm.recorder = rec = TraceRecorder(max_steps=64, device=llm.device)
    seq = llm.add_request(list(range(100, 300)), SamplingParams(max_tokens=8, ignore_eos=True))
    while not seq.is_finished:
        llm.step()
    llm.close()
    steps = [s if i < 2 else dataclasses.replace(s, spans=s.spans[:1], slots=[], detailed=False)
             for i, s in enumerate(x for x in rec.steps if x.phase in ("prefill", "decode"))]
    path = tmp_path / "steps.pkl"
    path.write_bytes(pickle.dumps(steps))
    kept = _run(DRAWS, str(path), "top-up")
    assert kept.returncode == 0 and "drawn" in kept.stdout, kept.stderr[-2000:]
    assert "Fatal Python error" not in kept.stderr
    if sys.version_info < (3, 12):                 # None is immortal from 3.12 on: nothing to show there
        for mode in ("reserve", "bare"):
            out = _run(DRAWS, str(path), mode)
            if out.returncode == 0:
                pytest.skip("this PySide6 or pyqtgraph no longer drops references to None while drawing")
            assert "_dealloc" in out.stderr, (mode, out.stderr[-2000:])   # none_dealloc (or bool_dealloc)
