"""A row of small labelled figures: decode and prefill speed, TTFT, copy bandwidth, GPU and host KV memory.

    strip.update_from_steps(recorder_steps)          # live, from StepTrace metrics and spans
    strip.set_stats({"ttft_s": 0.4, "decode_tok_s": 31.0, "prefill_tok_s": 5200.0})   # a finished turn

From steps, over the most recent ones (`window` steps): decode tokens/s is decode tokens over the decode steps'
time; H2D/D2H GB/s are the bytes of the copy spans over the time their lane was busy (`summarize`), or, where
spans carry no bytes, the `bytes_h2d`/`bytes_d2h` metrics over the steps' time; GPU memory is the latest
`gpu_mem_allocated` seen (CUDA only; the engine reads it in detailed steps only, so it stays until a newer one
comes or the strip is cleared); host KV is the latest `mem_kv_used` in the offload modes (their KV lives in host
memory; in gpu mode it says "on GPU"). A figure with nothing to show reads "—".
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from PySide6.QtCore import QEvent
from PySide6.QtGui import QFont, QPalette
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from engine.trace.events import D2H, DECODE, H2D, StepTrace
from engine.trace.summary import summarize
from widgets.export import add_export_actions
from widgets.steady import SteadyLabel
from widgets.trace_common import fmt_bytes

# key -> (caption, tooltip)
FIELDS = {
    "decode_tok_s": ("decode tok/s", "Decode speed: generated tokens per second"),
    "prefill_tok_s": ("prefill tok/s", "Prefill speed of the last turn: prompt tokens computed per second"),
    "ttft": ("TTFT", "Time to first token of the last turn"),
    "h2d_gbps": ("H2D GB/s", "Host-to-device copy bandwidth while copying (recent steps)"),
    "d2h_gbps": ("D2H GB/s", "Device-to-host copy bandwidth while copying (recent steps)"),
    "gpu_mem": ("GPU memory", "GPU memory allocated by the engine (latest step)"),
    "host_kv": ("host KV", "KV cache held in host memory (offload modes; latest step)"),
}
NONE = "—"
SAMPLES = {"decode_tok_s": "8,888.8", "prefill_tok_s": "88,888", "ttft": "888 ms", "h2d_gbps": "88.88",
           "d2h_gbps": "88.88", "gpu_mem": "888.8 MiB", "host_kv": "888.8 MiB"}   # each figure's usual widest text


def _get(stats, key: str):
    """A figure from a dict or from an object with attributes (e.g. engine GenerationStats)."""
    if isinstance(stats, Mapping):
        return stats.get(key)
    return getattr(stats, key, None)


class MetricsStrip(QWidget):
    """The figures row. API: `update_from_steps(steps)`, `set_stats(stats)`, `clear()`; read back
    `value(key)` / `values()` (key -> shown text, keys of FIELDS)."""

    def __init__(self, window: int = 16, parent: QWidget | None = None):
        super().__init__(parent)
        self.window = window
        self._values: dict[str, QLabel] = {}
        self._gpu_mem: tuple[float, float | None] | None = None    # (allocated, peak) of the latest step with them
        self._captions: list[QLabel] = []
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 2, 4, 2)
        layout.setSpacing(14)
        value_font = QFont()
        value_font.setBold(True)
        value_font.setPointSizeF(value_font.pointSizeF() * 1.1)
        for key, (caption, tip) in FIELDS.items():
            cell = QFrame()
            cell.setToolTip(tip)
            box = QVBoxLayout(cell)
            box.setContentsMargins(0, 0, 0, 0)
            box.setSpacing(0)
            cap = QLabel(caption)
            small = QFont()
            small.setPointSizeF(small.pointSizeF() * 0.85)
            cap.setFont(small)
            value = SteadyLabel(NONE, SAMPLES[key], value_font)     # a new figure lays out no dock
            value.setObjectName(f"metric_{key}")
            box.addWidget(cap)
            box.addWidget(value)
            layout.addWidget(cell)
            self._values[key] = value
            self._captions.append(cap)
        layout.addStretch(1)
        self._apply_palette()
        self.export_actions = add_export_actions(self, "metrics")

    # ---------------------------------------------------------------- palette
    def changeEvent(self, event) -> None:
        if event.type() == QEvent.Type.PaletteChange:
            self._apply_palette()
        super().changeEvent(event)

    def _apply_palette(self) -> None:
        """Captions in a softer shade of the palette's text colour (readable on dark and light)."""
        pal = self.palette()
        text, base = pal.color(QPalette.ColorRole.WindowText), pal.color(QPalette.ColorRole.Window)
        soft = text.toRgb()
        b = base.toRgb()
        soft.setRgb(*(int(0.7 * c + 0.3 * d) for c, d in zip((soft.red(), soft.green(), soft.blue()),
                                                              (b.red(), b.green(), b.blue()))))
        for cap in self._captions:
            cap.setStyleSheet(f"color: {soft.name()}")

    # ---------------------------------------------------------------- values
    def value(self, key: str) -> str:
        return self._values[key].text()

    def values(self) -> dict[str, str]:
        return {key: label.text() for key, label in self._values.items()}

    def _set(self, key: str, text: str | None) -> None:
        self._values[key].setText(text if text else NONE)

    def clear(self) -> None:
        self._gpu_mem = None
        for key in self._values:
            self._set(key, None)

    def set_stats(self, stats) -> None:
        """Per-turn figures: ttft_s, decode_tok_s, prefill_tok_s (a dict or an object with those attributes)."""
        ttft = _get(stats, "ttft_s")
        if ttft is not None:
            self._set("ttft", f"{ttft * 1e3:.0f} ms" if ttft < 1 else f"{ttft:.2f} s")
        for key in ("decode_tok_s", "prefill_tok_s"):
            rate = _get(stats, key)
            if rate is not None:
                self._set(key, f"{rate:,.1f}" if rate < 100 else f"{rate:,.0f}")

    def update_from_steps(self, steps: Iterable[StepTrace]) -> None:
        """Live figures from the most recent `window` steps (only those that can be worked out are changed)."""
        steps = list(steps)
        if not steps:
            return
        recent = steps[-self.window:]

        decode = [s for s in recent if s.phase == DECODE and s.dur_us > 0]
        if decode:
            tokens = sum(s.metrics.get("decode_tokens", s.n_tokens) for s in decode)
            self._set("decode_tok_s", f"{tokens / (sum(s.dur_us for s in decode) / 1e6):,.1f}")

        summary = summarize([sp for s in recent for sp in s.spans if sp.lane in (H2D, D2H)])   # copy lanes only
        for lane, key, metric in ((H2D, "h2d_gbps", "bytes_h2d"), (D2H, "d2h_gbps", "bytes_d2h")):
            gbps = summary.gbps.get(lane, 0.0)
            if gbps <= 0:   # spans without bytes: the step metrics over the steps' time
                moved = sum(s.metrics.get(metric, 0) for s in recent)
                busy = sum(s.dur_us for s in recent if s.metrics.get(metric))
                gbps = moved / (busy * 1e3) if busy > 0 else 0.0
            has_copies = any(metric in s.metrics for s in recent) or summary.busy_us.get(lane, 0) > 0
            self._set(key, f"{gbps:.2f}" if has_copies else None)

        latest = {}
        for s in recent:
            latest.update(s.metrics)
        for s in reversed(steps):          # (a detailed step, maybe older than the window: the others lack it)
            gpu = s.metrics.get("gpu_mem_allocated", s.metrics.get("mem_gpu_allocated"))
            if gpu is not None:
                self._gpu_mem = gpu, s.metrics.get("gpu_mem_peak")
                break
        gpu, peak = self._gpu_mem or (None, None)
        self._set("gpu_mem", fmt_bytes(gpu) if gpu is not None else None)
        self._values["gpu_mem"].setToolTip(f"peak {fmt_bytes(peak)}" if peak is not None else "")
        offload = any(k in latest for k in ("bytes_h2d", "bytes_d2h")) or any(s.slots for s in recent)
        kv = latest.get("mem_kv_used")
        if kv is None:
            self._set("host_kv", None)
        else:
            self._set("host_kv", fmt_bytes(kv) if offload else "on GPU")
