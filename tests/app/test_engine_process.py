"""The window as `python main.py` runs it: the engine in a process of its own (app/engine_process.py), on the real
default model, offscreen. Answers and steps come across, Stop reaches the child, a child that dies is reported
in one line and replaced without losing the chat, and closing the window mid-answer ends the child cleanly."""
import os
import signal
import time

import pytest
from PySide6.QtCore import Qt

from tests.app.test_window import (DOC_TEXT, LONG_QUESTION, QUESTION, TURN_MS, ask, make_window,
                                   start_long_answer, wait_ready)


@pytest.fixture(scope="module")
def window(qapp, tmp_path_factory, default_model_dir):
    doc = tmp_path_factory.mktemp("doc") / "planning.md"
    doc.write_text(DOC_TEXT)
    win = make_window(tmp_path_factory.mktemp("settings"), doc, default_model_dir, engine_process=True)
    yield win
    win.close()


def test_the_engine_answers_from_its_own_process_and_its_steps_are_drawn(window, qtbot, default_model_dir):
    wait_ready(qtbot, window, default_model_dir)
    assert window.worker.pid not in (None, os.getpid()) and window.worker.llm is None    # the LLM lives there
    answer = ask(qtbot, window, QUESTION)
    assert "Bergen" in answer["text"] and answer["stats"]["finish_reason"] in ("stop", "length")
    steps = window.worker.turn_steps
    assert [s.phase for s in steps].count("decode") == answer["stats"]["completion_tokens"] - 1
    assert window.timeline.bar_count() > 0
    turn = {"role": "assistant", "content": answer["text"]}   # (the history's copy comes with the request's end,
    qtbot.waitUntil(lambda: window.worker.history[-1:] == [turn], timeout=5000)   # after the answer's signal)
    assert window.describe()["engine"]["model"] == str(default_model_dir)


def test_an_idle_window_wakes_seldom_and_its_next_turn_is_drawn(window, qtbot, monkeypatch):
    """Between turns the window's timers wake its GUI thread a few times a second at most (each wake-up is CPU the
    engine of a 2-core machine loses); the next answer's steps are drawn as before."""
    from app import telemetry
    from app.collector import PROCESS_INTERVAL_MS
    monkeypatch.setattr(telemetry, "IDLE_S", 0.3)
    assert window.collector.timer.interval() == PROCESS_INTERVAL_MS       # no engine thread in this process
    qtbot.waitUntil(lambda: window.telemetry.idle, timeout=5_000)
    assert window.telemetry.timer.interval() == telemetry.IDLE_TICK_MS
    answer = ask(qtbot, window, QUESTION)
    steps = window.worker.turn_steps
    assert "Bergen" in answer["text"]
    assert [s.phase for s in steps].count("decode") == answer["stats"]["completion_tokens"] - 1
    assert window.timeline.steps[-1].step == steps[-1].step                 # the turn's last step is on the timeline


def test_unwatched_the_engine_records_nothing_and_the_views_keep_the_last_turn(window, qtbot):
    """View → Watch the engine off: the next answer comes as before with its stats, but the engine recorded no step
    (it ran as the command line runs it), and the views still show the turn before; on again, steps come back."""
    bars = window.timeline.bar_count()
    assert bars > 0 and window.status.watch_label.text() == ""
    window.watch_action.setChecked(False)
    assert window.status.watch_label.text() == "live views paused"
    answer = ask(qtbot, window, QUESTION)
    assert "Bergen" in answer["text"] and answer["stats"]["completion_tokens"] > 1
    assert window.worker.turn_steps == [] and window.timeline.bar_count() == bars
    old = window.worker.pid                                 # a child started again is told too
    os.kill(old, signal.SIGKILL)
    qtbot.waitUntil(lambda: not window.worker._proc.is_alive(), timeout=10_000)
    answer = ask(qtbot, window, QUESTION)
    assert window.worker.pid not in (None, old) and "Bergen" in answer["text"] and window.worker.turn_steps == []
    window.watch_action.setChecked(True)
    answer = ask(qtbot, window, QUESTION)
    assert [s.phase for s in window.worker.turn_steps].count("decode") == answer["stats"]["completion_tokens"] - 1
    assert window.status.watch_label.text() == ""


def test_stop_reaches_the_engine_process(window, qtbot):
    start_long_answer(qtbot, window, 21)
    t0 = time.monotonic()
    qtbot.keyClick(window.chat.input, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not window.chat.is_streaming() and not window.is_busy(), timeout=20_000)
    assert time.monotonic() - t0 < 10
    stopped = window.chat.messages()[-1]
    assert stopped["stats"]["finish_reason"] == "cancelled" and len(stopped["text"]) > 20   # the partial answer
    window.chat.set_sampling({"max_tokens": 24})


def test_a_dead_engine_process_is_reported_and_replaced_without_losing_the_chat(window, qtbot):
    history = list(window.worker.history)
    old = window.worker.pid
    start_long_answer(qtbot, window, 6)
    os.kill(old, signal.SIGKILL)                                  # as a driver crash or the OOM killer would
    qtbot.waitUntil(lambda: not window.chat.is_streaming() and not window.is_busy(), timeout=20_000)
    message = window.status.currentMessage()
    assert "engine process stopped" in message and "\n" not in message
    assert window.worker.history == history                       # the chat so far is kept
    window.chat.set_sampling({"max_tokens": 24})
    answer = ask(qtbot, window, "And at what time?")              # a new process, the same model, document, chat
    assert window.worker.pid not in (None, old)
    assert answer["stats"] is not None, window.chat.messages()[-3:]
    assert answer["stats"]["finish_reason"] in ("stop", "length") and answer["text"]
    assert window.worker.history[:len(history)] == history


def test_closing_mid_answer_ends_the_engine_process(qapp, qtbot, tmp_path, default_model_dir):
    doc = tmp_path / "planning.md"
    doc.write_text(DOC_TEXT)
    win = make_window(tmp_path, doc, default_model_dir, max_new_tokens=1500, engine_process=True)
    wait_ready(qtbot, win, default_model_dir)
    proc = win.worker._proc
    win.chat.input.setPlainText(LONG_QUESTION)
    qtbot.mouseClick(win.chat.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(win.chat.messages()) > 1 and bool(win.chat.messages()[-1]["text"]), timeout=TURN_MS)
    t0 = time.monotonic()
    assert win.close()
    assert time.monotonic() - t0 < 15 and win.thread.isFinished()
    assert not proc.is_alive() and proc.exitcode == 0                 # it closed its engine and returned
