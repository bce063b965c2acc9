"""Pieces shared by the Pallas kernels: constants, bit views, correctly rounded float32 operations,
the E4M3 and E2M1 encoders, masked loads and stores, key words, and launch-setting checks.

Each encoder computes a function of ``fp4jax.numerics`` in fewer operations, on float32 bit
patterns (no float4 or float8 casts, which Triton cannot lower); its docstring names that function,
and the kernel tests check the two agree on every float32 of the range. The correctly rounded
operations are PTX instructions inside GPU kernels (Triton's ``/`` and ``sqrt`` are not correctly
rounded) and the CPU's IEEE arithmetic or ``fp4jax.numerics`` in interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax import numerics, nvfp4
from fp4jax._fp32 import div_rn_normal

BLOCK = nvfp4.BLOCK  # elements of an NVFP4 block
ROUNDINGS = nvfp4.ROUNDINGS  # "nearest", "stochastic"
E2M1_X_E4M3_MAX = numerics.E2M1_MAX * numerics.E4M3_MAX  # 6 * 448 = 2688: S_enc = 2688 / amax
F32_SIGN_BITS = np.int32(-(2**31))  # the float32 sign bit as int32
F32_NORMAL_MIN_BITS = 0x00800000  # the pattern of 2^-126, the smallest normal float32
F32_INF_BITS = 0x7F800000


# ----------------------------------------------------------------------------------------------
# Sizes


def is_pow2(n) -> bool:
  """Whether ``n`` is a Python (or NumPy) int that is a power of two (1 included)."""
  return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def pow2_at_least(n) -> int:
  """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
  return 1 << max(0, int(n) - 1).bit_length()


