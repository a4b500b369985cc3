"""Layerwise decode with whole-step CUDA graphs off and on, alternating in one process (engine/offload/step_graphs.py).

    python tools/step_graphs_ab.py                          # default model's shape, bf16, 5,852-token prompt
    python tools/step_graphs_ab.py --pin 3,4 --busy 10      # engine on CPUs 3-4, then again with 10 busy CPUs

Blocks of `--steps` decode steps alternate (graphs off, on) `--blocks` times; each prints the median step, its p10 and
p90, and the host's time from the step's start to the logits (where the host is done issuing the step's layers). The
steps that recorded a graph are listed apart (a recording costs host time once). `--busy N`: the same again while N
processes spin on other CPUs (a host whose CPUs slow down while others work shows it). CUDA only.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from app_overhead import cpu_set       # (tools/ is the script's own folder on sys.path; it puts the repo there too)
from host_load import BURN

import torch  # noqa: E402

from bench.shapes import shape_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def measure(llm, blocks: int, steps: int, label: str) -> None:
    runner, sg = llm.runner, llm.runner.step_graphs
    logits_at = []
    plain = runner._logits

    def logits(h, residual, ctx):
        logits_at.append(time.perf_counter())
        return plain(h, residual, ctx)
    runner._logits = logits
    got = {False: ([], []), True: ([], [])}
    recorded = []
    try:
        for _ in range(blocks):
            for on in (False, True):
                sg.enabled = on
                for i in range(steps):
                    n = sg.captures
                    t0 = time.perf_counter()
                    llm.step()
                    t1 = time.perf_counter()
                    if sg.captures > n:
                        recorded.append((t1 - t0) * 1e3)
                    elif i >= 3:              # (the first steps after a switch settle the ring)
                        got[on][0].append((t1 - t0) * 1e3)
                        got[on][1].append((logits_at[-1] - t0) * 1e3)
    finally:
        runner._logits = plain
    for on in (False, True):
        step, host = got[on]
        q = sorted(step)
        print(f"{label} step graphs {'on ' if on else 'off'}: step {statistics.median(step):.3f} ms (p10 "
              f"{q[len(q) // 10]:.3f}, p90 {q[9 * len(q) // 10]:.3f}), host to the logits "
              f"{statistics.median(host):.3f} ms")
    print(f"  recorded {sg.captures}, replayed {sg.replays}; steps that recorded: {[round(t, 1) for t in recorded]} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, default=5852)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pin", type=cpu_set, default=set(), help="CPUs for this process, e.g. 3,4")
    ap.add_argument("--busy", type=int, default=0, help="then again with this many spinning processes")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step graphs exist on CUDA only")
    n = 2 * (1 + (a.busy > 0)) * a.blocks * a.steps + 16
    llm = LLM(None, shape=shape_config(a.shape), max_model_len=a.ctx + n + 8, mode="layerwise")
    llm.warm_up()
    prompt = torch.randint(0, llm.args.vocab_size, (a.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in range(10):
        llm.step()
    if a.pin:
        os.sched_setaffinity(0, a.pin)
    measure(llm, a.blocks, a.steps, "idle host,")
    if a.busy:                         # each burns a whole core of its own, away from the engine's
        others = sorted(set(range(os.cpu_count())) - a.pin)
        procs = [subprocess.Popen([sys.executable, "-c", BURN, "1.0"]) for _ in range(a.busy)]
        for i, p in enumerate(procs):
            os.sched_setaffinity(p.pid, {others[i % len(others)]})
        try:
            measure(llm, a.blocks, a.steps, f"{a.busy} busy CPUs,")
        finally:
            for p in procs:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
