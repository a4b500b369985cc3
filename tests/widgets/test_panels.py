"""What a user sees in the chat view and the document panel (pytest-qt, offscreen; the policy panel:
test_policy_panel.py)."""
import json

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from widgets.chat_view import ChatView
from widgets.document_panel import DocumentPanel

STATS = {"prompt_tokens": 1234, "cached_tokens": 1024, "completion_tokens": 17, "ttft_s": 0.123,
         "prefill_tok_s": 5321.0, "decode_tok_s": 45.25, "total_s": 0.6, "finish_reason": "stop",
         "bytes_h2d": 12 * 2**20, "bytes_d2h": 3 * 2**20}


@pytest.fixture
def chat(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 500)
    view.show()
    return view


def _answer(chat, qtbot, stats=STATS):
    with qtbot.waitSignal(chat.send_requested) as sent:
        qtbot.keyClicks(chat.input, "What is the report about?")
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)
    chat.begin_answer()
    chat.append_text("It is about **KV")
    chat.append_text(" offload**.")
    chat.end_answer(stats)
    return sent.args[0]


# ---------------------------------------------------------------------- chat view
def test_answer_streams_in_and_the_button_reads_stop_then_send(chat, qtbot):
    assert chat.send_button.text() == "Send"
    chat.add_user_message("Summarise it")
    chat.begin_answer()
    assert chat.send_button.text() == "Stop"
    chat.append_text("Hello **wor")
    chat.append_text("ld**, a long answer")
    body = chat.message_widget(-1).body
    qtbot.waitUntil(lambda: "Hello world, a long answer" in body.toPlainText(), timeout=2000)   # Markdown, rendered
    assert chat.send_button.text() == "Stop"
    chat.append_text(" ends here.")
    chat.end_answer(STATS)
    assert body.toPlainText().strip() == "Hello world, a long answer ends here."
    assert chat.send_button.text() == "Send"


def test_the_first_piece_shows_at_once_later_ones_at_the_render_interval_and_the_end_is_signalled(chat, qtbot):
    """A streaming answer's first piece is drawn as it arrives (no timer's wake first); a piece soon after it waits
    for the render interval; end_answer draws everything and emits answer_ended once."""
    chat.set_min_render_ms(400)
    chat.add_user_message("Summarise it")
    chat.begin_answer()
    body = chat.message_widget(-1).body
    chat.append_text("First")
    assert body.toPlainText().strip() == "First"                  # drawn now, before any event ran
    chat.append_text(" second")
    assert body.toPlainText().strip() == "First"                  # within the interval: later
    qtbot.waitUntil(lambda: body.toPlainText().strip() == "First second", timeout=3000)
    with qtbot.waitSignal(chat.answer_ended, timeout=1000):
        chat.append_text(" third.")
        chat.end_answer(STATS)
    assert body.toPlainText().strip() == "First second third."


def test_stats_line_shows_the_numbers(chat):
    chat.begin_answer()
    chat.append_text("ok")
    chat.end_answer(STATS)
    label = chat.message_widget(-1).stats_label
    assert label.isVisible()
    line = label.text()
    for part in ("1,234", "cached 1,024", "TTFT 0.12 s", "5,321 tok/s", "45.2 tok/s", "12.0 MiB", "3.0 MiB",
                 "stop"):
        assert part in line, (part, line)

    chat.begin_answer()
    chat.end_answer(dict(STATS, bytes_h2d=0, bytes_d2h=0, finish_reason="cancelled"))
    line = chat.message_widget(-1).stats_label.text()
    assert "MiB" not in line and "cancelled" in line and "from disk" not in line
    chat.begin_answer()
    chat.end_answer(dict(STATS, disk_cached_tokens=768))         # the disk tier supplied part of the cache
    assert "cached 1,024 (768 from disk)" in chat.message_widget(-1).stats_label.text()


def test_enter_sends_and_clears_shift_enter_does_not(chat, qtbot):
    qtbot.keyClicks(chat.input, "first line")
    with qtbot.assertNotEmitted(chat.send_requested):
        qtbot.keyClick(chat.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(chat.input, "second line")
    assert chat.input.toPlainText() == "first line\nsecond line"
    with qtbot.waitSignal(chat.send_requested) as sent:
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)
    assert sent.args == ["first line\nsecond line"]
    assert chat.input.toPlainText() == ""
    assert chat.messages()[-1] == {"role": "user", "text": "first line\nsecond line", "stats": None}
    with qtbot.assertNotEmitted(chat.send_requested):   # nothing to send
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)


def test_escape_and_stop_button_stop_a_streaming_answer(chat, qtbot):
    with qtbot.assertNotEmitted(chat.stop_requested):
        qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    chat.begin_answer()
    with qtbot.waitSignal(chat.stop_requested):
        qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    chat.end_answer(dict(STATS, finish_reason="cancelled"))
    assert chat.send_button.text() == "Send"
    chat.begin_answer()
    with qtbot.waitSignal(chat.stop_requested):
        qtbot.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)


def test_error_is_shown_in_the_conversation_and_ends_streaming(chat):
    chat.begin_answer()
    chat.append_text("partial")
    chat.show_error("CUDA out of memory: try layerwise mode.")
    assert chat.send_button.text() == "Send"
    err = chat.message_widget(-1)
    assert err.role == "error" and "out of memory" in err.body.toPlainText() and err.isVisible()
    assert [m["role"] for m in chat.messages()] == ["assistant", "error"]


