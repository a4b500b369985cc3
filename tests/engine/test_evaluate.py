"""The needle harness: documents of the asked length with the fact at the asked depth, graded by the answer."""
import pytest

from bench.needle import NEEDLES, grid, main, needle_document, run_needles


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from engine import LLM
    return LLM(str(default_model_dir), device="cpu", mode="layerwise", kv_block_size=64, max_model_len=2048)


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_needle_documents_have_the_length_and_the_depth(llm, depth):
    ids, question = needle_document(llm, 1500, depth, "place")
    assert 1400 <= len(ids) <= 1500 and question == NEEDLES["place"][1]
    text = llm.tokenizer.decode(ids)
    doc = text[text.index("<document>"):text.index("</document>")]
    at = doc.index(NEEDLES["place"][0]) / len(doc)
    assert abs(at - depth) < 0.05


def test_the_default_model_finds_a_number_and_the_grid_says_so(llm):
    cells = run_needles(llm, "full", [1024], [0.5], ["number"])
    assert cells[0].hit and "4817" in cells[0].answer and cells[0].lead > 0
    assert "1/1 x" in grid(cells, [1024], [0.5], ["number"])


def test_the_grid_names_the_cells_that_hung_on_a_near_tie():
    from bench.needle import NEAR_TIE, Cell
    cells = [Cell("full", 7000, 0.9, "name", 6990, False, "The architect", lead=0.19),
             Cell("full", 7000, 0.9, "number", 6990, True, "4817", lead=NEAR_TIE + 3),
             Cell("full", 2048, 0.9, "name", 2040, True, "Ingrid Solberg", lead=0.31)]
    text = grid(cells, [2048, 7000], [0.9], ["number", "name"])
    near = text.splitlines()[-1]
    assert near.startswith("near-ties") and "7000/90% name 0.19 (.)" in near and "2048/90% name 0.31 (x)" in near
    assert "number" not in near and near.index("0.19") < near.index("0.31")


def test_following_fulls_answer_from_where_a_miss_parted_from_it(llm):
    """A missed cell is answered again from Full's tokens up to the first one the answers differ in: with Full's own
    attention that gives Full's answer back, so a hit there says the miss was that one token."""
    import dataclasses

    from bench.needle import Cell, follow, followed_text
    full = run_needles(llm, "full", [1024], [0.5], ["number"])[0]
    assert full.hit and len(full.tokens) == len(full.leads) > 3
    other = next(t for t in range(100, 200) if t != full.tokens[2])
    missed = dataclasses.replace(full, policy="quest", hit=False, answer="?",
                                 tokens=full.tokens[:2] + [other] + full.tokens[3:])
    f = follow(llm, missed, full)
    assert f["at"] == 2 and f["full_lead"] == full.leads[2] and f["hit"] and "4817" in f["answer"]
    assert f["answer"].startswith(full.answer[:20])
    missed.followed = f
    text = followed_text([missed, full])
    assert "1024/50% number: parts from Full's answer at token 3" in text and "it finds the needle" in text
    assert followed_text([full]) == ""
    assert Cell("q", 1, 0.5, "name", 1, False, "").followed is None


def test_command_line_writes_every_cell(tmp_path, capsys, default_model_dir):
    out = tmp_path / "needles.json"
    assert main(["needle", "--model", str(default_model_dir), "--device", "cpu", "--lengths", "600", "--depths",
                 "0.5", "--kinds", "place", "--block-size", "64", "--json", str(out)]) == 0
    assert "depth 50%" in capsys.readouterr().out and '"kind": "place"' in out.read_text()


# Quest at 1024 tokens, half the prompt: at 512 it misses number cells that Full finds (README's grid; on this test's
# 1900-token prompt at depth 10% its answer ends "4812" instead of "4817" on some CPUs), a shortfall the README
# reports, not one this acceptance check may hide behind luck.
SPARSE = [("quest", {"token_budget": 1024, "page_size": 16, "min_context": 0, "min_layer_mb": 0}),
          ("minference", {"min_len": 1024, "vertical": 128, "slash": 256}),
          ("xattention", {"min_len": 1024, "threshold": 0.9, "stride": 8, "block": 64})]


def test_each_policy_finds_the_needles_full_finds(llm):
    """The acceptance check of the sparse policies at the default model's scale (the full grid is in the README)."""
    depths = [0.1, 0.5, 0.9]
    full = [c.hit for c in run_needles(llm, "full", [1900], depths, ["number"])]
    assert any(full)
    try:
        for name, params in SPARSE:
            llm.set_policy(name, params)
            cells = run_needles(llm, name, [1900], depths, ["number"])
            missed = [c for c, want in zip(cells, full) if want and not c.hit]
            assert not missed, f"{name} missed {[(c.depth, c.answer) for c in missed]}"
    finally:
        llm.set_policy("full")
