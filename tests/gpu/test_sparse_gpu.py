"""Sparse policies on a real CUDA device: the compiled kernels at a real model's head shape, and the engine."""
import numpy as np
import pytest
import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams
from engine.block_manager import block_hash
from engine.ops.sparse_prefill import block_sparse_reference, vertical_slash_reference
from engine.ops.sparse_triton import block_sparse_triton, vertical_slash_triton
from engine.sparse import MInferencePolicy, XAttentionPolicy
from engine.sparse.policy import SparsePolicy
from engine.trace import TraceRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _qkv(tq, tk, hq=32, hkv=8, d=128, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tq, hq, d, device="cuda", generator=g, dtype=dtype)
    k = torch.randn(hkv, tk, d, device="cuda", generator=g, dtype=dtype).transpose(0, 1)  # head-major, as layerwise
    v = torch.randn(tk, hkv, d, device="cuda", generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("tq,tk", [(4096, 4096), (3000, 4133)])
def test_vertical_slash_kernel_at_qwen3_shape(tq, tk):
    q, k, v = _qkv(tq, tk)
    pat = MInferencePolicy(vertical=300, slash=500, min_len=1).estimate(q, k, 128 ** -0.5)
    got, pairs = vertical_slash_triton(q, k, v, pat, 128 ** -0.5)
    want, want_pairs = vertical_slash_reference(q, k, v, pat, 128 ** -0.5)
    assert (got.float() - want.float()).abs().max() < 2e-2
    assert pairs.cpu().tolist() == want_pairs.tolist()


@pytest.mark.parametrize("tq,tk", [(4096, 4096), (3000, 4133)])
def test_block_sparse_kernel_at_qwen3_shape(tq, tk):
    q, k, v = _qkv(tq, tk)
    blocks = XAttentionPolicy(threshold=0.5, stride=16, block=128, min_len=1).estimate(q, k, 128 ** -0.5)
    got, pairs = block_sparse_triton(q, k, v, blocks, 128, 128 ** -0.5)
    want, want_pairs = block_sparse_reference(q, k, v, blocks, 128, 128 ** -0.5)
    assert (got.float() - want.float()).abs().max() < 2e-2
    assert pairs.cpu().tolist() == want_pairs.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tq,tk,d", [(4096, 4096, 128), (3000, 4133, 128), (4000, 4000, 64)])
def test_block_sparse_dispatch_and_flex_at_real_shapes(tq, tk, d, dtype):
    """What XAttention runs on CUDA (our Triton kernel), and FlexAttention's kernel the bench times beside it,
    equal the masked reference, pairs included."""
    from engine.ops import flex_sparse
    from engine.ops.sparse_prefill import block_sparse_attention
    q, k, v = _qkv(tq, tk, d=d, dtype=dtype)
    blocks = XAttentionPolicy(threshold=0.5, stride=16, block=128, min_len=1).estimate(q, k, d ** -0.5)
    want, want_pairs = block_sparse_reference(q, k, v, blocks, 128, d ** -0.5)
    runs = [block_sparse_attention] + ([flex_sparse.block_sparse_flex] if flex_sparse.available(q) else [])
    for run in runs:
        got, pairs = run(q, k, v, blocks, 128, d ** -0.5)
        assert (got.float() - want.float()).abs().max() < 2e-2
        assert pairs.cpu().tolist() == want_pairs.tolist()


def test_a_dense_pattern_runs_dense_on_the_gpu_and_says_why():
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(shape=shape_config("qwen3-4b"), dtype="bfloat16", max_model_len=4096, mode="gpu", kv_block_size=256,
              num_kv_blocks=32, policy="xattention", policy_params={"min_len": 1024})   # random weights: ~0.9
    st = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0].stats.policy_stats
    llm.close()
    assert st["sparse"] is False and "our GPU kernels are slower than dense attention" in st["reason"]


@pytest.mark.parametrize("policy", [XAttentionPolicy(min_len=1024, threshold=0.3),
                                    MInferencePolicy(min_len=1024, vertical=64, slash=16)])   # (slash runs 64 wide)
