"""What Quest reads, as document ranges: real Quest picks (default model, CPU, layerwise) over a real chat prompt
mapped to the document by the real tokenizer."""
import numpy as np
import pytest

from app.prompt import document_messages
from app.quest_highlight import (QuestHighlight, page_ranges, page_shares, page_spans, token_char_map,
                                 utf16_ranges, utf16_shift)
from engine.trace.events import DECODE

WORDS = ("Notes from the planning group. The quarterly review covers the storage migration, the new build farm "
         "and the hiring plan for the inference team. The storage migration moved four petabytes of archive data "
         "to the new object store without downtime. ")
SENTENCE = "The meeting is in Bergen on Tuesday at ten, in the harbour office."
DOC = "# Notes\n\n" + WORDS * 16 + "\n\n" + SENTENCE + "\n\n" + WORDS * 16
QUESTION = "Where is the meeting?"
HISTORY = [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "Planning notes."}]


@pytest.fixture(scope="module")
def run(default_model_dir):
    """(llm, messages, prompt ids, decode steps with picks) of one short Quest answer about DOC."""
    from engine import LLM, SamplingParams
    from engine.trace import TraceRecorder

    llm = LLM(str(default_model_dir), device="cpu", kv_block_size=64, mode="layerwise", max_model_len=2048,
              policy="quest", policy_params={"token_budget": 256, "page_size": 16, "min_context": 0, "min_layer_mb": 0})
    llm.recorder = rec = TraceRecorder()
    messages = document_messages(DOC, QUESTION, "notes.md", None, HISTORY)
    list(llm.stream(messages, SamplingParams(max_tokens=3, ignore_eos=True)))
    steps = [s for s in rec.steps if s.phase == DECODE and s.quest]
    assert len(steps) >= 2
    return llm, messages, llm.chat_prompt_ids(messages), steps


@pytest.fixture(scope="module")
def token_map(run):
    llm, messages, ids, _ = run
    m, why = token_char_map(llm.tokenizer, messages, ids, DOC)
    assert why == "" and m is not None
    return m


def test_token_map_puts_each_document_token_on_its_characters(run, token_map):
    llm, _, ids, _ = run
    assert token_map.shape == (len(ids), 2) and token_map.dtype == np.int32
    inside = np.nonzero(token_map[:, 0] >= 0)[0]
    assert len(inside) > 1000 and np.array_equal(inside, np.arange(inside[0], inside[-1] + 1))   # one run
    assert token_map[inside[0], 0] == 0 and token_map[inside[-1], 1] == len(DOC)
    assert (token_map[token_map[:, 0] < 0] == -1).all()                  # template, question, history: none
    assert (np.diff(token_map[inside, 0]) >= 0).all()
    for i in inside[1:-1]:                                               # (the first and last may be clipped)
        start, end = token_map[i]
        assert DOC[start:end] == llm.tokenizer.decode([ids[i]])
    assert QUESTION not in "".join(DOC[s:e] for s, e in token_map[inside])   # the question is not the document


def test_a_prompt_that_does_not_match_gives_no_map(run):
    llm, messages, ids, _ = run
    m, why = token_char_map(llm.tokenizer, messages, ids[:-1], DOC)
    assert m is None and "ids" in why
    m, why = token_char_map(llm.tokenizer, messages, ids, "a document that is not in the prompt")
    assert m is None and "not in the rendered prompt" in why


