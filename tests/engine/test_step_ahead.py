"""The next decode step's first layers issued before the token reaches the host (engine/offload/step_ahead.py), on
the CPU's eager path (CUDA runs it by default; tests/gpu/test_step_ahead_gpu.py): the same answers as steps that
wait, steps that would offload a block never issued ahead, an answer that ends or is cancelled leaving nothing wrong
behind for the next request, and a timeline only in steps that ran whole."""
import pytest

from engine import LLM, SamplingParams
from engine.trace import TraceRecorder

QUEST = {"token_budget": 256, "page_size": 16, "dense_layers": 2, "min_context": 0, "min_layer_mb": 0}
PROMPT = list(range(2000, 2000 + 900))          # 14 blocks of 64 and 4 tokens: the answer crosses two boundaries


@pytest.fixture(scope="module")
def engine(default_model_dir):
    """Quest in layerwise mode with a device budget that keeps its two dense layers (and a few more) resident."""
    with LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
             policy="quest", policy_params=QUEST, gpu_kv_budget_gb=0.05) as llm:
        assert {0, 1} <= set(llm.runner.oe.resident) and 2 not in llm.runner.oe.resident
        yield llm


def _answer(llm, ahead: bool, prompt=PROMPT, **params):
    llm.runner.ahead.enabled = ahead
    issued = []
    issue = llm.runner.ahead.issue
    llm.runner.ahead.issue = lambda seq, ctx, token, n: (issued.append((len(seq), n)), issue(seq, ctx, token, n))
    try:
        return llm.generate([prompt], SamplingParams(ignore_eos=True, **params))[0].token_ids, issued
    finally:
        del llm.runner.ahead.issue
        llm.runner.ahead.enabled = False


def test_steps_issued_ahead_answer_as_steps_that_wait(engine):
    waited, none = _answer(engine, False, max_tokens=70)
    got, issued = _answer(engine, True, max_tokens=70)
    assert got == waited and not none
    assert len(issued) >= 60 and all(n == 2 for _, n in issued)           # the two dense layers, nearly every step
    bs = 64
    assert all(L % bs and (L + 1) % bs for L, _ in issued)   # never where a block is completed or begun
    assert max(L for L, _ in issued) < len(PROMPT) + 70 - 1              # nor after the answer's last token


def test_an_answer_cancelled_after_a_step_issued_ahead_leaves_the_next_request_right(engine):
    """The dropped step wrote the two dense layers' K, V past the sequence's end: a follow-up request that reads
    the same cached prefix answers as an engine that never issued ahead."""
    llm, follow = engine, PROMPT + [3001, 3002, 3003]
    want, _ = _answer(llm, False, follow, max_tokens=12)
    llm.runner.ahead.enabled = True
    seq = llm.add_request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):
        llm.step()
    assert llm.runner.ahead.issued is not None
    llm.cancel(seq)
    rec = llm.recorder = TraceRecorder(detail_hz=1.0)
    try:
        got, issued = _answer(llm, True, follow, max_tokens=12)
    finally:
        llm.recorder = None
    assert llm.runner.ahead.issued is None and got == want and issued
    assert rec.steps[0].phase == "prefill" and rec.steps[0].detailed     # the next request's timeline is whole


def test_a_timeline_is_recorded_only_in_steps_that_ran_whole(engine):
    """A recorder at a detail rate: steps whose timeline is due are never issued ahead (nor the step before them),
    and every detailed decode step holds the compute of every layer."""
    llm = engine
    rec = TraceRecorder(detail_hz=1.0)
    llm.recorder = rec
    try:
        got, issued = _answer(llm, True, max_tokens=40)
    finally:
        llm.recorder = None
    decodes = [s for s in rec.steps if s.phase == "decode"]
    detailed = [s for s in decodes if s.detailed]
    assert issued and detailed and len(detailed) < len(decodes)
    for s in detailed:
        assert {sp.layer for sp in s.spans if sp.lane == "compute"} >= set(range(llm.args.num_layers))
    assert got == _answer(llm, False, max_tokens=40)[0]


def test_a_plain_step_stays_plain_when_its_timeline_falls_due():
    rec = TraceRecorder(detail_hz=1e9)            # every step due
    rec.begin_step("decode", 1)
    rec.end_step()
    assert rec.next_detailed()
    rec.begin_step("decode", 1, timeline=False)
    assert not rec.detail
    rec.end_step()
    rec.begin_step("decode", 1)
    assert rec.detail
