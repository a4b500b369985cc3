"""StreamingLLM: the pages it plans (sink + recent window), and the real engine running it in both offload modes."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.sparse import make_policy
from engine.sparse.policy import KVLayout
from engine.step import StepContext
from engine.trace import TraceRecorder

from tests.engine.tiny import tiny_model


def _policy(**params):
    p = make_policy("streamingllm", params, "layerwise")
    p.initialize(KVLayout(2, 2, 8, 32, torch.device("cpu"), torch.float32, 20))   # blocks of 32, 2 kv heads
    return p


def test_plan_is_the_sink_and_the_newest_pages_filling_whole_blocks():
    p = _policy(sink=16, window=40, page_size=16)          # 1 sink page, 3 window pages -> 4 pages = 2 blocks
    ctx = StepContext(block_table=torch.tensor([7, 3, 9, 4, 12, 5]))
    plan = p.plan_load(0, 6, ctx)                           # 6 full blocks = 12 pages
    assert plan.page_size == 16 and plan.pages.shape == (2, 4)
    # page i of host block b is b * 2 + i: sink = block 7's first page; window = last 3 pages (blocks 12, 5)
    assert plan.pages.tolist() == [[14, 25, 10, 11]] * 2
    assert p.plan_load(0, 2, ctx) is None                   # 4 pages fit: everything is loaded
    assert p.stats()["window_tokens"] == 48 and p.stats()["sink_tokens"] == 16


def test_bad_parameters_name_the_parameter():
    with pytest.raises(ConfigError, match=r"streamingllm window must be in \[1, "):
        make_policy("streamingllm", {"window": 0}, "layerwise")
    with pytest.raises(ConfigError, match="streamingllm policy runs in layerwise or chunked mode, not gpu"):
        make_policy("streamingllm", {}, "gpu")
    with pytest.raises(ConfigError, match="page_size 64 must divide the KV block size 32"):
        _policy(page_size=64)


def test_layerwise_and_chunked_attend_to_the_same_tokens(tmp_path):
    """Two runners execute the policy's plan: with a window that holds everything both answer like Full; with a
    tight one they move only sink + window per layer and step, and still agree with each other token by token."""
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(mode, policy, params):
        with LLM(str(tmp_path), device="cpu", kv_block_size=32, mode=mode, max_model_len=400, policy=policy,
                 policy_params=params) as llm:
            rec = TraceRecorder()
            llm.recorder = rec
            out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
            block = llm.runner.block_bytes                   # one block of every layer (both, here)
        decodes = [s for s in rec.steps if s.phase == "decode"][1:]
        return out.token_ids, [s.metrics["bytes_h2d"] / block for s in decodes]

    full, _ = run("layerwise", "full", {})
    assert run("layerwise", "streamingllm", {"window": 512})[0] == full
    tight = {"sink": 16, "window": 48, "page_size": 16}     # 1 + 3 pages: two blocks per layer and step
    lw, lw_bytes = run("layerwise", "streamingllm", tight)
    ch, ch_bytes = run("chunked", "streamingllm", tight)
    assert lw == ch and lw != full
    assert max(ch_bytes) == 2 and max(lw_bytes) <= 2        # blocks of every layer per step: sink + window
    assert min(run("chunked", "full", {})[1]) >= 9           # full streams all 9 earlier blocks
