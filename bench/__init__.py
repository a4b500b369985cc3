"""Tooling around the engine, not part of it: benchmarks (`python -m bench`), sparse prefill kernel timings
(bench.kernels), the needle accuracy harness (`python -m bench.needle`) and real models' shapes (bench.shapes)."""
