"""Shared pieces of the GPU checks: the two devices, running a function on one, and the report."""

import jax
import numpy as np

CPU = jax.devices("cpu")[0]
DEV = jax.devices()[0]


def on(device, fn, *args):
  """``jax.jit(fn)(*args)`` with the arguments on ``device``; the outputs as numpy arrays."""
  with jax.default_device(device):
    args = [jax.device_put(a, device) for a in args]
    return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def rel(a, b) -> float:
  """Relative Frobenius distance ``|a - b| / |b|`` in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def report(header: tuple[str, ...], rows, ok: bool) -> int:
  """Prints the markdown table and the verdict last; returns the exit code."""
  print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
  for row in rows:
    print("| " + " | ".join(str(c) for c in row) + " |")
  print("\nRESULT:", "PASS" if ok else "FAIL")
  return 0 if ok else 1
