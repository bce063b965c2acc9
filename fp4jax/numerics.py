"""Bit-exact numerics shared by the jnp code and the Pallas kernels: codecs, rounded arithmetic, hashes.

Every function takes and returns jnp arrays and uses only operations that every backend computes
identically: integer arithmetic on float32 bit patterns, comparisons and selects, float32 products
and sums whose rounding is pinned. There are no float4/float8 casts (XLA on the GPU may fold a cast
pair away, and Pallas Triton cannot lower an f4 cast), and no backend division or square root (not
correctly rounded on the GPU). The same code therefore runs under XLA on any backend and inside the
Pallas Triton kernels (``fp4jax.kernels``) and gives the same bits (docs/DESIGN.md, "Bit-exactness
on the GPU").

- Correctly rounded float32 arithmetic: ``div_rn``, ``sqrt_rn``, ``flush_subnormals``, ``F32_MAX``.
- Codecs: E4M3 (``round_to_e4m3``, ``e4m3_to_f32``) and E2M1 (``e2m1_rne_code``,
  ``e2m1_stochastic_code``, ``decode_e2m1``); the quantizer's per-block and per-element steps
  (``e4m3_block_scales``, ``e2m1_codes``).
- Products rounded before every addition, so no compiler contracts them into an FMA: ``runtime_zero``,
  ``rounded``, ``rounded_ema``, and Adam's moments and direction built on them (``adam_moments``,
  ``bias_factors``, ``adam_direction``).
- Stochastic-rounding bits from a keyed counter hash of 64-bit element indices: ``counter_bits``
  (``counter_words``, ``counter_hash``, ``lane_bits``: the pieces the kernels use;
  ``counter_hash_wide`` and ``flat_index_words`` for indices past 2^32); ``BIT_SOURCES`` names the
  two sources of rounding bits, ``stochastic_bits`` draws from either.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fp4jax._fp32 import F32_MAX, div_rn, flush_subnormals, sqrt_rn

__all__ = [
    "BIT_SOURCES", "E2M1_MAX", "E4M3_MAX", "F32_MAX", "INV6", "_LANES", "adam_direction",
    "adam_moments", "bias_factors", "counter_bits", "counter_hash", "counter_hash_wide", "counter_words",
    "decode_e2m1", "div_rn", "e2m1_codes", "e2m1_rne_code", "e2m1_stochastic_code", "e4m3_block_scales",
    "e4m3_to_f32", "flat_index_words", "flush_subnormals", "lane_bits", "round_to_e4m3", "rounded",
    "rounded_ema", "runtime_zero", "sqrt_rn", "stochastic_bits",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
INV6 = float(np.float32(1.0) / np.float32(6.0))  # fp32(1/6), a factor of Transformer Engine's order


def _bits(x):
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _from_bits(b):
  return lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


# ----------------------------------------------------------------------------------------------
# E4M3


def round_to_e4m3(v):
  """Rounds float32 ``v`` in [0, 448] to the nearest E4M3 value, ties to even.

  Args:
    v: float32 array, values in [0, 448].

  Returns:
    ``(value, byte)``: the rounded value as float32 and its E4M3 byte as uint8. E4M3 subnormals
    (multiples of 2^-9) are kept.
  """
  v = jnp.asarray(v, jnp.float32)
  b = _bits(v)
  e = ((b >> 23) & 0xFF) - 127
  # Normal E4M3 (v >= 2^-6): keep 3 mantissa bits by rounding the f32 pattern; carries ripple into
  # the exponent, which is what rounding up to the next binade must do.
  lsb = (b >> 20) & 1
  normal = _from_bits(((b + (1 << 19) - 1 + lsb) >> 20) << 20)
  # Subnormal E4M3: multiples of 2^-9; v * 512 is exact, rounded to nearest, ties to even, in
  # integers (Pallas Triton has no round). Only v < 2^-6 takes this branch, so the int32
  # conversion of a larger v is never used.
  t = v * 512.0
  k = jnp.minimum(t, 512.0).astype(jnp.int32)  # floor, t >= 0
  frac = t - k.astype(jnp.float32)  # exact
  sub_k = (k + ((frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))).astype(jnp.int32)).astype(jnp.float32)
  sub = sub_k * (1.0 / 512.0)
  value = jnp.where(e >= -6, normal, sub)
  nb = _bits(value)
  normal_code = ((((nb >> 23) & 0xFF) - 127 + 7) << 3) | ((nb >> 20) & 7)
  # A subnormal that rounded up to 2^-6 is the smallest normal, code 8: (k = 8) gives that too.
  code = jnp.where(value >= 2.0**-6, normal_code, sub_k.astype(jnp.int32))
  return value, code.astype(jnp.uint8)


def e4m3_to_f32(code):
  """Decodes E4M3 bytes (uint8, no NaN) to float32 with integer operations."""
  c = code.astype(jnp.int32)
  e = (c >> 3) & 0xF
  m = c & 7
  normal = _from_bits(((e - 7 + 127) << 23) | (m << 20))
  sub = m.astype(jnp.float32) * (1.0 / 512.0)
  mag = jnp.where(e == 0, sub, normal)
  return jnp.where((c & 0x80) != 0, -mag, mag)


def e4m3_block_scales(block_amax, m):
  """The E4M3 block scales of NVFP4: ``e4m3_rne(clip(min(block_amax * m, FLT_MAX), 0, 448))``.

  Args:
    block_amax: float32 per-block ``max|x|`` (>= 0).
    m: ``S_enc * fp32(1/6)``, the tensor's encode scale times ``INV6``.

  Returns:
    ``(value, byte)`` as ``round_to_e4m3``.
  """
  return round_to_e4m3(jnp.clip(jnp.minimum(block_amax * m, F32_MAX), 0.0, E4M3_MAX))


# ----------------------------------------------------------------------------------------------
# E2M1


def e2m1_rne_code(a):
  """Magnitude ``a`` in [0, 6] -> E2M1 code 0..7 (int32), to nearest, ties to the even code."""
  return ((a > 0.25).astype(jnp.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
          + (a >= 3.5) + (a > 5.0))


def e2m1_stochastic_code(a, bits):
  """Magnitude ``a`` in [0, 6] -> E2M1 code (int32), rounded up with probability ``(a - lo) / (hi - lo)``.

  On float32 bit patterns: each step of the E2M1 grid in [1, 6] lies inside one binade and spans
  2^22 patterns (1 → 1.5 → 2 → 3 → 4 → 6), so adding 22 random bits ``r`` to the pattern and keeping
  its top bits rounds up exactly when ``r >= 2^22 - frac`` (``frac``: the pattern mod 2^22), with
  probability ``frac / 2^22``. Below 1 the grid (0, 0.5, 1) has the shape of [1, 2) shifted down by
  1, so there the pattern is that of ``a + 1`` (float32, rounded to 2^-23).

  Args:
    a: float32 magnitudes in [0, 6].
    bits: uint32 random bits shaped like ``a``; the top 22 are used.

  Returns:
    int32 codes 0..7.
  """
  small = a < 1.0
  x = lax.bitcast_convert_type(jnp.where(small, a + 1.0, a), jnp.int32)
  # The code of 1.0 is 2, its pattern's top bits 254: of 1 + 0 (below 1), 0.
  top = (x + (bits >> 10).astype(jnp.int32)) >> 22
  return top - jnp.where(small, 254, 252)


def decode_e2m1(code):
  """E2M1 codes (sign in bit 3) -> float32, built as bit patterns with integer operations only.

  A normal magnitude code k in 2..7 is the float32 pattern ``(k << 22) + bits(0.5)`` (E2M1's exponent
  and mantissa bits shifted into float32's, bias 1 -> 127); k = 1 is 0.5, k = 0 is 0.
  """
  c = code.astype(jnp.int32)
  k = c & 7
  mag = jnp.where(k >= 2, (k << 22) + 0x3F000000, k * 0x3F000000)
  return lax.bitcast_convert_type(mag | ((c & 8) << 28), jnp.float32)


def e2m1_codes(x32, escale, zero_block, rounding: str, bits=None, dtype=jnp.uint8):
  """E2M1 codes of ``x32 * escale``: the per-element step of NVFP4 quantization.

  ``code = sign(x) | e2m1(min(|x * escale|, 6))``, the sign bit (bit 3) set for strictly negative
  ``x``, and 0 where ``zero_block``.

  Args:
    x32: float32 values.
    escale: the block's encode scale ``1 / (dscale * S_dec)``, broadcast against ``x32``.
    zero_block: bool, broadcast against ``x32``: blocks stored as zero (scale 0, or non-finite input).
    rounding: ``"nearest"`` or ``"stochastic"``.
    bits: uint32 random bits shaped like ``x32``, for stochastic rounding.
    dtype: of the codes (the kernels take int32: no byte arithmetic).

  Returns:
    Codes 0..15 as ``dtype``, one per element.
  """
  # |clip(x * escale, -6, 6)|, and the sign of x (escale > 0): one min instead of a clip.
  a = jnp.minimum(jnp.abs(x32 * escale), E2M1_MAX)
  mag = e2m1_rne_code(a) if rounding == "nearest" else e2m1_stochastic_code(a, bits)
  code = mag.astype(jnp.int32) | jnp.where(x32 < 0, 8, 0)
  return jnp.where(zero_block, 0, code).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Rounded arithmetic


def runtime_zero(count) -> jax.Array:
  """An int32 zero the compiler cannot prove is zero: ``min(count, 0)`` of a step count >= 0."""
  return jnp.minimum(jnp.asarray(count, jnp.int32), 0)


def rounded(x, zero) -> jax.Array:
  """``x``, rounded to float32 before any later addition (no fused multiply-add across it).

  XLA's GPU backend contracts ``a * b + c`` into one FMA (one rounding) where the CPU rounds the
  product first. Adding a runtime zero (``runtime_zero``) to the product's bit pattern makes it an
  opaque float32 on every backend: one integer add, fused, no memory traffic.
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) + zero
  return lax.bitcast_convert_type(bits, jnp.float32)


