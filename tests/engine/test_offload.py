"""Offload modes on the real default model (fp32, CPU, copy threads): same tokens as gpu mode, the traffic
the formulas predict, and a trace that shows the pipeline."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError, OutOfMemoryError
from engine.offload import plan_residency
from engine.offload.offload_engine import block_runs
from engine.offload.runner import prefill_chunk
from engine.ops.attention import attention_lse, causal_attention, lse_output, merge_lse
from engine.trace import TraceRecorder, summarize
from engine.trace.events import COMPUTE, H2D, HOST

BS = 16
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)  # 20 tokens: every prompt below crosses a block boundary


def _engine(model_dir, mode, **kw):
    kw.setdefault("max_model_len", 512)
    return LLM(str(model_dir), device="cpu", kv_block_size=BS, mode=mode, **kw)


@pytest.fixture(scope="module")
def engines(default_model_dir):
    return {m: _engine(default_model_dir, m) for m in ("gpu", "layerwise", "chunked")}


@pytest.fixture(scope="module")
def prompts(engines):
    tok = engines["gpu"].tokenizer
    text = tok.encode("The lighthouse keeper counted the ships that passed the northern cape each night, " * 12)
    return {"one block": text[:BS], "several blocks": text[:4 * BS], "partial last block": text[:3 * BS + 5]}


@pytest.mark.parametrize("case", ["one block", "several blocks", "partial last block"])
def test_offload_modes_give_the_gpu_mode_tokens(engines, prompts, case):
    want = engines["gpu"].generate([prompts[case]], GREEDY)[0].token_ids
    for mode in ("layerwise", "chunked"):
        got = engines[mode].generate([prompts[case]], GREEDY)[0]
        assert got.token_ids == want, mode
        assert got.stats.bytes_d2h > 0


def test_residency_and_ring_depth_do_not_change_tokens(default_model_dir, engines, prompts):
    want = engines["gpu"].generate([prompts["partial last block"]], GREEDY)[0].token_ids
    layer_mib = 512 // BS * engines["layerwise"].runner.block_bytes / 30 / 2**20
    budget_gb = (2 + 7) * layer_mib / 1024 + 0.001  # ring of 2 + 7 resident layers (+ decode buffer slack)
    llm = _engine(default_model_dir, "layerwise", ring_slots=2, gpu_kv_budget_gb=budget_gb)
    assert len(llm.plan.resident) == 7 and llm.plan.ring_slots == 2
    assert llm.plan.describe().startswith("layerwise plan: 7 of 30 layers resident")
    assert llm.generate([prompts["partial last block"]], GREEDY)[0].token_ids == want
    one = _engine(default_model_dir, "layerwise", ring_slots=1, prefill_chunk_tokens=16)  # rows in 4 chunks
    assert one.generate([prompts["partial last block"]], GREEDY)[0].token_ids == want


def test_layerwise_prefill_chunk_bounds_the_mlp_activations():
    """By default a chunk's MLP activations ([rows, 2 x intermediate]) stay under 256 MiB, at least 8192 rows."""
    assert prefill_chunk(9728, torch.bfloat16) == 8192            # Qwen3-4B: 6,898 rows would fit
    assert prefill_chunk(1536, torch.bfloat16) == 43008           # SmolLM2-135M: a 32K prompt in one call
    assert prefill_chunk(1536, torch.float32) * 2 * 1536 * 4 <= 2**28


def test_documents_one_after_another_answer_as_in_fresh_engines(default_model_dir, engines, prompts):
    tok = engines["gpu"].tokenizer
    doc_a = prompts["several blocks"] + tok.encode(" Question: what did the keeper count?")
    doc_b = tok.encode("A recipe: flour, water, salt and a long rest overnight. " * 6) + tok.encode(" Question: what rests?")
    follow = prompts["several blocks"] + tok.encode(" Question: where is the cape?")  # shares doc A's blocks
    for mode in ("layerwise", "chunked"):
        llm = engines[mode]
        in_turn = [llm.generate([p], GREEDY)[0] for p in (doc_a, doc_b, follow)]
        fresh = [_engine(default_model_dir, mode).generate([p], GREEDY)[0] for p in (doc_a, doc_b, follow)]
        assert [c.token_ids for c in in_turn] == [c.token_ids for c in fresh], mode
        assert in_turn[2].stats.cached_tokens == 4 * BS and fresh[2].stats.cached_tokens == 0


