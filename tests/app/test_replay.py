"""Recordings in the app: a live Quest turn saved from the window opens in a replay window that shows the same
chat, picks, highlight and timeline, with no engine; bad files and an empty conversation are one message each."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from PySide6.QtWidgets import QMessageBox

from app.main_window import MainWindow
from app.gui import replay_window
from app.replay import READ_ONLY, open_recording_window, save_window_recording
from engine.trace.recording import load_recording
from tests.app.test_window import DOC_TEXT, QUESTION, ask, make_window, wait_ready
from widgets.timeline_view import TimelineView

ROOT = Path(__file__).resolve().parents[2]
QUEST = {"policy": "quest", "mode": "layerwise",
         "policy_params": {"token_budget": 128, "page_size": 16, "min_context": 0, "min_layer_mb": 0}}


def _boxes(win, title: str) -> list[QMessageBox]:
    return [b for b in win.findChildren(QMessageBox) if b.windowTitle() == title and b.isVisible()]


@pytest.fixture(scope="module")
def live(qapp, tmp_path_factory, default_model_dir):
    """A window that answered one question with Quest, and its recording."""
    from pytestqt.qtbot import QtBot
    tmp = tmp_path_factory.mktemp("replay")
    doc = tmp / "planning.md"
    doc.write_text(DOC_TEXT)
    qtbot = QtBot(None)
    win = make_window(tmp, doc, default_model_dir)
    wait_ready(qtbot, win, default_model_dir)
    win.policy_panel.set_config(QUEST)
    answer = ask(qtbot, win, QUESTION)
    assert answer["role"] == "assistant" and answer["stats"]["policy"] == "quest"
    path = save_window_recording(win, tmp / "turn.kvscope")
    yield win, path, qtbot
    win.close()


def test_the_window_saves_its_turn_as_a_recording(live):
    win, path, _ = live
    rec = load_recording(path)
    assert [t["question"] for t in rec.turns] == [QUESTION]
    assert rec.turns[0]["answer"] == win.chat.messages()[-1]["text"]
    assert rec.document == win.document_info["text"] and rec.meta["origin"] == "app"
    assert rec.turns[0]["engine"]["policy"] == "quest" and rec.turns[0]["token_map"] is not None
    assert [s.step for s in rec.steps] == [s.step for s in win.worker.turn_steps]
    assert any(len(s.quest) for s in rec.steps)


def test_a_replay_shows_what_the_live_window_showed(live, qtbot):
    win, path, _ = live
    rec = load_recording(path)
    replay = replay_window(rec, {"settings_path": str(path.with_suffix(".ini")), "restore": False})
    qtbot.addWidget(replay)
    replay.show()
    assert [(m["role"], m["text"]) for m in replay.chat.messages()] == \
           [(m["role"], m["text"]) for m in win.chat.messages()]
    assert replay.chat.messages()[-1]["stats"]["decode_tok_s"] == win.chat.messages()[-1]["stats"]["decode_tok_s"]
    assert replay.chat.message_widget(-1).isVisible()
    # Quest's picks: the newest step's picture is the live one's, and scrubbing shows the same steps
    assert replay.quest.step_count() == sum(1 for s in win.worker.turn_steps if s.phase == "decode" and s.quest)
    win.quest.set_step_index(-1)
    np.testing.assert_array_equal(replay.quest.image(), win.quest.image())
    assert replay.quest.caption.text() == win.quest.caption.text()
    # the document: the same pages highlighted
    assert replay.document_panel.highlighted_ranges() == win.document_panel.highlighted_ranges() != []
    replay.quest.slider.setValue(0)                     # scrubbing moves the highlight to that step
    assert replay.quest_highlight.current_step() is replay.quest.current_step()
    # the timeline: the turn's bars, as a timeline shows the live turn's steps
    ref = TimelineView()
    qtbot.addWidget(ref)
    ref.set_steps(list(win.worker.turn_steps))
    assert replay.timeline.bar_count() == ref.bar_count() > 0
    # labelled as a recording; read-only
    assert "recording: turn.kvscope · made on" in replay.status.recording_label.text()
    assert not replay.chat.input.isEnabled() and replay.chat.input.placeholderText() == READ_ONLY
    assert not replay.policy_panel.isEnabled() and replay.worker.llm is None
    assert not replay.docks["quest"].visibleRegion().isEmpty()          # the Quest tab is the one in front
    replay.close()


def test_a_replay_needs_no_model_and_no_torch(live, tmp_path):
    _, path, _ = live
    code = (f"import sys; from PySide6.QtWidgets import QApplication; app = QApplication([]); "
            f"from app.gui import replay_window; from engine.trace.recording import load_recording; "
            f"w = replay_window(load_recording({str(path)!r}), {{'settings_path': {str(tmp_path / 's.ini')!r}}}); "
            f"w.show(); app.processEvents(); "
            f"print(w.quest.step_count(), len(w.chat.messages()), 'torch' in sys.modules); w.close()")
    env = {"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),   # no model files
           "XDG_CACHE_HOME": str(tmp_path / "no-cache"),                                       # to be found
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **{k: os.environ[k] for k in ("LD_LIBRARY_PATH", "FONTCONFIG_FILE") if k in os.environ}}   # (Qt's)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps, messages, torch = proc.stdout.split()
    assert int(steps) > 0 and messages == "2" and torch == "False"


def test_a_file_that_is_not_a_recording_is_one_message_and_loses_nothing(live, tmp_path):
    win, _, _ = live
    before = win.chat.messages()
    bad = tmp_path / "notes.kvscope"
    bad.write_text("not a recording")
    assert open_recording_window(win, bad) is None
    box, = _boxes(win, "Cannot open the recording")
    assert "not a kvscope recording" in box.text() and "\n" not in box.text()
    box.close()
    assert win.chat.messages() == before and win.document_panel.document_name() == "planning.md"


def test_dropping_a_recording_opens_it_in_a_window_of_its_own(live, qtbot):
    win, path, _ = live
    data = QMimeData()
    data.setUrls([QUrl.fromLocalFile(str(path))])
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, data, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    win.dropEvent(event)
    replay = win.side_windows[-1]
    assert replay.isVisible() and replay is not win and replay.chat.messages()[-1]["role"] == "assistant"
    assert win.document_panel.document_name() == "planning.md"              # the live window kept its document
    replay.close()


def test_saving_with_no_finished_turn_says_so(qtbot, tmp_path):
    win = MainWindow({"settings_path": str(tmp_path / "k.ini"), "autostart": False, "restore": False})
    qtbot.addWidget(win)
    win.show()
    assert save_window_recording(win, tmp_path / "empty.kvscope") is None
    box, = _boxes(win, "Nothing to save")
    assert "ask a question first" in box.text()
    assert not (tmp_path / "empty.kvscope").exists()
    win.close()


def test_ask_again_runs_the_last_question_with_the_panels_settings_and_compares(live):
    win, _, qtbot = live
    from app.compare_window import CompareWindow
    first = win.chat.messages()[-1]
    win.policy_panel.set_config({"policy": "full"})
    assert win.ask_again()
    qtbot.waitUntil(lambda: not win.is_busy() and len(win.conversation.turns) == 2, timeout=180_000)
    a, b = win.conversation.turns
    assert a["question"] == b["question"] == QUESTION and a["answer"] == first["text"]
    assert a["engine"]["policy"] == "quest" and b["engine"]["policy"] == "full"
    assert [m["role"] for m in win.chat.messages()[-2:]] == ["user", "assistant"]
    assert win.worker.history == [{"role": "user", "content": QUESTION},       # B in place of A, not after it
                                  {"role": "assistant", "content": b["answer"]}]
    shown = win.side_windows[-1]
    assert isinstance(shown, CompareWindow) and shown.isVisible()
    cmp = shown.view.comparison
    assert (cmp.answer_a, cmp.answer_b) == (a["answer"], b["answer"]) and cmp.quest_jaccard is None
    assert "Quest picks: neither turn" in shown.view.quest.caption.text()
    shown.close()
