"""Shared pieces of the NVFP4 optimizers: state codecs, keys, grouped updates.

The storage rule, the bytes of a state and its shardings are public, in ``fp4jax.optim.state``.
Leaves of the same shape can be updated together under ``jax.vmap`` (``grouped_map``: one program
per shape, not per leaf, each leaf with its own global scale and random bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import _platform, numerics, nvfp4
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor
from fp4jax.optim.state import block_axis, stores_nvfp4

_F32 = jnp.dtype(jnp.float32)


def is_nvfp4(x) -> bool:
  return isinstance(x, NVFP4Tensor)


def concrete_float(x) -> float | None:
  """``x`` as a Python float when its value is known while tracing, else None.

  Hyperparameters are Python numbers, except under ``optax.inject_hyperparams``, where they are
  arrays of the optimizer state (tracers inside a jit): those take the paths that need no static
  value.
  """
  if isinstance(x, jax.core.Tracer):
    return None
  return float(x)


def check_min_size(min_size):
  if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
    raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")


def check_rounding(name, rounding):
  if rounding not in nvfp4.ROUNDINGS:
    raise ValueError(f"{name} must be one of {nvfp4.ROUNDINGS}, got {rounding!r}")


def zeros_nvfp4(shape) -> NVFP4Tensor:
  """``quantize(zeros(shape))`` without computing it (works for abstract shapes in ``init``)."""
  shape = tuple(shape)
  ax = block_axis(shape)
  div = lambda d: tuple(n // d if i == ax else n for i, n in enumerate(shape))  # noqa: E731
  return NVFP4Tensor(
      codes=jnp.zeros(div(2), jnp.uint8),
      scales=jnp.zeros(div(BLOCK), jnp.float8_e4m3fn),
      global_scale=jnp.ones((), jnp.float32),
      shape=shape, block=(1, BLOCK), axis=ax, dtype=_F32)


def zeros_state(shape, min_size: int, quantize: bool):
  """A zero moment for a parameter of ``shape``: NVFP4 under the storage rule, else float32."""
  if quantize and stores_nvfp4(shape, min_size):
    return zeros_nvfp4(shape)
  return jnp.zeros(shape, jnp.float32)


def map_params(fn, params):
  """``jax.tree.map`` over parameter-like leaves (anything with ``shape`` and ``dtype``).

  Wrappers that are pytree nodes around one array (flax ``nnx.Variable``) count as leaves, so the
  state holds plain arrays and ``NVFP4Tensor``s, never a Variable wrapping an ``NVFP4Tensor``.
  """
  return jax.tree.map(fn, params, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def encode(x, rounding: str, key, lane: int = 0) -> NVFP4Tensor:
  """float32 ``x`` -> NVFP4, 1×16 blocks along ``block_axis(x.shape)``; stochastic rounding takes its
  bits from ``numerics.counter_bits(key, x.shape, lane)``."""
  bits = numerics.counter_bits(key, x.shape, lane) if rounding == "stochastic" else None
  return nvfp4.quantize(x.astype(jnp.float32), block=(1, BLOCK), axis=block_axis(x.shape),
                        rounding=rounding, bits=bits)


def decode(t: NVFP4Tensor) -> jax.Array:
  return t.dequantize(jnp.float32)


def group_by_default() -> bool:
  """Whether same-shape leaves are batched: not when the default platform is the CPU.

  On an accelerator, grouping launches fewer kernels; XLA:CPU compiles a vmapped group slowly and
  gains nothing from it. Grouped and ungrouped updates give the same bits.
  """
  return _platform.default_platform() != "cpu"


def grouped_map(fn, indices, *leaf_lists, group: bool):
  """``fn(*args)`` for every index in ``indices``, leaves of one shape batched under ``jax.vmap``.

  Args:
    fn: maps one leaf's arguments (arrays, ``NVFP4Tensor``s, keys or None) to a tuple of outputs.
    indices: the leaf indices to compute.
    *leaf_lists: per argument, a list indexed by leaf index.
    group: False computes each leaf on its own (no stacking copies; more, smaller programs).

  Returns:
    A dict index -> tuple of outputs.
  """
  groups: dict = {}
  for i in indices:
    sig = tuple((getattr(a[i], "shape", None), str(getattr(a[i], "dtype", None)))
                for a in leaf_lists)
    groups.setdefault(sig if group else i, []).append(i)
  out = {}
  for idx in groups.values():
    if len(idx) == 1:
      out[idx[0]] = fn(*(a[idx[0]] for a in leaf_lists))
      continue
    stacked = [None if a[idx[0]] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *(a[i] for i in idx))
               for a in leaf_lists]
    axes = [None if x is None else 0 for x in stacked]
    res = jax.vmap(fn, in_axes=axes)(*stacked)
    for j, i in enumerate(idx):
      out[i] = jax.tree.map(lambda x, j=j: x[j], res)
  return out


def step_key(seed: int, count) -> jax.Array:
  """The random key of one step: ``fold_in(key(seed), count)``; deterministic and checkpoint-free.

  The per-element rounding bits are ``numerics.counter_bits`` of the key (folded with the leaf's
  index), the same on every backend and sharding.
  """
  return jax.random.fold_in(jax.random.key(seed), count)
