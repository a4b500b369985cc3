"""Output paths checked before any work: can this file, or files in this folder, be written?

    problem = output_file_problem(Path("/proc/nope/trace.json"))
    # "its folder /proc/nope does not exist; choose a path in a folder you can write to"
    if problem:
        raise ConfigError(f"--trace {path}: {problem}")

Each function returns None when the path will do, else one line saying what is wrong and what to do,
to follow "<the path>: ".
The CLI (app/cli.py), the app's exports (app/bundle.py, widgets/export.py) and the screenshot tool
ask before they compute anything, so a bad path costs the user nothing. Qt-free, torch-free.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

FIX = "choose a path in a folder you can write to"


def output_file_problem(path: str | os.PathLike, example: str = "out.json") -> str | None:
    """Why the file `path` cannot be written (created or replaced), or None. `example` names a
    file for the hint when `path` is a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        return f"it is a folder; give a file name, e.g. {path / example}"
    folder = path.absolute().parent
    if not folder.exists():
        return f"its folder {folder} does not exist; {FIX}"
    if not folder.is_dir():
        return f"{folder} is a file, not a folder; {FIX}"
    if path.exists() and not os.access(path, os.W_OK):
        return f"it is read-only; {FIX}"
    return _writable(folder)


def output_folder_problem(folder: str | os.PathLike) -> str | None:
    """Why files cannot be written into `folder` (made, with its parents, if missing), or None."""
    folder = Path(folder).expanduser().absolute()
    existing = folder
    while not existing.exists():            # the folder that mkdir(parents=True) would write into
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder; {FIX}"
    return _writable(existing)


def _writable(folder: Path) -> str | None:
    """Try it: os.access says yes to root on read-only places such as /proc."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".kvscope-write-test-"):
            pass
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror or type(e).__name__}); {FIX}"
    return None
