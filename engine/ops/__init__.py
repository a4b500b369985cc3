"""Attention backends. Each op has a plain torch reference (the CPU path, and what tests compare to)."""
