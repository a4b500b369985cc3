"""Export bundle: one folder with what a turn looked like and what it did.

    folder = bundle_folder(Path("~/exports").expanduser())      # never overwrites: a fresh timestamped subfolder
    written = write_bundle(folder, window=win.grab(), views={"timeline": win.timeline, ...}, chat=win.chat,
                           steps=worker.turn_steps, config={...})

Contents: window.png (the whole window), one PNG per view, trace.json (the last turn as Chrome trace events, for
Perfetto), chat.md and chat.json (the conversation with its stats and config), config.json (engine, model,
document, sampling). A part that cannot be written is listed under "problems" in config.json; the rest is kept.
A folder that cannot be written is refused before anything is drawn or created (ExportError, one line).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import QWidget

from engine.paths import output_file_problem, output_folder_problem
from engine.trace import write_chrome_trace
from widgets.chat_view import ChatView
from widgets.export import save_png, show_export_error


class ExportError(OSError):
    """A bundle that cannot be written, in one line for the user."""


def bundle_folder(folder: Path) -> Path:
    """`folder` itself when it is new or empty, else a new subfolder named by the time ("kvscope-20250101-120000",
    with "-2", "-3" ... if that exists too). Created; nothing in it is ever overwritten. ExportError (one line)
    when files cannot be written there."""
    folder = Path(folder)
    check_bundle_folder(folder)
    if folder.is_dir() and any(folder.iterdir()):
        base = folder / time.strftime("kvscope-%Y%m%d-%H%M%S")
        candidate, n = base, 1
        while candidate.exists():
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")
        folder = candidate
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def check_bundle_folder(folder: Path) -> None:
    """ExportError when the bundle cannot be written into `folder`; nothing is created."""
    if (problem := output_folder_problem(folder)) is not None:
        raise ExportError(f"Cannot export the bundle to {folder}: {problem}")


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
    if not written:   # the folder took nothing (it was checked, but places change): say so, never "written"
        raise ExportError(f"Cannot export the bundle to {folder}: {problems[0]}")
    return written


def window_bundle(win, folder: Path) -> Path:
    """Write window.png, a PNG of each view registered with export=True (timeline, ring, quest, masks, metrics) and
    chat.png, trace.json (the last turn), chat.md, chat.json and config.json of a MainWindow into `folder`, or into a
    new timestamped subfolder when `folder` is not empty; returns it. A folder that cannot be written raises
    ExportError (an OSError, one line) before anything is drawn."""
    out = bundle_folder(Path(folder))
    steps = None if "ask" in win.requests else list(win.worker.turn_steps)   # never read while it changes
    views = {spec.name: win.views[spec.name] for spec in win.view_specs if spec.export}
    views["chat"] = win.chat
    _settle(views)
    write_bundle(out, win.grab(), views, win.chat, steps, win.describe())
    return out


def _settle(views: dict, timeout_s: float = 3.0) -> None:
    """Let views that draw off the GUI thread (the mask view bins its picture on a worker) finish the picture asked
    for, so the PNG shows it and not the previous one with "binning…"; gives up after `timeout_s`."""
    from PySide6.QtCore import QCoreApplication, QEventLoop

    deadline = time.monotonic() + timeout_s
    while any(getattr(v, "is_binning", lambda: False)() for v in views.values()) and time.monotonic() < deadline:
        QCoreApplication.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
        time.sleep(0.005)


def export_chat_dialog(win) -> None:
    """File → Export chat: Markdown or JSON, where the user says (the dialog asks before overwriting)."""
    from PySide6.QtWidgets import QFileDialog
    path, _ = QFileDialog.getSaveFileName(win, "Export chat", str(Path.home() / "chat.md"),
                                          "Markdown (*.md);;JSON (*.json)")
    if path:
        export_chat(win, Path(path))


def export_chat(win, path: Path) -> bool:
    """Save the chat at `path` (checked first); a failure is one message and the chat stays as it is."""
    problem = output_file_problem(path, "chat.md")
    if problem is None:
        try:
            win.chat.save(path, win.describe())
            win.status.showMessage(f"chat saved to {path}", 5000)
            return True
        except ValueError as e:          # an unknown suffix: the message says which to use
            problem = str(e)
        except OSError as e:
            problem = f"{e.strerror or e}; choose another place"
    show_export_error(win, f"Cannot export the chat to {path}: {problem}")
    return False


def export_bundle_dialog(win) -> None:
    """File → Export bundle: into the folder the user picks (a fresh subfolder when it is not empty)."""
    from PySide6.QtWidgets import QFileDialog
    folder = QFileDialog.getExistingDirectory(win, "Export bundle into a folder", str(Path.home()))
    if folder:
        export_bundle(win, Path(folder))


def export_bundle(win, folder: Path) -> Path | None:
    """Write the bundle into `folder`; a folder that cannot be written is one message, checked first."""
    try:
        out = win.export_bundle(folder)
    except ExportError as e:
        show_export_error(win, str(e))
        return None
    except OSError as e:                 # the folder changed between the check and the writing
        show_export_error(win, f"Cannot export the bundle to {folder}: {e.strerror or e}")
        return None
    win.status.showMessage(f"bundle written to {out}", 8000)
    return out
