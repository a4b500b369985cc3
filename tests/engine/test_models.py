"""Our modules against transformers' reference models: logits of prefill and of decode steps through the
paged KV cache, with prompts that cross a KV block boundary."""
from pathlib import Path

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.loader import build_model, load_weights
from engine.models.registry import read_config
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.sparse import make_policy
from engine.step import StepContext
from tests.engine.tiny import tiny_model


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_decode_logits_match_transformers(arch, device, tmp_path):
    """On CUDA this runs the Triton decode kernel inside the captured decode CUDA graphs."""
    ref = tiny_model(arch, tmp_path).to(device)
    args = read_config(tmp_path)
    dev = torch.device(device)
    model = load_weights(build_model(args, dev, torch.float32), Path(tmp_path))
    cfg = EngineConfig(model=str(tmp_path), device=device, kv_block_size=16, num_kv_blocks=16, max_num_seqs=2)
    runner = ModelRunner(model, cfg, dev, torch.float32, 256, make_policy("full", {}, "gpu"))
    assert (device == "cuda") == bool(runner.graphs)
    bm = BlockManager(runner.num_blocks, 16)

    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence(prompt, SamplingParams(), 16)
    bm.allocate(seq)
    ours = runner.forward_logits([seq], True, StepContext())[0]
    for step in range(12):  # 37 + 12 crosses the 48-token boundary during decode
        with torch.no_grad():
            want = ref(torch.tensor([seq.token_ids], device=device)).logits[0, -1]
        torch.testing.assert_close(ours, want, atol=5e-4, rtol=1e-4, msg=f"{arch}: step {step}")
        seq.append_token(int(want.argmax()))
        bm.may_append(seq)
        ours = runner.forward_logits([seq], False, StepContext())[0]
    assert len(seq.block_table) == 4


def test_prefill_over_a_cached_prefix_matches_full_prefill(tmp_path):
    """A second request that shares full blocks computes only its remainder, with the same logits."""
    tiny_model("llama", tmp_path)
    args = read_config(tmp_path)
    model = load_weights(build_model(args, torch.device("cpu"), torch.float32), Path(tmp_path))
    cfg = EngineConfig(model=str(tmp_path), device="cpu", kv_block_size=16, num_kv_blocks=32)
    runner = ModelRunner(model, cfg, torch.device("cpu"), torch.float32, 256, make_policy("full", {}, "gpu"))
    bm = BlockManager(runner.num_blocks, 16)
    doc = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    first = Sequence(doc + [5, 6, 7], SamplingParams(), 16)
    bm.allocate(first)
    runner.forward_logits([first], True, StepContext())
    bm.deallocate(first)

    second = Sequence(doc + [9, 9], SamplingParams(), 16)
    bm.allocate(second)
    assert second.num_cached_tokens == 48
    cached = runner.forward_logits([second], True, StepContext())[0]
    fresh = Sequence(doc + [9, 9], SamplingParams(), 16)
    bm2 = BlockManager(runner.num_blocks, 16)
    bm2.allocate(fresh)
    assert fresh.num_cached_tokens == 0
    torch.testing.assert_close(cached, runner.forward_logits([fresh], True, StepContext())[0], atol=1e-5, rtol=1e-5)
