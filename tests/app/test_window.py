"""The main window on the real engine (the default model, no mocks), offscreen: load, ask, watch, stop, export, close.

One window serves the tests of this module in order (loading a model takes seconds on a CPU); the last test makes
its own window to close it mid-answer. The settings go to an INI file in tmp, never to the user's.
"""
import json
import time

import pytest
import numpy as np
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QImage

from app.main_window import MainWindow, engine_kwargs
from engine.trace import H2D, check_chrome_trace

WORDS = ("Notes from the planning group. The quarterly review covers the storage migration, the new build farm "
         "and the hiring plan for the inference team. The storage migration moved four petabytes of archive data "
         "to the new object store without downtime; the remaining work is to retire the old tape library and to "
         "update the runbooks. The build farm now has forty machines and runs every test on every change. ")
DOC_TEXT = ("# Planning notes\n\n" + WORDS * 2 + "\n\n## The meeting\n\nThe meeting is in Bergen. Everyone meets "
            "in Bergen on Tuesday at ten, in the harbour office, to agree on the plan.\n\n" + WORDS + "\n")
QUESTION = "In which city is the meeting?"
LONG_QUESTION = "Write a very long story about a lighthouse keeper, with many chapters and details."
TURN_MS = 180_000


def make_window(tmp_path, doc, model_dir, **options) -> MainWindow:
    config = {"settings_path": str(tmp_path / "kvscope.ini"), "document": str(doc), "restore": False,
              "engine": {"model": str(model_dir), "max_model_len": 2048}, "max_new_tokens": 24, **options}
    win = MainWindow(config)
    win.resize(1300, 850)
    win.show()
    return win


def _pixel_std(img: QImage) -> float:
    """Standard deviation of the grey levels: a blank (one-colour) picture gives 0."""
    grey = img.convertToFormat(QImage.Format.Format_Grayscale8)
    row = grey.bytesPerLine()
    data = np.frombuffer(grey.constBits(), dtype=np.uint8, count=row * grey.height()).reshape(grey.height(), row)
    return float(data[:, :grey.width()].std())


def wait_ready(qtbot, win, model_dir) -> None:
    qtbot.waitUntil(lambda: model_dir.name in win.status.model_label.text() and bool(win.document_info)
                    and not win.is_busy(), timeout=TURN_MS)


def _on_cuda(win) -> bool:                     # the window's engine on CUDA: the CPU suite on a GPU workstation
    return str(win.model_info.get("device", "")).startswith("cuda")


def ask(qtbot, win, question: str) -> dict:
    """Send `question` as a user would (type, click Send) and wait until its answer has finished."""
    n = len(win.chat.messages())
    win.chat.input.setPlainText(question)
    qtbot.mouseClick(win.chat.send_button, Qt.MouseButton.LeftButton)
    assert win.chat.messages()[n] == {"role": "user", "text": question, "stats": None}
    qtbot.waitUntil(lambda: len(win.chat.messages()) >= n + 2 and not win.chat.is_streaming()
                    and not win.is_busy(), timeout=TURN_MS)
    return win.chat.messages()[-1]


def start_long_answer(qtbot, win, min_chars: int = 20) -> int:
    """Send LONG_QUESTION with room for a long answer and wait until `min_chars` of it show; -> the index of the
    answer in the chat."""
    win.chat.set_sampling({"max_tokens": 1500})
    n = len(win.chat.messages())
    win.chat.input.setPlainText(LONG_QUESTION)
    qtbot.mouseClick(win.chat.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(win.chat.messages()) > n + 1 and len(win.chat.messages()[-1]["text"]) >= min_chars,
                    timeout=TURN_MS)
    return n + 1


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("doc") / "planning.md"
    path.write_text(DOC_TEXT)
    return path


@pytest.fixture(scope="module")
def window(qapp, doc, tmp_path_factory, default_model_dir):
    win = make_window(tmp_path_factory.mktemp("settings"), doc, default_model_dir)
    yield win
    win.close()
    assert win.thread.isFinished()
    import gc
    assert gc.isenabled()            # automatic collection is back once no window needs the GUI-thread collector


