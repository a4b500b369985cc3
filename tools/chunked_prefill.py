"""Chunked prefill with a chunk's earlier blocks in groups (CUDA's default) against one block at a time.

    python tools/chunked_prefill.py [--shape smollm2-135m] [--length 5800] [--rounds 2]

Random weights of `--shape`, chunked mode, no disk tier. Per variant and round a new engine (warmed up) answers
three fresh prompts of `--length` tokens and then each again with a 206-token question appended (the document's
KV in the prefix cache): the medians of the time to first token of both. The variants alternate, `--rounds`
times each. On a CPU the engine's default is one block (the grouped variant is forced there for comparison).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=5800)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import torch

    from bench.shapes import shape_config
    from engine import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for _ in range(args.rounds):
        for variant in ("grouped", "one block"):
            g = torch.Generator().manual_seed(0)
            llm = LLM(shape=shape_config(args.shape), mode="chunked", kv_store=None)
            if variant == "one block":
                llm.runner.prefill_group = 1
            elif llm.runner.prefill_group == 1:                         # a CPU: as CUDA would group
                llm.runner.prefill_group = llm.runner.group
            llm.warm_up()
            first, again = [], []
            for _ in range(3):
                doc = torch.randint(100, 40000, (args.length,), generator=g).tolist()
                first.append(llm.generate([doc], params)[0].stats.ttft_s)
                question = torch.randint(100, 40000, (206,), generator=g).tolist()
                again.append(llm.generate([doc + question], params)[0].stats.ttft_s)
            print(f"{args.shape}, {args.length} tokens on {llm.device}, prefill {variant} (group "
                  f"{llm.runner.prefill_group}): time to first token {statistics.median(first):.3f} s fresh, "
                  f"{1e3 * statistics.median(again):.1f} ms with the document cached and 206 new tokens", flush=True)
            llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
