"""Benchmarks: our modes vs transformers, side by side in one run, medians of repeats.

    python -m bench                                  # CPU, default model: prefill 2K/6K, decode
    python -m bench --shape qwen3-4b --lengths 32768 # GPU, random weights of Qwen3-4B's shape, bf16
    python -m bench --shape qwen3-4b --lengths 32768 --modes gpu,layerwise,chunked --hf-offloaded
    python -m bench --shape qwen3-4b --lengths 32768,131072 --modes gpu,layerwise \
        --policies full,minference,xattention,quest:token_budget=2048 --no-transformers

A policy runs on the same engine as its mode's full (switched between requests, then warmed up as the app does:
`LLM.warm_up`, untimed; the switches' cost is printed after the table); its rows compare with that.

Prompts are random token ids, fresh per repeat (so the prefix cache never helps). Decode is timed from the
first answer token to the last, at a context of the prompt length. Absolute times only mean something on a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

import torch

from app.heap import Collections, freeze
from bench.engines import Ours, OursTraced, Transformers, TransformersOffloaded
from bench.shapes import shape_config
from engine.sparse import get_spec, parse_policy_spec


def _graphs(runner) -> bool:
    """Decode runs as CUDA graph replays: gpu mode's whole step, or the offload modes' layers."""
    return bool(getattr(runner, "graphs", None) or getattr(runner, "decode_graphs", None) is not None)


def main(argv=None) -> int:
    """The bench; a bad setting (a policy's parameter, a mode it has no meaning in, ...) -> one line, exit 2."""
    from engine.errors import KVScopeError
    try:
        return _main(argv)
    except KVScopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--shape", default=None, help="random weights of a real model's shape, e.g. qwen3-4b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--lengths", default=None, help="prompt lengths, comma separated (default 2048,6144 on CPU, "
                   "32768 on GPU); decode is timed at each")
    p.add_argument("--modes", default="gpu", help="our modes, comma separated: gpu,layerwise,chunked")
    p.add_argument("--ring-slots", type=int, default=3, help="offload modes: ring depth")
    p.add_argument("--gpu-kv-budget", type=float, default=None, help="layerwise: device KV budget (GB)")
    p.add_argument("--chunked-block", type=int, default=1024, help="chunked mode: block = chunk size (tokens)")
    p.add_argument("--decode-steps", type=int, default=None, help="tokens timed per decode run (default 32 CPU, 64 GPU)")
    p.add_argument("--text", default=None, metavar="FILE", help="prompts are pieces of this text (\"sample\": the "
                   "bundled sample document) from a random place each run, not random token ids: real attention "
                   "(what sparse prefill policies need); the text repeats when a prompt is longer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    p.add_argument("--hf-offloaded", type=int, default=0, metavar="STEPS",
                   help="also transformers with its offloaded cache, decode timed over STEPS tokens (it is slow)")
    p.add_argument("--policies", default="full", help="sparse policies, comma separated, each name[:key=value...], "
                   "e.g. full,minference:vertical=1000,quest:token_budget=2048 (each where its mode can run it)")
    p.add_argument("--kernels", action="store_true", help="time the sparse prefill kernels alone (one layer, CUDA): "
                   "estimate + kernel vs dense at chosen densities, see bench/kernels.py")
    p.add_argument("--phases", default="prefill,decode", help="what to time: prefill, decode or both")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--trace", action="store_true", help="also run ours with a recording recorder (tracing overhead)")
    p.add_argument("--no-freeze", action="store_true", help="leave the warm engines' objects in Python's full "
                   "collections (the app and the command line freeze them: app/heap.py)")
    p.add_argument("--no-details", action="store_true", help="skip the offload modes' extra runs after the table "
                   "(a traced decode's GB/s, busy and exposed copies; Quest's recall run)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    from engine.paths import output_file_problem
    if args.json and (problem := output_file_problem(args.json, "bench.json")):   # before hours of work
        print(f"error: --json {args.json}: {problem}", file=sys.stderr)
        return 2

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    lengths = [int(x) for x in (args.lengths or ("32768" if on_gpu else "2048,6144")).split(",")]
    if args.kernels:
        from bench.kernels import run
        from engine.models.registry import parse_config
        lines = run(parse_config(shape_config(args.shape or "qwen3-4b")), lengths)
        print("\n".join(lines))
        if args.json:
            _write(args.json, {"kernels": lines})
        return 0
    steps = args.decode_steps or (64 if on_gpu else 32)
    max_len = max(lengths) + steps + 16

    policies = parse_policy_spec(args.policies)
    ours, bases = [], []
    for m in args.modes.split(","):     # one engine per mode, built with its first policy; the others switch
        mine = [(name, params) for name, params in policies if m in get_spec(name).modes]
        bases.append(Ours(args, max_len, m, *mine[0]))
        ours += [bases[-1]] + [bases[-1].variant(name, params) for name, params in mine[1:]]
    engines = ours + ([OursTraced(o) for o in ours] if args.trace else [])   # every mode and policy, traced too
    if not args.no_transformers or args.hf_offloaded:
        hf = Transformers(args, ours[0])
        engines += ([] if args.no_transformers else [hf]) + ([TransformersOffloaded(hf, args.hf_offloaded)]
                                                             if args.hf_offloaded else [])
    gpu = next((o for o in bases if o.mode == "gpu"), None)
    phases = args.phases.split(",")
    measures = [(f"prefill {m} (tok/s)", lambda e, m=m: m / e.prefill_s(m)) for m in lengths if "prefill" in phases]
    measures += [(f"decode @{m} (ms/token)", lambda e, m=m: 1e3 * e.decode_s_per_token(m, steps)) for m in lengths
                 if "decode" in phases]
    if gpu is not None and gpu.llm.runner.graphs:
        n = max(lengths)
        measures.append(("  GPU only, graph replay (ms)", lambda e: 1e3 * e.decode_graph_s(n) if e is gpu else None))
    rows: dict[str, dict[str, float]] = {}
    bare: set[str] = set()                           # rows printed without ratios
    raw: dict[str, dict[str, list[float]]] = {}      # every repeat's value, for the paired ratios
    gcs, gc_lines = Collections(), []       # full collections pause the thread for ~0.2 s on a CUDA engine
    for what, fn in measures:  # engines alternate within each repeat, so drift hits all alike
        print(f"# {what}", file=sys.stderr, flush=True)
        samples: dict[str, list[float]] = {e.name: [] for e in engines}
        step_ms: dict[str, list[float]] = {e.name: [] for e in engines}    # ours: each decode step's wall time
        for e in engines:
            fn(e)  # warm-up
        if not args.no_freeze:   # the warm engines' objects out of later full collections, as the app does
            freeze()
        gcs.label = what
        for _ in range(args.repeats):
            for e in engines:
                value = fn(e)
                if value is not None:
                    samples[e.name].append(value)
                if what.startswith("decode @"):
                    step_ms[e.name] += getattr(e, "step_ms", None) or []
        gcs.label = None
        gc_lines.append(f"{what}: " + gcs.line(what, args.repeats * len(engines), "run"))
        rows[what] = {name: statistics.median(v) for name, v in samples.items() if v}
        raw[what] = samples
        if any(step_ms.values()):  # a mean over an answer against its steps' median: a few slow steps show here
            at = what.split("@")[1].split()[0]
            for label, f in (("median step", statistics.median), ("slowest step", max)):
                row = f"  {label} @{at} (ms)"
                rows[row] = {n: f(v) for n, v in step_ms.items() if v}
                bare.add(row)
            raw[f"  median step @{at} (ms)"] = {n: v for n, v in step_ms.items() if v}   # (every step, in the file)
        print("#   " + ", ".join(f"{n} {v:,.2f}" for n, v in rows[what].items()), file=sys.stderr, flush=True)
        if args.json:             # what is measured so far, should the run be cut short (a lent machine's limit)
            _write(args.json, {"partial": True, "rows": rows, "repeats": raw})
    extra = {"lines": [], "data": {}} if args.no_details else _offload_details(ours, lengths, steps, phases)
    first = ours[0].llm
    desc = (f"{first.model_name} · {first.device} · {str(first.dtype).removeprefix('torch.')} · "
            f"torch {torch.__version__} · graphs {'on' if any(_graphs(o.llm.runner) for o in ours) else 'off'}")
    if first.device.type == "cpu":   # (OMP_WAIT_POLICY=PASSIVE made CPU decode 1.4-1.7x slower: README)
        desc += f" · {torch.get_num_threads()} threads · OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    for e in [e for e in engines if not isinstance(e, Ours)] + bases:   # variants share their base's engine
        e.close()
    gc.collect()

    print(f"\n{desc}\nmedian of {args.repeats} runs after a warm-up, engines alternating (paired: the median of the "
          f"runs' own ratios); decode timed over {steps} tokens ({args.hf_offloaded} for hf-offloaded)\n")
    names = [e.name for e in engines]
    w = {n: max(14, len(n) + 2) for n in names}
    print(f"{'':28}" + "".join(f"{n:>{w[n]}}" for n in names))
    for what, vals in rows.items():
        line = f"{what:28}" + "".join(f"{vals.get(n, float('nan')):>{w[n]},.2f}" for n in names)
        if what in bare:
            print(line)
            continue
        for other in ("transformers", "kvscope"):
            if other in vals and "kvscope" in vals and other != "kvscope":
                line += f"   {_ratio(vals['kvscope'], vals[other], what)} vs {other}"
            if other == "kvscope" and "kvscope" in vals:
                line += "".join(f"   {n} {_ratio(vals[n], vals['kvscope'], what)}" for n in vals
                                if n in ("layerwise", "chunked"))
        line += "".join(f"   {n} {_ratio(vals[n], vals[b], what)} vs {b}{paired(raw[what][n], raw[what][b], what)}"
                        for n in vals if "+" in n and not n.endswith("+trace") and (b := n.split("+")[0]) in vals)
        if "hf-offloaded" in vals and "layerwise" in vals:
            line += f"   layerwise {_ratio(vals['layerwise'], vals['hf-offloaded'], what)} vs hf-offloaded"
        for n in [n for n in vals if n.endswith("+trace") and n.removesuffix("+trace") in vals]:
            base = n.removesuffix("+trace")
            cost = _speedup(vals[base], vals[n], what)          # the untraced run against the traced
            line += f"   tracing costs {base} {100 * (cost - 1):+.1f}%"
        print(line)
    print("\nPython's collections while the runs were timed" + (" (warm engines frozen out of them: app/heap.py)"
          if not args.no_freeze else " (--no-freeze)"))
    for line in gc_lines:
        print(f"  {line}")
    switches = {o.base: o.switch_s for o in bases if o.switch_s}
    if switches:                    # (untimed: a switch warms the new policy up before its runs, as the app does)
        print("policy switches, set_policy + warm_up (s, median): " + ", ".join(
            f"{b} {statistics.median(s):.2f} over {len(s)}" for b, s in switches.items()))
    for line in extra["lines"]:
        print(line)
    if args.json:
        _write(args.json, {"setup": desc, "rows": rows, "repeats": raw, "offload": extra["data"], "switch_s": switches})
    return 0


def _write(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


def _speedup(ours: float, other: float, what: str) -> float:
    return ours / other if "tok/s" in what else other / ours      # rates: higher is faster; times: lower


def _ratio(ours: float, other: float, what: str) -> str:
    r = _speedup(ours, other, what)
    return f"{r:.2f}x {'faster' if r >= 1 else 'slower'}"


def paired(ours: list[float], other: list[float], what: str) -> str:
    """The median of the repeats' own ratios (each repeat runs the engines back to back, so a host that drifts
    between repeats moves both sides of a ratio alike; the ratio of the medians can pair a fast repeat with a slow
    one), as text; empty where the two do not have a value for every repeat."""
    if len(ours) != len(other) or len(ours) < 2:
        return ""
    return f" (paired {statistics.median(_speedup(a, b, what) for a, b in zip(ours, other)):.2f}x)"


PCIE_GBPS = 53.5  # pinned H2D on the H100 of DESIGN.md §5


def _offload_details(ours: list[Ours], lengths: list[int], steps: int, phases: list[str]) -> dict:
    """Peak memory of every engine; for offload modes a traced decode (GB/s, busy, exposed copies) and the
    host->device bytes of one prefill next to the formula."""
    cuda = ours[0].llm.device.type == "cuda"
    lines, data = [""], {}
    if cuda:
        lines.append("peak GPU memory (GiB): " + ", ".join(
            f"{o.name} {o.peak_bytes / 2**30:.2f} (weights+buffers {o.static_bytes / 2**30:.2f})" for o in ours))
        data["peak_gib"] = {o.name: o.peak_bytes / 2**30 for o in ours}
    for o in ours:
        if o.policy in ("minference", "xattention"):      # prefill policies: the density of what ran
            for m in lengths:
                o.prefill_s(m)
                data[f"{o.name}@{m}"] = pol = o.last.policy_stats
                lines.append(f"{o.name} @{m}: attention density {pol.get('density', 1.0):.3f} of dense causal "
                             f"({pol.get('sparse_layers', 0)} sparse layers)")
            continue
        if o.mode == "gpu" or "decode" not in phases:
            continue
        a, dt = o.llm.args, o.llm.dtype
        per_tok = a.kv_bytes_per_token * dt.itemsize
        for m in lengths:
            d = o.decode_trace(m, min(steps, 16))          # (its prefill's and decode's H2D bytes too)
            floor_ms = m * per_tok / PCIE_GBPS / 1e6
            bs = o.llm.config.kv_block_size
            C = -(-m // bs)
            formula = a.num_layers * per_tok // a.num_layers * bs * C * (C - 1) // 2 if o.mode == "chunked" else 0
            d.update(pcie_floor_ms=floor_ms, formula_h2d_gb=formula / 1e9,
                     plan=o.llm.plan.describe() if o.llm.plan is not None else None)
            data[f"{o.name}@{m}"] = d
            floor = f" (PCIe floor {floor_ms:.1f} ms at {PCIE_GBPS} GB/s: {d['ms_per_token_traced'] / floor_ms:.2f}x)"
            lines.append(f"{o.name} @{m}: traced decode {d['ms_per_token_traced']:.1f} ms/token{floor if cuda else ''}, H2D "
                         f"{d['h2d_gbps']:.1f} GB/s, compute busy {100 * d['compute_busy']:.0f}%, exposed copy "
                         f"{d['exposed_copy_ms_per_token']:.1f} ms/token; prefill H2D {d['prefill_h2d_gb']:.2f} GB"
                         + (f" (formula L*b*B*C(C-1)/2 = {d['formula_h2d_gb']:.2f} GB)" if o.mode == "chunked" else ""))
            if o.policy == "quest":                        # recall needs the whole K read back: a separate run
                o._run(m, 9, recall=True)
                d.update({k: v for k, v in o.last.policy_stats.items()})
                lines.append(f"  quest: H2D {d['decode_h2d_gb_per_token']:.3f} GB/token (full: {m * per_tok / 1e9:.3f}); "
                             f"recall {d.get('recall', 1.0):.3f} (the speculation alone "
                             f"{d.get('recall_speculative', 1.0):.3f}), worst head {d.get('recall_min_head', 1.0):.3f}; "
                             f"pages fetched by the correction per step and layer "
                             f"{d.get('fetched_pages_per_step', 0.0):.1f}; "
                             "per layer " + " ".join(f"{r:.2f}" for r in d.get("recall_per_layer", {}).values()))
        if o.llm.plan is not None:
            lines.append(f"  {o.llm.plan.describe()}")
    return {"lines": lines, "data": data}


if __name__ == "__main__":
    sys.exit(main())
