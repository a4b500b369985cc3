"""MInference and XAttention: what they estimate (on planted data), and the real engine running them."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.sparse import MInferencePolicy, XAttentionPolicy, make_policy
from engine.trace.recorder import TraceRecorder

from tests.engine.tiny import tiny_model


def planted(tk=256, hq=4, hkv=2, d=32, column=150, seed=0):
    """Random q/k, plus one key (position `column`) that every query of kv head 0 aligns with strongly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tk, hq, d, generator=g) * 0.3
    k = torch.randn(tk, hkv, d, generator=g) * 0.3
    direction = torch.randn(d, generator=g)
    q[:, :hq // hkv] += direction
    k[column, 0] = direction * 4
    return q, k


def test_minference_estimate_finds_a_planted_column_and_keeps_forced_ones():
    q, k = planted()
    pol = MInferencePolicy(vertical=24, slash=20, last_q=32, sink=4, recent=8, block=16, min_len=1)
    pat = pol.estimate(q, k, 32 ** -0.5)
    assert pat.vertical.shape == (4, 24) and pat.slash.shape == (4, 20)     # index memory: budget per head only
    for h in range(4):
        v, s = pat.vertical[h].tolist(), pat.slash[h].tolist()
        assert v == sorted(v) and s == sorted(s)
        assert set(range(4)) <= set(v) and set(range(8)) <= set(s)        # sink columns, recent diagonals
    assert all(150 in pat.vertical[h].tolist() for h in (0, 1))           # the heads of kv head 0 see it


@pytest.mark.parametrize("tq,tk", [(100, 300), (40, 40)])
def test_minference_slashes_are_the_diagonals_with_most_attention(tq, tk):
    """The kept diagonals are the top ones by the definition: the last queries' softmax summed along each
    diagonal d = query position - key position (written out entry by entry), the recent ones forced."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(tq, 4, 16, generator=g), torch.randn(tk, 2, 16, generator=g)
    pol = MInferencePolicy(min_len=1, vertical=12, slash=20, last_q=32, sink=4, recent=6, block=16)
    n, pos = min(32, tq), range(tk - min(32, tq), tk)
    want = torch.zeros(4, tk)
    for h in range(4):
        for i, p in enumerate(pos):
            a = (q[tq - n + i, h] @ k[:p + 1, h // 2].T * 0.25).softmax(-1)
            for c in range(p + 1):
                want[h, p - c] += a[c]
    want[:, :6] = float("inf")
    assert torch.equal(pol.estimate(q, k, 0.25).slash, want.topk(20, dim=1).indices.sort(dim=1).values.int())


def test_minference_fraction_budgets_scale_with_length():
    pol = MInferencePolicy(vertical=0.1, slash=0.25, sink=4, recent=8)
    assert pol.budgets(1000) == (100, 250)
    assert pol.budgets(20) == (4, 8)                                      # never below the forced ones
    with pytest.raises(ConfigError, match=r"minference vertical must be in \(0, "):
        MInferencePolicy(vertical=0)


def test_xattention_estimate_keeps_the_heavy_block_and_the_diagonal():
    q, k = planted(tk=256, column=40)
    pol = XAttentionPolicy(threshold=0.5, stride=4, block=16, min_len=1, chunk_rows=32)
    blocks = pol.estimate(q, k, 32 ** -0.5)                               # [Hq, 16, 16]
    assert blocks.shape == (4, 16, 16)
    m = torch.arange(16)
    assert blocks[:, m, m].all() and blocks[:, :, 0].all()                # own block and the sink, always
    assert blocks[:2, 3:, 40 // 16].all()                                  # every later query block keeps it
    assert not blocks[:, m[:, None] < m[None, :]].any()                    # nothing above the diagonal
    assert blocks[2:].float().mean() < 0.6                                # the threshold drops blocks elsewhere


def test_xattention_threshold_one_keeps_every_block_with_mass():
    q, k = planted(tk=200)
    blocks = XAttentionPolicy(threshold=1.0, stride=4, block=16, min_len=1).estimate(q, k, 32 ** -0.5)
    assert blocks.equal(torch.ones(13, 13, dtype=torch.bool).tril()[None].expand(4, -1, -1))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_model("qwen3", folder)
    return folder


PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def answer(folder, mode, policy="full", params=None, recorder=None):
    llm = LLM(str(folder), device="cpu", kv_block_size=16, mode=mode, max_model_len=400, policy=policy,
              policy_params=params or {}, recorder=recorder)
    out = llm.generate([PROMPT], GREEDY)[0]
    return out.token_ids, out.stats


@pytest.mark.parametrize("mode", ["gpu", "layerwise"])
@pytest.mark.parametrize("policy,params", [
    ("minference", {"vertical": 1.0, "slash": 1.0, "min_len": 64, "block": 16, "cpu_dense_above": 1.0}),  # all
    ("xattention", {"threshold": 1.0, "stride": 4, "block": 16, "min_len": 64, "cpu_dense_above": 1.0}),
])
def test_patterns_that_cover_everything_answer_like_full(tiny_dir, mode, policy, params):
    want, _ = answer(tiny_dir, mode)
    got, stats = answer(tiny_dir, mode, policy, params)
    assert got == want
    assert stats.policy_stats["sparse_layers"] == 2 and stats.policy_stats["density"] == pytest.approx(1.0)


@pytest.mark.parametrize("policy,params", [
    ("minference", {"vertical": 16, "slash": 32, "min_len": 64, "block": 16, "sink": 4, "recent": 16,
                    "cpu_dense_above": 1.0}),
    ("xattention", {"threshold": 0.6, "stride": 4, "block": 16, "min_len": 64, "cpu_dense_above": 1.0}),
])
def test_sparse_prefill_is_the_same_in_gpu_and_layerwise_mode_and_traced(tiny_dir, policy, params):
    rec = TraceRecorder()
    got, stats = answer(tiny_dir, "layerwise", policy, params, recorder=rec)
    again, stats_gpu = answer(tiny_dir, "gpu", policy, params)
    assert got == again                                           # the same pattern from the same prompt
    assert 0 < stats.policy_stats["density"] < 0.9
    assert stats.policy_stats["density"] == pytest.approx(stats_gpu.policy_stats["density"])
    masks = [m for s in rec.steps for m in s.masks]
    assert {(m.layer, m.head) for m in masks} == {(l, h) for l in range(2) for h in range(4)}
    per_layer = stats.policy_stats["density_per_layer"]
    for l in range(2):
        mean = sum(m.density for m in masks if m.layer == l) / 4
        assert mean == pytest.approx(per_layer[str(l)], abs=1e-4)
    if policy == "minference":
        assert all(len(m.vertical) == 16 and len(m.slash) == 32 and m.n == 300 for m in masks)
    else:
        assert all(m.image is not None and m.image.shape == (19, 19) for m in masks)


def test_below_min_len_the_policy_runs_dense(tiny_dir):
    want, _ = answer(tiny_dir, "gpu")
    got, stats = answer(tiny_dir, "gpu", "minference", {"min_len": 1000, "vertical": 4, "slash": 4})
    assert got == want and stats.policy_stats["sparse_layers"] == 0
    assert stats.policy_stats["sparse"] is False and "below min_len 1,000" in stats.policy_stats["reason"]


def test_xattention_dense_below_an_automatic_length_per_device():
    """XAttention's default min_len (0) is per device: 4096 on a CPU, where its gathered path pays from ~4K tokens on
    the default model, 8192 on CUDA; a given min_len is kept as it is on both."""
    auto = XAttentionPolicy()
    assert auto.min_len == 0 and (auto.min_len_on(False), auto.min_len_on(True)) == (4096, 8192)
    assert XAttentionPolicy(min_len=256).min_len_on(False) == XAttentionPolicy(min_len=256).min_len_on(True) == 256
    assert MInferencePolicy().min_len_on(False) == 8192                    # MInference: no automatic value
    with pytest.raises(ConfigError, match="min_len"):
        MInferencePolicy(min_len=0)
    q, k = torch.randn(3000, 4, 32), torch.randn(3000, 2, 32)             # a 3,000-token prompt on the CPU
    assert auto._sparse(q, k, k, 32 ** -0.5) == "the prompt (3,000 tokens) is below min_len 4,096 (auto)"
    q, k = torch.randn(4200, 4, 32), torch.randn(4200, 2, 32)             # past it: the pattern decides
    assert "min_len" not in str(auto._sparse(q, k, k, 32 ** -0.5))


def test_a_dense_pattern_runs_dense_on_the_cpu_and_says_why(tiny_dir):
    """Off CUDA, a pattern that keeps more pairs than the gathered path can beat dense with runs dense: the
    answer is full attention's, no mask is recorded, and the stats say why."""
    want, _ = answer(tiny_dir, "gpu")
    rec = TraceRecorder()
    got, stats = answer(tiny_dir, "gpu", "xattention", {"threshold": 1.0, "stride": 4, "block": 16, "min_len": 64},
                        recorder=rec)
    assert got == want
    assert stats.policy_stats["sparse"] is False and stats.policy_stats["sparse_layers"] == 0
    assert "dense attention is faster on the CPU" in stats.policy_stats["reason"]
    assert not [m for s in rec.steps for m in s.masks]


def test_policies_switch_between_requests(tiny_dir):
    llm = LLM(str(tiny_dir), device="cpu", kv_block_size=16, mode="layerwise", max_model_len=400)
    dense = llm.generate([PROMPT], GREEDY)[0]
    llm.set_policy("xattention", {"threshold": 0.6, "stride": 4, "block": 16, "min_len": 64, "cpu_dense_above": 1.0})
    sparse = llm.generate([PROMPT], GREEDY)[0]
    assert sparse.stats.cached_tokens == 0                        # the new policy really ran on the whole prompt
    assert 0 < sparse.stats.policy_stats["density"] < 0.9
    llm.set_policy("full")
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == dense.token_ids
    with pytest.raises(ConfigError, match="unknown policy"):
        llm.set_policy("nope")


def test_policies_refused_where_they_cannot_run():
    with pytest.raises(ConfigError, match="gpu or layerwise mode, not chunked"):
        make_policy("minference", {}, "chunked")
    with pytest.raises(ConfigError, match="threshold"):
        make_policy("xattention", {"threshold": 1.5}, "gpu")
    with pytest.raises(ConfigError, match="stride"):
        make_policy("xattention", {"block": 64, "stride": 24}, "gpu")


def test_pattern_density_is_what_the_kernels_compute():
    """The CUDA gate reads the density off the pattern before running it: exact for blocks, close for slashes."""
    from engine.ops.sparse_prefill import block_sparse_reference, causal_pairs, vertical_slash_reference
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(600, h, 32, generator=g) for h in (4, 2, 2))
    mi = MInferencePolicy(vertical=40, slash=60, min_len=1, block=64)
    pat = mi.estimate(q, k, 0.17)
    exact = vertical_slash_reference(q, k, v, pat, 0.17)[1].sum().item() / (4 * causal_pairs(600, 600))
    assert float(mi.pattern_density(pat, 600, 600)) == pytest.approx(exact, rel=0.1)
    xa = XAttentionPolicy(threshold=0.6, min_len=1, block=64, stride=8)
    blocks = xa.estimate(q, k, 0.17)
    exact = block_sparse_reference(q, k, v, blocks, 64, 0.17)[1].sum().item() / (4 * causal_pairs(600, 600))
    assert float(xa.pattern_density(blocks, 600, 600)) == pytest.approx(exact)
