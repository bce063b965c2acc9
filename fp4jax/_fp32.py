"""Correctly rounded float32 arithmetic from integer operations, which XLA cannot rewrite.

NVFP4 quantization divides twice (``S_enc = 2688 / amax`` and ``escale = 1 / (dscale * S_dec)``),
and the optimizer stores a square root. The GPU's float32 division and square root are not correctly
rounded, and XLA may fold float conversion pairs into no-ops; either changes quantized codes at
rounding ties (docs/DESIGN.md, "Bit-exactness on the GPU"). Here everything is computed on the
integer bit pattern, which every backend computes identically. Public through ``fp4jax.numerics``.
"""

import jax.numpy as jnp
from jax import lax

F32_MAX = float(jnp.finfo(jnp.float32).max)
_EXP_MASK = 0xFF
_MANT_BITS = 23
_IMPLICIT = 1 << _MANT_BITS
_INF_BITS = 0x7F800000


def _bits(x):
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _from_bits(b):
  return lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def _unpack(x):
  """Positive finite f32 -> (mantissa in [2^23, 2^24) as int32, unbiased-ish exponent), subnormals normalized."""
  b = _bits(x)
  e = (b >> _MANT_BITS) & _EXP_MASK
  f = b & (_IMPLICIT - 1)
  # Subnormal: shift the fraction up until bit 23 is set; the exponent drops by the same amount.
  lz = jnp.where(e == 0, lax.clz(jnp.maximum(f, 1)) - 8, 0)
  m = jnp.where(e == 0, f << lz, f | _IMPLICIT)
  e = jnp.where(e == 0, 1 - lz, e)
  return m, e


def div_rn(a, b):
  """IEEE round-to-nearest-even ``a / b`` for float32 ``a >= 0`` finite and ``b >= 0`` (exact on any backend).

  ``b == 0`` gives ``inf`` for ``a > 0`` and NaN for ``a == 0``; inputs must not be NaN or inf
  (callers guard those).
  """
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  ma, ea = _unpack(a)
  mb, eb = _unpack(b)
  # Bring the mantissa ratio into [1, 2).
  small = ma < mb
  ma = jnp.where(small, ma << 1, ma)
  ea = jnp.where(small, ea - 1, ea)
  # Long division in radix 2^7: q = floor(ma * 2^25 / mb) in [2^25, 2^26) and its remainder r. The
  # first digit is 1 (ma in [mb, 2 mb)); four more give 7 + 7 + 7 + 4 = 25 bits. Each partial
  # remainder is below mb < 2^24, so r << 7 stays within int32. A digit is estimated in float32
  # (relative error below 2^-20 on any backend, so within 1 of the true digit, which is below 2^7)
  # and corrected by the sign of the exact integer remainder: the bits are the integers', whatever
  # the backend's float division. (b == 0 divides by 2^23 and a == 0 divides mb by itself; both
  # results are replaced below.)
  mb = jnp.where(mb == 0, _IMPLICIT, mb)
  ma = jnp.where(ma == 0, mb, ma)
  inv = 1.0 / mb.astype(jnp.float32)
  q = jnp.ones_like(ma)
  r = ma - mb
  for k in (7, 7, 7, 4):
    r = r << k
    d = (r.astype(jnp.float32) * inv).astype(jnp.int32)
    r = r - d * mb
    low, high = r < 0, r >= mb
    d = d - low.astype(jnp.int32) + high.astype(jnp.int32)
    r = r + jnp.where(low, mb, 0) - jnp.where(high, mb, 0)
    q = (q << k) | d
  sticky = r != 0
  e = ea - eb + 127  # biased exponent of the result, whose mantissa is q / 2^25 in [1, 2)
  # Drop 2 bits for a normal result, more where the result is subnormal (e < 1).
  drop = jnp.clip(2 + jnp.maximum(1 - e, 0), 2, 28)
  kept = q >> drop
  rem = q & ((1 << drop) - 1)
  half = 1 << (drop - 1)
  up = (rem > half) | ((rem == half) & (sticky | ((kept & 1) == 1)))
  kept = kept + up.astype(jnp.int32)
  # Normal: the implicit bit in `kept` adds one to the exponent field, and a carry to 2^24 adds another.
  bits = jnp.where(e >= 1, ((e - 1) << _MANT_BITS) + kept, kept)
  bits = jnp.where(e >= 255, _INF_BITS, jnp.minimum(bits, _INF_BITS))
  # Zero tests on the bit pattern: XLA's CPU backend treats subnormals as zero in comparisons.
  a_zero = _bits(a) == 0
  b_zero = _bits(b) == 0
  bits = jnp.where(a_zero, 0, bits)
  bits = jnp.where(b_zero, jnp.where(a_zero, 0x7FC00000, _INF_BITS), bits)
  return _from_bits(bits)