def test_garbage_is_collected_on_the_gui_thread(window, qtbot):
    """While the window runs, the interpreter collects no cycles by itself (a collection on the engine's thread
    could destroy GUI objects there and deadlock, see app/collector.py); the GUI thread's timer does it."""
    import gc
    import weakref

    class Node:
        pass

    assert not gc.isenabled()
    first = Node()
    first.me = first
    ref = weakref.ref(first)
    del first
    cycles = []
    for _ in range(gc.get_threshold()[0] + 50):   # past generation 0's threshold, as any busy turn gets
        n = Node()
        n.me = n
        cycles.append(n)
    del cycles, n
    qtbot.waitUntil(lambda: ref() is None, timeout=5000)
    assert window.collector.collections > 0


def test_the_worker_runs_on_an_engine_thread(window):
    """One Python thread state for the engine's whole life (tests/app/test_worker.py shows why)."""
    from app.worker import EngineThread
    assert type(window.thread) is EngineThread and window.worker.thread() is window.thread


def test_window_opens_and_loads_the_model(window, qtbot, default_model_dir, doc):
    wait_ready(qtbot, window, default_model_dir)
    assert window.status.model_label.text() == f"model: {default_model_dir.name}"
    assert window.status.mode_label.text() == "mode: gpu"
    assert window.status.policy_label.text() == "policy: Full"
    assert window.document_panel.document_name() == doc.name and window.document_panel.token_count() > 200
    assert "/ 2,048 tokens" in window.document_panel.context_text()
    assert window.worker.engine_config == engine_kwargs(window.policy_panel.config(), window.engine_overrides)
    assert {d.windowTitle() for d in window.docks.values()} == {"Document", "Policy", "Timeline", "Ring buffer",
                                                                 "Metrics", "Quest", "Masks"}
    menus = {a.text().replace("&", ""): a.menu() for a in window.menuBar().actions()}
    assert set(menus) == {"File", "View", "Help"}
    view_items = [a.text().replace("&", "") for a in menus["View"].actions()]
    assert "Timeline" in view_items and "Reset layout" in view_items
    window.docks["timeline"].close()
    assert not window.docks["timeline"].isVisible()
    window.reset_layout()
    assert window.docks["timeline"].isVisible()


def test_answer_streams_into_the_chat_with_stats(window, qtbot):
    answer = ask(qtbot, window, QUESTION)
    assert answer["role"] == "assistant" and "Bergen" in answer["text"]
    assert "Bergen" in window.chat.message_widget(-1).body.toPlainText()
    stats_line = window.chat.message_widget(-1).stats_label.text()
    assert "prompt" in stats_line and "TTFT" in stats_line
    assert answer["stats"]["prompt_tokens"] > 200 and answer["stats"]["finish_reason"] in ("stop", "length")


def test_views_hold_the_turn(window, qtbot):
    qtbot.waitUntil(lambda: window.timeline.bar_count() > 0, timeout=5000)
    assert window.metrics.value("decode_tok_s") != "—" and window.metrics.value("ttft") != "—"
    assert window.ring.showing_hint()                                 # gpu mode: no ring
    assert "KV" in window.status.memory_label.text() and "—" not in window.status.memory_label.text()
    assert window.worker.turn_steps and not window.status.progress.isVisible()


def test_layerwise_mode_shows_copies_and_ring_slots(window, qtbot):
    panel = window.policy_panel
    panel.mode_combo.setCurrentIndex(panel.mode_combo.findData("layerwise"))
    answer = ask(qtbot, window, QUESTION)
    assert answer["role"] == "assistant" and "Bergen" in answer["text"]
    assert window.worker.engine_config["mode"] == "layerwise"
    assert window.status.mode_label.text() == "mode: layerwise"
    qtbot.waitUntil(lambda: window.timeline.bar_count(H2D) > 0 and bool(window.ring.slots()), timeout=5000)
    assert not window.ring.showing_hint()
    assert "host" in window.document_panel.kv_label.text()


def test_stop_ends_a_long_answer_quickly_and_the_window_stays_usable(window, qtbot):
    start_long_answer(qtbot, window, 21)
    t0 = time.monotonic()
    qtbot.keyClick(window.chat.input, Qt.Key.Key_Escape)               # Esc = Stop
    qtbot.waitUntil(lambda: not window.chat.is_streaming() and not window.is_busy(), timeout=20_000)
    assert time.monotonic() - t0 < 10
    assert window.chat.messages()[-1]["stats"]["finish_reason"] == "cancelled"
    assert window.chat.send_button.text() == "Send" and window.chat.send_button.isEnabled()
    window.chat.set_sampling({"max_tokens": 24})
    answer = ask(qtbot, window, QUESTION)
    assert answer["role"] == "assistant" and answer["stats"]["finish_reason"] != "cancelled"


