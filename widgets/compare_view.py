"""Two recorded turns side by side (engine/trace/compare.py computes what is shown): the two answers with their
first difference marked, the figures and their ratios, the two timelines on one time scale, Quest's pick overlap
per layer and kv head, the prefill masks' densities of A and B per layer and head, and one layer and head's masks
of A and B over token bins with their difference.

API: `set_comparison(cmp)`; read back `figures_table`, `answer_a` / `answer_b` (QTextBrowser), `difference_label`,
`timeline_a` / `timeline_b`, `quest_image()` (the Jaccard array shown), `mask_image()` (B's density minus A's),
`mask_pair` (its `layer` / `head` spin boxes, `density(0 | 1)`, and `diff.values`), `notes_label`. Exports as a
whole with widgets/export.py (PNG, SVG).
"""
from __future__ import annotations

import html
import math
from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (QGridLayout, QGroupBox, QHBoxLayout, QLabel, QSpinBox, QTableWidget,
                               QTableWidgetItem, QTabWidget, QTextBrowser, QVBoxLayout, QWidget)

from engine.trace.compare import Comparison, from_zero, layer_recall, pick_raster
from widgets.mask_pattern import PrefillMasks, bin_edges
from widgets.timeline_view import TimelineView

DIFF_COLOR = "#f6c343"      # the answers from their first difference on
DIFF_BINS = 96              # a compared mask's picture: token bins per side at most
PICK_COLORS = ["#ffffff", "#f59e0b", "#2563eb", "#15803d"]   # a page picked by neither, A only, B only, both


def marked(text: str, at: int | None) -> str:
    """`text` as HTML with everything from character `at` on highlighted (None: nothing)."""
    if at is None:
        return f"<p>{html.escape(text)}</p>"
    return (f"<p>{html.escape(text[:at])}<span style='background:{DIFF_COLOR}; color:black'>"
            f"{html.escape(text[at:]) or '&nbsp;(ends here)'}</span></p>")


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if float(v).is_integer() and abs(v) >= 1:
        return f"{v:,.0f}"
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def _mean(values: np.ndarray) -> float:
    return float(np.nanmean(values)) if np.isfinite(values).any() else math.nan


def _before_after(cmp: Comparison) -> str:
    """The overlap while the answers agree and after they part (the steps then read different text)."""
    part, per_step = cmp.parting_step, cmp.quest_step_jaccard
    if part is None or not 0 < part < len(per_step):
        return ""
    return (f" ({_fmt(_mean(per_step[:part]))} over the {part} steps before the answers part, "
            f"{_fmt(_mean(per_step[part:]))} after)")


class _Grid(QWidget):
    """A small heatmap of a [rows, cols] float array (NaN blank) with a caption, values in [lo, hi]."""

    def __init__(self, title: str, x_label: str, colors: list[str], lo: float, hi: float, y_label: str = "layer"):
        super().__init__()
        self.lo, self.hi, self.values = lo, hi, np.zeros((0, 0))
        self.caption = QLabel(title, wordWrap=True)
        self.plot = pg.PlotWidget(background=self.palette().color(QPalette.ColorRole.Base))
        self.plot.hideButtons()
        self.plot.getPlotItem().getViewBox().invertY(True)
        self.plot.getPlotItem().setLabel("left", y_label)
        self.plot.getPlotItem().setLabel("bottom", x_label)
        self.img = pg.ImageItem(axisOrder="row-major")
        self.lut = pg.ColorMap(np.linspace(0, 1, len(colors)), colors).getLookupTable(nPts=256, alpha=True)
        self.plot.addItem(self.img)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.caption)
        layout.addWidget(self.plot, 1)

    def set_values(self, values: np.ndarray | None, caption: str) -> None:
        self.caption.setText(caption)
        self.values = np.zeros((0, 0)) if values is None else np.asarray(values, dtype=float)
        self.plot.setVisible(self.values.size > 0)
        if self.values.size == 0:
            self.img.clear()
            return
        blank = ~np.isfinite(self.values)
        index = np.clip((np.nan_to_num(self.values) - self.lo) / (self.hi - self.lo) * 255, 0, 255).astype(np.uint8)
        rgba = self.lut[index]
        rgba[blank] = 0                                  # no value: transparent
        self.img.setImage(rgba, levels=[0, 255])
        rows, cols = self.values.shape
        self.img.setRect(QRectF(-0.5, -0.5, cols, rows))       # cell (layer, head) centred on its numbers
        self.plot.getPlotItem().getViewBox().autoRange(padding=0)


