"""Quest in the real engine (the default model, and a tiny model for the runners' and the recall's checks): the
budget it loads, its answers, its refusals, its requests in turn, the two runners alike, the recall it measures,
and a switch to it."""
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.trace import TraceRecorder


QUEST = {"token_budget": 256, "page_size": 16, "dense_layers": 2, "min_context": 0, "min_layer_mb": 0}


@pytest.fixture(scope="module")
def quest_llm(default_model_dir):
    with LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
             policy="quest", policy_params=QUEST) as llm:
        yield llm


def test_quest_loads_only_its_budget_and_records_its_picks(quest_llm):
    llm = quest_llm
    rec = TraceRecorder()
    llm.recorder = rec
    prompt = list(range(2000, 2000 + 900))                       # 14 full blocks of 64 + 4 tokens
    out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    llm.recorder = None
    decodes = [s for s in rec.steps if s.phase == "decode"]
    a, block = llm.args, llm.runner.oe.block_bytes
    per_token_layer = block // 64
    window, budget = llm.runner.policy.window, QUEST["token_budget"]
    rows, rows_next = budget - min(window, 902 - 896), budget - min(window, 903 - 896)   # less the device tail
    # the step loads its layers 3.. and, ahead, the next step's layers 0, 1 (dense: 14 blocks) and 2 (sparse):
    # every row a sparse layer attends is moved once (its plan, or fetched ahead or by the correction), and a
    # row moved for nothing (a speculated page the query did not want) at most once more
    dense, attended = 2 * 14 * block, ((a.num_layers - 3) * rows + rows_next) * per_token_layer
    assert dense + attended <= decodes[1].metrics["bytes_h2d"] <= dense + 2 * attended   # a steady step
    picks = decodes[1].quest
    assert len(picks) == (a.num_layers - 2) * a.num_kv_heads      # every sparse layer, every kv head
    k = llm.runner.policy.k
    for p in picks:
        assert len(p.blocks) == k and p.n_blocks == (902 - llm.runner.policy.window) // 16
        assert all(1 <= int(x) < p.n_blocks for x in p.positions) # between the sink and the window
    assert "quest_fetched" in decodes[1].metrics and out.stats.policy_stats["sparse"]
    assert "quest_kept" in decodes[1].metrics


def test_quest_answers_a_question_about_a_document(default_model_dir):
    """A quarter of the context per layer (and all of it in the first two layers) still finds the fact."""
    with LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=4096,
             policy="quest", policy_params={"token_budget": 512, "page_size": 16, "min_context": 0, "min_layer_mb": 0}) as llm:
        doc = (open(__file__.replace("tests/engine/test_quest_engine.py",
                                     "resources/samples/kv_cache_offload_primer.md")).read()[:9000])
        msgs = [{"role": "user", "content": doc + "\n\nQuestion: In which city is the Halvorsen lab based?"}]
        chunks = list(llm.stream(msgs, SamplingParams(max_tokens=24)))
    assert "Bergen" in "".join(c.text for c in chunks)
    assert chunks[-1].stats.prompt_tokens > 4 * 512                      # Quest attends to under a quarter of it


def test_quest_with_room_for_everything_equals_full(default_model_dir, quest_llm):
    prompt = list(range(3000, 3000 + 200))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
             policy="quest", policy_params={"token_budget": 1024, "min_context": 0, "min_layer_mb": 0}) as roomy, \
         LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048) as full:
        got = roomy.generate([prompt], params)[0]
        assert got.token_ids == full.generate([prompt], params)[0].token_ids
    assert not got.stats.policy_stats["sparse"] and "fits the budget" in got.stats.policy_stats["reason"]


def test_quest_is_refused_where_it_cannot_run(default_model_dir):
    with pytest.raises(ConfigError, match="layerwise"):
        LLM(str(default_model_dir), device="cpu", mode="gpu", policy="quest")
    with pytest.raises(ConfigError, match="page_size 32 must divide the KV block size 16"):
        LLM(str(default_model_dir), device="cpu", mode="layerwise", kv_block_size=16, policy="quest",
            policy_params={"page_size": 32})


