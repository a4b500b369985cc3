"""A guard against a reference-count bug in PySide6 (seen in 6.12.0): an emit drops references it never took to
`True` (a Signal(bool) emitting True, True inside a Signal(object) or Signal(dict) argument: one per emit,
connected or not) and to `None` (one per None value in a Signal(dict) argument delivered to a slot), and every
call from Python of a Qt method that returns nothing (`setText`, `setVisible`, `processEvents`, ...) drops one
reference to None. Drawing makes many: pyqtgraph calls `QTransform.setMatrix` on every bounding-box query (a live
view's draw and paint: 50-200; the window at an H200's pace: ~370 a turn). On Python 3.11 these are ordinary objects: once a count reaches zero
the interpreter aborts ("Fatal Python error: bool_dealloc: deallocating True or False", "none_dealloc: deallocating
None"), at exit or mid-session. The window's process runs no torch, so None and True have only tens of thousands of
references there: a bare process aborted after ~400 draws of one view, and a window died at exit after a few turns.

`install()` parks references to `True`, `False` and `None` (half a million each, 12 MB) that the bug may eat, in a
list that is itself leaked on purpose (one extra reference no one drops: freed at exit, it would hand back
references the bug already took, and the count would reach zero there), and notes each one's count then.
`top_up()` gives back what was taken since (the count back to that floor; cheap, no memory): the window calls it
at every tick of its telemetry pump, the engine process after every request. The reserve alone lasted ~1,400 GPU-
paced turns of drawing. From Python 3.12 all three are immortal and nothing is needed. `tests/app/test_exits.py`
shows the bug and the guard.
"""
from __future__ import annotations

import ctypes
import sys

RESERVE = 500_000
_reserve: list = []
_floor: dict[int, int] = {}           # id(obj) -> its reference count after install()
_KEPT = (None, True, False)
_incref = ctypes.pythonapi.Py_IncRef  # (the GIL stays held in the call: no other thread's count change is lost)


def install(reserve: int = RESERVE) -> None:
    """Idempotent; a no-op where `True`, `False` and `None` are immortal (Python >= 3.12)."""
    if sys.version_info < (3, 12) and not _reserve:
        _reserve.extend(list(_KEPT) * reserve)
        _incref(ctypes.py_object(_reserve))                        # never freed, not even at exit
        _floor.update({id(obj): sys.getrefcount(obj) for obj in _KEPT})


def top_up() -> int:
    """Give `None`, `True` and `False` back the references taken from them since install() (none where it was not
    installed) -> how many were given back. More than the bug took (objects that held them were freed) does no
    harm: these objects are never freed anyway."""
    given = 0
    for obj in _KEPT:
        missing = _floor.get(id(obj), 0) - sys.getrefcount(obj)
        ref = ctypes.py_object(obj)
        for _ in range(missing):
            _incref(ref)
        given += max(0, missing)
    return given
