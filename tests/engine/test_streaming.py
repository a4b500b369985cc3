"""StreamingLLM: the rows it plans (sink + recent window), and the real engine running it in both offload modes."""
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


def test_plan_is_the_sink_and_the_newest_tokens():
    p = _policy(sink=4, window=40)
    table = torch.tensor([7, 3, 9, 4, 12, 5])
    plan = p.plan_load(0, 170, StepContext(block_table=table))      # 170 tokens: 5 full blocks + 10
    assert plan.device_tail == 10                                    # the block being filled: on the device
    assert plan.rows.shape == (2, 4 + 30)                            # sink + the window's 30 tokens on the host
    # token t of the sequence is host row table[t // 32] * 32 + t % 32
    want = [7 * 32 + t for t in range(4)] + [12 * 32 + t for t in range(130 - 128, 32)]
    assert plan.rows[0].tolist() == want and plan.rows[1].tolist() == want
    assert p.plan_load(0, 44, StepContext(block_table=table)) is None   # 44 tokens fit: everything is loaded


def test_bad_parameters_name_the_parameter():
    with pytest.raises(ConfigError, match=r"streamingllm window must be in \[1, "):
        make_policy("streamingllm", {"window": 0}, "layerwise")
    with pytest.raises(ConfigError, match="streamingllm policy runs in layerwise or chunked mode, not gpu"):
        make_policy("streamingllm", {}, "gpu")


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
            per_token = llm.runner.block_bytes // 32            # one token of every layer (both, here)
        decodes = [s for s in rec.steps if s.phase == "decode"][1:]
        return out.token_ids, [s.metrics["bytes_h2d"] / per_token for s in decodes]

    full, _ = run("layerwise", "full", {})
    assert run("layerwise", "streamingllm", {"window": 512})[0] == full
    tight = {"sink": 8, "window": 40}
    lw, lw_tokens = run("layerwise", "streamingllm", tight)
    ch, ch_tokens = run("chunked", "streamingllm", tight)
    assert lw == ch and lw != full
    assert max(ch_tokens) <= 48 and max(lw_tokens) <= 48          # tokens per layer and step: at most sink + window
    assert min(run("chunked", "full", {})[1]) >= 9 * 32           # full streams all 9 earlier blocks