def test_quest_requests_in_turn_answer_as_in_a_fresh_engine(default_model_dir, quest_llm):
    """Two prompts sharing cached blocks, one after the other: the second one's prefill is dense and unaffected
    by the first one's page selections (a stale selection once leaked into a prefill and garbled answers)."""
    shared = list(range(4000, 4000 + 640))
    first, second = shared + list(range(100, 160)), shared + list(range(200, 230))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    quest_llm.generate([first], params)
    in_turn = quest_llm.generate([second], params)[0]
    assert in_turn.stats.cached_tokens == 640
    with LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
             policy="quest", policy_params=QUEST) as llm:
        fresh = llm.generate([second], params)[0]
    assert in_turn.token_ids == fresh.token_ids


@pytest.mark.parametrize("bs", [16, 64])
def test_layerwise_and_chunked_attend_to_the_same_tokens(tmp_path, bs):
    """The same choices, corrections included, executed by two runners, and with the guess one layer ahead
    (layerwise): the same tokens, whatever each loaded before its query chose."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    outs, ahead = [], []
    for mode, look_ahead in (("layerwise", False), ("chunked", False), ("layerwise", True)):
        rec = TraceRecorder()
        with LLM(str(tmp_path), device="cpu", kv_block_size=bs, mode=mode, max_model_len=400, policy="quest",
                 recorder=rec, policy_params={"token_budget": 96, "dense_layers": 0, "min_context": 0, "min_layer_mb": 0,
                                              "look_ahead": look_ahead}) as llm:
            outs.append(llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0])
        ahead.append(sum(s.metrics.get("quest_fetched_ahead", 0) for s in rec.steps))
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert all(o.stats.policy_stats["sparse"] for o in outs)
    assert ahead[0] == ahead[1] == 0 < ahead[2]                     # the guess did fetch pages early


def test_recall_measured_in_the_engine(tmp_path):
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def stats(budget, rec=None):
        with LLM(str(tmp_path), device="cpu", kv_block_size=16, mode="layerwise", max_model_len=400,
                 policy="quest", policy_params={"token_budget": budget, "dense_layers": 0, "recall": True,
                                                "min_context": 0, "min_layer_mb": 0}) as llm:
            if rec is not None:
                llm.recorder = rec
            return llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].stats.policy_stats

    rec = TraceRecorder()
    tight = stats(64, rec)
    assert tight["selections"] > 0 and set(tight["recall_per_layer"]) == {"0", "1"}
    assert 0 < tight["recall_min_head"] <= tight["recall"] < 1
    assert 0 < tight["recall_speculative"] < 1                      # what the previous query's choice would have had
    assert "recall" not in stats(512)                               # the budget holds everything: never sparse
    # each decode step's trace carries the recall it measured: per layer, their mean and the lowest layer's
    measured = [s.metrics for s in rec.steps if "quest_recall" in s.metrics]
    assert len(measured) == 5 and all(s.phase == "decode" for s in rec.steps if "quest_recall" in s.metrics)
    for m in measured:                                              # the first decode step is planned from the prompt
        layers = [m["quest_recall_l0"], m["quest_recall_l1"]]
        assert m["quest_recall"] == pytest.approx(sum(layers) / 2) and m["quest_recall_min"] == min(layers)
    per_layer0 = np.mean([m["quest_recall_l0"] for m in measured])
    assert per_layer0 == pytest.approx(tight["recall_per_layer"]["0"], abs=1e-4)


def test_a_switch_to_quest_makes_its_dense_layers_resident(default_model_dir):
    """An engine built for Full keeps other layers resident; switched to Quest, its dense layers (read whole every
    step) take the resident buffers, and it answers as an engine built for Quest."""
    quest = {"token_budget": 256, "min_context": 0, "min_layer_mb": 0}
    prompt = list(range(3000, 3000 + 900))
    kw = dict(device="cpu", kv_block_size=64, mode="layerwise", max_model_len=1024, gpu_kv_budget_gb=0.012)
    with LLM(str(default_model_dir), policy="full", **kw) as llm:
        before = llm.runner.plan.resident
        assert len(before) >= 2 and 0 not in before
        llm.set_policy("quest", quest)
        assert llm.runner.plan.resident[:2] == (0, 1) and len(llm.runner.plan.resident) == len(before)
        switched = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    with LLM(str(default_model_dir), policy="quest", policy_params=quest, **kw) as llm:
        fresh = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert switched.token_ids == fresh.token_ids
    assert switched.stats.bytes_h2d == fresh.stats.bytes_h2d         # no dense layer streamed whole each step


@pytest.mark.parametrize("mode", ["layerwise", "chunked"])
def test_a_dense_quest_decodes_as_full_and_turns_sparse_on_time(tmp_path, mode):
    """Below its gates Quest is not shown a decode query (the runner runs the layer as Full would: on CUDA one
    graph, and chunked mode's graphed step) and answers as Full; once the context passes min_context mid-answer it
    chooses, and both runners then attend to the same tokens."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    quest = {"token_budget": 96, "dense_layers": 0, "min_layer_mb": 0}
    outs = {}
    for name, policy, extra in (("full", "full", None), ("dense", "quest", {"min_context": 4096}),
                                ("turns", "quest", {"min_context": 306})):
        with LLM(str(tmp_path), device="cpu", kv_block_size=16, mode=mode, max_model_len=400, policy=policy,
                 policy_params=None if extra is None else quest | extra) as llm:
            seen = []
            if extra is not None:
                observe = llm.runner.policy.observe_query
                llm.runner.policy.observe_query = lambda l, q, ctx, **kw: seen.append(ctx.context_len) or observe(
                    l, q, ctx, **kw)
            outs[name] = llm.generate([prompt], params)[0]
            outs[name].seen = seen
    assert outs["dense"].token_ids == outs["full"].token_ids
    assert not outs["dense"].stats.policy_stats["sparse"] and "min_context" in outs["dense"].stats.policy_stats["reason"]
    assert all(n == 300 for n in outs["dense"].seen)                 # the prompt's last query only (prefill)
    decode_seen = sorted(set(n for n in outs["turns"].seen if n > 300))
    assert decode_seen and decode_seen[0] == 305                     # chooses at 305 for the step of 306 on
    assert outs["turns"].stats.policy_stats["sparse"]
    if mode == "chunked":
        with LLM(str(tmp_path), device="cpu", kv_block_size=16, mode="layerwise", max_model_len=400, policy="quest",
                 policy_params=quest | {"min_context": 306}) as llm:
            assert llm.generate([prompt], params)[0].token_ids == outs["turns"].token_ids


def test_the_rank_score_runs_alike_in_both_runners_and_over_cached_blocks(tmp_path):
    """Quest scoring pages by low-rank keys: layerwise and chunked attend to the same tokens; a second prompt
    sharing the first one's blocks (its keys projected before, from the prefix cache) answers as in a fresh
    engine."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    g = torch.Generator().manual_seed(6)
    first = torch.randint(0, 256, (300,), generator=g).tolist()
    second = first[:256] + torch.randint(0, 256, (40,), generator=g).tolist()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    quest = {"token_budget": 96, "dense_layers": 0, "min_context": 0, "min_layer_mb": 0, "rank": 4}
    outs = {}
    for mode in ("layerwise", "chunked"):
        with LLM(str(tmp_path), device="cpu", kv_block_size=16, mode=mode, max_model_len=400, policy="quest",
                 policy_params=quest) as llm:
            outs[mode] = llm.generate([first], params)[0]
            outs[mode + " cached"] = llm.generate([second], params)[0]
            assert outs[mode + " cached"].stats.cached_tokens == 256
        assert outs[mode].stats.policy_stats["sparse"]
    with LLM(str(tmp_path), device="cpu", kv_block_size=16, mode="layerwise", max_model_len=400, policy="quest",
             policy_params=quest) as llm:
        llm.generate([first], params)            # the same basis (made from the first prompt's keys)
        llm.block_manager.forget_cached()
        fresh = llm.generate([second], params)[0]
    assert outs["layerwise"].token_ids == outs["chunked"].token_ids
    assert outs["layerwise cached"].token_ids == outs["chunked cached"].token_ids == fresh.token_ids


def _first_decode_picks(rec: TraceRecorder) -> list[tuple]:
    step = next(s for s in rec.steps if s.phase == "decode")
    return [(p.layer, p.kv_head, p.blocks.tolist()) for p in step.quest]


def test_a_switch_keeps_the_cached_prefill_kv_and_drops_what_a_sparse_decode_wrote(default_model_dir):
    """Full's KV is what Quest would compute: after a switch the document's cached blocks are reused, and Quest,
    shown their keys, picks and answers as an engine built for it. Quest's answer tokens carry KV made from sparse
    attention: back under Full, the blocks its decode wrote to are computed again, the prefill's are reused."""
    quest = {"token_budget": 256, "min_context": 0, "min_layer_mb": 0}
    doc, prompt = list(range(3000, 3700)), list(range(3000, 3700)) + list(range(100, 140))
    kw = dict(device="cpu", kv_block_size=64, mode="layerwise", max_model_len=1024, gpu_kv_budget_gb=0.012)
    six = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(default_model_dir), policy="full", **kw) as llm:
        llm.generate([doc], SamplingParams(max_tokens=2, ignore_eos=True))
        llm.set_policy("quest", quest)
        llm.recorder = rec = TraceRecorder()
        switched = llm.generate([prompt], six)[0]
        llm.recorder = None
        answer = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]   # fills block 11
        llm.set_policy("full")
        back = llm.generate([prompt + answer.token_ids + [1, 2, 3]], six)[0]
    with LLM(str(default_model_dir), policy="quest", policy_params=quest, **kw) as llm:
        llm.recorder = fresh_rec = TraceRecorder()
        fresh = llm.generate([prompt], six)[0]
    assert switched.stats.cached_tokens == 640 and fresh.stats.cached_tokens == 0    # the doc's 10 full blocks
    assert _first_decode_picks(rec) == _first_decode_picks(fresh_rec) != []
    assert switched.token_ids == fresh.token_ids
    assert answer.stats.cached_tokens == 704                       # the prompt's 11 full blocks, all prefill's
    assert back.stats.cached_tokens == 704                         # not block 11: Quest's decode wrote tokens 740-767


