"""The comparison of two recorded turns in a window of its own (widgets/compare_view.py draws it), from File →
Compare with a recording… (the window's own conversation against a file), File → Ask again and compare (the last
question again with the panel's settings now, against its first answer), `python main.py compare A B`, or
`python main.py render A B --out DIR` (offscreen, app/render.py)."""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QFileDialog, QMainWindow

from app.quest_highlight import page_spans
from engine.trace.compare import compare
from engine.trace.recording import SUFFIX, Recording, RecordingError, load_recording
from widgets.compare_view import CompareView
from widgets.export import export_with_dialog, save_png, save_svg, show_export_error

PAGE_TEXT = 160             # characters of a page's text shown when hovering it in the picks' picture


def keep_open(parent, window) -> None:
    """Keep `window` (a recording's or a comparison's, opened from `parent`) alive while it is shown: in
    `parent.side_windows`, which drops those closed."""
    parent.side_windows = [w for w in getattr(parent, "side_windows", []) if w.isVisible()] + [window]



def page_texts(recordings: tuple[Recording, Recording], turns: tuple[int, int], page_size: int):
    """(side, page) -> the document text of that page of side A's (0) or B's (1) prompt, shortened, from the turn's
    token map ("" where the page holds no document tokens, or the turn has no map)."""
    spans = []
    for rec, i in zip(recordings, turns):
        token_map = rec.turns[i % len(rec.turns)].get("token_map") if rec.turns else None
        spans.append(page_spans(token_map, page_size) if token_map is not None and page_size else None)

    def text(side: int, page: int) -> str:
        s = spans[side]
        if s is None or page >= len(s) or s[page, 0] < 0:
            return ""
        words = " ".join(recordings[side].document[s[page, 0]:s[page, 1]].split())
        return words if len(words) <= PAGE_TEXT else words[:PAGE_TEXT - 1] + "…"
    return text


class CompareWindow(QMainWindow):
    """`view` (a CompareView); File → Export PNG / SVG."""

    def __init__(self, a: Recording, b: Recording, turn_a: int = -1, turn_b: int = -1):
        super().__init__()
        self.view = CompareView()
        self.view.set_comparison(compare(a, b, turn_a, turn_b))
        self.view.pick_pair.page_text = page_texts((a, b), (turn_a, turn_b), self.view.pick_pair.page_size)
        self.setCentralWidget(self.view)
        self.setWindowTitle(f"A: {Path(a.meta.get('source', 'A')).name} · B: {Path(b.meta.get('source', 'B')).name}"
                            " — compare — kvscope")
        self.resize(1500, 1000)
        menu = self.menuBar().addMenu("&File")
        menu.addAction("Export &PNG…", lambda: export_with_dialog(self.view, "png", "compare"))
        menu.addAction("Export &SVG…", lambda: export_with_dialog(self.view, "svg", "compare"))
        menu.addAction("Export &bundle…", self._export_bundle_dialog)
        menu.addAction("&Close", self.close).setShortcut(QKeySequence.StandardKey.Close)


    def export_bundle(self, folder: Path) -> Path:
        """compare.png, compare.svg and comparison.json (the figures, the first difference and the decode step the
        answers part at, the notes, the Quest overlap per layer and head and per step, and mask densities as lists)
        into `folder`, or a new timestamped subfolder of it when it is not empty; returns it. ExportError (one line)
        when it cannot be written."""
        from app.bundle import bundle_folder
        out = bundle_folder(Path(folder))
        save_png(self.view, out / "compare.png")
        save_svg(self.view, out / "compare.svg")
        c = self.view.comparison
        data = {"format": "kvscope-comparison", "version": 1, "a": c.label_a, "b": c.label_b, "notes": c.notes,
                "answer_a": c.answer_a, "answer_b": c.answer_b, "first_difference": c.first_difference,
                "figures": [{"name": n, "a": a, "b": b, "b_over_a": r} for n, a, b, r in c.figures],
                "parting_step": c.parting_step, "quest_aligned_steps": c.quest_steps,
                "quest_step_jaccard": c.quest_step_jaccard.tolist(),
                "quest_jaccard": None if c.quest_jaccard is None else c.quest_jaccard.tolist(),
                "mask_density": None if c.mask_density is None else [m.tolist() for m in c.mask_density]}
        (out / "comparison.json").write_text(json.dumps(data, indent=1, default=str).replace("NaN", "null"))
        return out

    def _export_bundle_dialog(self) -> None:
        from app.bundle import ExportError
        folder = QFileDialog.getExistingDirectory(self, "Export the comparison into a folder", str(Path.home()))
        if folder:
            try:
                self.export_bundle(Path(folder))
            except (ExportError, OSError) as e:
                show_export_error(self, str(e))


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
    keep_open(win, view)
    return view


def compare_turns(win, turn_a: int, turn_b: int) -> CompareWindow | None:
    """A window comparing two turns of `win`'s conversation (File → Ask again and compare)."""
    rec = window_recording(win)
    try:
        view = CompareWindow(rec, rec, turn_a, turn_b)
    except ValueError as e:
        show_export_error(win, str(e), "Cannot compare")
        return None
    view.setWindowTitle(f"turn {turn_a + 1} against turn {turn_b + 1} — compare — kvscope")
    view.show()
    keep_open(win, view)
    return view


def compare_dialog(win) -> None:
    path, _ = QFileDialog.getOpenFileName(win, "Compare with a recording", str(Path.home()),
                                          f"kvscope recordings (*{SUFFIX});;All files (*)")
    if path:
        compare_with_recording(win, path)
