"""The disk KV tier on a real CUDA device: pages written from device or pinned host memory (writer thread), read
back into the device cache or the host pool of a new engine, answer as the computed prefill does (bf16)."""
import pytest
import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("mode", ["gpu", "layerwise"])
def test_kv_from_disk_answers_as_computed_prefill_on_cuda(tmp_path, mode):
    prompt = torch.randint(100, 30000, (3000,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(times):
        llm = LLM(shape=shape_config("qwen3-4b"), device="cuda", mode=mode, kv_block_size=256, max_model_len=4096,
                  kv_store=str(tmp_path))
        outs = [llm.generate([prompt], params)[0] for _ in range(times)]
        llm.close()
        return outs
    computed, memory_hit = run(2)          # the second: the same blocks from the in-memory prefix cache
    (read,) = run(1)                       # a new engine: from disk
    assert computed.stats.disk_cached_tokens == 0 and memory_hit.stats.cached_tokens == 11 * 256
    assert read.stats.disk_cached_tokens == read.stats.cached_tokens == 11 * 256
    assert read.token_ids == memory_hit.token_ids        # the disk's KV is the KV the engine computed, bit for bit
