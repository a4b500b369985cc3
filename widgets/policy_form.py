"""The sparse policies' parameters as a form: one page per PolicySpec (engine.sparse.specs), one editor per
parameter shown in the panel, with the spec's range, default and help.

A pure view: `values(policy)` reads a page, `set_values(policy, values)` shows values on it, `changed()` fires
when the user edits any of them. The policy panel (widgets/policy_panel.py) shows the chosen policy's page.
"""
from __future__ import annotations

import math
from decimal import Decimal

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QLabel, QSpinBox, QStackedWidget,
                               QWidget)

from engine.sparse.specs import SPECS, Param   # torch-free: what each policy takes

INT_LIMIT = 2**31 - 1          # QSpinBox holds 32-bit ints
FLOAT_LIMIT = 1e12


def spin_box(lo: int, hi: int, value: int, step: int = 1, tip: str = "", suffix: str = "") -> QSpinBox:
    box = QSpinBox(minimum=lo, maximum=hi, value=value, singleStep=step, suffix=suffix)
    box.setToolTip(tip)
    return box


def combo_box(values: list[int], value: int, tip: str) -> QComboBox:
    box = QComboBox()
    for v in values:
        box.addItem(str(v), v)
    box.setCurrentIndex(values.index(value))
    box.setToolTip(tip)
    return box


def _decimals(param: Param) -> int:
    """Decimals of a float parameter's spin box: those of its step (2 for 0.05, 0 for 100), and at least 2 where
    values below 1 are allowed (e.g. MInference's vertical lines as a fraction of the prompt, 0.1)."""
    exponent = Decimal(repr(float(param.step))).normalize().as_tuple().exponent
    decimals = max(0, -int(exponent))
    if param.min is None or param.min < 1:
        decimals = max(decimals, 2)
    return min(decimals, 6)


def param_tooltip(param: Param) -> str:
    """A parameter's help, with its range and default."""
    text = param.help[:1].upper() + param.help[1:]
    if param.type is bool:
        return f"{text}\n\nDefault: {'on' if param.default else 'off'}."
    return f"{text}\n\nRange: {param.describe_range()}. Default: {param.default}."


def param_label(param: Param) -> str:
    return param.label or param.name.replace("_", " ").capitalize()


def param_widget(param: Param) -> QWidget:
    """The editor of one parameter: a combo box (choices), a check box (bool), or a spin box whose range is the
    parameter's (an open minimum becomes the smallest step above it), set to its default."""
    tip = param_tooltip(param)
    if param.choices:
        box = combo_box(list(param.choices), param.default, tip)
    elif param.type is bool:
        box = QCheckBox()
        box.setChecked(bool(param.default))
        box.setToolTip(tip)
    elif param.type is int:
        lo = -INT_LIMIT if param.min is None else math.floor(param.min) + 1 if param.min_open else math.ceil(param.min)
        hi = INT_LIMIT if param.max is None else min(INT_LIMIT, math.floor(param.max))
        box = spin_box(max(lo, -INT_LIMIT), hi, int(param.default), max(1, int(param.step)), tip)
        if param.special:
            box.setSpecialValueText(param.special)     # shown at the minimum (e.g. 0 = auto)
    else:
        decimals = _decimals(param)
        lo = -FLOAT_LIMIT if param.min is None else param.min + (10.0 ** -decimals if param.min_open else 0)
        hi = FLOAT_LIMIT if param.max is None else param.max
        box = QDoubleSpinBox()
        box.setDecimals(decimals)
        box.setRange(lo, hi)
        box.setSingleStep(param.step)
        box.setValue(float(param.default))
        box.setToolTip(tip)
    return box


def widget_value(w: QWidget):
    if isinstance(w, QComboBox):
        return w.currentData()
    if isinstance(w, QCheckBox):
        return w.isChecked()
    return w.value()


def set_widget_value(w: QWidget, value) -> None:
    """Show `value`; a spin box clamps it to its range, a combo box keeps its choice when `value` is not one."""
    if isinstance(w, QComboBox):
        index = w.findData(value)
        if index >= 0:
            w.setCurrentIndex(index)
    elif isinstance(w, QCheckBox):
        w.setChecked(bool(value))
    elif isinstance(w, QSpinBox):
        w.setValue(int(round(max(-INT_LIMIT, min(INT_LIMIT, float(value))))))
    else:
        w.setValue(float(value))


def _changed_signal(w: QWidget):
    if isinstance(w, QComboBox):
        return w.currentIndexChanged
    if isinstance(w, QCheckBox):
        return w.toggled
    return w.valueChanged


class PolicyForm(QStackedWidget):
    """One page per policy of engine.sparse.SPECS, in its order, holding the editors of its shown parameters
    (`Param.panel`; the others stay command line / library only)."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.editors: dict[str, dict[str, QWidget]] = {}     # policy -> shown parameter -> its editor
        for key, spec in SPECS.items():
            page = QWidget()
            page_form = QFormLayout(page)
            page_form.setContentsMargins(0, 0, 0, 0)
            shown = [p for p in spec.params if p.panel]
            self.editors[key] = {}
            if not spec.params:
                page_form.addRow(QLabel("No parameters: every token is attended to."))
            elif not shown:
                page_form.addRow(QLabel("No parameters to set here (the command line has them)."))
            for param in shown:
                w = self.editors[key][param.name] = param_widget(param)
                label = QLabel(param_label(param))
                label.setToolTip(w.toolTip())
                page_form.addRow(label, w)
                _changed_signal(w).connect(self._on_edited)
            self.addWidget(page)

    def _on_edited(self, *_) -> None:
        self.changed.emit()

    def values(self, policy: str) -> dict:
        """The values of `policy`'s shown parameters."""
        return {name: widget_value(w) for name, w in self.editors[policy].items()}

    def set_values(self, policy: str, values: dict) -> None:
        """Show `values` on `policy`'s page; names it does not show are ignored (they keep the engine's default)."""
        editors = self.editors[policy]
        for name, value in values.items():
            if name in editors:
                set_widget_value(editors[name], value)
