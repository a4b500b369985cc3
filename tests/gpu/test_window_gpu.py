"""The whole window over a CUDA engine, as a GPU user runs it: the path that once died in its first turn on the H100
(a segfault between the engine's thread and the GUI's) while the CLI and every CPU test ran.

The real MainWindow, its engine in a process of its own as `python main.py` runs it, the default model in bf16 on the
GPU, the bundled sample document (~5.9K tokens). One window takes every turn in order: each mode with each policy
it runs (gpu: Full, MInference, XAttention; layerwise: Full, Quest, XAttention; chunked: Full, Quest), switched from
the policy panel between turns as a user does; after each answer, what the user sees is checked (the answer, the
stats line, and the view the policy feeds). Then a bundle is exported and the window closed.

    pytest -m gpu tests/gpu/test_window_gpu.py       (on the device: unpack ../shared/gpu-kit first, its README)
"""
import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TURN_S = 120
SPARSE_PREFILL = {"min_len": 1024, "cpu_dense_above": 1.0, "gpu_dense_above": 1.0}      # sparse on the sample
QUEST = {"token_budget": 1024, "page_size": 16, "min_context": 0, "min_layer_mb": 0}       # sparse on the sample
TURNS = [("gpu", "full", {}), ("gpu", "minference", {"vertical": 256, "slash": 512, **SPARSE_PREFILL}),
         ("gpu", "xattention", SPARSE_PREFILL), ("layerwise", "full", {}), ("layerwise", "quest", QUEST),
         ("layerwise", "xattention", SPARSE_PREFILL), ("chunked", "full", {}), ("chunked", "quest", QUEST)]


@pytest.fixture(scope="module")
def qapp():
    """The QApplication (pytest-qt's fixture of that name where it is installed; the device has no pytest-qt)."""
    from PySide6.QtWidgets import QApplication
    return QApplication.instance() or QApplication(["kvscope-test"])


@pytest.fixture(scope="module")
def window(qapp, tmp_path_factory):
    from app.main_window import MainWindow
    from app.samples import SAMPLE
    from app.screenshots import wait_until
    tmp = tmp_path_factory.mktemp("window-gpu")
    win = MainWindow({"settings_path": str(tmp / "kvscope.ini"), "document": str(SAMPLE), "max_new_tokens": 32,
                      "restore": False, "engine_process": True})
    win.resize(1600, 1000)
    win.show()
    wait_until(qapp, lambda: win.model_info and win.document_info and not win.is_busy(), 300, "the model")
    yield win
    pid = win.worker.pid
    win.close()
    assert win.worker.pid is None and pid is not None
    with pytest.raises(ProcessLookupError):            # the engine process is gone, not left behind
        os.kill(pid, 0)


def _ask(qapp, win, question: str) -> dict:
    from app.screenshots import ask_and_wait
    n = len(win.chat.messages())
    ask_and_wait(qapp, win, question, TURN_S)
    assert len(win.chat.messages()) == n + 2, win.chat.messages()[n:]
    return win.chat.messages()[-1]


def test_the_model_runs_on_the_gpu_in_bf16(window):
    assert window.status.device_label.text().startswith("cuda") and "bfloat16" in window.status.device_label.text()
    assert window.document_panel.token_count() > 5000


@pytest.mark.parametrize("mode, policy, params", TURNS, ids=[f"{m}-{p}" for m, p, _ in TURNS])
def test_a_turn_in_each_mode_with_each_policy(window, qapp, mode, policy, params):
    from app.samples import SAMPLE_QUESTION
    from engine.trace import H2D, summarize
    panel = window.policy_panel
    panel.mode_combo.setCurrentIndex(panel.mode_combo.findData(mode))            # as a user: the panel's boxes
    panel.policy_combo.setCurrentIndex(panel.policy_combo.findData(policy))
    panel.params_stack.set_values(policy, params)
    window.docks[{"quest": "quest", "minference": "masks", "xattention": "masks"}.get(policy, "timeline")].raise_()
    answer = _ask(qapp, window, SAMPLE_QUESTION)
    stats = answer["stats"]
    assert window.worker.engine_config["mode"] == mode and stats["policy"] == policy
    assert stats["finish_reason"] in ("stop", "length") and stats["completion_tokens"] > 1 and answer["text"].strip()
    assert "TTFT" in window.chat.message_widget(-1).stats_label.text()
    if policy in ("full", "quest"):                       # the sample's answer, as the CLI gives it
        assert "Lanternfish" in answer["text"], answer["text"]
    steps = window.worker.turn_steps
    assert [s.phase for s in steps].count("decode") == stats["completion_tokens"] - 1
    assert window.timeline.bar_count() > 0 and "GPU" in window.status.memory_label.text()
    if mode != "gpu":      # KV streamed from pinned host memory on its own stream (the prefill loads the cached
        detailed = [s for s in steps if s.timeline]       # document's, and decode's layers)
        assert detailed and window.timeline.bar_count(H2D) > 0 and window.ring.slots()
        assert summarize(detailed).overlap_fraction > 0   # copies ran while compute did
        decodes = [s for s in steps if s.phase == "decode"]
        if len(decodes) >= 2:                             # at GPU speed a short answer has a decode timeline too
            assert decodes[1].timeline and decodes[1].lane_spans(H2D)
    if policy == "quest":
        assert stats["policy_stats"]["sparse"] is True
        step = window.quest.current_step()
        assert step is not None and step.quest and all(len(p.blocks) < p.n_blocks for p in step.quest)
        assert window.quest.image().any()
    if policy in ("minference", "xattention"):
        assert stats["policy_stats"]["sparse"] is True and 0 < stats["policy_stats"]["density"] < 1
        masks = window.masks.current()
        assert masks is not None and masks.kind == policy and not window.masks.showing_hint()
        from app.screenshots import wait_until
        wait_until(qapp, lambda: not window.masks.is_binning(), 10, "the mask picture")   # binned off the GUI thread
        assert window.masks.image().any()


def test_a_bundle_of_the_last_turn(window, tmp_path):
    from engine.trace import check_chrome_trace
    out = window.export_bundle(tmp_path / "bundle")
    for name in ("window.png", "timeline.png", "ring.png", "quest.png", "masks.png", "trace.json", "config.json"):
        assert (out / name).stat().st_size > 0, name
    assert check_chrome_trace(json.loads((out / "trace.json").read_text())) == []
    config = json.loads((out / "config.json").read_text())
    assert config["engine"]["mode"] == "chunked" and config["problems"] == []
