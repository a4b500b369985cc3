"""The disk KV tier on the real engine (the default model, CPU): a document read once is not prefilled again,
also by a new engine (a restart); what comes from disk is exactly what prefill computes; bad pages are never used."""
import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Sequence
from engine.trace import TraceRecorder

PROMPT = list(range(1000, 1000 + 700))     # 10 full 64-token blocks + 60 tokens
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _llm(model_dir, store, mode="gpu", **kw):
    return LLM(str(model_dir), device="cpu", kv_block_size=64, max_model_len=2048, mode=mode, kv_store=str(store),
               **kw)


def _run(llm, prompt=PROMPT, params=GREEDY):
    rec = TraceRecorder()
    llm.recorder = rec
    out = llm.generate([prompt], params)[0]
    llm.tier.flush()
    return out, list(rec.steps)


@pytest.mark.parametrize("mode", ["gpu", "layerwise", "chunked"])
def test_kv_read_from_disk_answers_as_prefill_does(default_model_dir, tmp_path, mode):
    first = _llm(default_model_dir, tmp_path, mode)
    computed, _ = _run(first)
    assert computed.stats.disk_cached_tokens == 0
    assert first.tier.metrics()["disk_pages"] == 11             # 711 tokens have KV: 11 full blocks
    first.close()
    again = _llm(default_model_dir, tmp_path, mode)              # a restart: a new engine, the same store
    read, steps = _run(again)
    assert read.stats.cached_tokens == read.stats.disk_cached_tokens == 640   # all full blocks but the last token's
    assert read.token_ids == computed.token_ids                   # greedy: the same answer
    prefill = [s for s in steps if s.phase == "prefill"][0]
    disk = [sp for sp in prefill.spans if sp.name == "disk read"]
    assert len(disk) == 1 and disk[0].bytes == 10 * again.tier.fmt.nbytes and disk[0].args["pages"] == 10
    assert prefill.n_tokens == 60 and prefill.metrics["disk_cached_tokens"] == 640
    assert "decode_tokens" not in prefill.metrics and prefill.metrics["disk_pages"] == 11
    decode = [s for s in steps if s.phase == "decode"]
    assert decode and all(s.metrics["decode_tokens"] == 1 and "disk_pages" in s.metrics for s in decode)
    again.close()


def test_decode_blocks_are_written_in_page_strides(default_model_dir, tmp_path):
    llm = _llm(default_model_dir, tmp_path)
    out, _ = _run(llm, params=SamplingParams(max_tokens=80, ignore_eos=True))   # 700 + 80: blocks 10 and 11 fill
    assert llm.tier.metrics()["disk_pages"] == 12 and llm.tier.metrics()["disk_write_pending"] == 0
    follow_up = PROMPT + out.token_ids + list(range(5000, 5010))   # the next turn of the chat: prompt + answer + more
    llm.close()
    again = _llm(default_model_dir, tmp_path)
    nxt, _ = _run(again, follow_up)
    assert nxt.stats.disk_cached_tokens == 12 * 64               # the answer's full blocks came from disk too
    assert not again.block_manager.used_ids                      # the writes' holds were all released
    again.close()


def test_a_corrupt_page_is_recomputed_and_rewritten(default_model_dir, tmp_path):
    llm = _llm(default_model_dir, tmp_path)
    computed, _ = _run(llm)
    llm.close()
    pages = sorted(tmp_path.glob("*/*/*.kvp"), key=lambda p: p.stat().st_mtime_ns)
    assert len(pages) == 11
    victim = pages[4]                                             # written in order: the 5th block's page
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    again = _llm(default_model_dir, tmp_path)
    read, _ = _run(again)
    assert read.stats.disk_cached_tokens == 4 * 64                # up to the bad page, then computed
    assert read.token_ids == computed.token_ids
    assert again.tier.metrics()["disk_pages"] == 11               # and rewritten
    again.close()
    third = _llm(default_model_dir, tmp_path)
    assert _run(third)[0].stats.disk_cached_tokens == 640
    third.close()


def test_pages_of_another_prefill_policy_are_never_read(default_model_dir, tmp_path):
    llm = _llm(default_model_dir, tmp_path)
    _run(llm)
    llm.close()
    sparse = _llm(default_model_dir, tmp_path, policy="minference", policy_params={"min_len": 256})
    assert _run(sparse)[0].stats.disk_cached_tokens == 0          # its KV is not dense KV: another namespace
    sparse.set_policy("full")                                     # back to dense: the dense pages are found
    assert _run(sparse)[0].stats.disk_cached_tokens == 640
    quest = _llm(default_model_dir, tmp_path, mode="layerwise", policy="quest")
    assert _run(quest)[0].stats.disk_cached_tokens == 640          # Quest changes decode only: dense prefill KV
    sparse.close()
    quest.close()


