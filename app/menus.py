"""The main window's menus (File, View, Help) and its window-wide Esc shortcut.

`build_menus(win)` runs once the window has its chat, docks and Quest highlight (app/main_window.py); it sets
`win.highlight_action` (View → Highlight what Quest reads), `win.watch_action` (View → Watch the engine) and
`win.stop_action` (Esc: stop the answer).
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMessageBox, QWidget

from app.bundle import export_bundle_dialog, export_chat_dialog
from app.compare_window import compare_dialog
from app.replay import open_recording_dialog, save_recording_dialog


def _action(menu, text, slot, shortcut=None) -> QAction:
    act = menu.addAction(text)
    act.triggered.connect(slot)
    if shortcut is not None:
        act.setShortcut(QKeySequence(shortcut))
    return act


def show_about(parent: QWidget) -> None:
    QMessageBox.about(parent, "About kvscope", "<b>kvscope</b><p>Chat with a long document on kvscope's own "
                      "engine and watch it work: the stream timeline, the ring buffer and the metrics show "
                      "what each step computed and copied.</p><p>Apache-2.0</p>")


def build_menus(win: QMainWindow) -> None:
    """File (open, new chat, exports, recordings, quit), View (a toggle per dock, the Quest highlight, reset layout), Help."""
    file_menu = win.menuBar().addMenu("&File")
    _action(file_menu, "&Open document…", win.open_document_dialog, QKeySequence.StandardKey.Open)
    _action(file_menu, "&New chat", win.new_chat, QKeySequence.StandardKey.New)
    file_menu.addSeparator()
    _action(file_menu, "Export &chat…", lambda: export_chat_dialog(win))
    _action(file_menu, "Export &bundle…", lambda: export_bundle_dialog(win))
    file_menu.addSeparator()
    _action(file_menu, "Open &recording…", lambda: open_recording_dialog(win))
    _action(file_menu, "&Save recording…", lambda: save_recording_dialog(win), QKeySequence.StandardKey.Save)
    _action(file_menu, "Co&mpare with a recording…", lambda: compare_dialog(win))
    win.ask_again_action = _action(file_menu, "Ask &again and compare", lambda: win.ask_again() or win.status.showMessage(
        "Ask again and compare: wait for a finished answer (it asks the last question again with the panel's "
        "settings now)", 8000))
    win.ask_again_action.setStatusTip("The last question again with the policy panel's settings now; then the two "
                                      "turns side by side")
    file_menu.addSeparator()
    _action(file_menu, "&Quit", win.close, "Ctrl+Q")
    view_menu = win.menuBar().addMenu("&View")
    for dock in win.docks.values():
        view_menu.addAction(dock.toggleViewAction())
    view_menu.addSeparator()
    win.highlight_action = QAction("&Highlight what Quest reads", win, checkable=True, checked=True,
                                   toggled=win.quest_highlight.set_enabled)
    view_menu.addAction(win.highlight_action)
    win.watch_action = QAction("&Watch the engine (live views)", win, checkable=True, checked=True,
                               toggled=win.set_watching)
    win.watch_action.setStatusTip("Off: the engine records nothing from the next question on (it runs as the command "
                                  "line runs it) and the views keep what they showed")
    view_menu.addAction(win.watch_action)
    _action(view_menu, "&Reset layout", win.reset_layout)
    help_menu = win.menuBar().addMenu("&Help")
    _action(help_menu, "&About kvscope", lambda: show_about(win))

    def stop_answer() -> None:
        if win.chat.is_streaming() and win.chat.send_button.isEnabled():
            win.chat.send_button.click()    # the chat's Stop button: shows "Stopping…" and emits stop_requested

    win.stop_action = QAction("Stop the answer", win, shortcut=QKeySequence(Qt.Key.Key_Escape))
    win.stop_action.triggered.connect(stop_answer)
    win.addAction(win.stop_action)      # Esc anywhere in the window (the chat's own Esc works too)
