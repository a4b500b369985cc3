"""The needle grid with Quest's pages chosen by an oracle: each step, layer and kv head keeps the pages of the
budget that hold the most true attention (summed over the group's query heads), with Quest's exact accounting
(sink, window, k pages). What no page score can beat: a cell this misses is out of reach of the budget.

    python tools/quest_oracle_grid.py --budget 512

Same documents, questions and hits as `python -m bench.needle needle` (layerwise, the default model, CPU; each
step reads every layer's whole K, so it is slow: ~15 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.needle import NEEDLES, grid, run_needles  # noqa: E402
from engine import LLM  # noqa: E402
from engine.sparse import get_spec  # noqa: E402
from engine.sparse.quest import QuestPolicy  # noqa: E402


class OracleQuest(QuestPolicy):
    """Quest whose page score is the true attention mass of each page (from the layer's whole K)."""

    def __init__(self, **params):
        super().__init__(**params)
        self.wants_layer_keys = True

    def observe_query(self, layer, q, ctx):
        self._ctx = ctx
        return super().observe_query(layer, q, ctx)

    def bounds(self, layer, q, pages, valid):
        k = self._ctx.layer_keys().float()                                        # [Hkv, T, D]
        hkv, t, d = k.shape
        scale, ps = d ** -0.5, self.page_size
        p = torch.softmax(q.float().reshape(hkv, -1, d) @ k.transpose(1, 2) * scale, -1)   # [Hkv, G, T]
        m = t // ps
        mass = p.new_zeros(hkv, p.shape[1], valid.shape[0])
        mass[:, :, :m] = p[:, :, :m * ps].reshape(hkv, p.shape[1], m, ps).sum(-1)
        return (mass.clamp_min(1e-30).log() / scale).masked_fill_(~valid, float("-inf"))   # softmax -> the shares


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--lengths", default="2048,4096,7000")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--block-size", type=int, default=64)
    a = ap.parse_args()
    lengths, depths = [int(x) for x in a.lengths.split(",")], [float(x) for x in a.depths.split(",")]
    params = get_spec("quest").validate({"token_budget": a.budget, "page_size": a.page, "min_context": 0,
                                         "min_layer_mb": 0})
    llm = LLM(None, device="cpu", mode="layerwise", kv_block_size=a.block_size, max_model_len=max(lengths) + 64)
    llm.runner.set_policy(OracleQuest(**params))   # (LLM.set_policy makes its own instance)
    cells = run_needles(llm, "quest-oracle", lengths, depths, list(NEEDLES))
    print(f"quest with oracle pages (budget {a.budget}, page {a.page}, layerwise):")
    print(grid(cells, lengths, depths, list(NEEDLES)))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
