"""The desktop app: `python main.py` (no arguments) or `kvscope` opens the main window."""
from __future__ import annotations

import sys


def run(argv: list[str] | None = None, config: dict | None = None) -> int:
    """Create the QApplication (name "kvscope"), show the main window and run the event loop; the exit code."""
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow

    argv = list(sys.argv if argv is None else argv)
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    app.setApplicationDisplayName("kvscope")
    window = MainWindow({"engine_process": True, **(config or {})})   # the engine never shares the GUI's GIL
    window.show()
    return app.exec()
