"""Shared pieces of the NVFP4 optimizers: the storage rule, state codecs, keys, bytes, shardings.

Storage rule (the same for every optimizer state in this package): a state leaf is stored as an
``NVFP4Tensor`` with 1×16 blocks iff it has at least ``min_size`` elements (default 4096,
bitsandbytes' ``min_8bit_size``) and an axis whose size is a multiple of 16; the blocks run along the
**last** such axis (the last axis for nearly every weight; the first for an untied LM head of shape
``(d, 50257)``). Every other leaf (biases and norm scales, odd shapes, scalars) stays float32 and
follows optax's arithmetic exactly: small leaves are a negligible share of a model's bytes, and a
16-element block with one global scale is a poor fit for a 64-element vector.

Leaves of the same shape can be updated together under ``jax.vmap`` (``grouped_map``: one program
per shape, not per leaf, each leaf with its own global scale and random bits).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax import _platform, numerics, nvfp4
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor

DEFAULT_MIN_SIZE = 4096
_F32 = jnp.dtype(jnp.float32)


def is_nvfp4(x) -> bool:
  return isinstance(x, NVFP4Tensor)


def block_axis(shape) -> int | None:
  """The blocked axis of the storage rule: the last axis whose size is a multiple of 16, or None."""
  for ax in range(len(shape) - 1, -1, -1):
    if shape[ax] % BLOCK == 0 and shape[ax] > 0:
      return ax
  return None


def stores_nvfp4(shape, min_size: int) -> bool:
  """The storage rule of the module docstring: is a state leaf of ``shape`` stored as NVFP4?

  Empty leaves never are (whatever ``min_size``): they have no block to scale.
  """
  shape = tuple(shape)
  return block_axis(shape) is not None and math.prod(shape) >= max(min_size, 1)


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


def state_nbytes(state) -> int:
  """Bytes held by an optimizer state: packed codes, E4M3 scales and global scales of NVFP4 leaves
  plus every other array leaf, counted from shapes (works on ``jax.eval_shape`` output).

  Args:
    state: any pytree of arrays, ``jax.ShapeDtypeStruct`` and ``NVFP4Tensor``.

  Returns:
    The total number of bytes.
  """
  total = 0
  for leaf in jax.tree.leaves(state, is_leaf=is_nvfp4):
    if is_nvfp4(leaf):
      total += sum(_leaf_nbytes(x) for x in (leaf.codes, leaf.scales, leaf.global_scale))
    else:
      total += _leaf_nbytes(leaf)
  return total


def _leaf_nbytes(x) -> int:
  if not hasattr(x, "shape"):
    return np.asarray(x).nbytes
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return int(np.prod(x.shape)) * 8
  return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def state_sharding(state, params_sharding, replicated=None):
  """Shardings for an optimizer state that follow the parameters' shardings (ZeRO-style).

  Every subtree of ``state`` with the structure of the parameters (optax moments, ``MaskedNode``s
  allowed) is matched leaf by leaf with ``params_sharding``: an array of the parameter's rank gets
  the parameter's sharding; an ``NVFP4Tensor`` gets it for its packed codes and its E4M3 scales
  (both keep the parameter's axes, the blocked one divided by 2 and 16, so a shard holds its own
  codes and scales), and a replicated global scale. A mesh axis that does not divide the leaf's
  dimension is dropped from that dimension (e.g. the scales of a blocked axis sharded finer than 16
  elements per shard). Everything else (counts, scalars) is replicated.

  Args:
    state: the optimizer state, or its ``jax.eval_shape``.
    params_sharding: a pytree like the parameters, of ``NamedSharding``s.
    replicated: sharding for the other leaves; default: replicated on the mesh of the first
      parameter sharding.

  Returns:
    A pytree of shardings with the structure of ``state`` (usable as ``out_shardings``).

  Example:
    >>> from fp4jax import optim
    >>> mesh = jax.make_mesh((1,), ("x",))
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> tx = optim.adamw_nvfp4(1e-3)
    >>> shardings = optim.state_sharding(jax.eval_shape(tx.init, params),
    ...                                  {"w": NamedSharding(mesh, PartitionSpec(None, "x"))})
  """
  shardings, p_def = jax.tree.flatten(params_sharding)
  if not shardings:
    raise ValueError("params_sharding has no leaves")
  if replicated is None:
    replicated = NamedSharding(shardings[0].mesh, PartitionSpec())
  masked = optax.MaskedNode
  is_leaf = lambda x: is_nvfp4(x) or isinstance(x, masked)  # noqa: E731

  def leaf_for(param_sharding, x):
    if isinstance(x, masked):
      return x
    if is_nvfp4(x):
      return NVFP4Tensor(codes=_fit(param_sharding, x.codes.shape),
                         scales=_fit(param_sharding, x.scales.shape), global_scale=replicated,
                         shape=x.shape, block=x.block, axis=x.axis, dtype=x.dtype)
    spec = getattr(param_sharding, "spec", ())
    shape = tuple(getattr(x, "shape", ()))
    return _fit(param_sharding, shape) if len(shape) >= max(len(spec), 1) else replicated

  def walk(node):
    leaves, sdef = jax.tree.flatten(node, is_leaf=is_leaf)
    if sdef == p_def:
      return jax.tree.unflatten(sdef, [leaf_for(s, x) for s, x in zip(shardings, leaves)])
    if isinstance(node, masked) or not leaves:
      return node
    children, tdef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    if jax.tree_util.treedef_is_leaf(tdef):
      return None if node is None else replicated
    return jax.tree_util.tree_unflatten(tdef, [walk(c) for c in children])

  return walk(state)


def _fit(sharding, shape):
  """``sharding`` for an array of ``shape``: mesh axes that do not divide their dimension dropped."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  dims, dropped = [], False
  for dim, axes in zip(shape, sharding.spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    fits = dim % math.prod(sharding.mesh.shape[a] for a in names) == 0
    dims.append(axes if fits else None)
    dropped |= not fits
  return NamedSharding(sharding.mesh, PartitionSpec(*dims)) if dropped else sharding
