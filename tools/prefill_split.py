"""Where a prefill's time goes: attention against the rest, dense and sparse, and what that allows a sparse policy.

    python tools/prefill_split.py [--length 7000] [--policies full,xattention] [--repeats 3] [--device cpu]

One engine (the default model unless `--model`, gpu mode) prefills `--length` tokens of the bundled sample document
(repeated as needed) once per policy per round, the policies alternating, with each layer's attention call timed by
hand (perf_counter around it, the device synchronised on CUDA): dense causal attention in the engine's own call, a
sparse prefill policy's whole `prefill_attention` (its estimate, its table and its attention; a layer its gate runs
dense included), and within it the policy's `estimate` (the index building: MInference's vertical-slash estimate,
XAttention's antidiagonal scoring), timed the same way. The rest (projections, MLP, norms, rotary, sampling) is the
prefill's time less that. Medians per policy, each sparse one's speed-up over the first policy of the list, and the
ceiling: the speed-up its attention would give if the rest cost what it costs now, and what the attention's share of
dense would have to be for 1.5x.
Time to first token here is the wall time of `generate(max_tokens=1)`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=7000)
    p.add_argument("--policies", default="full,xattention", help="comma separated, each name[:key=value...]; the "
                   "first is the baseline")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--goal", type=float, default=1.5, help="the speed-up whose attention share is printed")
    args = p.parse_args(argv)

    import torch

    import engine.ops.attention as ops
    from app.samples import SAMPLE
    from engine import LLM, SamplingParams
    from engine.defaults import default_model_dir
    from engine.sparse import parse_policy_spec, policy_class
    from engine.sparse.policy import SparsePrefillPolicy

    policies = parse_policy_spec(args.policies)
    spent = [0.0, 0.0]      # attention, of which the estimate

    def timed(fn, i=0):
        def run(*a, **k):
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[i] += time.perf_counter() - t
            return out
        return run

    llm = LLM(args.model or str(default_model_dir()), device=args.device, mode="gpu",
              max_model_len=args.length + 64)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    dense, sparse = ops.causal_attention, SparsePrefillPolicy.prefill_attention
    ops.causal_attention = timed(dense)                                     # the dense path's one call per layer
    SparsePrefillPolicy.prefill_attention = timed(sparse)                   # a sparse layer, whole
    prefill = [cls for cls in map(policy_class, (name for name, _ in policies)) if issubclass(cls, SparsePrefillPolicy)]
    owners = {next(c for c in cls.__mro__ if "estimate" in c.__dict__) for cls in prefill}   # (inherited: its owner)
    estimates = {cls: cls.estimate for cls in owners - {SparsePrefillPolicy}}
    for cls, fn in estimates.items():
        cls.estimate = timed(fn, 1)                                         # ... and its estimate within it
    text = llm.tokenizer.encode(Path(SAMPLE).read_text(encoding="utf-8"))
    ids = (text * (1 + args.length // len(text)))[:args.length]
    runs: dict[str, list[tuple[float, float, float]]] = {}
    density: dict[str, float | None] = {}
    try:
        for _ in range(args.repeats + 1):                                   # the first round warms up, untimed
            for label, (name, params) in zip(args.policies.split(","), policies):
                llm.set_policy(name, params)
                spent[:] = [0.0, 0.0]
                sync()
                t = time.perf_counter()
                out = llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0]
                sync()
                runs.setdefault(label, []).append((time.perf_counter() - t, *spent))
                density[label] = out.stats.policy_stats.get("density")
    finally:
        ops.causal_attention, SparsePrefillPolicy.prefill_attention = dense, sparse
        for cls, fn in estimates.items():
            cls.estimate = fn
        llm.close()
    base = None
    print(f"{args.length} tokens, {llm.device.type}, medians of {args.repeats} (s): total = attention + rest")
    for label, got in runs.items():
        got = got[1:]
        total, attn = statistics.median(t for t, _, _ in got), statistics.median(a for _, a, _ in got)
        rest, est = statistics.median(t - a for t, a, _ in got), statistics.median(e for _, _, e in got)
        d = f", density {density[label]:.3f}" if density[label] is not None else ""
        e = f", estimate {est:.3f} ({est / total:.1%} of the prefill)" if est else ""
        line = f"  {label}: {total:.2f} = {attn:.2f} + {rest:.2f}{d}{e}"
        if base is None:
            base = (total, attn, rest)
            need = (total / args.goal - rest) / attn
            line += (f"  (for {args.goal}x a sparse policy's attention must take <= {need:.2f} of this attention's "
                     f"time, the rest as it is)")
        else:
            line += (f"  {base[0] / total:.2f}x; its attention {attn / base[1]:.2f} of dense; with no attention at "
                     f"all {base[0] / rest:.2f}x")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
