"""What the window remembers between runs (QSettings): geometry, the dock layout, the policy panel's choices and
the last document (saved by the window when a document opens). Tests pass `settings_path` (an INI file) so the
user's own settings are never touched."""
from __future__ import annotations

import json

from PySide6.QtCore import QByteArray

from widgets.policy_panel import POLICIES


def restore_settings(win) -> None:
    """Options first (max_new_tokens), then, unless `restore` is off, the saved layout and panel."""
    if win.options.get("max_new_tokens"):
        win.chat.set_sampling({"max_tokens": int(win.options["max_new_tokens"])})
    if not win.options.get("restore", True):
        return
    geometry, state = win.settings.value("geometry"), win.settings.value("windowState")
    if isinstance(geometry, QByteArray):
        win.restoreGeometry(geometry)
    if isinstance(state, QByteArray):
        win.restoreState(state)
    try:
        panel = json.loads(win.settings.value("policy", "") or "{}")
    except (TypeError, ValueError):
        panel = {}
    if panel:
        win.policy_panel.set_config(panel)
        win.status.set_policy(POLICIES[win.policy_panel.policy()][0])


def save_settings(win) -> None:
    win.settings.setValue("geometry", win.saveGeometry())
    win.settings.setValue("windowState", win.saveState())
    win.settings.setValue("policy", json.dumps(win.policy_panel.config()))
    win.settings.sync()
