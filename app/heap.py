"""The engine's long-lived objects out of Python's full collections (Qt-free: the command line uses it too).

A full (oldest-generation) collection walks every object the process tracks: on a CUDA engine, torch's modules, the
compiled kernels' wrappers, the captured graphs, the tokenizer, hundreds of thousands of objects, for a pause of
tens to hundreds of ms on the thread that allocated. The recorder's steps bring such collections sooner (each step
leaves a few objects behind in the views' history), and at GPU decode speed a pause is many tokens. Once a model is
loaded and warm, `freeze()` moves everything the process holds into the collector's permanent generation, so
later collections walk only what came after; `thaw()` before an engine is let go makes its objects collectable
again (cycles among frozen objects are never freed), and at exit everything is thawed, so extension modules that
count their objects at shutdown (Triton's) find them released.
"""
from __future__ import annotations

import atexit
import gc
import time

_registered = False


def freeze() -> None:
    """After a model's load and warm-up: what exists now is skipped by every later collection."""
    global _registered
    if not _registered:
        atexit.register(gc.unfreeze)
        _registered = True
    gc.freeze()


def thaw() -> None:
    """Before an engine is closed and dropped: its objects can be collected again."""
    gc.unfreeze()


class Collections:
    """Python's collections in this process, counted and timed by generation (gc.callbacks), under a label the
    caller sets (`label`; None: not counted). The tools that measure what watching costs report them."""

    def __init__(self):
        self.label, self._t0 = None, 0.0
        self.by: dict = {}                    # label -> [[count, ms] per generation]
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.label is not None:
            n_ms = self.by.setdefault(self.label, [[0, 0.0] for _ in range(3)])[info["generation"]]
            n_ms[0] += 1
            n_ms[1] += (time.perf_counter() - self._t0) * 1e3

    def total(self, label) -> tuple[int, float]:
        """(collections, ms) under `label`, every generation."""
        gens = self.by.get(label, [])
        return sum(n for n, _ in gens), sum(ms for _, ms in gens)

    def line(self, label, units: float, what: str) -> str:
        """The collections under `label` per `what`, `units` of them counted ("GC per turn", units = the turns)."""
        gens = self.by.get(label, [[0, 0.0] for _ in range(3)])
        return f"GC per {what}: " + ", ".join(f"gen{g} {n / units:.2f}x {ms / units:.2f} ms"
                                             for g, (n, ms) in enumerate(gens))
