import os
import tempfile

import pytest
import torch

# Before anything imports triton or Qt: without a GPU, Triton kernels run in its interpreter; no display needed.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The disk KV tier of the CLI (on by default) writes here, never into the user's cache (subprocesses inherit it)
os.environ["KVSCOPE_KV_STORE"] = tempfile.mkdtemp(prefix="kvscope-test-kv-")


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted default model, in the user's real cache so later runs reuse it.

    The first run converts the GGUF file (about 15 s on CPU); later runs find it done.
    """
    from engine.defaults import ensure_default_model

    return ensure_default_model()
