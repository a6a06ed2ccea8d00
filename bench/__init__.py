"""Benchmarks: scripts, not tests (see moe_bench.py)."""