def div_rn_normal(a, b):
  """``div_rn(a, b)`` where ``a``, ``b`` and the quotient are normal float32, zero or an overflow to inf.

  On the CPU this is the hardware's IEEE division, which XLA:CPU compiles in a small fraction of the
  time of ``div_rn``'s integer arithmetic; on every other backend it is ``div_rn``. Both round
  correctly, so the bits agree except where a subnormal is involved: XLA:CPU reads subnormal operands
  as zero and flushes a subnormal quotient to zero, where ``div_rn`` keeps them. ``0 / 0`` is a NaN
  (its payload may differ). The divisor passes through its bit pattern plus an integer zero taken
  from ``a``'s (``a >= 0``) that the compiler cannot prove zero, so XLA cannot replace a division by
  a constant with a product by the constant's rounded reciprocal (not the same quotient).
  """
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)

  def hardware(a, b):
    return a / _from_bits(_bits(b) + jnp.minimum(_bits(a), 0))

  return lax.platform_dependent(a, b, cpu=hardware, default=div_rn)


def flush_subnormals(x):
  """Float32 subnormals -> +0.0, decided on the bit pattern so every backend agrees."""
  x = jnp.asarray(x, jnp.float32)
  b = _bits(x)
  return jnp.where((b & _INF_BITS) == 0, 0.0, x)


def _square_base24(q):
  """``q * q`` for 0 <= q < 2^26 as an exact (hi, lo) pair: ``hi * 2^24 + lo``, ``lo < 2^24``."""
  qa, qb = q >> 12, q & 0xFFF
  cross = 2 * qa * qb
  lo = ((cross & 0xFFF) << 12) + qb * qb
  return qa * qa + (cross >> 12) + (lo >> 24), lo & 0xFFFFFF


def sqrt_rn(x):
  """IEEE round-to-nearest-even ``sqrt(x)`` for float32 ``x`` (exact on any backend).

  The backend's ``sqrt`` gives a candidate mantissa R (the GPU's is not correctly rounded); two
  rounds of an exact integer test move R to the root's correct rounding: R is it iff
  ``(2R - 1)^2 <= 4 MX < (2R + 1)^2``, with ``MX`` the radicand's mantissa scaled so that
  ``sqrt(MX)`` has 24 bits (no ties: the left sides are odd, ``4 MX`` even). The squares are exact in
  two 24-bit limbs of int32. ``x < 0`` or NaN gives NaN, ``+inf`` gives ``+inf``; subnormal inputs
  are exact too.
  """
  return _sqrt_corrected(x, jnp.sqrt)


def _sqrt_corrected(x, approx_sqrt):
  """``sqrt_rn`` from any ``approx_sqrt`` within 2 ulp on [1, 4) (the tests pass perturbed ones)."""
  x = jnp.asarray(x, jnp.float32)
  mag = _bits(x) & 0x7FFFFFFF  # |x| and the zero test on the bits (XLA-CPU flushes subnormals)
  m, e = _unpack(_from_bits(mag))
  exp2 = e - 127 - _MANT_BITS  # x = m * 2^exp2, m in [2^23, 2^24)
  odd = (exp2 & 1) == 1
  # x = MX * 2^(exp2 - s) with MX = m * 2^s, s = 23 (odd) or 24 (even): sqrt(MX) in [2^23, 2^24).
  s = jnp.where(odd, 23, 24)
  z = _from_bits((jnp.where(odd, 127, 128) << _MANT_BITS) | (m & (_IMPLICIT - 1)))  # MX / 2^46
  zb = _bits(approx_sqrt(z))  # in [1, 2]: R = sqrt(z) * 2^23
  # R from sqrt(z), clamped to [2^23, 2^24] where an inexact sqrt left [1, 2] (sqrt(1) just below 1).
  r = jnp.where(zb >= 0x40000000, 1 << 24,
                jnp.where(zb < 0x3F800000, _IMPLICIT, (zb & (_IMPLICIT - 1)) | _IMPLICIT))
  four_mx = m << (s - 22)  # 4 MX = four_mx * 2^24 (low limb 0)
  for _ in range(2):
    hi, lo = _square_base24(2 * r + 1)
    up = four_mx > hi  # 4 MX >= (2R + 1)^2; the low limbs: 0 >= lo only if lo == 0
    up = up | ((four_mx == hi) & (lo == 0))
    # (2R - 1)^2 = (2R + 1)^2 - 8R
    eight_r = 8 * r
    lo2 = lo - (eight_r & 0xFFFFFF)
    hi2 = hi - (eight_r >> 24) - (lo2 < 0).astype(jnp.int32)
    lo2 = lo2 & 0xFFFFFF
    down = (four_mx < hi2) | ((four_mx == hi2) & (lo2 > 0))
    r = r + up.astype(jnp.int32) - down.astype(jnp.int32)
  half_exp = (exp2 - s) >> 1  # sqrt(x) = R * 2^half_exp
  bits = ((half_exp + _MANT_BITS + 127 - 1) << _MANT_BITS) + r  # R = 2^24 carries into the exponent
  negative = _bits(x) < 0
  out = jnp.where(mag == 0, x, _from_bits(bits))  # sqrt(±0) = ±0
  out = jnp.where(mag == _INF_BITS, x, out)
  return jnp.where((mag > _INF_BITS) | (negative & (mag != 0)), jnp.nan, out)