@jax.custom_jvp
def bf16_rn(x) -> jax.Array:
  """float32 ``x`` rounded to the nearest bfloat16 value (ties to even), returned as float32.

  The same value as ``x.astype(bfloat16).astype(float32)``, computed on the bit pattern: under
  ``jax.jit`` on the GPU, XLA folds that pair of casts to ``x`` (it allows excess precision), so a
  value meant to be rounded to bfloat16 before later arithmetic would not be there, and the CPU's
  bits would differ. Finite inputs round as the cast does (overflow to infinity); NaN stays NaN.
  Integer adds and masks only, so the kernels call it too; differentiated as the identity (as the casts).
  """
  x = jnp.asarray(x, jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.int32)
  bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & jnp.int32(-65536)  # -65536: 0xFFFF0000
  return jnp.where(x != x, x, lax.bitcast_convert_type(bits, jnp.float32))


# Differentiated as the casts are: the identity.
bf16_rn.defjvp(lambda primals, tangents: (bf16_rn(*primals), jnp.asarray(tangents[0], jnp.float32)))


def _rounded_mul(zero):
  return lambda a, b: rounded(a * b, zero)


def rounded_ema(old, new, decay: float, zero, mul=None) -> jax.Array:
  """``decay * old + (1 - decay) * new`` in float32, each product rounded on its own.

  ``old`` (often a dequantized product ``q * scale``) is rounded first too, so no backend can
  contract or reassociate across it.

  Args:
    old: the previous average (float32).
    new: the new value (any float dtype; taken as float32).
    decay: the EMA's decay.
    zero: ``runtime_zero`` of the step count.
    mul: ``mul(a, b)``, a float32 product that no compiler fuses into an addition, in place of
      ``rounded(a * b)`` (the kernels pass PTX's ``mul.rn.f32``: the same values).

  Returns:
    The new average, float32.
  """
  if mul is None:
    mul, old = _rounded_mul(zero), rounded(old, zero)
  return mul(1.0 - decay, new.astype(jnp.float32)) + mul(decay, old)


