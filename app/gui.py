"""The desktop app: `python main.py` (no arguments) or `kvscope` opens the main window; `python main.py FILE.kvscope`
opens a recording (no model, no GPU)."""
from __future__ import annotations

import sys


def _application(argv: list[str]):
    from PySide6.QtWidgets import QApplication
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    app.setApplicationDisplayName("kvscope")
    return app


def run(argv: list[str] | None = None, config: dict | None = None) -> int:
    """Create the QApplication (name "kvscope"), show the main window and run the event loop; the exit code."""
    argv = list(sys.argv if argv is None else argv)
    app = _application(argv)
    from app.main_window import MainWindow
    window = MainWindow({"engine_process": True, **(config or {})})   # the engine never shares the GUI's GIL
    window.show()
    return app.exec()


def run_recording(path: str, argv: list[str] | None = None) -> int:
    """Open a recording in its own window (exit 2 and one line when the file is not one)."""
    from engine.trace.recording import RecordingError, load_recording
    try:
        rec = load_recording(path)
    except RecordingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = _application(list(sys.argv[:1] if argv is None else argv))
    window = replay_window(rec)
    window.show()
    return app.exec()


def replay_window(rec, config: dict | None = None):
    """A new MainWindow showing the Recording `rec` (not shown yet): app/replay.py."""
    from app.main_window import MainWindow
    from app.replay import show_recording
    win = MainWindow({**(config or {}), "recording": rec, "autostart": False})
    show_recording(win, rec)
    return win
