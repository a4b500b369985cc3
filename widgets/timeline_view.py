"""Stream timeline: what ran on compute, H2D, D2H and the host, step after step.

One row per lane; each span a bar coloured by its kind (a layer, attention, mlp, a wait for a copy, other
compute, a copy, host work). All bars of one colour are one `BarGraphItem` (arrays of rectangles), so thousands
of spans draw in one call. Spans nested in another of their lane ("attention" inside "layer 3") are drawn
thinner, in the lower part of their parent, leaving the parent's top strip for its label ("L3" or its name
where there is room). The time axis pans and zooms (x only); "Follow live" keeps the newest step in view.
Below the plot, a line summarizes the visible range: how busy each lane was, how much of the copying hid
behind compute, the exposed copy time and the copy bandwidth (`engine.trace.summary.summarize`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QToolButton, QVBoxLayout, QWidget

from engine.trace.events import COMPUTE, D2H, H2D, HOST, LANES, Span, StepTrace
from engine.trace.summary import TraceSummary, lane_arrays, summarize
from widgets.steady import SteadyHeight
from widgets.trace_common import (DEFAULT_MAX_STEPS, KIND_COLORS, TracePlot, fmt_bytes, fmt_pct, fmt_us,
                                  text_color_on)

LANE_TITLES = {COMPUTE: "compute", H2D: "H2D", D2H: "D2H", HOST: "host"}
KIND_TITLES = {"layer": "layer", "attention": "attention", "mlp": "mlp", "wait": "wait for copy",
               "compute": "other compute", H2D: "H2D", D2H: "D2H", HOST: "host"}
KIND_LANE = {"layer": COMPUTE, "attention": COMPUTE, "mlp": COMPUTE, "wait": COMPUTE, "compute": COMPUTE,
             H2D: H2D, D2H: D2H, HOST: HOST}
MAX_LABELS = 120
LABEL_MIN_PX = 22      # a bar gets a label from this width on


def span_kind(span: Span) -> str:
    """The colour group of a span: a key of KIND_COLORS."""
    if span.lane == COMPUTE:
        name = span.name
        if name.startswith("layer"):
            return "layer"
        if name in ("attention", "mlp"):
            return name
        if name.startswith("wait"):
            return "wait"
        return "compute"
    return span.lane


def nesting_depths(spans: list[Span]) -> list[int]:
    """For spans of one lane: how many earlier spans are still open when each one starts (0 = top level)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].t0_us, -spans[i].t1_us))
    depths = [0] * len(spans)
    open_ends: list[float] = []
    for i in order:
        s = spans[i]
        while open_ends and open_ends[-1] <= s.t0_us:
            open_ends.pop()
        depths[i] = len(open_ends)
        open_ends.append(s.t1_us)
    return depths


def bar_rows(row: int, depth: int) -> tuple[float, float]:
    """(top, height) of a bar in row `row` at nesting `depth` (rows are 0.8 high; y grows downwards)."""
    d = min(depth, 2)
    return row - 0.4 + 0.3 * d, 0.8 - 0.3 * d


@dataclass
class _StepBars:
    """A step's bars by kind ([x0_ms, x1_ms, top, height] rows), its spans by lane, for lookups, and as the
    summary's arrays (`engine.trace.summary.lane_arrays`: made once, not at each refresh of the summary line)."""
    rects: dict[str, np.ndarray]
    lanes: dict[str, list[tuple[Span, int]]] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def describe_span(span: Span, step: StepTrace | None = None) -> str:
    """The hover text of a span: name, layer, slot, duration, bytes and GB/s."""
    lines = [span.name]
    where = [f"{what} {value}" for what, value in (("layer", span.layer), ("slot", span.slot)) if value is not None]
    if where:
        lines.append(" · ".join(where))
    lines.append(f"duration {fmt_us(span.dur_us)}")
    if span.bytes:
        gbps = span.bytes / (span.dur_us * 1e3) if span.dur_us > 0 else 0.0
        lines.append(f"{fmt_bytes(span.bytes)} · {gbps:.2f} GB/s")
    if span.args:
        lines.append(" · ".join(f"{k} {v}" for k, v in span.args.items()))
    lane = LANE_TITLES.get(span.lane, span.lane)
    lines.append(f"{lane} lane" + (f" · step {step.step} ({step.label})" if step is not None else ""))
    return "\n".join(lines)


