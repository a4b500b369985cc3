"""The bundled sample document and its sample question (the CLI's and the window's defaults, the screenshots')."""
from __future__ import annotations

from pathlib import Path

SAMPLE = Path(__file__).resolve().parent.parent / "resources" / "samples" / "kv_cache_offload_primer.md"
SAMPLE_QUESTION = ("What is the name of the Halvorsen lab's profiling dashboard that shows busy fraction, overlap and "
                   "exposed copy time per layer?")  # the answer sits near the end of the ~5.8K-token sample