class _MaskPair(QWidget):
    """One layer and head's prefill mask of A and of B (each cell's share of its causal pairs computed, over token
    bins) and B's minus A's where both prompts have the same length; head -1: the mean of the heads."""

    def __init__(self):
        super().__init__()
        self.masks: tuple[PrefillMasks | None, PrefillMasks | None] = (None, None)
        self.layer, self.head = QSpinBox(), QSpinBox(minimum=-1, specialValueText="mean")
        blue, diverging = ["#f8fafc", "#1d4ed8"], ["#b91c1c", "#f8fafc", "#15803d"]
        self.a, self.b = (_Grid(f"{side}'s mask", "keys (bins)", blue, 0.0, 1.0, "queries (bins)") for side in "AB")
        self.diff = _Grid("B − A", "keys (bins)", diverging, -1.0, 1.0, "queries (bins)")
        controls = QHBoxLayout()
        for label, box in (("layer", self.layer), ("head", self.head)):
            controls.addWidget(QLabel(label))
            controls.addWidget(box)
            box.valueChanged.connect(lambda *_: self._redraw())
        controls.addStretch(1)
        grids = QHBoxLayout()
        for g in (self.a, self.b, self.diff):
            grids.addWidget(g)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(controls)
        layout.addLayout(grids, 1)

    def set_masks(self, a: PrefillMasks | None, b: PrefillMasks | None) -> None:
        self.masks = (a, b)
        shown = [m for m in (a, b) if m is not None]
        self.setVisible(bool(shown))
        if shown:
            self.layer.setRange(min(m.layers[0] for m in shown), max(m.layers[-1] for m in shown))
            self.head.setRange(-1, max(m.n_heads for m in shown) - 1)
            self._redraw()

    def density(self, side: int) -> np.ndarray | None:
        """A's (0) or B's (1) picture of the chosen layer and head: [rows, cols], NaN above the diagonal."""
        m = self.masks[side]
        if m is None or not m.heads(self.layer.value(), self.head.value()):
            return None
        kept, causal = m.cells(self.layer.value(), self.head.value(), bin_edges(m.n, DIFF_BINS))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(causal > 0, kept / causal, np.nan)

    def _redraw(self) -> None:
        where = f"layer {self.layer.value()}, " + ("mean of the heads" if self.head.value() < 0 else
                                                   f"head {self.head.value()}")
        a, b = self.density(0), self.density(1)
        self.a.set_values(a, f"A: {where}" if a is not None else "A: no mask at this layer and head")
        self.b.set_values(b, f"B: {where}" if b is not None else "B: no mask at this layer and head")
        same = a is not None and b is not None and a.shape == b.shape and self.masks[0].n == self.masks[1].n
        self.diff.set_values(b - a if same else None, "B − A (red: B computed less, green: more)" if same else
                             "B − A: needs both masks over prompts of the same length")