def test_quest_on_kv_from_disk_picks_as_on_kv_it_computed(default_model_dir, tmp_path):
    """Quest's key bounds of blocks read from disk are made from their keys: its sparse decode (256-token budget
    over ~700 tokens) answers as with the same blocks from the in-memory prefix cache."""
    quest = {"policy": "quest", "policy_params": {"token_budget": 256, "page_size": 16, "dense_layers": 2, "min_context": 0, "min_layer_mb": 0}}
    llm = _llm(default_model_dir, tmp_path, mode="layerwise", **quest)
    _run(llm)
    memory_hit, _ = _run(llm)
    assert memory_hit.stats.cached_tokens == 640 and memory_hit.stats.disk_cached_tokens == 0
    assert llm.runner.policy.selections > 0                       # sparse: it chose pages
    llm.close()
    again = _llm(default_model_dir, tmp_path, mode="layerwise", **quest)
    read, _ = _run(again)
    assert read.stats.disk_cached_tokens == 640 and read.token_ids == memory_hit.token_ids
    again.close()


def test_the_size_limit_holds_under_many_documents(default_model_dir, tmp_path):
    llm = _llm(default_model_dir, tmp_path, kv_store_gb=0.02)    # room for 7 pages of 2.9 MiB
    for d in range(5):                                            # 4 pages each
        _run(llm, list(range(3000 + 1000 * d, 3000 + 1000 * d + 300)), SamplingParams(max_tokens=2))
        pages, nbytes = llm.tier.store.usage()
        files = list(tmp_path.glob("*/*/*.kvp"))
        assert nbytes <= 0.02 * 2**30 and sum(p.stat().st_size for p in files) == nbytes and len(files) == pages
    assert pages == int(0.02 * 2**30 // files[0].stat().st_size) == 7
    llm.close()


def test_a_held_block_is_not_reused_until_released():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence(list(range(8)), SamplingParams(), 4)
    bm.allocate(seq)
    held = seq.block_table[0]
    bm.hold(held)                                                 # the writer reads it
    bm.deallocate(seq)
    assert bm.num_free == 1 and held in bm.used_ids
    bm.release(held)                                              # acknowledged
    assert bm.num_free == 2 and not bm.used_ids


def test_forgetting_the_cache_keeps_what_was_cached_before_and_still_is():
    """LLM.warm_up's throwaway prompts leave the cache; the prompts cached before them stay, unless a throwaway
    prompt took their block."""
    bm = BlockManager(num_blocks=6, block_size=4)
    tables = []
    for first in (0, 50):                                          # two documents of two full blocks, cached
        seq = Sequence(list(range(first, first + 8)), SamplingParams(), 4)
        bm.allocate(seq)
        tables.append(list(seq.block_table))
        bm.deallocate(seq)
    kept = dict(bm.hash_to_block)
    taken = Sequence(list(range(100, 112)), SamplingParams(), 4)   # a throwaway prompt: two clean blocks, then
    bm.allocate(taken)                                              # the oldest cached one (the first doc's first)
    assert tables[0][0] in taken.block_table
    bm.deallocate(taken)
    bm.forget_cached(keep=kept)
    assert bm.cached_ids() == sorted([tables[0][1], *tables[1]]) and len(bm.hash_to_block) == 3
    assert bm.num_free == 6 and len(bm.clean) == 3                 # the rest is clean: handed out first
    again = Sequence(list(range(50, 60)), SamplingParams(), 4)
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == tables[1]


def test_blocks_a_sparse_decode_wrote_to_never_reach_the_disk(default_model_dir, tmp_path):
    """Quest's answer tokens carry KV from attention over a subset: the store keeps only what prefill computes (its
    pages are read by every decode policy)."""
    quest = {"policy": "quest", "policy_params": {"token_budget": 256, "page_size": 16, "dense_layers": 2,
                                                   "min_context": 0, "min_layer_mb": 0}}
    llm = _llm(default_model_dir, tmp_path, mode="layerwise", **quest)
    _run(llm, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))    # block 10 filled by tokens 700-703
    llm.close()                                                         # (the writer's last writes finish)
    assert len(list(tmp_path.glob("*/*/*.kvp"))) == 10                  # the prompt's 10 full blocks only
