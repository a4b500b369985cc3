"""Labels whose new text lays nothing else out again: the window's relayouts (one per new figure, with a Qt
animation per dock) and the plots' resizes cost a CPU engine its cores' time during every turn."""
from PySide6.QtCore import QEvent, QObject
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from widgets.steady import SteadyHeight, SteadyLabel


class LayoutRequests(QObject):
    def __init__(self, widget):
        super().__init__()
        self.count = 0
        widget.installEventFilter(self)

    def eventFilter(self, obj, event):   # noqa: N802
        if event.type() == QEvent.Type.LayoutRequest:
            self.count += 1
        return False


def _window(qtbot, child):
    top = QWidget()
    layout = QVBoxLayout(top)
    layout.addWidget(child)
    layout.addWidget(QLabel("below"))
    top.resize(400, 200)
    qtbot.addWidget(top)
    top.show()
    qtbot.waitExposed(top)
    qtbot.wait(50)                                               # its first layout done
    return top


def test_a_steady_label_takes_new_figures_without_a_layout_and_grows_when_one_does_not_fit(qtbot):
    label = SteadyLabel("—", "8,888.8")
    top = _window(qtbot, label)
    requests = LayoutRequests(top)
    size = label.size()
    for text in ("1.5", "88.2", "1,234.5", "—"):
        label.setText(text)
        qtbot.wait(20)
    assert requests.count == 0 and label.size() == size and label.text() == "—"
    label.setText("1,234,567.8 tok/s")                          # wider than the sample: it grows, once
    qtbot.wait(20)
    assert requests.count >= 1 and label.width() > size.width()
    assert label.width() >= label.fontMetrics().horizontalAdvance("1,234,567.8 tok/s")


def test_a_steady_height_grows_to_the_lines_a_text_needs_and_shrinks_only_when_relaxed(qtbot):
    label = QLabel("short")
    box = SteadyHeight(label)
    top = _window(qtbot, box)
    one_line = box.height()
    requests = LayoutRequests(top)
    label.setText("a much longer summary line " * 8)
    box.text_changed()
    qtbot.wait(20)
    grown = box.height()
    assert grown >= 2 * one_line and label.height() == grown       # every line shows
    requests.count = 0
    for text in ("short again", "a much longer summary line " * 5):
        label.setText(text)
        box.text_changed()
        qtbot.wait(20)
    assert box.height() == grown and requests.count == 0            # nothing below it moved
    box.relax()
    qtbot.wait(20)
    assert box.height() < grown
