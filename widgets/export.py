"""Save any view as PNG or SVG, with or without a file dialog.

    save_png(plot_widget, "timeline.png")       # pyqtgraph PlotWidget / GraphicsLayoutWidget: pyqtgraph exporters
    save_svg(metrics_strip, "metrics.svg")      # a plain QWidget: grab() for PNG, QSvgGenerator for SVG
    add_export_actions(widget, "timeline")      # "Export PNG…" / "Export SVG…" in the widget's context menu

The dialog is a `QFileDialog` in save mode: it asks before it overwrites a file (Qt's default, kept), and it adds
the suffix itself, so that question also covers a name typed without ".png". A path that cannot be written is
refused before anything is drawn, with one message (`show_export_error`, which does not block the event loop).
"""
from __future__ import annotations

from pathlib import Path

import pyqtgraph as pg
from pyqtgraph.exporters import ImageExporter, SVGExporter
from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QAction, QPainter
from PySide6.QtSvg import QSvgGenerator
from PySide6.QtWidgets import QFileDialog, QGraphicsView, QMessageBox, QWidget

from engine.paths import output_file_problem

FORMATS = {"png": "PNG image (*.png)", "svg": "SVG drawing (*.svg)"}
_last_dir: str = ""   # the folder of the last export, offered by the next dialog


def _target(widget: QWidget):
    """What the pyqtgraph exporters take for `widget` (its plot item or its scene), or None for a plain widget."""
    if isinstance(widget, pg.PlotWidget):
        return widget.getPlotItem()
    if isinstance(widget, pg.GraphicsView):
        return widget.scene()
    return None


def _written(path: Path) -> Path:
    if not path.is_file() or path.stat().st_size == 0:
        raise OSError(f"could not write {path}")
    return path


def save_png(widget: QWidget, path: str | Path) -> Path:
    """Write `widget` to `path` as a PNG image at its on-screen size; returns the path (OSError if not written)."""
    path = Path(path)
    target = _target(widget)
    if target is None:
        if not widget.grab().save(str(path), "PNG"):
            raise OSError(f"could not write {path}")
        return _written(path)
    exporter = ImageExporter(target)
    rect = exporter.getTargetRect()
    # the exporter's own parameters are ints derived from floats; set both so neither rounds to zero
    exporter.parameters()["width"] = max(1, int(round(rect.width())))
    exporter.parameters()["height"] = max(1, int(round(rect.height())))
    exporter.export(str(path))
    return _written(path)


def save_svg(widget: QWidget, path: str | Path, title: str = "kvscope") -> Path:
    """Write `widget` to `path` as an SVG drawing (vector where the widget paints vectors); returns the path.

    pyqtgraph widgets go through pyqtgraph's SVGExporter; where it fails (pyqtgraph 0.14 cannot parse the closed
    paths "... Z" that newer Qt writes: pyqtgraph issue #3495) the widget is rendered with QSvgGenerator instead,
    as plain widgets always are."""
    path = Path(path)
    target = _target(widget)
    if target is not None:
        try:
            SVGExporter(target).export(str(path))
            return _written(path)
        except ValueError:
            pass
    return _render_svg(widget, path, title)


def _render_svg(widget: QWidget, path: Path, title: str) -> Path:
    """Paint `widget` (and its children) into an SVG file with Qt's own SVG generator."""
    size = widget.size() if widget.width() > 0 and widget.height() > 0 else widget.sizeHint()
    gen = QSvgGenerator()
    gen.setFileName(str(path))
    gen.setSize(QSize(size.width(), size.height()))
    gen.setViewBox(QRect(0, 0, size.width(), size.height()))
    gen.setTitle(title)
    painter = QPainter()
    if not painter.begin(gen):
        raise OSError(f"could not write {path}")
    try:
        if isinstance(widget, QGraphicsView):
            widget.render(painter)                 # the scene as the view shows it
        else:
            widget.render(painter, QPoint(0, 0))   # the widget and its children
    finally:
        painter.end()
    return _written(path)


def save(widget: QWidget, path: str | Path) -> Path:
    """PNG or SVG by the path's suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".svg":
        return save_svg(widget, path)
    if suffix == ".png":
        return save_png(widget, path)
    raise ValueError(f"unknown export format {suffix!r}: use .png or .svg")


def ask_save_path(parent: QWidget | None, fmt: str, name: str = "view") -> Path | None:
    """Ask where to save a `fmt` ("png" or "svg") file; None if the user cancels.

    Qt asks before overwriting an existing file (the dialog's default, which this keeps)."""
    global _last_dir
    start = str(Path(_last_dir or Path.home()) / f"{name}.{fmt}")
    dialog = QFileDialog(parent, f"Export {fmt.upper()}", start, FORMATS[fmt])
    dialog.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
    dialog.setFileMode(QFileDialog.FileMode.AnyFile)
    dialog.setDefaultSuffix(fmt)          # "trace" becomes "trace.png" before the overwrite question
    if not dialog.exec():
        return None
    files = dialog.selectedFiles()
    if not files:
        return None
    _last_dir = str(Path(files[0]).parent)
    return Path(files[0])


def export_with_dialog(widget: QWidget, fmt: str, name: str = "view") -> Path | None:
    """Ask for a path, save `widget` there, and tell the user if it failed; returns the path written (or None)."""
    path = ask_save_path(widget.window(), fmt, name)
    return None if path is None else export_to(widget, fmt, path)


def export_to(widget: QWidget, fmt: str, path: Path) -> Path | None:
    """Save `widget` as `fmt` at `path`, checked first; a failure is one message, and None."""
    problem = output_file_problem(path, f"view.{fmt}")
    try:
        if problem is None:
            return (save_png if fmt == "png" else save_svg)(widget, path)
    except OSError as e:
        problem = f"{e.strerror or e}; choose another place"
    show_export_error(widget.window(), f"Cannot export {path}: {problem}")
    return None


def show_export_error(parent: QWidget | None, message: str, title: str = "Export failed") -> QMessageBox:
    """One warning box, `title`, with `message` (one line). It does not block: what the user was doing stays as
    it was."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, message, QMessageBox.StandardButton.Ok, parent)
    box.setObjectName("export_error")
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    box.open()
    return box


def _menus(widget: QWidget) -> list:
    """The context menus a pyqtgraph widget shows: those of its view boxes."""
    if isinstance(widget, pg.PlotWidget):
        return [widget.getPlotItem().getViewBox().menu]
    if isinstance(widget, pg.GraphicsView):
        return [item.menu for item in widget.scene().items()
                if isinstance(item, pg.ViewBox) and getattr(item, "menu", None) is not None]
    return []


def add_export_actions(widget: QWidget, name: str = "view") -> list[QAction]:
    """Add "Export PNG…" and "Export SVG…" to `widget`'s context menu; returns the two actions.

    pyqtgraph widgets get them in their plots' right-click menus; a plain widget shows them as its context menu
    (Qt.ActionsContextMenu). `name` is the file name the dialog proposes."""
    actions = []
    for fmt in ("png", "svg"):
        action = QAction(f"Export {fmt.upper()}…", widget)
        action.triggered.connect(lambda _=False, f=fmt: export_with_dialog(widget, f, name))
        actions.append(action)
    menus = _menus(widget)
    if menus:
        for menu in menus:
            menu.addSeparator()
            menu.addActions(actions)
    else:
        widget.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        widget.addActions(actions)
    return actions