def adam_moments(m_old, v_old, g32, b1: float, b2: float, zero, mul=None):
  """Adam's moments ``m = b1 m_old + (1 - b1) g`` and ``v = b2 v_old + (1 - b2) g²`` by ``rounded_ema``.

  Returns:
    ``(m, v)``, float32, with the same bits on every backend.
  """
  m = rounded_ema(m_old, g32, b1, zero, mul)
  v = rounded_ema(v_old, (mul or _rounded_mul(zero))(g32, g32), b2, zero, mul)
  return m, v


@functools.partial(jax.jit, inline=True)
def _bias_denominator(decay, count):
  return 1 - decay**count  # as optax.tree.bias_correction computes it before dividing by it


def bias_factors(b1: float, b2: float, eps_root: float, count):
  """The scalars of ``adam_direction`` at step ``count`` (>= 1), with optax's bias corrections.

  Returns:
    float32 ``(1 / bc1, 1 / bc1 at count + 1, 1 / sqrt(bc2), eps_root * bc2)``, ``bc = 1 - decay^count``.
  """
  bc1, bc1_next, bc2 = (_bias_denominator(b1, count),
                        _bias_denominator(b1, optax.safe_increment(count)),
                        _bias_denominator(b2, count))
  return tuple(jnp.asarray(x, jnp.float32)
               for x in (1 / bc1, 1 / bc1_next, 1 / jnp.sqrt(bc2), eps_root * bc2))


