"""Quest decode, variants side by side in one process: one engine and one request, steps alternating in blocks.

    python tools/quest_decode_ab.py --shape qwen3-4b --ctx 131072 --gpu-kv-budget 2.7 \
        --variants plain,load-sink,look-ahead,look-ahead+load-sink

A variant is a '+'-joined set of switches flipped between blocks of steps, on the same engine and sequence:
`look-ahead` (the policy guesses each layer's query one layer early and fetches what the guess chooses;
the engine is built with look_ahead so that either can run) and `load-sink` (the layerwise runner loads a plan's
sink from the host instead of its device copy: `LayerwiseRunner.keep_sink`), and `no-step-ahead` (the next step's
first layers wait for the host's token: engine/offload/step_ahead.py); `plain` flips none. Steps alternate,
so a host whose speed drifts (the GPU machine's CPUs move by up to 1.8x from minute to minute) hits every variant
alike; medians and minima per variant, ms per decode step (each step ends when its token is on the host).
"""
import argparse
import json
import statistics
import time

import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams

SWITCHES = ("look-ahead", "load-sink", "no-step-ahead")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--params", default='{"token_budget": 2048}', help="Quest's parameters as JSON")
    p.add_argument("--gpu-kv-budget", type=float, default=None, help="device KV budget in GB")
    p.add_argument("--variants", default="plain,load-sink,look-ahead,look-ahead+load-sink")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=8, help="steps timed per variant and round (after 2 to settle)")
    a = p.parse_args()
    variants = {v: set(v.split("+")) - {"plain"} for v in a.variants.split(",")}
    for name, flips in variants.items():
        if flips - set(SWITCHES):
            p.error(f"variant {name!r}: switches are {', '.join(SWITCHES)} (or plain)")
    params = {**json.loads(a.params), "look_ahead": any("look-ahead" in f for f in variants.values())}
    steps = a.rounds * len(variants) * (a.block + 2) + 16
    llm = LLM(shape=shape_config(a.shape), max_model_len=a.ctx + steps + 64, mode="layerwise", policy="quest",
              policy_params=params, **({} if a.gpu_kv_budget is None else {"gpu_kv_budget_gb": a.gpu_kv_budget}))
    runner, policy = llm.runner, llm.runner.policy
    llm.add_request(torch.randint(0, llm.args.vocab_size, (a.ctx,)).tolist(),
                    SamplingParams(max_tokens=steps, ignore_eos=True))
    for _ in range(13):                          # the prefill, then decode steps that capture the graphs
        llm.step()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for name, flips in variants.items():
            policy.looks_ahead = "look-ahead" in flips
            runner.keep_sink = "load-sink" not in flips
            runner.ahead.enabled = "no-step-ahead" not in flips
            runner._packed[:] = [None] * len(runner._packed)   # what the last variant planned is loaded again
            for i in range(a.block + 2):
                t = time.perf_counter()
                llm.step()
                if i >= 2:
                    times[name].append((time.perf_counter() - t) * 1e3)
    print(f"{a.shape}, {a.ctx} tokens, Quest {json.dumps(json.loads(a.params))}, {llm.device}:")
    for name, v in times.items():
        print(f"  {name:24s} {statistics.median(v):7.2f} ms/step median, {min(v):7.2f} min ({len(v)} steps)")
    st = policy.stats()
    print(f"  pages fetched per step and layer: {st.get('fetched_pages_per_step', 0):.1f} by the correction, "
          f"{st.get('fetched_ahead_pages_per_step', 0):.1f} ahead (means over every variant)")
    llm.close()


if __name__ == "__main__":
    main()
