"""Quest's page bound and selection (the math, on random data)."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sparse.policy import KVLayout
from engine.sparse.quest import QuestPolicy


def _policy(hkv=2, d=8, bs=32, page=16, blocks=6, budget=64, dense_layers=0):
    p = QuestPolicy(token_budget=budget, page_size=page, dense_layers=dense_layers)
    p.initialize(KVLayout(2, hkv, d, bs, torch.device("cpu"), torch.float32, blocks))
    return p


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), g=st.sampled_from([1, 2, 4]), scale=st.floats(0.1, 10.0))
def test_page_bound_is_at_least_the_true_max(seed, g, scale):
    torch.manual_seed(seed)
    p = _policy()
    keys = torch.randn(6, 2, 32, 8) * scale                       # [block, Hkv, bs, D]
    for b in range(6):
        p.on_kv_written(1, b, keys[b])
    q = torch.randn(2 * g, 8) * scale                              # [Hq, D]
    pages = p.page_ids(range(6))
    bound = p.scores(1, q, pages)                                  # [Hkv, 12]
    k_pages = keys.reshape(6, 2, 2, 16, 8).permute(1, 0, 2, 3, 4).reshape(2, 12, 16, 8)
    true = torch.einsum("hgd,hptd->hgpt", q.reshape(2, g, 8), k_pages).amax(-1).amax(1)   # [Hkv, 12]
    assert (bound >= true - 1e-4 * (1 + true.abs())).all()


def test_selection_is_per_kv_head_with_sink_and_recent():
    torch.manual_seed(0)
    p = _policy(budget=64)                                          # 64 tokens = 2 blocks = 4 pages per kv head
    keys = 0.01 * torch.randn(6, 2, 32, 8)                          # [block, Hkv, bs, D]: 12 pages of 16
    keys[2, 0, :, 0] = 5.0                                          # pages 4, 5: large keys on kv head 0 only
    keys[4, 1, :, 1] = 5.0                                          # pages 8, 9: large keys on kv head 1 only
    for b in range(6):
        p.on_kv_written(0, b, keys[b])
    q = torch.zeros(4, 8)
    q[:, 0] = q[:, 1] = 1.0                                         # every query head looks for both
    top, scores = p.select(0, q, list(range(6)))
    assert top.tolist() == [[0, 4, 5, 11], [0, 8, 9, 11]]          # per head; sink and most recent always in
    assert (scores[0, 1:3] > 4).all() and (scores[1, 1:3] > 4).all()


def test_dense_below_the_budget_and_in_dense_layers():
    p = _policy(budget=64, dense_layers=1)
    assert not p.applies(0, 6)           # a dense layer
    assert not p.applies(1, 2)           # 4 pages fit the budget of 4
    assert p.applies(1, 3)


# ---------------------------------------------------------------- Quest in layerwise mode (the real default model)
import pytest  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.trace import TraceRecorder  # noqa: E402

QUEST = {"token_budget": 256, "page_size": 16, "dense_layers": 2}


@pytest.fixture(scope="module")
def quest_llm(default_model_dir):
    return LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
               policy="quest", policy_params=QUEST)


def test_quest_loads_only_its_budget_and_records_its_picks(quest_llm):
    llm = quest_llm
    rec = TraceRecorder()
    llm.recorder = rec
    prompt = list(range(2000, 2000 + 900))                       # 14 full blocks of 64 + 4 tokens
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.recorder = None
    decodes = [s for s in rec.steps if s.phase == "decode"]
    a, block = llm.args, llm.runner.oe.block_bytes
    per_token_layer = block // 64
    want = 2 * 14 * block + (a.num_layers - 2) * QUEST["token_budget"] * per_token_layer   # dense + sparse layers
    assert decodes[1].metrics["bytes_h2d"] == want                # a steady step (its first loads came early)
    picks = decodes[1].quest
    assert len(picks) == (a.num_layers - 2) * a.num_kv_heads      # every sparse layer, every kv head
    for p in picks:
        assert 0 in p.blocks and p.n_blocks == 13 * 4             # sink page in; candidates: all but the newest block
        assert len(p.blocks) == QUEST["token_budget"] // 16 - 4   # the newest block's 4 pages are added at load


def test_quest_answers_a_question_about_a_document(default_model_dir):
    """A quarter of the context per layer (and all of it in the first two layers) still finds the fact."""
    llm = LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=4096,
              policy="quest", policy_params={"token_budget": 512, "page_size": 16, "dense_layers": 2})
    doc = (open(__file__.replace("tests/engine/test_quest.py", "resources/samples/kv_cache_offload_primer.md"))
           .read()[:9000])
    msgs = [{"role": "user", "content": doc + "\n\nQuestion: In which city is the Halvorsen lab based?"}]
    chunks = list(llm.stream(msgs, SamplingParams(max_tokens=24)))
    assert "Bergen" in "".join(c.text for c in chunks)
    assert chunks[-1].stats.prompt_tokens > 4 * 512                      # Quest loads under a quarter of it


def test_quest_with_room_for_everything_equals_full(default_model_dir, quest_llm):
    prompt = list(range(3000, 3000 + 200))
    roomy = LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
                policy="quest", policy_params={"token_budget": 1024})
    full = LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert roomy.generate([prompt], params)[0].token_ids == full.generate([prompt], params)[0].token_ids


def test_quest_is_refused_where_it_cannot_run(default_model_dir):
    with pytest.raises(ConfigError, match="layerwise"):
        LLM(str(default_model_dir), device="cpu", mode="gpu", policy="quest")
    with pytest.raises(ConfigError, match="page_size"):
        LLM(str(default_model_dir), device="cpu", mode="layerwise", policy="quest", policy_params={"page_size": 24})


def test_quest_requests_in_turn_answer_as_in_a_fresh_engine(default_model_dir, quest_llm):
    """Two prompts sharing cached blocks, one after the other: the second one's prefill is dense and unaffected
    by the first one's page selections (a stale selection once leaked into a prefill and garbled answers)."""
    shared = list(range(4000, 4000 + 640))
    first, second = shared + list(range(100, 160)), shared + list(range(200, 230))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    quest_llm.generate([first], params)
    in_turn = quest_llm.generate([second], params)[0]
    assert in_turn.stats.cached_tokens == 640
    fresh = LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
                policy="quest", policy_params=QUEST).generate([second], params)[0]
    assert in_turn.token_ids == fresh.token_ids


