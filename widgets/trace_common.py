"""What the trace views share: colours, number formats, and `TracePlot`, a time plot over a bounded step history.

Colours are mid-luminance (relative luminance 0.14-0.30), so each has a contrast ratio of at least 3 against a
white and against a near-black background: bars read the same in light and dark palettes. The plot's background,
axes and text follow the widget palette and change with it.
"""
from __future__ import annotations

import time
from collections import deque

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPoint, QTimer, Signal
from PySide6.QtGui import QColor, QFontMetrics, QPalette
from PySide6.QtWidgets import QToolTip, QWidget

from engine.trace.events import COMPUTING, D2H, FREE, H2D, HOST, LOADING, READY, StepTrace
from widgets.export import add_export_actions

# Bar colours of the timeline, by kind of span.
KIND_COLORS = {
    "layer": "#4E79A7",       # a whole layer (or any other compute span)
    "attention": "#C97A1E",
    "mlp": "#4E9A45",
    "wait": "#D64550",        # compute waiting for a copy: exposed transfer time
    "compute": "#7F7F7F",     # other compute: logits, embeddings
    H2D: "#A463B0",
    D2H: "#2E9C8F",
    HOST: "#9C755F",
}
# Ring slot states (loading and computing match the timeline's h2d and compute colours).
STATE_COLORS = {FREE: "#7F7F7F", LOADING: KIND_COLORS[H2D], READY: "#AD8716", COMPUTING: KIND_COLORS["layer"]}

DEFAULT_MAX_STEPS = 200
OVERLAY_LIVE_MS = 250     # labels and the summary line: at most this often while following live steps
OVERLAY_PAN_MS = 40       # ... and while the user pans or zooms
IDLE_GAP_MS = 500         # following live: steps further apart than this are different bursts (turns, loads)


def luminance(color) -> float:
    """WCAG relative luminance of a colour (anything QColor takes)."""
    c = QColor(color)

    def lin(v: float) -> float:
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
    return 0.2126 * lin(c.redF()) + 0.7152 * lin(c.greenF()) + 0.0722 * lin(c.blueF())


def contrast_ratio(a, b) -> float:
    """WCAG contrast ratio of two colours (1 to 21)."""
    la, lb = sorted((luminance(a), luminance(b)))
    return (lb + 0.05) / (la + 0.05)


def text_color_on(color) -> QColor:
    """Black or white, whichever reads better on `color`."""
    black, white = QColor("#000000"), QColor("#FFFFFF")
    return black if contrast_ratio(color, black) >= contrast_ratio(color, white) else white


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_pct(fraction: float) -> str:
    """0.034 -> "3.4%", 0.52 -> "52%"."""
    pct = 100 * fraction
    return f"{pct:.1f}%" if 0 < pct < 10 else f"{pct:.0f}%"


def fmt_us(us: float) -> str:
    """A duration given in µs, in the unit that suits it."""
    if abs(us) >= 1e6:
        return f"{us / 1e6:.2f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


