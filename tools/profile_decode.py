"""Where a decode step's time goes: torch.profiler over a few steps, top ops by CPU and CUDA time, host syncs.

    python tools/profile_decode.py --shape qwen3-4b --ctx 32768 --mode layerwise --policy quest
    python tools/profile_decode.py --shape qwen3-4b --ctx 32768 --mode layerwise --syncs   # host syncs per step
    python tools/profile_decode.py --shape qwen3-4b --ctx 131072 --policy quest --params '{"token_budget": 2048}' \
        --gpu-kv-budget 2.7 --layers                   # one steady step's timeline, per layer (CUDA events)
    python tools/profile_decode.py ... --wall --steps 24   # steady steps' wall time, and when the host is done issuing
    python tools/profile_decode.py ... --wall --host       # and the host time per step of the layer loop's parts
    python tools/profile_decode.py --ctx 16384 --max-model-len 131072 ... --wall   # a short prompt, a long limit

`--syncs` profiles the steps with Python stacks and counts, per decode step, the calls that block the host
(cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy) and the copies
from pageable memory, split into those made inside the layer loop (under the runner's forward) and the rest
(sampling reads the token once per step: that one is expected).
"""
import argparse
import contextlib
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench.shapes import shape_config
from engine import LLM, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--mode", default="layerwise")
    p.add_argument("--policy", default="full")
    p.add_argument("--params", default="{}", help="policy parameters as JSON")
    p.add_argument("--max-model-len", type=int, default=0, help="the engine's context limit (default: ctx + 64); a "
                   "longer one than the prompt needs shows what a short document costs under a long-context model")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=8, help="decode steps before any timing (CUDA graphs are captured on "
                   "a layer's second use of a ring slot: with 3 slots, in the first ~6 steps)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (the split then sees attention's kernels)")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--gpu-kv-budget", default=None, help="layerwise: device KV budget in GB")
    p.add_argument("--python", action="store_true", help="cProfile the host side instead (python functions)")
    p.add_argument("--syncs", action="store_true", help="count host syncs and pageable copies per step, in and out "
                   "of the layer loop")
    p.add_argument("--split", action="store_true", help="GPU time per step by part, from the kernels' names: the "
                   "policy's scoring and selection, the row gathers (loads and corrections), attention, the GEMVs, the "
                   "rest; the step's host-to-device bytes at PCIe's pace (the copy floor); and the step's wall time")
    p.add_argument("--layers", action="store_true", help="one steady step's timeline per layer, from the engine's own "
                   "trace (every step timed): each layer's compute span and its wait for copies, and the copy lane's "
                   "spans (where the step's time goes, layer by layer)")
    p.add_argument("--wall", action="store_true", help="each steady step's wall time (median, min, each step) and "
                   "when the host was done issuing its first layer (the GPU idles until then: the previous step "
                   "ended in a sync) and all of them (the model's last layer left the runner): a host done early "
                   "means the GPU's own chain sets the pace")
    p.add_argument("--host", action="store_true", help="with --wall: the host time per step of the layer loop's "
                   "parts (HOST_PARTS), each timed around its call (inclusive, so nested parts count in both)")
    p.add_argument("--ops-out", default=None, help="with --split: save the profiled GPU ops and CUDA runtime calls "
                   "(JSON) to study the gaps")
    p.add_argument("--trace", action="store_true", help="with a recorder on, as the app records (LIVE_DETAIL_HZ)")
    p.add_argument("--no-step-graphs", action="store_true", help="layerwise: no whole-step CUDA graphs (recorded "
                   "where >= 32 steps alike may follow: engine/offload/step_graphs.py)")
    a = p.parse_args()
    llm = LLM(shape=shape_config(a.shape), max_model_len=a.max_model_len or a.ctx + 64, mode=a.mode,
              policy=a.policy, policy_params=json.loads(a.params), enforce_eager=a.eager,
              **({"gpu_kv_budget_gb": float(a.gpu_kv_budget)} if a.gpu_kv_budget else {}))
    if a.no_step_graphs and getattr(llm.runner, "step_graphs", None) is not None:
        llm.runner.step_graphs.enabled = False
    if a.trace or a.layers:
        from engine.trace import TraceRecorder
        llm.recorder = TraceRecorder(device=llm.device) if a.layers else TraceRecorder.live(llm.device, mode=llm.config.mode)
    prompt = torch.randint(0, llm.args.vocab_size, (a.ctx,)).tolist()
    seq = llm.add_request(prompt, SamplingParams(max_tokens=a.warm + 2 * a.steps + 4, ignore_eos=True))
    llm.step()                                     # prefill
    for _ in range(a.warm):                        # warm-up decode steps
        llm.step()
    sync()
    if a.wall:
        with host_timer(a.host) as host:
            wall_report(llm, a.steps)
        host(a.steps)
        return
    if a.layers:
        for _ in range(a.steps):
            llm.step()
        llm.recorder.flush()
        layer_report([s for s in llm.recorder.steps if s.phase == "decode"][-a.steps:])
        return
    if a.python:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            llm.step()
        sync()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(a.rows)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(a.rows)
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if a.syncs or a.split:
        import time
        t0 = time.perf_counter()
        for _ in range(a.steps):                   # unprofiled, for the wall time
            llm.step()
        sync()
        wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
        if a.syncs:
            label_calls()                          # (--split goes by kernel names, it needs no ranges)
        with profile(activities=acts) as prof:
            for _ in range(a.steps):
                llm.step()
            sync()
        if a.syncs:
            sync_report(prof, a.steps)
        if a.split:
            split_report(prof, a.steps, wall_ms, getattr(llm.runner, "last_step_bytes", (0, 0))[0], a.ops_out)
        return
    with profile(activities=acts) as prof:
        for _ in range(a.steps):
            llm.step()
        sync()
    ev = prof.key_averages()
    print(ev.table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if torch.cuda.is_available():
        print(ev.table(sort_by="self_cuda_time_total", row_limit=a.rows))
    syncs = [e for e in ev if "Synchronize" in e.key or "cudaMemcpy" == e.key or "item" in e.key or "_local_scalar" in e.key]
    for e in syncs:
        print(f"{e.key}: {e.count} calls, {e.cpu_time_total / 1e3:.1f} ms")
    print(f"steps: {a.steps}; seq {seq.seq_id} at {len(seq)} tokens")


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LOOP = "kvscope: layer loop"
# the ranges --syncs labels its calls with: (label, [(module, owner, attribute), ...]); a call counts for the
# innermost label above it (--split goes by kernel names: KERNEL_PARTS)
PARTS = (("score (page bounds)", [("engine.sparse.quest", "QuestPolicy", "bounds")]),
         ("select + correction (policy)", [("engine.sparse.policy", "SparsePolicy", "observe_query"),
                                           ("engine.sparse.quest", "QuestPolicy", "observe_query"),
                                           ("engine.sparse.quest", "QuestPolicy", "observe_ahead"),
                                           ("engine.sparse.quest", "QuestPolicy", "plan_load")]),
         ("gather / copy (loads, corrections)", [("engine.offload.offload_engine", "OffloadEngine", "load_rows"),
                                                 ("engine.offload.offload_engine", "OffloadEngine", "fix_rows"),
                                                 ("engine.offload.offload_engine", "OffloadEngine", "fetch_rows"),
                                                 ("engine.offload.offload_engine", "OffloadEngine", "load")]),
         ("attention", [("engine.offload.layerwise", None, "decode_attention"),
                        ("engine.offload.decode_graphs", None, "decode_attention")]))


def label_calls() -> None:
    """Wrap the functions PARTS names (and the runners' forward: the layer loop) in profiler ranges: torch 2.11's
    profiler gives no Python stacks to the ops, so kernels are attributed through these ranges."""
    import functools

    from torch.profiler import record_function

    def wrap(name):
        def make(fn, place):
            @functools.wraps(fn)
            def inner(*args, **kw):
                with record_function(name):
                    return fn(*args, **kw)
            return inner
        return make

    parts = PARTS + ((LOOP, [("engine.offload.layerwise", "LayerwiseRunner", "forward"),
                             ("engine.offload.chunked", "ChunkedRunner", "forward")]),)
    for name, places in parts:
        wrap_places(places, wrap(f"kvscope: {name}"))


def wrap_places(places, make) -> list:
    """Replace each (module, class or None, attribute) that the class (or module) itself defines with
    make(fn, place) -> [(target, attribute, the original)], to put them back."""
    import importlib
    saved = []
    for mod, owner, attr in places:
        target = importlib.import_module(mod)
        target = getattr(target, owner) if owner else target
        if attr in vars(target):
            fn = getattr(target, attr)
            saved.append((target, attr, fn))
            setattr(target, attr, make(fn, (mod, owner, attr)))
    return saved


def _labels(e) -> list[str]:
    """The kvscope ranges around a profiler event, innermost first."""
    out = []
    while e is not None:
        if e.name.startswith("kvscope: "):
            out.append(e.name)
        e = e.cpu_parent
    return out


def sync_report(prof, steps: int) -> None:
    counts = {("sync", True): 0, ("sync", False): 0, ("pageable", True): 0, ("pageable", False): 0}
    names: dict[tuple, int] = {}
    for e in prof.events():
        kinds = []
        if e.name in SYNC_CALLS:
            kinds.append(("sync", e.name))
        kinds += [("pageable", k.name) for k in getattr(e, "kernels", []) if "Pageable" in k.name]
        for kind, name in kinds:
            labels = _labels(e)
            inside = LOOP in labels
            counts[(kind, inside)] += 1
            key = (kind, name, "layer loop" if inside else "outside", labels[0] if labels else "")
            names[key] = names.get(key, 0) + 1
    print(f"per decode step over {steps} steps:")
    print(f"  host syncs inside the layer loop: {counts[('sync', True)] / steps:g}; outside: "
          f"{counts[('sync', False)] / steps:g}")
    print(f"  pageable copies inside the layer loop: {counts[('pageable', True)] / steps:g}; outside: "
          f"{counts[('pageable', False)] / steps:g}")
    for key, n in sorted(names.items(), key=lambda kv: -kv[1]):
        print(f"  {n / steps:g}/step  {key[0]}: {key[1]} ({key[2]}) {key[3]}")


# the layer loop's parts --host times: (module, class, method); a part's time includes the parts it calls
HOST_PARTS = [("engine.offload.layerwise", "LayerwiseRunner", m) for m in
              ("forward", "_prefetch", "_load", "_observe", "_place_newest", "_after_layer")] + \
             [("engine.offload.runner", "OffloadRunner", m) for m in ("_query_fix", "_logits")] + \
             [("engine.sparse.quest", "QuestPolicy", m) for m in ("plan_load", "observe_query", "observe_ahead", "_run",
                                                                  "on_kv_written", "end_step")] + \
             [("engine.offload.offload_engine", "OffloadEngine", m) for m in ("load_rows", "ahead", "release")] + \
             [("engine.offload.streams", "CopyStream", "copy"),
              ("engine.offload.decode_graphs", "DecodeGraphs", "run"),
              ("engine.offload.decode_graphs", "DecodeGraphs", "_replay"),
              ("engine.ops.triton_gather", None, "gather_rows")]


@contextlib.contextmanager
def host_timer(on: bool):
    """Wrap HOST_PARTS in timers while the block runs; yields report(steps) (prints ms per step and calls)."""
    import time
    spent: dict[str, list] = {}

    def timer(fn, place):
        acc = spent.setdefault(f"{place[1] or place[0]}.{place[2]}", [0, 0])    # ns, calls

        def timed(*args, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kw)
            finally:
                acc[0] += time.perf_counter_ns() - t0
                acc[1] += 1
        return timed
    saved = wrap_places(HOST_PARTS if on else [], timer)

    def report(steps: int) -> None:
        if spent:
            print(f"host time per step, each part timed around its call (inclusive), over {steps} steps:")
        for name, (ns, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
            if calls:
                print(f"  {name:40s} {ns / steps / 1e6:7.3f} ms  {calls / steps:5.1f} calls")
    try:
        yield report
    finally:
        for o, attr, fn in saved:
            setattr(o, attr, fn)


def wall_report(llm, steps: int) -> None:
    import statistics
    import time

    from engine.offload.runner import OffloadRunner
    from engine.step import StepContext
    issued: list[float] = []
    first: list[float] = []
    logits, layer_done = OffloadRunner._logits, StepContext.layer_done

    def timed_logits(self, *args, **kw):           # the layer loop has been issued when the logits are
        issued.append(time.perf_counter())
        return logits(self, *args, **kw)

    def timed_layer_done(self, done, total):       # the step's first layer issued (after layers run ahead)
        if not first:
            first.append(time.perf_counter())
        return layer_done(self, done, total)
    OffloadRunner._logits, StepContext.layer_done = timed_logits, timed_layer_done
    walls, hosts, starts = [], [], []
    ahead = getattr(llm.runner, "ahead", None)
    ahead0 = ahead.steps if ahead is not None else 0
    for _ in range(steps):
        issued.clear()
        first.clear()
        t0 = time.perf_counter()
        llm.step()
        walls.append((time.perf_counter() - t0) * 1e3)
        hosts.append((issued[0] - t0) * 1e3 if issued else float("nan"))
        starts.append((first[0] - t0) * 1e3 if first else float("nan"))
    OffloadRunner._logits, StepContext.layer_done = logits, layer_done
    h2d = getattr(llm.runner, "last_step_bytes", (0, 0))[0] / 1e6       # (gpu mode: none)
    print(f"{steps} steady steps: {statistics.median(walls):.2f} ms/step (median; min {min(walls):.2f}); the host done "
          f"issuing the first layer after {statistics.median(starts):.2f} ms and all of them after "
          f"{statistics.median(hosts):.2f} ms (medians; before its first layer the GPU waits on the host); H2D "
          f"{h2d:.1f} MB in the last step")
    print("  each step (ms):", " ".join(f"{w:.1f}" for w in walls))
    if ahead is not None:
        print(f"  steps whose first layers ran ahead (engine/offload/step_ahead.py): {ahead.steps - ahead0} of {steps}")
    st = llm.runner.policy.stats() if llm.runner.policy is not None else {}
    if "fetched_pages_per_step" in st:
        print(f"  per sparse layer and kv head, of {st['pages_per_head']} pages: the correction fetched "
              f"{st['fetched_pages_per_step']:.1f}, the guess one layer ahead {st['fetched_ahead_pages_per_step']:.1f}"
              f" (mean over the run); speculating layers {st['speculating_layers']} of {st['choosing_layers']}")


def layer_report(steps) -> None:
    """Per layer, medians over the steps: the compute span (the layer's work on the compute stream, from the end of
    its wait to its end), the wait for its copies before it, and what the copy lane moved for it."""
    import statistics
    rows: dict[int, dict[str, list[float]]] = {}
    for s in steps:
        for sp in s.spans:
            if sp.layer is None or sp.lane == "host" or sp.lane == "compute" and sp.name in ("attention", "mlp"):
                continue                                  # (the CPU path's parts of a layer: inside its span)
            kind = ("wait" if sp.name == "wait for copy" else "compute") if sp.lane == "compute" else sp.lane
            per = rows.setdefault(sp.layer, {}).setdefault(kind, [0.0] * len(steps))
            per[steps.index(s)] += sp.dur_us
    walls = [s.dur_us / 1e3 for s in steps]
    print(f"{len(steps)} steps: {statistics.median(walls):.2f} ms/step (median; traced, every step timed)")
    kinds = sorted({k for r in rows.values() for k in r})
    print("layer " + "".join(f"{k + ' µs':>14}" for k in kinds))
    total = dict.fromkeys(kinds, 0.0)
    for layer in sorted(rows):
        med = {k: statistics.median(rows[layer].get(k, [0.0])) for k in kinds}
        for k in kinds:
            total[k] += med[k]
        print(f"{layer:5d} " + "".join(f"{med[k]:14.0f}" for k in kinds))
    print("sum   " + "".join(f"{total[k] / 1e3:11.2f} ms" for k in kinds))


# the split's parts, by kernel name (CUDA graph replays give the profiler no Python ranges to attribute by):
# (part, name fragments); a kernel counts for the first part one of whose fragments its name holds
KERNEL_PARTS = (("score (page bounds, sketch)", ("_page_bounds_kernel", "_sketch_scores_kernel")),
                ("select + correction", ("_stats_kernel", "_chunk_kernel", "_merge_kernel", "_correct_kernel")),
                ("gather / copy (loads, corrections)", ("_gather_rows_kernel", "Memcpy HtoD")),
                ("attention", ("_split_kernel", "_reduce_kernel", "flash", "fmha", "attention", "_vs_kernel",
                               "_bs_kernel")),
                ("projections and MLP (GEMVs)", ("_gemv_kernel", "gemv", "nvjet", "gemm", "splitKreduce")))
PCIE_GBS = 53.5   # the H100 machine's pinned host-to-device copy pace, 1 GiB (DESIGN.md)


def split_report(prof, steps: int, wall_ms: float, h2d_bytes: int, ops_out: str | None = None) -> None:
    """Each GPU kernel's (and copy's) time per step by part (KERNEL_PARTS), the compute stream's busy time, and the
    step's host-to-device bytes at PCIe's pace: the copy floor."""
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    if ops_out:                      # the GPU's ops and the host's runtime calls, to study the gaps offline
        with open(ops_out, "w") as f:
            json.dump([e for e in events if e.get("ph") == "X" and e.get("cat") in
                       ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver")], f)
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    totals: dict[str, float] = {}
    streams: dict = {}
    for e in ops:
        part = next((name for name, frags in KERNEL_PARTS if any(f in e["name"] for f in frags)),
                    "the rest (norms, rotary, small copies)")
        totals[part] = totals.get(part, 0.0) + e["dur"] / 1e3                   # µs -> ms
        streams[e["tid"]] = streams.get(e["tid"], 0.0) + e["dur"] / 1e3
    busiest = max(streams.values(), default=0.0)
    print(f"per decode step over {steps} steps: {wall_ms:.2f} ms/token unprofiled; GPU busy (kernels and copies, all "
          f"streams) {sum(totals.values()) / steps:.2f} ms, the busiest stream {busiest / steps:.2f} ms")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:45} {ms / steps:8.3f} ms")
    print(f"  host-to-device {h2d_bytes / 1e6:.1f} MB in the last step: {h2d_bytes / PCIE_GBS / 1e6:.2f} ms at "
          f"{PCIE_GBS:g} GB/s (the copy floor)")
    gaps_report([e for e in ops if e["tid"] == max(streams, key=streams.get)], steps)


def gaps_report(ops: list, steps: int, rows: int = 10) -> None:
    """Where the busiest stream waits: its idle time between two ops, by the pair of kernels around it (a wait for
    another stream's copy, for the host's next launch, or the step's end and the sampler's sync)."""
    ops = sorted(ops, key=lambda e: e["ts"])
    short = lambda e: e["name"].split("(")[0].split("<")[0][-40:]           # noqa: E731
    by_pair: dict[tuple, list] = {}
    for a, b in zip(ops, ops[1:]):
        gap = b["ts"] - a["ts"] - a["dur"]
        if gap > 1.0:                                                          # µs
            by_pair.setdefault((short(a), short(b)), []).append(gap)
    total = sum(sum(g) for g in by_pair.values())
    print(f"  the busiest stream idle {total / steps / 1e3:.2f} ms a step between its ops (gaps > 1 us), by the ops "
          "around the gap:")
    for (a, b), g in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"    {sum(g) / steps:8.1f} us ({len(g) / steps:5.1f} a step)  {a} -> {b}")


if __name__ == "__main__":
    main()
