"""The frame the heatmap views share (Quest picks, sparse prefill masks): a caption, a pyqtgraph plot with one
uint8 image (rows downward), export actions, a hint shown instead while there is nothing to draw, colours that
follow the palette, and hover text. Subclasses build their controls, call `_layout(controls, *below)`, and
implement `_apply_palette` and `tooltip_at(x, y)`."""
from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QRect, QRectF, Qt
from PySide6.QtWidgets import QLabel, QSplitter, QStackedLayout, QVBoxLayout, QWidget

from widgets.export import add_export_actions
from widgets.trace_common import show_hover


class HeatmapView(QWidget):
    side_min = (0, 0)   # the least room for the plot beside the main one (a subclass sets it)

    def _heatmap(self, x_label: str, y_label: str, export_name: str) -> None:
        """The caption, the plot (first row on top), its image and export actions."""
        self.hover_text = ""
        self.caption = QLabel()
        self.caption.setWordWrap(True)
        self.plot = pg.PlotWidget()
        self.plot.hideButtons()
        item = self.plot.getPlotItem()
        self.viewbox: pg.ViewBox = item.getViewBox()
        self.viewbox.invertY(True)
        item.setLabel("bottom", x_label)
        item.setLabel("left", y_label)
        self.img = pg.ImageItem(axisOrder="row-major")
        self.img.setLevels([0, 255])
        self.plot.addItem(self.img)
        self.export_actions = add_export_actions(self.plot, export_name)

    def _layout(self, controls, *below: QWidget, hint: str, side: QWidget | None = None) -> None:
        """Controls, caption, plot (with `side` at its right) and `below` in a column; the hint in its place until
        `_show_plot(True)`. The plot and `side` share their row through a splitter (`self.splitter`, 3 : 1): each
        keeps its minimum size, so `side` is never pushed past the view's edge, and the user can move the line."""
        self._side = side
        content = QWidget()
        col = QVBoxLayout(content)
        col.setContentsMargins(0, 0, 0, 0)
        col.addLayout(controls)
        col.addWidget(self.caption)
        if side is None:
            col.addWidget(self.plot, 1)
        else:
            self.splitter = QSplitter(Qt.Orientation.Horizontal, childrenCollapsible=False)
            self.splitter.addWidget(self.plot)
            self.splitter.addWidget(side)
            self.splitter.setStretchFactor(0, 3)
            self.splitter.setStretchFactor(1, 1)
            col.addWidget(self.splitter, 1)
        for w in below:
            col.addWidget(w)
        self.hint_label = QLabel(hint, alignment=Qt.AlignmentFlag.AlignCenter)
        self.hint_label.setWordWrap(True)
        self._stack = QStackedLayout(self)
        self._stack.addWidget(content)
        self._stack.addWidget(self.hint_label)
        self._stack.setCurrentWidget(self.hint_label)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_caption()
        self._fit_side()

    def _fit_caption(self) -> None:
        """The caption's wrapped lines count towards the view's minimum height (Qt's minimum sizes leave out
        height-for-width), so a long caption never pushes the plots out of the view. Call after setText."""
        text, width = self.caption.text(), max(1, self.width())
        h = self.caption.fontMetrics().boundingRect(QRect(0, 0, width, 1 << 20), Qt.TextFlag.TextWordWrap,
                                                     text).height() if text else 0
        if h != self.caption.minimumHeight():
            self.caption.setMinimumHeight(h)

    def _fit_side(self) -> None:
        """The side plot (title, axes, cells) never gets larger than the widget that shows it, or its right part
        is cut off: the widget is at least as large as the plot needs (`side_min`, or more for long tick labels),
        and the plot is laid out to the widget's size again (pyqtgraph does that only on a resize). Call after
        changing its ticks or title."""
        side = getattr(self, "_side", None)
        if not isinstance(side, pg.PlotWidget):
            return
        item = side.getPlotItem()
        need = item.effectiveSizeHint(Qt.SizeHint.MinimumSize)
        side.setMinimumSize(max(self.side_min[0], math.ceil(need.width())),
                            max(self.side_min[1], math.ceil(need.height())))
        item.setGeometry(QRectF(0, 0, side.width(), side.height()))

    def showing_hint(self) -> bool:
        return self._stack.currentWidget() is self.hint_label

    def changeEvent(self, event) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.StyleChange):
            self._apply_palette()
        super().changeEvent(event)

    def _apply_palette(self) -> None:
        raise NotImplementedError

    def tooltip_at(self, x: float, y: float) -> str:
        raise NotImplementedError

    def _on_mouse_moved(self, scene_pos) -> None:
        self.hover_text = show_hover(self.plot, self.viewbox, scene_pos, self.tooltip_at)