def test_recall_is_the_attention_mass_on_what_was_loaded():
    p = _policy(hkv=1, d=2)
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])                    # two query heads, one kv head
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])   # [Hkv, T=3, D]
    loaded = torch.tensor([[True, False, True]])
    e = torch.e
    want = [(e + 1) / (e + 2), 2 / (e + 2)]                        # softmax mass on tokens 0 and 2 per head
    assert p.recall(q, keys, loaded, 1.0).tolist() == pytest.approx(want)


def test_recall_measured_in_the_engine(tmp_path):
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def stats(budget, rec=None):
        llm = LLM(str(tmp_path), device="cpu", kv_block_size=16, mode="layerwise", max_model_len=400, policy="quest",
                  policy_params={"token_budget": budget, "page_size": 16, "dense_layers": 0, "recall": True})
        if rec is not None:
            llm.recorder = rec
        return llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].stats.policy_stats

    rec = TraceRecorder()
    tight = stats(64, rec)
    assert tight["selections"] > 0 and set(tight["recall_per_layer"]) == {"0", "1"}
    assert 0 < tight["recall_min_head"] <= tight["recall"] < 1
    assert 0 < tight["recall_current_query"] < 1
    assert "recall" not in stats(512)                               # the budget holds everything: never sparse
    # each decode step's trace carries the recall it measured: per layer, their mean and the lowest layer's
    measured = [s.metrics for s in rec.steps if "quest_recall" in s.metrics]
    assert len(measured) == 5 and all(s.phase == "decode" for s in rec.steps if "quest_recall" in s.metrics)
    for m in measured:                                              # the first decode step has no selection yet
        layers = [m["quest_recall_l0"], m["quest_recall_l1"]]
        assert m["quest_recall"] == pytest.approx(sum(layers) / 2) and m["quest_recall_min"] == min(layers)
    per_layer0 = np.mean([m["quest_recall_l0"] for m in measured])
    assert per_layer0 == pytest.approx(tight["recall_per_layer"]["0"], abs=1e-4)


def test_load_plans_per_policy():
    """The API the runners call: Quest plans nothing until it saw a query, then its chosen pages per kv head
    (sink and most recent forced) plus the newest block's pages, under a new key after each selection; Full and
    the prefill policies never plan (everything is loaded)."""
    from engine.sparse import make_policy
    from engine.step import StepContext
    p = _policy(budget=64, dense_layers=0)                        # 6 blocks of 32, pages of 16: 4 pages per head
    keys = torch.randn(6, 2, 32, 8)
    for b in range(6):
        p.on_kv_written(1, b, keys[b])
    ctx = StepContext(block_table=torch.tensor([3, 0, 5, 1, 4, 2]))   # the sequence's host blocks
    assert p.plans_loads and p.plan_load(1, 6, ctx) is None
    p.observe_query(1, torch.randn(4, 8), 5, ctx)                  # choose among the first 5 blocks
    plan = p.plan_load(1, 6, ctx)
    # page i of host block b is b * 2 + i: the sink (block 3), the most recent of the 5 (block 4), the newest (2)
    assert plan.page_size == 16 and plan.pages.tolist() == [[6, 9, 4, 5]] * 2
    p.observe_query(1, torch.randn(4, 8), 5, ctx)
    assert p.plan_load(1, 6, ctx).key != plan.key
    assert p.plan_load(1, 2, ctx) is None                          # 2 blocks fit the budget: load all
    for name in ("full", "minference", "xattention"):
        other = make_policy(name, {}, "layerwise")
        assert not other.plans_loads and other.plan_load(1, 6, ctx) is None
