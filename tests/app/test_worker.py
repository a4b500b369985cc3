"""The engine worker on the real engine (the default model, CPU), driven directly on the test's thread: a policy
change switches the loaded engine's policy instead of rebuilding it, and a bad parameter reaches the user."""
import gc
import threading
import weakref

import pytest
import shiboken6
from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from app.worker import EngineThread, EngineWorker
from engine.trace.events import PREFILL

DOC = ("The harbour office keeps a log of every ship that enters the port. " * 40).strip()
MI_PARAMS = {"min_len": 256, "vertical": 96, "slash": 192, "block": 64, "cpu_dense_above": 1.0}


class Signals:
    def __init__(self, worker: EngineWorker):
        self.errors, self.ready, self.answers = [], [], []
        worker.error.connect(self.errors.append)
        worker.model_ready.connect(self.ready.append)
        worker.answer_done.connect(self.answers.append)


@pytest.fixture(scope="module")
def worker(qapp, default_model_dir, tmp_path_factory):
    w = EngineWorker()
    w.signals = Signals(w)
    w.load_model({"model": str(default_model_dir), "device": "cpu", "max_model_len": 2048, "mode": "gpu",
                  "kv_block_size": 64, "policy": "full", "policy_params": {}})
    doc = tmp_path_factory.mktemp("doc") / "log.md"
    doc.write_text(DOC)
    w.open_document(str(doc))
    assert w.llm is not None and w.signals.errors == []
    return w


def _ask(worker) -> list:
    n = len(worker.signals.answers)
    worker.ask("Who keeps the log?", {"max_tokens": 2}, "")
    assert len(worker.signals.answers) == n + 1 and worker.signals.errors == []
    return worker.turn_steps


def test_a_policy_change_switches_the_loaded_engine(worker):
    llm, ready = worker.llm, len(worker.signals.ready)
    assert not any(s.masks for s in _ask(worker))                    # full: dense prefill
    config = {**worker.engine_config, "policy": "minference", "policy_params": MI_PARAMS}
    worker.load_model(config)
    assert worker.llm is llm and worker.engine_config == config and worker.signals.errors == []
    assert llm.config.policy == "minference" and llm.config.policy_params == MI_PARAMS
    assert len(worker.signals.ready) == ready + 1 and worker.signals.ready[-1]["policy"] == "minference"
    assert worker.history                                            # the chat goes on
    prefill = [s for s in _ask(worker) if s.phase == PREFILL]
    assert prefill and prefill[0].masks and prefill[0].n_tokens > 256  # the prefix cache was dropped: all new
    assert {m.layer for m in prefill[0].masks} == set(range(30))
    worker.load_model({**config, "policy": "full", "policy_params": {}})
    assert worker.llm is llm and not any(s.masks for s in _ask(worker))


def test_a_bad_policy_parameter_reaches_the_user_and_keeps_the_engine(worker):
    llm, config = worker.llm, dict(worker.engine_config)
    worker.load_model({**config, "policy": "xattention", "policy_params": {"stride": 7}})
    assert worker.llm is llm and worker.engine_config == config
    assert len(worker.signals.errors) == 1
    assert "xattention" in worker.signals.errors[0] and "stride" in worker.signals.errors[0]
    worker.load_model({**config, "policy": "quest", "policy_params": {}})     # Quest cannot run in gpu mode
    assert "layerwise" in worker.signals.errors[-1] and worker.engine_config == config
    # with another engine setting too (a rebuild): refused from the spec before the loaded engine is let go
    worker.load_model({**config, "kv_block_size": 128, "policy": "minference", "policy_params": {"vertical": -1}})
    assert worker.llm is llm and worker.engine_config == config
    assert worker.signals.errors[-1] == "minference vertical must be in (0, 4194304] (got -1)"
    worker.signals.errors.clear()


def test_another_engine_setting_rebuilds_the_engine(worker):
    llm = worker.llm
    assert gc.get_freeze_count() > 0 and not any(o is llm for o in gc.get_objects())   # loaded: out of collections
    old = weakref.ref(llm)
    del llm
    config = {**worker.engine_config, "kv_block_size": 128, "policy": "xattention",
              "policy_params": {"min_len": 256, "threshold": 0.8, "cpu_dense_above": 1.0}}
    worker.load_model(config)
    assert worker.signals.errors == [] and worker.llm is not old() and worker.engine_config == config
    gc.collect()
    assert old() is None                               # the engine let go is freed, cycles and all (app/heap.py)
    assert worker.llm.config.kv_block_size == 128 and worker.llm.config.policy == "xattention"
    prefill = [s for s in _ask(worker) if s.phase == PREFILL]
    assert prefill[0].masks and prefill[0].masks[0].image is not None


def test_weights_that_fail_to_load_bring_the_previous_engine_back(worker, tmp_path, default_model_dir):
    """A folder that passes the cheap checks but whose weights are corrupt: the error is shown and the engine that
    ran before is loaded again (with its chat), so the next question still has a model."""
    for f in default_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\x00" * 64)
    before, history = dict(worker.engine_config), list(worker.history)
    worker.load_model({**before, "model": str(tmp_path)})
    assert len(worker.signals.errors) == 1 and "corrupt" in worker.signals.errors[0]
    assert "model.safetensors" in worker.signals.errors[0]
    assert worker.llm is not None and worker.engine_config == before and worker.history == history
    worker.signals.errors.clear()
    _ask(worker)