class TracePlot(QWidget):
    """Base of the timeline and ring views: a plot with named rows and a time axis in ms (x pans and zooms, y is
    fixed), over the last `max_steps` steps. Subclasses turn a step into cached drawing data (`_prepare`), draw
    the history (`_redraw`), describe a point (`tooltip_at`) and may refresh overlays for the visible range
    (`refresh_overlays`, debounced while the user pans).

    `follow` (default on) keeps the newest step in view as steps are appended, and never more than the newest
    burst of steps (those with no idle gap over IDLE_GAP_MS between them: the turn that runs, not the idle time
    since the last one); a manual pan or zoom turns it off (`followChanged` says so)."""

    followChanged = Signal(bool)

    def __init__(self, rows: list[str], max_steps: int = DEFAULT_MAX_STEPS, export_name: str = "trace",
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.max_steps = max_steps
        self._history: deque[tuple[StepTrace, object]] = deque(maxlen=max_steps)
        self._follow = True
        self.hover_text = ""       # what the tooltip shows (or last showed) for the mouse position
        self._overlay_timer = QTimer(self, singleShot=True, interval=OVERLAY_PAN_MS)
        self._overlay_timer.timeout.connect(self._overlays_now)
        self._overlays_at = 0.0     # perf_counter of the last refresh of the overlays
        self._scrolling = False     # append_steps is scrolling to the newest step (it refreshes the overlays itself)

        self.plot = pg.PlotWidget()
        self.plot.setMenuEnabled(True)
        self.plot.hideButtons()
        item = self.plot.getPlotItem()
        self.viewbox: pg.ViewBox = item.getViewBox()
        self.viewbox.setMouseEnabled(x=True, y=False)
        self.viewbox.enableAutoRange(x=False, y=False)
        self.viewbox.invertY(True)               # the first row on top
        item.setLabel("bottom", "time (ms)")
        item.showGrid(x=True, y=False, alpha=0.25)
        self.set_rows(rows)
        self.viewbox.sigRangeChangedManually.connect(self._on_manual_range)
        self.viewbox.sigXRangeChanged.connect(self._on_range_changed)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.export_actions = add_export_actions(self.plot, export_name)

    # ---------------------------------------------------------------- rows, palette
    def set_rows(self, rows: list[str]) -> None:
        """Name the rows (row i is drawn at y = i, top to bottom)."""
        self.rows = list(rows)
        axis = self.plot.getPlotItem().getAxis("left")
        axis.setTicks([[(i, name) for i, name in enumerate(self.rows)]])
        # a fixed width that fits the longest name (the automatic one lags a repaint behind and drops labels)
        metrics = QFontMetrics(axis.style.get("tickFont") or self.plot.font())
        axis.setWidth(max([metrics.horizontalAdvance(name) for name in self.rows] + [20]) + 14)
        self.viewbox.setLimits(yMin=-0.5, yMax=max(len(self.rows), 1) - 0.5)
        self.viewbox.setYRange(-0.5, max(len(self.rows), 1) - 0.5, padding=0)

    def changeEvent(self, event) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.StyleChange):
            self._apply_palette()
        super().changeEvent(event)

    def showEvent(self, event) -> None:
        self._apply_palette()
        super().showEvent(event)

    def _apply_palette(self) -> None:
        """Background and axes from the widget palette (dark or light)."""
        pal = self.palette()
        self.plot.setBackground(pal.color(QPalette.ColorRole.Base))
        fg = pal.color(QPalette.ColorRole.Text)
        for name in ("left", "bottom"):
            axis = self.plot.getPlotItem().getAxis(name)
            axis.setPen(fg)
            axis.setTextPen(fg)

    # ---------------------------------------------------------------- history
    @property
    def steps(self) -> list[StepTrace]:
        """The steps shown (oldest first)."""
        return [step for step, _ in self._history]

    def set_steps(self, steps: list[StepTrace]) -> None:
        """Show these steps (the last `max_steps` of them), replacing what was shown; fits the time axis."""
        self._history.clear()
        for step in list(steps)[-self.max_steps:]:
            self._history.append((step, self._prepare(step)))
        self._redraw()
        self.fit()
        self.refresh_overlays()

    def append_step(self, step: StepTrace) -> None:
        """Add the newest step (the oldest is dropped beyond `max_steps`); scrolls to it when following."""
        self.append_steps([step])

    def append_steps(self, steps) -> None:
        """Add several new steps (oldest first) with ONE redraw: for a GUI timer that drains steps in batches."""
        steps = list(steps)[-self.max_steps:]
        if not steps:
            return
        for step in steps:
            self._history.append((step, self._prepare(step)))
        self._redraw()
        if self._follow:
            self._scrolling = True
            try:
                self.scroll_to_latest(arrived=True)
            finally:
                self._scrolling = False
        self._schedule_overlays()

    def _on_range_changed(self, *_) -> None:
        if not self._scrolling:
            self._schedule_overlays()

    def _schedule_overlays(self) -> None:
        """Refresh the overlays at most once per interval: OVERLAY_LIVE_MS while following live steps (they cost
        ~5-10 ms of a core each: refreshing after every step took CPU from the engine on small machines),
        OVERLAY_PAN_MS while the user pans or zooms. While following, a refresh that is due runs at once, so the
        bars and their labels are painted together (a refresh a timer's interval after a draw painted the plot a
        second time: on a 2-core CPU, whose drawing is throttled to ~1 draw/s, every draw)."""
        if self._overlay_timer.isActive():
            return
        wait_ms = OVERLAY_LIVE_MS if self._follow else OVERLAY_PAN_MS
        since_ms = (time.perf_counter() - self._overlays_at) * 1e3
        if self._follow and since_ms >= wait_ms:
            self._overlays_now()
        else:
            self._overlay_timer.start(max(1, int(wait_ms - since_ms)) if self._follow else wait_ms)

    def _overlays_now(self) -> None:
        self._overlays_at = time.perf_counter()
        self.refresh_overlays()

    def clear(self) -> None:
        self._history.clear()
        self._redraw()
        self.refresh_overlays()

    def extent_ms(self) -> tuple[float, float] | None:
        """Time span of the history, in ms (None when empty)."""
        if not self._history:
            return None
        return self._history[0][0].t0_us / 1e3, max(s.t1_us for s, _ in self._history) / 1e3

    def visible_ms(self) -> tuple[float, float]:
        (x0, x1), _ = self.viewbox.viewRange()
        return x0, x1

    def fit(self) -> None:
        """Show the whole history."""
        ext = self.extent_ms()
        if ext is not None:
            self.viewbox.setXRange(ext[0], max(ext[1], ext[0] + 1e-3), padding=0.01)

    def burst_ms(self) -> tuple[float, float] | None:
        """Time span of the newest burst of steps, in ms: back from the newest step to the first idle gap over
        IDLE_GAP_MS (None when empty)."""
        if not self._history:
            return None
        end = max(s.t1_us for s, _ in self._history)
        start = self._history[-1][0].t0_us
        for step, _ in reversed(self._history):
            if start - step.t1_us > IDLE_GAP_MS * 1e3:
                break
            start = min(start, step.t0_us)
        return start / 1e3, end / 1e3

    def fit_burst(self) -> None:
        """Show the newest burst of steps whole (the last turn, without the idle time before it)."""
        burst = self.burst_ms()
        if burst is not None:
            self.viewbox.setXRange(burst[0], max(burst[1], burst[0] + 1e-3), padding=0.01)

    def scroll_to_latest(self, arrived: bool = False) -> None:
        """Keep the visible width and put the newest step's end at the right edge; the whole newest burst where it
        is no wider, is a single step, or (`arrived`: steps just came) begins after the visible range (a new turn):
        an idle gap before the running turn is never shown."""
        burst = self.burst_ms()
        if burst is None:
            return
        x0, x1 = self.visible_ms()
        width = x1 - x0
        if width >= burst[1] - burst[0] or len(self._history) == 1 or (arrived and x1 < burst[0]):
            self.fit_burst()
        else:
            self.viewbox.setXRange(burst[1] - width, burst[1], padding=0)

    # ---------------------------------------------------------------- follow
    @property
    def follow(self) -> bool:
        return self._follow

    def set_follow(self, on: bool) -> None:
        """Auto-scroll to the newest step (turned off by a manual pan or zoom)."""
        on = bool(on)
        if on != self._follow:
            self._follow = on
            self.followChanged.emit(on)
        if on:
            self.scroll_to_latest()

    def _on_manual_range(self, *_) -> None:
        self.set_follow(False)

    # ---------------------------------------------------------------- hover
    def _on_mouse_moved(self, scene_pos) -> None:
        self.hover_text = show_hover(self.plot, self.viewbox, scene_pos, self.tooltip_at)

    def row_at(self, y: float) -> int | None:
        row = int(round(y))
        return row if 0 <= row < len(self.rows) and abs(y - row) <= 0.45 else None

    def pixel_ms(self) -> float:
        """Width of one screen pixel in ms (for hover tolerance and label room)."""
        px = self.viewbox.viewPixelSize()[0]
        return px if px > 0 else 1e-3

    # ---------------------------------------------------------------- for subclasses
    def _prepare(self, step: StepTrace):
        """Drawing data of one step, computed once when it arrives."""
        return None

    def _redraw(self) -> None:
        raise NotImplementedError

    def tooltip_at(self, x_ms: float, y: float) -> str:
        """Tooltip text for a point in view coordinates ("" for nothing there)."""
        return ""

    def refresh_overlays(self) -> None:
        """Recompute what depends on the visible range (labels, summaries)."""


