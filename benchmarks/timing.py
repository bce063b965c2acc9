"""Shared timing helper for the benchmark scripts (never used by tests)."""

import statistics
import time

import jax


def median_seconds(fn, *args, iters=20, warmup=3):
  """Median wall time of ``fn(*args)`` over ``iters`` runs, after ``warmup`` runs (compile included there)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def environment_line():
  dev = jax.devices()[0]
  return f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}"