def test_ranges_cover_the_picked_pages_in_the_document(run, token_map):
    step = run[3][-1]
    pages, shares, page_size = page_shares(step.quest)
    assert page_size == 16 and len(step.quest) > 1 and len(step.quest[0].positions) < step.quest[0].n_blocks
    ranges, weights = page_ranges(step.quest, token_map)
    assert ranges and len(ranges) == len(weights)
    flat = [x for r in ranges for x in r]
    assert flat == sorted(flat) and all(s < e for s, e in ranges)        # sorted, disjoint, none empty
    assert 0 <= ranges[0][0] and ranges[-1][1] <= len(DOC)
    assert all(0 < w <= 1 for w in weights) and len(set(weights)) > 1    # heads and layers disagree
    lit = np.zeros(len(DOC), dtype=float)
    for (s, e), w in zip(ranges, weights):
        lit[s:e] = w
    share = dict(zip(pages.tolist(), shares.tolist()))
    doc_pages = 0
    for page in range(-(-len(token_map) // page_size)):
        tokens = token_map[page * page_size:(page + 1) * page_size]
        tokens = tokens[tokens[:, 0] >= 0]
        if not len(tokens):
            continue
        doc_pages += 1
        for s, e in tokens:                 # each token's characters lit with its page's share (0: not picked)
            assert lit[s] == pytest.approx(share.get(page, 0.0)), (page, s, e)
    assert doc_pages > len([p for p in share if share[p] > 0.5])         # not everything, strongly
    # the shares are the fraction of (layer, kv head) picks choosing each page
    page = int(pages[len(pages) // 2])
    chose = sum(page in set(np.asarray(p.positions).tolist()) for p in step.quest)
    assert share[page] == pytest.approx(chose / len(step.quest))
    # a threshold keeps only the pages chosen by more picks
    strong, strong_w = page_ranges(step.quest, token_map, min_share=0.5)
    assert strong and all(w > 0.5 for w in strong_w) and sum(e - s for s, e in strong) < sum(e - s for s, e in ranges)
    assert all(any(s <= a and b <= e for s, e in ranges) for a, b in strong)


def test_page_spans_tile_the_document(token_map):
    spans = page_spans(token_map, 16)
    doc = spans[spans[:, 0] >= 0]
    assert doc[0, 0] == 0 and doc[-1, 1] == len(DOC) and np.array_equal(doc[1:, 0], doc[:-1, 1])


class Panel:
    def __init__(self):
        self.calls = []

    def highlight_ranges(self, ranges, weights=None, scroll=True):
        self.calls.append((list(ranges), weights, scroll))


def test_the_highlight_follows_the_newest_step_of_the_turn(run, token_map):
    steps = run[3]
    panel, hl = Panel(), QuestHighlight(Panel())
    hl.panel = panel
    hl.new_turn({"map": token_map, "text": DOC, "first_step": steps[0].step})
    assert panel.calls == [([], None, True)]                           # a new turn clears
    hl.feed(steps[:1])
    hl.feed(steps)
    assert hl.current_step() is steps[-1] and len(panel.calls) == 3
    ranges, weights = page_ranges(steps[-1].quest, token_map)
    assert panel.calls[-1] == (ranges, weights, False)                 # scrolled once, at the first draw
    assert panel.calls[1][2] is True
    hl.feed(steps)                                                      # the same step again: not redrawn
    assert len(panel.calls) == 3
    hl.set_enabled(False)
    assert panel.calls[-1][0] == []
    hl.set_enabled(True)
    assert panel.calls[-1][0] == ranges
    hl.new_turn({"map": token_map, "text": DOC, "first_step": steps[-1].step + 1})
    hl.feed(steps)                                                      # the last turn's steps: not this turn's
    assert hl.current_step() is None and panel.calls[-1][0] == []
    hl.new_turn(None)                                                   # a turn without Quest
    hl.feed(steps)
    assert hl.current_step() is None and panel.calls[-1][0] == []


def test_utf16_positions_count_characters_outside_the_bmp_twice():
    text = "a😀b 😀 hello"
    i = text.index("hello")
    assert utf16_ranges([(i, i + 5), (0, 2)], utf16_shift(text)) == [(i + 2, i + 7), (0, 3)]
    assert utf16_shift("plain text") is None and utf16_shift("naïve") is None
    assert utf16_ranges([(1, 3)], None) == [(1, 3)]
