"""NVFP4: the 4-bit block-scaled format, as pure JAX functions around one pytree type.

An NVFP4 tensor stores E2M1 elements (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), one E4M3 scale per block of
16 consecutive elements (``block=(1, 16)``, along ``axis``) or per 16×16 tile of the last two axes
(``block=(16, 16)``, for weights), and one float32 decode scale for the whole tensor. Quantization
follows Transformer Engine's order of float32 operations bit for bit (docs/DESIGN.md, "The NVFP4
format")::

  amax   = max|x|;  S_enc = min(2688 / amax, FLT_MAX) (1 where amax == 0);  S_dec = 1 / S_enc
  dscale = e4m3_rne(min(block_amax * (S_enc * fp32(1/6)), 448))
  escale = min(1 / (dscale * S_dec), FLT_MAX)
  q      = e2m1_rne(clamp(x * escale, -6, 6))      (code 0 where dscale == 0)
  x_hat  = q * dscale * S_dec

Four over Six (``scale_rule="4over6_mse"`` or ``"4over6_mae"``; Cook et al., arXiv 2512.02010) gives
each block two candidate scales, its amax mapped to 6 (as above) or to 4, and keeps the one whose
dequantized block is closer to ``x``. E2M1 has a step of 2 between 4 and 6, so a block whose large
elements fall there is often better served by the grid up to 4 with a scale 1.5× larger. The
order of float32 operations is Transformer Engine's 4over6 kernel (``quantize_4over6_nvfp4.cuh``,
its candidate error in the E4M3-scaled domain, ``NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH=1``)::

  S_enc  = min(1536 / amax, FLT_MAX) (1 where amax == 0);  S_dec = 1 / S_enc     (1536 = 256 * 6)
  base   = ftz(block_amax / 6) * S_enc
  d6     = e4m3_rne(min(base, 448));   d4 = e4m3_rne(min(base * 1.5, 448))
  q_c    = e2m1_rne(clamp(x * min(1 / (d_c * S_dec), FLT_MAX), -6, 6))   (0 where d_c == 0)
  e_c    = ftz(q_c * d_c - ftz(x * S_enc)),  then |e_c| (mae) or ftz(e_c * e_c) (mse)
  err_c  = e_c summed in float32: in element order 0..15 for a 1×16 block; for a 16×16 tile each
           row in that order, then the 16 row sums pairwise (r + r+8, then + r+4, + r+2, + r+1)
  keep d4 and q_4 where err_4 < err_6, else d6 and q_6          (a tie keeps the amax-to-6 scale)

Each product is rounded before any addition (no fused multiply-add); ``q_c * d_c`` is exact.
``ftz`` flushes float32 subnormals to zero on every backend (Transformer Engine keeps them; with
``max|x| >= 1e-30`` that changes nothing but error terms below 2^-126, in the sums of the
``x * S_enc`` domain where a block's elements run up to about 1536). The global bound 256 in place
of 448 keeps ``d4 <= 1.5 * 256 = 384`` within E4M3; the stored global scale is ``S_dec`` as above,
so ``dequantize`` and every consumer of an ``NVFP4Tensor`` are unchanged. Stochastic rounding is not
offered with 4/6 (a choice made from the rounded values would bias the rounding).

Divisions are correctly rounded on every backend, so the GPU gives the same bits as the CPU: on the
GPU, whose division is not, they are computed on integer bit patterns (``numerics.div_rn``); on the
CPU by its IEEE division. Roundings are computed on bit patterns everywhere (XLA may fold float
conversion pairs away).

Non-finite input: if ``x`` holds any NaN or ±inf, the stored global scale is NaN and every block is
stored as zero, so the whole tensor dequantizes to NaN. Nothing non-finite ever comes back finite.

Range: float32 subnormal inputs are flushed to zero (XLA's CPU backend does this in any float
arithmetic; here it is explicit, so every backend agrees). For tensors with ``max|x| >= 1e-30`` every
intermediate is a normal float32 and the result is bit-exact to Transformer Engine (subnormal
elements quantize to code 0 there too). Below that the decode scales themselves become subnormal,
which a backend that flushes denormals (XLA's CPU) reads as zero: below ``max|x| ~ 3e-35`` the CPU
stores ``S_dec = 0`` where the GPU stores the subnormal, and either tensor dequantizes to (about) 0.

Signed zero: the sign bit of a code is set for strictly negative ``x`` (so ``-0.0`` gives code 0,
and ``-0.2`` gives code 8, a negative zero), as in Transformer Engine.

Storage: codes are packed two per uint8 along the blocked axis (the last axis for 16×16 tiles),
the even element in the low nibble; with the E4M3 scales that is 4.5 bits per element, plus 4 bytes.

Functions: ``quantize``, ``dequantize``, ``fake_quant`` (straight-through), ``gemm`` (an NVFP4 GEMM
as tensor cores compute it, emulated on bf16 ones), ``scaled_matmul_gemm`` (the same GEMM through
``jax.nn.scaled_matmul``, for GPUs with FP4 tensor cores), ``hadamard`` (the 16-point random Hadamard
transform).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax import numerics
from fp4jax._fp32 import div_rn_normal
from fp4jax.numerics import E2M1_MAX, E4M3_MAX, F32_MAX

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROUNDINGS = ("nearest", "stochastic")  # the rounding names of every quantizing function
SCALE_RULES = ("max", "4over6_mse", "4over6_mae")  # how a block's E4M3 scale is chosen (``quantize``)
E4M3_MAX_4OVER6 = 256.0  # the E4M3 bound in S_enc under 4/6: map-to-4 scales (×1.5) stay below 448
_MAP4 = 1.5  # a block's amax mapped to 4 instead of 6: its scale times 6 / 4
_VALID_BLOCKS = ((1, BLOCK), (BLOCK, BLOCK))
# The non-negative finite E4M3 bytes 0..126 (0x7F is NaN).
_E4M3_CODES = np.arange(127, dtype=np.uint8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
  """A tensor quantized to NVFP4.

  Attributes:
    codes: uint8, two E2M1 codes per byte along the packed axis (``axis``).
    scales: float8_e4m3fn block scales; the blocked axes of ``shape`` divided by 16.
    global_scale: float32 scalar, the decode scale ``S_dec`` (NaN if the input was not finite).
    shape: shape of the original tensor.
    block: ``(1, 16)`` (16 consecutive elements along ``axis``) or ``(16, 16)`` (tiles of the last
      two axes).
    axis: the non-negative blocked axis for ``(1, 16)``; ``ndim - 1`` for ``(16, 16)``. Codes are
      packed along it.
    dtype: dtype of the original tensor, the default of ``dequantize``.
  """

  codes: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    _check_layout(self.shape, self.block, self.axis)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    """Bytes stored: packed codes (0.5 B/element), E4M3 scales (1 B per 16) and the f32 global scale."""
    return self.size // 2 + self.size // (BLOCK * self.block[0]) + 4

  def elements(self) -> jax.Array:
    """The E2M1 values (float32), shaped like the original tensor."""
    return numerics.decode_e2m1(_unpack(self.codes, self.axis))

  def block_scales(self) -> jax.Array:
    """The decoded E4M3 block scales (float32), one per block (decoded with integer operations)."""
    return numerics.e4m3_to_f32(lax.bitcast_convert_type(self.scales, jnp.uint8))

  def code_indices(self) -> jax.Array:
    """The 4-bit E2M1 codes (uint8, 0..15: sign bit 8), unpacked, shaped like the original tensor."""
    return _unpack(self.codes, self.axis)

  def with_code_indices(self, code) -> NVFP4Tensor:
    """This tensor's scales with other codes (``code_indices``' layout): an encoder that chooses its
    own codes within ``quantize``'s scales (dithered or preconditioner-space rounding)."""
    return dataclasses.replace(self, codes=_pack(jnp.asarray(code).astype(jnp.uint8), self.axis))

  def encode_scales(self) -> jax.Array:
    """Per block, the factor ``quantize`` multiplied the elements by: ``min(1 / (d · S_dec), FLT_MAX)``
    for the block's E4M3 scale ``d`` and the global ``S_dec`` (float32, one per block)."""
    code = lax.bitcast_convert_type(self.scales, jnp.uint8).astype(jnp.int32)
    return _escale_table(self.global_scale).at[code].get(mode="promise_in_bounds")

  def scaled_elements(self, dtype=jnp.float32) -> jax.Array:
    """``elements * block_scales`` without the global scale: exact in bfloat16 and float32.

    ``scaled_elements(bf16)`` operands in a bf16 matmul with f32 accumulation, times both global
    scales afterwards, reproduce an NVFP4 GEMM up to summation order.
    """
    return (self.elements() * _expand_scales(self.block_scales(), self)).astype(dtype)

  def dequantize(self, dtype=None) -> jax.Array:
    """``elements * block_scales * global_scale`` in float32, then cast to ``dtype`` (default: original)."""
    return _dequantize(self, jnp.dtype(self.dtype if dtype is None else dtype))


