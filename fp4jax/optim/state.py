"""The optimizer states' storage rule, bytes and shardings, for every transformation of ``fp4jax.optim``.

Storage rule (the same for every optimizer state in this package): a state leaf is stored as an
``NVFP4Tensor`` with 1×16 blocks iff it has at least ``min_size`` elements (default
``DEFAULT_MIN_SIZE`` = 4096, bitsandbytes' ``min_8bit_size``) and an axis whose size is a multiple of
16; the blocks run along the **last** such axis (``block_axis``: the last axis for nearly every
weight; the first for an untied LM head of shape ``(d, 50257)``). Every other leaf (biases and norm
scales, odd shapes, scalars) stays float32 and follows optax's arithmetic exactly: small leaves are
a negligible share of a model's bytes, and a 16-element block with one global scale is a poor fit
for a 64-element vector.

Leaves can also be kept float32 by name (``AdamNvfp4Options.keep_fp32``: e.g. the embedding and the
LM head, ``("embed", "lm_head")``; ``path_matches``).

- ``block_axis``, ``stores_nvfp4``: the rule; ``path_matches``: the rule's exceptions by name.
- ``CenteredNVFP4Tensor``: Adam's √v stored with its block means removed and rotated, then NVFP4.
- ``state_nbytes``: the bytes an optimizer state holds.
- ``state_sharding``: shardings of a state that follow the parameters' (ZeRO-style).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax.kernels import adam_nvfp4 as _kernel
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor

DEFAULT_MIN_SIZE = 4096


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CenteredNVFP4Tensor(NVFP4Tensor):
  """A non-negative tensor (Adam's √v) stored as NVFP4 after removing each block's mean and rotating.

  Per 16-element block along ``axis``: ``mean`` = the block's mean (summed in element order, times
  1/16, rounded to bfloat16); the codes, scales and global scale are the NVFP4 encoding of
  ``nvfp4.hadamard(x - mean, key(0))`` (the matmul's 16-point random Hadamard transform), whose block
  scales then follow the spread of the block around its mean, not its largest value. ``dequantize``
  inverts both steps and floors each element at ``2^-4`` times its block's mean (never negative, and 0 only
  where the block's mean is). ``elements``, ``block_scales`` and ``scaled_elements`` describe
  the rotated deviations.

  Bits per element: 4 (codes) + 0.5 (E4M3 scales) + 1 (bfloat16 means), and a float32 global scale.

  Attributes:
    mean: bfloat16, one per block, shaped like ``scales``.
  """

  mean: jax.Array

  @property
  def nbytes(self) -> int:
    return super().nbytes + 2 * (self.size // BLOCK)

  def dequantize(self, dtype=None) -> jax.Array:
    """The stored tensor: means added back to the inverse rotation of the decoded deviations."""
    y = jnp.moveaxis(NVFP4Tensor.dequantize(self, jnp.float32), self.axis, -1)
    blocks = y.reshape(*y.shape[:-1], y.shape[-1] // BLOCK, BLOCK)
    mean = jnp.moveaxis(self.mean, self.axis, -1)
    x = _kernel.uncenter(blocks, mean)
    x = jnp.moveaxis(x.reshape(y.shape), -1, self.axis)
    return x.astype(self.dtype if dtype is None else dtype)


def path_matches(path, patterns) -> bool:
  """Whether a leaf's key path (``jax.tree_util`` keys) matches one of ``patterns``: a pattern is one
  key name (``"lm_head"``) or several joined by ``/`` (``"embed/embedding"``) that appear in the path
  one after the other."""
  names = [jax.tree_util.keystr((k,), simple=True) for k in path]
  for pattern in patterns:
    want = pattern.split("/")
    if any(names[i:i + len(want)] == want for i in range(len(names) - len(want) + 1)):
      return True
  return False


def unmatched_patterns(params, patterns) -> list[str]:
  """The ``patterns`` (``path_matches``'s) that match no leaf's key path in ``params``; a leaf that
  ``optax.masked`` left out (``optax.MaskedNode``) counts with its path. A tree without key names
  (one bare leaf, or the placeholder of ``optax.tree_utils.tree_map_params``) has none to match: []."""
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]
  if not any(path for path, _ in leaves):
    return []
  return [p for p in patterns if not any(path_matches(path, (p,)) for path, _ in leaves)]


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
  (and the means of centered ones) plus every other array leaf, counted from shapes (works on
  ``jax.eval_shape`` output).

  Args:
    state: any pytree of arrays, ``jax.ShapeDtypeStruct`` and ``NVFP4Tensor``.

  Returns:
    The total number of bytes.
  """
  total = 0
  for leaf in jax.tree.leaves(state, is_leaf=_is_nvfp4):
    if _is_nvfp4(leaf):
      total += sum(_leaf_nbytes(x) for x in (leaf.codes, leaf.scales, leaf.global_scale))
      if isinstance(leaf, CenteredNVFP4Tensor):
        total += _leaf_nbytes(leaf.mean)
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
      extra = ({"mean": _fit(param_sharding, x.mean.shape)}
               if isinstance(x, CenteredNVFP4Tensor) else {})
      return dataclasses.replace(x, codes=_fit(param_sharding, x.codes.shape),
                                 scales=_fit(param_sharding, x.scales.shape),
                                 global_scale=replicated, **extra)
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
