import pytest


@pytest.fixture(scope="session")
def llm(default_model_dir):
    """The real engine on the embedded default model (fp32, CPU), shared by the tests of this folder."""
    from engine import LLM
    return LLM(str(default_model_dir), device="cpu", kv_block_size=64, max_num_seqs=4)
