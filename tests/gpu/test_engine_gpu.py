"""The gpu mode on a real CUDA device (run with `make gpu-test` on a CUDA machine)."""
import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def llm():
    """Random weights of Qwen3-4B's shape, bf16, KV sized from free memory, decode CUDA graphs on."""
    return LLM(shape="qwen3-4b", max_model_len=8192, max_num_seqs=4)


def test_memory_sizing_and_graphs(llm):
    assert llm.dtype == torch.bfloat16 and llm.runner.graphs
    assert llm.kv_capacity_tokens >= 4 * 8192  # 4 sequences of the full context fit


def test_graph_decode_equals_eager_decode(llm):
    """Replaying the captured graph gives the logits of running the same step eagerly."""
    from engine.sequence import Sequence
    seqs = [Sequence(torch.randint(0, 1000, (n,)).tolist(), SamplingParams(), llm.config.kv_block_size)
            for n in (700, 3000)]
    for s in seqs:
        llm.block_manager.allocate(s)
    first = llm.runner.forward_logits(seqs, True).argmax(-1).tolist()
    for s, t in zip(seqs, first):
        s.append_token(t)
        llm.block_manager.may_append(s)
    graphs = llm.runner.forward_logits(seqs, False).float()
    saved, llm.runner.graphs = llm.runner.graphs, {}
    try:
        eager = llm.runner.forward_logits(seqs, False).float()
    finally:
        llm.runner.graphs = saved
        for s in seqs:
            llm.block_manager.deallocate(s)
    torch.testing.assert_close(graphs, eager, atol=2e-2, rtol=2e-2)


def test_generate_batched_and_prefix_cache(llm):
    prompt = torch.randint(0, 1000, (2000,)).tolist()
    outs = llm.generate([prompt, prompt[:1500]], SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.stats.completion_tokens for o in outs] == [16, 16]
    again = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert again.stats.cached_tokens == (2000 - 1) // 256 * 256