class _PickPair(QWidget):
    """One layer and kv head's Quest picks of A and of B over the aligned decode steps (rows) and the sequence's
    pages (columns): A only, B only, both; a line where the answers part (from there the steps read different
    text); the caption counts them and gives each side's recall at that layer when it was measured."""

    def __init__(self):
        super().__init__()
        self.cmp: Comparison | None = None
        self.values = np.zeros((0, 0), np.uint8)
        self.page_size = 0
        self.page_text: Callable[[int, int], str] | None = None   # (side 0 | 1, page) -> its document text
        self.layer, self.head = QSpinBox(), QSpinBox()
        self.caption = QLabel(wordWrap=True)
        self.hover_label = QLabel("Hover a page: which side picked it, and its text", wordWrap=True,
                                  textFormat=Qt.TextFormat.PlainText)
        self.plot = pg.PlotWidget(background=self.palette().color(QPalette.ColorRole.Base))
        self.plot.hideButtons()
        item = self.plot.getPlotItem()
        item.getViewBox().invertY(True)
        item.setLabel("left", "decode step")
        item.setLabel("bottom", "page of the sequence")
        self.img = pg.ImageItem(axisOrder="row-major")
        self.parting = pg.InfiniteLine(angle=0, pen=pg.mkPen("#b91c1c", width=2, style=Qt.PenStyle.DashLine))
        self.plot.addItem(self.img)
        self.plot.addItem(self.parting)
        controls = QHBoxLayout()
        for label, box in (("layer", self.layer), ("kv head", self.head)):
            controls.addWidget(QLabel(label))
            controls.addWidget(box)
            box.valueChanged.connect(lambda *_: self._redraw())
        legend = " ".join(f"<span style='background:{c}'>&nbsp;&nbsp;&nbsp;</span> {name}"
                          for c, name in zip(PICK_COLORS[1:], ("A only", "B only", "both")))
        controls.addWidget(QLabel(legend))
        controls.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(controls)
        layout.addWidget(self.caption)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.hover_label)
        self.plot.scene().sigMouseMoved.connect(self._hover)

    def set_comparison(self, cmp: Comparison) -> None:
        self.cmp = cmp
        picks = [p for steps in (cmp.steps_a, cmp.steps_b) for s in steps for p in s.quest]
        picked = [(p.layer, p.kv_head) for p in picks]
        self.page_size = next((p.page_size for p in picks if p.page_size), 0)
        self.setVisible(bool(picked))
        if picked:
            layers = sorted({l for l, _ in picked})
            self.layer.setRange(layers[0], layers[-1])
            self.head.setRange(0, max(h for _, h in picked))
            if cmp.quest_jaccard is not None:      # start at the layer where A and B agree least
                worst = np.nanargmin(np.where(np.isfinite(cmp.quest_jaccard), cmp.quest_jaccard, np.inf), axis=None)
                self.layer.setValue(int(worst // cmp.quest_jaccard.shape[1]))
                self.head.setValue(int(worst % cmp.quest_jaccard.shape[1]))
            self._redraw()

    def _redraw(self) -> None:
        cmp, layer, head = self.cmp, self.layer.value(), self.head.value()
        self.values = pick_raster(cmp.steps_a, cmp.steps_b, layer, head)
        rows, cols = self.values.shape
        if self.values.size:
            lut = np.array([pg.mkColor(c).getRgb() for c in PICK_COLORS], np.uint8)
            self.img.setImage(lut[self.values], levels=[0, 255])
            self.img.setRect(QRectF(-0.5, -0.5, cols, rows))
            self.plot.getPlotItem().getViewBox().autoRange(padding=0)
        else:
            self.img.clear()
        part = cmp.parting_step
        self.parting.setVisible(part is not None and part < rows)
        if part is not None:
            self.parting.setValue(part - 0.5)
        n_a, n_b = ((self.values & bit).astype(bool).sum(1) for bit in (1, 2))

        def side(name: str, n: np.ndarray, steps) -> str:
            if not n.any():
                return f"{name} picked nothing here (a dense layer, or a policy without picks)"
            recall = layer_recall(steps, layer)
            return (f"{name} {float(np.mean(n[n > 0])):.0f} pages a step"
                    + (f", recall {recall:.3f}" if math.isfinite(recall) else ""))
        both = (self.values == 3).sum(1)
        union = (self.values > 0).sum(1)
        shared = [b / u for b, u in zip(both, union) if u] if n_a.any() and n_b.any() else []
        text = (f"Layer {layer}, kv head {head}: {side('A', n_a, cmp.steps_a)}; {side('B', n_b, cmp.steps_b)}"
                + (f"; shared {float(np.mean(shared)):.2f} of their union" if shared else ""))
        if part is not None and part < rows:
            text += f". The dashed line: from decode step {part} on, the answers differ (the steps read other text)"
        self.caption.setText(text)

    def describe(self, step: int, page: int) -> str:
        """What the picture shows at (decode step, page): who picked the page, its tokens and its document text."""
        who = ("neither", "A only", "B only", "both")[int(self.values[step, page])]
        ps = self.page_size
        text = f"Decode step {step}, page {page}" + (f" (tokens {page * ps:,}–{(page + 1) * ps - 1:,})" if ps else "")
        text += f": picked by {who}"
        a, b = (self.page_text(0, page), self.page_text(1, page)) if self.page_text is not None else ("", "")
        if a and b and a != b:                   # (two documents, or two prompts)
            text += f" · A: “{a}” · B: “{b}”"
        elif a or b:                             # (a side without a token map: a turn that was not Quest's)
            text += f" · “{a or b}”"
        return text

    def _hover(self, pos) -> None:
        at = self.plot.getPlotItem().getViewBox().mapSceneToView(pos)
        step, page = int(round(at.y())), int(round(at.x()))
        if 0 <= step < self.values.shape[0] and 0 <= page < self.values.shape[1]:
            self.hover_label.setText(self.describe(step, page))


class CompareView(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.comparison: Comparison | None = None
        self.title_a, self.title_b = QLabel(wordWrap=True), QLabel(wordWrap=True)
        self.notes_label = QLabel(wordWrap=True)
        self.notes_label.setStyleSheet("color: #b45309")
        self.figures_table = QTableWidget(0, 4)
        self.figures_table.setHorizontalHeaderLabels(["", "A", "B", "B / A"])
        self.figures_table.verticalHeader().hide()
        self.figures_table.horizontalHeader().setStretchLastSection(True)
        self.figures_table.setMinimumHeight(150)
        self.answer_a, self.answer_b = QTextBrowser(), QTextBrowser()
        self.difference_label = QLabel(wordWrap=True, textFormat=Qt.TextFormat.PlainText)
        self.timeline_a, self.timeline_b = TimelineView(), TimelineView()
        self.timeline_b.viewbox.setXLink(self.timeline_a.viewbox)     # one time scale: each turn from its start
        for t in (self.timeline_a, self.timeline_b):
            t.follow_button.hide()                                      # (recorded turns: nothing to follow)
        self.quest = _Grid("Quest picks", "kv head", ["#f8fafc", "#1d4ed8"], 0.0, 1.0)
        self.masks = _Grid("Prefill masks", "head", ["#b91c1c", "#f8fafc", "#15803d"], -0.5, 0.5)
        self.mask_pair = _MaskPair()
        self.pick_pair = _PickPair()

        answers = QGridLayout()
        answers.addWidget(self.title_a, 0, 0)
        answers.addWidget(self.title_b, 0, 1)
        answers.addWidget(self.answer_a, 1, 0)
        answers.addWidget(self.answer_b, 1, 1)
        top = QHBoxLayout()
        top.addLayout(answers, 3)
        top.addWidget(self.figures_table, 2)
        self.tabs = QTabWidget()                # Quest's overlap, or the masks: the one the turns have in front
        masks = QWidget()
        row = QHBoxLayout(masks)
        row.addWidget(self.masks, 1)
        row.addWidget(self.mask_pair, 2)
        picks = QWidget()
        row = QHBoxLayout(picks)
        row.addWidget(self.quest, 1)
        row.addWidget(self.pick_pair, 2)
        self.tabs.addTab(picks, "Quest picks")
        self.tabs.addTab(masks, "Prefill masks")
        timelines = QGroupBox("Timelines (each turn from its start, one time scale): A above, B below")
        tl = QVBoxLayout(timelines)
        tl.addWidget(self.timeline_a)
        tl.addWidget(self.timeline_b)
        layout = QVBoxLayout(self)
        layout.addWidget(self.notes_label)
        layout.addLayout(top, 3)
        layout.addWidget(self.difference_label)
        layout.addWidget(timelines, 4)
        layout.addWidget(self.tabs, 4)

    def set_comparison(self, cmp: Comparison) -> None:
        self.comparison = cmp
        self.title_a.setText(f"<b>A</b>: {html.escape(cmp.label_a)}")
        self.title_b.setText(f"<b>B</b>: {html.escape(cmp.label_b)}")
        self.notes_label.setText(" · ".join(cmp.notes))
        self.notes_label.setVisible(bool(cmp.notes))
        self.answer_a.setHtml(marked(cmp.answer_a, cmp.first_difference))
        self.answer_b.setHtml(marked(cmp.answer_b, cmp.first_difference))
        at = cmp.first_difference
        if at is None:
            self.difference_label.setText("The answers are the same.")
        else:
            words = len(cmp.answer_a[:at].split())
            def cut(text: str) -> str:
                return text[at:at + 32].replace("\n", " ⏎ ") or "(ends)"
            self.difference_label.setText(f"The answers part at character {at} (after {words} words, marked): "
                                          f"A “{cut(cmp.answer_a)}…” · B “{cut(cmp.answer_b)}…”")
        self.figures_table.setRowCount(len(cmp.figures))
        for row, (name, a, b, ratio) in enumerate(cmp.figures):
            for col, text in enumerate((name, _fmt(a), _fmt(b), "—" if math.isnan(ratio) else f"{ratio:.2f}×")):
                item = QTableWidgetItem(text)
                if col:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.figures_table.setItem(row, col, item)
        self.figures_table.resizeColumnsToContents()
        self.timeline_a.set_steps(from_zero(cmp.steps_a))
        self.timeline_b.set_steps(from_zero(cmp.steps_b))
        ext = [t.extent_ms() for t in (self.timeline_a, self.timeline_b) if t.extent_ms() is not None]
        if ext:
            self.timeline_a.viewbox.setXRange(0, max(e[1] for e in ext), padding=0.01)
        if cmp.quest_jaccard is None:
            self.quest.set_values(None, "Quest picks: neither turn (or only one) recorded picks to compare")
        else:
            self.quest.set_values(cmp.quest_jaccard, f"Quest picks: overlap of A's and B's pages (Jaccard, white 0 "
                                  f"→ blue 1) per layer and kv head over {cmp.quest_steps} aligned steps; mean "
                                  f"{_fmt(_mean(cmp.quest_jaccard))}" + _before_after(cmp))
        self.pick_pair.set_comparison(cmp)
        self.mask_pair.set_masks(*(next((m for m in map(PrefillMasks.from_step, steps) if m is not None), None)
                                   for steps in (cmp.steps_a, cmp.steps_b)))
        self.tabs.setCurrentIndex(0 if cmp.quest_jaccard is not None or cmp.mask_density is None else 1)
        if cmp.mask_density is None:
            self.masks.set_values(None, "Prefill masks: neither turn ran a sparse prefill")
        else:
            a, b = cmp.mask_density
            self.masks.set_values(b - a, f"Prefill masks: density of B minus A per layer and head (red: B kept "
                                  f"less, green: more); mean A {_fmt(_mean(a))}, B {_fmt(_mean(b))}")

    def quest_image(self) -> np.ndarray:
        return self.quest.values

    def mask_image(self) -> np.ndarray:
        return self.masks.values
