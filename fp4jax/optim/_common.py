"""Shared pieces of the NVFP4 optimizers: which leaves are stored in NVFP4, state codecs, keys, bytes.

Storage rule (the same for every optimizer state in this package): a state leaf is stored as an
``NVFP4Tensor`` with 1×16 blocks iff it has at least ``min_size`` elements (default 4096,
bitsandbytes' ``min_8bit_size``) and an axis whose size is a multiple of 16; the blocks run along the
**last** such axis (the last axis for nearly every weight; the first for an untied LM head of shape
``(d, 50257)``). Every other leaf (biases and norm scales, odd shapes, scalars) stays float32 and
follows optax's arithmetic exactly. Small leaves are a negligible share of the bytes of any real
model, and a 16-element block with one global scale is a poor fit for a 64-element vector.

Leaves of the same shape are updated together under ``jax.vmap`` (one quantizer program per
shape, not per leaf): a 12-layer Transformer compiles 6 programs instead of 72, and the GPU
launches that many fewer kernels. Each leaf keeps its own global scale and random bits. AdamW does
this by default except on the CPU, where it only costs compile time (``group_by_default``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax import _fp32, nvfp4
from fp4jax._platform import default_platform
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor

DEFAULT_MIN_SIZE = 4096
ROUNDINGS = ("nearest", "stochastic")
_F32 = jnp.dtype(jnp.float32)
# A block whose E4M3 scale rounds to zero had block_amax * S_enc / 6 <= 2^-10 (half the smallest
# subnormal E4M3, tie to even): its values are at most this many S_dec.
_ZERO_BLOCK_BOUND = 6.0 * 2.0**-10


def is_nvfp4(x) -> bool:
  return isinstance(x, NVFP4Tensor)


def block_axis(shape) -> int | None:
  """The blocked axis of the storage rule: the last axis whose size is a multiple of 16, or None."""
  for ax in range(len(shape) - 1, -1, -1):
    if shape[ax] % BLOCK == 0 and shape[ax] > 0:
      return ax
  return None


def stores_nvfp4(shape, min_size: int) -> bool:
  """The storage rule of the module docstring: is a state leaf of ``shape`` stored as NVFP4?"""
  shape = tuple(shape)
  return block_axis(shape) is not None and math.prod(shape) >= min_size


def check_common(min_size, rounding):
  if not isinstance(min_size, int) or min_size < 0:
    raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


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


def encode(x, rounding: str, key, lane: int = 0, amax=None) -> NVFP4Tensor:
  """float32 ``x`` -> NVFP4, 1×16 blocks along ``block_axis(x.shape)``; stochastic rounding takes its
  bits from ``counter_bits(key, x.shape, lane)``; ``amax``: ``nvfp4.quantize``'s (None: max|x|)."""
  bits = counter_bits(key, x.shape, lane) if rounding == "stochastic" else None
  return nvfp4.quantize(x.astype(jnp.float32), block=(1, BLOCK), axis=block_axis(x.shape),
                        rounding=rounding, bits=bits, amax=amax)


AMAX_RULES = ("bound", "exact")


