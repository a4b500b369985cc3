"""Recordings in the window: File → Save recording, File → Open recording, and the window that shows one.

A recording (engine/trace/recording.py) opens in a window of its own: `open_recording_window` from a window,
app/gui.py's `replay_window` from the command line. It is built like the live one from the same views, with no model
and no torch: a `ReplayWorker` answers for the engine. The chat, the document, the views (scrub steps, hover,
Quest's pages highlighted in the document) show the recorded turns as after a live turn; the status bar says where
and when it was recorded; the chat and the policy panel are read-only. The live window that opened it keeps
everything it had.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Slot

from app.compare_window import compare_turns, keep_open
from app.worker import WorkerBase
from engine.paths import output_file_problem
from engine.trace.recording import SUFFIX, Recording, RecordingError, load_recording, save_recording
from widgets.export import show_export_error

READ_ONLY = "A recording: read-only. Open the app without it to chat."


class ReplayWorker(WorkerBase):
    """The worker of a recording's window: no engine; the recorded engine config and last turn's steps."""

    def __init__(self, rec: Recording):
        super().__init__()
        last = rec.turns[-1] if rec.turns else {}
        self.engine_config = dict(last.get("engine") or (rec.meta.get("app") or {}).get("engine") or {})
        self.turn_steps = rec.turn_steps(len(rec.turns) - 1) if rec.turns else list(rec.steps)

    @Slot(dict)
    def load_model(self, config: dict) -> None:
        pass

    @Slot(str)
    def open_document(self, path: str) -> None:
        pass

    @Slot()
    def new_chat(self) -> None:
        pass

    @Slot(bool)
    def set_watching(self, on: bool) -> None:
        pass

    @Slot(str, dict, str)
    def ask(self, question: str, sampling: dict, system: str) -> None:
        self.error.emit(READ_ONLY)

    @Slot(str, dict, str)
    def ask_again(self, question: str, sampling: dict, system: str) -> None:
        self.error.emit(READ_ONLY)

    def close_engine(self) -> None:
        pass


def where_recorded(rec: Recording) -> str:
    """"recording: FILE · made on HOST (DEVICE) at TIME"."""
    m = rec.meta
    device = m.get("device") or ((m.get("app") or {}).get("model") or {}).get("device", "?")
    when = str(m.get("created", "?")).replace("T", " ").removesuffix("Z")
    return f"recording: {Path(m.get('source', '')).name} · made on {m.get('host', '?')} ({device}) at {when} UTC"


def show_recording(win, rec: Recording) -> None:
    """Fill `win` (a MainWindow built with a ReplayWorker) with the recording: chat, document, views, status."""
    app = rec.meta.get("app") or {}
    model = dict(app.get("model") or {})
    if model:
        win._on_model_ready(model)
    doc = dict(app.get("document") or {})
    doc.setdefault("limit", model.get("max_model_len", 0))
    win.document_info = {**doc, "text": rec.document}
    win.document_panel.set_document(doc.get("name") or "document", rec.document, int(doc.get("tokens") or 0),
                                    doc.get("encoding", ""))
    engine = win.worker.engine_config
    win.policy_panel.set_config({k: v for k, v in engine.items() if k in ("mode", "policy", "policy_params",
                                                                           "kv_block_size", "ring_slots")})
    win.policy_panel.setEnabled(False)
    win.chat.set_sampling(app.get("sampling") or {})
    win.chat.set_system_prompt(app.get("system_prompt") or "")
    for turn in rec.turns:
        win.chat.add_user_message(turn.get("question", ""))
        win.chat.begin_answer()
        win.chat.append_text(turn.get("answer", ""))
        win._on_answer_done(dict(turn.get("stats") or {}))
    for spec in win.view_specs:
        if spec.telemetry:                    # every view of the registry the pump feeds has set_steps (it fits)
            win.views[spec.name].set_steps(list(rec.steps))
    win.metrics.update_from_steps(rec.steps[-64:])
    win.conversation.turns = [{**t, "steps": rec.turn_steps(i)} for i, t in enumerate(rec.turns)]   # save, compare
    if rec.turns and rec.turns[-1].get("token_map") is not None:
        last = rec.turns[-1]
        win.quest_highlight.new_turn({"map": last["token_map"], "reason": last.get("token_map_reason", ""),
                                      "text": rec.document, "first_step": last["first_step"]})
        win.quest_highlight.feed(win.worker.turn_steps)
    if any(s.quest for s in rec.steps):                 # the view with something to show, in front of its tab group
        win.docks["quest"].raise_()
    elif any(s.masks for s in rec.steps):
        win.docks["masks"].raise_()
    for w in (win.chat.input, win.chat.send_button, win.document_panel.open_button):
        w.setEnabled(False)
    win.chat.input.setPlaceholderText(READ_ONLY)
    win.status.set_recording(where_recorded(rec))
    win.setWindowTitle(f"{doc.get('name') or 'recording'} — {Path(rec.meta.get('source', '')).name} — kvscope")


def open_recording_window(parent, path: str | Path):
    """File → Open recording (or a dropped .kvscope file): a new window with it, shown; None and one message when
    the file is not a recording (the window that asked keeps everything)."""
    try:
        rec = load_recording(path)
    except RecordingError as e:
        show_export_error(parent, str(e), "Cannot open the recording")
        return None
    win = type(parent)({"settings_path": parent.options.get("settings_path"), "recording": rec, "autostart": False})
    show_recording(win, rec)
    win.show()
    keep_open(parent, win)
    return win


def open_dropped_recordings(win, event) -> bool:
    """The `.kvscope` files of a drop on `win`, each in a window of its own; False when the drop has none."""
    paths = [u.toLocalFile() for u in event.mimeData().urls() if u.toLocalFile().endswith(SUFFIX)]
    for path in paths:
        open_recording_window(win, path)
    if paths:
        event.acceptProposedAction()
    return bool(paths)


def keep_turn(win, stats: dict) -> None:
    """A finished turn of the live window into its conversation (its question, answer, stats, engine config and
    steps); the second run of File → Ask again and compare then opens the comparison with the first."""
    messages = win.chat.messages()
    question = next((m["text"] for m in reversed(messages) if m["role"] == "user"), "")
    win.conversation.end_turn(question, messages[-1]["text"], stats, win.worker.engine_config,
                              list(win.worker.turn_steps))
    if win.compare_with is not None:
        compare_turns(win, win.compare_with, len(win.conversation.turns) - 1)
        win.compare_with = None


def open_recording_dialog(win) -> None:
    from PySide6.QtWidgets import QFileDialog
    path, _ = QFileDialog.getOpenFileName(win, "Open a recording", str(Path.home()),
                                          f"kvscope recordings (*{SUFFIX});;All files (*)")
    if path:
        open_recording_window(win, path)


def save_window_recording(win, path: Path) -> Path | None:
    """File → Save recording: the conversation so far (every finished turn) to `path`; one message when there is
    nothing to save yet or the file cannot be written, and the window keeps everything."""
    if not win.conversation.turns:
        show_export_error(win, "Nothing to record yet: ask a question first (a recording keeps the finished turns)",
                          "Nothing to save")
        return None
    if (problem := output_file_problem(path, f"run{SUFFIX}")) is not None:
        show_export_error(win, f"Cannot save the recording to {path}: {problem}")
        return None
    meta = {"origin": "app", "device": win.model_info.get("device", ""), "app": win.describe()}
    try:
        out = save_recording(win.conversation.recording(win.document_info.get("text", ""), meta), path)
    except OSError as e:
        show_export_error(win, f"Cannot save the recording to {path}: {e.strerror or e}")
        return None
    win.status.showMessage(f"recording saved to {out} ({out.stat().st_size / 2**20:,.1f} MiB)", 8000)
    return out


def save_recording_dialog(win) -> None:
    from PySide6.QtWidgets import QFileDialog
    path, _ = QFileDialog.getSaveFileName(win, "Save recording", str(Path.home() / f"run{SUFFIX}"),
                                          f"kvscope recordings (*{SUFFIX})")
    if path:
        save_window_recording(win, Path(path if path.endswith(SUFFIX) else path + SUFFIX))
