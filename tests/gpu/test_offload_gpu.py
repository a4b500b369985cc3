"""Offload modes on a real CUDA device: streams, events and pinned memory (run with `make gpu-test`)."""
import gc

import pytest
import torch

from bench.shapes import shape_config
from engine import LLM, SamplingParams
from engine.trace import TraceRecorder, summarize
from engine.trace.events import COMPUTE, COMPUTING, H2D

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BS = 256


def _engine(mode, **kw):
    """Random weights of Qwen3-4B's shape in fp32 (so that greedy tokens are comparable across modes)."""
    if mode == "gpu":
        kw["num_kv_blocks"] = 64
    return LLM(shape=shape_config("qwen3-4b"), dtype="float32", max_model_len=4096, mode=mode, kv_block_size=BS, **kw)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (BS - 10, 3 * BS, 1000)]


@pytest.fixture(scope="module")
def reference(prompts):
    with _engine("gpu") as llm:
        out = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("mode, kw", [("layerwise", {}), ("layerwise", {"ring_slots": 2, "gpu_kv_budget_gb": 1.0}),
                                      ("chunked", {})])
def test_offload_tokens_equal_gpu_mode_on_cuda(mode, kw, prompts, reference):
    with _engine(mode, **kw) as llm:
        assert llm.runner.oe.host.is_pinned()
        got = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
        assert got == reference
        if mode == "chunked":     # its decode ran as graph replays over the ring (the earlier blocks fit a slot)
            assert llm.runner.decode_graphs.graphs
            assert llm.runner.prefill_group > 1   # and its prefill streamed earlier blocks in groups
        if kw.get("gpu_kv_budget_gb"):
            assert 0 < len(llm.plan.resident) < 36


