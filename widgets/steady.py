"""Labels whose new text does not lay the window out again.

A label's new text asks its parent's layout for a new size, and that request climbs to the main window: each
figure of the metrics strip and each new summary line of the timeline re-laid out every dock (Qt makes an animation
per dock for it) and resized the plots beside them, which then repainted whole. On a 2-core CPU, where the engine
wants both cores, a turn asked for ~10 such layouts. Qt stops the climb at a widget whose size is fixed (its
minimum equals its maximum) and at a parent without a layout, so:

- `SteadyLabel`: a label of fixed size that only grows (when a text does not fit the size it has);
- `SteadyHeight`: a word-wrapped label in a holder without a layout, whose fixed height grows to the lines the text
  needs at its width and shrinks only on `relax()` (e.g. when the view is cleared).
"""
from __future__ import annotations

from PySide6.QtGui import QFont
from PySide6.QtWidgets import QLabel, QWidget


class SteadyLabel(QLabel):
    """A QLabel sized for `sample` (its widest usual text) that keeps that size until a text needs more."""

    def __init__(self, text: str, sample: str, font: QFont | None = None, parent: QWidget | None = None):
        super().__init__(text, parent)
        if font is not None:
            self.setFont(font)
        self._fit(sample)
        self._fit(text)

    def setText(self, text: str) -> None:   # noqa: N802 (Qt's name)
        if text != self.text():
            self._fit(text)
            super().setText(text)

    def _fit(self, text: str) -> None:
        fm = self.fontMetrics()
        m = self.contentsMargins()
        w = fm.horizontalAdvance(text) + m.left() + m.right() + 2
        h = fm.height() + m.top() + m.bottom()
        if w > self.minimumWidth() or h > self.minimumHeight():
            self.setFixedSize(max(w, self.minimumWidth()), max(h, self.minimumHeight()))


class SteadyHeight(QWidget):
    """Holds `label` (word-wrapped, laid over the whole holder) at a fixed height: the lines its text needs at the
    holder's width, grown when a text needs more, never shrunk until `relax()`."""

    def __init__(self, label: QLabel, parent: QWidget | None = None):
        super().__init__(parent)
        self.label = label
        label.setParent(self)
        label.setWordWrap(True)
        label.setMinimumSize(0, 0)
        self._grow(reset=True)

    def text_changed(self) -> None:
        """Call after setting the label's text: grows the holder if the text needs more lines."""
        self._grow()

    def relax(self) -> None:
        """Fit the current text exactly (may shrink: one layout)."""
        self._grow(reset=True)

    def resizeEvent(self, event) -> None:   # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self.label.setGeometry(0, 0, self.width(), self.height())
        self._grow()

    def _grow(self, reset: bool = False) -> None:
        w = self.width()
        need = max(self.label.heightForWidth(w) if w > 1 else 0, self.label.fontMetrics().height())
        fixed = self.minimumHeight() == self.maximumHeight()
        if reset or not fixed or need > self.maximumHeight():
            self.setFixedHeight(need)
