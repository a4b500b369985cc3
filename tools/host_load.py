"""Does other work on the host slow the engine's decode? Turns with and without CPU-burning processes beside it.

    python tools/host_load.py [--mode layerwise] [--shape smollm2-135m] [--rounds 6] [--length 5800]

One engine (random weights of `--shape`, the app's live tracing) answers the same prompt (`--length` random token
ids, in the prefix cache after the first turn) with 64 greedy tokens, `--rounds` times per variant, the variants
interleaved: nothing else running, one process burning 30% of a core in 10 ms periods (about what the window's GUI
thread takes while it draws at its full rate), one burning a whole core, four burning 30% each. Medians and each
turn's tok/s are printed. The offload modes' decode is a Python loop over the layers on one host core; gpu mode
replays one graph per step. This is why the window keeps its drawing to a small budget in the offload modes on a
GPU even with the engine in a process of its own (app/telemetry.py, `gui_budget`).

`--cpus` first times the host alone: the same pure-Python loop (about 10 ms) on each CPU in turn, twice, with
nothing else of ours running. On the H100 machine it took 9.7-25.9 ms depending on the CPU and the moment (the same
CPU moved between the two ends from one pass to the next): the host's speed, not the engine, sets the spread of
host-bound decode there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BURN = r"""
import sys, time
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * 0.01:
        pass
    time.sleep((1 - duty) * 0.01 + 1e-6)
"""
VARIANTS = {"nothing else": None, "30% of a core": (0.3, 1), "a whole core": (1.0, 1), "4 x 30% of a core": (0.3, 4)}


def _loop(n: int = 200_000) -> float:
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return time.perf_counter() - t


def cpu_speeds() -> None:
    """The same loop pinned to each CPU in turn (median of 5), two passes; the process's affinity is restored."""
    cpus = sorted(os.sched_getaffinity(0))
    for n in (1, 2):
        ms = {}
        for c in cpus:
            os.sched_setaffinity(0, {c})
            _loop(20_000)
            ms[c] = 1e3 * statistics.median(_loop() for _ in range(5))
        os.sched_setaffinity(0, cpus)
        print(f"pass {n}, ms per loop by CPU: " + " ".join(f"{c}:{v:.1f}" for c, v in ms.items())
              + f"  (spread {max(ms.values()) / min(ms.values()):.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="layerwise")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--length", type=int, default=5800)
    ap.add_argument("--cpus", action="store_true", help="first time a fixed loop on each CPU, twice (no engine)")
    args = ap.parse_args()
    if args.cpus:
        cpu_speeds()
    import torch

    from bench.shapes import shape_config
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder
    extra = {"ring_slots": 3} if args.mode != "gpu" else {}
    llm = LLM(shape=shape_config(args.shape), mode=args.mode, kv_block_size=256, kv_store=None, **extra)
    llm.warm_up()
    llm.recorder = TraceRecorder.live(llm.device, mode=llm.config.mode)
    ids = torch.randint(100, 40000, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate([ids], params)                       # into the prefix cache
    rows: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(args.rounds):
        for name, burn in VARIANTS.items():
            procs = [] if burn is None else [subprocess.Popen([sys.executable, "-c", BURN, str(burn[0])])
                                             for _ in range(burn[1])]
            time.sleep(0.3)
            try:
                rows[name].append(llm.generate([ids], params)[0].stats.decode_tok_s)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    llm.close()
    base = statistics.median(rows["nothing else"])
    print(f"{args.mode} decode on {llm.device} ({args.shape} shape, {args.length} tokens), medians of {args.rounds}:")
    for name, v in rows.items():
        m = statistics.median(v)
        print(f"  {name:18s} {m:7.1f} tok/s ({m / base:.3f}x)  each: {[round(x) for x in v]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
