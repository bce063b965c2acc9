"""NVFP4 quantization in two Pallas (Triton) kernels, bit-exact with ``fp4jax.nvfp4.quantize``.

``quantize`` computes the same ``NVFP4Tensor`` as ``nvfp4.quantize`` (codes, E4M3 scales, global scale)
in two passes over the tensor: an ``amax`` kernel folds ``max|x|`` per program (on float32 bit
patterns: NaN and inf order above every finite value), XLA reduces those partial maxima, and a
``quantize`` kernel forms ``S_enc`` and ``S_dec`` in Transformer Engine's order and writes the packed
codes, the scale bytes, the global scale and, optionally, the decoded operand ``codes × E4M3 scale``
in bfloat16 (exact there; the global scale is left to the GEMM's epilogue). Options that
``nvfp4.quantize`` takes from its caller are fused: the random bits of stochastic rounding
(``jax.random.bits`` of a threefry key, or ``numerics.counter_bits``), and the 16-point random
Hadamard transform of the wgrad operands.

Layouts of the ``quantize`` kernel (each a free reshape of ``x``; programs tile the two outer axes,
with masked edges):

- ``(1, 16)`` along the last axis: ``x`` as ``(R, 1, C, 16)`` (``R`` rows, ``C = K / 16`` blocks);
  right after the load the tile is split in registers into its even and odd elements (the low and
  high nibbles of each code byte), two ``(R, 1, C, 8)`` halves on which every later step is
  elementwise; each block's max is a reduction over their last axis.
- ``(16, 16)``: ``x`` as ``(T, 16, C, 16)``, the same code with a tile's 16 rows in axis 1.
- ``(1, 16)`` along another axis ``a`` (the wgrad's token axis): ``x`` as ``(P·G, 16, Q)`` (``G`` blocks
  along ``a``, ``Q`` the elements after it); a program loads the 16 rows of its blocks as 16
  separate ``(rows, columns)`` slabs, contiguous along ``Q``, so the block reductions and the
  Hadamard butterfly are elementwise between slabs; the slabs are then stacked into one
  ``(rows, columns, 16)`` array, on which the rounding bits, codes, packing and decoded operand are
  one operation each, and split again for the stores.
- ``(1, 16)`` along the last axis with the Hadamard transform: ``x`` as ``(R, C, 16)``, read as 16
  strided slabs and stacked in the same way (its codes and decoded operand are stored whole).

The ``amax`` kernel reads the flattened tensor, or, with the Hadamard transform, the quantizer's
layout through the transform.

E2M1 rounding to nearest runs on float32 patterns (``_common.e2m1_rne_magnitude``: from 1 up the pattern
rounded to a multiple of 2^22, below 1 ``rint(2a)``), a few integer operations per element instead of
``numerics.e2m1_rne_code``'s seven comparisons, with the same codes for every float32 in [0, 6].

Division: ``1 / (dscale · S_dec)`` is PTX ``div.rn.f32`` on the GPU (Triton's ``/`` is not correctly
rounded) and the CPU's IEEE division in interpret mode: both equal ``numerics.div_rn``. Codes are
encoded with integer operations (``fp4jax.numerics``): no float4 or float8 casts in the kernels.

Hadamard transform: the kernels run ``nvfp4.hadamard``'s butterfly (strides 1, 2, 4, 8, sum before
difference, then the exact ×1/4), the same float32 additions in the same order, so the transformed
operand is the same on every backend and in the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax import numerics, nvfp4
from fp4jax.execution import AMAX_PASSES
from fp4jax.kernels._common import (BLOCK, F32_INF_BITS, F32_NORMAL_MIN_BITS, ROUNDINGS, abs_bits,
                                    check_powers_of_two, div_rn, division, e2m1_codes, e4m3_block_scales,
                                    float_of, four_over_six_scales, four_over_six_terms, key_words, load,
                                    max_all, ref_words, rounded_mul, store)
from fp4jax.numerics import BIT_SOURCES, stochastic_bits

__all__ = ["AMAX_PASSES", "BIT_SOURCES", "BLOCK", "BlockSizes", "amax_bits", "check_powers_of_two",
           "hadamard_signs", "quantize", "quantize_reference", "stochastic_bits", "threefry_key"]

_KERNEL_SUFFIX = {"max": "", "4over6_mse": "_4over6_mse", "4over6_mae": "_4over6_mae"}
_MIN_BB = 8  # the fewest blocks (or slab columns) of the contiguous axis that a divisor tile takes
_TF_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Elements per program of each kernel (powers of two) and Triton warps per program.

  A program of ``quantize`` takes ``quantize_elements`` elements of ``x`` (at most: fewer where an
  axis is shorter), one of ``amax`` takes ``amax_elements``.
  """

  quantize_elements: int = 4096
  amax_elements: int = 16384
  num_warps: int = 4
  amax_num_warps: int = 8

  def __post_init__(self):
    check_powers_of_two(self, lambda name: 1 if "warps" in name else BLOCK)


# ----------------------------------------------------------------------------------------------
# References


def hadamard_signs(key) -> jax.Array:
  """The ±1 float32 sign vector ``s`` of ``nvfp4.hadamard_matrix(key) = diag(s)·H16/4``."""
  return nvfp4.hadamard_matrix(key)[:, 0] * 4.0


