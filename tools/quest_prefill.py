"""What Quest's page index costs the prefill: time to the first token of one prompt length with Full, with a fresh
Quest policy (its sketch basis is made on its first prompt) and with the same policy again, in turn, medians.

    python tools/quest_prefill.py --shape qwen3-4b --ctx 32768            # GPU, random weights of the shape
    python tools/quest_prefill.py --shape smollm2-135m --ctx 2048 --device cpu --rounds 2

Layerwise mode; each round runs Full, then a new Quest policy three times (`--params` JSON, default budget 2048 with
its gates off so it really indexes and chooses), on fresh random prompts; the first round warms up (compiles). A
fresh policy makes its sketch basis on its first prompt and captures its selection's CUDA graphs on its second (a
layer's graph is captured on its second use); from the third on it runs as it does in a chat's later turns.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import shape_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--device", default=None)
    p.add_argument("--rounds", type=int, default=4, help="rounds after the warm-up one")
    p.add_argument("--params", default='{"token_budget": 2048, "min_context": 1024, "min_layer_mb": 0}')
    a = p.parse_args()
    params = json.loads(a.params)
    llm = LLM(shape=shape_config(a.shape), max_model_len=a.ctx + 64, mode="layerwise", policy="full",
              **({"device": a.device} if a.device else {}))

    def first_token() -> float:
        prompt = torch.randint(0, llm.args.vocab_size, (a.ctx,)).tolist()
        seq = llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        while not seq.is_finished:
            llm.step()
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"full": [], "quest, fresh policy": [], "quest, 2nd prompt": [],
                                     "quest, 3rd prompt": []}
    for r in range(a.rounds + 1):
        llm.set_policy("full")
        got = [first_token()]
        llm.set_policy("quest", params)
        got += [first_token(), first_token(), first_token()]
        if r:
            for name, t in zip(times, got):
                times[name].append(t)
    full = statistics.median(times["full"])
    print(f"{a.shape}, {a.ctx:,}-token prompt, layerwise, {llm.device.type}: time to the first token, median of "
          f"{a.rounds} (ms)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:22s} {m * 1e3:9.1f}  ({full / m:.2f}x Full's pace)  each: "
              + " ".join(f"{t * 1e3:.1f}" for t in ts))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
