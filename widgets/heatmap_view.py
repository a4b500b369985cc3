"""The frame the heatmap views share (Quest picks, sparse prefill masks): a caption, a pyqtgraph plot with one
uint8 image (rows downward), export actions, a hint shown instead while there is nothing to draw, colours that
follow the palette, and hover text. Subclasses build their controls, call `_layout(controls, *below)`, and
implement `_apply_palette` and `tooltip_at(x, y)`."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QStackedLayout, QVBoxLayout, QWidget

from widgets.export import add_export_actions
from widgets.trace_common import show_hover


class HeatmapView(QWidget):
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
        `_show_plot(True)`."""
        content = QWidget()
        col = QVBoxLayout(content)
        col.setContentsMargins(0, 0, 0, 0)
        col.addLayout(controls)
        col.addWidget(self.caption)
        if side is None:
            col.addWidget(self.plot, 1)
        else:
            row = QHBoxLayout()
            row.addWidget(self.plot, 3)
            row.addWidget(side, 1)
            col.addLayout(row, 1)
        for w in below:
            col.addWidget(w)
        self.hint_label = QLabel(hint, alignment=Qt.AlignmentFlag.AlignCenter)
        self.hint_label.setWordWrap(True)
        self._stack = QStackedLayout(self)
        self._stack.addWidget(content)
        self._stack.addWidget(self.hint_label)
        self._stack.setCurrentWidget(self.hint_label)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)

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