@pytest.mark.parametrize("policy, params", [
    ("quest", {"token_budget": 96, "dense_layers": 0, "min_context": 0, "min_layer_mb": 0}),
    ("streamingllm", {"sink": 16, "window": 40})])
def test_a_plan_of_the_sink_and_recent_rows_loads_nothing_and_answers_alike(tmp_path, policy, params):
    """Where a layer's plan would move only the sink and the window's tokens before the partly filled block from
    the host (no page is speculated), both come from device copies (the sink's made at prefill, the last complete
    block's when it completed): the same tokens as loading them, fewer bytes, a whole token's bytes per row kept.
    The answer crosses a block boundary, so the window reaches back into the block before. StreamingLLM's plans
    are only those rows: with the copies it loads nothing at all."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = []
    for keep in (True, False):
        with LLM(str(tmp_path), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=400, ring_slots=1,
                 policy=policy, policy_params=params) as llm:        # (one slot: the layers take turns in it)
            llm.runner.keep_sink = keep
            oe, loads = llm.runner.oe, []
            load_rows = oe.load_rows
            oe.load_rows = lambda *args, **kw: loads.append(args[1]) or load_rows(*args, **kw)
            out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
            a = llm.args
            row_bytes = a.num_kv_heads * 2 * a.head_dim * 4                  # a token of one layer: K and V, fp32
            runs.append((out.token_ids, out.stats.bytes_h2d, llm.runner._sink_ok, llm.runner._prev_blk, len(loads)))
    (kept, b_kept, ok, prev, n_kept), (loaded, b_loaded, _, _, n_loaded) = runs
    assert kept == loaded and all(ok) and prev == [(250 + 15) // 64 - 1] * len(prev)
    saved = b_loaded - b_kept
    assert saved > 0 and saved % row_bytes == 0 and n_kept < n_loaded
    if policy == "streamingllm":
        assert n_kept == 0 and n_loaded > 0
