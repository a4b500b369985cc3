"""`python main.py render A.kvscope [B.kvscope] --out DIR`: a recording's views as PNGs, offscreen, with no model and
no GPU (runs captured on a cluster turned into figures in CI or a paper).

For each recording, DIR/<its name>/ gets what File → Export bundle writes from its replay window: window.png, one
PNG per view, chat.png, trace.json, chat.md/json and config.json (the Quest view in front when the turn has picks,
the mask view when it has masks, as in any replay window). For two, DIR/compare/ gets the comparison of their last
turns: compare.png, compare.svg and comparison.json, what the compare window's File → Export bundle writes.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def render(paths: list[str], out: Path, size: tuple[int, int] = (1600, 1000)) -> list[Path]:
    """Write the PNGs; returns what was written. RecordingError for a file that is not a recording."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from engine.trace.recording import load_recording
    recordings = [load_recording(p) for p in paths]          # every file read before anything is drawn
    from PySide6.QtWidgets import QApplication
    app = QApplication.instance() or QApplication(sys.argv[:1])
    from app.gui import replay_window
    from app.screenshots import settle
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for path, rec in zip(paths, recordings):
        win = replay_window(rec, {"settings_path": str(out / ".render.ini"), "restore": False})
        win.resize(*size)
        win.show()
        settle(app, 0.5)
        folder = out / Path(path).stem
        written.append(win.export_bundle(folder))
        win.close()
    if len(recordings) == 2:
        from app.compare_window import CompareWindow
        cmp = CompareWindow(*recordings)
        cmp.resize(*size)
        cmp.show()
        settle(app, 0.5)
        written.append(cmp.export_bundle(out / "compare"))     # compare.png / .svg and comparison.json
        cmp.close()
    (out / ".render.ini").unlink(missing_ok=True)
    return written