def show_hover(plot, viewbox, scene_pos, tooltip_at) -> str:
    """Show `tooltip_at(x, y)` (data coordinates) as a tooltip at the mouse over a plot; -> the text ("" = none)."""
    if not viewbox.sceneBoundingRect().contains(scene_pos):
        QToolTip.hideText()
        return ""
    p = viewbox.mapSceneToView(scene_pos)
    text = tooltip_at(p.x(), p.y())
    if text:
        view_pos = plot.mapFromScene(scene_pos)
        QToolTip.showText(plot.mapToGlobal(QPoint(view_pos.x(), view_pos.y())), text, plot)
    else:
        QToolTip.hideText()
    return text


def apply_heatmap_palette(widget: QWidget, plots, image, color: str) -> None:
    """Heatmap views (Quest picks, sparse masks): plot backgrounds and axes from the widget's palette, and the
    image's lookup table from the background to `color`, so a map reads in light and dark themes alike."""
    import numpy as np
    pal = widget.palette()
    bg, fg = pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text)
    for plot in plots:
        plot.setBackground(bg)
        for name in ("left", "bottom"):
            axis = plot.getPlotItem().getAxis(name)
            axis.setPen(fg)
            axis.setTextPen(fg)
    c = QColor(color)
    t = np.linspace(0.0, 1.0, 256)[:, None]
    lut = (1 - t) * [bg.red(), bg.green(), bg.blue()] + t * [c.red(), c.green(), c.blue()]
    image.setLookupTable(np.round(lut).astype(np.uint8))