@functools.partial(jax.jit, static_argnums=1)  # one compiled program per layout, as ``_quantize``
def _dequantize(t: NVFP4Tensor, dtype) -> jax.Array:
  return (t.scaled_elements(jnp.float32) * t.global_scale).astype(dtype)


def _check_layout(shape, block, axis):
  if tuple(block) not in _VALID_BLOCKS:
    raise ValueError(f"block must be (1, 16) or (16, 16), got {block!r}")
  ndim = len(shape)
  if block == (BLOCK, BLOCK):
    if ndim < 2:
      raise ValueError(f"block=(16, 16) tiles the last two axes and needs ndim >= 2, got shape {shape}")
    for ax in (ndim - 2, ndim - 1):
      if shape[ax] % BLOCK:
        raise ValueError(
            f"block=(16, 16): axis {ax} has size {shape[ax]}, not a multiple of 16 (shape {shape})")
  else:
    if not 0 <= axis < ndim:
      raise ValueError(f"axis {axis} out of range for shape {shape}")
    if shape[axis] % BLOCK:
      raise ValueError(
          f"block=(1, 16) along axis {axis}: size {shape[axis]} is not a multiple of 16 (shape {shape})")


def block_layout(shape, block, axis) -> tuple[tuple[int, int], int]:
  """The checked layout of an NVFP4 tensor of ``shape``: ``(block, axis)`` with ``block`` (1, 16) or
  (16, 16) and ``axis`` non-negative (the last axis for 16×16 tiles). Raises ``ValueError`` naming
  the problem for any other block, an axis out of range, or an axis that is not a multiple of 16."""
  try:
    block = tuple(int(b) for b in block)
  except TypeError:
    raise ValueError(f"block must be (1, 16) or (16, 16), got {block!r}") from None
  ndim = len(shape)
  if block == (BLOCK, BLOCK):
    axis = ndim - 1
  elif not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} out of range for shape {shape}")
  axis = axis % ndim if ndim else 0
  _check_layout(shape, block, axis)
  return block, axis


