"""What a whole-step CUDA graph of layerwise decode rests on (engine/offload/step_graphs.py), checked on the CPU
engine: which steps qualify, and that an eager decode step leaves the ring holding what the next step alike finds
(a replay restores that state instead of computing it). The replays themselves: tests/gpu/test_step_graphs_gpu.py."""
import math

import pytest

from bench.shapes import shape_config
from engine import LLM, SamplingParams
from engine.offload.step_graphs import RECORD_MIN_STEPS
from engine.trace import TraceRecorder
from engine.trace.recorder import NULL_RECORDER

BS = 256
TAIL = 44          # prompts of one block and 44 tokens: the answer starts 44 tokens into block 1


@pytest.fixture(scope="module")
def llm():
    with LLM(None, shape=shape_config("smollm2-135m"), device="cpu", mode="layerwise", kv_block_size=BS,
             max_model_len=1024, ring_slots=3) as engine:
        yield engine


def _decode(llm, prompt, max_tokens, steps):
    seq = llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for _ in range(steps + 1):             # the prefill, then `steps` decode steps
        llm.step()
    return seq


def _finish(llm):
    while not llm.scheduler.is_finished():
        llm.step()


def test_steps_alike_share_a_key_and_the_ring_state_they_start_from(llm):
    sg = llm.runner.step_graphs
    seq = _decode(llm, list(range(3, 3 + BS + 190)), BS, 2)     # (63 steps before block 1 fills)
    key, held = sg.key(seq, NULL_RECORDER), sg._holdings()
    assert key is not None and key[0] == (len(seq) - 1) // BS
    S, N = len(llm.runner.streamed), llm.runner.oe.ring_slots
    for _ in range(N // math.gcd(S, N)):               # eager steps until the ring's phase comes round again:
        llm.step()                                      # the same key, the same holdings
    assert sg.key(seq, NULL_RECORDER) == key
    assert sg._holdings() == held and sg._holds(held)
    while len(seq) % BS:                               # the step that fills the block, and the one after it,
        llm.step()                                     # run eagerly (their offloads are not in a graph)
    assert sg.key(seq, NULL_RECORDER) is None
    llm.step()
    assert sg.key(seq, NULL_RECORDER) is None
    llm.step()
    after = sg.key(seq, NULL_RECORDER)
    assert after is not None and after[0] == key[0] + 1 and after[2][:-1] == key[2]
    assert not sg._holds(held)                         # the ring now holds one block more
    llm.cancel(seq)


def test_a_new_requests_prefill_leaves_a_ring_no_step_graph_starts_from(llm):
    sg = llm.runner.step_graphs
    prompt = list(range(7, 7 + BS + TAIL))
    _decode(llm, prompt, 40, 3)
    held = sg._holdings()
    _finish(llm)
    seq = _decode(llm, prompt, 40, 0)                  # the same blocks (prefix cache), after its prefill
    assert not sg._holds(held)
    llm.step()                                          # one eager decode step: as the earlier request's steps
    assert sg.key(seq, NULL_RECORDER) is not None and sg._holds(held)
    _finish(llm)


def test_what_runs_eagerly(llm):
    sg = llm.runner.step_graphs
    seq = _decode(llm, list(range(11, 11 + BS + TAIL)), 300, 2)
    assert sg.key(seq, NULL_RECORDER) is not None
    assert sg.key(seq, TraceRecorder(device=llm.device)) is None       # a step with a timeline
    assert sg._pays(seq)                               # 300 tokens asked for, 200 steps before the block fills
    params, done = seq.params, seq.num_completion_tokens
    seq.params = SamplingParams(max_tokens=done + RECORD_MIN_STEPS - 1)
    assert not sg._pays(seq)                           # too few steps alike left to pay for a recording
    seq.params = SamplingParams(max_tokens=done + RECORD_MIN_STEPS)
    assert sg._pays(seq)
    seq.params = params
    llm.cancel(seq)
    llm.set_policy("quest", {"token_budget": 128, "min_context": 32, "min_layer_mb": 0})
    try:
        seq = _decode(llm, list(range(13, 13 + BS + TAIL)), 40, 2)
        assert llm.runner.policy.plans_loads
        assert sg.key(seq, NULL_RECORDER) is None      # Quest plans each step's pages
        _finish(llm)
    finally:
        llm.set_policy("full")