def test_the_dense_gate_answers_as_dense_or_as_the_kernel(policy):
    """The gate's answer is read after the kernel's launch (the kernel exits where it says dense): a layer over the
    limit gives dense attention's output and says why, one under it the kernel's."""
    q, k, v = _qkv(3000, 4133)
    dense = SparsePolicy.prefill_attention(policy, q.clone(), k, v, 0, 0.08)
    pattern = policy.estimate(q, k, 0.08)
    policy.estimate = lambda *_: pattern            # (MInference's estimate adds atomically: ties may flip)
    share = float(policy.pattern_density(pattern, 3000, 4133))
    sparse = policy.kernel(q, k, v, pattern, 0.08)[0]
    policy.gpu_dense_above = share * 0.99
    assert torch.equal(policy.prefill_attention(q.clone(), k, v, 0, 0.08), dense) and 0 in policy.dense_reasons
    policy.gpu_dense_above = min(share * 1.01, 0.999)
    assert torch.equal(policy.prefill_attention(q.clone(), k, v, 0, 0.08), sparse) and 0 not in policy.dense_reasons


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])      # fp32: tiles that fit its shared memory
@pytest.mark.parametrize("d", [64, 128])
def test_vertical_slash_kernel_block_128_default_tiles(d, dtype):
    q, k, v = _qkv(3000, 4133, d=d, dtype=dtype)
    pat = MInferencePolicy(vertical=300, slash=500, min_len=1).estimate(q, k, d ** -0.5)
    assert pat.block == 128
    got, pairs = vertical_slash_triton(q, k, v, pat, d ** -0.5)
    want, want_pairs = vertical_slash_reference(q, k, v, pat, d ** -0.5)
    assert (got.float() - want.float()).abs().max() < 2e-2
    assert pairs.cpu().tolist() == want_pairs.tolist()


@pytest.mark.parametrize("policy,params", [("minference", {"vertical": 256, "slash": 512, "min_len": 1024, "block": 64,
                                                          "gpu_dense_above": 1.0}),
                                           ("xattention", {"threshold": 0.8, "min_len": 1024, "gpu_dense_above": 1.0})])
def test_sparse_prefill_gpu_and_layerwise_agree(policy, params):
    """The same masks and the same answer in both modes. Where a selection by threshold (XAttention's cumulative
    share) flips a block between the modes (their K differ in layout, so the estimate's matmuls may round apart
    in the last bits), random weights' nearly flat logits can then pick another token: the masks must still
    be the same in > 95% of the (layer, head) pairs and the first token (the prefill's) must be the same.
    (Random weights make every key block's share nearly equal, so a cut by threshold is where rounding shows:
    H100 runs of XAttention saw 0 and, twice, 25 of 1152 masks differ, the first token equal each time. A real
    error in either mode, such as another layer's K, changes most masks.)"""
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    outs, masks = [], []
    for mode in ("gpu", "layerwise"):
        rec = TraceRecorder()
        llm = LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode=mode, kv_block_size=256,
                  policy=policy, policy_params=params, recorder=rec, **({"num_kv_blocks": 32} if mode == "gpu" else {}))
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        outs.append(out.token_ids)
        assert 0 < out.stats.policy_stats["density"] < 1
        assert len([m for s in rec.steps for m in s.masks]) == 36 * 32
        masks.append({(m.layer, m.head): (bytes(np.sort(m.vertical)), bytes(np.sort(m.slash)),    # (sets: any order)
                                          None if m.image is None else bytes(m.image)) for s in rec.steps for m in s.masks})
        print(mode, policy, "density", round(out.stats.policy_stats["density"], 3))
        llm.close()
        del llm
        torch.cuda.empty_cache()
    assert masks[0].keys() == masks[1].keys()
    differ = sum(masks[0][k] != masks[1][k] for k in masks[0])
    print(f"{policy}: (layer, head) masks that differ between the modes: {differ} of {len(masks[0])}; tokens "
          f"{outs[0]} / {outs[1]}")
    if outs[0] != outs[1]:
        assert differ / len(masks[0]) < 0.05 and outs[0][0] == outs[1][0]


def test_quest_recall_on_gpu():
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(shape=shape_config("qwen3-4b"), dtype="bfloat16", max_model_len=4096, mode="layerwise",
              kv_block_size=256, policy="quest", policy_params={"token_budget": 512, "page_size": 32, "recall": True, "min_context": 0, "min_layer_mb": 0})
    st = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].stats.policy_stats
    llm.close()
    print("quest recall", round(st["recall"], 3), "speculation alone", round(st["recall_speculative"], 3))
    assert 0 < st["recall_min_head"] <= st["recall"] <= 1 and len(st["recall_per_layer"]) == 34


