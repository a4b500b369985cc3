"""The main window's status bar: model, device, mode, policy and KV memory, plus a progress bar with an ETA.

    bar = StatusBar()
    bar.set_model({"name": "SmolLM2-135M-Instruct", "device": "cpu", "dtype": "float32", "mode": "gpu"})
    bar.show_progress("prefill", 0.4, "prefill: 12 of 30 layers")   # "… 40% · ETA 3 s" from the progress rate,
                                                                     # shown once the task has run 0.3 s
    bar.hide_progress()
    bar.set_memory(step.metrics)                                    # the latest StepTrace's metrics
"""
from __future__ import annotations

import time

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar, QWidget

from widgets.trace_common import fmt_bytes


def format_eta(seconds: float | None) -> str:
    """12.3 -> "12 s", 95 -> "1 min 35 s", None -> "" (not known yet)."""
    if seconds is None:
        return ""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class EtaEstimator:
    """Time left for a task that reports a fraction done, from its rate so far.

    A task is named by a key ("model", "prefill"); a new key, or a fraction that goes back (the next turn's
    prefill), starts a new estimate. The rate is measured from the first report of a task, so time spent before
    it (e.g. tokenizing) does not count: ETA = elapsed × (fraction left) / (fraction done since the first report).
    """

    MIN_ELAPSED_S = 0.25   # no estimate until the task has run this long (the first reports are noise)

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self.key: str | None = None
        self._t0 = 0.0                         # when the task's first report came (`started`)
        self._f0 = 0.0
        self._last = 0.0

    def update(self, key: str, fraction: float, now: float | None = None) -> float | None:
        """Record a report; returns the seconds left, or None while there is no estimate yet."""
        now = self._clock() if now is None else now
        fraction = min(1.0, max(0.0, float(fraction)))
        if key != self.key or fraction < self._last:
            self.key, self._t0, self._f0, self._last = key, now, fraction, fraction
            return None
        self._last = fraction
        done, elapsed = fraction - self._f0, now - self._t0
        if done <= 0 or elapsed < self.MIN_ELAPSED_S:
            return None
        return elapsed * (1.0 - fraction) / done

    @property
    def started(self) -> float:
        """When the current task's first report came (the clock's time)."""
        return self._t0


class StatusBar(QStatusBar):
    """Permanent fields (model, device, mode, policy, memory) and a progress bar shown while something loads.

    Read back: `recording_label`, `model_label`, `device_label`, `mode_label`, `policy_label`, `memory_label`, `watch_label` (QLabels) and
    `progress` (QProgressBar; its text is the task's message, percentage and ETA)."""

    SHOW_AFTER_S = 0.3       # a task's bar appears once the task has run this long
    UPDATE_EVERY_S = 0.1     # and is redrawn at most this often

    def __init__(self, parent: QWidget | None = None, clock=time.monotonic):
        super().__init__(parent)
        self.model_label = QLabel("model: loading…")
        self.device_label = QLabel()
        self.mode_label = QLabel()
        self.policy_label = QLabel()
        self.memory_label = QLabel("KV —")
        self.watch_label = QLabel()
        self.recording_label = QLabel()           # a recording's window: where and when it was made
        self.watch_label.setToolTip("View → Watch the engine: while off, the engine records nothing and the views "
                                    "keep what they last showed")
        self.model_label.setToolTip("The model the engine runs")
        self.device_label.setToolTip("Where the engine computes, and its data type")
        self.mode_label.setToolTip("Where the KV cache lives (gpu, or host memory streamed to the device)")
        self.policy_label.setToolTip("The sparse attention policy of the next turn")
        self.memory_label.setToolTip("From the latest engine step: GPU memory allocated (CUDA) and the KV cache "
                                     "in use (on the device in gpu mode, in host memory in the offload modes)")
        self.progress = QProgressBar(minimum=0, maximum=1000)
        self.progress.setTextVisible(True)
        self.progress.setMinimumWidth(320)
        self.progress.hide()
        self._clock = clock
        self.eta = EtaEstimator(clock)
        self._pending: tuple[int, str] | None = None   # the newest report not drawn yet: (value, text)
        self._drawn = 0.0                                # when the bar was last drawn
        self._timer = QTimer(self, singleShot=True, timeout=self._draw_pending)
        for w in (self.progress, self.recording_label, self.watch_label, self.model_label, self.device_label, self.mode_label,
                  self.policy_label, self.memory_label):
            self.addPermanentWidget(w)

    def set_model(self, info: dict) -> None:
        """From the worker's model_ready dict: name, device, dtype, mode (and plan, shown as a tooltip)."""
        self.model_label.setText(f"model: {info.get('name', '?')}")
        self.model_label.setToolTip(info.get("plan") or "The model the engine runs")
        self.device_label.setText(f"{info.get('device', '?')} · {info.get('dtype', '?')}")
        self.set_mode(info.get("mode", ""))

    def set_mode(self, mode: str) -> None:
        self.mode_label.setText(f"mode: {mode}" if mode else "")

    def set_policy(self, name: str) -> None:
        self.policy_label.setText(f"policy: {name}" if name else "")

    def set_recording(self, text: str) -> None:
        self.recording_label.setText(text)

    def set_watching(self, on: bool) -> None:
        self.watch_label.setText("" if on else "live views paused")

    def set_memory(self, metrics: dict, offload: bool) -> None:
        """GPU memory (CUDA only) and KV in use, from one step's metrics; `offload`: the KV lives on the host."""
        parts = []
        gpu = metrics.get("gpu_mem_allocated", metrics.get("mem_gpu_allocated"))
        if gpu is not None:
            parts.append(f"GPU {fmt_bytes(gpu)}")
        kv = metrics.get("mem_kv_used")
        if kv is not None:
            parts.append(f"{'host' if offload else 'device'} KV {fmt_bytes(kv)}")
        if parts:
            self.memory_label.setText(" · ".join(parts))

    def show_progress(self, key: str, fraction: float, message: str) -> None:
        """Task `key` is at `fraction` (0-1) with `message`; the bar hides itself at 1.0. The bar appears once the
        task has run SHOW_AFTER_S and is redrawn at most every UPDATE_EVERY_S (the newest report; a timer shows
        the last one): a question about a cached document (a prefill of tens of ms) never flashes a bar, and a
        prefill reporting every layer does not repaint the status bar every layer while the engine works."""
        if fraction >= 1.0:
            self.hide_progress()
            return
        now = self._clock()
        eta = format_eta(self.eta.update(key, fraction, now))
        self._pending = (int(round(1000 * max(0.0, fraction))),
                         f"{message} — {100 * fraction:.0f}%" + (f" · ETA {eta}" if eta else ""))
        due = (self._drawn + self.UPDATE_EVERY_S if self.progress.isVisible()
               else self.eta.started + self.SHOW_AFTER_S)
        if now >= due:
            self._draw_pending()
        elif not self._timer.isActive():
            self._timer.start(max(1, int(1000 * (due - now))))

    def _draw_pending(self) -> None:
        self._timer.stop()
        if self._pending is None:
            return
        value, text = self._pending
        self._pending, self._drawn = None, self._clock()
        self.progress.setValue(value)
        self.progress.setFormat(text)
        self.progress.show()

    def hide_progress(self) -> None:
        self._timer.stop()
        self._pending = None
        self.progress.hide()
        self.eta.reset()

    def progress_text(self) -> str:
        """The progress bar's text ("" while hidden)."""
        return self.progress.text() if self.progress.isVisible() else ""
