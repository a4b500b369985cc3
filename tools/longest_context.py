"""How long a context runs in layerwise mode: one prefill of N random tokens and a few decode steps.

    python tools/longest_context.py --tokens 524288 --shape qwen3-4b
"""
import argparse
import time

import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=524288)
p.add_argument("--shape", default="qwen3-4b")
p.add_argument("--decode", type=int, default=4)
a = p.parse_args()
t = time.perf_counter()
llm = LLM(shape=shape_config(a.shape), mode="layerwise", max_model_len=a.tokens + a.decode + 16)
print(f"engine ready in {time.perf_counter() - t:.0f} s: {llm.plan.describe()}; host pool "
      f"{llm.runner.oe.host.numel() * llm.runner.oe.host.element_size() / 2**30:.1f} GiB", flush=True)
llm.generate([list(range(2048))], SamplingParams(max_tokens=4, ignore_eos=True))  # compiles the kernels
weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
torch.cuda.reset_peak_memory_stats()
prompt = torch.randint(0, llm.args.vocab_size, (a.tokens,)).tolist()
out = llm.generate([prompt], SamplingParams(max_tokens=a.decode + 1, ignore_eos=True))[0]
s = out.stats
peak = torch.cuda.max_memory_allocated()
print(f"{a.tokens} tokens: prefill {s.prefill_tok_s:,.0f} tok/s ({s.ttft_s:.1f} s), decode {1e3 / s.decode_tok_s:.0f} "
      f"ms/token, H2D {s.bytes_h2d / 1e9:.1f} GB, D2H {s.bytes_d2h / 1e9:.1f} GB; peak GPU memory "
      f"{peak / 2**30:.2f} GiB = weights {weights / 2**30:.2f} + {(peak - weights) / 2**30:.2f} GiB")
