"""How large a recording of a long turn is, and how long it takes to write: a Quest turn on a model shape with
random weights, recorded as the app records it (`TraceRecorder.live`), saved as a `.kvscope`.

    python tools/recording_size.py --shape qwen3-4b --ctx 131072 --out /tmp/q128k.kvscope
    python tools/recording_size.py --shape smollm2-135m --ctx 2048 --device cpu --out /tmp/q2k.kvscope

The answer is `--tokens` tokens (EOS ignored); Quest runs with `--budget` (layerwise mode, `--gpu-kv-budget` GB of
KV on the device). Quest's picks are most of the file: layers x kv heads x pages per step.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.record import Conversation, model_info, turn_stats  # noqa: E402
from bench.shapes import shape_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.trace import TraceRecorder  # noqa: E402
from engine.trace.recording import save_recording  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gpu-kv-budget", type=float, default=2.7)
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rec = TraceRecorder.live(device, max_steps=a.tokens + 64, mode="layerwise")
    engine = dict(max_model_len=a.ctx + a.tokens + 64, mode="layerwise", policy="quest", device=device,
                  policy_params={"token_budget": a.budget, "min_context": 0, "min_layer_mb": 0},
                  gpu_kv_budget_gb=a.gpu_kv_budget if device.startswith("cuda") else None)
    with LLM(shape=shape_config(a.shape), recorder=rec, **engine) as llm:
        prompt = torch.randint(0, llm.args.vocab_size, (a.ctx,)).tolist()
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=a.tokens, ignore_eos=True))[0]
        turn = time.perf_counter() - t0
        conv = Conversation()
        conv.end_turn("(a random prompt)", out.text, turn_stats(out.stats, llm), engine, list(rec.steps))
        meta = {"device": str(llm.device), "app": {"model": model_info(llm), "engine": engine}}
        t0 = time.perf_counter()
        path = save_recording(conv.recording("", meta), a.out)
        took = time.perf_counter() - t0
    print(f"{a.shape} at {a.ctx:,} tokens, Quest {a.budget}, {len(rec.steps)} steps (turn {turn:.2f} s: time to first "
          f"token {out.stats.ttft_s:.2f} s, decode {out.stats.decode_tok_s:.1f} tok/s): {path} is "
          f"{path.stat().st_size / 2**20:.1f} MiB, written in {took:.3f} s ({100 * took / turn:.1f}% of the turn)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
