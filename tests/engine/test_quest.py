"""Quest: the page bound and selection (the math, on random data), the budget's accounting, the correction with
the current query (tests/engine/test_quest_engine.py: the real engine running it)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import ConfigError
from engine.sparse import make_policy
from engine.sparse.policy import KVLayout
from engine.sparse.quest import QuestPolicy
from engine.step import StepContext


def _policy(hkv=2, d=8, bs=32, page=16, blocks=6, budget=64, dense_layers=0, sink=16, recent=16, layers=2, rank=0,
            **kw):
    p = QuestPolicy(token_budget=budget, page_size=page, dense_layers=dense_layers, sink=sink, recent=recent,
                    min_context=0, min_layer_mb=0, rank=rank, **kw)
    p.initialize(KVLayout(layers, hkv, d, bs, torch.device("cpu"), torch.float32, blocks))
    return p


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), g=st.sampled_from([1, 2, 4]), scale=st.floats(0.1, 10.0))
def test_page_bound_is_at_least_the_true_max(seed, g, scale):
    torch.manual_seed(seed)
    p = _policy()
    keys = torch.randn(6, 2, 32, 8) * scale                       # [block, Hkv, bs, D]
    for b in range(6):
        p.on_kv_written(1, [b], keys[b][None], 0, 32)
    q = torch.randn(2 * g, 8) * scale                              # [Hq, D]
    bound = p.bounds(1, q, torch.arange(12), torch.ones(12, dtype=torch.bool))   # [Hkv, G, 12]
    k_pages = keys.reshape(6, 2, 2, 16, 8).permute(1, 0, 2, 3, 4).reshape(2, 12, 16, 8)
    true = torch.einsum("hgd,hptd->hgpt", q.reshape(2, g, 8), k_pages).amax(-1)   # [Hkv, G, 12]
    assert (bound >= true - 1e-4 * (1 + true.abs())).all()


def test_page_bounds_follow_the_tokens_as_they_are_written():
    """Decode writes one token at a time: a page's bounds appear when its last token does."""
    p = _policy()
    keys = torch.randn(2, 32, 8)
    p.on_kv_written(0, [3], keys[None], 0, 15)                      # 15 tokens: no page complete yet
    assert torch.isinf(p.index.kmin[0, 6]).all()
    p.on_kv_written(0, [3], keys[None], 15, 16)                     # the 16th completes page 0 of block 3
    torch.testing.assert_close(p.index.kmin[0, 6], keys[:, :16].amin(1))
    assert torch.isinf(p.index.kmin[0, 7]).all()


def test_the_centroid_score_is_the_mean_of_the_bound_and_the_mean_keys_score():
    torch.manual_seed(1)
    plain, mid = _policy(), _policy(centroid=True)
    keys = torch.randn(6, 2, 32, 8)                                  # [block, Hkv, bs, D]
    for b in range(6):
        plain.on_kv_written(1, [b], keys[b][None], 0, 32)
        mid.on_kv_written(1, [b], keys[b][None], 0, 32)
    q, pages, valid = torch.randn(4, 8), torch.arange(12), torch.arange(12) % 3 > 0
    mean = keys.reshape(6, 2, 2, 16, 8).mean(3).permute(1, 0, 2, 3).reshape(2, 12, 8)   # [Hkv, page, D]
    want = (plain.bounds(1, q, pages, valid) + torch.einsum("hgd,hpd->hgp", q.reshape(2, 2, 8), mean)) / 2
    got = mid.bounds(1, q, pages, valid)
    torch.testing.assert_close(got[:, :, valid], want[:, :, valid])
    assert torch.isneginf(got[:, :, ~valid]).all()