def test_layerwise_decode_trace_shows_the_ring(default_model_dir, prompts):
    n_ring = 3
    llm = _engine(default_model_dir, "layerwise", ring_slots=n_ring)
    rec = TraceRecorder()
    llm.recorder = rec
    prompt = prompts["partial last block"]                       # 53 tokens: 3 full blocks on the host
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    prefill, *decodes = [s for s in rec.steps if s.phase in ("prefill", "decode")]
    L, block = llm.args.num_layers, llm.runner.oe.block_bytes
    assert prefill.metrics["bytes_h2d"] == 0                     # prefill reads nothing back
    assert prefill.device == "cpu (threaded copies)"
    assert prefill.metrics["bytes_d2h"] == L * 3 * block         # each full block written once per layer
    step = decodes[1]                                            # a steady-state step (its first loads came early)
    computes = {s.layer: s for s in step.lane_spans(COMPUTE) if s.name.startswith("layer ")}
    assert sorted(computes) == list(range(L))                    # one compute span per layer
    loads = {s.layer: s for s in step.lane_spans(H2D)}
    assert step.metrics["bytes_h2d"] == L * 3 * block == sum(s.bytes for s in loads.values())
    for layer in range(L - n_ring):                              # load of l + N after compute of l is done
        assert loads[layer + n_ring].t0_us >= computes[layer].t1_us
        assert loads[layer + n_ring].slot == computes[layer].slot == layer % n_ring
    # when layer l starts computing, the loads of layers l .. l+N-1 have been issued: N in flight
    loading = [s for s in step.slots if s.state == "loading"]
    assert len(loading) == L                                     # L-N for this step, N for the next one
    for layer in range(n_ring, L - n_ring):
        issued = {s.layer for s in loading if s.t_us < computes[layer].t0_us}
        assert issued == set(range(n_ring, layer + n_ring))      # layers < N were issued by the step before
    states = {s.state for s in step.slots}
    assert states == {"loading", "ready", "computing", "free"}


def test_chunked_prefill_reads_back_the_triangle(default_model_dir, prompts):
    llm = _engine(default_model_dir, "chunked", ring_slots=2)
    rec = TraceRecorder()
    llm.recorder = rec
    prompt = prompts["partial last block"]                       # C = 4 chunks of 16 tokens (the last one partial)
    llm.generate([prompt], SamplingParams(max_tokens=1))
    prefill = next(s for s in rec.steps if s.phase == "prefill")
    L, b_tok = llm.args.num_layers, llm.runner.oe.block_bytes // BS
    C = 4
    assert prefill.metrics["bytes_h2d"] == L * b_tok * BS * C * (C - 1) // 2
    assert prefill.metrics["bytes_d2h"] == L * b_tok * BS * 3     # full chunks only


def test_cancel_frees_host_blocks_and_the_next_answer_is_unchanged(engines, prompts):
    llm = engines["layerwise"]
    want = llm.generate([prompts["several blocks"]], GREEDY)[0].token_ids
    seq = llm.add_request(prompts["partial last block"], GREEDY)
    llm.step()
    llm.step()
    llm.cancel(seq)
    assert llm.block_manager.num_used == 0 and seq.finish_reason == "cancelled"
    assert llm.generate([prompts["several blocks"]], GREEDY)[0].token_ids == want


def test_offload_refusals_name_the_knob(default_model_dir):
    with pytest.raises(OutOfMemoryError, match=r"GiB.*--host-kv-gb"):
        _engine(default_model_dir, "layerwise", host_kv_gb=1e6)
    with pytest.raises(ConfigError, match="one sequence at a time"):
        _engine(default_model_dir, "chunked", max_num_seqs=4)
    with pytest.raises(OutOfMemoryError, match=r"--gpu-kv-budget"):
        _engine(default_model_dir, "layerwise", gpu_kv_budget_gb=0.001)


def test_planner_spreads_resident_layers():
    p = plan_residency(36, 3, 100, 10, 3 * 100 + 10 + 6 * 100)
    assert len(p.resident) == 6 and p.resident == (3, 9, 15, 21, 27, 33) and len(p.streamed) == 30
    assert plan_residency(36, 3, 100, 10, 36 * 100 + 10).ring_slots == 0
    assert plan_residency(36, 3, 100, 10, None).resident == ()


def test_planner_keeps_the_policys_dense_layers_resident_first():
    p = plan_residency(36, 3, 100, 10, 3 * 100 + 10 + 4 * 100, prefer=(0, 1))
    assert p.resident[:2] == (0, 1) and len(p.resident) == 4 and len(set(p.resident)) == 4
    assert plan_residency(36, 3, 100, 10, 3 * 100 + 10 + 1 * 100, prefer=(0, 1)).resident == (0,)