def test_exports_hold_both_messages_and_the_stats(chat, qtbot, tmp_path):
    question = _answer(chat, qtbot)
    md = chat.to_markdown()
    assert question in md and "It is about **KV offload**." in md and "TTFT 0.12 s" in md
    data = chat.to_json({"mode": "layerwise", "ring_slots": 3})
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["text"] == question
    assert data["messages"][1]["stats"]["prompt_tokens"] == 1234
    assert data["config"] == {"mode": "layerwise", "ring_slots": 3}
    assert data["sampling"]["max_tokens"] == 256
    chat.save(tmp_path / "chat.md")
    chat.save(tmp_path / "chat.json", {"mode": "gpu"})
    assert (tmp_path / "chat.md").read_text(encoding="utf-8") == md
    saved = json.loads((tmp_path / "chat.json").read_text(encoding="utf-8"))
    assert saved["messages"][1]["stats"]["cached_tokens"] == 1024 and saved["config"] == {"mode": "gpu"}
    with pytest.raises(ValueError, match=".md"):
        chat.save(tmp_path / "chat.txt")
    chat.new_chat()
    assert chat.messages() == [] and question not in chat.to_markdown()


def test_sampling_settings_and_system_prompt(chat):
    assert chat.sampling() == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 256, "seed": None}
    chat.set_sampling({"temperature": 0.7, "top_k": 40, "seed": 7})
    chat.set_system_prompt("Be brief.")
    assert chat.sampling()["temperature"] == pytest.approx(0.7)
    assert chat.sampling()["top_k"] == 40 and chat.sampling()["seed"] == 7
    assert chat.system_prompt() == "Be brief."
    assert not chat.settings_body.isVisible()
    chat.settings_toggle.click()
    assert chat.settings_body.isVisible()


# ---------------------------------------------------------------------- document panel
@pytest.fixture
def doc_panel(qtbot):
    panel = DocumentPanel()
    qtbot.addWidget(panel)
    panel.show()
    return panel


def _drop(panel, path):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    panel.dropEvent(QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                               Qt.KeyboardModifier.NoModifier))


def test_document_panel_shows_tokens_and_context_meter(doc_panel):
    doc_panel.set_document("report.md", "Alpha beta gamma.\nDelta.", 12345)
    assert doc_panel.name_label.text() == "report.md"
    assert "12,345 tokens" in doc_panel.tokens_label.text()
    assert doc_panel.preview.toPlainText().startswith("Alpha beta")
    doc_panel.set_context(4096, 8192, "layerwise")
    assert "50.0%" in doc_panel.context_text() and "4,096 / 8,192" in doc_panel.context_text()
    assert "host (layerwise)" in doc_panel.kv_label.text()
    doc_panel.set_context(100, 8192, "gpu")
    assert "1.2%" in doc_panel.context_text() and doc_panel.kv_label.text() == "KV: GPU"
    doc_panel.highlight_ranges([(6, 10), (200, 300)])
    assert doc_panel.highlighted_ranges() == [(6, 10)]          # out-of-text ranges are dropped
    doc_panel.highlight_ranges([(0, 5), (6, 10)], [0.1, 1.0])           # weights: a faint and a strong tint
    faint, strong = (s.format.background().color() for s in doc_panel.preview.extraSelections())
    base = doc_panel.preview.palette().base().color()
    assert abs(faint.lightnessF() - base.lightnessF()) < abs(strong.lightnessF() - base.lightnessF())
    assert doc_panel.highlighted_ranges() == [(0, 5), (6, 10)] and doc_panel.preview.textCursor().position() == 6
    doc_panel.highlight_ranges([])
    assert doc_panel.highlighted_ranges() == []
    doc_panel.highlight_ranges([(0, 5)])
    doc_panel.set_document("other.md", "Another text.", 3)                 # a new document: no highlight
    assert doc_panel.highlighted_ranges() == []
    doc_panel.clear()
    assert doc_panel.tokens_label.text() == "" and doc_panel.preview.toPlainText() == ""


def test_dropped_files_are_checked(doc_panel, qtbot, tmp_path):
    doc_panel.set_document("report.md", "Some text", 3)
    with qtbot.assertNotEmitted(doc_panel.file_dropped):
        _drop(doc_panel, tmp_path / "setup.exe")
    assert ".exe" in doc_panel.message() and doc_panel.message_label.isVisible()
    assert doc_panel.preview.toPlainText() == "Some text"   # the loaded document stays
    with qtbot.waitSignal(doc_panel.file_dropped) as dropped:
        _drop(doc_panel, tmp_path / "notes.md")
    assert dropped.args == [str(tmp_path / "notes.md")]
    with qtbot.waitSignal(doc_panel.open_requested):
        qtbot.mouseClick(doc_panel.open_button, Qt.MouseButton.LeftButton)
    doc_panel.show_error("notes.md is empty.")
    assert doc_panel.message() == "notes.md is empty." and doc_panel.token_count() == 3


def test_document_panel_names_the_encoding_it_was_read_in(doc_panel):
    doc_panel.set_document("old.txt", "caf\u00e9", 12, "Windows-1252")
    assert doc_panel.tokens_label.text() == "12 tokens · Windows-1252"
    doc_panel.set_document("new.md", "text", 3)
    assert doc_panel.tokens_label.text() == "3 tokens"
