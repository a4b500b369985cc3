"""The conversation: user questions, streamed Markdown answers with their stats, an input box and settings.

A pure view. The window connects `send_requested(str)` / `stop_requested()` to the engine worker and feeds
the answer back through `begin_answer()`, `append_text(delta)` and `end_answer(stats)`; `stats` is a plain
dict with the keys of the engine's GenerationStats (prompt_tokens, cached_tokens, ttft_s, ...).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (QDoubleSpinBox, QFormLayout, QHBoxLayout, QPlainTextEdit, QPushButton, QScrollArea,
                               QSpinBox, QToolButton, QVBoxLayout, QWidget)

from widgets.chat_bubble import ROLE_TITLES, MessageWidget, format_stats


class InputBox(QPlainTextEdit):
    """Multi-line input: Enter submits, Shift+Enter inserts a newline, Esc asks to stop."""

    submit = Signal()
    escape = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        key = event.key()
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submit.emit()
            return
        if key == Qt.Key.Key_Escape:
            self.escape.emit()
            return
        super().keyPressEvent(event)


class ChatView(QWidget):
    """Scrolling conversation, input box, Send/Stop button, and collapsible prompt/sampling settings.

    Sending adds the user's message to the conversation and emits `send_requested(text)`; the window then
    calls `begin_answer()`, `append_text()` for each piece of the answer, and `end_answer(stats)`.
    """

    send_requested = Signal(str)
    stop_requested = Signal()
    answer_ended = Signal()        # end_answer(): the streaming answer is complete (or stopped, or failed)

    MIN_RENDER_MS = 40     # re-render a streaming answer at most ~25 times a second ...
    MAX_RENDER_MS = 400    # ... and less often when a long answer takes long to lay out

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._messages: list[dict] = []           # {"role", "text", "stats"}
        self._widgets: list[MessageWidget] = []
        self._streaming = False
        self._stick_to_bottom = True
        self._min_render_ms = self._render_every_ms = self.MIN_RENDER_MS
        self._rendered_at = 0.0                   # perf_counter() of the streaming answer's last render
        self._render_timer = QTimer(self, singleShot=True, interval=self.MIN_RENDER_MS)
        self._render_timer.timeout.connect(self._render_answer)

        self._list = QWidget()
        self._list_layout = QVBoxLayout(self._list)
        self._list_layout.setContentsMargins(4, 4, 4, 4)
        self._list_layout.addStretch(1)
        self._scroll = QScrollArea()
        self._scroll.setWidgetResizable(True)
        self._scroll.setWidget(self._list)
        bar = self._scroll.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range_changed)

        self.input = InputBox()
        self.input.setPlaceholderText("Ask about the document (Enter sends, Shift+Enter for a new line)")
        self.input.setFixedHeight(self.input.fontMetrics().lineSpacing() * 4 + 12)
        self.input.submit.connect(self._submit)
        self.input.escape.connect(self._on_escape)
        self.send_button = QPushButton("Send")
        self.send_button.setToolTip("Send the question (Enter). While an answer streams: stop it (Esc).")
        self.send_button.clicked.connect(self._on_button)
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._scroll, 1)
        layout.addLayout(row)
        layout.addWidget(self._build_settings())

    # ------------------------------------------------------------------ settings
    def _build_settings(self) -> QWidget:
        box = QWidget()
        outer = QVBoxLayout(box)
        outer.setContentsMargins(0, 0, 0, 0)
        self.settings_toggle = QToolButton(text="Prompt and sampling settings", checkable=True)
        self.settings_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.settings_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.settings_toggle.setAutoRaise(True)
        self.settings_body = QWidget()
        self.settings_body.hide()
        self.settings_toggle.toggled.connect(self._toggle_settings)
        form = QFormLayout(self.settings_body)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("Optional system prompt, e.g. 'Answer briefly and quote the document.'")
        self.system_edit.setFixedHeight(self.system_edit.fontMetrics().lineSpacing() * 3 + 12)
        self.system_edit.setToolTip("Sent as the system message before the document and the conversation.")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=5.0, singleStep=0.1, decimals=2, value=0.0)
        self.temperature.setToolTip("0 = greedy (always the most likely token). 0.7-1.0 for varied answers.")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2, value=1.0)
        self.top_p.setToolTip("Nucleus sampling: keep the smallest set of tokens whose probability sums to p. "
                              "1 = off. Only used when temperature > 0.")
        self.top_k = QSpinBox(minimum=0, maximum=100000, value=0)
        self.top_k.setSpecialValueText("off")
        self.top_k.setToolTip("Keep only the k most likely tokens (0 = off). Only used when temperature > 0.")
        self.max_tokens = QSpinBox(minimum=1, maximum=131072, singleStep=64, value=256)
        self.max_tokens.setToolTip("The answer stops after this many tokens (finish reason 'length').")
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1, value=-1)
        self.seed.setSpecialValueText("random")
        self.seed.setToolTip("A fixed seed makes sampled answers repeatable; 'random' = a new one each time.")
        form.addRow("System prompt", self.system_edit)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Max new tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        outer.addWidget(self.settings_toggle)
        outer.addWidget(self.settings_body)
        return box

    def _toggle_settings(self, shown: bool) -> None:
        self.settings_body.setVisible(shown)
        self.settings_toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    def sampling(self) -> dict:
        """Sampling settings as SamplingParams keyword args (seed None = nondeterministic)."""
        return {"temperature": self.temperature.value(), "top_p": self.top_p.value(), "top_k": self.top_k.value(),
                "max_tokens": self.max_tokens.value(), "seed": None if self.seed.value() < 0 else self.seed.value()}

    def set_sampling(self, values: dict) -> None:
        """Set any of the keys `sampling()` returns; missing keys keep their current value."""
        for key, box in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                         ("max_tokens", self.max_tokens)):
            if values.get(key) is not None:
                box.setValue(values[key])
        if "seed" in values:
            self.seed.setValue(-1 if values["seed"] is None else int(values["seed"]))

    def system_prompt(self) -> str:
        return self.system_edit.toPlainText().strip()

    def set_system_prompt(self, text: str) -> None:
        self.system_edit.setPlainText(text)

    # ------------------------------------------------------------------ conversation
    def is_streaming(self) -> bool:
        return self._streaming

    def messages(self) -> list[dict]:
        """A copy of the conversation: [{"role": "user"|"assistant"|"error", "text": str, "stats": dict|None}]."""
        return [dict(m) for m in self._messages]

    def message_widget(self, index: int = -1) -> MessageWidget:
        """The widget showing message `index` (its `body` holds the text, `stats_label` the stats line)."""
        return self._widgets[index]

    def add_user_message(self, text: str) -> None:
        """Show a user message (sending from the input box does this itself)."""
        self._add("user", text)

    def begin_answer(self) -> None:
        """Start a new, empty assistant answer; the button becomes Stop."""
        if self._streaming:
            self.end_answer(None)
        self._add("assistant", "")
        self._streaming = True
        self._stick_to_bottom = True
        self._set_button()

    def append_text(self, delta: str) -> None:
        """Add streamed answer text; the Markdown re-render is throttled: now if the last one is (nearly) an
        interval old, else when it is (a timer's wake of its own: on a 2-core CPU each is taken from the engine)."""
        if not self._streaming:
            self.begin_answer()
        self._messages[-1]["text"] += delta
        if self._render_timer.isActive():
            return
        wait_ms = self._render_every_ms - (time.perf_counter() - self._rendered_at) * 1000
        if wait_ms <= 0.2 * self._render_every_ms:
            self._render_answer()
        else:
            self._render_timer.start(int(wait_ms))

    def end_answer(self, stats: dict | None) -> None:
        """Finish the streaming answer, render it in full and show its stats line; the button becomes Send."""
        if not self._streaming:
            return
        self._render_timer.stop()
        self._render_answer()
        self._messages[-1]["stats"] = dict(stats) if stats else None
        self._widgets[-1].set_stats(stats)
        self._streaming = False
        self._set_button()
        self.answer_ended.emit()

    def show_error(self, text: str) -> None:
        """Show an error in red in the conversation; a streaming answer ends (keeping its text so far)."""
        if self._streaming:
            self.end_answer(None)
        self._add("error", text)

    def new_chat(self) -> None:
        """Clear the conversation (the settings stay)."""
        self._render_timer.stop()
        for w in self._widgets:
            self._list_layout.removeWidget(w)
            w.deleteLater()
        self._widgets.clear()
        self._messages.clear()
        self._streaming = False
        self._set_button()

    def _add(self, role: str, text: str) -> None:
        self._messages.append({"role": role, "text": text, "stats": None})
        widget = MessageWidget(role)
        widget.set_text(text)
        self._widgets.append(widget)
        self._list_layout.insertWidget(self._list_layout.count() - 1, widget)   # above the stretch
        if self._list.isVisible():
            widget.setVisible(True)           # now, not at the layout's next queued update (before the list is
                                              # shown, it shows with it)

    def _render_answer(self) -> None:
        """Re-render the streaming answer; the next render waits about twice as long as this one took."""
        if not self._widgets or self._widgets[-1].role != "assistant":
            return
        t0 = time.perf_counter()
        self._widgets[-1].set_text(self._messages[-1]["text"])
        spent_ms = (time.perf_counter() - t0) * 1000
        self._rendered_at = time.perf_counter()
        self._render_every_ms = int(min(self.MAX_RENDER_MS, max(self._min_render_ms, 2 * spent_ms)))

    def set_min_render_ms(self, ms: int) -> None:
        """Re-render a streaming answer at most every `ms` (the window raises it when the engine needs the CPU)."""
        self._min_render_ms = max(1, int(ms))
        self._render_every_ms = max(self._render_every_ms, self._min_render_ms)

    def _on_scrolled(self, value: int) -> None:
        """Follow new text only while the user is at the bottom (scrolling up to read stops following)."""
        self._stick_to_bottom = value >= self._scroll.verticalScrollBar().maximum() - 8

    def _on_range_changed(self, _low: int, high: int) -> None:
        if self._stick_to_bottom:
            self._scroll.verticalScrollBar().setValue(high)

    # ------------------------------------------------------------------ input
    def _set_button(self) -> None:
        self.send_button.setEnabled(True)
        self.send_button.setText("Stop" if self._streaming else "Send")

    def _submit(self) -> None:
        if self._streaming:
            return   # the answer still streams: Enter does not queue a second question
        text = self.input.toPlainText().strip()
        if not text:
            return
        self.input.clear()
        self.add_user_message(text)
        self._stick_to_bottom = True
        self.send_requested.emit(text)

    def _stop(self) -> None:
        self.send_button.setText("Stopping…")
        self.send_button.setEnabled(False)
        self.stop_requested.emit()

    def _on_button(self) -> None:
        if self._streaming:
            self._stop()
        else:
            self._submit()

    def _on_escape(self) -> None:
        if self._streaming and self.send_button.isEnabled():
            self._stop()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        """Esc anywhere in the view (e.g. while reading the answer) stops a streaming answer."""
        if event.key() == Qt.Key.Key_Escape and self._streaming:
            self._on_escape()
            return
        super().keyPressEvent(event)

    # ------------------------------------------------------------------ export
    def to_markdown(self) -> str:
        """The conversation as a Markdown document, with each answer's stats line."""
        lines = ["# kvscope chat", ""]
        if self.system_prompt():
            lines += ["**System prompt:** " + self.system_prompt(), ""]
        for m in self._messages:
            lines += [f"## {ROLE_TITLES.get(m['role'], m['role'])}", "", m["text"].rstrip(), ""]
            if m["stats"]:
                lines += [f"_{format_stats(m['stats'])}_", ""]
        return "\n".join(lines)

    def to_json(self, config: dict | None = None) -> dict:
        """The conversation as JSON-ready data: messages with per-message stats, the sampling and config used."""
        return {"format": "kvscope-chat", "version": 1, "system_prompt": self.system_prompt(),
                "sampling": self.sampling(), "config": dict(config or {}), "messages": self.messages()}

    def save(self, path: str | Path, config: dict | None = None) -> Path:
        """Write the conversation as Markdown (.md) or JSON (.json), chosen by the file's suffix."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".md", ".markdown"):
            path.write_text(self.to_markdown(), encoding="utf-8")
        elif suffix == ".json":
            path.write_text(json.dumps(self.to_json(config), indent=2, ensure_ascii=False), encoding="utf-8")
        else:
            raise ValueError(f"{path.name}: save the chat as .md (Markdown) or .json, not {suffix or 'no suffix'}")
        return path
