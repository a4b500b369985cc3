"""The main window builds its docks from the view registry (app/views.py): one extra ViewSpec line gives a view its
dock, its View menu entry, the engine's steps through the telemetry pump and its PNG in the export bundle.

Runs the real engine on the default model (one short turn). The settings go to an INI file in tmp.
"""
import pytest
from PySide6.QtWidgets import QLabel

from app.main_window import MainWindow
from app.views import BOTTOM, VIEWS, ViewSpec


class ProbeView(QLabel):
    """A throwaway view: counts the steps the pump gives it."""

    def __init__(self):
        super().__init__("probe")
        self.steps = []
        self.clears = 0

    def append_steps(self, steps) -> None:
        self.steps += steps
        self.setText(f"{len(self.steps)} steps")

    def clear(self) -> None:
        self.clears += 1
        self.steps = []


PROBE = ViewSpec("probe", "Probe", BOTTOM, ProbeView, telemetry=True, export=True, tab_with="masks")


def test_a_view_spec_takes_at_most_one_placement():
    with pytest.raises(ValueError):
        ViewSpec("x", "X", BOTTOM, ProbeView, below="metrics", tab_with="ring")
    assert ViewSpec("x", "X", BOTTOM, ProbeView).attr == "x"


def test_one_registry_line_adds_a_view(qapp, qtbot, tmp_path, default_model_dir):
    doc = tmp_path / "note.md"
    doc.write_text("# Note\n\nThe meeting is in Bergen on Tuesday at ten, in the harbour office.\n")
    win = MainWindow({"settings_path": str(tmp_path / "kvscope.ini"), "document": str(doc), "restore": False,
                      "engine": {"model": str(default_model_dir), "max_model_len": 1024}, "max_new_tokens": 4},
                     views=(*VIEWS, PROBE))
    try:
        win.resize(1300, 850)
        win.show()
        probe = win.probe
        assert isinstance(probe, ProbeView) and win.views["probe"] is probe
        dock = win.docks["probe"]
        assert dock.widget() is probe and dock.objectName() == "dock_probe" and dock.windowTitle() == "Probe"
        assert set(win.docks) == {spec.name for spec in VIEWS} | {"probe"}
        assert dock in win.tabifiedDockWidgets(win.docks["masks"])          # a tab beside the ring buffer ...
        qtbot.waitUntil(lambda: not win.docks["ring"].visibleRegion().isEmpty(), timeout=5000)
        assert dock.visibleRegion().isEmpty()                              # ... which stays in front
        view_menu = next(a.menu() for a in win.menuBar().actions() if a.text().replace("&", "") == "View")
        assert dock.toggleViewAction() in view_menu.actions()

        def ready() -> None:     # (an assertion: on a timeout, pytest-qt shows what the chat says)
            assert win.model_info and win.document_info and not win.is_busy(), win.chat.messages()

        qtbot.waitUntil(ready, timeout=180_000)
        win.chat.input.setPlainText("Where is the meeting?")
        win.chat.send_button.click()
        qtbot.waitUntil(lambda: len(win.chat.messages()) >= 2 and not win.chat.is_streaming() and not win.is_busy(),
                        timeout=180_000)
        assert win.chat.messages()[-1]["role"] == "assistant", win.chat.messages()
        qtbot.waitUntil(lambda: bool(probe.steps), timeout=5000)           # the pump fed it the turn's steps
        turn = [s.step for s in win.worker.turn_steps]
        assert turn and [s.step for s in probe.steps[-len(turn):]] == turn

        out = win.export_bundle(tmp_path / "bundle")
        assert (out / "probe.png").is_file() and (out / "timeline.png").is_file()
    finally:
        win.close()
    assert win.thread.isFinished()