def test_export_bundle(window, tmp_path):
    out = window.export_bundle(tmp_path / "bundle")
    assert out == tmp_path / "bundle"
    for name in ("window.png", "timeline.png", "ring.png", "quest.png", "masks.png", "metrics.png", "chat.png",
                 "trace.json", "chat.md", "chat.json", "config.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("window.png", "timeline.png", "ring.png", "metrics.png", "chat.png"):   # real pictures, not blank
        img = QImage(str(out / name))
        assert not img.isNull() and img.width() > 50 and img.height() > 20, name
        assert _pixel_std(img) > 5, name
    trace = json.loads((out / "trace.json").read_text())
    assert check_chrome_trace(trace) == []
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    config = json.loads((out / "config.json").read_text())
    assert config["engine"]["mode"] == "layerwise" and config["problems"] == []
    assert QUESTION in (out / "chat.md").read_text()
    before = (out / "chat.md").read_bytes()
    again = window.export_bundle(tmp_path / "bundle")                  # not empty now: a new subfolder
    assert again.parent == out and (again / "window.png").is_file() and (out / "chat.md").read_bytes() == before


def test_quest_view_shows_the_pages_quest_picked(window, qtbot, tmp_path, doc):
    # Quest is sparse only where the context holds more pages than the budget: a longer document (> 400 tokens,
    # several 64-token blocks past a 256-token budget), opened for this test and closed again after it
    long_doc = tmp_path / "planning-long.md"
    long_doc.write_text(DOC_TEXT + "\n" + WORDS * 3)
    window.open_document(str(long_doc))
    qtbot.waitUntil(lambda: window.document_panel.document_name() == long_doc.name and not window.is_busy(),
                    timeout=30_000)
    assert window.document_panel.token_count() > 400
    panel = window.policy_panel
    _choose_small_quest(panel)
    window.docks["quest"].raise_()
    try:
        ask(qtbot, window, QUESTION)
        assert window.worker.engine_config["policy"] == "quest" and window.worker.engine_config["kv_block_size"] == 64
        qtbot.waitUntil(lambda: not window.quest.showing_hint(), timeout=5000)
        step = window.quest.current_step()
        assert step.quest and all(len(p.blocks) < p.n_blocks for p in step.quest)
        assert window.quest.image().shape[0] == len({p.layer for p in step.quest}) and window.quest.image().any()
        assert f"step {step.step}" in window.quest.caption.text()
    finally:
        panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("full"))
        window.open_document(str(doc))
        qtbot.waitUntil(lambda: window.document_panel.document_name() == doc.name and not window.is_busy(),
                        timeout=30_000)


def _choose_small_quest(panel) -> None:
    """Layerwise, 64-token blocks, Quest with a 256-token budget of 16-token pages, choosing at any length (dense
    below 0 tokens and 0 MiB): sparse on ~1500 tokens."""
    panel.mode_combo.setCurrentIndex(panel.mode_combo.findData("layerwise"))
    panel.block_size.setCurrentIndex(panel.block_size.findData(64))
    panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("quest"))
    params = panel._params["quest"]
    params["token_budget"].setValue(256)
    params["page_size"].setCurrentIndex(params["page_size"].findData(16))
    params["min_context"].setValue(0)
    params["min_layer_mb"].setValue(0)