def test_layerwise_copies_overlap_compute_on_cuda():
    llm = LLM(shape=shape_config("qwen3-4b"), max_model_len=16384, mode="layerwise", ring_slots=3)
    rec = TraceRecorder(device=llm.device)
    llm.recorder = rec
    prompt = torch.randint(0, 150000, (12000,)).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.recorder = None
    L, block = 36, llm.runner.oe.block_bytes
    llm.close()                                      # (the runner is gone after close)
    prefill, *decodes = [s for s in rec.steps if s.phase in ("prefill", "decode")]
    assert prefill.metrics["bytes_h2d"] == 0 and prefill.metrics["bytes_d2h"] == L * (12000 // BS) * block
    steady = decodes[2:-1]   # (the last step's prefetch for a step that never comes differs: seen on an H200)
    for step in steady:
        loads = step.lane_spans(H2D)
        assert step.metrics["bytes_h2d"] == L * (12000 // BS) * block          # what the engine issued
        # the trace: a cross-step prefetch can land in the neighbouring step (seen once with decode graphs)
        assert abs(sum(s.bytes for s in loads) - L * (12000 // BS) * block) <= (12000 // BS) * block, \
            [(s.layer, s.bytes >> 20) for s in loads]
        computes = {s.layer: s for s in step.lane_spans(COMPUTE) if s.name.startswith("layer ")}
        assert len(computes) == L
        for s in loads:
            if s.layer >= 3 and s.args is not None:
                assert s.t0_us >= computes[s.layer - 3].t1_us - 1.0  # after compute-done of layer l - N
    sm = summarize(steady)
    print(f"\nlayerwise decode @12K: H2D {sm.gbps['h2d']:.1f} GB/s, compute busy {sm.busy_fraction['compute']:.2f}, "
          f"overlap {sm.overlap_fraction:.2f}, exposed copy {sm.exposed_copy_us / len(steady) / 1e3:.2f} ms/token")
    assert sm.gbps["h2d"] > 5.0 and sm.overlap_fraction > 0.5


def test_page_gather_reads_the_pinned_pool_directly():
    """Quest's per-kv-head page loads on CUDA: one gather kernel over the pool's device mapping."""
    from engine.offload.offload_engine import OffloadEngine
    oe = OffloadEngine(2, 4, 64, 64, torch.bfloat16, torch.device("cuda"), host_blocks=10, ring_slots=1,
                       slot_blocks=4)
    oe.host.copy_(torch.randn(oe.host.shape).to(torch.bfloat16))
    pages = torch.tensor([[0, 5, 17, 39, 2, 3, 8, 9], [1, 4, 6, 30, 31, 33, 12, 13],
                          [0, 1, 2, 3, 4, 5, 6, 7], [39, 38, 20, 21, 22, 23, 24, 25]], device="cuda")
    oe.load_rows(0, 1, (pages[:, :, None] * 16 + torch.arange(16, device="cuda")).flatten(1))   # pages of 16 rows
    torch.cuda.synchronize()
    host = oe.host[1].view(10, 2, 4, 4, 16, 64)                      # [block, k/v, head, page, P, D]
    buf = oe.buffers[0].view(4, 2, 4, 4, 16, 64)
    for h in range(4):
        for j, p in enumerate(pages[h].tolist()):
            assert torch.equal(buf[j // 4, :, h, j % 4].cpu(), host[p // 4, :, h, p % 4])
    oe.close()


@pytest.mark.parametrize("mode", ["gpu", "layerwise"])
def test_warm_up_captures_at_load_and_leaves_no_trace(mode, prompts, reference):
    """LLM.warm_up() (the app and the CLI call it at load) captures what the first turn would: gpu mode's traced
    decode graphs, every layerwise (layer, ring buffer) graph; the answers after it are those of the reference."""
    with _engine(mode) as llm:
        llm.warm_up()
        if mode == "gpu":
            assert llm.runner.traced_graphs
        else:
            captured = {(layer, buf) for layer, buf, v, part in llm.runner.decode_graphs.graphs if v == 0}
            want = {(layer, llm.runner._buffer(layer)) for layer in range(llm.args.num_layers)}
            assert want <= captured
            before = len(llm.runner.decode_graphs.graphs)
        out = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
        assert out == reference
        if mode == "layerwise":
            assert len(llm.runner.decode_graphs.graphs) == before    # the first turns captured nothing new
        print(f"{mode}: warm-up captured {len(llm.runner.decode_graphs.graphs) if mode != 'gpu' else 'traced'} graphs")


def test_chunked_prefill_timeline_nests_each_layers_attention_and_mlp():
    """A question over a cached document in chunked mode, traced on CUDA: the layer, its attention and its MLP share
    their boundary marks (the layer begins with its attention, the MLP begins where the attention ends and ends
    inside the layer), every wait lies inside its layer's attention, and each slot's COMPUTING state comes at the
    end of the wait before it."""
    llm = LLM(shape=shape_config("smollm2-135m"), max_model_len=4096, mode="chunked", kv_block_size=BS)
    doc = torch.randint(0, 40000, (3 * BS,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.generate([doc + [7]], SamplingParams(max_tokens=2, ignore_eos=True))        # the document's KV cached
    rec = TraceRecorder(device=llm.device)
    llm.recorder = rec
    llm.generate([doc + list(range(11, 11 + BS + 40))], SamplingParams(max_tokens=2, ignore_eos=True))  # 2 chunks
    llm.recorder = None
    layers = llm.args.num_layers
    llm.close()
    prefill = next(s for s in rec.steps if s.phase == "prefill")
    spans = prefill.lane_spans(COMPUTE)
    by = lambda name, l: [s for s in spans if s.name == name and s.layer == l]   # noqa: E731
    waits = [s for s in spans if s.name == "wait for copy"]
    assert waits and {s.layer for s in spans if s.name.startswith("layer ")} == set(range(layers))
    for l in range(layers):
        for lay, att, mlp in zip(by(f"layer {l}", l), by("attention", l), by("mlp", l)):   # one per chunk
            assert lay.t0_us == att.t0_us and att.t1_us == mlp.t0_us and mlp.t1_us <= lay.t1_us
            assert all(att.t0_us <= w.t0_us <= w.t1_us <= att.t1_us for w in waits if w.layer == l
                       and lay.t0_us <= w.t0_us <= lay.t1_us)
    computing = [s for s in prefill.slots if s.state == COMPUTING]
    ends = {w.t1_us for w in waits}
    assert computing and all(s.t_us in ends for s in computing)


def test_layerwise_prefill_timeline_shares_marks_between_wait_attention_and_mlp():
    """A question over a cached document in layerwise mode, traced on CUDA: each layer begins where its wait for the
    copy ends, its attention begins with it, its MLP begins where the attention ends and ends inside the layer; each
    slot's COMPUTING state comes at the end of the wait before it."""
    llm = LLM(shape=shape_config("smollm2-135m"), max_model_len=4096, mode="layerwise", kv_block_size=BS)
    doc = torch.randint(0, 40000, (3 * BS,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.generate([doc + [7]], SamplingParams(max_tokens=2, ignore_eos=True))        # the document's KV cached
    rec = TraceRecorder(device=llm.device)
    llm.recorder = rec
    llm.generate([doc + list(range(11, 11 + 40))], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.recorder = None
    layers = llm.args.num_layers
    llm.close()
    prefill = next(s for s in rec.steps if s.phase == "prefill")
    spans = prefill.lane_spans(COMPUTE)
    one = lambda name, l: next(s for s in spans if s.name == name and s.layer == l)   # noqa: E731
    for l in range(layers):
        wait, lay, att, mlp = (one(n, l) for n in ("wait for copy", f"layer {l}", "attention", "mlp"))
        assert wait.t1_us == lay.t0_us == att.t0_us and att.t1_us == mlp.t0_us and mlp.t1_us <= lay.t1_us
    computing = [s for s in prefill.slots if s.state == COMPUTING]
    assert computing and all(s.t_us in {w.t1_us for w in spans if w.name == "wait for copy"} for s in computing)
