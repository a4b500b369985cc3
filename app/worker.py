"""EngineWorker: the one QObject that owns the LLM, living on its own long-lived QThread (DESIGN.md §3).

Requests come in as queued signals (connect the window's signals to `load_model`, `open_document`, `ask`);
results go out as signals. Stop is not a queued request (the worker's event loop is busy while it answers):
`stop()` sets a thread-safe flag that the engine checks after every layer. Telemetry is not one signal per
span either: every finished engine step is appended to a bounded deque, which the window drains on a timer.

The worker lives on an `EngineThread`, not a plain QThread. A plain QThread runs each queued slot under a Python
thread state made for that call and destroyed after it (threading.local values vanish between requests), and
torch >= 2.6 keeps per-thread state that then dangles: on CUDA the app crashed in the first turn (a segfault in
torch.cuda.synchronize or an event record, or "double free or corruption") while the CLI, on Python's own main
thread, ran. EngineThread.run() is Python code that runs the event loop, so the thread keeps one Python thread
state for its whole life.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app import heap
from app.documents import Document, load_document
from app.prompt import document_messages
from app.quest_highlight import token_char_map
from app.record import model_info, turn_stats
from app.telemetry import gui_budget
from engine.errors import KVScopeError


TEXT_EVERY_S = 0.03   # one cross-thread signal per token at GPU speed kept the GUI thread (and the GIL) busy
TIGHT_TEXT_EVERY_S = 0.2   # ... and where the window's CPU is scarce (app.telemetry.gui_budget < 1), text and prefill
#                            progress at most this often (the chat re-renders every 250 ms there anyway): on a
#                            2-core CPU each signal woke the window's threads, which took a core from the engine


def _without_policy(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("policy", "policy_params")}


class EngineThread(QThread):
    """The engine's long-lived thread: one Python thread state from start to finish (see the module docstring)."""

    def run(self) -> None:
        self.exec()


class WorkerBase(QObject):
    """The window's side of a worker: its signals, the telemetry deque, Stop. Subclasses give the slots
    (`load_model`, `open_document`, `new_chat`, `ask`) and `close_engine`. (Slots are not overridden from one
    worker class to another: PySide6 then runs a queued call of the override on the connecting thread, the GUI's.)"""
    model_progress = Signal(float, str)   # loading the model
    model_ready = Signal(dict)            # name, device, dtype, mode, max_model_len, plan, policies, policy, threads
    document_ready = Signal(dict)         # name, path, text, tokens, limit
    prefill_progress = Signal(float, str)
    answer_text = Signal(str)             # a piece of the answer
    answer_done = Signal(dict)            # GenerationStats as a dict
    token_map = Signal(object)            # a question's prompt tokens -> document characters (Quest), or None
    error = Signal(str)                   # a readable message (never a traceback)
    busy = Signal(bool)
    SIGNALS = ("model_progress", "model_ready", "document_ready", "prefill_progress", "answer_text", "answer_done",
               "token_map", "error", "busy")   # the names above (the engine process relays each one)

    def __init__(self, max_steps: int = 2048):
        super().__init__()
        self.llm = None
        self.engine_config: dict = {}
        self.history: list[dict] = []
        self.telemetry: deque = deque(maxlen=max_steps)   # StepTraces, drained by the GUI
        self.turn_steps: list = []                         # the last turn's StepTraces (export)
        self._cancel = threading.Event()
        self.text_every_s = TEXT_EVERY_S                   # the answer's text and the prefill's progress: how often

    # ---------------------------------------------------------------- called from the GUI thread
    def stop(self) -> None:
        """Thread-safe: the running answer (or prefill) stops after the current layer."""
        self._cancel.set()

    def drain(self) -> list:
        """Thread-safe: the engine steps recorded since the last call."""
        out = []
        while self.telemetry:
            out.append(self.telemetry.popleft())
        return out


