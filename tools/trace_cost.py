"""What watching costs a decode, step by step: one engine, turns taken in turn with and without a recorder.

    python tools/trace_cost.py --shape smollm2-135m --ctx 6144 --mode layerwise --turns 6 --steps 64
    python tools/trace_cost.py --shape qwen3-4b --ctx 32768 --mode layerwise --policy quest:token_budget=2048

Variants (the order rotates every round, each turn a fresh random prompt; each variant's recorder lives the whole
run, as the app's worker keeps one: `--fresh` makes a new one per turn, whose prefill then creates its CUDA events):
  plain   no recorder
  live    the app's recorder (TraceRecorder.live: a per-layer timeline LIVE_DETAIL_HZ times a second; on a CPU and
          in the offload modes on CUDA LOW_DETAIL_HZ)
  lean    the same recorder with no per-layer timeline in decode (metrics, picks, host spans only)
  full    a timeline in every step
  send    `live`, each step sent as the app's engine process sends it (app/outbox.py: a thread of its own
          pickles batches into a pipe) to another process that reads them (as the window's process does)
  record  `live`, and the turn then saved as a recording (`--record`: app/record.py, engine/trace/recording.py),
          the write's time counted in the whole turn
Per variant, medians over turns: the turn's decode ms/token as `generate` reports it (first to last token), the
whole turn (the prefill step, every decode step and, for `record`, the write), the prefill step (time to first
token), the first decode step (it reads the prefill's trace), the steady steps, and for `live` the detailed and the
other steps apart. So the cost splits into a fixed part per step, the timeline's
part and the first step's part (reading the prefill's timeline: a chunked prefill's first, middle and last chunks
at a detail rate, `full` every chunk).
`--profile VARIANT` adds a cProfile of that variant's last turn (the host functions, by own time).
`--blocks N` measures the steady steps alone, with less of the host's drift: one long answer, the recorder swapped
every N steps (the variants in turn, the order rotating every round, 5 steps after each swap not timed); per variant
the median over rounds of each block's median step and of its mean step (the mean counts the detailed steps too),
and each block's mean against the same round's `plain` one; also the engine thread's CPU time per step, paired the
same way (on a CPU the work watching adds; on CUDA the thread spins while it waits for the GPU, so there it reads as
the wall time: H100, 11.52 ms CPU in an 11.52 ms Quest step).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import heap  # noqa: E402
from app.record import Conversation, model_info  # noqa: E402 - the recording as `chat --record` makes it
from bench.shapes import shape_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.sparse import parse_policy_spec  # noqa: E402
from engine.trace import TraceRecorder  # noqa: E402
from engine.trace.recording import save_recording  # noqa: E402

VARIANTS = ("plain", "live", "lean", "full", "send", "record")
OUTBOX: list = []         # `send`: the app's outbox, its pipe read by another process (made once, in main)


def _read_all(conn) -> None:
    """The window's side of the pipe, as far as the engine's process can tell: every batch read (unpickled)."""
    while True:
        try:
            conn.recv()
        except EOFError:
            return


RECORDERS: dict = {}            # one recorder per variant for the whole run, as the app's worker keeps one (--fresh: not)


def recorder(variant: str, device, mode: str, fresh: bool = False):
    """The variant's recorder: the same one turn after turn (its pool of timing events filled by the first turns, as
    in the app), or with `fresh` a new one per turn (each prefill then creates its CUDA events: ~100-300)."""
    if variant == "plain":
        return None
    if not fresh and variant in RECORDERS:
        return RECORDERS[variant]
    if variant == "send":
        rec = TraceRecorder.live(device, mode=mode, on_step=OUTBOX[0].append)
    else:
        hz = {"live": None, "record": None, "lean": 1e-9, "full": 1e9}[variant]
        rec = TraceRecorder.live(device, mode=mode) if hz is None else TraceRecorder(max_steps=512, device=device,
                                                                                    detail_hz=hz)
    RECORDERS[variant] = rec
    return rec


SAME_PROMPT: list[int] = []     # --same-prompt: one prompt for every turn (its KV in the prefix cache after the first)
QUESTION = [16]                 # ... but its last this many tokens (--question)


FRESH = [False]                 # --fresh


def turn(llm: LLM, variant: str, ctx: int, steps: int, gen: torch.Generator, prof=None) -> dict:
    rec = recorder(variant, llm.device, llm.config.mode, FRESH[0])
    first = rec.steps[-1].step + 1 if rec is not None and rec.steps else 0     # this turn's steps: from this number
    llm.recorder = rec
    try:
        prompt = torch.randint(0, llm.args.vocab_size, (ctx,), generator=gen).tolist()
        if SAME_PROMPT:                            # (the generator still moves: the variants' turns stay alike)
            prompt = SAME_PROMPT[:ctx - QUESTION[0]] + prompt[-QUESTION[0]:]   # a cached document, a new question
        seq = llm.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        t0 = time.perf_counter()
        llm.step()                                     # prefill (its trace is read in the first decode step)
        prefill = (time.perf_counter() - t0) * 1e3
        times = []
        if prof is not None:
            prof.enable()
        while not seq.is_finished:
            t0 = time.perf_counter()
            llm.step()
            times.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            prof.disable()
        if rec is not None:
            rec.flush()
        write = save(llm, rec, seq, first) if variant == "record" else 0.0
    finally:
        llm.recorder = None
    out = {"turn": (seq.t_last_token - seq.t_first_token) * 1e3 / steps, "whole": prefill + sum(times) + write,
           "prefill": prefill, "first": times[0], "steady": statistics.median(times[1:]), "write": write}
    if rec is not None:
        pre = [s for s in rec.steps if s.phase == "prefill"][-1]
        out["prefill_records"] = len(pre.spans) + len(pre.slots)
    if variant == "live":   # decode steps in order: which got a timeline
        flags = [s.detailed for s in rec.steps if s.phase == "decode"][-len(times):]
        det = [t for t, d in zip(times, flags) if d][1:]
        rest = [t for t, d in zip(times, flags) if not d][1:]
        out.update(detailed=statistics.median(det) if det else float("nan"), n_detailed=len(det),
                   other=statistics.median(rest) if rest else float("nan"))
    return out


def save(llm: LLM, rec, seq, first: int) -> float:
    """The turn as `chat --record` saves it (no document: random tokens), into an existing folder (a temporary one,
    made and removed outside the time): ms."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        info = model_info(llm)
        conv = Conversation()
        steps = [s for s in rec.steps if s.phase in ("prefill", "decode") and s.step >= first]
        conv.end_turn("(random tokens)", "", {"prompt_tokens": seq.num_prompt_tokens}, {"mode": llm.config.mode},
                      steps)
        save_recording(conv.recording("", {"device": str(llm.device), "app": {"model": info}}), Path(d) / "t.kvscope")
        return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: --shape with random weights)")
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--ctx", type=int, default=6144)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--turns", type=int, default=6, help="rounds; each runs every variant once")
    p.add_argument("--mode", default="layerwise")
    p.add_argument("--policy", default="full", help="name[:key=value...]")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", default=None, choices=VARIANTS, help="cProfile this variant's last turn")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--same-prompt", action="store_true", help="every turn the same prompt but its last --question tokens (as "
                   "the app's turns about one document: its KV in the prefix cache, the question prefilled)")
    p.add_argument("--fresh", action="store_true", help="a new recorder every turn (the app keeps one: its pool of "
                   "CUDA timing events is then filled; a fresh one creates each event its prefill records)")
    p.add_argument("--question", type=int, default=16, help="--same-prompt: the new tokens at the end of each turn's "
                   "prompt (e.g. 220: a question of the app's chat template over a cached document)")
    p.add_argument("--blocks", type=int, default=0, help="steps per block: the steady steps of one answer, the "
                   "recorder swapped every block (see above); --turns rounds")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the engine is warm (as the app's engine "
                   "process and the command line do): full collections then skip what the engine holds")
    p.add_argument("--gc-off", action="store_true", help="no automatic collection once the engine is warm (one "
                   "between turns, outside the times): what the collections cost a turn")
    a = p.parse_args()
    FRESH[0] = a.fresh
    (name, params), = parse_policy_spec(a.policy)
    kw = {"kv_block_size": a.block_size} if a.block_size else {}
    variants = a.variants.split(",")
    rounds_steps = a.turns * len(variants) * (a.blocks + 5) + 40 if a.blocks else 0   # --blocks: one answer
    llm = LLM(a.model, shape=None if a.model else shape_config(a.shape),
              max_model_len=a.ctx + max(a.steps, rounds_steps) + 8, mode=a.mode, policy=name, policy_params=params,
              max_num_seqs=1, **kw)
    if "send" in variants:
        import multiprocessing as mp
        from app.outbox import Outbox
        reader, writer = mp.Pipe(duplex=False)
        mp.get_context("spawn").Process(target=_read_all, args=(reader,), daemon=True).start()
        OUTBOX.append(Outbox(writer))
    if a.blocks:
        return blocks(llm, a, variants, rounds_steps)
    gen = torch.Generator().manual_seed(0)
    if a.same_prompt:
        SAME_PROMPT[:] = torch.randint(0, llm.args.vocab_size, (a.ctx,), generator=gen).tolist()
        QUESTION[0] = a.question
    turn(llm, "plain", a.ctx, 8, gen)                  # warm-up: kernels, graphs
    turn(llm, "live", a.ctx, 8, gen)
    tally = collections(a)
    res: dict[str, list[dict]] = {v: [] for v in variants}
    prof = None
    for r in range(a.turns):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            tally.label = v
            if a.profile == v and r == a.turns - 1:
                import cProfile
                prof = cProfile.Profile()
                res[v].append(turn(llm, v, a.ctx, a.steps, gen, prof))
            else:
                res[v].append(turn(llm, v, a.ctx, a.steps, gen))
            tally.label = None
            if a.gc_off:
                gc.collect(1)
    print(f"{llm.device} {a.mode} {a.policy} ctx {a.ctx}, {a.steps} decode steps, {a.turns} turns per variant "
          "(ms; medians over turns)")
    base = statistics.median(t["turn"] for t in res["plain"]) if "plain" in res else None
    base_pre = statistics.median(t["prefill"] for t in res["plain"]) if "plain" in res else None
    base_whole = statistics.median(t["whole"] for t in res["plain"]) if "plain" in res else None
    for v in variants:
        med = {k: statistics.median(t[k] for t in res[v]) for k in res[v][0]}
        ratio = f"  {med['turn'] / base:.3f}x plain" if base else ""
        extra = f"  prefill's trace {med['prefill_records']:.0f} spans and slot states" if v != "plain" else ""
        extra += (f"  detailed steps {med['detailed']:.3f} (n={med['n_detailed']:.0f}), others {med['other']:.3f}"
                 if v == "live" else "")
        pre = f" ({med['prefill'] / base_pre:.3f}x)" if base_pre else ""
        whole = f" ({med['whole'] / base_whole:.3f}x)" if base_whole else ""
        extra += f"  write {med['write']:.1f}" if v == "record" else ""
        print(f"  {v:6s} turn {med['turn']:.3f} ms/token{ratio}  whole turn {med['whole']:.1f}{whole}  prefill "
              f"{med['prefill']:.1f}{pre}  first step {med['first']:.2f}  steady {med['steady']:.3f}{extra}")
        print("         per turn: " + ", ".join(f"{t['turn']:.3f}" for t in res[v]))
        print("         " + tally.line(v, a.turns, "turn"))
        if base and v != "plain":   # each round's turn against the same round's plain one (the host drifts slowly)
            for key, what in (("turn", "decode"), ("whole", "whole turn"), ("prefill", "prefill step")):
                paired = [t[key] / u[key] for t, u in zip(res[v], res["plain"])]
                print(f"         {what} paired with plain, round by round: median {statistics.median(paired):.3f}x "
                      f"({min(paired):.2f}-{max(paired):.2f})")
    if prof is not None:
        import pstats
        print(f"cProfile of the last {a.profile} turn, by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.rows)
        print("the recorder's part, cumulative:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats("trace/", a.rows)


def collections(a) -> heap.Collections:
    """--gc-freeze / --gc-off once the engine is warm; the collections counted per variant from then on."""
    def full() -> str:
        t0 = time.perf_counter()
        gc.collect()
        return f"a full collection {(time.perf_counter() - t0) * 1e3:.2f} ms"
    line = f"objects the collector tracks: {len(gc.get_objects()):,}, {full()}"
    if a.gc_freeze:
        heap.freeze()
        line += f"; frozen, {full()}"
    if a.gc_off:
        gc.disable()
        line += " (automatic collection off: a collection between turns)"
    print(line)
    return heap.Collections()


def blocks(llm: LLM, a, variants: list[str], steps: int) -> None:
    prompt = torch.randint(0, llm.args.vocab_size, (a.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = llm.add_request(prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
    for _ in range(21):                                # prefill, then steps that capture graphs and warm up
        llm.step()
    tally = collections(a)
    res: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(a.turns):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            llm.recorder = recorder(v, llm.device, llm.config.mode)
            tally.label = v
            times, cpu = [], 0.0
            for i in range(a.blocks + 5):
                t0, c0 = time.perf_counter(), time.thread_time()
                llm.step()
                if i >= 5:
                    times.append((time.perf_counter() - t0) * 1e3)
                    cpu += time.thread_time() - c0
            if llm.recorder.enabled:
                llm.recorder.flush()
            res[v].append((statistics.median(times), statistics.fmean(times), cpu * 1e3 / a.blocks))
    tally.label = None
    llm.recorder = None
    print(f"{llm.device} {a.mode} {a.policy} ctx {a.ctx}..{len(seq)}: blocks of {a.blocks} steady steps of one answer, "
          f"{a.turns} rounds (ms/step, median over rounds of each block's median / mean step)")
    for v in variants:
        medians, means, cpus = ([r[i] for r in res[v]] for i in range(3))
        line = (f"  {v:6s} {statistics.median(medians):.4f} / {statistics.median(means):.4f}  engine thread's CPU "
                f"{statistics.median(cpus):.4f} ms/step  block means: " + " ".join(f"{t:.3f}" for t in means))
        if "plain" in res and v != "plain":
            for what, i in (("mean", 1), ("CPU", 2)):
                paired = [t[i] / u[i] for t, u in zip(res[v], res["plain"])]
                line += f"\n         {what} against plain, round by round: median {statistics.median(paired):.3f}x " \
                        f"({min(paired):.3f}-{max(paired):.3f})"
        print(line + "\n         " + tally.line(v, a.turns * (a.blocks + 5) / 1000, "1000 steps"))


if __name__ == "__main__":
    main()