@pytest.mark.parametrize("centroid, chosen", [(False, 4), (True, 6)])
def test_the_centroid_score_prefers_the_page_with_more_attention_to_the_page_with_one_outlier(centroid, chosen):
    """Page 4 holds one key far along the query (bound 6, mean 0.375), page 6 sixteen keys at 4 (bound and mean 4):
    page 6 gets ~3x the attention (16 e^(4/sqrt 8) against e^(6/sqrt 8) + 15); the bound alone picks page 4."""
    p = _policy(budget=48, centroid=centroid)                       # sink 16 + 1 page + window 16
    keys = torch.zeros(6, 2, 32, 8)
    keys[2, :, 0, 0] = 6.0                                          # page 4 (block 2, tokens 0..15): one outlier
    keys[3, :, :16, 0] = 4.0                                        # page 6 (block 3, tokens 0..15): all of them
    for b in range(6):
        p.on_kv_written(0, [b], keys[b][None], 0, 32)
    q = torch.zeros(4, 8)
    q[:, 0] = 1.0
    p.observe_query(0, q, StepContext(block_table=torch.arange(6), context_len=192))
    assert p._pages[0].flatten().tolist() == [chosen, chosen]


def test_selection_is_per_kv_head():
    torch.manual_seed(0)
    p = _policy(budget=64)                                          # sink 16 + 2 pages + window 16
    keys = 0.01 * torch.randn(6, 2, 32, 8)                          # [block, Hkv, bs, D]: 12 pages of 16
    keys[2, 0, :, 0] = 5.0                                          # pages 4, 5: large keys on kv head 0 only
    keys[4, 1, :, 1] = 5.0                                          # pages 8, 9: large keys on kv head 1 only
    for b in range(6):
        p.on_kv_written(0, [b], keys[b][None], 0, 32)
    q = torch.zeros(4, 8)
    q[:, 0] = q[:, 1] = 1.0                                         # every query head looks for both
    p.observe_query(0, q, StepContext(block_table=torch.arange(6), context_len=192))   # candidates: pages 1..10
    assert p._pages[0].sort().values.tolist() == [[4, 5], [8, 9]]   # per head (best first)
    assert (p._scores[0] > 0.5).all()                              # each ~3x a uniform share (2 heads / 10 pages)


@pytest.mark.parametrize("bs,page,budget,sink,recent", [(32, 16, 64, 16, 16), (64, 16, 200, 16, 32),
                                                        (64, 32, 300, 40, 20), (256, 16, 512, 16, 32),
                                                        (16, 16, 100, 0, 1)])
