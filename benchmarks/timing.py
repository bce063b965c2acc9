"""Helpers shared by the benchmark scripts: timing, the environment line, ``NAME=VALUE`` arguments."""

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


def require_gpu(parser, small: bool, flag: str) -> None:
  """Stops with ``parser.error`` (usage, one line, exit status 2) where a GPU benchmark would run at
  its full size on the CPU, for hours (its kernels in interpret mode, or a GPU-sized model): ``flag``,
  the script's smoke-run switch (``small``: whether it was given), runs it small there instead."""
  if not small and jax.default_backend() == "cpu":
    parser.error(f"no GPU here (jax's backend is cpu): this benchmark's full size would take hours on a "
                 f"CPU; {flag} runs a small check of it here")


def environment_line():
  dev = jax.devices()[0]
  return f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}"


def assignment(text: str, what: str, form: str = "NAME=VALUE") -> tuple[str, object]:
  """``NAME=VALUE`` -> (NAME, VALUE as a bool, int or float where it reads as one, else the string);
  otherwise a ValueError naming ``what`` and the expected ``form``."""
  name, eq, value = text.partition("=")
  if not eq or not name:
    raise ValueError(f"{what}: {text!r} is not {form}")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  for cast in (int, float):
    try:
      return name, cast(value)
    except ValueError:
      pass
  return name, value