class _Probe(QObject):
    """Records, per queued request, what a thread-local held when it came in (then sets it)."""
    seen = Signal(object)

    def __init__(self):
        super().__init__()
        self.tls = threading.local()

    @Slot(int)
    def probe(self, i: int) -> None:
        self.seen.emit(getattr(self.tls, "last", None))
        self.tls.last = i


class _Sender(QObject):
    go = Signal(int)


@pytest.mark.parametrize("thread_class, keeps", [(EngineThread, True), (QThread, False)])
def test_the_engine_thread_keeps_one_python_thread_state(qtbot, thread_class, keeps):
    """The engine's thread keeps its Python thread state between requests. A plain QThread makes one per queued
    call and drops it after (thread-locals vanish); torch >= 2.6 keeps per-thread state that then dangles, and on
    CUDA the app crashed in its first turn. The window runs its worker on an EngineThread."""
    thread, probe, sender = thread_class(), _Probe(), _Sender()
    probe.moveToThread(thread)
    sender.go.connect(probe.probe, Qt.ConnectionType.QueuedConnection)
    seen = []
    probe.seen.connect(seen.append)
    thread.start()
    try:
        for i in range(3):
            sender.go.emit(i)
        qtbot.waitUntil(lambda: len(seen) == 3, timeout=5000)
    finally:
        thread.quit()
        thread.wait()
        for obj in (probe, sender, thread):   # deleted here, not by a later garbage collection on another thread
            shiboken6.delete(obj)
    assert seen == ([None, 0, 1] if keeps else [None, None, None])


def test_streamed_text_is_batched_at_speed_and_nothing_is_lost(worker, monkeypatch):
    """At GPU speed a signal per token kept the GUI thread busy: text goes out at most every `text_every_s`, and the
    pieces still add up to the whole answer (the last piece is sent before the turn ends). The prefill's progress
    goes out as seldom: its first report and its end always."""
    pieces, progress = [], []
    worker.answer_text.connect(pieces.append)
    worker.prefill_progress.connect(lambda f, _: progress.append(f))
    monkeypatch.setattr(worker, "text_every_s", 0.0)
    worker.new_chat()
    worker.ask("Who keeps the log?", {"max_tokens": 12, "temperature": 0.0}, "")
    every_token = len(pieces)
    answer = worker.history[-1]["content"]
    assert "".join(pieces) == answer and every_token > 1
    layers = worker.llm.args.num_layers
    assert progress == [i / layers for i in range(1, layers + 1)]                 # every layer's report
    pieces.clear()
    progress.clear()
    monkeypatch.setattr(worker, "text_every_s", 60.0)          # slower than the whole turn: the first piece and the rest
    worker.new_chat()
    worker.ask("Who keeps the log?", {"max_tokens": 12, "temperature": 0.0}, "")
    assert "".join(pieces) == worker.history[-1]["content"] == answer and len(pieces) == 2
    assert progress == [1 / layers, 1.0]
    worker.answer_text.disconnect(pieces.append)
    worker.prefill_progress.disconnect()


def test_a_cpu_engine_on_every_core_sends_text_less_often(worker):
    """Where the engine computes on every core of a CPU (the window's budget is tight there), each signal woke the
    window's threads and took a core's time from the engine: text and progress go out every 0.2 s at most."""
    import os

    import torch

    import app.worker as w
    every_core = torch.get_num_threads() >= (os.cpu_count() or 1)
    assert worker.text_every_s == (w.TIGHT_TEXT_EVERY_S if every_core else w.TEXT_EVERY_S)


def test_a_quest_turn_maps_its_tokens_beside_the_prefill_and_the_map_comes_before_the_turn_ends(worker):
    """The token map of a new prompt is made on a thread while the prefill runs: the window hears the turn without a
    map at once, then the map (one row per prompt token), both before the answer ends; the same prompt asked again
    takes the cached map at once."""
    config = dict(worker.engine_config)
    worker.load_model({**config, "mode": "layerwise", "policy": "quest",
                       "policy_params": {"token_budget": 128, "min_context": 0, "min_layer_mb": 0}})
    events = []
    on_map, on_done = (lambda info: events.append(("map", info))), (lambda stats: events.append(("done", stats)))
    worker.token_map.connect(on_map)
    worker.answer_done.connect(on_done)
    try:
        worker.new_chat()
        worker.ask("Who keeps the log?", {"max_tokens": 2}, "")
        (k1, pending), (k2, made), (k3, stats) = events
        assert (k1, k2, k3) == ("map", "map", "done") and worker.signals.errors == []
        assert pending["map"] is None and pending["reason"] == "" and made["first_step"] == pending["first_step"]
        assert made["map"].shape == (stats["prompt_tokens"], 2) and made["reason"] == ""
        events.clear()
        worker.ask_again("Who keeps the log?", {"max_tokens": 2}, "")    # the same prompt: the cached map
        (k1, again), (k2, _) = events
        assert (k1, k2) == ("map", "done") and again["map"] is made["map"]
    finally:
        worker.token_map.disconnect(on_map)
        worker.answer_done.disconnect(on_done)
        worker.load_model(config)