def adam_direction(m, v, s, g32, factors, b1: float, eps: float, eps_root: float, nesterov: bool,
                   bound=None):
  """Adam's update ``m_hat / (sqrt(v_hat + eps_root) + eps)`` from the new moments, clipped to ``±bound``.

  Computed as ``m * (1 / bc1) / (sqrt(v + eps_root * bc2) * (1 / sqrt(bc2)) + eps)``; with
  ``eps_root = 0`` the root is ``s = sqrt(v)``, which the NVFP4 optimizer stores anyway (one product
  per element instead of two divisions and a square root).

  Args:
    m, v: the new moments (float32).
    s: ``sqrt_rn(v)``.
    g32: the gradient (float32), for Nesterov's blend (as ``optax.scale_by_adam(nesterov=True)``).
    factors: ``bias_factors`` of the step.
    b1, eps, eps_root, nesterov: Adam's.
    bound: the clip, or None.

  Returns:
    The update direction, float32.
  """
  c1, c1_next, c2, eps_root_bc2 = factors
  if nesterov:
    m_hat = b1 * (m * c1_next) + (1 - b1) * (g32 * c1)
  else:
    m_hat = m * c1
  root = s if eps_root == 0 else jnp.sqrt(v + eps_root_bc2)
  u = m_hat / (root * c2 + eps)
  return u if bound is None else jnp.clip(u, -bound, bound)


# ----------------------------------------------------------------------------------------------
# Stochastic-rounding bits

_LANES = 2  # tensors one key's hash serves (Adam's m and √v)


def hadamard16_butterfly(v: list) -> list:
  """The Walsh–Hadamard butterfly ``H16 · v`` over a list of 16 equally shaped arrays: strides 1, 2,
  4, 8, each pair's sum before its difference (Sylvester's order). The fixed order of the additions
  is what makes ``fp4jax.nvfp4.hadamard`` the same bits on every backend and in the kernels."""
  v = list(v)
  if len(v) != 16:
    raise ValueError(f"hadamard16_butterfly takes 16 arrays, got {len(v)}")
  for stride in (1, 2, 4, 8):
    for i in range(16):
      if not i & stride:
        a, b = v[i], v[i + stride]
        v[i], v[i + stride] = a + b, a - b
  return v


