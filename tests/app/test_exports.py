"""Exports to a place that cannot be written: one clear message, checked before any work, and nothing lost.

A real main window (no model loaded: exporting does not need one) with a conversation in its chat, shown
offscreen. Paths under /proc cannot be written even by root, so these hold however the tests are run.
"""
from pathlib import Path

import pytest
from PySide6.QtWidgets import QMessageBox

from app.bundle import export_bundle, export_chat
from app.main_window import MainWindow
from widgets.export import export_to

ANSWER = "The meeting is in **Bergen**, on Tuesday at ten."


@pytest.fixture
def window(qtbot, tmp_path):
    win = MainWindow({"settings_path": str(tmp_path / "kvscope.ini"), "restore": False, "autostart": False})
    qtbot.addWidget(win)
    win.resize(1280, 800)
    win.show()
    win.chat.add_user_message("Where is the meeting?")
    win.chat.begin_answer()
    win.chat.append_text(ANSWER)
    win.chat.end_answer({"prompt_tokens": 120, "completion_tokens": 14})
    win.chat.input.setPlainText("a question being typed")
    (tmp_path / "a-file").write_text("not a folder")
    yield win
    win.close()


def _error_boxes(win) -> list[QMessageBox]:
    return [b for b in win.findChildren(QMessageBox) if b.objectName() == "export_error" and b.isVisible()]


def _one_message(qtbot, win) -> str:
    """The one "Export failed" box the window shows (closed after reading, as a user would)."""
    qtbot.waitUntil(lambda: len(_error_boxes(win)) == 1, timeout=2000)
    box = _error_boxes(win)[0]
    assert box.windowTitle() == "Export failed" and box.icon() == QMessageBox.Icon.Warning
    text = box.text()
    box.close()
    qtbot.waitUntil(lambda: not _error_boxes(win), timeout=2000)
    assert "\n" not in text and "Traceback" not in text and "Errno" not in text
    return text


def _unchanged(win, before: list[dict]) -> None:
    assert win.chat.messages() == before and win.chat.input.toPlainText() == "a question being typed"
    assert ANSWER.replace("**", "") in win.chat.message_widget(-1).body.toPlainText()


@pytest.mark.parametrize("where, why", [
    ("/proc/self/chat.md", "cannot create a file in /proc/self"),
    ("{tmp}/a-file/chat.md", "a-file is a file, not a folder"),
    ("{tmp}", "it is a folder; give a file name"),
    ("{tmp}/chat.txt", "save the chat as .md (Markdown) or .json"),
])
def test_chat_export_to_a_bad_place_is_one_message_and_the_chat_stays(window, qtbot, tmp_path, where, why):
    where = Path(where.format(tmp=tmp_path))
    before = window.chat.messages()
    assert export_chat(window, where) is False
    text = _one_message(qtbot, window)
    assert text.startswith(f"Cannot export the chat to {where}: ") and why in text
    _unchanged(window, before)
    assert [p.name for p in tmp_path.iterdir() if p.name != "kvscope.ini"] == ["a-file"]   # nothing written

    assert export_chat(window, tmp_path / "chat.md") is True                  # a good place works at once
    assert "Where is the meeting?" in (tmp_path / "chat.md").read_text() and not _error_boxes(window)


@pytest.mark.parametrize("where, why", [
    ("/proc/self/bundle", "cannot create a file in /proc/self"),
    ("{tmp}/a-file/bundle", "a-file is a file, not a folder"),
    ("{tmp}/a-file", "a-file is a file, not a folder"),
])
def test_bundle_export_to_a_bad_place_is_one_message_before_any_work(window, qtbot, tmp_path, where, why):
    where = Path(where.format(tmp=tmp_path))
    before = window.chat.messages()
    grabbed, real_grab = [], window.grab                                      # counts the screenshots taken
    window.grab = lambda *a: grabbed.append(1) or real_grab(*a)
    assert export_bundle(window, where) is None
    text = _one_message(qtbot, window)
    assert text.startswith(f"Cannot export the bundle to {where}: ") and why in text
    assert grabbed == [] and not (tmp_path / "a-file").is_dir()               # nothing drawn, nothing made
    _unchanged(window, before)

    out = export_bundle(window, tmp_path / "bundle")                          # a good place works at once
    assert out == tmp_path / "bundle" and (out / "chat.md").is_file() and (out / "window.png").is_file()
    assert grabbed == [1] and not _error_boxes(window)


def test_view_export_to_a_bad_place_is_one_message(window, qtbot, tmp_path):
    for where, why in [(Path("/proc/self/timeline.png"), "cannot create a file in /proc/self"),
                       (tmp_path / "a-file" / "timeline.svg", "a-file is a file, not a folder")]:
        assert export_to(window.timeline, where.suffix[1:], where) is None
        text = _one_message(qtbot, window)
        assert text.startswith(f"Cannot export {where}: ") and why in text
    assert export_to(window.timeline, "png", tmp_path / "timeline.png") == tmp_path / "timeline.png"