def amax_bits(x, *, hadamard_key=None, axis=-1) -> jax.Array:
  """``max|x|`` (of ``nvfp4.hadamard(x)`` in float32 with ``hadamard_key``) as a float32 bit pattern
  (int32), in one XLA reduction: the value the kernels' first pass computes (NaN and inf patterns
  lie above every finite one, so a non-finite element wins)."""
  x = jnp.asarray(x)
  if hadamard_key is not None:
    x = nvfp4.hadamard(x.astype(jnp.float32), hadamard_key, axis)
  return jnp.max(abs_bits(x.astype(jnp.float32)))


def quantize_reference(x, *, block=(1, BLOCK), axis=-1, rounding="nearest", key=None,
                       bit_source="random", hadamard_key=None, decoded=False, scale_rule="max"):
  """``quantize`` in plain jnp: ``nvfp4.quantize`` of ``x`` (or of ``nvfp4.hadamard`` of ``x`` in float32)
  with ``stochastic_bits(key, x.shape, bit_source)``. Arguments and results as ``quantize``."""
  x = jnp.asarray(x)
  if hadamard_key is not None:
    x = nvfp4.hadamard(x.astype(jnp.float32), hadamard_key, axis)
  bits = None
  if rounding == "stochastic" and key is not None:
    bits = stochastic_bits(key, x.shape, bit_source)
  t = nvfp4.quantize(x, block=block, axis=axis, rounding=rounding, bits=bits, scale_rule=scale_rule)
  return (t, t.scaled_elements(jnp.bfloat16)) if decoded else t


# ----------------------------------------------------------------------------------------------
# Pieces of the kernels


def _tensor_scales(i_ref, interpret):
  """``(S_enc / 6, S_dec, finite)`` of the tensor as (1, 1) arrays (``_tensor_encode``, bound 448)."""
  s_enc, s_dec, finite = _tensor_encode(i_ref, interpret, numerics.E4M3_MAX)
  return s_enc * jnp.float32(numerics.INV6), s_dec, finite


