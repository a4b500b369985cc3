"""The engine on the embedded default model (SmolLM2-135M-Instruct, fp32, CPU)."""
import threading
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError, ContextTooLongError

SAMPLE = Path(__file__).resolve().parents[2] / "resources" / "samples" / "kv_cache_offload_primer.md"


def chat_prompt(llm, question: str, words: int) -> list[int]:
    text = " ".join(SAMPLE.read_text().split()[:words])
    return llm.chat_prompt_ids([{"role": "user", "content": f"<document>\n{text}\n</document>\n\n{question}"}])


def test_greedy_output_equals_transformers_token_for_token(llm, default_model_dir):
    """Tokens, and each token's top-logit lead over the runner-up (`leads`), as transformers computes them."""
    from transformers import LlamaForCausalLM
    # a question with a long answer, so neither side stops at EOS before 32 tokens
    ids = chat_prompt(llm, "Write a long, detailed summary of this document, section by section.", 250)
    assert 300 < len(ids) < 600
    got = llm.generate([ids], SamplingParams(max_tokens=32, leads=True))[0]
    ref = LlamaForCausalLM.from_pretrained(str(default_model_dir), local_files_only=True, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    assert len(got.token_ids) == 32 and got.token_ids == out.sequences[0, len(ids):].tolist()
    top = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
    assert len(got.leads) == 32 and min(got.leads) >= 0
    assert torch.allclose(torch.tensor(got.leads), top[:, 0] - top[:, 1], atol=2e-3)


def test_the_default_model_answers_sensibly(llm):
    answer = "".join(c.text for c in llm.stream("What is the capital of France?", SamplingParams(max_tokens=16)))
    assert "Paris" in answer


def test_second_question_about_the_same_document_reuses_its_blocks(llm):
    doc = " ".join(SAMPLE.read_text().split()[300:700])
    def ask(q):
        chunks = list(llm.stream([{"role": "user", "content": f"<document>\n{doc}\n</document>\n\n{q}"}],
                                 SamplingParams(max_tokens=12)))
        return "".join(c.text for c in chunks), chunks[-1].stats
    first_answer, first = ask("Summarise the document in one line.")
    again_answer, again = ask("Summarise the document in one line.")
    assert first.cached_tokens == 0 and first.prompt_tokens > 400
    # every full block of the shared prefix is reused; the last prompt token is always computed
    assert again.cached_tokens == (again.prompt_tokens - 1) // 64 * 64 > 0
    assert again_answer == first_answer
    _, other = ask("Which lab is mentioned?")
    assert 0 < other.cached_tokens < other.prompt_tokens


def test_batched_generation_equals_one_by_one(llm):
    prompts = [chat_prompt(llm, q, w) for q, w in (("Name one idea.", 40), ("What is PCIe?", 90), ("Why page?", 150))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    together = [c.token_ids for c in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(llm):
    ids = chat_prompt(llm, "Write a short poem about memory.", 30)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=24, seed=7, ignore_eos=True)
    a, b = (llm.generate([ids], p)[0].token_ids for _ in range(2))
    c = llm.generate([ids], SamplingParams(temperature=1.0, max_tokens=24, seed=8, ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_stats_describe_the_request(llm):
    chunks = list(llm.stream("Say hello.", SamplingParams(max_tokens=8, ignore_eos=True)))
    stats = chunks[-1].stats
    assert stats.completion_tokens == 8 and stats.finish_reason == "length"
    assert stats.ttft_s > 0 and stats.prefill_tok_s > 0 and stats.decode_tok_s > 0
    assert stats.prompt_tokens == len(llm.chat_prompt_ids("Say hello."))


def test_cancel_stops_the_answer_and_frees_its_blocks(llm):
    cancel = threading.Event()
    used_before = llm.block_manager.num_used
    chunks = []
    for chunk in llm.stream("Count from one to one hundred.", SamplingParams(max_tokens=200, ignore_eos=True), cancel):
        chunks.append(chunk)
        if len(chunks) == 3:
            cancel.set()
    stats = chunks[-1].stats
    assert stats.finish_reason == "cancelled" and stats.completion_tokens < 10
    assert llm.block_manager.num_used == used_before


def test_prompt_longer_than_the_context_is_refused_with_both_numbers(llm):
    ids = [1] * 9000
    with pytest.raises(ContextTooLongError) as e:
        llm.generate([[1, 2, 3], ids])
    assert "9000" in str(e.value) and "8192" in str(e.value)
    assert llm.scheduler.is_finished()  # the good prompt queued before it was withdrawn too


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max-new-tokens"),
])
def test_invalid_sampling_values_are_named(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        SamplingParams(**kwargs)


def test_count_tokens(llm):
    assert llm.count_tokens("hello world") == 2


@pytest.mark.parametrize("mode", ["gpu", "layerwise", "chunked"])
def test_close_joins_every_engine_thread(default_model_dir, tmp_path, mode):
    """`with LLM(...)` closes the engine: its copy threads and the disk tier's writer are gone afterwards."""
    before = set(threading.enumerate())               # engines of other tests may still hold theirs

    def started() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in before]
    with LLM(str(default_model_dir), device="cpu", mode=mode, kv_block_size=64, max_model_len=1024,
             kv_store=str(tmp_path / "kv")) as llm:
        llm.generate(["The KV cache " * 40], SamplingParams(max_tokens=3))
        assert "kvscope-kv-writer" in started() and (mode == "gpu" or "kvscope-h2d" in started())
    assert started() == []
    llm.close()                                                                      # idempotent


def test_a_model_folder_without_tokenizer_files_takes_token_ids_and_says_so_for_text(tmp_path):
    """No vocabulary file: the engine loads and answers token ids; text gets one line naming the missing files
    (transformers 5 would have handed back an empty tokenizer that turns every text into no tokens)."""
    from tests.engine.tiny import tiny_model
    tiny_model("qwen3", tmp_path)
    with LLM(str(tmp_path), device="cpu", kv_store=None, max_model_len=64) as llm:
        assert llm.tokenizer is None
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
        with pytest.raises(ConfigError, match="tokenizer.json or tokenizer.model"):
            llm.count_tokens("hello")
