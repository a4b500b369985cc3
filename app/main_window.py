"""kvscope's main window: chat with a document in the middle, the engine's views in dock widgets around it.

The window owns one `EngineWorker` on one long-lived `EngineThread` (a QThread) (DESIGN.md §3). Requests go to the worker
through the window's own signals, connected queued to the worker's slots, so they run in the order they were
made (a config change reloads the model before the question that follows it). Answers come back as signals;
engine steps are drained by the telemetry pump (app/telemetry.py: ~30 Hz, less often under its GUI budget) and
drawn once per draw. Stop is the worker's thread-safe `stop()`.

    win = MainWindow(config={"settings_path": "/tmp/kvscope.ini", "document": "notes.md",
                             "engine": {"max_model_len": 2048}, "max_new_tokens": 64})

`config` keys (all optional): settings_path (an INI file instead of the user's kvscope settings), engine (extra
LLM keyword arguments under the policy panel's, e.g. model, device, max_model_len), document (opened on start
instead of the last one / the bundled sample), max_new_tokens, restore (window layout from the settings,
default True), autostart (load the model and open the document now, default True), engine_process (the engine in
a process of its own, app/engine_process.py: what `python main.py` runs; default False, the engine on the window's
engine thread, whose `worker.llm` tests can read), recording (a Recording to show instead of an engine:
app/replay.py, which builds such windows).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QSettings, Qt, Signal, Slot
from PySide6.QtWidgets import QDockWidget, QFileDialog, QMainWindow, QWidget

from app import pyside_guard
from app.bundle import window_bundle
from app.menus import build_menus
from app.quest_highlight import QuestHighlight
from app.record import Conversation
from app.requests import Requests
from app.samples import SAMPLE
from app.settings import restore_settings, save_settings
from app.status import StatusBar
from app.telemetry import TIGHT_RENDER_MS, TelemetryPump, gui_budget
from app.views import VIEWS, ViewSpec, build_docks
from app.collector import GuiThreadCollector
from app.engine_process import ProcessWorker
from app.replay import keep_turn, open_dropped_recordings
from app.worker import EngineThread, EngineWorker
from widgets.chat_view import ChatView
from widgets.document_panel import SUPPORTED_SUFFIXES
from widgets.policy_panel import POLICIES

if TYPE_CHECKING:   # the views' classes, for the attributes below
    from widgets.document_panel import DocumentPanel
    from widgets.mask_view import MaskView
    from widgets.metrics_strip import MetricsStrip
    from widgets.policy_panel import PolicyPanel
    from widgets.quest_view import QuestView
    from widgets.ring_view import RingView
    from widgets.timeline_view import TimelineView

pyside_guard.install()   # PySide6 drops references to True and None (app/pyside_guard.py): given back at every pump tick

CLOSE_WAIT_MS = 30000   # closing waits this long for the worker (a model load cannot be interrupted)


def engine_kwargs(panel_config: dict, overrides: dict | None = None) -> dict:
    """The LLM keyword arguments the worker gets (and keeps as `engine_config`) for a policy panel config."""
    return {**(overrides or {}), **panel_config}


class MainWindow(QMainWindow):
    """The app window. Public for tests and tools: `chat`, one attribute per view of the registry (app/views.py:
    `document_panel`, `policy_panel`, `metrics`, `timeline`, `ring`, `quest`, `masks`), `views` (name -> widget),
    `docks` (name -> QDockWidget), `view_specs` (the registry it was built from), `status` (StatusBar), `worker`,
    `thread`, `quest_highlight` (what Quest reads, tinted in the document) and its View menu toggle
    `highlight_action`, `model_info` (the latest model_ready dict), `is_busy()`, `send(question)`, `stop()`,
    `export_bundle(folder)`, `shutdown()`.

    The `views=` argument is the registry to build the docks from (default `app.views.VIEWS`; tests add to it)."""

    # set by build_docks from the registry (declared here for readers and type checkers)
    views: dict[str, QWidget]
    docks: dict[str, QDockWidget]
    document_panel: DocumentPanel
    policy_panel: PolicyPanel
    metrics: MetricsStrip
    timeline: TimelineView
    ring: RingView
    quest: QuestView
    masks: MaskView

    request_load = Signal(dict)
    request_open = Signal(str)
    request_ask = Signal(str, dict, str)
    request_ask_again = Signal(str, dict, str)
    request_new_chat = Signal()
    request_watch = Signal(bool)

    def __init__(self, config: dict | None = None, parent: QWidget | None = None, *,
                 views: Sequence[ViewSpec] = VIEWS):
        super().__init__(parent)
        self.view_specs = tuple(views)
        self.options = dict(config or {})
        self.engine_overrides = {"kv_store": "default", **(self.options.get("engine") or {})}   # disk KV tier on
        path = self.options.get("settings_path")
        self.settings = (QSettings(str(path), QSettings.Format.IniFormat) if path
                         else QSettings("kvscope", "kvscope"))
        self.model_info: dict = {}
        self.document_info: dict = {}
        self.conversation = Conversation()    # the finished turns with their steps (File → Save recording)
        self.compare_with: int | None = None   # the turn an "ask again" answer is compared with when it ends
        self.requests = Requests()            # sent to the worker and not finished (app/requests.py)
        self._closed = False
        self.setWindowTitle("kvscope")
        self.resize(1400, 900)
        self._build_views()
        build_menus(self)
        self._default_state = self.saveState()
        self.collector = GuiThreadCollector(self, not self.options.get("engine_process"))   # before the engine starts
        self._start_worker()
        traced = tuple(self.views[spec.name] for spec in self.view_specs if spec.telemetry)
        self.telemetry = TelemetryPump(self.worker.drain, traced, self._draw_steps, self.metrics.clear, parent=self)
        self.telemetry.timer.timeout.connect(pyside_guard.top_up)   # PySide6's lost references back (Python 3.11)
        self.telemetry.start()
        restore_settings(self)
        if self.options.get("autostart", True):
            self._request("load", self.request_load, self._engine_config())
            self._request("open", self.request_open, str(self._initial_document()))

    # ------------------------------------------------------------------ building
    def _build_views(self) -> None:
        self.chat = ChatView()
        self.setCentralWidget(self.chat)
        build_docks(self, self.view_specs)   # sets views, docks and one attribute per view
        self.quest_highlight = QuestHighlight(self.document_panel)   # the document spans Quest reads
        self.status = StatusBar()
        self.setStatusBar(self.status)
        self.status.set_policy(POLICIES[self.policy_panel.policy()][0])
        self.setAcceptDrops(True)

        self.chat.send_requested.connect(self.send)
        self.chat.stop_requested.connect(self.stop)
        self.document_panel.open_requested.connect(self.open_document_dialog)
        self.document_panel.file_dropped.connect(self.open_document)
        self.policy_panel.config_changed.connect(lambda cfg: self.status.set_policy(POLICIES[cfg["policy"]][0]))
        self.policy_panel.model_folder_chosen.connect(self._on_model_folder)
        self.quest.slider.valueChanged.connect(lambda *_: self.quest_highlight.show_step(self.quest.current_step()))

    def _start_worker(self) -> None:
        self.thread = EngineThread(self)
        self.thread.setObjectName("kvscope-engine")
        if self.options.get("recording") is not None:                 # a recording's window: no engine
            from app.replay import ReplayWorker
            self.worker = ReplayWorker(self.options["recording"])
        else:
            self.worker = ProcessWorker() if self.options.get("engine_process") else EngineWorker()
        self.worker.moveToThread(self.thread)
        queued = Qt.ConnectionType.QueuedConnection
        self.request_load.connect(self.worker.load_model, queued)
        self.request_open.connect(self.worker.open_document, queued)
        self.request_ask.connect(self.worker.ask, queued)
        self.request_ask_again.connect(self.worker.ask_again, queued)
        self.request_new_chat.connect(self.worker.new_chat, queued)
        self.request_watch.connect(self.worker.set_watching, queued)
        w = self.worker
        w.model_progress.connect(self._on_model_progress)
        w.model_ready.connect(self._on_model_ready)
        w.document_ready.connect(self._on_document_ready)
        w.prefill_progress.connect(self._on_prefill_progress)
        w.answer_text.connect(self._on_answer_text)
        w.answer_done.connect(self._on_answer_done)
        w.error.connect(self._on_error)
        w.token_map.connect(self._on_token_map)
        w.busy.connect(self._on_busy)
        self.thread.start()

    # ------------------------------------------------------------------ settings
    def _initial_document(self) -> Path:
        if self.options.get("document"):
            return Path(self.options["document"])
        last = self.settings.value("document", "")
        return Path(last) if last and Path(last).is_file() else SAMPLE

    def reset_layout(self) -> None:
        """Every dock back where it started, and shown."""
        self.restoreState(self._default_state)
        for dock in self.docks.values():
            dock.show()

    # ------------------------------------------------------------------ requests
    def _engine_config(self) -> dict:
        return engine_kwargs(self.policy_panel.config(), self.engine_overrides)

    def _request(self, kind: str, signal, *args) -> None:
        self.requests.add(kind)
        signal.emit(*args)

    def _ask(self, signal, question: str) -> None:
        """`question` to the worker through `signal`, a changed engine config's reload first; the answer begins."""
        config = self._engine_config()
        if config != self.worker.engine_config:
            self._request("load", self.request_load, config)
        self._request("ask", signal, question, self.chat.sampling(), self.chat.system_prompt())
        self.chat.begin_answer()

    @Slot(str)
    def send(self, question: str) -> None:
        """Ask `question` (ChatView has shown it already); a changed engine config reloads the model first."""
        self._ask(self.request_ask, question)

    def ask_again(self) -> bool:
        """The last question again with the panel's settings now (the model reloads or the policy switches
        first), in place of the last turn in the engine's chat; when it has finished, a window compares the two
        turns (app/compare_window.py). False when there is no finished turn or a request runs."""
        if self.is_busy() or not self.conversation.turns or self.options.get("recording") is not None:
            return False
        question = self.conversation.turns[-1]["question"]
        self.compare_with = len(self.conversation.turns) - 1
        self.chat.add_user_message(question)
        self._ask(self.request_ask_again, question)
        return True

    @Slot()
    def stop(self) -> None:
        """Stop the streaming answer within one layer (or, if it has not begun yet, as soon as it does)."""
        self.worker.stop()
        self.requests.stop_pressed()

    def open_document(self, path: str) -> None:
        self._request("open", self.request_open, str(path))

    def open_document_dialog(self) -> None:
        start = self.document_info.get("path") or str(Path.home())
        patterns = " ".join(f"*{s}" for s in SUPPORTED_SUFFIXES)
        path, _ = QFileDialog.getOpenFileName(self, "Open a document", start, f"Documents ({patterns});;All files (*)")
        if path:
            self.open_document(path)

    def set_watching(self, on: bool) -> None:
        """View → Watch the engine: the engine records its steps for the views (on), or records nothing from the
        next question on, running as the command line runs it (to time it unwatched); the views keep what they
        showed."""
        self.status.set_watching(on)
        self.request_watch.emit(bool(on))   # queued after any pending request: applies from the next question

    def new_chat(self) -> None:
        if self.chat.is_streaming():
            return
        self.chat.new_chat()
        self.conversation.clear()
        self.request_new_chat.emit()      # no busy/finish signals follow: not tracked in requests

    def _on_model_folder(self, folder: str) -> None:
        self.engine_overrides["model"] = folder
        self.policy_panel.set_model_label(Path(folder).name)
        self._request("load", self.request_load, self._engine_config())

    def is_busy(self) -> bool:
        """Whether any request is queued or running in the worker."""
        return bool(self.requests)

    # ------------------------------------------------------------------ worker signals
    @Slot(bool)
    def _on_busy(self, busy: bool) -> None:
        if busy:
            if self.watch_action.isChecked():
                self.telemetry.wake()         # its steps drawn at the working rate (unwatched, none come)
            if self.requests.begin():         # a question Stop was pressed for before it began
                self.worker.stop()
            self.policy_panel.set_busy(self.requests.head == "ask")
        else:
            self.requests.finish()
            self.telemetry.flush()            # the request's last steps, drawn now
            self.policy_panel.set_busy(False)
            self.status.hide_progress()

    @Slot(float, str)
    def _on_model_progress(self, fraction: float, message: str) -> None:
        self.policy_panel.set_load_progress(fraction, message)
        self.status.show_progress("model", fraction, message)

    @Slot(dict)
    def _on_model_ready(self, info: dict) -> None:
        self.model_info = dict(info)
        budget = gui_budget(info.get("device", ""), int(info.get("threads", 1)), info.get("mode", "gpu"))
        self.telemetry.set_budget(budget)         # the views, and the streaming answer's re-render, yield the CPU
        self.chat.set_min_render_ms(TIGHT_RENDER_MS if budget < 1 else ChatView.MIN_RENDER_MS)
        self.status.set_model(info)
        self.ring.set_mode(info.get("mode"))
        if info.get("policy") in POLICIES:                  # what the engine runs (the panel may be ahead of it)
            self.status.set_policy(POLICIES[info["policy"]][0])
        self.policy_panel.set_engine_policies(info.get("policies") or ["full"])
        self.policy_panel.set_model_label(info.get("name", ""))
        self.policy_panel.set_load_progress(1.0, info.get("plan") or f"{info.get('name')} on {info.get('device')}")
        self._show_context(self.document_panel.token_count())

    @Slot(dict)
    def _on_document_ready(self, info: dict) -> None:
        if info.get("text") != self.document_info.get("text"):
            self.conversation.clear()                 # a recording holds one document's conversation
        self.document_info = dict(info)
        self.document_panel.set_document(info["name"], info["text"], info["tokens"], info.get("encoding", ""))
        self.quest_highlight.clear()
        self._show_context(info["tokens"])
        self.settings.setValue("document", info["path"])
        self.setWindowTitle(f"{info['name']} — kvscope")

    def _show_context(self, used: int) -> None:
        if self.document_info.get("limit"):
            self.document_panel.set_context(used, self.document_info["limit"], self.model_info.get("mode", ""))

    @Slot(object)
    def _on_token_map(self, info) -> None:
        self.quest_highlight.new_turn(info)      # a new question: highlight its Quest picks (clear without)
        self.conversation.begin_turn(info)

    @Slot(float, str)
    def _on_prefill_progress(self, fraction: float, message: str) -> None:
        self.status.show_progress("prefill", fraction, message)

    @Slot(str)
    def _on_answer_text(self, text: str) -> None:
        self.status.hide_progress()
        self.chat.append_text(text)

    @Slot(dict)
    def _on_answer_done(self, stats: dict) -> None:
        self.chat.end_answer(stats)
        if self.options.get("recording") is None:
            keep_turn(self, stats)                        # for File → Save recording, and "ask again"
        figures, phase = stats.get("policy_stats") or {}, stats.get("policy_phase")
        dense = figures.get("reason") if figures.get("sparse") is False else None
        self.quest.set_dense_reason(dense if phase == "decode" else None)
        self.masks.set_dense_reasons((dense or figures.get("dense_layers")) if phase == "prefill" else None)
        self.metrics.set_stats(stats)
        self._show_context(int(stats.get("prompt_tokens", 0)) + int(stats.get("completion_tokens", 0)))

    @Slot(str)
    def _on_error(self, message: str) -> None:
        head = self.requests.head or "ask"
        if head == "ask" and not self.requests.started:   # refused before it began: no busy signals follow
            self.requests.finish()
        if head == "open":
            self.document_panel.show_error(message)
        else:
            self.chat.show_error(message)
        if head == "load":             # the engine that was loaded still runs: the model picker goes back to it
            self.policy_panel.set_load_progress(1.0, message)
            loaded = self.worker.engine_config.get("model", self.engine_overrides.get("model"))
            if loaded is None:
                self.engine_overrides.pop("model", None)
            else:
                self.engine_overrides["model"] = loaded
            self.policy_panel.set_model_label(self.model_info.get("name", ""))
        self.status.showMessage(message, 10000)

    # ------------------------------------------------------------------ telemetry
    def _draw_steps(self, steps: list, recent) -> None:
        """The rest of a telemetry tick (the pump fed the trace views): the highlight, metrics and memory."""
        self.quest_highlight.feed(steps)
        self.metrics.update_from_steps(recent)
        offload = self.model_info.get("mode", "gpu") != "gpu"
        cuda = str(self.model_info.get("device", "cpu")).startswith("cuda")
        for step in reversed(steps):   # the engine reads GPU memory in detailed steps only (engine/llm.py)
            if step.metrics and (not cuda or "gpu_mem_allocated" in step.metrics):
                self.status.set_memory(step.metrics, offload)
                break

    # ------------------------------------------------------------------ export
    def describe(self) -> dict:
        """What the session runs: the panel's config, the engine's, the model, the document and the sampling."""
        doc = {k: v for k, v in self.document_info.items() if k != "text"}
        return {"panel": self.policy_panel.config(), "engine": dict(self.worker.engine_config),
                "model": dict(self.model_info), "document": doc, "sampling": self.chat.sampling(),
                "system_prompt": self.chat.system_prompt()}

    def export_bundle(self, folder: Path) -> Path:
        """app/bundle.py's `window_bundle`: PNGs, the last turn's trace, the chat and the config into `folder` (a new
        subfolder when it is not empty); ExportError first when it cannot be written."""
        return window_bundle(self, folder)

    # ------------------------------------------------------------------ drops, closing
    def dragEnterEvent(self, event) -> None:
        self.document_panel.dragEnterEvent(event)

    def dropEvent(self, event) -> None:
        if not open_dropped_recordings(self, event):      # a recording opens in a window of its own
            self.document_panel.dropEvent(event)

    def shutdown(self, timeout_ms: int = CLOSE_WAIT_MS) -> bool:
        """Stop any answer, end the worker's thread and wait for it (bounded); True when the thread finished."""
        self.telemetry.stop()
        pyside_guard.top_up()
        self.worker.stop()
        self.thread.quit()                    # requests still queued are dropped
        finished = self.thread.wait(timeout_ms)
        if finished:
            self.worker.close_engine()        # nothing runs on the engine any more: join its threads
            self.collector.stop()
        return finished

    def closeEvent(self, event) -> None:
        if not self._closed:
            self._closed = True
            save_settings(self)
            if not self.shutdown():
                print("kvscope: the engine thread did not stop in time", file=sys.stderr)
        super().closeEvent(event)
