"""The loaded document: its name, token count, a read-only preview and a context meter.

A pure view. It asks for a document (`open_requested()`, or `file_dropped(path)` when a supported file is
dropped on it) and the window answers with `set_document(name, text, tokens)` once the file is parsed.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor, QDragEnterEvent, QDropEvent, QPalette, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar, QPushButton, QTextEdit,
                               QVBoxLayout, QWidget)

SUPPORTED_SUFFIXES = (".txt", ".md", ".pdf", ".html", ".htm")
SUPPORTED_TEXT = "a .txt, .md, .pdf or .html file"
KV_LOCATIONS = {"gpu": "GPU", "layerwise": "host (layerwise)", "chunked": "host (chunked)"}
NO_DOCUMENT = "No document: open one or drop a file here"
HIGHLIGHT_TINT = 0.45      # share of the highlight colour in the strongest tint
HIGHLIGHT_LEVELS = 8       # weighted tints are rounded to this many steps


def blend(a: QColor, b: QColor, t: float) -> QColor:
    """a mixed with b (t = share of b); used to tint highlights so text stays readable."""
    return QColor.fromRgbF(*(x * (1 - t) + y * t for x, y in zip(a.getRgbF()[:3], b.getRgbF()[:3])))


class DocumentPanel(QWidget):
    """Name, token count, Open button, error line, preview and context meter of the current document."""

    open_requested = Signal()
    file_dropped = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setAcceptDrops(True)
        self._name = ""
        self._tokens = 0

        self.name_label = QLabel(NO_DOCUMENT)
        font = self.name_label.font()
        font.setBold(True)
        self.name_label.setFont(font)
        self.name_label.setWordWrap(True)
        self.tokens_label = QLabel()
        self.tokens_label.setToolTip("Tokens the document takes in the prompt (with the model's tokenizer).")
        self.open_button = QPushButton("Open…")
        self.open_button.setToolTip(f"Open {SUPPORTED_TEXT} (Ctrl+O), or drop one on this panel.")
        self.open_button.clicked.connect(self.open_requested)
        header = QHBoxLayout()
        header.addWidget(self.name_label, 1)
        header.addWidget(self.tokens_label)
        header.addWidget(self.open_button)

        self.message_label = QLabel()
        self.message_label.setWordWrap(True)
        self.message_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.message_label.hide()

        self.preview = QPlainTextEdit()
        self.preview.setReadOnly(True)
        self.preview.setAcceptDrops(False)        # drops go to the panel, which checks the file type
        self.preview.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth)
        self.preview.setPlaceholderText(f"Open {SUPPORTED_TEXT}, or drop one here, to chat with it.")

        self.meter = QProgressBar()
        self.meter.setRange(0, 1)
        self.meter.setValue(0)
        self.meter.setTextVisible(True)
        self.meter.setFormat("no context yet")
        self.meter.setToolTip("Tokens in use (document, conversation and answer) of the model's context length.")
        self.kv_label = QLabel()
        self.kv_label.setToolTip("Where the KV cache lives: on the GPU, or in host memory streamed to the GPU "
                                 "(layerwise: a layer at a time; chunked: a block at a time).")
        meter_row = QHBoxLayout()
        meter_row.addWidget(QLabel("Context"), 1)
        meter_row.addWidget(self.kv_label)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(header)
        layout.addWidget(self.message_label)
        layout.addWidget(self.preview, 1)
        layout.addLayout(meter_row)
        layout.addWidget(self.meter)

    # ------------------------------------------------------------------ document
    def set_document(self, name: str, text: str, tokens: int, encoding: str = "") -> None:
        """Show a newly loaded document (clears any message and highlight); `encoding`: how its bytes were read."""
        self._name, self._tokens = name, tokens
        self.name_label.setText(name)
        self.name_label.setToolTip(name)
        self.tokens_label.setText(f"{tokens:,} tokens" + (f" · {encoding}" if encoding else ""))
        self.preview.setExtraSelections([])
        self.preview.setPlainText(text)
        self.preview.moveCursor(QTextCursor.MoveOperation.Start)
        self.message_label.hide()

    def clear(self) -> None:
        """Back to "no document": empty preview, no token count, empty meter, no message."""
        self._name, self._tokens = "", 0
        self.name_label.setText(NO_DOCUMENT)
        self.name_label.setToolTip("")
        self.tokens_label.clear()
        self.preview.clear()
        self.preview.setExtraSelections([])
        self.message_label.hide()
        self.meter.setRange(0, 1)
        self.meter.setValue(0)
        self.meter.setFormat("no context yet")
        self.kv_label.clear()

    def document_name(self) -> str:
        return self._name

    def token_count(self) -> int:
        return self._tokens

    # ------------------------------------------------------------------ context meter
    def set_context(self, used_tokens: int, limit: int, kv_location: str) -> None:
        """Show `used_tokens` of the `limit`-token context, and where the KV lives ("gpu", "layerwise", ...)."""
        limit = max(1, int(limit))
        used = max(0, int(used_tokens))
        pct = 100.0 * used / limit
        self.meter.setRange(0, limit)
        self.meter.setValue(min(used, limit))
        over = "  (over the limit)" if used > limit else ""
        self.meter.setFormat(f"{used:,} / {limit:,} tokens ({pct:.1f}%){over}")
        self.meter.setToolTip(f"{used:,} of the model's {limit:,}-token context in use ({pct:.1f}%); "
                              f"{max(0, limit - used):,} left for the conversation and answers.")
        where = KV_LOCATIONS.get(kv_location.lower(), kv_location) if kv_location else ""
        self.kv_label.setText(f"KV: {where}" if where else "")

    def context_text(self) -> str:
        """The meter's text as the user sees it, e.g. "1,024 / 8,192 tokens (12.5%)"."""
        return self.meter.text()

    # ------------------------------------------------------------------ highlight
    def highlight_ranges(self, ranges: list[tuple[int, int]], weights: list[float] | None = None,
                         scroll: bool = True) -> None:
        """Tint the character ranges [start, end) in the preview (e.g. what Quest reads); [] clears.

        `weights` (0..1, one per range) vary the tint from faint to strong; without them every range gets the
        strong tint. `scroll` brings the first range (with weights: the first of the strongest) into view."""
        palette = self.preview.palette()
        base, accent = palette.color(QPalette.ColorRole.Base), palette.color(QPalette.ColorRole.Highlight)
        formats: dict[int, QTextCharFormat] = {}

        def tint(weight: float) -> QTextCharFormat:
            level = round(HIGHLIGHT_LEVELS * min(1.0, max(0.0, float(weight))))
            if level not in formats:
                formats[level] = QTextCharFormat()
                share = HIGHLIGHT_TINT * (0.15 + 0.85 * level / HIGHLIGHT_LEVELS)
                formats[level].setBackground(blend(base, accent, share))
            return formats[level]

        doc_len = self.preview.document().characterCount() - 1
        weights = [1.0] * len(ranges) if weights is None else list(weights)
        selections, target, best = [], None, -1.0
        for (start, end), weight in zip(ranges, weights):
            start, end = max(0, int(start)), min(doc_len, int(end))
            if end <= start:
                continue
            sel = QTextEdit.ExtraSelection()
            sel.cursor = QTextCursor(self.preview.document())
            sel.cursor.setPosition(start)
            sel.cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
            sel.format = tint(weight)
            selections.append(sel)
            if weight > best:
                target, best = start, weight
        self.preview.setExtraSelections(selections)
        if scroll and target is not None:   # bring the range into view without selecting it
            cursor = QTextCursor(self.preview.document())
            cursor.setPosition(target)
            self.preview.setTextCursor(cursor)
            self.preview.ensureCursorVisible()

    def highlighted_ranges(self) -> list[tuple[int, int]]:
        """The ranges currently tinted (clipped to the text)."""
        return [(s.cursor.selectionStart(), s.cursor.selectionEnd()) for s in self.preview.extraSelections()]

    # ------------------------------------------------------------------ messages
    def show_error(self, text: str) -> None:
        """Show a red message above the preview; a loaded document stays."""
        dark = self.palette().color(QPalette.ColorRole.Base).lightnessF() < 0.5
        self.message_label.setStyleSheet(f"color: {'#ff7b72' if dark else '#c62828'};")
        self.message_label.setText(text)
        self.message_label.show()

    def message(self) -> str:
        """The message shown above the preview ("" when none)."""
        return self.message_label.text() if not self.message_label.isHidden() else ""

    # ------------------------------------------------------------------ drag and drop
    def handle_dropped_paths(self, paths: list[str]) -> bool:
        """Emit `file_dropped` for the first path if it is a supported file; otherwise show why not."""
        if not paths:
            self.show_error(f"Nothing to open: drop {SUPPORTED_TEXT}.")
            return False
        path = Path(paths[0])
        extra = f" (only the first of {len(paths)} files is opened)" if len(paths) > 1 else ""
        if path.is_dir():
            self.show_error(f"{path.name} is a folder: drop {SUPPORTED_TEXT}.")
            return False
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            kind = f"{path.suffix} files" if path.suffix else "files without a suffix"
            self.show_error(f"Can't open {path.name}: {kind} are not supported. Drop {SUPPORTED_TEXT}.")
            return False
        if extra:
            self.show_error(f"Opening {path.name}{extra}.")
        self.file_dropped.emit(str(path))
        return True

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        # Any local file is accepted here so that an unsupported one gets a message on drop, not silence.
        if event.mimeData().hasUrls() and any(u.isLocalFile() for u in event.mimeData().urls()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event) -> None:
        event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        self.handle_dropped_paths(paths)
        event.acceptProposedAction()
