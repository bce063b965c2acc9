"""The optimizer states' storage rule, bytes and shardings, for every transformation of ``fp4jax.optim``.

Storage rule (the same for every optimizer state in this package): a state leaf is stored as an
``NVFP4Tensor`` with 1×16 blocks iff it has at least ``min_size`` elements (default
``DEFAULT_MIN_SIZE`` = 4096, bitsandbytes' ``min_8bit_size``) and an axis whose size is a multiple of
16; the blocks run along the **last** such axis (``block_axis``: the last axis for nearly every
weight; the first for an untied LM head of shape ``(d, 50257)``). Every other leaf (biases and norm
scales, odd shapes, scalars) stays float32 and follows optax's arithmetic exactly: small leaves are
a negligible share of a model's bytes, and a 16-element block with one global scale is a poor fit
for a 64-element vector.

- ``block_axis``, ``stores_nvfp4``: the rule.
- ``state_nbytes``: the bytes an optimizer state holds.
- ``state_sharding``: shardings of a state that follow the parameters' (ZeRO-style).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax.nvfp4 import BLOCK, NVFP4Tensor

DEFAULT_MIN_SIZE = 4096


def is_state_leaf(x) -> bool:
  """Whether ``x`` stands where one parameter's leaf stands in a state: an NVFP4 moment (an
  ``NVFP4Tensor``, a pytree of codes, scales and a global scale) or ``optax.MaskedNode`` (a leaf a
  mask left out, as in Muon's and ROOT's partitioned states).

  The ``is_leaf`` for tree utilities that pair a state with a params-shaped tree, e.g.
  ``optax.tree_utils.tree_map_params(tx, f, state, specs, is_leaf=is_state_leaf)``: ``f`` gets each
  NVFP4 moment whole, and each ``MaskedNode``, beside the parameter's leaf (return a
  ``MaskedNode`` unchanged to keep the state's structure). For shardings, ``state_sharding`` maps a
  parameter's sharding onto the codes and scales and replicates the global scale.
  """
  return isinstance(x, (NVFP4Tensor, optax.MaskedNode))


def _is_nvfp4(x) -> bool:
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


def state_nbytes(state) -> int:
  """Bytes held by an optimizer state: packed codes, E4M3 scales and global scales of NVFP4 leaves
  plus every other array leaf, counted from shapes (works on ``jax.eval_shape`` output).

  Args:
    state: any pytree of arrays, ``jax.ShapeDtypeStruct`` and ``NVFP4Tensor``.

  Returns:
    The total number of bytes.
  """
  total = 0
  for leaf in jax.tree.leaves(state, is_leaf=_is_nvfp4):
    if _is_nvfp4(leaf):
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
  is_leaf = lambda x: _is_nvfp4(x) or isinstance(x, masked)

  def leaf_for(param_sharding, x):
    if isinstance(x, masked):
      return x
    if _is_nvfp4(x):
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
