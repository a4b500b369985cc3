"""Where Quest loses a needle: per layer at the step its answer leaves Full's, the true attention mass on what it
attended, on what the best pages by true attention would keep (an oracle with the same budget), and on what other
page scores would keep; and whether the needle's page was attended.

    python tools/quest_oracle.py --length 7000 --depth 0.5 --kind number --budget 1024

It answers the needle question (bench/needle.py's documents) with Full and with Quest (layerwise, recall on),
finds the first answer token where they differ, answers again with Quest keeping each layer's query and keys at
that step, and prints one line per sparse layer: the needle's share of the attention (the largest over heads), for
each page score the mass kept (mean / lowest query head) and per kv head whether the needle's pages were in (x).
Scores: A the policy's (softmax of the page bounds per query head, summed over the group), B the largest softmax
share over the group's heads, D the largest raw bound, R the `rank` score at rank head_dim / 4 (each page's
best token in the leading directions of the layer's keys before the window), O the oracle (true attention
mass per page, summed); S an oracle that splits the same pages in all across layers and kv heads by need (mass
kept, mean over the group).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.needle import NEEDLES, needle_document  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.sparse import get_spec  # noqa: E402
from engine.sparse.quest import QuestPolicy  # noqa: E402


class KeepingQuest(QuestPolicy):
    """Quest that keeps, at one context length, each layer's query, keys, slots and window (recall must be on)."""
    at = -1

    def _measure_recall(self, layer, q, old, end, ctx):
        super()._measure_recall(layer, q, old, end, ctx)
        if end == self.at:
            self.kept[layer] = (q.clone(), ctx.layer_keys().clone(), self._slots[layer].clone(), self._layout_for(end)[0])


def scores(q: torch.Tensor, k: torch.Tensor, w: int, sink: int, ps: int):
    """Per kv head: the candidate pages, and each score's value per candidate; with the true attention p."""
    hkv, t, d = k.shape
    qg, scale = q.float().reshape(hkv, -1, d), d ** -0.5
    p = torch.softmax(qg @ k.float().transpose(1, 2) * scale, -1)                        # [Hkv, G, T]
    n = (t - w) // ps                                                                     # pages before the window
    cand = torch.arange(sink // ps, n)
    kp = k.float()[:, :n * ps].reshape(hkv, n, ps, d)
    mn, mx = kp.amin(2)[:, None], kp.amax(2)[:, None]
    b = torch.maximum(qg[:, :, None] * mn, qg[:, :, None] * mx).sum(-1)[:, :, cand]        # bounds [Hkv, G, c]
    share = torch.softmax(b * scale, -1)
    mass = p[:, :, :n * ps].reshape(hkv, -1, n, ps).sum(-1)[:, :, cand]
    basis = torch.linalg.eigh(kp.flatten(1, 2).transpose(1, 2) @ kp.flatten(1, 2)).eigenvectors[..., -d // 4:]
    low = torch.einsum("hgr,hntr->hgnt", qg @ basis, kp @ basis[:, None]).amax(-1)[:, :, cand]   # rank d/4
    return p, cand, {"A": share.sum(1), "B": share.amax(1), "D": b.amax(1),
                     "R": torch.softmax(low * scale, -1).sum(1), "O": mass.sum(1)}


def split_oracle(policy, scored: dict) -> dict[int, float]:
    """S: the same number of pages in all (every sparse layer's k per kv head), split across layers and kv heads
    by true attention mass (the best pages of all of them) -> the mass each layer keeps. `scored`: layer -> scores()"""
    masses, ctx = {}, {}
    for layer, (q, k, _, w) in policy.kept.items():
        p, cand, by = scored[layer]
        masses[layer] = by["O"] / p.shape[1]                                    # [Hkv, c], mean over the group
        fixed = p[:, :, :policy.sink].sum(-1) + p[:, :, k.shape[1] - w:].sum(-1)
        ctx[layer] = fixed.mean(1)                                              # sink + window, per kv head
    flat = torch.cat([m.flatten() for m in masses.values()])
    n = min(len(flat), policy.k * sum(m.shape[0] for m in masses.values()))
    cut = flat.topk(n).values[-1]
    return {layer: (ctx[layer] + (m * (m >= cut)).sum(-1)).mean().item() for layer, m in masses.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=7000)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--kind", default="number", choices=sorted(NEEDLES))
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    a = ap.parse_args()
    params = get_spec("quest").validate({"token_budget": a.budget, "page_size": a.page, "min_context": 0, "min_layer_mb": 0,
                                         "recall": True})
    llm = LLM(a.model, device="cpu", mode="layerwise", kv_block_size=a.block_size, max_model_len=a.length + 64)
    ids, _ = needle_document(llm, a.length, a.depth, a.kind)
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    fact_at = "".join(pieces).index(NEEDLES[a.kind][2])
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    needle = [i for i, s in enumerate(starts) if fact_at <= s + len(pieces[i]) - 1 and s < fact_at + len(NEEDLES[a.kind][2])]
    sp = SamplingParams(max_tokens=32)
    full = llm.generate([ids], sp)[0].token_ids
    policy = KeepingQuest(**params)
    llm.runner.set_policy(policy)            # (LLM.set_policy makes its own instance: this one keeps what it sees)
    llm.block_manager.forget_cached()        # Full's cached prompt KV would skip Quest's page bounds
    quest = llm.generate([ids], sp)[0].token_ids
    step = next((i for i, (x, y) in enumerate(zip(full, quest)) if x != y), None)
    show = lambda toks: repr(llm.tokenizer.decode(toks))  # noqa: E731
    print(f"needle tokens {needle} of {len(ids)}; Full: {show(full)}; Quest: {show(quest)}")
    if step is None or step == 0:
        print("the answers do not part at a decode step: nothing to show")
        return 0
    policy.at, policy.kept = len(ids) + step, {}
    llm.generate([ids], SamplingParams(max_tokens=step + 1))
    print(f"answer token {step}: Full {show(full[step:step + 1])}, Quest {show(quest[step:step + 1])}; {policy.k} pages "
          f"per kv head, sink {policy.sink}, window {policy.window}+")
    means: dict[str, list[float]] = {}
    scored = {layer: scores(q, k, w, policy.sink, a.page) for layer, (q, k, _, w) in policy.kept.items()}
    split = split_oracle(policy, scored)
    for layer, (q, k, slots, w) in sorted(policy.kept.items()):
        p, cand, by = scored[layer]
        hkv, t = k.shape[0], k.shape[1]
        line = f"L{layer:2d} needle {p[:, :, needle].sum(-1).max():.3f}"
        for name, s in by.items():
            top = cand[s.topk(min(policy.k, len(cand)), -1).indices]
            att = torch.zeros(hkv, t, dtype=torch.bool)
            att[:, :policy.sink] = att[:, t - w:] = True
            for h in range(hkv):
                att[h, (top[h, :, None] * a.page + torch.arange(a.page)).flatten()] = True
            kept = (p * att[:, None]).sum(-1)
            means.setdefault(name, []).append(kept.mean().item())
            line += f" | {name} {kept.mean():.3f}/{kept.min():.2f} " + "".join("x" if att[h, needle].all() else "."
                                                                          for h in range(hkv))
        print(line + f" | S {split[layer]:.3f}")
    print("mean over layers: " + ", ".join(f"{n} {sum(v) / len(v):.3f}" for n, v in means.items())
          + f", S {sum(split.values()) / len(split):.3f}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
