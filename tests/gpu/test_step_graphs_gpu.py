"""Layerwise decode steps recorded and replayed as whole CUDA graphs (engine/offload/step_graphs.py), on CUDA."""
import pytest
import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams
from engine.offload.step_graphs import RECORD_MIN_STEPS
from engine.trace import TraceRecorder
from engine.trace.events import COMPUTE, H2D

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BS = 256


def _answers(llm, prompts, steps, recorder=None):
    llm.recorder = recorder
    try:
        out = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))]
    finally:
        llm.recorder = None
    return out


@pytest.fixture(scope="module")
def llm():
    """The default model's shape, random weights, fp32 (greedy tokens comparable step for step), ring of 3."""
    with LLM(shape=shape_config("smollm2-135m"), dtype="float32", max_model_len=2048, mode="layerwise",
             kv_block_size=BS, ring_slots=3) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49000, (n,), generator=g).tolist() for n in (600, 300)]


def test_replayed_steps_answer_as_eager_ones_across_block_boundaries(llm, prompts):
    """400 answer tokens after a 600-token prompt fill the block at 768: the tokens and each step's bytes are those
    of the eager steps; each block's steps were recorded once (on their second step) and replayed; the 300-token
    prompt's short answer is too short to pay for a recording and runs eagerly."""
    sg = llm.runner.step_graphs
    sg.enabled = False
    eager = _answers(llm, prompts[:1], 400)
    eager_bytes = llm.runner.last_step_bytes          # (the last step's: a replay below)
    eager = eager, _answers(llm, prompts[1:], RECORD_MIN_STEPS)
    sg.enabled, sg.replays, sg.captures = True, 0, 0
    sg.clear()
    got = _answers(llm, prompts[:1], 400)
    assert sg.captures == 2 and sg.replays >= 399 - 6, (sg.captures, sg.replays)
    assert llm.runner.last_step_bytes == eager_bytes  # its loads, and the next step's issued after the launch
    replays = sg.replays
    got = got, _answers(llm, prompts[1:], RECORD_MIN_STEPS)
    assert got == eager
    assert sg.captures == 2 and sg.replays == replays
    print(f"\nstep graphs: {sg.captures} recorded, {sg.replays} replays of 399 decode steps")


def test_recording_again_after_the_policy_changed(llm, prompts, recwarn):
    """set_policy drops the recorded steps (and their memory pool): the next long answer records and replays again
    (a stale pool once failed the recording, and every later step ran eagerly with a warning)."""
    sg = llm.runner.step_graphs
    sg.enabled = False
    eager = _answers(llm, prompts[1:], 100)
    sg.enabled = True
    _answers(llm, prompts[:1], 100)
    llm.set_policy("full")
    captures, replays = sg.captures, sg.replays
    assert _answers(llm, prompts[1:], 100) == eager
    assert sg.enabled and sg.captures == captures + 1 and sg.replays > replays + 90, (sg.captures, sg.replays)
    assert not [w for w in recwarn if "CUDA graph" in str(w.message)]


def test_a_new_request_over_the_same_blocks_replays_only_once_the_ring_is_steady(llm, prompts):
    """A second request over the same blocks (the prefix cache's) with a short answer: its first decode step follows
    a prefill, whose ring holds other layers, so it runs eagerly; the graph recorded for the long answer serves the
    steps after it."""
    sg = llm.runner.step_graphs
    sg.enabled = True
    _answers(llm, prompts[:1], 400)
    captures, replays = sg.captures, sg.replays
    sg.enabled = False
    eager = _answers(llm, prompts[:1], 40)
    sg.enabled = True
    assert _answers(llm, prompts[:1], 40) == eager
    assert sg.captures == captures and sg.replays == replays + 38


def test_detailed_steps_run_eagerly_between_replays_and_keep_their_timeline(llm, prompts):
    """The app's recorder (a timeline a few times a second): its detailed decode steps carry every layer's compute
    and loads; the steps between them are replays; the answer is the untraced one."""
    sg = llm.runner.step_graphs
    _answers(llm, prompts[:1], 400)          # (records the steps the short answers replay)
    plain = _answers(llm, prompts[:1], 120)
    replays = sg.replays
    rec = TraceRecorder(max_steps=512, device=llm.device, detail_hz=50.0)   # every ~20 ms
    traced = _answers(llm, prompts[:1], 120, rec)
    assert traced == plain
    assert sg.replays > replays
    decodes = [s for s in rec.steps if s.phase == "decode"]
    detailed = [s for s in decodes if s.detailed]
    assert 0 < len(detailed) < len(decodes)
    for s in detailed[1:]:
        layers = {sp.layer for sp in s.lane_spans(COMPUTE) if sp.name.startswith("layer ")}
        assert layers == set(range(llm.args.num_layers))
        assert s.lane_spans(H2D)
    print(f"\ntraced: {len(detailed)} detailed of {len(decodes)} decode steps, {sg.replays - replays} replays")
