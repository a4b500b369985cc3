"""One message of the conversation: its title, its text (Markdown for answers) and, under an answer, the stats line.

The chat view (widgets/chat_view.py) stacks these; `format_stats` is also its Markdown export's stats line.
"""
from __future__ import annotations

import json

from PySide6.QtCore import QEvent, QSize, Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QFrame, QLabel, QSizePolicy, QTextBrowser, QVBoxLayout, QWidget

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "error": "Error"}
MIB = 2**20


def error_colour(widget: QWidget) -> str:
    """A red that reads well on the widget's background (lighter on dark palettes)."""
    dark = widget.palette().color(QPalette.ColorRole.Base).lightnessF() < 0.5
    return "#ff7b72" if dark else "#c62828"


def format_stats(stats: dict | None) -> str:
    """One short line: prompt/cached tokens, TTFT, prefill and decode speed, KV traffic, finish reason."""
    if not stats:
        return ""
    parts = []
    if "prompt_tokens" in stats:
        parts.append(f"prompt {stats['prompt_tokens']:,} tok")
    if "cached_tokens" in stats:
        disk = stats.get("disk_cached_tokens") or 0
        parts.append(f"cached {stats['cached_tokens']:,}" + (f" ({disk:,} from disk)" if disk else ""))
    if "completion_tokens" in stats:
        parts.append(f"answer {stats['completion_tokens']:,} tok")
    if stats.get("ttft_s") is not None:
        parts.append(f"TTFT {stats['ttft_s']:.2f} s")
    if stats.get("prefill_tok_s") is not None:
        parts.append(f"prefill {stats['prefill_tok_s']:,.0f} tok/s")
    if stats.get("decode_tok_s") is not None:
        parts.append(f"decode {stats['decode_tok_s']:,.1f} tok/s")
    h2d, d2h = stats.get("bytes_h2d") or 0, stats.get("bytes_d2h") or 0
    if h2d or d2h:
        parts.append(f"KV host→GPU {h2d / MIB:,.1f} MiB, GPU→host {d2h / MIB:,.1f} MiB")
    if stats.get("finish_reason"):
        parts.append(f"finish: {stats['finish_reason']}")
    return " · ".join(parts)


def muted_colour(widget: QWidget) -> QColor:
    """Text colour halfway to the background: for secondary lines, readable on dark and light palettes."""
    pal = widget.palette()
    text, base = pal.color(QPalette.ColorRole.Text), pal.color(widget.backgroundRole())
    return QColor.fromRgbF(*(0.6 * t + 0.4 * b for t, b in zip(text.getRgbF()[:3], base.getRgbF()[:3])))


class MessageBrowser(QTextBrowser):
    """A read-only Markdown view that grows to fit its text (the conversation's scroll area scrolls)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.viewport().setAutoFillBackground(False)   # the bubble's background shows through
        self.document().documentLayout().documentSizeChanged.connect(self._fit)

    def _fit(self, *_):
        height = int(self.document().size().height()) + 2 * self.frameWidth() + 4
        if height != self.height():
            self.setFixedHeight(height)

    def resizeEvent(self, event):
        super().resizeEvent(event)
        self._fit()

    def sizeHint(self) -> QSize:
        return QSize(200, self.height())


class MessageWidget(QFrame):
    """One message: a title ("You" / "Assistant" / "Error"), its text, and (answers) a stats line."""

    def __init__(self, role: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.role = role
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setAutoFillBackground(True)
        self.setBackgroundRole(QPalette.ColorRole.AlternateBase if role == "user" else QPalette.ColorRole.Base)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(2)
        self.title = QLabel(ROLE_TITLES.get(role, role))
        font = self.title.font()
        font.setBold(True)
        self.title.setFont(font)
        self.body = MessageBrowser()
        self.stats_label = QLabel()
        self.stats_label.setWordWrap(True)
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        small = self.stats_label.font()
        small.setPointSizeF(max(6.0, small.pointSizeF() * 0.85))
        self.stats_label.setFont(small)
        self.stats_label.hide()
        self._mute_stats()
        for w in (self.title, self.body, self.stats_label):
            layout.addWidget(w)
        self._error_colour = ""
        self._colour_error()

    def _colour_error(self) -> None:
        colour = error_colour(self) if self.role == "error" else ""
        if colour != self._error_colour:
            self._error_colour = colour
            self.title.setStyleSheet(f"color: {colour};")
            self.body.setStyleSheet(f"color: {colour};")

    def _mute_stats(self) -> None:
        pal = self.stats_label.palette()
        for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text):   # selectable labels use Text
            pal.setColor(role, muted_colour(self))
        self.stats_label.setPalette(pal)

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and hasattr(self, "_error_colour"):   # e.g. now dark
            self._mute_stats()
            self._colour_error()

    def set_text(self, text: str) -> None:
        if self.role == "assistant":
            self.body.setMarkdown(text)
        else:
            self.body.setPlainText(text)

    def set_stats(self, stats: dict | None) -> None:
        line = format_stats(stats)
        self.stats_label.setText(line)
        self.stats_label.setToolTip(json.dumps(stats, indent=1) if stats else "")
        self.stats_label.setVisible(bool(line))
