"""What a user sees in the chat view, the document panel and the policy panel (pytest-qt, offscreen)."""
import json

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from widgets.chat_view import ChatView
from widgets.document_panel import DocumentPanel
from widgets.policy_panel import PolicyPanel

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


# ---------------------------------------------------------------------- policy panel
@pytest.fixture
def policy(qtbot):
    panel = PolicyPanel()
    qtbot.addWidget(panel)
    panel.show()
    return panel


def _quest_item(panel):
    return panel.policy_combo.model().item(panel.policy_combo.findData("quest"))


def test_quest_is_disabled_in_gpu_mode_with_the_reason(policy):
    assert policy.mode() == "gpu"
    assert not _quest_item(policy).isEnabled()
    assert "gpu mode" in policy.policy_tooltip("quest") and "layerwise" in policy.policy_tooltip("quest")
    assert not policy.ring_slots.isEnabled() and "offload modes" in policy.ring_slots.toolTip()
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("layerwise"))
    assert _quest_item(policy).isEnabled() and "Not available" not in policy.policy_tooltip("quest")
    assert policy.ring_slots.isEnabled() and policy.budget_check.isEnabled()
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("chunked"))
    assert _quest_item(policy).isEnabled() and "Not available" not in policy.policy_tooltip("quest")
    assert not policy.policy_available("minference")
    assert "chunked" in policy.policy_tooltip("xattention") and not policy.budget_check.isEnabled()


def test_quest_falls_back_to_full_when_switching_to_gpu(policy):
    policy.set_config({"mode": "layerwise", "policy": "quest"})
    assert policy.policy() == "quest"
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("gpu"))
    assert policy.policy() == "full" and "Quest" in policy.note_label.text() and policy.note_label.isVisible()


def test_config_round_trips_and_changes_are_signalled(policy, qtbot):
    cfg = {"mode": "layerwise", "kv_block_size": 512, "ring_slots": 5, "host_kv_gb": 32.0,
           "prefill_chunk_tokens": 4096, "gpu_kv_budget_gb": 2.5, "policy": "quest",
           "policy_params": {"token_budget": 4096, "page_size": 32, "dense_layers": 1}}
    with qtbot.assertNotEmitted(policy.config_changed):
        policy.set_config(cfg)
    assert policy.config() == cfg
    other = PolicyPanel()
    qtbot.addWidget(other)
    other.set_config(policy.config())
    assert other.config() == cfg
    xa = {"mode": "gpu", "kv_block_size": 256, "policy": "xattention",
          "policy_params": {"threshold": 0.8, "stride": 8, "min_len": 4096}}
    other.set_config(xa)
    assert other.config() == xa   # no offload knobs in gpu mode

    with qtbot.waitSignal(policy.config_changed) as changed:
        policy.ring_slots.setValue(2)
    assert changed.args[0]["ring_slots"] == 2 and changed.args[0]["policy"] == "quest"
    with qtbot.waitSignal(policy.config_changed) as changed:
        policy.policy_combo.setCurrentIndex(policy.policy_combo.findData("minference"))
    assert changed.args[0]["policy_params"] == {"vertical": 1000, "slash": 6096, "min_len": 8192}   # the engine's
    mi = {"mode": "gpu", "kv_block_size": 256, "policy": "minference",
          "policy_params": {"vertical": 0.05, "slash": 2048, "min_len": 1024}}               # a fraction, counts
    other.set_config(mi)
    assert other.config() == mi


def test_sparse_policy_defaults_are_the_engines(policy):
    import inspect

    from engine.sparse.minference import MInferencePolicy
    from engine.sparse.xattention import XAttentionPolicy
    for key, cls in (("minference", MInferencePolicy), ("xattention", XAttentionPolicy)):
        policy.policy_combo.setCurrentIndex(policy.policy_combo.findData(key))
        params = policy.config()["policy_params"]
        engine = inspect.signature(cls).parameters
        assert params == {name: engine[name].default for name in params}, key
        cls(**params)                                      # the engine takes them as they are
    assert list(policy.config()["policy_params"]) == ["threshold", "stride", "min_len"]


def test_policies_the_engine_lacks_are_disabled(policy):
    from engine import POLICIES as ENGINE_POLICIES
    policy.mode_combo.setCurrentIndex(policy.mode_combo.findData("layerwise"))
    policy.set_engine_policies(ENGINE_POLICIES)
    model = policy.policy_combo.model()
    assert all(model.item(policy.policy_combo.findData(k)).isEnabled() for k in ENGINE_POLICIES)
    policy.set_engine_policies(["full", "quest"])
    assert not model.item(policy.policy_combo.findData("xattention")).isEnabled()
    assert "not in the running engine" in policy.policy_tooltip("xattention")


def test_busy_label_and_load_progress(policy, qtbot):
    assert not policy.busy_label.isVisible()
    policy.set_busy(True)
    assert policy.busy_label.isVisible() and "next turn" in policy.busy_label.text()
    assert policy.mode_combo.isEnabled()
    policy.set_busy(False)
    assert not policy.busy_label.isVisible()
    assert "SmolLM2-135M-Instruct" in policy.model_label.text()
    policy.set_load_progress(0.5, "loading weights")
    assert policy.load_bar.value() == 500 and policy.load_message.text() == "loading weights"