class EngineWorker(WorkerBase):
    """The worker that owns the LLM: on the window's engine thread, or in the engine process's main thread
    (app/engine_process.py)."""

    def __init__(self, max_steps: int = 2048):
        super().__init__(max_steps)
        self.document: Document | None = None
        self._map_cache: tuple = (None, None, "")          # (prompt key, token map, why none)
        self.watching = True                               # the engine records its steps for the views
        self._live = None                                  # the loaded engine's live recorder (kept while not watching)

    def close_engine(self) -> None:
        """Close the engine (threads joined, pinned memory freed, last disk writes done). Call it once the worker's
        thread has finished, from the thread that owns the window."""
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    # ---------------------------------------------------------------- slots (worker thread)
    @Slot(dict)
    def load_model(self, config: dict) -> None:
        """(Re)build the engine with `config` (LLM keyword arguments, policy included; `model` None = the default
        model). When only the policy or its parameters differ, the loaded engine switches policy instead
        (`LLM.set_policy`: no reload; the chat history stays, the prefix cache goes). A policy the engine does not
        have, or bad parameters, are refused by the engine with a readable message (the `error` signal)."""
        self.busy.emit(True)
        try:
            self._build(config)
        except KVScopeError as e:
            self.error.emit(str(e))
        except Exception as e:  # noqa: BLE001 - shown in the window, never a traceback
            self.error.emit(f"could not load the model: {type(e).__name__}: {e}")
        finally:
            self.busy.emit(False)

    def _build(self, config: dict) -> None:
        from engine.config import check_config
        if self.llm is not None and config == self.engine_config:
            return
        if self.llm is not None and _without_policy(config) == _without_policy(self.engine_config):
            # only the policy changed: switch it on the loaded engine (LLM.set_policy says when the prefix cache
            # stays; a bad parameter raises ConfigError and leaves the engine as it was)
            self.llm.set_policy(config.get("policy", "full"), config.get("policy_params") or {})
            self.engine_config = dict(config)
            self.llm.warm_up(self.model_progress.emit)   # CUDA: its kernels and graphs now, not in the first turn
            heap.freeze()                                # (the new policy's graphs too: app/heap.py)
            self._ready()
            return
        check_config(**config)                    # a wrong folder or setting is refused while the loaded engine runs
        old, previous, self.llm = self.llm, self.engine_config, None
        if old is not None:                       # freed first: two big models may not fit side by side
            heap.thaw()                           # (its objects collectable again: app/heap.py)
            old.close()                           # (its disk tier's writes finish; it lets go of its model and KV)
            del old                               # (no gc.collect() here: a collection on this thread destroys
                                                  # other threads' Qt objects, and PySide can deadlock on that)
        try:
            self._load(config)
        except Exception:
            if previous:                          # bad weights, out of memory: the engine that ran comes back
                history = self.history
                try:
                    self._load(previous)
                    self.history = history
                except Exception:  # noqa: BLE001 - the first error is the one to show
                    self.llm, self.engine_config = None, {}
            raise

    def _load(self, config: dict) -> None:
        from engine import LLM
        from engine.trace import TraceRecorder
        llm = LLM(progress=self.model_progress.emit, **config)
        try:                             # kernels compiled and graphs captured now, not in the user's first turn
            llm.warm_up(self.model_progress.emit)
        except BaseException:
            llm.close()
            raise
        heap.freeze()                    # the engine's objects out of every later full collection (app/heap.py)
        self._live = TraceRecorder.live(llm.device, on_step=self.telemetry.append, mode=llm.config.mode)
        llm.recorder = self._live if self.watching else None
        self.llm, self.engine_config = llm, dict(config)
        self.history, self._map_cache = [], (None, None, "")
        self._ready()
        if self.document is not None:
            self._announce(self.document)

    def _ready(self) -> None:
        info = model_info(self.llm)
        tight = gui_budget(info.get("device", ""), int(info.get("threads", 1)), info.get("mode", "gpu")) < 1
        self.text_every_s = TIGHT_TEXT_EVERY_S if tight else TEXT_EVERY_S
        self.model_ready.emit(info)

    def _progress(self):
        """The prefill's progress callback: a signal at most every `text_every_s` (the first and the last always)."""
        last = [0.0]

        def report(fraction: float, message: str) -> None:
            now = time.monotonic()
            if fraction >= 1.0 or now - last[0] >= self.text_every_s:
                last[0] = now
                self.prefill_progress.emit(fraction, message)
        return report

    @Slot(str)
    def open_document(self, path: str) -> None:
        """Parse and measure a document; one too long for the context is refused and the old one kept."""
        self.busy.emit(True)
        try:
            doc = load_document(Path(path))
            self._announce(doc)
        except KVScopeError as e:
            self.error.emit(str(e))
        except Exception as e:  # noqa: BLE001
            self.error.emit(f"could not open {path}: {type(e).__name__}: {e}")
        finally:
            self.busy.emit(False)

    def _announce(self, doc: Document) -> None:
        tokens = limit = 0
        if self.llm is not None:
            tokens = len(self.llm.chat_prompt_ids(document_messages(doc.text, "", doc.name)))
            limit = min(self.llm.max_model_len, self.llm.kv_capacity_tokens)
            if tokens >= limit:
                raise KVScopeError(f"{doc.name} is {tokens:,} tokens with the prompt around it, but the context "
                                   f"holds {limit:,}: open a shorter document (or a part of it), or a model "
                                   "with a longer context")
        if self.document is None or doc.text != self.document.text:
            self.history = []
        self.document = doc
        self.document_ready.emit({"name": doc.name, "path": str(doc.path), "text": doc.text, "tokens": tokens,
                                  "limit": limit, "encoding": doc.encoding if doc.kind != "pdf" else ""})

    @Slot()
    def new_chat(self) -> None:
        self.history = []

    @Slot(bool)
    def set_watching(self, on: bool) -> None:
        """Record the engine's steps for the live views (on), or record nothing from the next question on: the
        engine then runs as the command line runs it, and the views keep what they last showed."""
        self.watching = bool(on)
        if self.llm is not None:
            self.llm.recorder = self._live if self.watching else None

    @Slot(str, dict, str)
    def ask(self, question: str, sampling: dict, system: str) -> None:
        """Answer `question` about the open document (with the chat so far), streaming the text."""
        from engine import SamplingParams
        self._cancel.clear()
        if self.llm is None or self.document is None:
            self.error.emit("no model or no document yet: wait for the model to load and open a document")
            return
        self.busy.emit(True)
        llm, doc = self.llm, self.document
        messages = document_messages(doc.text, question, doc.name, system or None, self.history)
        answer, stats = [], None
        rec = llm.recorder
        first_step = rec.steps[-1].step + 1 if rec.steps else 0
        unsent, sent_at = 0, 0.0          # text goes to the window at most every TEXT_EVERY_S (GPU: ~700 tok/s)
        mapping = None
        try:
            ids = llm.tokenize_turn(messages)                # once: the token map and the engine both take them
            mapping = self._token_map(llm, messages, ids, doc.text, first_step)
            params = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
            for chunk in llm.stream(messages, params, cancel=self._cancel, progress=self._progress(),
                                    prompt_ids=ids):
                if mapping is not None and mapping.done():      # (sent from this thread, as every signal is)
                    self.token_map.emit(mapping.result())
                    mapping = None
                if chunk.stats is not None:
                    stats = chunk.stats
                elif chunk.text:
                    answer.append(chunk.text)
                    unsent += 1
                    if (now := time.monotonic()) - sent_at >= self.text_every_s:
                        self.answer_text.emit("".join(answer[-unsent:]))
                        unsent, sent_at = 0, now
        except KVScopeError as e:
            self.error.emit(str(e))
        except Exception as e:  # noqa: BLE001
            self.error.emit(f"the engine failed: {type(e).__name__}: {e}")
        finally:
            if unsent:
                self.answer_text.emit("".join(answer[-unsent:]))
            if mapping is not None:                          # the map reaches the window before the turn's end
                self.token_map.emit(mapping.result())
            self.turn_steps = [s for s in list(rec.steps) if s.step >= first_step]
            self.busy.emit(False)
        if stats is not None:
            if stats.finish_reason != "cancelled":
                self.history += [{"role": "user", "content": question}, {"role": "assistant", "content": "".join(answer)}]
            self.answer_done.emit(turn_stats(stats, llm))

    @Slot(str, dict, str)
    def ask_again(self, question: str, sampling: dict, system: str) -> None:
        """The last question again, in place of the last exchange of the history (the second run of a
        comparison: both answers see the same chat before them)."""
        if len(self.history) >= 2 and self.history[-2] == {"role": "user", "content": question}:
            self.history = self.history[:-2]
        self.ask(question, sampling, system)

    def _token_map(self, llm, messages: list[dict], ids: list[int], text: str, first_step: int) -> Future | None:
        """For the highlight of what Quest reads: each prompt token's document characters (app/quest_highlight.py),
        with the turn's first step number, to the window (`token_map`). None when the policy does not select pages
        (nothing to highlight); map None (and why) when the prompt cannot be mapped. Cached for a prompt asked
        again. A new map is made on a thread while the prefill runs (the tokenizer lets go of the GIL; before, a
        long document's map came before the prefill: ~0.5 s at 115K tokens on a 2-core CPU): the window gets the
        turn without a map at once, and `ask` sends the map once the thread has made it (its Future, returned;
        None: nothing to wait for)."""
        if not llm.runner.policy.plans_loads:
            self.token_map.emit(None)
            return None
        key = (id(llm), repr(messages))

        def info() -> dict:
            return {"map": self._map_cache[1], "reason": self._map_cache[2], "text": text, "first_step": first_step}

        def make() -> dict:
            try:
                token_map, why = token_char_map(llm.tokenizer, messages, ids, text)
            except Exception as e:  # noqa: BLE001 - no highlight this turn; the answer itself reports its errors
                token_map, why = None, f"{type(e).__name__}: {e}"
            self._map_cache = (key, token_map, why)
            return info()

        if self._map_cache[0] == key:
            self.token_map.emit(info())
            return None
        self.token_map.emit({"map": None, "reason": "", "text": text, "first_step": first_step})
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvscope-token-map")
        made = pool.submit(make)
        pool.shutdown(wait=False)
        return made