@pytest.mark.parametrize("mode", ["layerwise", "chunked"])
@pytest.mark.parametrize("policy,params", [
    ("full", {}), ("quest", {"token_budget": 512, "page_size": 32, "min_context": 0, "min_layer_mb": 0, "rank": 0}),
    ("quest", {"token_budget": 512, "min_context": 0, "min_layer_mb": 0}),
    ("quest", {"token_budget": 512, "min_context": 0, "min_layer_mb": 0, "look_ahead": True})])
def test_decode_graphs_answer_like_eager(policy, params, mode):
    """Each decode layer replayed as CUDA graphs gives the tokens the eager layers give (fp32), in both offload
    modes; with Quest (bounds or the default low-rank score) the layers choose pages and their graphs record the
    correction's gather; with look_ahead (layerwise) the guess's choice and fetch run on the copy stream, one
    graph per layer and buffer there."""
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = []
    for eager in (True, False):
        llm = LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode=mode,
                  kv_block_size=256, policy=policy, policy_params=params, enforce_eager=eager)
        out = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        outs.append(out.token_ids)
        graphs = llm.runner.decode_graphs
        assert (graphs is None) == eager and (eager or len(graphs.graphs) >= 36)
        if policy == "quest":
            st = out.stats.policy_stats
            assert st["sparse"] and st["fetched_pages_per_step"] > 0
            assert (st["fetched_ahead_pages_per_step"] > 0) == (params.get("look_ahead", False) and mode == "layerwise")
        llm.close()
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_quest_counts_staged_before_the_sync_match_a_synced_read():
    """Quest's per-step counts (pages fetched per layer, pages of the previous choice kept, which turns the next
    plans' speculation on or off) copied to the host before the sampler's sync read as a sync of their own reads
    them: the same answer, figures and pages fetched, step by step."""
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(2)).tolist()
    params = {"token_budget": 512, "min_context": 0, "min_layer_mb": 0}
    got = []
    for staged in (True, False):
        llm = LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode="layerwise",
                  kv_block_size=256, policy="quest", policy_params=params)
        policy, steps = llm.runner.policy, []
        if not staged:
            policy.stage_step = lambda: None
        metrics = policy.step_metrics
        policy.step_metrics = lambda: steps.append(metrics()) or steps[-1]
        out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        assert (policy._counts_host is not None) == staged
        st = out.stats.policy_stats
        got.append((out.token_ids, st["fetched_pages_per_step"], st["speculating_layers"],
                    [{k: v for k, v in m.items() if k.startswith(("quest_fetched", "quest_kept"))} for m in steps]))
        llm.close()
        del llm
        torch.cuda.empty_cache()
    assert got[0] == got[1]
    assert got[0][1] > 0 and any(m for m in got[0][3])


def test_quest_in_chunked_mode_on_gpu():
    """The page gather into one-block slots on a real device: a roomy budget answers like Full, a tight one
    moves less."""
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    got = {}
    for name, params in [("full", {}), ("quest", {"token_budget": 8192, "page_size": 32, "dense_layers": 0, "min_context": 0, "min_layer_mb": 0}),
                         ("tight", {"token_budget": 512, "page_size": 32, "min_context": 0, "min_layer_mb": 0})]:
        llm = LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode="chunked",
                  kv_block_size=256, policy="full" if name == "full" else "quest", policy_params=params)
        out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        got[name] = (out.token_ids, out.stats.bytes_h2d)
        llm.close()
        del llm
        torch.cuda.empty_cache()
    assert got["quest"][0] == got["full"][0]
    assert got["tight"][1] < got["full"][1]


def test_a_policy_switch_keeps_the_decode_graphs_valid():
    """Graphs that record a policy's tensors (Quest's correction gather) are not replayed for the next policy,
    even where the new policy's tensors lie at the old one's addresses (the bench crashed with an illegal address
    after such switches): after full -> quest(1024) -> quest(512) -> quest(1024) on one engine, none is kept and
    the last answers as a fresh quest(1024) engine."""
    prompt = torch.randint(0, 150000, (3000,), generator=torch.Generator().manual_seed(1)).tolist()
    quest = {"page_size": 32, "min_context": 0, "min_layer_mb": 0}

    def engine(policy, params):
        return LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode="layerwise",
                   kv_block_size=256, policy=policy, policy_params=params, gpu_kv_budget_gb=0.25)   # ring + 2 resident layers
    llm = engine("full", {})
    for budget in (1024, 512, 1024):
        llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
        llm.set_policy("quest", {**quest, "token_budget": budget})
        assert not [key for key in llm.runner.decode_graphs.graphs if len(key) == 5]   # (key, tag): a policy's work
    switched = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    llm.close()
    fresh = engine("quest", {**quest, "token_budget": 1024})
    want = fresh.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    fresh.close()
    assert switched == want