def test_block_runs_coalesce_consecutive_blocks():
    assert block_runs([(0, 7), (1, 8), (2, 9), (3, 3), (4, 4), (6, 5)]) == [(0, 7, 3), (3, 3, 2), (6, 5, 1)]


def _by_hand(q, k, v, scale):
    """Attention of q [Lq, Hq, D], the last Lq of Lk positions, over k, v [Lk, Hkv, D], written out."""
    lq, lk, g = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lk - lq, lk)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(g, 1))


@pytest.mark.parametrize("lq, lk", [(7, 7), (1, 40), (5, 40), (33, 41), (300, 1100)])
def test_causal_attention_over_a_cached_prefix_is_bottom_right_aligned(lq, lk):
    """New tokens after a cached prefix: query i sits at position lk - lq + i (a question about a cached document)."""
    torch.manual_seed(lq)
    q, k, v = torch.randn(lq, 6, 16), torch.randn(lk, 2, 16), torch.randn(lk, 2, 16)
    torch.testing.assert_close(causal_attention(q, k, v, 0.3), _by_hand(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_lse_merge_equals_one_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 8, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    want = causal_attention(q, k, v, 0.25)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    o, lse = attention_lse(q, kh[:, 35:], vh[:, 35:], 0.25, causal=True)
    for a in range(0, 35, 16):
        b = min(35, a + 16)
        o, lse = merge_lse(o, lse, *attention_lse(q, kh[:, a:b], vh[:, a:b], 0.25))
    torch.testing.assert_close(lse_output(o, q.dtype), want, atol=1e-5, rtol=1e-5)


def test_reused_host_blocks_come_back_in_ascending_runs(default_model_dir):
    """Layer loads are one copy per run of consecutive host blocks: blocks reused from the prefix cache must be
    handed out in order, or a long prompt's layer would move as hundreds of small copies."""
    llm = _engine(default_model_dir, "layerwise")                 # 33 host blocks of 16 tokens
    tok = llm.tokenizer
    for topic in ("tides", "bread", "comets"):                   # the third one reuses the first one's blocks
        seq = llm.add_request(tok.encode(f"A document about {topic}. " * 60)[:15 * BS], SamplingParams(max_tokens=2))
        llm.step()
        runs = block_runs([(i, b) for i, b in enumerate(seq.block_table)])
        assert len(runs) <= 2, seq.block_table                    # never-used blocks, then reused ones
        llm.cancel(seq)


def test_dense_prefill_hook_per_head_equals_one_call():
    from engine.sparse import FullPolicy
    torch.manual_seed(0)
    q, k, v = torch.randn(300, 8, 64), torch.randn(340, 2, 64), torch.randn(340, 2, 64)
    want = causal_attention(q, k, v, 0.1)
    per_head = FullPolicy()
    per_head.one_call_bytes = 0                        # as for a long prompt: one kv head at a time, over q
    torch.testing.assert_close(per_head.prefill_attention(q.clone(), k, v, 0, 0.1), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(FullPolicy().prefill_attention(q, k, v, 0, 0.1), want)


@pytest.mark.parametrize("mode", ["gpu", "layerwise", "chunked"])
def test_stop_mid_prefill_within_a_layer_and_nothing_poisoned(engines, prompts, mode):
    """Stop during a prefill: the stream ends at once as cancelled; the half-computed blocks are not offered by
    the prefix cache, so asking again computes everything and answers as a clean engine does."""
    import threading
    text = engines["gpu"].tokenizer.decode(prompts["several blocks"]) + f" Stop test in {mode} mode."
    llm = engines[mode]
    ids = llm.chat_prompt_ids(text)
    stop, seen = threading.Event(), []

    def progress(fraction, message):
        seen.append(fraction)
        if len(seen) == 5:
            stop.set()

    chunks = list(llm.stream(text, GREEDY, cancel=stop, progress=progress))
    assert chunks[-1].stats.finish_reason == "cancelled" and chunks[-1].stats.completion_tokens == 0
    assert len(seen) == 5 and seen == sorted(seen) and seen[-1] < 1.0   # stopped right after the 5th layer (chunk)
    assert llm.block_manager.num_used == 0
    again = llm.generate([ids], GREEDY)[0]
    assert again.stats.cached_tokens == 0                                  # the stopped prefill left no cache entries
    clean = _engine(engines["gpu"].model_dir, "gpu").generate([ids], GREEDY)[0]
    assert again.token_ids == clean.token_ids


def test_chunked_prefill_in_groups_of_earlier_blocks_answers_the_same(tmp_path):
    """Chunked prefill streams a chunk's earlier blocks in groups (one load, attention and merge per group: the
    default where attention_lse keeps no scores, CUDA's flash and the CPU's fused kernel) or one at a time: the same
    math, so the same greedy answer, in fewer pieces (and no more bytes)."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()   # 10 chunks of 32
    got = {}
    for group in (1, 4):
        llm = LLM(str(tmp_path), device="cpu", kv_block_size=32, mode="chunked", max_model_len=400, kv_store=None)
        assert llm.runner.prefill_group == llm.runner.group > 4      # the CPU's default: whole slots
        llm.runner.prefill_group = group
        rec = TraceRecorder()
        llm.recorder = rec
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        prefill = [s for s in rec.steps if s.phase == "prefill"]
        loads = sum(1 for s in prefill for sp in s.spans if sp.lane == H2D)
        got[group] = (out.token_ids, sum(s.metrics["bytes_h2d"] for s in prefill), loads)
        llm.close()
    assert got[4][0] == got[1][0]
    assert got[4][1] <= got[1][1]          # (a slot that still holds a group of the same layer is not loaded again)
    assert got[4][2] < got[1][2] / 2


def test_a_chunked_prefill_is_timed_in_three_of_its_chunks_at_a_detail_rate(tmp_path):
    """With a detail rate (the app's recorder) a long chunked prefill records the per-layer timeline of three of its
    chunks, the first, a middle one and the last but one (reading ~8K spans of a 6K prefill cost the next step 55 ms
    on an H100); the step says which chunks have
    one and the figures count those chunks' time only. A recorder without a rate times every chunk."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    gen = torch.Generator().manual_seed(3)
    llm = LLM(str(tmp_path), device="cpu", kv_block_size=32, mode="chunked", max_model_len=400, kv_store=None)
    steps = {}
    for name, rec in (("every", TraceRecorder()), ("rate", TraceRecorder(detail_hz=10.0))):
        llm.recorder = rec
        prompt = torch.randint(0, 256, (300,), generator=gen).tolist()      # 10 chunks of 32, not cached
        llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
        steps[name] = [s for s in rec.steps if s.phase == "prefill"][0]
    llm.close()
    every, rate = steps["every"], steps["rate"]
    assert every.metrics["parts"] == rate.metrics["parts"] == 10
    assert every.metrics["parts_detailed"] == 10 and len(every.windows) == 10
    assert rate.metrics["parts_detailed"] == 3 and len(rate.windows) == 3
    timed = [s for s in rate.spans if s.lane != HOST]

    def inside(t0, t1):
        return any(w0 - 1e-3 <= t0 and t1 <= w1 + 1e-3 for w0, w1 in rate.windows)
    assert timed and all(inside(s.t0_us, s.t0_us) for s in timed)       # nothing of the other chunks; compute
    assert all(inside(s.t0_us, s.t1_us) for s in timed if s.lane == COMPUTE)   # ends in it (a copy may end later)
    assert all(inside(s.t_us, s.t_us) for s in rate.slots)
    chunk = {s.name: [] for s in timed}
    for s in timed:
        chunk[s.name].append(s.layer)
    assert sorted(chunk["attention"]) == [0, 0, 0, 1, 1, 1]            # three chunks, both layers each
    assert len(timed) < len([s for s in every.spans if s.lane != HOST]) / 2
    w_first, w_last = rate.windows[0], rate.windows[-1]                 # the first chunk's, the last but one's
    assert w_first[0] <= rate.t0_us + (rate.t1_us - rate.t0_us) * 0.2 and w_last[1] >= rate.t1_us - (
        rate.t1_us - rate.t0_us) * 0.2
    busy = summarize(rate).busy_fraction[COMPUTE]      # over the three chunks' time, not the whole step's
    assert busy > 0.5 and summarize(every).busy_fraction[COMPUTE] > 0.5


def test_quest_in_chunked_mode_streams_its_pages_and_answers_like_full_with_room(tmp_path):
    """Chunked decode with Quest: the budget bounds the bytes streamed per step; a budget holding everything
    answers exactly like Full."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2)).tolist()

    def run(policy, params):
        llm = LLM(str(tmp_path), device="cpu", kv_block_size=32, mode="chunked", max_model_len=400, policy=policy,
                  policy_params=params)
        rec = TraceRecorder()
        llm.recorder = rec
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        decodes = [s for s in rec.steps if s.phase == "decode"][1:]
        return out, [s.metrics.get("bytes_h2d", 0) for s in decodes], rec

    full, full_bytes, _ = run("full", {})
    roomy, _, _ = run("quest", {"token_budget": 512, "page_size": 16, "dense_layers": 0, "min_context": 0, "min_layer_mb": 0})
    assert roomy.token_ids == full.token_ids
    tight, tight_bytes, rec = run("quest", {"token_budget": 64, "page_size": 16, "dense_layers": 0, "min_context": 0, "min_layer_mb": 0})
    per_block = 2 * 2 * 32 * 32 * 4                 # K and V, 2 kv heads, 32 tokens, head_dim 32, fp32
    assert max(tight_bytes) <= 2 * 2 * per_block     # per layer: one pack of chosen pages + the newest block
    assert min(full_bytes) >= 2 * 9 * per_block      # full streams all 9 earlier blocks of both layers
    assert tight.stats.policy_stats["selections"] > 0 and any(s.quest for s in rec.steps)


@pytest.mark.parametrize("hz,detailed_decodes", [(1e-9, 1), (1e9, 4)])
def test_the_live_detail_rate_keeps_the_timeline_of_only_some_decode_steps(default_model_dir, prompts, hz,
                                                                          detailed_decodes):
    """The app records a decode step's per-layer timeline at its views' redraw rate: the other steps keep their
    metrics and host spans but no layer, copy or slot records, and summaries measure over detailed steps only."""
    llm = _engine(default_model_dir, "layerwise", ring_slots=2)
    rec = TraceRecorder(detail_hz=hz)   # 1e-9: only the second decode step after the prefill; 1e9: every one
    llm.recorder = rec
    llm.generate([prompts["partial last block"]], SamplingParams(max_tokens=5, ignore_eos=True))
    prefill, *decodes = [s for s in rec.steps if s.phase in ("prefill", "decode")]
    assert prefill.detailed and prefill.lane_spans(COMPUTE) and prefill.slots       # prefill always is
    assert [s.detailed for s in decodes] == ([True] * 4 if hz > 1 else [False, True, False, False])
    for step in decodes:
        layers = [s for s in step.lane_spans(COMPUTE) if s.name.startswith("layer ")]
        if step.detailed:
            assert len(layers) == llm.args.num_layers and step.slots and step.lane_spans(H2D)
        else:
            assert not layers and not step.slots and not step.lane_spans(H2D)
            assert step.metrics["bytes_h2d"] > 0 and step.t1_us > step.t0_us   # what it did is still there
            assert [s.name for s in step.spans] == ["sample"]
    steps = list(rec.steps)
    if detailed_decodes == len(decodes):         # every step detailed: the window is the steps' extent
        assert summarize(steps).window_us == pytest.approx(steps[-1].t1_us - steps[0].t0_us)
    else:                                        # gaps: busy shares of the detailed steps' own time
        sm = summarize(steps)
        assert sm.busy_us[COMPUTE] / sm.busy_fraction[COMPUTE] == pytest.approx(
            sum(s.dur_us for s in steps if s.detailed), rel=1e-6)
    llm.close()


def test_a_resident_buffer_loads_again_only_what_changed():
    """A resident layer's load at every decode step is skipped without a look at each block while nothing it holds
    changed; a block rewritten from outside (the disk tier), positions compute overwrote, or another layer's
    blocks make it copy again, and what it then holds is the host pool's."""
    from engine.offload.offload_engine import OffloadEngine
    oe = OffloadEngine(2, 2, 4, 4, torch.float32, torch.device("cpu"), host_blocks=6, ring_slots=1, slot_blocks=4,
                       resident_layers=(1,))
    try:
        oe.host.copy_(torch.randn_like(oe.host))
        buf = oe.resident[1]

        def load(blocks):
            before = oe.bytes_h2d
            oe.load(buf, 1, blocks)
            oe.synchronize()
            assert torch.equal(oe.buffers[buf][:len(blocks)], oe.host[1, blocks])
            return (oe.bytes_h2d - before) // oe.block_bytes

        assert load([3, 5]) == 2
        assert load([3, 5]) == 0                    # held: nothing moves
        assert load([3, 5, 0]) == 1                 # one more block
        oe.host[1, 5] += 1.0
        oe.host_written([5])
        assert load([3, 5, 0]) == 1                 # the rewritten block only
        oe.writing(buf, 2)                          # compute writes position 2
        assert load([3, 5, 0]) == 1
        oe.load(buf, 0, [1])                        # another layer's block in the buffer
        assert load([3, 5, 0]) == 3
    finally:
        oe.close()

