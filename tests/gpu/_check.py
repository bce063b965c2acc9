"""Shared pieces of the GPU tests: the two devices, running a function on one, comparing, tables."""

import jax
import ml_dtypes
import numpy as np


def devices():
  """``(accelerator, cpu)``: JAX's default device and the CPU backend's first device."""
  return jax.devices()[0], jax.devices("cpu")[0]


def on(device, fn, *args):
  """``jax.jit(fn)(*args)`` with the arguments on ``device``; the outputs as numpy arrays."""
  with jax.default_device(device):
    args = [jax.device_put(a, device) for a in args]
    return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def rel(a, b) -> float:
  """Relative Frobenius distance ``|a - b| / |b|`` in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bits_differ(a, b) -> int:
  """Number of elements whose bits differ; NaNs count as equal to NaNs (payloads vary by backend)."""
  a, b = np.asarray(a), np.asarray(b)
  floats = a.dtype.kind == "f" or a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)
  if floats and a.dtype != ml_dtypes.float8_e4m3fn:
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    if (na != nb).any():
      return int(np.sum(na != nb))
    a, b = np.where(na, 0, a).astype(a.dtype), np.where(nb, 0, b).astype(b.dtype)
  if floats:
    a = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.itemsize])
    b = b.view(a.dtype)
  return int(np.sum(a != b))


def table(header, rows) -> str:
  """The rows as a markdown table, printed (``pytest -s`` shows it) and returned."""
  text = "\n| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
  text += "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
  print(text)
  return text