@pytest.mark.parametrize("mode,policy,params", [
    ("layerwise", "quest", {"token_budget": 512, "page_size": 16, "min_context": 2048, "min_layer_mb": 0}),
    ("gpu", "minference", {"min_len": 2048, "vertical": 256, "slash": 512, "gpu_dense_above": 1.0})])
def test_warm_up_after_a_policy_switch_runs_the_new_policy_sparse(mode, policy, params):
    """A policy switched on a loaded engine (the app's policy panel) is warmed up on prompts long enough for it to
    run sparse, so its kernels compile and its graphs are captured then, not in the user's first turn."""
    llm = LLM(shape=shape_config("smollm2-135m"), dtype="bfloat16", max_model_len=4096, mode=mode, kv_block_size=256)
    try:
        llm.warm_up()
        llm.set_policy(policy, params)
        llm.warm_up()
        pol = llm.runner.policy
        if policy == "quest":
            assert pol._graphs, "Quest's selection graphs were not captured in the warm-up"
        else:
            assert pol.stats()["sparse"] is True and pol.stats()["sparse_layers"] == 30
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["layerwise", "chunked"])
def test_a_dense_quest_decodes_with_full_graphs(mode):
    """Quest below its gates (min_context) runs each decode layer as Full does: one graph per layer in
    layerwise mode (none split around a choice), chunked mode's graphed step; the same tokens as Full (fp32)."""
    prompt = torch.randint(0, 150000, (1500,), generator=torch.Generator().manual_seed(2)).tolist()
    outs, keys = [], []
    for policy, params in (("full", {}), ("quest", {"token_budget": 512, "min_context": 8192})):
        llm = LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=2048, mode=mode,
                  kv_block_size=256, policy=policy, policy_params=params)
        out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        outs.append(out.token_ids)
        keys.append({k[3] for k in llm.runner.decode_graphs.graphs})
        if policy == "quest":
            assert not out.stats.policy_stats["sparse"] and "min_context" in out.stats.policy_stats["reason"]
        llm.close()
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
    assert keys[1] == keys[0] and keys[1] and "pre" not in keys[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tq,tk,d", [(4096, 4096, 128), (3000, 4133, 128), (4000, 4000, 64)])
def test_xattention_estimate_kernel_at_real_shapes(tq, tk, d, dtype):
    """The one-launch estimate (head-major k, bf16) against the torch form: the same shares up to bf16 rounding of
    the torch form's logits, and nearly the same blocks chosen (a share at the threshold may fall either way)."""
    from engine.ops.xattn_estimate import (block_shares_reference, block_shares_triton, select_blocks,
                                           select_blocks_reference)
    q, k, _ = _qkv(tq, tk, d=d, dtype=dtype)
    got = block_shares_triton(q, k, d ** -0.5, 16, 128)
    want = block_shares_reference(q, k, d ** -0.5, 16, 128)
    assert (got - want).abs().max() < 2e-2
    assert torch.allclose(got.sum(-1), torch.ones_like(got[..., 0]), atol=1e-3)
    same = (select_blocks(got, 0.9, tq, tk, 128) == select_blocks_reference(want, 0.9, tq, tk, 128)).float().mean()
    assert same > 0.99
    kernel, torch_form = select_blocks(got, 0.9, tq, tk, 128), select_blocks_reference(got, 0.9, tq, tk, 128)
    assert (kernel == torch_form).float().mean() > 0.999       # (sums in another order may move a cut by one block)
    assert (got.where(kernel, 0).sum(-1) >= 0.9 - 1e-4).all()


def test_the_warm_up_leaves_no_sketch_basis_behind():
    """LLM.warm_up's throwaway prompts reach Quest's sketch first: after it, the user's prompt makes the basis, the
    one an engine that never warmed up makes from the same prompt (the warm-up's own basis differs)."""
    prompt = torch.randint(0, 49152, (3000,), generator=torch.Generator().manual_seed(2)).tolist()
    params = {"token_budget": 512, "min_context": 2048, "min_layer_mb": 0}
    bases = []
    for warm in (True, False):
        llm = LLM(shape=shape_config("smollm2-135m"), dtype="float32", max_model_len=4096, mode="layerwise",
                  kv_block_size=256, policy="quest", policy_params=params)
        try:
            if warm:
                llm.warm_up()
                index = llm.runner.policy.index
                assert all(p == [] for p in index.pending)            # forgotten: made again from the next keys
                made_in_warm_up = index.basis.clone()
            llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
            bases.append(llm.runner.policy.index.basis.clone())
        finally:
            llm.close()
    torch.testing.assert_close(bases[0], bases[1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(made_in_warm_up[2:], bases[1][2:], atol=1e-2)   # (layers 0, 1 are dense)


def test_the_sketch_basis_graph_gives_the_eager_basis():
    """On CUDA the basis's ~150 launches are one graph replay, captured once per shape: each call (new keys into
    the same graph) gives what the eager iteration gives."""
    from engine.sparse.page_index import _start, _subspace, leading_directions
    for seed in (0, 1):
        k = torch.randn(3, 500, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        m = k.transpose(1, 2) @ k
        got = leading_directions(m, 32)
        torch.testing.assert_close(got, _subspace(m, _start(m, 32), 24), rtol=1e-9, atol=1e-9)
        eye = torch.eye(32, dtype=got.dtype, device="cuda").expand(3, 32, 32)
        torch.testing.assert_close(got.transpose(1, 2) @ got, eye)


def test_a_switch_to_quest_and_its_warm_up_keep_the_cached_document():
    """The app switches the policy, then warms the engine up (LLM.warm_up): the document asked about under Full stays
    cached through both, and Quest's basis and page index are made from the cached keys: the basis an engine built
    for Quest makes from the whole prompt, and its first picks. (Not token for token: on random weights' flat
    logits the prompt's rest, prefilled over the cached part, rounds apart from one whole prefill.)"""
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(0, 49152, (3000,), generator=g).tolist()
    prompt = doc + torch.randint(0, 49152, (40,), generator=g).tolist()
    params = {"token_budget": 512, "min_context": 2048, "min_layer_mb": 0}
    kw = dict(shape=shape_config("smollm2-135m"), dtype="float32", max_model_len=8192, mode="layerwise",
              kv_block_size=256)       # (the host pool holds one sequence: room for the doc and the warm-up's)
    steps, runs = SamplingParams(max_tokens=4, ignore_eos=True), []
    for switch in (True, False):
        with LLM(**kw, **({} if switch else {"policy": "quest", "policy_params": params})) as llm:
            llm.warm_up()
            if switch:
                llm.generate([doc], SamplingParams(max_tokens=2, ignore_eos=True))
                llm.set_policy("quest", params)
                llm.warm_up()
            llm.recorder = rec = TraceRecorder(device=llm.device)
            out = llm.generate([prompt], steps)[0]
            picks = {(p.layer, p.kv_head): set(p.blocks.tolist())
                     for p in next(s for s in rec.steps if s.phase == "decode").quest}
            h, blocks = -1, []                           # the doc's blocks, as the prefix cache finds them
            for i in range(11):
                h = block_hash(prompt[i * 256:(i + 1) * 256], h)
                blocks.append(llm.block_manager.hash_to_block[h])
            rows = (torch.tensor(blocks)[:, None] * 256 + torch.arange(256)).flatten().to(llm.device)
            index = llm.runner.policy.index
            runs.append((out.stats.cached_tokens, index.basis.clone(), index.keys[:, :, rows].clone(), picks))
    (cached, basis, keys, picks), (fresh_cached, fresh_basis, fresh_keys, fresh_picks) = runs
    assert cached == 2816 and fresh_cached == 0                          # the doc's 11 full blocks
    torch.testing.assert_close(basis, fresh_basis, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(keys[2:], fresh_keys[2:], rtol=1e-3, atol=1e-3)   # (layers 0, 1 are dense)
    assert keys[2:].abs().amax() > 0
    assert picks.keys() == fresh_picks.keys() and picks
    overlap = np.mean([len(picks[k] & fresh_picks[k]) / len(picks[k] | fresh_picks[k]) for k in picks])
    assert overlap > 0.5, overlap