def max_abs(x) -> jax.Array:
  """``max|x|`` (float32 scalar) as the integer max of the magnitudes' bit patterns: the same value
  on every backend (subnormals kept, NaN above inf); 0 for an empty ``x``."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32) & 0x7FFFFFFF
  return jax.lax.bitcast_convert_type(jnp.max(bits, initial=0), jnp.float32)


def largest_stored(t: NVFP4Tensor, floor: float = 0.0) -> jax.Array:
  """No value of ``t`` is larger in magnitude (``floor``: a least block scale, for readers that lift
  zeros); ``largest_from_scale`` of its largest scale byte (E4M3 bytes of non-negative values are
  ordered as their values)."""
  top = jnp.max(jax.lax.bitcast_convert_type(t.scales, jnp.uint8), initial=0)
  return largest_from_scale(top, t.global_scale, floor)


def largest_from_scale(scale_byte, global_scale, floor: float = 0.0) -> jax.Array:
  """``(6 * max(dscale, floor)) * S_dec`` for an E4M3 scale byte: an E2M1 code is at most 6, and
  ``dequantize`` multiplies in this order. The Pallas kernels' ``amax="bound"`` calls it with the
  largest byte their first pass found."""
  d = _fp32.e4m3_to_f32(scale_byte)
  if floor:
    d = jnp.maximum(d, floor)
  return (6.0 * d) * global_scale


def amax_bounds(g_max, m_max, v_max, b1: float, b2: float, zero):
  """Upper bounds of the new moments' amaxes, ``max|m|`` and ``max v``, from ``max|g|`` and bounds of
  the old moments' magnitudes: ``adam_moments`` itself applied to them. Rounding to nearest is
  monotone, so the EMA of the largest inputs, computed with the same operations in the same order,
  is never below the EMA of any element."""
  return adam_moments(m_max, v_max, g_max, b1, b2, zero)


def _mix32(x):
  """A bijective 32-bit integer finalizer (Wellons' "lowbias32": xorshift-multiply, bias ~1.7e-4)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


LANES = 2  # tensors that one key's hash serves (Adam's m and sqrt(v))


def counter_bits(key, shape, lane: int = 0) -> jax.Array:
  """uint32 stochastic-rounding bits: 8 random bits per element from a keyed hash of element pairs.

  One 32-bit hash of each pair of neighbouring elements (flat indices ``2i`` and ``2i + 1``) gives
  the bits of two tensors of that shape, ``lane`` 0 and 1 (Adam's m and √v under one key): element
  ``2i + h`` of lane ``j`` takes byte ``2j + h`` (``lane_bits``). Four roundings per hash, because
  the Pallas AdamW kernel is bound by instruction issue. Eight bits per rounding, as Blackwell's
  ``cvt.rs`` takes one 32-bit random operand per four FP4 values: a probability is rounded to a
  multiple of 1/256 (within 1/512 of exact, see ``lane_bits``), far below the format's own step.

  The hash: two rounds of a bijective mix keyed by the two ends of ``key``'s data (~17 integer
  operations, fused into the quantizer; ``jax.random.bits`` ran as a separate kernel through
  memory). Distinct keys (steps, leaves, via ``fold_in``) give unrelated streams; the same key gives
  the same bits on every backend and sharding (integer arithmetic on the global index).
  """
  if lane not in range(LANES):
    raise ValueError(f"counter_bits: lane must be 0 or 1, got {lane!r}")
  k1, k2 = counter_words(key)
  size = math.prod(shape)
  if size >= 2**32:
    raise ValueError(f"counter_bits: {size} elements, more than 2^32 counters")
  idx = jnp.arange(size, dtype=jnp.uint32).reshape(shape)
  return lane_bits(counter_hash(idx >> 1, k1, k2), 2 * lane + (idx & 1))


def lane_bits(h, byte):
  """Byte ``byte`` (0..3, array or int) of hashes ``h`` as ``nvfp4.quantize``'s uint32 rounding bits.

  The byte ``b`` goes to the top of the word with a half step below it, ``b << 24 | 1 << 23``: the
  quantizer adds the top 22 bits, ``(b + 0.5) * 2^14``, to a value's pattern, so a value is rounded
  up when ``(b + 0.5) / 256 >= 1 - p``: with probability ``p`` rounded to a multiple of 1/256 (off
  by at most 1/512, either way), where a bare ``b << 24`` would round every probability down.
  """
  shift = jnp.uint32(24) - jnp.uint32(8) * jnp.asarray(byte, jnp.uint32)
  return ((h << shift) & jnp.uint32(0xFF000000)) | jnp.uint32(1 << 23)


def counter_words(key):
  """The two uint32 words that key ``counter_bits``' hash, mixed from the ends of ``key``'s data."""
  words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  return _mix32(words[0] ^ jnp.uint32(0x9E3779B9)), _mix32(words[-1] ^ jnp.uint32(0x85EBCA6B))


def counter_hash(idx, k1, k2):
  """The hash of ``counter_bits`` for uint32 pair indices ``idx``, given the key's ``counter_words``."""
  return _mix32(_mix32(idx ^ k1) + k2)


def decode(t: NVFP4Tensor) -> jax.Array:
  return t.dequantize(jnp.float32)


def runtime_zero(count) -> jax.Array:
  """An int32 zero the compiler cannot prove is zero (``min(count, 0)`` of a count >= 0)."""
  return jnp.minimum(jnp.asarray(count, jnp.int32), 0)


def rounded(x, zero) -> jax.Array:
  """``x``, rounded to float32 before any later addition (no fused multiply-add across it).

  XLA's GPU backend contracts ``a * b + c`` into one FMA (one rounding) where the CPU rounds the
  product first; the moments then differ in the last bit, and so, at rounding boundaries, do their
  global scales and codes. Adding a runtime zero to the product's bit pattern makes the product an
  opaque float32 on every backend (one integer add, fused, no extra memory traffic).
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) + zero
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def adam_moments(m_old, v_old, g32, b1: float, b2: float, zero, mul=None):
  """Adam's moment EMAs in float32 from the decoded old moments, every product rounded on its own
  (``rounded_ema``): the same bits on the GPU and the CPU (no FMA contraction or reassociation).
  ``zero``: ``runtime_zero`` of the step count; ``mul``: see ``rounded_ema``."""
  m = rounded_ema(m_old, g32, b1, zero, mul)
  v = rounded_ema(v_old, (mul or _rounded_mul(zero))(g32, g32), b2, zero, mul)
  return m, v


@functools.partial(jax.jit, inline=True)
def bias_denominator(decay, count):
  """``1 - decay ** count``, computed as ``optax.tree.bias_correction`` does before dividing by it."""
  return 1 - decay**count


def bias_factors(b1: float, b2: float, eps_root: float, count):
  """The scalars of ``adam_direction`` at step ``count`` (>= 1), float32: ``1 / bc1``, ``1 / bc1`` at
  ``count + 1``, ``1 / sqrt(bc2)`` and ``eps_root * bc2`` (``bc``: ``bias_denominator``)."""
  bc1, bc1_next, bc2 = (bias_denominator(b1, count),
                        bias_denominator(b1, optax.safe_increment(count)), bias_denominator(b2, count))
  return tuple(jnp.asarray(x, jnp.float32)
               for x in (1 / bc1, 1 / bc1_next, 1 / jnp.sqrt(bc2), eps_root * bc2))


def adam_direction(m, v, s, g32, factors, b1: float, eps: float, eps_root: float, nesterov: bool,
                   bound=None):
  """Adam's update ``m_hat / (sqrt(v_hat + eps_root) + eps)`` from the new moments, with optax's bias
  corrections (``factors``: ``bias_factors``; Nesterov as ``optax.scale_by_adam(nesterov=True)``),
  clipped to ``±bound`` when one is given.

  Computed as ``m * (1 / bc1) / (sqrt(v + eps_root * bc2) * (1 / sqrt(bc2)) + eps)``: with
  ``eps_root = 0`` the root is ``s = sqrt(v)``, which the NVFP4 optimizers compute anyway to store it
  (one product per element instead of two divisions and a square root; float32 rounding away from
  optax's order, which the float32 leaves keep).
  """
  c1, c1_next, c2, eps_root_bc2 = factors
  if nesterov:
    m_hat = b1 * (m * c1_next) + (1 - b1) * (g32 * c1)
  else:
    m_hat = m * c1
  root = s if eps_root == 0 else jnp.sqrt(v + eps_root_bc2)
  u = m_hat / (root * c2 + eps)
  return u if bound is None else jnp.clip(u, -bound, bound)


def rounded_ema(old, new, decay: float, zero, mul=None) -> jax.Array:
  """``decay * old + (1 - decay) * new`` in float32 with every product rounded on its own.

  ``old`` (often a dequantized product ``q * scale``) is rounded first too, so no backend can
  contract or reassociate across it: the moments, and the NVFP4 state made from them, get the same
  bits on the GPU and the CPU. ``mul(a, b)``, when given, computes those products instead: a float32
  multiply that no compiler fuses into the addition (the Pallas kernels pass PTX's ``mul.rn.f32``,
  one instruction where ``rounded`` adds an integer operation per product); the values are the same.
  """
  if mul is None:
    mul, old = _rounded_mul(zero), rounded(old, zero)
  return mul(1.0 - decay, new.astype(jnp.float32)) + mul(decay, old)


def _rounded_mul(zero):
  """The default ``mul`` of ``rounded_ema``: the product, then ``rounded``."""
  return lambda a, b: rounded(a * b, zero)


def zero_floor(t: NVFP4Tensor) -> jax.Array:
  """Per element, the largest value that round-to-nearest stores as code 0 in its block.

  ``0.25 * dscale * S_dec`` in a block with a non-zero scale; ``6 * 2^-10 * S_dec`` (the largest
  block amax whose E4M3 scale rounds to zero) in a zero-scale block. For a non-negative tensor
  quantized with round-to-nearest, ``max(dequantize(t), zero_floor(t))`` is never below the value
  that was stored where the code is 0, and equals ``dequantize(t)`` elsewhere.
  """
  d = t.block_scales()
  unit = jnp.where(d > 0, 0.25 * d, _ZERO_BLOCK_BOUND) * t.global_scale
  return jnp.repeat(unit, BLOCK, axis=t.axis)


def decode_guarded(t: NVFP4Tensor) -> jax.Array:
  """Dequantize a non-negative tensor, lifting codes 0 to their block's rounding threshold."""
  return jnp.maximum(decode(t), zero_floor(t))


def group_by_default() -> bool:
  """Whether same-shape leaves are batched by default: not when the default platform is the CPU.

  Measured on the CPU, one run of ``benchmarks/optim_update.py --small --skip-equality --variants``
  (adamw_nvfp4): grouped 55.1 s to compile, 30.5 ms per update; ungrouped 7.6 s and 29.5 ms; the
  results are bit-identical (tests). XLA:CPU's compile time for a vmapped group is erratic: two (64, 128) leaves took 51 s
  with 8 host devices and 2 s with one, two (128, 512) leaves 1.4 s. Ungrouped leaves compile in
  about a second each. On the GPU, grouping launches fewer kernels.
  """
  return default_platform() != "cpu"


def grouped_map(fn, indices, *leaf_lists, group: bool | None = None):
  """``fn(*args)`` for every index in ``indices``, leaves of one shape batched under ``jax.vmap``.

  Args:
    fn: maps one leaf's arguments (arrays, ``NVFP4Tensor``s, keys or None) to a tuple of outputs.
    indices: the leaf indices to compute.
    *leaf_lists: per argument, a list indexed by leaf index.

    group: False computes each leaf on its own (no stacking copies; more, smaller programs). None
      (default): ``group_by_default()``.

  Returns:
    A dict index -> tuple of outputs.
  """
  if group is None:
    group = group_by_default()
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


def step_key(seed: int, count, impl: str | None = None) -> jax.Array:
  """The random key of one step: ``fold_in(key(seed), count)``; deterministic and checkpoint-free.

  ``impl`` picks the key's generator (``jax.random.key``'s ``impl``): None is JAX's default
  (threefry). The per-element rounding bits are ``counter_bits`` of the key, the same on every
  backend and sharding.
  """
  return jax.random.fold_in(jax.random.key(seed, impl=impl), count)


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
  """Shardings for an optimizer state that follow the parameters' shardings.

  Every subtree of ``state`` with the structure of the parameters (optax moments, ``MaskedNode``s
  allowed) is matched leaf by leaf with ``params_sharding``: an array of the parameter's shape gets
  the parameter's sharding; an ``NVFP4Tensor`` gets it for its packed codes and its E4M3 scales
  (both keep the parameter's axes, the last one divided by 2 and 16, so a shard holds its own codes
  and scales), and a replicated global scale. Everything else (counts, scalars) is replicated.

  Args:
    state: the optimizer state, or its ``jax.eval_shape``.
    params_sharding: a pytree like the parameters, of ``NamedSharding``s.
    replicated: sharding for the other leaves; default: replicated on the mesh of the first
      parameter sharding.

  Returns:
    A pytree of shardings with the structure of ``state`` (usable as ``out_shardings``).
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
      return NVFP4Tensor(codes=param_sharding, scales=param_sharding, global_scale=replicated,
                         shape=x.shape, block=x.block, axis=x.axis, dtype=x.dtype)
    spec = getattr(param_sharding, "spec", ())
    return param_sharding if len(getattr(x, "shape", ())) >= max(len(spec), 1) else replicated

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

