"""The next decode step's first layers issued from the device's token before the host reads it
(engine/offload/step_ahead.py), on CUDA: Quest's dense, resident layers replayed as CUDA graphs from the sampled token
give the answers of steps that wait for the host, with the live recorder too, and a cancelled answer leaves the
next request right."""
import pytest
import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams
from engine.trace import TraceRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QUEST = {"token_budget": 512, "min_context": 0, "min_layer_mb": 0}


@pytest.fixture(scope="module")
def llm():
    """Qwen3-4B's shape, random weights, fp32 (greedy tokens comparable step for step); a device budget that keeps
    Quest's two dense layers resident and streams the rest."""
    with LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode="layerwise",
             kv_block_size=256, policy="quest", policy_params=QUEST, gpu_kv_budget_gb=0.3) as engine:
        resident = set(engine.runner.oe.resident)
        assert {0, 1} <= resident and len(engine.runner.streamed) > 20, (resident, engine.runner.plan)
        yield engine


PROMPT = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(3)).tolist()


def _answer(llm, ahead: bool, prompt=PROMPT, tokens=40, recorder=None):
    llm.runner.ahead.enabled, llm.recorder = ahead, recorder
    before = llm.runner.ahead.steps
    try:
        return llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))[0].token_ids, \
            llm.runner.ahead.steps - before
    finally:
        llm.runner.ahead.enabled, llm.recorder = True, None


def test_steps_issued_ahead_answer_as_steps_that_wait(llm):
    _answer(llm, False)                                  # the prefix cached and the graphs captured for both runs
    waited, none = _answer(llm, False)
    got, issued = _answer(llm, True)
    assert got == waited and none == 0 and issued >= 30
    assert llm.runner.decode_graphs is not None and len(llm.runner.decode_graphs.graphs) >= 36


def test_the_live_recorder_keeps_whole_timelines_and_the_answer(llm):
    rec = TraceRecorder.live(llm.device, mode="layerwise")
    got, issued = _answer(llm, True, tokens=120, recorder=rec)
    rec.flush()
    decodes = [s for s in rec.steps if s.phase == "decode"]
    detailed = [s for s in decodes if s.detailed]
    assert issued > 0 and detailed and len(detailed) < len(decodes)
    for s in detailed:
        assert {sp.layer for sp in s.spans if sp.lane == "compute"} >= set(range(llm.args.num_layers))
    assert got == _answer(llm, False, tokens=120)[0]


def test_a_cancelled_answer_leaves_the_next_request_right(llm):
    follow = PROMPT + [7, 8, 9]
    want, _ = _answer(llm, False, follow, tokens=16)
    seq = llm.add_request(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(10):
        llm.step()
    assert llm.runner.ahead.issued is not None
    llm.cancel(seq)
    got, issued = _answer(llm, True, follow, tokens=16)
    assert got == want and issued > 0