def round_up(n, m):
  """``n`` rounded up to a multiple of ``m``."""
  return -(-n // m) * m


def pad_pow2(x):
  """``x`` flattened and zero-padded to a power-of-two length."""
  x = x.reshape(-1)
  return jnp.pad(x, (0, pl.next_power_of_2(x.size) - x.size))


def check_powers_of_two(settings, minimum, *, maximum=None, allow_none=False,
                        exclude=()) -> None:
  """ValueError unless every field of the dataclass ``settings`` (but those in ``exclude``) is a
  power of two of at least ``minimum(field_name)`` (and at most ``maximum(field_name)`` where that
  is not None); with ``allow_none``, None (the kernel's default) passes. Launch settings: elements
  or rows per program, warps."""
  for f in dataclasses.fields(settings):
    if f.name in exclude:
      continue
    v, lo = getattr(settings, f.name), minimum(f.name)
    hi = None if maximum is None else maximum(f.name)
    if v is None and allow_none:
      continue
    if not isinstance(v, int) or v < lo or v & (v - 1) or (hi is not None and v > hi):
      bound = f" <= {hi}" if hi is not None else ""
      raise ValueError(f"{type(settings).__name__}.{f.name} must be a power of two >= {lo}{bound}, "
                       f"got {v!r}")


def check_positive(settings, name, *, allow_none=False) -> None:
  """ValueError unless field ``name`` of the dataclass ``settings`` is a positive int (or, with
  ``allow_none``, None: the kernel's default), e.g. Triton's pipelining stages."""
  v = getattr(settings, name)
  if v is None and allow_none:
    return
  if not isinstance(v, int) or isinstance(v, bool) or v < 1:
    raise ValueError(f"{type(settings).__name__}.{name} must be a positive int, got {v!r}")


# ----------------------------------------------------------------------------------------------
# Float32 bit views


def int_bits(x):
  """The int32 bit pattern of float32 ``x``."""
  return lax.bitcast_convert_type(x, jnp.int32)


def float_of(b):
  """The float32 whose bit pattern is int32 ``b``."""
  return lax.bitcast_convert_type(b, jnp.float32)


def abs_bits(x32):
  """The int32 pattern of ``|x32|`` (float32): the sign bit cleared. Patterns order like the
  magnitudes, with every NaN above +inf."""
  return int_bits(x32) & 0x7FFFFFFF


def max_all(a):
  """Full max of an array, one axis at a time from the last (a full reduction does not lower to
  Triton)."""
  while a.ndim:
    a = jnp.max(a, axis=a.ndim - 1)
  return a


# ----------------------------------------------------------------------------------------------
# Correctly rounded float32 operations


def ptx(op, *args):
  """A correctly rounded float32 PTX instruction ``op`` (e.g. ``"div.rn.f32"``), elementwise over
  the broadcast of ``args`` (Triton's ``/`` and ``sqrt`` are not correctly rounded)."""
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
  args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
  operands = ", ".join(f"${i + 1}" for i in range(len(args)))
  return plgpu.elementwise_inline_asm(
      f"{op} $0, {operands};", args=args, constraints=",".join(["=f"] + ["f"] * len(args)),
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


def division(interpret: bool) -> str:
  """The ``division`` of a kernel: ``"backend"`` in interpret mode, else ``"ptx"``."""
  return "backend" if interpret else "ptx"


def div_rn(a, b, division: str):
  """``a / b`` in float32 (``b`` an array), correctly rounded (``numerics.div_rn``) by
  ``division``: ``"ptx"`` (PTX ``div.rn.f32``, inside GPU kernels) or ``"backend"``
  (``div_rn_normal``: the CPU's IEEE division in interpret mode, as ``nvfp4.quantize`` divides
  there). Both agree unless a subnormal is involved, which the CPU flushes to zero."""
  if division == "ptx":
    return ptx("div.rn.f32", a, b)
  return div_rn_normal(a, b)


def recip_rn(b, division: str):
  """``1 / b`` correctly rounded, as ``div_rn(1.0, b, division)``; with ``"ptx"`` PTX
  ``rcp.rn.f32``, the same correctly rounded reciprocal in fewer instructions than ``div.rn.f32``."""
  if division == "ptx":
    return ptx("rcp.rn.f32", b)
  return div_rn(1.0, b, division)


def sqrt_rn(x, interpret: bool):
  """IEEE ``sqrt`` (``numerics.sqrt_rn``): PTX ``sqrt.rn.f32`` inside GPU kernels (subnormals
  included), ``numerics.sqrt_rn`` in interpret mode: the same bits."""
  return numerics.sqrt_rn(x) if interpret else ptx("sqrt.rn.f32", x)


def mul_rn(interpret: bool):
  """The rounded products of ``numerics.rounded_ema`` (its ``mul``): PTX ``mul.rn.f32`` inside GPU
  kernels, which ptxas never fuses into an addition: one instruction, where ``numerics.rounded``
  adds an integer operation per product. None (``numerics.rounded``) in interpret mode."""
  return None if interpret else lambda a, b: ptx("mul.rn.f32", a, b)


# ----------------------------------------------------------------------------------------------
# E4M3 and E2M1 encoders (each equals a function of fp4jax.numerics on its range)


def e4m3_value(v):
  """``numerics.round_to_e4m3(v)[0]`` (the value, no byte) for float32 ``v`` in [0, 448]: the
  decoded block scale of a fake quantization.

  ``(v + M) - M`` rounds ``v`` to a multiple of the float32 ulp at ``M``, ties to even: with ``M =
  2^(e + 20)`` (``e`` the exponent of ``v``) that keeps 3 mantissa bits, E4M3's normal rounding; with
  ``M`` at least 2^14 (ulp 2^-9), values below 2^-6 round to E4M3's subnormal step 2^-9. Equal for
  every float32 in [0, 448] (tests/test_kernels_attention.py checks it exhaustively)."""
  big = float_of(jnp.maximum((int_bits(v) & 0x7F800000) + (20 << 23), 0x46800000))  # 0x46800000: 2^14
  return (v + big) - big


def e4m3_block_scales(block_amax, m):
  """``numerics.e4m3_block_scales(block_amax, m)``, value and byte (int32), in fewer operations,
  for finite ``block_amax >= 0`` and finite ``m > 0`` (the same value and byte for every float32 in
  [0, 448]; tests/test_kernels_quantize.py checks it exhaustively): the quantizer's block scales.

  From 2^-6 up, ``numerics.round_to_e4m3``'s pattern rounding, with the byte read off the rounded
  pattern: its bits 20 and up are ``(biased exponent << 3) | mantissa``, so the byte is that minus
  ``(127 - 7) << 3``. Below 2^-6 (E4M3 subnormals, multiples of 2^-9): ``v + 2^14`` rounds ``v`` to a
  multiple of 2^-9, ties to even (the spacing of float32 in [2^14, 2^15)), its pattern is that of
  2^14 plus the multiple (the value is that multiple times 2^-9: ``t - 2^14`` would be too, but
  XLA:CPU folds ``(v + c) - c`` to ``v`` in interpret mode).
  """
  # clip(min(block_amax * m, FLT_MAX), 0, 448) for block_amax >= 0 and m > 0 (finite): the product
  # is +0 or more, inf included.
  v = jnp.minimum(block_amax * m, numerics.E4M3_MAX)
  b = int_bits(v)
  r = b + (0x7FFFF + ((b >> 20) & 1))
  normal_value = float_of(r & jnp.int32(-(1 << 20)))
  normal_code = (r >> 20) - ((127 - 7) << 3)
  t = v + jnp.float32(2.0**14)
  sub_code = int_bits(t) - 0x46800000  # the pattern of 2^14
  sub_value = sub_code.astype(jnp.float32) * jnp.float32(2.0**-9)
  small = v < 2.0**-6
  return jnp.where(small, sub_value, normal_value), jnp.where(small, sub_code, normal_code)


def e2m1_value(a, rounding: str, r):
  """The E2M1 value (float32) of magnitudes ``a`` in [0, 6], for a fake quantization:
  ``numerics.decode_e2m1(numerics.e2m1_rne_code(a))`` or, with ``rounding="stochastic"``,
  ``numerics.decode_e2m1(numerics.e2m1_stochastic_code(a, bits))`` for int32 ``r = bits >> 10``
  (the 22 random bits that it adds), equal for every ``a`` in [0, 6] and every ``bits``
  (tests/test_kernels_attention.py).

  Nearest: the E2M1 grid has the step 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so ``(a + M) - M``
  with ``M = 2^22 · 2^max(e, 0)`` (``e`` the exponent of ``a``: the ulp at ``M`` is the step) rounds
  to it, ties to even, which is E2M1's tie to the even code: two integer operations for ``M`` and
  two additions, where ``e2m1_rne_code`` takes seven comparisons and ``decode_e2m1`` a select.
  Stochastic: ``e2m1_stochastic_code``'s pattern rounding (``a``, or ``a + 1`` below 1, plus the top 22
  random bits, truncated to a multiple of 2^22) is already the pattern of the rounded value (of the
  value plus 1 below 1): no code and no decode."""
  if rounding == "nearest":
    m = float_of(jnp.maximum((int_bits(a) & 0x7F800000) + (22 << 23), 0x4A800000))  # 0x4A800000: 2^22
    return (a + m) - m
  one = jnp.where(a < 1.0, jnp.float32(1.0), jnp.float32(0.0))
  return float_of((int_bits(a + one) + r) & -(1 << 22)) - one


def e2m1_rne_magnitude(a):
  """``numerics.e2m1_rne_code(a)`` (the code, int32) for float32 ``a`` in [0, 6] in fewer
  operations (equal for every float32 in [0, 6]; tests/test_kernels_quantize.py checks it
  exhaustively).

  From 1 up, each step of the E2M1 grid (1, 1.5, 2, 3, 4, 6) spans 2^22 float32 patterns, so the
  code is the pattern rounded to a multiple of 2^22, ties to even, minus 252 (the pattern of 1.0 is
  254 · 2^22). Below 1 the grid (0, 0.5, 1) is ``rint(2a)``: ``a + 2^22`` rounds ``a`` to a multiple of
  1/2 (the spacing of float32 in [2^22, 2^23)), ties to even, and its pattern is that of 2^22
  (``0x4A800000``) plus ``rint(2a)``.
  """
  b = int_bits(a)
  big = ((b + (0x1FFFFF + ((b >> 22) & 1))) >> 22) - 252
  small = int_bits(a + jnp.float32(2.0**22)) - 0x4A800000
  return jnp.where(a < 1.0, small, big)


def e2m1_codes(x32, escale, rounding, bits):
  """``numerics.e2m1_codes(x32, escale, False, rounding, bits, int32)`` for subnormal-flushed
  ``x32``: the magnitude as ``e2m1_rne_magnitude`` (nearest) and the sign bit from the pattern
  (``x32 < 0`` for a flushed, finite value). The quantizer zeroes the blocks of ``zero_block`` in
  the packed bytes, one select per two codes."""
  a = jnp.minimum(jnp.abs(x32 * escale), numerics.E2M1_MAX)
  mag = e2m1_rne_magnitude(a) if rounding == "nearest" else numerics.e2m1_stochastic_code(a, bits)
  sign = (int_bits(x32) >> 28) & 8
  return mag | sign


# ----------------------------------------------------------------------------------------------
# Four over Six (``nvfp4.quantize(scale_rule="4over6_*")``)


def four_over_six_scales(block_amax, s_enc, s_dec, finite, interpret: bool):
  """The two candidate block scales of 4/6, amax to 4 then amax to 6, each ``(dscale, its E4M3 byte
  (uint8), escale = min(1 / (dscale * S_dec), FLT_MAX), zero_block)``, as ``nvfp4.quantize`` forms
  them: ``base = ftz(block_amax / 6) * S_enc`` and ``e4m3_rne(min(base * 1.5, 448))``,
  ``e4m3_rne(min(base, 448))``. ``S_enc``, ``S_dec`` are the tensor's under the E4M3 bound 256;
  ``finite``: whether its amax is. PTX ``div.rn.f32`` on the GPU; in interpret mode ``block_amax /
  6`` and ``escale`` are the CPU's IEEE division (``div_rn_normal``)."""
  block_amax = jnp.where(finite, block_amax, 0.0)
  sixth = div_rn(block_amax, jnp.float32(numerics.E2M1_MAX), division(interpret))
  base = numerics.flush_subnormals(sixth) * s_enc
  out = []
  for m in (1.5, 1.0):  # nvfp4._MAP4; 1.0: min(base * 1, 448) is min(base, 448)
    dscale, dcode = e4m3_block_scales(base, jnp.float32(m))
    escale = jnp.minimum(div_rn(1.0, dscale * s_dec, division(interpret)), numerics.F32_MAX)
    out.append((dscale, dcode.astype(jnp.uint8), escale, (dscale == 0) | ~finite))
  return out


def four_over_six_terms(code, dscale, scaled_x, scale_rule: str, mul):
  """The per-element error terms of a 4/6 candidate: ``e = ftz(decode(code) * dscale - scaled_x)``,
  then ``|e|`` (``"4over6_mae"``) or ``ftz(mul(e, e))`` (``"4over6_mse"``), where ``scaled_x`` is
  ``ftz(mul(x, S_enc))`` and ``mul`` a float32 product that no compiler fuses into an addition
  (``mul_rn``). ``decode(code) * dscale`` is exact (a zero-scale block gives 0 whatever its code)."""
  e = numerics.flush_subnormals(numerics.decode_e2m1(code) * dscale - scaled_x)
  return jnp.abs(e) if scale_rule == "4over6_mae" else numerics.flush_subnormals(mul(e, e))


def rounded_mul(interpret: bool):
  """``mul_rn(interpret)``, or the plain float32 product in interpret mode (the CPU rounds every
  product on its own)."""
  return mul_rn(interpret) or (lambda a, b: a * b)


# ----------------------------------------------------------------------------------------------
# Loads, stores, key words


def store(ref, val, mask, eviction_policy=None):
  """``ref[...] = val``, masked where ``mask`` is not None (a block hanging over the array's end);
  ``eviction_policy``: Triton's L2 hint."""
  if mask is None and eviction_policy is None:
    ref[...] = val
  else:
    plgpu.store(ref, val, mask=mask, eviction_policy=eviction_policy)


def load(ref, mask, eviction_policy=None):
  """``ref``'s block, zeros where ``mask`` (if not None) is False; ``eviction_policy``: Triton's L2
  hint."""
  if mask is None:
    return ref[...] if eviction_policy is None else plgpu.load(ref, eviction_policy=eviction_policy)
  if ref.dtype == jnp.float8_e4m3fn:  # Triton cannot cast an `other` to f8: zero the bytes after
    return lax.bitcast_convert_type(
        jnp.where(mask, f8_bytes(plgpu.load(ref, mask=mask, eviction_policy=eviction_policy)),
                  jnp.uint8(0)),
        jnp.float8_e4m3fn)
  return plgpu.load(ref, mask=mask, other=0, eviction_policy=eviction_policy)


def f8_bytes(x):
  """The uint8 bytes of a float8 array."""
  return lax.bitcast_convert_type(x, jnp.uint8)


def key_words(key, bit_source: str = "counter"):
  """The two uint32 words of ``key`` that a kernel's rounding bits are drawn from, as int32 (2,):
  ``numerics.counter_words(key)`` (``"counter"``) or the key's threefry words (``"random"``)."""
  if bit_source == "counter":
    k1, k2 = numerics.counter_words(key)
  else:
    k1, k2 = jax.random.key_data(key).reshape(-1)[:2].astype(jnp.uint32)
  return lax.bitcast_convert_type(jnp.stack([k1, k2]).astype(jnp.uint32), jnp.int32)


def ref_words(ref, at: int = 0):
  """The two uint32 key words at ``ref[at:at + 2]`` of a kernel's int32 operand (``key_words``)."""
  return tuple(lax.bitcast_convert_type(ref[at + i], jnp.uint32) for i in range(2))