def test_every_sparse_step_attends_exactly_the_budget(bs, page, budget, sink, recent):
    """The accounting: rows loaded + the newest tokens on the device = the budget, for any context longer than
    it, with the sink, the recent window (up to the new token, from a page boundary: no token between the
    candidates and the window is left out) and distinct chosen pages in."""
    blocks = -(-(budget + 3 * bs) // bs) + 1
    p = _policy(hkv=2, bs=bs, page=page, blocks=blocks, budget=budget, sink=sink, recent=recent)
    table = torch.randperm(blocks)
    ctx = StepContext(block_table=table)
    for b in range(blocks):
        p.on_kv_written(1, [int(table[b])], torch.randn(2, bs, 8)[None], 0, bs)
    for end in range(budget + 1, budget + 3 * bs):
        ctx.context_len = end - 1
        p.observe_query(1, torch.randn(4, 8), ctx)                  # the step before chooses for this one
        plan = p.plan_load(1, end, ctx)
        assert plan.rows.shape[1] + plan.device_tail == budget
        window = end - (end - p.window) // page * page               # R and the tokens before it in its page
        assert recent <= p.window <= window < p.window + page
        partial = end - (end - 1) // bs * bs
        assert plan.device_tail == min(window, partial)
        seq = (torch.nonzero(table[None, None, :] == (plan.rows // bs)[:, :, None])[:, 2].view(2, -1) * bs
               + plan.rows % bs)
        for h in range(2):
            got = seq[h].tolist()
            assert len(set(got)) == len(got)                        # no token twice
            want_fixed = set(range(p.sink)) | set(range(end - window, end - plan.device_tail))
            assert want_fixed <= set(got)                           # the sink and the window's host part
            chosen = set(got) - want_fixed
            assert len(chosen) == p.k * page - (window - p.window)  # the last page gives the window its tail
            assert all(p.sink <= t < end - window for t in chosen)


def test_the_correction_fetches_what_the_current_query_wants():
    """The plan loaded a speculation (the previous query's choice); the query of the step itself picks other
    pages: the fix fetches exactly those, into the places of the dropped ones."""
    p = _policy(budget=64)                                          # k = 2 pages
    table = torch.arange(6)
    ctx = StepContext(block_table=table, context_len=150)
    keys = 0.01 * torch.randn(6, 2, 32, 8)
    keys[1, :, :16, 0] = 5.0                                        # page 2 answers q[0]
    keys[3, :, 16:, 1] = 5.0                                        # page 7 answers q[1]
    for b in range(6):
        p.on_kv_written(0, [b], keys[b][None], 0, 32)
    first, second = torch.zeros(4, 8), torch.zeros(4, 8)
    first[:, 0], second[:, 1] = 1.0, 1.0
    assert p.observe_query(0, first, ctx) is None                   # nothing was loaded from a plan yet
    plan = p.plan_load(0, 150, ctx)                                 # [sink | window's host part | pages]
    base = plan.rows.shape[1] - 2 * 16 + (p._layout_for(150)[0] - p.window)   # where the pages start
    planned = [set((plan.rows[h, base:] // 16).tolist()) for h in range(2)]  # (the last cut by the window)
    assert 2 in planned[0]
    fix = p.observe_query(0, second, ctx)                           # now page 7 matters
    now = p._pages[0]
    assert 7 in now[0].tolist()
    fetched = [set((fix.rows[h][fix.rows[h] >= 0] // 16).tolist()) for h in range(2)]
    assert all(fetched[h] == set(now[h].tolist()) - planned[h] for h in range(2))
    dst = fix.dst[fix.rows >= 0]
    assert ((dst >= base) & (dst < plan.rows.shape[1])).all()     # into the chosen pages' places only
    p.end_step(ctx)
    rows = (fix.rows >= 0).sum().item()                             # the cut page's tail is not fetched
    assert sum(map(len, fetched)) * 16 - 16 < rows <= sum(map(len, fetched)) * 16
    assert p.step_metrics()["quest_fetched"] == pytest.approx(rows / 16 / 2)   # pages per kv head
    assert p.fetched_rows() == rows and p.fetched_rows() == 0       # read once, by the runner


def test_a_deferred_correction_chooses_when_the_runner_runs_it():
    """With `defer` (the runner's path) the choice is left in the fix's `select`, for the runner to run with its
    gather (one CUDA graph): nothing is chosen before it runs, and after it the fix, the pages and the next plan
    equal those of a choice made at once."""
    out = []
    for defer in (False, True):
        p = _policy(budget=64)
        ctx = StepContext(block_table=torch.arange(6), context_len=150)
        keys = 0.01 * torch.randn(6, 2, 32, 8, generator=torch.Generator().manual_seed(1))
        keys[1, :, :, 0], keys[3, :, :, 1] = 5.0, 5.0               # pages 2, 3 answer the first query, 6, 7 the second
        for b in range(6):
            p.on_kv_written(0, [b], keys[b][None], 0, 32)
        first, second = torch.zeros(4, 8), torch.zeros(4, 8)
        first[:, 0], second[:, 1] = 1.0, 1.0
        assert p.observe_query(0, first, ctx, defer=defer) is None  # no plan loaded: a choice, no fix
        p.plan_load(0, 150, ctx)
        fix = p.observe_query(0, second, ctx, defer=defer)
        assert (fix.select is not None) == defer
        if defer:
            assert sorted(p._pages[0][0].tolist()) == [2, 3]        # the first query's choice still
            fix.select()
        out.append([x.clone() for x in (fix.rows, fix.dst, p._pages[0], p._plan)])
    assert sorted(out[1][2][0].tolist()) == [6, 7]
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_a_policy_that_defers_chooses_from_the_query_written_after_it_was_asked():
    """`defers` says when observe_query(defer=True) leaves all its work on q to the fix's select: the runner then asks
    before q exists (one CUDA graph a layer: q, the choice, the gather, the attention), so the choice must read q
    when select runs, not when observe_query was called. It does not defer without a loaded plan (no fix), nor
    where recall reads the slots first or a guess one layer ahead chooses on its own."""
    p, along = _two_pages_each()
    ctx = StepContext(block_table=torch.arange(6), context_len=150)
    assert not p.defers(0, ctx)                                     # nothing chosen or loaded yet
    p.observe_query(0, along[0], ctx, defer=True)                   # pages 2, 3
    p.plan_load(0, 150, ctx)
    assert p.defers(0, ctx)
    q = torch.full((4, 8), float("nan"))                            # the graph's static q, not made yet
    fix = p.observe_query(0, q, ctx, defer=True)
    assert fix.select is not None
    q.copy_(along[1])                                               # q made, then the choice runs (in the graph)
    fix.select()
    assert sorted(p._pages[0][0].tolist()) == [6, 7] and _fetched_pages(fix) == [{6, 7}, {6, 7}]
    for kw in ({"recall": True}, {"look_ahead": True}):
        other = _policy(budget=64, **kw)
        other.observe_query(0, along[0], ctx)
        other.plan_load(0, 150, ctx)
        other_ctx = StepContext(block_table=torch.arange(6), context_len=150, layer_keys=lambda: None)
        assert not other.defers(0, other_ctx), kw


def _two_pages_each():
    """A policy with k = 2 and keys where a query along dim 0 wants pages 2, 3 and one along dim 1 pages 6, 7."""
    p = _policy(budget=64)
    keys = 0.01 * torch.randn(6, 2, 32, 8, generator=torch.Generator().manual_seed(0))
    keys[1, :, :, 0] = 5.0                                          # pages 2, 3
    keys[3, :, :, 1] = 5.0                                          # pages 6, 7
    for b in range(6):
        p.on_kv_written(0, [b], keys[b][None], 0, 32)
    along = [torch.zeros(4, 8), torch.zeros(4, 8)]
    along[0][:, 0], along[1][:, 1] = 1.0, 1.0
    return p, along


def _fetched_pages(fix):
    return [set((fix.rows[h][fix.rows[h] >= 0] // 16).tolist()) for h in range(2)]


@pytest.mark.parametrize("right", [True, False])
def test_the_guess_ahead_fetches_early_and_the_query_corrects_the_rest(right):
    p, along = _two_pages_each()
    ctx = StepContext(block_table=torch.arange(6), context_len=150)
    p.observe_query(0, along[0], ctx)                               # a first choice: pages 2, 3
    p.plan_load(0, 150, ctx)                                        # loads them (the speculation)
    guess = along[1] if right else along[0]
    ahead = p.observe_ahead(0, guess, ctx)                          # one layer early: a guess of the query
    assert _fetched_pages(ahead) == ([{6, 7}] * 2 if right else [set()] * 2)
    fix = p.observe_query(0, along[1], ctx)                         # the query itself wants pages 6, 7
    assert _fetched_pages(fix) == ([set()] * 2 if right else [{6, 7}] * 2)
    slots, chosen = p._slots[0], p._pages[0]                        # what the buffer holds now: the choice,
    assert all(set(slots[h].tolist()) == {6, 7} for h in range(2))  # its lowest-scored page in the cut last slot
    assert torch.equal(slots[:, -1], chosen[:, -1])
    p.end_step(ctx)
    m = p.step_metrics()
    assert m["quest_fetched_ahead"] == pytest.approx((2 - 0.375) if right else 0.0)   # the last page's cut tail
    assert m["quest_fetched"] == pytest.approx(0.0 if right else 2 - 0.375)


def test_the_speculation_is_left_out_where_the_choice_moves_and_back_where_it_stays():
    p, along = _two_pages_each()
    for end, q, spec in ((150, along[0], True), (151, along[1], True), (152, along[1], False), (153, along[1], True)):
        ctx = StepContext(block_table=torch.arange(6), context_len=end)
        plan = p.plan_load(0, end, ctx)
        if plan is not None:                                        # (none before the first choice)
            base = p._layout_for(end)[2]
            assert (plan.rows[:, base:] >= 0).all() == spec and (plan.moved is None) == spec
            assert spec or (p._slots[0] < 0).all()                  # and nothing is assumed loaded
        p.observe_query(0, q, ctx)
        p.end_step(ctx)                                             # 151: the choice kept none of its pages
    assert p.stats()["speculating_layers"] == p.stats()["choosing_layers"] == 1


def test_dense_where_choosing_does_not_pay():
    p = _policy(budget=64, dense_layers=1)
    assert not p.sparse(0, 1000)                                    # a dense layer
    assert not p.sparse(1, 64)                                      # the context fits the budget
    assert p.sparse(1, 65)
    q = QuestPolicy(token_budget=64, page_size=16, min_context=4096)
    assert not q.sparse(5, 4000) and "min_context 4096" in q.dense_reason
    small = QuestPolicy(token_budget=64, page_size=16, dense_layers=0, min_context=0, min_layer_mb=1)
    small.initialize(KVLayout(2, 2, 8, 32, torch.device("cpu"), torch.float32, 6))   # 2 x 2 x 8 x 4 = 128 B a token
    assert not small.sparse(1, 8191)                                # 1 MiB of a layer's KV is 8192 tokens
    assert "min_layer_mb 1" in small.dense_reason and "8,192 tokens" in small.dense_reason
    assert small.sparse(1, 8192) and small.warm_up_tokens() == 8192


def test_bad_parameters_name_the_parameter():
    with pytest.raises(ConfigError, match="must hold the sink .* and the recent window"):
        make_policy("quest", {"token_budget": 64, "sink": 48, "recent": 32}, "layerwise")
    with pytest.raises(ConfigError, match="quest page_size must be one of 16, 32, 64, 128"):
        make_policy("quest", {"page_size": 24}, "layerwise")
    with pytest.raises(ConfigError, match="the quest policy runs in layerwise or chunked mode, not gpu"):
        make_policy("quest", {}, "gpu")


def test_recall_is_the_attention_mass_on_what_was_loaded():
    p = _policy(hkv=1, d=2)
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])                    # two query heads, one kv head
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])   # [Hkv, T=3, D]
    loaded = torch.tensor([[True, False, True]])
    e = torch.e
    want = [(e + 1) / (e + 2), 2 / (e + 2)]                        # softmax mass on tokens 0 and 2 per head
    assert p.recall(q, keys, loaded, 1.0).tolist() == pytest.approx(want)


def test_load_plans_per_policy():
    """Full and the prefill policies never plan (everything is loaded); Quest plans once it has chosen."""
    p = _policy(budget=64)
    ctx = StepContext(block_table=torch.arange(6), context_len=150)
    assert p.plans_loads and p.plan_load(1, 150, ctx) is None
    for b in range(6):
        p.on_kv_written(1, [b], torch.randn(2, 32, 8)[None], 0, 32)
    p.observe_query(1, torch.randn(4, 8), ctx)
    plan = p.plan_load(1, 151, ctx)
    assert plan is not None and plan.key != p.plan_load(1, 152, ctx).key
    for name in ("full", "minference", "xattention"):
        other = make_policy(name, {}, "layerwise")
        assert not other.plans_loads and other.plan_load(1, 150, ctx) is None


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), parts=st.sampled_from([2, 4, 16]), centroid=st.booleans())
def test_a_page_in_parts_is_bounded_by_its_tightest_part_bound(seed, parts, centroid):
    """bound_tokens < page_size: a page scores by the largest of its parts' bounds, each the bound (or, with
    centroid, the score) of bound_tokens tokens alone; that stays above the page's best key and below the bound
    of the whole page."""
    torch.manual_seed(seed)
    whole, split = _policy(centroid=centroid), _policy(bound_tokens=16 // parts, centroid=centroid)
    keys = torch.randn(6, 2, 32, 8)
    for p in (whole, split):
        for b in range(6):
            p.on_kv_written(1, [b], keys[b][None], 0, 32)
    q, valid = torch.randn(4, 8), torch.arange(12) % 5 > 0
    got = split.bounds(1, q, torch.arange(12), valid)                         # [Hkv, G, 12]
    k = keys.reshape(6, 2, 2, parts, 16 // parts, 8).permute(1, 0, 2, 3, 4, 5).reshape(2, 12, parts, 16 // parts, 8)
    qg = q.reshape(2, 2, 1, 1, 8)
    want = torch.maximum(qg * k.amin(3)[:, None], qg * k.amax(3)[:, None]).sum(-1)   # [Hkv, G, page, part]
    if centroid:
        want = (want + (qg * k.mean(3)[:, None]).sum(-1)) / 2
    torch.testing.assert_close(got[:, :, valid], want.amax(-1)[:, :, valid])
    assert torch.isneginf(got[:, :, ~valid]).all()
    if not centroid:
        true = torch.einsum("hgd,hptd->hgpt", q.reshape(2, 2, 8), k.flatten(2, 3)).amax(-1)
        assert (got[:, :, valid] >= true[:, :, valid] - 1e-4).all()
        assert (got[:, :, valid] <= whole.bounds(1, q, torch.arange(12), valid)[:, :, valid] + 1e-4).all()


def test_bound_tokens_must_divide_the_page():
    with pytest.raises(ConfigError, match="bound_tokens 32 must divide page_size 16"):
        _policy(bound_tokens=32)
    with pytest.raises(ConfigError, match="bound_tokens"):
        _policy(bound_tokens=3)                                     # not one of the choices


@pytest.mark.parametrize("kw", [dict(), dict(bound_tokens=8), dict(centroid=True), dict(rank=4)])
@pytest.mark.parametrize("start,end", [(0, 96), (5, 96), (20, 70), (40, 50)])
def test_a_prompts_blocks_written_at_once_index_as_one_at_a_time(kw, start, end):
    """A prompt's completed blocks reach the page index in one call (shuffled pool blocks, a ragged first and last
    block): the same bounds, means or projected keys as the blocks written one by one."""
    torch.manual_seed(7)
    table, keys = [4, 0, 5], torch.randn(3, 2, 32, 8)                # [block, Hkv, bs, D]
    one, many = _policy(**kw), _policy(**kw)
    for i, b in enumerate(table):
        lo, hi = max(start - 32 * i, 0), min(end - 32 * i, 32)
        if hi > lo:
            one.on_kv_written(1, [b], keys[i][None], lo, hi)
    many.on_kv_written(1, table, keys, start, end)
    seq_pages = torch.arange(start // 16, end // 16)                 # the pages the tokens complete
    q, pages = torch.randn(4, 8), torch.tensor(table)[seq_pages // 2] * 2 + seq_pages % 2   # their pool pages
    done = torch.ones(len(pages), dtype=torch.bool)
    scores = [p.bounds(1, q, pages, done) for p in (one, many)]     # (the sketch makes its basis here)
    assert torch.isfinite(scores[0][:, :, done]).all()
    torch.testing.assert_close(scores[1], scores[0])
    got, want = (many.index.keys, one.index.keys) if kw.get("rank") else (many.index.kb, one.index.kb)
    torch.testing.assert_close(got, want)