def hadamard16_last_axis(x):
  """``hadamard16_butterfly`` on the last axis (16 elements) of one array: the same additions in the
  same order, one stage at a time (at stride s, element i with bit s clear becomes ``v[i] + v[i + s]``,
  element ``i + s`` becomes ``v[i] - v[i + s]``). The XLA paths use this form: on a list of 16 slices
  XLA copies each output's addition tree into a fusion of its own."""
  if x.shape[-1] != 16:
    raise ValueError(f"hadamard16_last_axis takes a last axis of 16, got shape {x.shape}")
  for stride in (1, 2, 4, 8):
    pairs = x.reshape(*x.shape[:-1], 16 // (2 * stride), 2, stride)
    a, b = pairs[..., 0, :], pairs[..., 1, :]
    x = jnp.stack([a + b, a - b], axis=-2).reshape(x.shape)
  return x


def _mix32(x):
  """A bijective 32-bit integer finalizer (Wellons' "lowbias32": xorshift-multiply)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def counter_words(key):
  """The two uint32 words that key ``counter_hash``, mixed from the ends of ``key``'s data."""
  words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  return _mix32(words[0] ^ jnp.uint32(0x9E3779B9)), _mix32(words[-1] ^ jnp.uint32(0x85EBCA6B))


def counter_hash(idx, k1, k2):
  """The keyed hash of uint32 pair indices ``idx``: two rounds of ``_mix32`` keyed by ``counter_words``."""
  return _mix32(_mix32(idx ^ k1) + k2)


def counter_hash_wide(hi, lo, k1, k2):
  """``counter_hash`` of 64-bit pair indices ``hi * 2^32 + lo`` (uint32 words).

  The high word is folded into the second key word, ``k2 ^ _mix32(hi)``: ``_mix32`` is a bijection
  with ``_mix32(0) = 0``, so at ``hi = 0`` this is ``counter_hash(lo, k1, k2)`` (the indices of
  every tensor of fewer than 2^33 elements), and each high word keys its own stream of 2^32 pairs.
  """
  return counter_hash(lo, k1, k2 ^ _mix32(hi))


def lane_bits(h, byte):
  """Byte ``byte`` (0..3, array or int) of hashes ``h`` as uint32 rounding bits for ``e2m1_stochastic_code``.

  The byte ``b`` goes to the top of the word with a half step below it, ``b << 24 | 1 << 23``: the
  quantizer adds the top 22 bits, ``(b + 0.5) * 2^14``, to a value's pattern, so a value is rounded
  up when ``(b + 0.5) / 256 >= 1 - p``: with probability ``p`` rounded to a multiple of 1/256 (off
  by at most 1/512 either way), where a bare ``b << 24`` would round every probability down.
  """
  shift = jnp.uint32(24) - jnp.uint32(8) * jnp.asarray(byte, jnp.uint32)
  return ((h << shift) & jnp.uint32(0xFF000000)) | jnp.uint32(1 << 23)


_INDEX_ROW = 2**16  # the row of the (rows, 2^16) iota that numbers a tensor of 2^32 elements or more


def flat_index_words(size: int, offset: int = 0, row: int | None = None):
  """The 64-bit flat indices ``offset + [0, size)`` as two uint32 arrays ``(hi, lo)`` of shape (size,).

  Built from a (rows, ``row``) iota, ``row`` a power of two: element ``(r, c)`` is ``r * row + c``,
  whose words are shifts of ``r`` and ``c``, then the offset is added with its carry. No uint64 (off by
  default in JAX) and no iota longer than 2^32.

  Args:
    size: the number of indices (>= 0).
    offset: the first index (>= 0; ``offset + size <= 2^64``).
    row: the iota's row length (a power of two, at most 2^16); None: ``size`` rounded up to a power
      of two, at most 2^16.

  Returns:
    ``(hi, lo)``, uint32 arrays of shape (size,).
  """
  if row is None:
    row = min(_INDEX_ROW, 1 << max(0, size - 1).bit_length())
  if row <= 0 or row & (row - 1) or row > _INDEX_ROW:
    raise ValueError(f"flat_index_words: row must be a power of two <= 2^16, got {row!r}")
  rows = -(-size // row)
  if rows > 2**32:
    raise ValueError(f"flat_index_words: {size} indices in rows of {row} are more than 2^32 rows")
  u32 = jnp.uint32
  s = row.bit_length() - 1
  r = lax.broadcasted_iota(u32, (rows, row), 0)
  c = lax.broadcasted_iota(u32, (rows, row), 1)
  hi, lo = (r >> u32(32 - s), c | (r << u32(s))) if s else (jnp.zeros_like(r), r)
  off_hi, off_lo = u32(offset >> 32), u32(offset & 0xFFFFFFFF)
  total = lo + off_lo
  hi = hi + off_hi + (total < lo).astype(u32)
  return hi.reshape(-1)[:size], total.reshape(-1)[:size]


def counter_bits(key, shape, lane: int = 0, offset: int = 0) -> jax.Array:
  """uint32 stochastic-rounding bits: 8 random bits per element from a keyed hash of element pairs.

  One 32-bit hash of each pair of neighbouring elements (flat indices ``2i`` and ``2i + 1``) gives
  the bits of two tensors of that shape, ``lane`` 0 and 1: element ``2i + h`` of lane ``j`` takes
  byte ``2j + h`` (``lane_bits``). Eight bits per rounding, as Blackwell's ``cvt.rs`` takes one
  32-bit random operand per four FP4 values: a probability is rounded to a multiple of 1/256, far
  below the format's own step. The hash is integer arithmetic on the global index, so the same key
  gives the same bits on every backend and sharding; distinct keys (``fold_in``) give unrelated
  streams. Indices are 64-bit: pairs past 2^32 fold their high word into the key
  (``counter_hash_wide``), which leaves the bits of pairs below 2^32 as they are.

  Args:
    key: a ``jax.random`` key.
    shape: the tensor's shape.
    lane: 0 or 1.
    offset: the flat index of the tensor's first element in a larger tensor (>= 0): the bits are
      those of elements ``offset + [0, size)`` of it.

  Returns:
    uint32 bits of ``shape``, for ``nvfp4.quantize(bits=...)``.

  Raises:
    ValueError: a lane other than 0 or 1, or an offset that is not an int in [0, 2^64 - size].
  """
  if lane not in range(_LANES):
    raise ValueError(f"counter_bits: lane must be 0 or 1, got {lane!r}")
  size = math.prod(shape)
  if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset <= 2**64 - size:
    raise ValueError(f"counter_bits: offset must be an int in [0, 2^64 - {size}], got {offset!r}")
  k1, k2 = counter_words(key)
  offset = int(offset)
  if offset + size < 2**32:  # 32-bit indices: the high word is 0
    idx = jnp.arange(size, dtype=jnp.uint32).reshape(shape)
    if offset:
      idx = idx + jnp.uint32(offset)
    return lane_bits(counter_hash(idx >> 1, k1, k2), 2 * lane + (idx & 1))
  hi, lo = flat_index_words(size, offset)
  pair_hi, pair_lo = hi >> 1, (lo >> 1) | (hi << 31)
  h = counter_hash_wide(pair_hi, pair_lo, k1, k2)
  return lane_bits(h, 2 * lane + (lo & 1)).reshape(shape)


BIT_SOURCES = ("random", "counter")  # the sources of stochastic-rounding bits (``stochastic_bits``)


def stochastic_bits(key, shape, bit_source="random") -> jax.Array:
  """The uint32 stochastic-rounding bits of a tensor of ``shape`` drawn from ``key``.

  Args:
    key: a ``jax.random`` key.
    shape: the tensor's shape.
    bit_source: ``"random"``: ``jax.random.bits(key, shape, uint32)`` (what ``nvfp4.quantize(key=key)``
      draws); ``"counter"``: ``counter_bits(key, shape)``.

  Returns:
    uint32 bits of ``shape``, for ``nvfp4.quantize(bits=...)``.
  """
  if bit_source == "random":
    return jax.random.bits(key, shape, jnp.uint32)
  if bit_source == "counter":
    return counter_bits(key, shape)
  raise ValueError(f"bit_source must be one of {BIT_SOURCES}, got {bit_source!r}")