def test_the_document_preview_highlights_what_quest_reads(window, qtbot, tmp_path, doc, default_model_dir):
    wait_ready(qtbot, window, default_model_dir)
    long_doc = tmp_path / "planning-1500.md"                # ~1500 tokens: sparse under a 256-token budget
    long_doc.write_text(DOC_TEXT + "\n" + WORDS * 16)
    window.open_document(str(long_doc))
    qtbot.waitUntil(lambda: window.document_panel.document_name() == long_doc.name and not window.is_busy(),
                    timeout=30_000)
    panel, preview, text = window.policy_panel, window.document_panel.preview, long_doc.read_text()
    assert window.document_panel.token_count() > 1400
    _choose_small_quest(panel)
    assert window.highlight_action.isChecked() and window.highlight_action.text().replace("&", "") in [
        a.text().replace("&", "") for a in window.menuBar().actions()[1].menu().actions()]
    try:
        ask(qtbot, window, QUESTION)
        assert window.worker.engine_config["policy"] == "quest"
        qtbot.waitUntil(lambda: window.quest_highlight.current_step() is window.quest.current_step()
                        and bool(preview.extraSelections()), timeout=5000)
        shown = window.document_panel.highlighted_ranges()
        flat = [x for r in shown for x in r]
        assert flat == sorted(flat) and 0 <= flat[0] and flat[-1] <= len(text) and all(s < e for s, e in shown)
        assert shown == window.quest_highlight.ranges()[0]               # the newest step's picked pages
        step = window.quest.current_step()
        assert all(len(p.positions) < p.n_blocks for p in step.quest)
        assert len({s.format.background().color().name() for s in preview.extraSelections()}) > 1  # by share
        window.highlight_action.trigger()                                # View → Highlight what Quest reads: off
        assert preview.extraSelections() == []
        window.highlight_action.trigger()
        assert window.document_panel.highlighted_ranges() == shown
        panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("full"))
        ask(qtbot, window, QUESTION)                                     # a Full turn: nothing highlighted
        qtbot.wait(100)
        assert preview.extraSelections() == [] and window.quest_highlight.current_step() is None
    finally:
        panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("full"))
        window.open_document(str(doc))
        qtbot.waitUntil(lambda: window.document_panel.document_name() == doc.name and not window.is_busy(),
                        timeout=30_000)
    assert preview.extraSelections() == []


def test_mask_view_shows_the_minference_masks(window, qtbot, tmp_path, doc):
    long_doc = tmp_path / "planning-long.md"                # longer than the policy's dense-below length
    long_doc.write_text(DOC_TEXT + "\n" + WORDS * 3)
    window.open_document(str(long_doc))
    qtbot.waitUntil(lambda: window.document_panel.document_name() == long_doc.name and not window.is_busy(),
                    timeout=30_000)
    panel = window.policy_panel                             # layerwise (in the module's order: already chosen)
    panel.mode_combo.setCurrentIndex(panel.mode_combo.findData("layerwise"))
    assert window.masks.showing_hint()
    panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("minference"))
    params = panel._params["minference"]
    params["vertical"].setValue(0.1)                        # a tenth of the prompt's columns
    params["slash"].setValue(0.3)
    params["min_len"].setValue(256)
    window.docks["masks"].raise_()
    try:
        ask(qtbot, window, QUESTION)       # ~500 tokens: the pattern keeps too much for sparse to win: dense
        llm, hint = window.worker.llm, window.masks.hint_label.text()
        cuda = _on_cuda(window)
        why = "our GPU kernels are slower than dense attention" if cuda else "dense attention is faster on the CPU"
        assert window.worker.engine_config["mode"] == "layerwise" and window.masks.showing_hint() and \
            "the last prefill ran dense (the pattern keeps" in hint and why in hint
        params["gpu_dense_above" if cuda else "cpu_dense_above"].setValue(1.0)   # sparse anyway, to see the masks
        ask(qtbot, window, QUESTION)
        assert window.worker.engine_config["policy_params"] == {"vertical": 0.1, "slash": 0.3, "min_len": 256,
                                                                "cpu_dense_above": 0.35 if cuda else 1.0,
                                                                "gpu_dense_above": 1.0 if cuda else 0.45}
        assert window.worker.llm is llm                     # only the policy changed: switched, not rebuilt
        assert window.status.policy_label.text() == "policy: MInference"
        qtbot.waitUntil(lambda: not window.masks.showing_hint(), timeout=5000)
        p = window.masks.current()
        assert p.kind == "minference" and p.n > 400 and p.offset == 0 and len(p.layers) == 30
        density = p.masks[(0, 0)].density
        assert window.export_bundle(tmp_path / "bundle") and not window.masks.is_binning()   # masks.png: done
        assert 0 < density < 1 and f"density {100 * density:.1f}%" in window.masks.caption.text()
        assert window.masks.image().any() and not window.masks.showing_hint()
    finally:
        panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("full"))
        window.open_document(str(doc))
        qtbot.waitUntil(lambda: window.document_panel.document_name() == doc.name and not window.is_busy(),
                        timeout=30_000)