def _tensor_encode(i_ref, interpret, e4m3_max):
  """``(S_enc, S_dec, finite)`` of the tensor as (1, 1) arrays, from the bit pattern of its
  ``max|x|`` (``i_ref[0]``), as ``nvfp4.quantize`` forms them (``nvfp4.global_decode_scale`` with
  ``e4m3_max``): PTX ``div.rn.f32`` on the GPU, the CPU's division in interpret mode."""
  div = lambda a, b: div_rn(a, b, division(interpret))
  bits = jnp.full((1, 1), i_ref[0], jnp.int32)
  bits = jnp.where(bits < F32_NORMAL_MIN_BITS, 0, bits)  # subnormals flushed, as every element
  finite = bits < F32_INF_BITS  # NaN and inf patterns lie above every finite one
  amax = float_of(jnp.where(finite, bits, 0))
  s_enc = jnp.minimum(div(jnp.float32(e4m3_max * numerics.E2M1_MAX), amax), numerics.F32_MAX)
  s_enc = jnp.where((amax == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)
  s_dec = jnp.where(finite, div(jnp.float32(1.0), s_enc), jnp.float32(jnp.nan))
  return s_enc, s_dec, finite


def _rotl(x, r):
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _threefry_bits(idx, k1, k2):
  """``jax.random.bits(key, shape, uint32)`` at flat indices ``idx`` (uint32) of a threefry2x32 key
  with words ``(k1, k2)``: ``x0 ^ x1`` of Threefry-2x32 (20 rounds) on the counter ``(0, idx)``."""
  ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
  x0 = jnp.zeros_like(idx) + ks[0]
  x1 = idx + ks[1]
  for i in range(5):
    for r in _TF_ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
  return x0 ^ x1


def _iota_index(shape, starts, strides):
  """uint32 flat indices of a tile: ``sum_d (starts[d] + iota_d) * strides[d]`` (strides in elements)."""
  idx = None
  for d, (start, stride) in enumerate(zip(starts, strides)):
    if shape[d] == 1 and isinstance(start, int) and start == 0:
      continue
    term = lax.broadcasted_iota(jnp.uint32, shape, d)
    if not (isinstance(start, int) and start == 0):
      term = term + jnp.asarray(start).astype(jnp.uint32)
    term = term * jnp.uint32(stride)
    idx = term if idx is None else idx + term
  return jnp.zeros(shape, jnp.uint32) if idx is None else idx


def _block_scales(block_amax, consts, interpret):
  """``nvfp4.quantize``'s per-block step, given the tensor's ``(S_enc / 6, S_dec, finite)``:
  ``(dscale, its E4M3 byte, escale = 1 / (dscale * S_dec), zero_block)``."""
  mconst, s_dec, finite = consts
  block_amax = jnp.where(finite, block_amax, 0.0)
  dscale, dcode = e4m3_block_scales(block_amax, mconst)
  # dscale is the value of its E4M3 byte (round_to_e4m3), so no decode of dcode is needed.
  escale = jnp.minimum(div_rn(1.0, dscale * s_dec, division(interpret)), numerics.F32_MAX)
  zero_block = (dscale == 0) | ~finite
  return dscale, dcode.astype(jnp.uint8), escale, zero_block


# ----------------------------------------------------------------------------------------------
# Kernels: (1, 16) along the last axis and (16, 16), as (A, S, B, 8, 2) views ("pairs")


def _pair_ok(shape, pid_a, pid_b, n_a, n_b):
  """Mask of a (BA, S, BB, ...) tile inside the (A, S, B, ...) view, or None when it is inside."""
  ok = None
  if n_a % shape[0]:
    ok = pid_a * shape[0] + lax.broadcasted_iota(jnp.int32, shape, 0) < n_a
  if n_b % shape[2]:
    ok_b = pid_b * shape[2] + lax.broadcasted_iota(jnp.int32, shape, 2) < n_b
    ok = ok_b if ok is None else ok & ok_b
  return ok


def _flat_amax_kernel(x_ref, o_ref, *, n_rows):
  """max|x| of a (rows, W) tile of the flattened tensor, as a float32 bit pattern."""
  br = x_ref.shape[0]
  ok = None
  if n_rows % br:
    ok = pl.program_id(0) * br + lax.broadcasted_iota(jnp.int32, x_ref.shape, 0) < n_rows
  o_ref[...] = jnp.full((1, 1), max_all(abs_bits(load(x_ref, ok).astype(jnp.float32))), jnp.int32)


def _pair_quantize_kernel(i_ref, x_ref, codes_ref, scales_ref, g_ref, *dec_ref, n_a, n_b, rounding,
                          bit_source, interpret, scale_rule="max"):
  ba, s, bb = x_ref.shape[:3]
  pid_a, pid_b = pl.program_id(0), pl.program_id(1)
  # Each byte's two elements (the low and the high nibble) as two (BA, S, BB, 8) halves, split in
  # registers right after the load: every later step is elementwise on the halves.
  x = load(x_ref, _pair_ok(x_ref.shape, pid_a, pid_b, n_a, n_b))
  lo, hi = jnp.unstack(x.reshape(ba, s, bb, BLOCK // 2, 2), axis=-1)
  lo, hi = (numerics.flush_subnormals(v.astype(jnp.float32)) for v in (lo, hi))
  # Block amax over each block's 16 elements (axis 3 of both halves) and, for 16x16 tiles, its 16
  # rows (axis 1).
  block_amax = jnp.max(jnp.max(jnp.maximum(jnp.abs(lo), jnp.abs(hi)), axis=3), axis=1)  # (BA, BB)
  bc = lambda v: v[:, None, :, None]
  if scale_rule != "max":
    dscale, dcode, zero_block, (code_lo, code_hi) = _pair_four_over_six(
        i_ref, g_ref, lo, hi, block_amax, scale_rule, interpret)
  else:
    consts = _tensor_scales(i_ref, interpret)
    _store_global_scale(g_ref, consts[1], pid_a, pid_b)
    dscale, dcode, escale, zero_block = _block_scales(block_amax, consts, interpret)
    bits = (None, None)
    if rounding == "stochastic":
      # Flat index of each low element: ((a * S + s) * B + b) * 16 + 2 * i.
      idx = _iota_index(lo.shape, (pid_a * ba, 0, pid_b * bb, 0),
                        (s * n_b * BLOCK, n_b * BLOCK, BLOCK, 2))
      bits = _pair_bits(idx, i_ref, bit_source)
    code_lo, code_hi = (e2m1_codes(v, bc(escale), rounding, b) for v, b in zip((lo, hi), bits))
  zero = bc(zero_block)
  packed = jnp.where(zero, 0, code_lo | (code_hi << 4))
  store(codes_ref, packed.astype(jnp.uint8).reshape(codes_ref.shape),
         _pair_ok(codes_ref.shape, pid_a, pid_b, n_a, n_b))
  store(scales_ref, dcode[:, None, :], _pair_ok((ba, 1, bb), pid_a, pid_b, n_a, n_b))
  if dec_ref:
    dec = [(numerics.decode_e2m1(jnp.where(zero, 0, c)) * bc(dscale)).astype(dec_ref[0].dtype)
           for c in (code_lo, code_hi)]
    dec = jnp.stack(dec, axis=-1).reshape(x.shape)
    store(dec_ref[0], dec, _pair_ok(x.shape, pid_a, pid_b, n_a, n_b))


def _four_over_six(i_ref, g_ref, block_amax, codes_and_terms, pick_shape, scale_rule, interpret):
  """4/6 for a tile (``nvfp4.quantize``'s order): the tensor's scales under the bound 256 (``S_dec``
  stored), both candidates' scales, and ``codes_and_terms(escale, dscale, scaled_x, mul)`` of each
  giving its codes and its per-block error sums; returns the kept candidate's ``(dscale, dcode,
  zero_block, codes)``, amax to 4 where its error is strictly lower. ``pick_shape`` broadcasts a
  per-block choice against the codes."""
  s_enc, s_dec, finite = _tensor_encode(i_ref, interpret, nvfp4.E4M3_MAX_4OVER6)
  _store_global_scale(g_ref, s_dec, pl.program_id(0), pl.program_id(1))
  mul = rounded_mul(interpret)
  cands = []
  for dscale, dcode, escale, zero_block in four_over_six_scales(block_amax, s_enc, s_dec, finite, interpret):
    codes, err = codes_and_terms(escale, dscale, s_enc, mul)
    cands.append((dscale, dcode, zero_block, codes, err))
  (d4, b4, z4, c4, e4), (d6, b6, z6, c6, e6) = cands
  map4 = e4 < e6
  pick = pick_shape(map4)
  return (jnp.where(map4, d4, d6), jnp.where(map4, b4, b6), jnp.where(map4, z4, z6),
          tuple(jnp.where(pick, a, b) for a, b in zip(c4, c6)))


def _in_order(terms):
  """Float32 sum of a list of arrays, first to last."""
  return functools.reduce(lambda a, b: a + b, terms)


def _pair_four_over_six(i_ref, g_ref, lo, hi, block_amax, scale_rule, interpret):
  """4/6 on the (BA, S, BB, 8) halves of the pair kernels (S = 1: 1×16 blocks, 16: 16×16 tiles):
  ``(dscale, dcode, zero_block, (code_lo, code_hi))``. A block's error terms are summed in element
  order (element 2i is ``lo[..., i]``, 2i + 1 is ``hi[..., i]``), then a tile's 16 row sums pairwise
  (rows r and r + 8, then r + 4, r + 2, r + 1)."""
  bc = lambda v: v[:, None, :, None]
  ftz = numerics.flush_subnormals

  def codes_and_terms(escale, dscale, s_enc, mul):
    codes = tuple(e2m1_codes(v, bc(escale), "nearest", None) for v in (lo, hi))
    s_enc = s_enc.reshape(1, 1, 1, 1)
    t_lo, t_hi = (_unstack_last(four_over_six_terms(c, bc(dscale), ftz(mul(v, s_enc)), scale_rule, mul))
                  for c, v in zip(codes, (lo, hi)))
    err = _in_order([t for pair in zip(t_lo, t_hi) for t in pair])  # (BA, S, BB)
    while err.shape[1] > 1:
      a, b = jnp.split(err, 2, axis=1)
      err = a + b
    return codes, err.reshape(err.shape[0], err.shape[2])

  return _four_over_six(i_ref, g_ref, block_amax, codes_and_terms, bc, scale_rule, interpret)


def _store_global_scale(g_ref, s_dec, pid_a, pid_b):
  """``S_dec`` into ``g_ref``, from the first program only (one store instead of one per program to
  the same address)."""
  @pl.when((pid_a == 0) & (pid_b == 0))
  def _():
    g_ref[...] = s_dec.reshape(1)


def _pair_bits(idx, i_ref, bit_source):
  """The uint32 rounding bits of the elements at flat indices ``idx`` (even) and ``idx + 1``; with the
  counter hash, one hash of the pair ``idx >> 1`` serves both (``numerics.counter_bits``, whose 64-bit
  pair index has the high word 0 below the kernels' 2^31 elements: ``counter_hash`` of the low word)."""
  if bit_source != "counter":
    return _element_bits(idx, i_ref, bit_source), _element_bits(idx + jnp.uint32(1), i_ref, bit_source)
  k1, k2 = ref_words(i_ref, 1)
  h = numerics.counter_hash(idx >> 1, k1, k2)
  return numerics.lane_bits(h, 0), numerics.lane_bits(h, 1)


def _element_bits(idx, i_ref, bit_source):
  """The uint32 rounding bits of the elements at flat indices ``idx`` (``stochastic_bits``)."""
  k1, k2 = ref_words(i_ref, 1)
  if bit_source == "counter":
    return numerics.lane_bits(numerics.counter_hash(idx >> 1, k1, k2), idx & 1)
  return _threefry_bits(idx, k1, k2)


# ----------------------------------------------------------------------------------------------
# Kernels: 16 slabs, (A, 16, B) ("mid", blocks along a non-last axis) or (A, B, 16) ("last")


def _slab_ref(ref, i, mid):
  i = jnp.int32(i)
  return ref.at[:, i, :] if mid else ref.at[:, :, i]


def _slab_ok(shape, pid_a, pid_b, n_a, n_b):
  ok = None
  if n_a % shape[0]:
    ok = pid_a * shape[0] + lax.broadcasted_iota(jnp.int32, shape, 0) < n_a
  if n_b % shape[1]:
    ok_b = pid_b * shape[1] + lax.broadcasted_iota(jnp.int32, shape, 1) < n_b
    ok = ok_b if ok is None else ok & ok_b
  return ok


def _slabs(x_ref, s_ref, ok, mid, hadamard_on):
  """The 16 elements of each block of the tile as 16 float32 (BA, BB) slabs (Hadamard-transformed
  when ``hadamard_on``), subnormals flushed."""
  xs = [numerics.flush_subnormals(load(_slab_ref(x_ref, i, mid), ok).astype(jnp.float32))
        for i in range(BLOCK)]
  if hadamard_on:
    xs = numerics.hadamard16_butterfly([x * s_ref[i] for i, x in enumerate(xs)])  # nvfp4.hadamard's order
    xs = [numerics.flush_subnormals(x * jnp.float32(0.25)) for x in xs]
  return xs


def _stack_last(vs):
  """``jnp.stack(vs, axis=-1)`` for a power-of-two number of arrays, from two-operand stacks (Triton
  joins two tensors at a time): the evens and the odds stacked, each in the same way."""
  if len(vs) == 1:
    return vs[0][..., None]
  if len(vs) == 2:
    return jnp.stack(vs, axis=-1)
  even, odd = _stack_last(vs[0::2]), _stack_last(vs[1::2])
  return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], len(vs))


def _unstack_last(v):
  """The arrays ``v[..., i]`` of a power-of-two last axis (at least 2), from two-way splits (the
  inverse of ``_stack_last``): the evens and the odds split, each in the same way."""
  n = v.shape[-1]
  if n == 2:
    return list(jnp.unstack(v, axis=-1))
  even, odd = jnp.unstack(v.reshape(*v.shape[:-1], n // 2, 2), axis=-1)
  out = [None] * n
  out[0::2], out[1::2] = _unstack_last(even), _unstack_last(odd)
  return out


def _slab_tile(x_ref, mid):
  shape = x_ref.shape
  return (shape[0], shape[2]) if mid else (shape[0], shape[1])


def _slab_amax_kernel(s_ref, x_ref, o_ref, *, n_a, n_b, mid, hadamard_on):
  tile = _slab_tile(x_ref, mid)
  ok = _slab_ok(tile, pl.program_id(0), pl.program_id(1), n_a, n_b)
  xs = _slabs(x_ref, s_ref, ok, mid, hadamard_on)
  m = functools.reduce(jnp.maximum, [abs_bits(x) for x in xs])
  o_ref[...] = jnp.full((1, 1), max_all(m), jnp.int32)


def _slab_four_over_six(i_ref, g_ref, xs, block_amax, scale_rule, interpret):
  """4/6 on the 16 (BA, BB) slabs of the slab kernels (slab i: element i of each block), stacked into
  one (BA, BB, 16) array for the codes: ``(dscale, dcode, zero_block, (codes,))``, a block's error
  terms summed in element order."""
  x = _stack_last(xs)
  ftz = numerics.flush_subnormals

  def codes_and_terms(escale, dscale, s_enc, mul):
    codes = e2m1_codes(x, escale[..., None], "nearest", None)
    terms = four_over_six_terms(codes, dscale[..., None], ftz(mul(x, s_enc[..., None])), scale_rule, mul)
    return (codes,), _in_order(_unstack_last(terms))

  return _four_over_six(i_ref, g_ref, block_amax, codes_and_terms, lambda m: m[..., None], scale_rule,
                        interpret)


def _slab_quantize_kernel(i_ref, s_ref, x_ref, codes_ref, scales_ref, g_ref, *dec_ref, n_a, n_b, mid,
                          hadamard_on, rounding, bit_source, interpret, scale_rule="max"):
  tile = _slab_tile(x_ref, mid)
  pid_a, pid_b = pl.program_id(0), pl.program_id(1)
  ok = _slab_ok(tile, pid_a, pid_b, n_a, n_b)
  xs = _slabs(x_ref, s_ref, ok, mid, hadamard_on)
  block_amax = functools.reduce(jnp.maximum, [jnp.abs(x) for x in xs])
  if scale_rule != "max":
    dscale, dcode, zero_block, (codes,) = _slab_four_over_six(i_ref, g_ref, xs, block_amax, scale_rule,
                                                              interpret)
  else:
    consts = _tensor_scales(i_ref, interpret)
    _store_global_scale(g_ref, consts[1], pid_a, pid_b)
    dscale, dcode, escale, zero_block = _block_scales(block_amax, consts, interpret)
    # The 16 slabs stacked into one (BA, BB, 16) array, element i of each block at index i of the
    # last axis: the rounding bits, codes, packing and decoded operand are then one array operation
    # each instead of one per slab (one threefry over the tile, a smaller IR for Triton to compile).
    x = _stack_last(xs)
    bits = None
    if rounding == "stochastic":
      starts = (pid_a * tile[0], pid_b * tile[1], 0)
      if mid:  # element i of a block at (a * 16 + i) * B + b
        bits = _element_bits(_iota_index((*tile, BLOCK), starts, (BLOCK * n_b, 1, n_b)), i_ref,
                             bit_source)
      elif bit_source == "counter":  # at (a * B + b) * 16 + i: one counter hash per pair 2p, 2p + 1
        idx = _iota_index((*tile, BLOCK // 2), starts, (BLOCK * n_b, BLOCK, 2))
        bits = jnp.stack(_pair_bits(idx, i_ref, bit_source), axis=-1).reshape(x.shape)
      else:
        bits = _element_bits(_iota_index((*tile, BLOCK), starts, (BLOCK * n_b, BLOCK, 1)), i_ref,
                             bit_source)
    codes = e2m1_codes(x, escale[..., None], rounding, bits)
  zero = zero_block[..., None]
  lo, hi = jnp.unstack(codes.reshape(*tile, BLOCK // 2, 2), axis=-1)
  packed = jnp.where(zero, 0, lo | (hi << 4)).astype(jnp.uint8)  # (BA, BB, 8): a block's bytes
  ok3 = None if ok is None else ok[:, :, None]
  if mid:  # byte p of each block is slab p of the codes
    for p, v in enumerate(_unstack_last(packed)):
      store(_slab_ref(codes_ref, p, mid), v, ok)
  else:  # a block's 8 bytes are contiguous: one (BA, BB, 8) store
    store(codes_ref, packed, ok3)
  store(scales_ref, dcode, ok)
  if dec_ref:
    dec = (numerics.decode_e2m1(jnp.where(zero, 0, codes)) * dscale[..., None]).astype(dec_ref[0].dtype)
    if mid:
      for i, v in enumerate(_unstack_last(dec)):
        store(_slab_ref(dec_ref[0], i, mid), v, ok)
    else:  # a block's 16 elements are contiguous: one (BA, BB, 16) store
      store(dec_ref[0], dec, ok3)


# ----------------------------------------------------------------------------------------------
# Driver


@dataclasses.dataclass(frozen=True)
class _Layout:
  kind: str  # "pairs" or "slabs"
  view: tuple[int, ...]  # x as this shape
  tile: tuple[int, ...]  # a program's block of the view
  codes_view: tuple[int, ...]
  codes_tile: tuple[int, ...]
  mid: bool = False  # slabs: the 16-axis is axis 1 (else the last)

  @property
  def n_a(self):
    return self.view[0]

  @property
  def n_b(self):
    return self.view[2] if self.kind == "pairs" or self.mid else self.view[1]


def _tile_ab(n_a, n_b, per_block, elements):
  """Power-of-two (BA, BB) for an (n_a, n_b) grid of blocks of ``per_block`` elements: BB covers
  up to 64 blocks (or 256 slab columns) of the contiguous axis, BA the rest of ``elements``.

  Where that BB does not divide ``n_b``, BB is the largest power of two that does, if at least
  ``_MIN_BB``: 48 blocks (K = 768) are 3 tiles of 16 rather than one of 64 with 16 of them masked
  (a quarter of each program's lanes would compute nothing).
  """
  bb = min(pl.next_power_of_2(n_b), max(1, elements // per_block), 64 if per_block > 1 else 256)
  if n_b % bb and (n_b & -n_b) >= _MIN_BB:
    bb = n_b & -n_b
  ba = min(pl.next_power_of_2(n_a), max(1, elements // (per_block * bb)))
  return ba, bb


def _layout(shape, block, axis, hadamard_on, elements) -> _Layout:
  ndim = len(shape)
  if block == (BLOCK, BLOCK):
    *lead, m, n = shape
    a, b = math.prod(lead) * m // BLOCK, n // BLOCK
    ba, bb = _tile_ab(a, b, BLOCK * BLOCK, elements)
    return _Layout("pairs", (a, BLOCK, b, BLOCK), (ba, BLOCK, bb, BLOCK), (a, BLOCK, b, 2, 4),
                   (ba, BLOCK, bb, 2, 4))
  if axis == ndim - 1:
    a, b = math.prod(shape[:-1]), shape[-1] // BLOCK
    if not hadamard_on:
      ba, bb = _tile_ab(a, b, BLOCK, elements)
      # Codes as (.., 2, 4), a block's 8 bytes in two halves of 4: Triton gives each thread 8 of a
      # block's 16 bfloat16 elements, so each thread's 4 code bytes are stored as they lie in its
      # registers (a last axis of 8 takes a layout conversion through shared memory first).
      return _Layout("pairs", (a, 1, b, BLOCK), (ba, 1, bb, BLOCK), (a, 1, b, 2, 4), (ba, 1, bb, 2, 4))
    ba, bb = _tile_ab(a, b, BLOCK, elements)
    return _Layout("slabs", (a, b, BLOCK), (ba, bb, BLOCK), (a, b, 8), (ba, bb, 8))
  a = math.prod(shape[:axis + 1]) // BLOCK
  b = math.prod(shape[axis + 1:])
  ba, bb = _tile_ab(a, b, 1, max(1, elements // BLOCK))
  return _Layout("slabs", (a, BLOCK, b), (ba, BLOCK, bb), (a, 8, b), (ba, 8, bb), mid=True)


def _specs(lay: _Layout):
  """Block specs of x, codes, scales (and the decoded output, x's)."""
  if lay.kind == "pairs":
    x = pl.BlockSpec(lay.tile, lambda i, j: (i, 0, j, 0))
    codes = pl.BlockSpec(lay.codes_tile, lambda i, j: (i, 0, j, 0, 0))
    scales = pl.BlockSpec((lay.tile[0], 1, lay.tile[2]), lambda i, j: (i, 0, j))
    return x, codes, scales
  if lay.mid:
    x = pl.BlockSpec(lay.tile, lambda i, j: (i, 0, j))
    codes = pl.BlockSpec(lay.codes_tile, lambda i, j: (i, 0, j))
    scales = pl.BlockSpec((lay.tile[0], lay.tile[2]), lambda i, j: (i, j))
  else:
    x = pl.BlockSpec(lay.tile, lambda i, j: (i, j, 0))
    codes = pl.BlockSpec(lay.codes_tile, lambda i, j: (i, j, 0))
    scales = pl.BlockSpec((lay.tile[0], lay.tile[1]), lambda i, j: (i, j))
  return x, codes, scales


def _grid(lay: _Layout):
  tb = lay.tile[2] if lay.kind == "pairs" or lay.mid else lay.tile[1]
  return pl.cdiv(lay.n_a, lay.tile[0]), pl.cdiv(lay.n_b, tb)


def _scales_shape(lay: _Layout):
  return (lay.n_a, 1, lay.n_b) if lay.kind == "pairs" else (lay.n_a, lay.n_b)


def _amax_layout(lay: _Layout, elements: int) -> _Layout:
  """The Hadamard layouts' view with larger tiles for the amax pass."""
  if lay.mid:
    ba, bb = _tile_ab(lay.n_a, lay.n_b, 1, max(1, elements // BLOCK))
    return dataclasses.replace(lay, tile=(ba, BLOCK, bb))
  ba, bb = _tile_ab(lay.n_a, lay.n_b, BLOCK, elements)
  return dataclasses.replace(lay, tile=(ba, bb, BLOCK))


def _flat_view(size, elements):
  """(rows, W) view of a flattened tensor of ``size`` (a multiple of 16) elements, W <= 1024 a power
  of two dividing it, and the rows of a tile of about ``elements``."""
  w = BLOCK
  while w < 1024 and size % (2 * w) == 0:
    w *= 2
  rows = size // w
  return (rows, w), (min(pl.next_power_of_2(rows), max(1, elements // w)), w)


def _check(x, block, axis, rounding, key, bit_source, hadamard_key, scale_rule):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize needs a floating-point array, got dtype {x.dtype}")
  block, axis = nvfp4.block_layout(tuple(x.shape), block, axis)
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
  nvfp4.check_scale_rule(scale_rule, rounding)
  if bit_source not in BIT_SOURCES:
    raise ValueError(f"bit_source must be one of {BIT_SOURCES}, got {bit_source!r}")
  if rounding == "stochastic":
    if key is None:
      raise ValueError("rounding='stochastic' needs a `key` (a jax.random key)")
    if bit_source == "random" and not threefry_key(key):
      raise ValueError(
          "bit_source='random' reproduces jax.random.bits of threefry2x32 keys with "
          "jax_threefry_partitionable (JAX's defaults); got a key of "
          f"{jax.random.key_impl(key)}: use bit_source='counter', or fp4jax.nvfp4.quantize")
  if hadamard_key is not None and block != (1, BLOCK):
    raise ValueError("hadamard_key: the Hadamard transform runs along the blocked axis of block=(1, 16)")
  if x.size >= 2**31:
    raise ValueError(f"quantize: {x.size} elements; the kernels address at most 2**31 - 1")
  return block, axis


def threefry_key(key) -> bool:
  """Whether the kernels reproduce ``jax.random.bits(key, ...)`` (``bit_source="random"``): a
  threefry2x32 key with ``jax_threefry_partitionable`` on (JAX's defaults)."""
  return str(jax.random.key_impl(key)) == "threefry2x32" and jax.config.jax_threefry_partitionable


def quantize(x, *, block=(1, BLOCK), axis=-1, rounding="nearest", key=None, bit_source="random",
             hadamard_key=None, decoded=False, block_sizes: BlockSizes | None = None,
             amax: str = "kernel", scale_rule: str = "max", interpret=False):
  """Quantizes ``x`` to NVFP4 in two Pallas kernels: ``nvfp4.quantize``'s tensor, bit for bit.

  ``quantize(x, block=b, axis=a, rounding=r, key=k, scale_rule=s)`` equals ``nvfp4.quantize(x,
  block=b, axis=a, rounding=r, key=k, scale_rule=s)``; with ``bit_source="counter"`` it equals ``nvfp4.quantize(x, ...,
  bits=numerics.counter_bits(k, x.shape))``, and with ``hadamard_key=h`` it quantizes
  ``nvfp4.hadamard`` of ``x`` in float32 instead of ``x`` (``quantize_reference`` spells this out).

  Not differentiable (its codes are integers): ``x`` is taken under ``stop_gradient``, which gives
  ``nvfp4.quantize``'s zero derivative.

  Args:
    x: float32, bfloat16 or float16 array, fewer than 2**31 elements.
    block: ``(1, 16)`` (16 consecutive elements along ``axis``) or ``(16, 16)`` (tiles of the last
      two axes), as ``nvfp4.quantize``.
    axis: the blocked axis of ``(1, 16)``, any axis.
    rounding: ``"nearest"`` or ``"stochastic"``.
    key: the ``jax.random`` key of stochastic rounding.
    bit_source: ``"random"``: ``jax.random.bits(key, x.shape, uint32)``, computed in the kernel
      (threefry2x32 keys, JAX's default); ``"counter"``: ``numerics.counter_bits(key, x.shape)``,
      one hash per pair of elements (fewer instructions).
    hadamard_key: if given, quantize ``hadamard(x, hadamard_key, axis)`` (``block=(1, 16)`` only):
      the random Hadamard transform along the blocked axis, fused into both kernels.
    decoded: also return the decoded operand ``elements × block scales`` (``NVFP4Tensor.
      scaled_elements(bfloat16)``: exact; the global scale is not applied).
    block_sizes: kernel tiling (``BlockSizes``; None: ``BlockSizes()``).
    amax: the first pass, ``max|x|`` (of ``hadamard(x)`` with ``hadamard_key``) as a float32 bit
      pattern: ``"kernel"`` (a Pallas kernel) or ``"xla"`` (``amax_bits``: a reduction that XLA
      fuses and compiles with its own emitters, one Triton kernel fewer per operand; docs/DESIGN.md,
      "Kernels"). The same value either way (a max is exact).
    scale_rule: ``nvfp4.quantize``'s (static): ``"max"``, ``"4over6_mse"`` or ``"4over6_mae"`` (Four
      over Six, round-to-nearest only; its own kernel, named ``nvfp4_quantize_*_4over6_*``: both
      candidates' codes and block errors in registers, the error terms summed in ``nvfp4.quantize``'s
      order, products by PTX ``mul.rn.f32`` so that none fuses into an addition).
    interpret: run the kernels in Pallas interpret mode (CPU).

  Returns:
    An ``NVFP4Tensor`` (dtype ``x.dtype``, or float32 with the Hadamard transform); with
    ``decoded=True``, ``(tensor, decoded)``, ``decoded`` bfloat16 shaped like ``x``.

  Raises:
    ValueError: what ``nvfp4.quantize`` rejects; ``hadamard_key`` with ``block=(16, 16)``;
      ``bit_source="random"`` with a key that is not threefry2x32; 2**31 elements or more; a
      ``block_sizes`` that is not a ``BlockSizes``.
  """
  x = lax.stop_gradient(jnp.asarray(x))
  if block_sizes is None:
    block_sizes = BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be an nvfp4_quantize.BlockSizes or None, got "
                     f"{type(block_sizes).__name__}")
  block, axis = _check(x, block, axis, rounding, key, bit_source, hadamard_key, scale_rule)
  if amax not in AMAX_PASSES:
    raise ValueError(f"amax must be one of {AMAX_PASSES}, got {amax!r}")
  hadamard_on = hadamard_key is not None
  if x.size == 0:
    return quantize_reference(x, block=block, axis=axis, rounding=rounding, key=key,
                              bit_source=bit_source, hadamard_key=hadamard_key, decoded=decoded,
                              scale_rule=scale_rule)
  lay = _layout(x.shape, block, axis, hadamard_on, block_sizes.quantize_elements)
  xv = x.reshape(lay.view)
  signs = hadamard_signs(hadamard_key) if hadamard_on else jnp.ones((BLOCK,), jnp.float32)
  params = dict(compiler_params=plgpu.CompilerParams(num_warps=block_sizes.amax_num_warps),
                interpret=interpret)

  # Pass 1: max|x| per program, as float32 bit patterns (NaN and inf above every finite value); over
  # the flattened tensor, or through the Hadamard transform in the quantizer's layout.
  o_spec = pl.BlockSpec((1, 1), lambda i, j: (i, j))
  if amax == "xla":
    partial = amax_bits(x, hadamard_key=hadamard_key, axis=axis)
  elif not hadamard_on:
    view, tile = _flat_view(x.size, block_sizes.amax_elements)
    grid = (pl.cdiv(view[0], tile[0]), 1)
    partial = pl.pallas_call(
        functools.partial(_flat_amax_kernel, n_rows=view[0]), out_shape=jax.ShapeDtypeStruct(grid, jnp.int32),
        grid=grid, in_specs=[pl.BlockSpec(tile, lambda i, j: (i, 0))], out_specs=o_spec,
        name="nvfp4_amax", **params)(x.reshape(view))
  else:
    alay = _amax_layout(lay, block_sizes.amax_elements)
    grid = _grid(alay)
    whole = pl.BlockSpec((BLOCK,), lambda i, j: (0,))
    partial = pl.pallas_call(
        functools.partial(_slab_amax_kernel, n_a=alay.n_a, n_b=alay.n_b, mid=alay.mid,
                          hadamard_on=hadamard_on),
        out_shape=jax.ShapeDtypeStruct(grid, jnp.int32), grid=grid,
        in_specs=[whole, _specs(alay)[0]], out_specs=o_spec, name="nvfp4_amax", **params)(signs, xv)

  # The tensor's max|x| (its bit pattern) and the key's two words, for the second pass.
  words = key_words(key, bit_source) if rounding == "stochastic" else jnp.zeros((2,), jnp.int32)
  ints = jnp.concatenate([jnp.max(partial)[None], words, jnp.zeros((5,), jnp.int32)])

  # Pass 2: codes, scale bytes, and the decoded operand.
  x_spec, c_spec, s_spec = _specs(lay)
  grid = _grid(lay)
  out_shape = [jax.ShapeDtypeStruct(lay.codes_view, jnp.uint8),
               jax.ShapeDtypeStruct(_scales_shape(lay), jnp.uint8),
               jax.ShapeDtypeStruct((1,), jnp.float32)]
  out_specs = [c_spec, s_spec, pl.BlockSpec((1,), lambda i, j: (0,))]
  if decoded:
    out_shape.append(jax.ShapeDtypeStruct(lay.view, jnp.bfloat16))
    out_specs.append(x_spec)
  smem8, smem16 = (pl.BlockSpec((n,), lambda i, j: (0,)) for n in (8, BLOCK))
  common = dict(n_a=lay.n_a, n_b=lay.n_b, rounding=rounding, bit_source=bit_source,
                interpret=interpret, scale_rule=scale_rule)
  params["compiler_params"] = plgpu.CompilerParams(num_warps=block_sizes.num_warps)
  if lay.kind == "pairs":
    kernel = functools.partial(_pair_quantize_kernel, **common)
    in_specs, args = [smem8, x_spec], (ints, xv)
  else:
    kernel = functools.partial(_slab_quantize_kernel, mid=lay.mid, hadamard_on=hadamard_on, **common)
    in_specs, args = [smem8, smem16, x_spec], (ints, signs, xv)
  name = f"nvfp4_quantize_{lay.kind}{_KERNEL_SUFFIX[scale_rule]}"
  outs = pl.pallas_call(kernel, out_shape=tuple(out_shape), grid=grid, in_specs=in_specs,
                        out_specs=tuple(out_specs), name=name, **params)(*args)

  codes_shape = list(x.shape)
  codes_shape[axis] //= 2
  scales_shape = list(x.shape)
  scales_shape[axis] //= BLOCK
  if block == (BLOCK, BLOCK):
    scales_shape[-2] //= BLOCK
  t = nvfp4.NVFP4Tensor(
      codes=outs[0].reshape(codes_shape),
      scales=lax.bitcast_convert_type(outs[1].reshape(scales_shape), jnp.float8_e4m3fn),
      global_scale=outs[2].reshape(()),
      shape=tuple(x.shape),
      block=block,
      axis=axis,
      dtype=jnp.dtype(jnp.float32) if hadamard_on else x.dtype,
  )
  return (t, outs[3].reshape(x.shape)) if decoded else t
