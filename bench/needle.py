"""Accuracy harness: does a policy still find a fact hidden in a long document?

    python -m bench.needle needle --lengths 2048,4096,7000 --depths 0.1,0.5,0.9 --policy full,quest
    python -m bench.needle needle --model ~/models/Qwen3-4B --lengths 32768 --mode layerwise --json out.json

A haystack of plain filler sentences (seeded, so every run is the same) gets one needle at a relative depth:
a number, a name or a place, each with its question. The engine answers greedily; a hit is an answer that
contains the needle's value. The grid prints length x depth with hits per needle kind, one grid per policy,
and the cells where the answer hung on a near-tie: a token of the answer's first LEAD_TOKENS whose top logit led
the runner-up by less than NEAR_TIE. There greedy decoding is a coin toss that any change to the attention may
turn (on the default model, Full's 7000-token 90% name cell: " name" led " arch" by 0.19), so a sparse policy's
miss there says little about its choice of keys. When Full runs first in the same command, each cell Full found
and a later policy missed is answered once more by that policy, given Full's answer up to and including the first
token where the two answers part: a hit then means the policy lost the cell at that one token (the line prints
Full's lead there), a miss that it loses the needle itself.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field

LEAD_TOKENS, NEAR_TIE = 8, 0.5
NEEDLES = {
    "number": ("The access code for the north gate of the observatory is 4817.",
               "What is the access code for the north gate of the observatory?", "4817"),
    "name": ("The archivist on duty during the night of the flood was called Ingrid Solberg.",
             "What was the name of the archivist on duty during the night of the flood?", "Solberg"),
    "place": ("The spare keys to the lighthouse are kept in a tin box in Tromsø.",
              "In which town are the spare keys to the lighthouse kept?", "Tromsø"),
}
_SUBJECTS = ["The committee", "A traveller", "The old ferry", "Every spring the valley", "The baker",
             "A quiet library", "The river", "Our neighbour", "The night train", "A small orchard"]
_VERBS = ["remembered", "described", "welcomed", "ignored", "carried", "painted", "measured", "followed"]
_OBJECTS = ["the long winter evenings", "a basket of apples", "the harbour lights", "an unfinished letter",
            "the scent of pine resin", "a map of the coastline", "the sound of distant bells", "a wooden chair"]


def haystack(n_sentences: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(n_sentences)]


def needle_document(llm, tokens: int, depth: float, kind: str, seed: int = 0) -> tuple[list[int], str]:
    """Prompt token ids (chat template applied) of about `tokens` tokens with the needle at `depth`."""
    fact, question, _ = NEEDLES[kind]
    per_sentence = max(1, llm.count_tokens(" ".join(haystack(50, seed))) / 50)
    hay = haystack(int(tokens / per_sentence) + 1, seed)
    while True:
        body = hay[:int(len(hay) * depth)] + [fact] + hay[int(len(hay) * depth):]
        text = " ".join(body)
        content = f"Read the document and answer the question.\n\n<document>\n{text}\n</document>\n\nQuestion: {question}"
        ids = llm.chat_prompt_ids([{"role": "user", "content": content}])
        if len(ids) <= tokens or len(hay) < 10:
            return ids, question
        hay = hay[:int(len(hay) * tokens / len(ids)) - 1]


@dataclass
class Cell:
    policy: str
    length: int
    depth: float
    kind: str
    prompt_tokens: int
    hit: bool
    answer: str
    recall: dict | None = None     # Quest with recall on: mean, lowest head, per layer (over the answer's steps)
    density: tuple | None = None   # prefill policies: (density over the sparse layers, sparse layers)
    lead: float | None = None      # the smallest top-logit lead over the runner-up in the answer's first LEAD_TOKENS
    tokens: list[int] = field(default_factory=list)     # the answer's token ids
    leads: list[float] = field(default_factory=list)    # each answer token's top-logit lead over the runner-up
    followed: dict | None = None   # a cell Full found and this policy missed, answered again from Full's tokens:
    #                                {"at": the first token the answers differ in, "full_lead": Full's lead there,
    #                                 "hit": found then, "answer": that answer}


def run_needles(llm, policy: str, lengths: list[int], depths: list[float], kinds: list[str],
                max_new_tokens: int = 32) -> list[Cell]:
    from engine import SamplingParams
    cells = []
    for n in lengths:
        for d in depths:
            for kind in kinds:
                ids, _ = needle_document(llm, n, d, kind)
                out = llm.generate([ids], SamplingParams(max_tokens=max_new_tokens, leads=True))[0]
                st = out.stats.policy_stats
                recall = ({"mean": st["recall"], "min_head": st["recall_min_head"],
                           "per_layer": st["recall_per_layer"]} if "recall" in st else None)
                density = (st["density"], st["sparse_layers"]) if "sparse_layers" in st else None
                cells.append(Cell(policy, n, d, kind, len(ids), NEEDLES[kind][2].lower() in out.text.lower(),
                                  out.text.strip(), recall, density, min(out.leads[:LEAD_TOKENS], default=None),
                                  list(out.token_ids), list(out.leads)))
    return cells


def follow(llm, cell: Cell, full: Cell, max_new_tokens: int = 32) -> dict:
    """Answer `cell` (missed by its policy, found by Full) again with llm's policy, given Full's answer up to and
    including the first token where the two answers differ: did the policy lose the needle, or one token's toss?"""
    from engine import SamplingParams
    at = next((i for i, (a, b) in enumerate(zip(cell.tokens, full.tokens)) if a != b),
              min(len(cell.tokens), len(full.tokens)))
    given = full.tokens[:at + 1]
    ids, _ = needle_document(llm, cell.length, cell.depth, cell.kind)
    out = llm.generate([ids + given], SamplingParams(max_tokens=max(1, max_new_tokens - len(given))))[0]
    answer = (llm.tokenizer.decode(given) + out.text).strip()
    return {"at": at, "full_lead": full.leads[at] if at < len(full.leads) else None,
            "hit": NEEDLES[cell.kind][2].lower() in answer.lower(), "answer": answer}


