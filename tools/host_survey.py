"""How steady a GPU host is, CPU by CPU: what the spread of the offload modes' benchmarks is made of.

    python tools/host_survey.py [--cpus 0-15] [--rounds 1]

For each CPU, in a fresh process pinned there: host-to-device copies of 256 MiB from pinned memory allocated on that
CPU (median and slowest of 8: the offload modes' decode is bound by these on a small model), a fixed Python loop (best
of 7: their per-layer host loop runs at this pace) and the time to launch a small kernel. One NUMA node or several,
a CPU's speed that moves from one pass to the next, copies that sometimes crawl: each shows here as a column.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from app_overhead import cpu_set   # (tools/ is the script's own folder on sys.path)

MIB = 1 << 20


def probe() -> str:
    import torch
    n = 256 * MIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    gbs = []
    for i in range(11):
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()
        if i >= 3:                                          # the first copies warm up the path
            gbs.append(n / (time.perf_counter() - t) / 1e9)
    loops = []
    for _ in range(7):
        t, x = time.perf_counter(), 0
        for i in range(300_000):
            x += i * i % 7
        loops.append(time.perf_counter() - t)
    small = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3000):
        small.add_(1)
    torch.cuda.synchronize()
    launch = (time.perf_counter() - t) / 3000
    return (f"H2D {statistics.median(gbs):5.1f} GB/s (slowest {min(gbs):5.1f})   Python loop {min(loops) * 1e3:5.1f} ms"
            f"   launch {launch * 1e6:5.2f} us")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", type=lambda text: sorted(cpu_set(text)), default=sorted(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=1, help="passes over the CPUs (a CPU's speed may move between them)")
    ap.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)   # (the child: pinned, measures)
    args = ap.parse_args()
    if args.probe is not None:
        os.sched_setaffinity(0, {args.probe})
        print(probe())
        return 0
    import torch
    if not torch.cuda.is_available():
        print("host_survey: no CUDA GPU here: it measures a GPU host's copies and CPUs", file=sys.stderr)
        return 2
    for r in range(args.rounds):
        for cpu in args.cpus:
            out = subprocess.run([sys.executable, __file__, "--probe", str(cpu)], capture_output=True, text=True)
            line = out.stdout.strip() or "failed: " + (out.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"pass {r + 1}, CPU {cpu:3d}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
