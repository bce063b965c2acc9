"""Benchmark scripts, one per op or step, each run as ``python -m benchmarks.NAME``; figures in RESULTS.md."""