class TimelineView(TracePlot):
    """The stream timeline. API: `set_steps(steps)`, `append_step(step)` (the last `max_steps` are kept),
    `clear()`, `set_follow(on)`, `fit()`; read back `bar_count(lane)`, `span_at(x_ms, lane)`, `summary`
    (TraceSummary of the visible range) and `summary_label.text()`."""

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS, parent: QWidget | None = None):
        super().__init__([LANE_TITLES[lane] for lane in LANES], max_steps, "timeline", parent)
        self.summary: TraceSummary | None = None
        self._bars: dict[str, pg.BarGraphItem] = {}
        self._drawn: dict[str, list] = {}       # kind -> the steps' bar arrays it shows (held: `is` compares them)
        for kind, color in KIND_COLORS.items():
            item = pg.BarGraphItem(x0=[], x1=[], y0=[], height=[], brush=color, pen=pg.mkPen(color, width=1))
            self.plot.addItem(item)
            self._bars[kind] = item
        self._labels: list[pg.TextItem] = []

        self.follow_button = QToolButton(text="Follow live", checkable=True, checked=self.follow)
        self.follow_button.setToolTip("Scroll to the newest step as steps arrive (a pan or zoom turns it off)")
        self.follow_button.toggled.connect(self.set_follow)
        self.followChanged.connect(self.follow_button.setChecked)
        fit_button = QPushButton("Fit")
        fit_button.setToolTip("Show the whole history")
        fit_button.clicked.connect(self.fit)
        legend = QLabel("  ".join(f'<span style="color:{c}">■</span> {KIND_TITLES[k]}'
                                  for k, c in KIND_COLORS.items()))
        legend.setTextFormat(Qt.TextFormat.RichText)
        self.summary_label = QLabel("no steps yet")
        self._summary_box = SteadyHeight(self.summary_label)    # a new summary line lays out no dock, resizes no plot
        self.summary_label.setToolTip("Busy: share of the visible time each lane worked. Overlap: share of copy time "
                                      "that ran while compute ran. Exposed copy: copy time with compute idle.")

        bar = QHBoxLayout()
        bar.addWidget(self.follow_button)
        bar.addWidget(fit_button)
        bar.addStretch(1)
        bar.addWidget(legend)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(bar)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self._summary_box)

    # ---------------------------------------------------------------- drawing data
    def _prepare(self, step: StepTrace) -> _StepBars:
        rows: dict[str, list[list[float]]] = {}
        lanes: dict[str, list[tuple[Span, int]]] = {}
        for row, lane in enumerate(LANES):
            spans = [s for s in step.spans if s.lane == lane]
            depths = nesting_depths(spans)
            lanes[lane] = sorted(zip(spans, depths), key=lambda sd: sd[0].t0_us)
            for s, d in zip(spans, depths):
                top, height = bar_rows(row, d)
                rows.setdefault(span_kind(s), []).append([s.t0_us / 1e3, s.t1_us / 1e3, top, height])
        return _StepBars({k: np.asarray(v, dtype=np.float64) for k, v in rows.items()}, lanes, lane_arrays(step.spans))

    def _redraw(self) -> None:
        empty = np.zeros((0, 4))
        for kind, item in self._bars.items():
            parts = [bars.rects[kind] for _, bars in self._history if kind in bars.rects]
            drawn = self._drawn.get(kind)
            if drawn is not None and len(drawn) == len(parts) and all(a is b for a, b in zip(drawn, parts)):
                continue             # the same steps' bars of this kind (steps without a timeline add none)
            self._drawn[kind] = parts
            a = np.concatenate(parts) if parts else empty
            item.setOpts(x0=a[:, 0], x1=a[:, 1], y0=a[:, 2], height=a[:, 3])
        if not self._history:
            for label in self._labels:
                label.setVisible(False)

    def bar_count(self, lane: str | None = None) -> int:
        """How many bars are drawn (in one lane, or in all)."""
        return sum(len(item.opts["x0"]) for kind, item in self._bars.items() if lane in (None, KIND_LANE[kind]))

    # ---------------------------------------------------------------- lookups
    def span_at(self, x_ms: float, lane: str, tolerance_ms: float = 0.0) -> tuple[Span, StepTrace] | None:
        """The innermost span of `lane` under time `x_ms` (or within `tolerance_ms` of it), with its step."""
        t = x_ms * 1e3
        tol = tolerance_ms * 1e3
        best, best_key = None, None
        for step, bars in self._history:
            if not step.t0_us - tol <= t <= step.t1_us + tol:
                continue
            for span, depth in bars.lanes.get(lane, ()):
                if span.t0_us - tol > t:
                    break
                if span.t1_us + tol < t:
                    continue
                inside = span.t0_us <= t <= span.t1_us
                distance = 0.0 if inside else min(abs(span.t0_us - t), abs(span.t1_us - t))
                key = (inside, depth, -distance)
                if best_key is None or key > best_key:
                    best, best_key = (span, step), key
        return best

    def tooltip_at(self, x_ms: float, y: float) -> str:
        row = self.row_at(y)
        if row is None:
            return ""
        found = self.span_at(x_ms, LANES[row], tolerance_ms=3 * self.pixel_ms())
        return describe_span(*found) if found else ""

    # ---------------------------------------------------------------- overlays: labels and the summary line
    def refresh_overlays(self) -> None:
        self._overlay_timer.stop()
        self._place_labels()
        self._update_summary()

    def _visible_steps(self, x0_ms: float, x1_ms: float):
        return [(s, b) for s, b in self._history if s.t1_us >= x0_ms * 1e3 and s.t0_us <= x1_ms * 1e3]

    def _place_labels(self) -> None:
        x0, x1 = self.visible_ms()
        px = self.pixel_ms()
        used = 0
        for step, bars in self._visible_steps(x0, x1):
            for row, lane in enumerate(LANES):
                for span, depth in bars.lanes.get(lane, ()):
                    if used >= MAX_LABELS:
                        break
                    if depth or span.layer is None:
                        continue
                    a, b = max(span.t0_us / 1e3, x0), min(span.t1_us / 1e3, x1)
                    width_px = (b - a) / px
                    if width_px < LABEL_MIN_PX:
                        continue
                    text = span.name if width_px >= 7 * len(span.name) + 8 else f"L{span.layer}"
                    self._label(used, text, a, bar_rows(row, 0)[0], KIND_COLORS[span_kind(span)])
                    used += 1
        for label in self._labels[used:]:
            label.setVisible(False)

    def _label(self, i: int, text: str, x: float, y: float, bar_color: str) -> None:
        if i == len(self._labels):
            label = pg.TextItem(anchor=(0, 0))
            font = QFont()
            font.setPointSizeF(7.5)
            label.setFont(font)
            label.setZValue(10)
            self.plot.addItem(label, ignoreBounds=True)
            self._labels.append(label)
        label = self._labels[i]
        label.setText(text, color=text_color_on(bar_color))
        label.setPos(x, y)
        label.setVisible(True)

    def visible_labels(self) -> list[str]:
        """The bar labels now shown."""
        return [label.toPlainText() for label in self._labels if label.isVisible()]

    def _update_summary(self) -> None:
        ext = self.extent_ms()
        if ext is None:
            self.summary = None
            self.summary_label.setText("no steps yet")
            self._summary_box.relax()
            return
        v0, v1 = self.visible_ms()
        t0, t1 = max(v0, ext[0]) * 1e3, min(v1, ext[1]) * 1e3
        if t1 <= t0:
            self.summary = None
            self.summary_label.setText("nothing recorded in the visible range")
            self._summary_box.text_changed()
            return
        visible = self._visible_steps(t0 / 1e3, t1 / 1e3)
        steps = [step for step, _ in visible]
        self.summary = s = summarize(steps, t0=t0, t1=t1, arrays=[bars.arrays for _, bars in visible])
        busy = " · ".join(f"{LANE_TITLES[lane]} {fmt_pct(s.busy_fraction.get(lane, 0.0))}" for lane in LANES)
        text = (f"visible {fmt_us(t1 - t0)} — busy: {busy} — copy overlapped by compute {fmt_pct(s.overlap_fraction)}"
                + f" — exposed copy {fmt_us(s.exposed_copy_us)}")
        shown = sum(step.detailed for step in steps)
        if shown < len(steps):   # the engine recorded the timeline of some decode steps only (its detail rate)
            text = f"timeline of {shown} of {len(steps)} steps (figures over those) — " + text
        for step in steps:       # a long chunked prefill: the timeline of some of its chunks (the same rate)
            if step.windows is not None and len(step.windows) < step.metrics.get("parts", 0):
                text = (f"{step.label}: timeline of {len(step.windows)} of {step.metrics['parts']:.0f} chunks "
                        "(figures over those) — " + text)
        rates = [f"{LANE_TITLES[lane]} {s.gbps[lane]:.2f} GB/s" for lane in (H2D, D2H) if s.gbps.get(lane)]
        if rates:
            text += " — " + " · ".join(rates)
        self.summary_label.setText(text)
        self._summary_box.text_changed()