def followed_text(cells: list[Cell]) -> str:
    """The lines that say, per cell Full found and the policy missed, what following Full's answer showed."""
    lines = []
    for c in cells:
        if c.followed is not None:
            f = c.followed
            lead = f"Full's lead there {f['full_lead']:.2f}" if f["full_lead"] is not None else "Full's answer ended"
            lines.append(f"  {c.length}/{c.depth:.0%} {c.kind}: parts from Full's answer at token {f['at'] + 1} ({lead});"
                         f" given Full's answer to there it {'finds' if f['hit'] else 'still misses'} the needle: "
                         f"{f['answer'][:100]!r}")
    return ("cells Full found that this policy missed:\n" + "\n".join(lines)) if lines else ""


def grid(cells: list[Cell], lengths: list[int], depths: list[float], kinds: list[str]) -> str:
    lines = [f"{'tokens':>8} " + "".join(f"{f'depth {d:.0%}':>14}" for d in depths)]
    for n in lengths:
        row = []
        for d in depths:
            hits = [c for c in cells if c.length == n and c.depth == d]
            row.append(f"{sum(c.hit for c in hits)}/{len(hits)} " + "".join("x" if c.hit else "." for c in hits))
        lines.append(f"{n:>8} " + "".join(f"{r:>14}" for r in row))
    lines.append(f"(hits of {', '.join(kinds)} per cell; x = found, . = missed)")
    near = sorted((c for c in cells if c.lead is not None and c.lead < NEAR_TIE), key=lambda c: c.lead)
    if near:                  # where greedy decoding itself hung on a near-tie, any change to attention may flip it
        lines.append(f"near-ties (a top-logit lead under {NEAR_TIE} in the answer's first {LEAD_TOKENS} tokens): "
                     + ", ".join(f"{c.length}/{c.depth:.0%} {c.kind} {c.lead:.2f} ({'x' if c.hit else '.'})"
                                 for c in near))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.needle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    n = sub.add_parser("needle", help="needle in a haystack: length x depth grid per policy")
    n.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    n.add_argument("--device", default=None)
    n.add_argument("--mode", default="layerwise", choices=("gpu", "layerwise", "chunked"))
    n.add_argument("--lengths", default="2048,4096,7000")
    n.add_argument("--depths", default="0.1,0.5,0.9")
    n.add_argument("--kinds", default=",".join(NEEDLES))
    n.add_argument("--policy", default="full", help="comma separated, each name[:key=value...], e.g. "
                   "full,quest:token_budget=512,minference:min_len=1024 (quest takes --quest-budget/--quest-page "
                   "unless given)")
    n.add_argument("--quest-budget", type=int, default=1024)
    n.add_argument("--quest-page", type=int, default=16)
    n.add_argument("--block-size", type=int, default=256)
    n.add_argument("--warm-up", action="store_true", help="warm each engine up first (LLM.warm_up: throwaway "
                   "prompts, as the command line and the app do on CUDA) before its cells")
    n.add_argument("--json", default=None, help="also write every cell (answer included) to this file")
    args = p.parse_args(argv)
    from engine.paths import output_file_problem
    if args.json and (problem := output_file_problem(args.json, "needle.json")):   # before hours of work
        print(f"error: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    from engine.errors import KVScopeError
    from engine.sparse import parse_policy_spec
    try:                                      # every policy checked before any of them runs
        policies = parse_policy_spec(args.policy)
        return _run(args, policies)
    except KVScopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args, policies: list[tuple[str, dict]]) -> int:
    from engine import LLM
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    kinds = args.kinds.split(",")
    cells: list[Cell] = []
    full: dict[tuple, Cell] = {}                     # Full's cells, when it runs first (see follow)
    for policy, given in policies:
        # Quest chooses at every length here (min_context 0, min_layer_mb 0): the grid measures its choice, not its dense fallback
        params = ({"token_budget": args.quest_budget, "page_size": args.quest_page, "min_context": 0, "min_layer_mb": 0}
                  if policy == "quest" else {})
        params.update(given)
        llm = LLM(args.model, device=args.device, mode=args.mode, policy=policy, policy_params=params,
                  kv_block_size=args.block_size, max_model_len=max(lengths) + 64)
        if args.warm_up:
            llm.warm_up()
        got = run_needles(llm, policy, lengths, depths, kinds)
        if policy == "full" and not given and not full:
            full = {(c.length, c.depth, c.kind): c for c in got}
        for c in got if policy != "full" else []:
            f = full.get((c.length, c.depth, c.kind))
            if f is not None and f.hit and not c.hit:
                c.followed = follow(llm, c, f)
        cells += got
        print(f"\n{policy} ({args.mode} mode{', ' + json.dumps(params) if params else ''}):")
        print(grid(got, lengths, depths, kinds), flush=True)
        if text := followed_text(got):
            print(text, flush=True)
        ran = [c.density for c in got if c.density]
        for n_tok in lengths if ran else []:
            at = [c.density for c in got if c.density and c.length == n_tok]
            ran = [d for d, layers in at if layers]                  # cells where some layer ran sparse
            mean = f"{sum(ran) / len(ran):.3f} over its sparse layers" if ran else "- (every layer dense)"
            print(f"  @{n_tok}: prefill density {mean} ({min(l for _, l in at)}-{max(l for _, l in at)} of "
                  f"{llm.args.num_layers} layers sparse)")
        measured = [c.recall for c in got if c.recall]
        if measured:
            layers: dict[str, list[float]] = {}
            for r in measured:
                for layer, v in r["per_layer"].items():
                    layers.setdefault(layer, []).append(v)
            low = min(layers, key=lambda l: sum(layers[l]) / len(layers[l]))
            print(f"recall (attention mass on what was attended, mean over sparse layers and cells): "
                  f"{sum(r['mean'] for r in measured) / len(measured):.3f}; lowest layer {low} "
                  f"({sum(layers[low]) / len(layers[low]):.3f}); lowest head in any cell "
                  f"{min(r['min_head'] for r in measured):.3f}", flush=True)
        llm.close()
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(c) for c in cells], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
