"""What a recording keeps of a conversation (engine/trace/recording.py has the file format): the turns as the window
or the command line saw them. No Qt here; torch only inside `model_info` (on a loaded engine).

    conv = Conversation()
    conv.begin_turn(token_map_info)                      # the worker's token_map signal (None: no Quest map)
    conv.end_turn(question, answer, stats, engine_config, steps)
    save_recording(conv.recording(document_text, app_meta), "run.kvscope")
"""
from __future__ import annotations

from dataclasses import replace

from engine.trace.recording import Recording


def model_info(llm) -> dict:
    """What the window's status bar and views show of a loaded engine (the worker's model_ready signal)."""
    import torch

    from engine import POLICIES
    return {"name": llm.model_name, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
            "mode": llm.config.mode, "max_model_len": llm.max_model_len, "policies": list(POLICIES),
            "policy": llm.config.policy, "threads": torch.get_num_threads(),
            "plan": llm.plan.describe() if llm.plan is not None else ""}


def turn_stats(stats, llm) -> dict:
    """A turn's GenerationStats as the window shows them (the worker's answer_done signal): with the policy that
    ran and the phase it acts in, and when the turn ended."""
    import time

    from engine.sparse.specs import get_spec
    d = stats.to_dict()
    d["t_done"] = time.time()
    d["policy"], d["policy_phase"] = llm.config.policy, get_spec(llm.config.policy).phase
    return d


class Conversation:
    """The turns of one conversation on one document, each with the engine steps it took. Only the last
    `keep_steps` turns keep their steps (a Qwen3-4B Quest step at 128K holds ~0.4 MB of picks: a long chat must not
    grow without bound); older turns keep their text and stats, and say `steps_dropped`."""

    def __init__(self, keep_steps: int = 8):
        self.turns: list[dict] = []
        self.keep_steps = keep_steps
        self._map: dict | None = None

    def clear(self) -> None:
        self.turns, self._map = [], None

    def begin_turn(self, token_map: dict | None) -> None:
        """The token map of the turn that starts (the worker's `token_map` signal: map, reason, first_step)."""
        self._map = token_map

    def end_turn(self, question: str, answer: str, stats: dict, engine: dict, steps: list) -> None:
        """A finished turn: its question, answer, stats (as answer_done reports them), the engine config it ran
        with and its steps (numbered; the turn spans the first to the last)."""
        m = self._map or {}
        numbers = [s.step for s in steps]
        self.turns.append({"question": question, "answer": answer, "stats": dict(stats), "engine": dict(engine),
                           "first_step": min(numbers, default=0), "last_step": max(numbers, default=-1),
                           "token_map": m.get("map"), "token_map_reason": m.get("reason", ""), "steps": list(steps)})
        self._map = None
        for t in self.turns[:-self.keep_steps]:
            if t["steps"]:
                t["steps"], t["steps_dropped"] = [], True

    def recording(self, document: str, meta: dict) -> Recording:
        """A Recording of every turn so far (`meta`: the manifest's `app` part and any other fields)."""
        turns, steps, after = [], [], -1
        for t in self.turns:          # a reloaded engine numbers its steps from 0 again: the file's go on
            if not t["steps"]:        # (none recorded, or dropped): an empty range
                turns.append({**{k: v for k, v in t.items() if k != "steps"}, "first_step": after + 1,
                              "last_step": after})
                continue
            shift = max(0, after + 1 - t["first_step"])
            steps += [replace(s, step=s.step + shift) if shift else s for s in t["steps"]]
            turns.append({**{k: v for k, v in t.items() if k != "steps"}, "first_step": t["first_step"] + shift,
                          "last_step": t["last_step"] + shift})
            after = max(after, t["last_step"] + shift)
        return Recording(dict(meta), document, turns, steps)
