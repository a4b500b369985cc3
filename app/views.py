"""The registry of the main window's views: one `ViewSpec` line per dock.

The window (app/main_window.py) builds everything from `VIEWS`, in order: the widget (`factory()`), its dock
(object name `dock_<name>`, which saveState/restoreState go by), the window attribute (`win.<attr>`, and
`win.views[name]`), the dock's place in the default layout, its View menu entry, the telemetry pump's list (views
with `telemetry=True` get the engine's StepTrace batches) and the export bundle (`export=True`: `<name>.png`).

Adding a view: a widget in widgets/ and one line here (README, "Adding a view"). `build_docks(win, specs)` does the
building.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDockWidget, QFrame, QMainWindow, QScrollArea, QWidget

from widgets.document_panel import DocumentPanel
from widgets.mask_view import MaskView
from widgets.metrics_strip import MetricsStrip
from widgets.policy_panel import PolicyPanel
from widgets.quest_view import QuestView
from widgets.ring_view import RingView
from widgets.timeline_view import TimelineView

LEFT = Qt.DockWidgetArea.LeftDockWidgetArea
RIGHT = Qt.DockWidgetArea.RightDockWidgetArea
BOTTOM = Qt.DockWidgetArea.BottomDockWidgetArea


@dataclass(frozen=True)
class ViewSpec:
    """One dock of the main window.

    name: the key of `win.docks` / `win.views`, the dock's object name `dock_<name>` (saved layouts find it by
        it: never rename a shipped view) and the bundle's `<name>.png`.
    title: the dock's title and its View menu entry.
    area: where the dock starts (LEFT, RIGHT, BOTTOM).
    factory: makes the widget, no arguments (a class, or `functools.partial` for options).
    attr: the window attribute that holds the widget (default: `name`).
    telemetry: the telemetry pump (app/telemetry.py) feeds it the engine's steps: the widget has
        `append_steps(steps)` (a list of `engine.trace.StepTrace`, once per draw) and `clear()` (a reloaded engine
        starts over).
    export: File → Export bundle writes the widget as `<name>.png` (widgets/export.py `save_png`).
    below / right_of / tab_with: at most one; the name of a view listed BEFORE this one: the dock is split off
        under it, beside it on the right, or put in a tab over it (the first dock of a tab group stays in front).
    width / height: the dock's starting size in pixels (resizeDocks), if it needs one.
    scroll: the widget sits in a scroll area that scrolls up and down: a tall form then does not set the window's
        minimum height (the window fits a 1280 x 800 screen, with room for the views below).
    """

    name: str
    title: str
    area: Qt.DockWidgetArea
    factory: Callable[[], QWidget]
    attr: str = ""
    telemetry: bool = False
    export: bool = False
    below: str | None = None
    right_of: str | None = None
    tab_with: str | None = None
    width: int | None = None
    height: int | None = None
    scroll: bool = False

    def __post_init__(self) -> None:
        if sum(p is not None for p in (self.below, self.right_of, self.tab_with)) > 1:
            raise ValueError(f"view {self.name!r}: give at most one of below, right_of, tab_with")
        if not self.attr:
            object.__setattr__(self, "attr", self.name)


VIEWS: tuple[ViewSpec, ...] = (
    ViewSpec("document", "Document", LEFT, DocumentPanel, attr="document_panel", width=380),
    ViewSpec("policy", "Policy", RIGHT, PolicyPanel, attr="policy_panel", width=330, scroll=True),
    ViewSpec("metrics", "Metrics", BOTTOM, MetricsStrip, export=True, height=50),   # fed stats by the window
    ViewSpec("timeline", "Timeline", BOTTOM, TimelineView, telemetry=True, export=True, below="metrics",
             width=700, height=210),        # at 1400 x 900 the policy form above needs no scrolling
    ViewSpec("ring", "Ring buffer", BOTTOM, RingView, telemetry=True, export=True, right_of="timeline", width=420),
    ViewSpec("quest", "Quest", BOTTOM, QuestView, telemetry=True, export=True, tab_with="ring"),
    ViewSpec("masks", "Masks", BOTTOM, partial(MaskView, threaded=True),    # binned off the GUI thread
             telemetry=True, export=True, tab_with="quest"),
)


def build_docks(win: QMainWindow, specs: tuple[ViewSpec, ...]) -> None:
    """One widget and dock per view of `specs`, placed as it says. Sets `win.views` (name -> widget), `win.docks`
    (name -> QDockWidget) and `win.<attr>` for each view; a name or attribute already taken raises ValueError."""
    win.views = {}
    win.docks = {}
    for spec in specs:
        if spec.name in win.views or hasattr(win, spec.attr):
            raise ValueError(f"view {spec.name!r}: the name or the window attribute {spec.attr!r} is taken")
        widget = win.views[spec.name] = spec.factory()
        setattr(win, spec.attr, widget)
        dock = win.docks[spec.name] = QDockWidget(spec.title, win)
        dock.setObjectName(f"dock_{spec.name}")     # saveState/restoreState find docks by name
        dock.setWidget(_scrolled(widget) if spec.scroll else widget)
        win.addDockWidget(spec.area, dock)
    by_name = {spec.name: spec for spec in specs}
    tab_groups = set()                               # the first view of each tab group
    for spec in specs:                               # in order: a view is placed next to one placed before
        dock = win.docks[spec.name]
        if spec.below:
            win.splitDockWidget(win.docks[spec.below], dock, Qt.Orientation.Vertical)
        elif spec.right_of:
            win.splitDockWidget(win.docks[spec.right_of], dock, Qt.Orientation.Horizontal)
        elif spec.tab_with:
            win.tabifyDockWidget(win.docks[spec.tab_with], dock)
            first = spec.tab_with
            while by_name[first].tab_with:
                first = by_name[first].tab_with
            tab_groups.add(first)
    for name in tab_groups:
        win.docks[name].raise_()                     # a tab group shows its first view
    for size, orientation in (("width", Qt.Orientation.Horizontal), ("height", Qt.Orientation.Vertical)):
        sized = [spec for spec in specs if getattr(spec, size) is not None]
        if sized:
            win.resizeDocks([win.docks[s.name] for s in sized], [getattr(s, size) for s in sized], orientation)


def _scrolled(widget: QWidget) -> QScrollArea:
    """`widget` in a frameless scroll area as wide as the widget needs (it scrolls up and down only)."""
    area = QScrollArea(frameShape=QFrame.Shape.NoFrame, widgetResizable=True)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    area.setWidget(widget)
    area.setMinimumWidth(widget.minimumSizeHint().width() + area.verticalScrollBar().sizeHint().width())
    return area
