"""Where a decode step's time goes: torch.profiler over a few steps, top ops by CPU and CUDA time, host syncs.

    python tools/profile_decode.py --shape qwen3-4b --ctx 32768 --mode layerwise --policy quest
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--mode", default="layerwise")
    p.add_argument("--policy", default="full")
    p.add_argument("--params", default="{}", help="policy parameters as JSON")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--python", action="store_true", help="cProfile the host side instead (python functions)")
    a = p.parse_args()
    llm = LLM(shape=a.shape, max_model_len=a.ctx + 64, mode=a.mode, policy=a.policy,
              policy_params=json.loads(a.params))
    prompt = torch.randint(0, llm.args.vocab_size, (a.ctx,)).tolist()
    seq = llm.add_request(prompt, SamplingParams(max_tokens=a.steps + 4, ignore_eos=True))
    llm.step()                                     # prefill
    for _ in range(2):                             # warm-up decode steps
        llm.step()
    torch.cuda.synchronize()
    if a.python:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            llm.step()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(a.rows)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(a.rows)
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(a.steps):
            llm.step()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    print(ev.table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if torch.cuda.is_available():
        print(ev.table(sort_by="self_cuda_time_total", row_limit=a.rows))
    syncs = [e for e in ev if "Synchronize" in e.key or "cudaMemcpy" == e.key or "item" in e.key or "_local_scalar" in e.key]
    for e in syncs:
        print(f"{e.key}: {e.count} calls, {e.cpu_time_total / 1e3:.1f} ms")
    print(f"steps: {a.steps}; seq {seq.seq_id} at {len(seq)} tokens")


if __name__ == "__main__":
    main()