# ----------------------------------------------------------------------------------------------
# Packing


def _pack(codes, axis):
  c = jnp.moveaxis(codes, axis, -1)
  c = c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2)
  packed = c[..., 0] | (c[..., 1] << 4)
  return jnp.moveaxis(packed, -1, axis)


def _unpack(packed, axis):
  p = jnp.moveaxis(packed, axis, -1)
  c = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
  return jnp.moveaxis(c, -1, axis)


# ----------------------------------------------------------------------------------------------
# Blocking


def _block_amax(a, block, axis):
  """Per-block max of ``a`` (>= 0): shape of ``a`` with blocked axes divided by 16."""
  if block == (BLOCK, BLOCK):
    *lead, m, n = a.shape
    return a.reshape(*lead, m // BLOCK, BLOCK, n // BLOCK, BLOCK).max(axis=(-3, -1))
  a = jnp.moveaxis(a, axis, -1)
  out = a.reshape(*a.shape[:-1], a.shape[-1] // BLOCK, BLOCK).max(axis=-1)
  return jnp.moveaxis(out, -1, axis)


def _expand(s, shape, block, axis):
  """Broadcast per-block values back to the element shape."""
  if block == (BLOCK, BLOCK):
    return jnp.repeat(jnp.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)
  return jnp.repeat(s, BLOCK, axis=axis)


def _expand_scales(s, t: NVFP4Tensor):
  return _expand(s, t.shape, t.block, t.axis)


# ----------------------------------------------------------------------------------------------
# Public API


def global_decode_scale(amax, e4m3_max: float = E4M3_MAX):
  """``S_enc`` and ``S_dec`` for a tensor whose ``max|x|`` is ``amax`` (finite, >= 0), in TE's order:
  ``S_enc = min(e4m3_max * 6 / amax, FLT_MAX)`` (1 where that is 0 or ``amax`` is), ``S_dec = 1 / S_enc``.
  ``e4m3_max``: 448, or ``E4M3_MAX_4OVER6`` (256) under Four over Six."""
  amax = jnp.asarray(amax, jnp.float32)
  s_enc = _encode_scale(div_rn_normal(jnp.float32(e4m3_max * E2M1_MAX), amax), amax)
  return s_enc, div_rn_normal(jnp.float32(1.0), s_enc)


def _encode_scale(quotient, amax):
  """``S_enc`` from the correctly rounded ``e4m3_max * 6 / amax``: at most FLT_MAX, 1 where it or
  ``amax`` is 0."""
  s_enc = jnp.minimum(quotient, F32_MAX)
  return jnp.where((amax == 0) | (s_enc == 0), 1.0, s_enc).astype(jnp.float32)


def quantize(x, *, block=(1, BLOCK), axis=-1, rounding="nearest", key=None, bits=None,
             scale_rule="max") -> NVFP4Tensor:
  """Quantizes ``x`` to NVFP4, bit-exact to Transformer Engine's algorithm (module docstring).

  Args:
    x: a float32, bfloat16 or float16 array.
    block: ``(1, 16)``: 16 consecutive elements along ``axis`` share a scale (activations,
      gradients). ``(16, 16)``: 16×16 tiles of the last two axes share a scale (weights; the same
      codes then serve ``x`` and ``x.T``).
    axis: the blocked axis for ``(1, 16)``; ignored for ``(16, 16)``.
    rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased: rounds to one of the two
      neighbouring E2M1 values with probabilities that make the expectation exact; 22 random bits
      per element from ``key``).
    key: a ``jax.random`` key for stochastic rounding (``jax.random.bits``). Same key, same bits.
    bits: instead of ``key``, the uint32 random bits themselves, shaped like ``x`` (the top 22 of
      each are used), e.g. ``numerics.counter_bits``, which XLA fuses into the quantizer.
    scale_rule: how each block's E4M3 scale is chosen: ``"max"`` (its amax maps to E2M1's 6: Transformer
      Engine's NVFP4, the default), ``"4over6_mse"`` or ``"4over6_mae"`` (Four over Six: its amax maps
      to 6 or to 4, whichever candidate's dequantized block has the lower sum of squared or absolute
      errors; a tie keeps 6; the global scale uses 256 in place of 448; module docstring).
      Round-to-nearest only.

  Returns:
    An ``NVFP4Tensor``. Non-finite ``x`` gives a NaN global scale (see the module docstring).

  Raises:
    ValueError: a blocked axis not a multiple of 16, a bad ``block``/``axis``/``rounding``/
      ``scale_rule``, stochastic rounding without a key or bits (or with both) or with a 4/6 rule,
      or bits of the wrong shape or dtype.

  Example:
    >>> t = quantize(jnp.ones((4, 32)))
    >>> t.codes.shape, t.scales.shape, float(t.dequantize()[0, 0])
    ((4, 16), (4, 2), 1.0)
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize needs a floating-point array, got dtype {x.dtype}")
  block, axis = block_layout(x.shape, block, axis)
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
  check_scale_rule(scale_rule, rounding)
  if rounding == "stochastic" and key is None and bits is None:
    raise ValueError("rounding='stochastic' needs a `key` (a jax.random key) or `bits`")
  if key is not None and bits is not None:
    raise ValueError("give stochastic rounding a `key` or its `bits`, not both")
  if bits is not None and (tuple(bits.shape) != tuple(x.shape) or bits.dtype != jnp.uint32):
    raise ValueError(f"bits must be uint32 shaped like x {tuple(x.shape)}, got {bits.dtype}"
                     f"{tuple(bits.shape)}")
  return _quantize(x, key, bits, block=block, axis=axis, rounding=rounding, scale_rule=scale_rule)


# One compiled program per shape and layout: an eager ``quantize`` runs it instead of op by op; under a
# trace it is a nested call that XLA inlines (the same operations as written out in place).
@functools.partial(jax.jit, static_argnames=("block", "axis", "rounding", "scale_rule"))
def _quantize(x, key, bits, *, block, axis, rounding, scale_rule) -> NVFP4Tensor:
  """``quantize`` of checked arguments (``block`` and ``axis`` as ``block_layout`` returns them)."""
  x32 = numerics.flush_subnormals(x.astype(jnp.float32))
  # NaN -> inf before the max: XLA's CPU max does not propagate NaN.
  ax = jnp.where(jnp.isnan(x32), jnp.inf, jnp.abs(x32))
  # The tensor's amax is the max of the block amaxes (the same value): one pass over the elements
  # gives both, where max(ax) beside the block maxima was a second full pass on the GPU.
  block_amax = _block_amax(ax, block, axis)
  amax = jnp.asarray(jnp.max(block_amax) if x.size else jnp.float32(0), jnp.float32)
  finite = amax <= F32_MAX  # false for NaN and inf
  e4m3_max = E4M3_MAX if scale_rule == "max" else E4M3_MAX_4OVER6
  s_enc, s_dec, table = _global_scales(jnp.where(finite, amax, 0.0), e4m3_max)
  s_dec = jnp.where(finite, s_dec, jnp.nan)  # a non-finite tensor's table serves only zeroed blocks

  block_amax = jnp.where(finite, block_amax, 0.0)
  if scale_rule != "max":
    dscale_code, code = _four_over_six(x32, block_amax, amax, s_enc, table, finite,
                                       block, axis, scale_rule)
    return _tensor(x, code, dscale_code, s_dec, block, axis)
  dscale, dscale_code = numerics.e4m3_block_scales(block_amax, s_enc * jnp.float32(numerics.INV6))
  escale = table.at[dscale_code.astype(jnp.int32)].get(mode="promise_in_bounds")

  if rounding == "stochastic" and bits is None:
    bits = jax.random.bits(key, x.shape, jnp.uint32)
  zero_block = _expand(dscale == 0, x.shape, block, axis) | ~finite
  code = numerics.e2m1_codes(x32, _expand(escale, x.shape, block, axis), zero_block, rounding, bits)
  return _tensor(x, code, dscale_code, s_dec, block, axis)


def check_scale_rule(scale_rule, rounding="nearest") -> None:
  """ValueError unless ``scale_rule`` is one of ``SCALE_RULES`` and, for a 4/6 rule, ``rounding`` is
  ``"nearest"``."""
  if scale_rule not in SCALE_RULES:
    raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
  if scale_rule != "max" and rounding != "nearest":
    raise ValueError(f"scale_rule={scale_rule!r} takes rounding='nearest' only: a scale chosen by the "
                     f"error of the rounded block would bias stochastic rounding; use scale_rule='max'")


def _escale_table(s_dec):
  """``min(1 / (d * S_dec), FLT_MAX)`` for each of the 127 non-negative E4M3 values ``d``, by byte.

  ``escale = 1 / (dscale * S_dec)`` takes one of 127 values per tensor (dscale is a non-negative
  E4M3 value): divide once per code, then look the blocks up. A per-block division is fused into
  the per-element loop by XLA and recomputed 16 times per block (the integer division of other
  backends is ~100 operations).
  """
  denominators = numerics.e4m3_to_f32(_E4M3_CODES) * s_dec[..., None]
  return jnp.minimum(div_rn_normal(jnp.float32(1.0), denominators), F32_MAX)


@functools.partial(jax.jit, static_argnums=1)  # traced once per e4m3_max, a call in each quantize (XLA inlines it)
def _global_scales(amax, e4m3_max):
  """``global_decode_scale(amax, e4m3_max)`` and ``_escale_table`` of its ``S_dec``: ``(S_enc, S_dec,
  table)``."""
  s_enc, s_dec = global_decode_scale(amax, e4m3_max)
  return s_enc, s_dec, _escale_table(s_dec)


def _tensor(x, code, dscale_code, s_dec, block, axis) -> NVFP4Tensor:
  return NVFP4Tensor(
      codes=_pack(code, axis),
      scales=lax.bitcast_convert_type(dscale_code, jnp.float8_e4m3fn),
      global_scale=s_dec.astype(jnp.float32),
      shape=tuple(x.shape),
      block=block,
      axis=axis,
      dtype=x.dtype,
  )


def _four_over_six(x32, block_amax, amax, s_enc, table, finite, block, axis, scale_rule):
  """The 4/6 block scales and codes (module docstring): ``(scale bytes, codes)``, the candidate with
  the lower block error per block, map-to-6 on a tie."""
  # An int32 zero that XLA cannot fold (amax >= 0, so its pattern is too): added to a product's bit
  # pattern, it keeps the GPU from fusing the product into the next addition.
  zero = jnp.minimum(lax.bitcast_convert_type(amax, jnp.int32), 0)
  ftz = numerics.flush_subnormals
  # The barrier keeps XLA from fusing the division (integer arithmetic off the CPU) into every
  # element's loop.
  base = lax.optimization_barrier(ftz(div_rn_normal(block_amax, jnp.float32(E2M1_MAX))) * s_enc)
  scaled_x = ftz(numerics.rounded(x32 * s_enc, zero))
  candidates = []
  for v in (base * jnp.float32(_MAP4), base):  # amax to 4, amax to 6
    dscale, dscale_code = numerics.round_to_e4m3(jnp.minimum(v, E4M3_MAX))
    escale = table.at[dscale_code.astype(jnp.int32)].get(mode="promise_in_bounds")
    zero_block = _expand(dscale == 0, x32.shape, block, axis) | ~finite
    code = numerics.e2m1_codes(x32, _expand(escale, x32.shape, block, axis), zero_block, "nearest")
    e = ftz(numerics.decode_e2m1(code) * _expand(dscale, x32.shape, block, axis) - scaled_x)
    e = jnp.abs(e) if scale_rule == "4over6_mae" else ftz(numerics.rounded(e * e, zero))
    candidates.append((dscale_code, code, _block_error(e, block, axis)))
  (code4, q4, err4), (code6, q6, err6) = candidates
  map4 = err4 < err6
  return jnp.where(map4, code4, code6), jnp.where(_expand(map4, x32.shape, block, axis), q4, q6)


def _block_error(e, block, axis):
  """Per-block float32 sums of the error terms ``e`` in a fixed order (shaped as ``_block_amax``): a
  block's 16 elements in order; a 16×16 tile's rows so, then the 16 row sums pairwise with strides
  8, 4, 2, 1 (Transformer Engine's warp reduction)."""
  in_order = lambda t: functools.reduce(operator.add, [t[..., i] for i in range(BLOCK)])
  if block == (BLOCK, BLOCK):
    *lead, m, n = e.shape
    rows = in_order(e.reshape(*lead, m // BLOCK, BLOCK, n // BLOCK, BLOCK))
    v = [rows[..., r, :] for r in range(BLOCK)]
    while len(v) > 1:
      h = len(v) // 2
      v = [v[r] + v[r + h] for r in range(h)]
    return v[0]
  e = jnp.moveaxis(e, axis, -1)
  return jnp.moveaxis(in_order(e.reshape(*e.shape[:-1], e.shape[-1] // BLOCK, BLOCK)), -1, axis)


def dequantize(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
  """The values an NVFP4 tensor represents, ``q * dscale * S_dec``, computed in float32, as ``dtype``."""
  return t.dequantize(dtype)


def gemm(a: NVFP4Tensor, b: NVFP4Tensor, contracting=((1,), (0,)), *, decoded=(None, None)) -> jax.Array:
  """An NVFP4 × NVFP4 GEMM as tensor cores compute it, up to summation order.

  ``(dot(scaled_elements(a), scaled_elements(b)) * S_dec(a)) * S_dec(b)``: the operands decoded to
  bfloat16 without the global scales (exact, ``scaled_elements``), a float32-accumulated dot, then
  the two float32 global scales one at a time. Multiplying by one scale, then the other, keeps a
  product whose two scales are tiny (their product below float32's range) from flushing to zero.

  Args:
    a, b: 2-D ``NVFP4Tensor``s.
    contracting: ``lax.dot_general``'s contracting dimensions: ``((1,), (0,))`` is ``a @ b``,
      ``((1,), (1,))`` is ``a @ b.T``, ``((0,), (0,))`` is ``a.T @ b``.
    decoded: ``(da, db)``, each ``scaled_elements(bfloat16)`` of its operand when the caller already
      has it (the quantizer kernels write it), or None to decode here. The same values either way.

  Returns:
    The float32 product.

  Example:
    >>> a, b = quantize(jnp.ones((16, 32))), quantize(jnp.ones((16, 32)))
    >>> float(gemm(a, b, ((1,), (1,)))[0, 0])
    32.0
  """
  da, db = decoded
  da = a.scaled_elements(jnp.bfloat16) if da is None else da
  db = b.scaled_elements(jnp.bfloat16) if db is None else db
  acc = lax.dot_general(da, db, (contracting, ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
  return (acc * a.global_scale) * b.global_scale


def scaled_matmul_operand(t: NVFP4Tensor, contracting_axis: int) -> tuple[jax.Array, jax.Array]:
  """A 2-D NVFP4 tensor as an operand of ``jax.nn.scaled_matmul``: the contraction axis last.

  Returns ``(elements, scales)``: ``elements`` ``[R, K]`` in ``float4_e2m1fn`` (the stored codes,
  bitcast: an E2M1 code is the float4_e2m1fn bit pattern) and ``scales`` ``[R, K // 16]`` in
  ``float8_e4m3fn``, one per 16 consecutive elements along K, where K is the tensor's
  ``contracting_axis`` and R its other axis. ``elements * repeat(scales, 16)`` is
  ``scaled_elements()`` laid out with K last; the global scale is not included.

  A ``(1, 16)`` tensor must be blocked along the contraction; a ``(16, 16)`` tile's scale is repeated
  over its 16 rows (the layout of cuDNN's block-scaled GEMM, which scales 1×16 blocks along K).

  Raises:
    ValueError: a tensor that is not 2-D, or 1×16 blocks across the contraction axis.
  """
  if t.ndim != 2:
    raise ValueError(f"scaled_matmul_operand: needs a 2-D NVFP4 tensor, got shape {t.shape}")
  k_axis = contracting_axis % 2
  if t.block == (1, BLOCK) and t.axis != k_axis:
    raise ValueError(f"scaled_matmul_operand: 1x16 blocks along axis {t.axis} cannot feed a contraction "
                     f"over axis {k_axis}: an NVFP4 GEMM needs its blocks along the contraction")
  codes = _unpack(t.codes, t.axis).astype(jnp.uint4)
  elements = lax.bitcast_convert_type(codes, jnp.float4_e2m1fn)
  scales = t.scales
  if t.block == (BLOCK, BLOCK):
    scales = jnp.repeat(scales, BLOCK, axis=1 - k_axis)
  if k_axis == 0:
    elements, scales = elements.T, scales.T
  return elements, scales


def scaled_matmul_gemm(a: NVFP4Tensor, b: NVFP4Tensor, contracting=((1,), (0,))) -> jax.Array:
  """``gemm`` through ``jax.nn.scaled_matmul``: FP4 tensor cores where the device has them.

  The packed operands go to ``jax.nn.scaled_matmul`` as ``float4_e2m1fn`` elements with
  ``float8_e4m3fn`` scales per 16 elements along the contraction (``scaled_matmul_operand``), which
  lowers to cuDNN's block-scaled GEMM on CUDA (FP4 tensor cores of compute capability 10 and up) and
  to an exact dequantize-then-dot elsewhere; the two global scales are then applied one at a time,
  as in ``gemm``. Every product of decoded elements is exact in float32, so the result equals
  ``gemm``'s up to the order of the float32 summation.

  Args/Returns: as ``gemm``.
  """
  (ka,), (kb,) = contracting
  ea, sa = scaled_matmul_operand(a, ka)
  eb, sb = scaled_matmul_operand(b, kb)
  acc = jax.nn.scaled_matmul(ea[None], eb[None], sa[None], sb[None], preferred_element_type=jnp.float32)[0]
  return (acc * a.global_scale) * b.global_scale


@jax.custom_jvp
def _straight_through(x, y):
  return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
  return primals[1], tangents[0].astype(primals[1].dtype)


def fake_quant(x, *, block=(1, BLOCK), axis=-1, rounding="nearest", key=None, scale_rule="max") -> jax.Array:
  """``dequantize(quantize(x))`` in ``x``'s dtype, with a straight-through gradient (d/dx = identity).

  Arguments as in ``quantize``.
  """
  x = jnp.asarray(x)
  y = quantize(x, block=block, axis=axis, rounding=rounding, key=key, scale_rule=scale_rule).dequantize(x.dtype)
  return _straight_through(x, lax.stop_gradient(y))


def hadamard_matrix(key) -> jax.Array:
  """The 16×16 random Hadamard transform ``diag(s) · H16 / 4`` (orthonormal), ``s`` random ±1 from ``key``."""
  h = np.array([[1.0]], np.float32)
  while h.shape[0] < BLOCK:
    h = np.block([[h, h], [h, -h]])
  signs = jnp.where(jax.random.bernoulli(key, 0.5, (BLOCK,)), 1.0, -1.0).astype(jnp.float32)
  return signs[:, None] * jnp.asarray(h / 4.0)


def hadamard(x, key, axis=-1, *, inverse=False) -> jax.Array:
  """Random Hadamard transform of each 16-element block of ``x`` along ``axis``, in a fixed order.

  ``y = hadamard_matrix(key)ᵀ · x = H16 · (s ⊙ x) / 4`` per block (``inverse``: ``s ⊙ (H16 · x) / 4``),
  computed in float32 as a butterfly: the products by the signs ``s`` (exact), then 64 additions
  with strides 1, 2, 4, 8, each pair's sum before its difference, then the exact ``× 1/4``. Float32
  subnormal inputs are flushed to zero first.

  The order of the additions is part of the definition: a matrix product (``einsum``) sums in the
  backend's order, so the rounding of ``H·x``, and with it the NVFP4 codes of the wgrad operands,
  would differ between CPU and GPU and between XLA and a kernel. With one order, every backend and
  the fused quantizer kernel (``fp4jax.kernels.nvfp4_quantize``) give the same bits.

  Applying it to both operands along their contraction axis leaves their product unchanged
  (the transform is orthonormal), while spreading outliers across each block.

  Args:
    x: array whose ``axis`` is a multiple of 16.
    key: random key choosing the sign vector; use the same key for both operands of a product.
    axis: the axis to transform.
    inverse: apply the inverse (transpose) transform.

  Returns:
    The transformed array, computed in float32, in ``x``'s dtype.
  """
  x = jnp.asarray(x)
  axis = axis % x.ndim
  if x.shape[axis] % BLOCK:
    raise ValueError(f"hadamard along axis {axis}: size {x.shape[axis]} is not a multiple of 16")
  return _hadamard(x, key, axis, inverse)


@functools.partial(jax.jit, static_argnums=(2, 3))  # one compiled program per shape, as ``_quantize``
def _hadamard(x, key, axis, inverse):
  signs = hadamard_matrix(key)[:, 0] * 4.0  # s, exactly ±1
  signs = signs.reshape((1,) * x.ndim + (BLOCK,))
  xm = jnp.moveaxis(numerics.flush_subnormals(x.astype(jnp.float32)), axis, -1)
  xb = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK, BLOCK)
  if not inverse:
    xb = xb * signs
  xb = numerics.hadamard16_last_axis(xb)  # the butterfly's additions in their order
  if inverse:
    xb = xb * signs
  yb = xb * jnp.float32(0.25)
  return jnp.moveaxis(yb.reshape(xm.shape), -1, axis).astype(x.dtype)
