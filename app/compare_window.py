"""The comparison of two recorded turns in a window of its own (widgets/compare_view.py draws it), from File →
Compare with a recording… (the window's own conversation against a file), `python main.py compare A B`, or
`python main.py render A B --out DIR` (offscreen, app/render.py)."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QFileDialog, QMainWindow

from engine.trace.compare import compare
from engine.trace.recording import SUFFIX, Recording, RecordingError, load_recording
from widgets.compare_view import CompareView
from widgets.export import export_with_dialog, show_export_error


class CompareWindow(QMainWindow):
    """`view` (a CompareView); File → Export PNG / SVG."""

    def __init__(self, a: Recording, b: Recording):
        super().__init__()
        self.view = CompareView()
        self.view.set_comparison(compare(a, b))
        self.setCentralWidget(self.view)
        self.setWindowTitle(f"A: {Path(a.meta.get('source', 'A')).name} · B: {Path(b.meta.get('source', 'B')).name}"
                            " — compare — kvscope")
        self.resize(1500, 1000)
        menu = self.menuBar().addMenu("&File")
        menu.addAction("Export &PNG…", lambda: export_with_dialog(self.view, "png", "compare"))
        menu.addAction("Export &SVG…", lambda: export_with_dialog(self.view, "svg", "compare"))
        menu.addAction("&Close", self.close).setShortcut(QKeySequence.StandardKey.Close)


def window_recording(win) -> Recording:
    """The window's conversation (its finished turns) as an unsaved recording."""
    meta = {"origin": "app", "device": win.model_info.get("device", ""), "app": win.describe(),
            "source": win.windowTitle().split(" — ")[0] or "this window"}
    return win.conversation.recording(win.document_info.get("text", ""), meta)


def compare_with_recording(win, path: str | Path) -> CompareWindow | None:
    """A window comparing `win`'s last turn (A) with the last turn of the recording at `path` (B); None and one
    message when there is nothing to compare or the file is not a recording (the window keeps everything)."""
    if not win.conversation.turns:
        show_export_error(win, "Nothing to compare yet: ask a question first (a comparison is of finished turns)",
                          "Nothing to compare")
        return None
    try:
        other = load_recording(path)
        view = CompareWindow(window_recording(win), other)
    except (RecordingError, ValueError) as e:
        show_export_error(win, str(e), "Cannot compare")
        return None
    view.show()
    win._replays = [w for w in getattr(win, "_replays", []) if w.isVisible()] + [view]   # kept alive
    return view


def compare_dialog(win) -> None:
    path, _ = QFileDialog.getOpenFileName(win, "Compare with a recording", str(Path.home()),
                                          f"kvscope recordings (*{SUFFIX});;All files (*)")
    if path:
        compare_with_recording(win, path)
