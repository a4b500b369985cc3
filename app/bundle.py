"""Export bundle: one folder with what a turn looked like and what it did.

    folder = bundle_folder(Path("~/exports").expanduser())      # never overwrites: a fresh timestamped subfolder
    written = write_bundle(folder, window=win.grab(), views={"timeline": win.timeline, ...}, chat=win.chat,
                           steps=worker.turn_steps, config={...})

Contents: window.png (the whole window), one PNG per view, trace.json (the last turn as Chrome trace events, for
Perfetto), chat.md and chat.json (the conversation with its stats and config), config.json (engine, model,
document, sampling). A part that cannot be written is listed under "problems" in config.json; the rest is kept.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import QWidget

from engine.trace import write_chrome_trace
from widgets.chat_view import ChatView
from widgets.export import save_png


def bundle_folder(folder: Path) -> Path:
    """`folder` itself when it is new or empty, else a new subfolder named by the time ("kvscope-20250101-120000",
    with "-2", "-3" ... if that exists too). Created; nothing in it is ever overwritten."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file: choose a folder for the bundle")
    if folder.is_dir() and any(folder.iterdir()):
        base = folder / time.strftime("kvscope-%Y%m%d-%H%M%S")
        candidate, n = base, 1
        while candidate.exists():
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")
        folder = candidate
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_bundle(folder: Path, window: QPixmap, views: dict[str, QWidget], chat: ChatView, steps: list | None,
                 config: dict) -> list[Path]:
    """Write the bundle's files into `folder` (which must exist); returns the paths written.

    `steps` None means the trace could not be read (a turn was running): trace.json is left out and config.json
    says why."""
    written: list[Path] = []
    problems: list[str] = []

    def attempt(name: str, write) -> None:
        try:
            written.append(write(folder / name))
        except Exception as e:  # noqa: BLE001 - one failed part must not lose the others
            problems.append(f"{name}: {type(e).__name__}: {e}")

    def save_pixmap(path: Path) -> Path:
        if not window.save(str(path), "PNG"):
            raise OSError(f"could not write {path}")
        return path

    attempt("window.png", save_pixmap)
    for name, view in views.items():
        attempt(f"{name}.png", lambda p, v=view: save_png(v, p))
    if steps is None:
        problems.append("trace.json: left out, a turn was running (export again when it has finished)")
    else:
        attempt("trace.json", lambda p: write_chrome_trace(list(steps), p))
    attempt("chat.md", lambda p: chat.save(p))
    attempt("chat.json", lambda p: chat.save(p, config))
    meta = {"format": "kvscope-bundle", "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **config, "trace_steps": None if steps is None else len(steps), "problems": problems}

    def save_config(path: Path) -> Path:
        path.write_text(json.dumps(meta, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
        return path

    attempt("config.json", save_config)
    return written


def export_chat_dialog(win) -> None:
    """File → Export chat: Markdown or JSON, where the user says (the dialog asks before overwriting)."""
    from PySide6.QtWidgets import QFileDialog, QMessageBox
    path, _ = QFileDialog.getSaveFileName(win, "Export chat", str(Path.home() / "chat.md"),
                                          "Markdown (*.md);;JSON (*.json)")
    if path:
        try:
            win.chat.save(path, win.describe())
            win.status.showMessage(f"chat saved to {path}", 5000)
        except (OSError, ValueError) as e:
            QMessageBox.warning(win, "Export failed", str(e))


def export_bundle_dialog(win) -> None:
    """File → Export bundle: into the folder the user picks (a fresh subfolder when it is not empty)."""
    from PySide6.QtWidgets import QFileDialog, QMessageBox
    folder = QFileDialog.getExistingDirectory(win, "Export bundle into a folder", str(Path.home()))
    if folder:
        try:
            out = win.export_bundle(Path(folder))
            win.status.showMessage(f"bundle written to {out}", 8000)
        except OSError as e:
            QMessageBox.warning(win, "Export failed", str(e))
