"""A guard against a reference-count bug in PySide6 (seen in 6.12.0): an emit drops references it never took to
`True` (a Signal(bool) emitting True, True inside a Signal(object) or Signal(dict) argument: one per emit,
connected or not) and to `None` (one per None value in a Signal(dict) argument delivered to a slot). On Python
3.11 these are ordinary objects: once a count reaches zero the interpreter aborts ("Fatal Python error:
bool_dealloc: deallocating True or False", "none_dealloc: deallocating None"), at exit or mid-session.
The window's process runs no torch, so `True` has only a few thousand references there, and the app died at
exit after a few turns (the engine-in-a-process window; the engine thread's process, with torch, had ~100x
more references and failed only sometimes, as "none_dealloc" once).

`install()` parks references to `True` and `None` that the bug may eat: each one is one emit more before trouble
(half a million each, 8 MB: a turn loses a few dozen). They sit in a list that is itself leaked on purpose (one
extra reference no one drops): freed at exit, it would hand back references the bug already took, and the count
would reach zero there. From Python 3.12 both are immortal and nothing is needed. `tests/app/test_exits.py` shows
the bug and the guard (a process that emits them 5,000 times exits 0 with the guard, aborts without it).
"""
from __future__ import annotations

import ctypes
import sys

RESERVE = 500_000
_reserve: list = []


def install() -> None:
    """Idempotent; a no-op where `True` and `None` are immortal (Python >= 3.12)."""
    if sys.version_info < (3, 12) and not _reserve:
        _reserve.extend([True, None] * RESERVE)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_reserve))     # never freed, not even at exit