@pytest.mark.parametrize("name, content, phrase", [
    ("empty.txt", b"   \n", "empty"),
    ("image.txt", bytes(range(256)) * 40, "binary"),
    ("long.txt", (WORDS * 60).encode(), "tokens"),             # ~4K tokens: the context holds 2048
])
def test_a_bad_document_shows_its_error_in_the_document_panel(window, qtbot, tmp_path, doc, name, content, phrase):
    bad = tmp_path / name
    bad.write_bytes(content)
    tokens = window.document_panel.token_count()
    window.open_document(str(bad))
    qtbot.waitUntil(lambda: phrase in window.document_panel.message() and not window.is_busy(), timeout=30_000)
    assert window.document_panel.document_name() == doc.name          # the open document stays
    assert window.document_panel.token_count() == tokens
    assert window.chat.messages()[-1]["role"] == "assistant"          # nothing in the chat
    if name == "long.txt":                                             # the numbers, and what to do
        assert "2,048" in window.document_panel.message() and "shorter" in window.document_panel.message()


def test_a_bad_model_folder_shows_its_error_and_keeps_the_loaded_model(window, qtbot, tmp_path, default_model_dir):
    llm, name = window.worker.llm, window.status.model_label.text()
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "notes.txt").write_text("no config.json here")
    window._on_model_folder(str(tmp_path / "not-a-model"))            # what the panel's folder picker does
    qtbot.waitUntil(lambda: not window.is_busy(), timeout=60_000)
    last = window.chat.messages()[-1]
    assert last["role"] == "error" and "config.json" in last["text"] and "Traceback" not in last["text"]
    assert window.worker.llm is llm and window.status.model_label.text() == name     # the old engine still runs
    window._on_model_folder(str(default_model_dir))                   # back to the real one (the same engine)
    qtbot.waitUntil(lambda: not window.is_busy(), timeout=60_000)
    answer = ask(qtbot, window, QUESTION)
    assert answer["role"] == "assistant" and answer["stats"]["finish_reason"] != "cancelled"


def test_stop_during_prefill_returns_at_once_and_the_next_answer_is_right(window, qtbot, tmp_path, doc):
    if _on_cuda(window):
        pytest.skip("a CUDA prefill of this document ends before Stop can reach it")
    fresh = tmp_path / "fresh.md"                              # new text: nothing from the prefix cache
    fresh.write_text("# Oslo office\n\n" + DOC_TEXT.replace("Bergen", "Oslo") + "\n" + WORDS * 18)
    window.open_document(str(fresh))
    qtbot.waitUntil(lambda: window.document_panel.document_name() == fresh.name and not window.is_busy(),
                    timeout=30_000)
    try:
        n = len(window.chat.messages())
        window.chat.input.setPlainText(QUESTION)
        qtbot.mouseClick(window.chat.send_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: "prefill" in window.status.progress_text(), timeout=TURN_MS)
        t0 = time.monotonic()
        qtbot.keyClick(window.chat.input, Qt.Key.Key_Escape)
        qtbot.waitUntil(lambda: not window.chat.is_streaming() and not window.is_busy(), timeout=20_000)
        assert time.monotonic() - t0 < 5
        stopped = window.chat.messages()[n + 1]
        assert stopped["role"] == "assistant" and stopped["stats"]["finish_reason"] == "cancelled"
        assert stopped["stats"]["completion_tokens"] == 0
        answer = ask(qtbot, window, QUESTION)                  # the stopped prefill left no half-computed KV behind
        assert "Oslo" in answer["text"] and answer["stats"]["cached_tokens"] == 0
    finally:
        window.open_document(str(doc))
        qtbot.waitUntil(lambda: window.document_panel.document_name() == doc.name and not window.is_busy(),
                        timeout=30_000)


def test_closing_mid_answer_exits_cleanly(qapp, qtbot, tmp_path, doc, default_model_dir):
    win = make_window(tmp_path, doc, default_model_dir, max_new_tokens=1500)
    wait_ready(qtbot, win, default_model_dir)
    win.chat.input.setPlainText(LONG_QUESTION)
    qtbot.mouseClick(win.chat.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(win.chat.messages()) > 1 and bool(win.chat.messages()[-1]["text"]), timeout=TURN_MS)
    t0 = time.monotonic()
    assert win.close()
    assert win.thread.isFinished() and time.monotonic() - t0 < 15
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)
    assert settings.value("document") == str(doc) and settings.value("geometry") is not None
