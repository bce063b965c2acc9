"""Flash attention forward and backward for NVFP4 attention: Pallas (Triton) kernels.

The kernels compute the numerics of ``fp4jax.ops.attention`` (its reference defines them) on
operands that the caller has already decoded:

- ``attention_fwd(q, k, v, *, causal, sm_scale) -> (o, lse)``: per (batch, head, query block), a loop
  over key blocks (stopping at the diagonal when causal) with an online softmax in float32:
  ``S = dot(q, kᵀ) * sm_scale`` (bf16 operands, f32 accumulation), ``O = P·V`` with P in bf16,
  ``lse = m + log(l)``.
- ``attention_bwd(q, k, v, o, lse, do, *, causal, sm_scale, ds_rounding, key, dq_accumulation)
  -> (dq, dk, dv)``:
  ``δ = rowsum(dO ∘ O)`` (one XLA pass), then one kernel per key block (dK, dV, looping over the
  query blocks of every query head of its key/value head) that recomputes ``P = exp(S - lse)`` with
  the forward's dot, ``dP = dO·Vᵀ`` and ``dS = (P ∘ (dP - δ)) * sm_scale``. With ``ds_rounding``
  set, dS is quantized to NVFP4 inside the tile and its decoded bf16 values are the operand of
  ``dQ = dS·K`` and ``dK = dSᵀ·Q``; otherwise dS is cast to bf16. ``dV = Pᵀ·dO`` with P in bf16.
  dQ comes one of two ways (``dq_accumulation``): ``"recompute"``, a second kernel per query block
  that forms every dS tile again (the same tiles, so the same quantization) and sums ``dS·K`` over
  the key blocks in registers; or ``"atomic"``, the key-block kernel itself adds each tile's
  ``dS·K`` to a float32 dQ in global memory with atomic adds (FlashAttention-2's scheme): each dS
  tile is formed and quantized once, but the order of dQ's float32 sums varies from run to run.

- ``attention_pv(q, k, v, lse, *, causal, sm_scale, p_rounding, key) -> o``: with an NVFP4 P, the
  output ``deq(Q(P))·V`` from ``P = exp(S - lse)`` once the flash forward has given lse (a second pass
  over the keys); ``attention_bwd(p_rounding=...)`` quantizes the same P tiles for ``dV``.

Layout: q ``[B, T, H, D]``, k and v ``[B, S, Hk, D]`` with ``H % Hk == 0`` (query head ``h`` reads
key/value head ``h // (H // Hk)``; dK and dV sum over a group's query heads), D a multiple of 16 up
to 256 (64 and 128 are the tested ones), lse ``[B, H, T]`` float32. T and S need not be multiples
of the blocks (the arrays are padded, padding keys get P = 0, padding rows dS = 0); causal needs
T == S. q and k are the decoded NVFP4 operands ``nvfp4.dequantize(Q(q), bf16)``; any bf16 (or f16)
arrays work.

dS quantization (its jnp reference is ``fp4jax.ops.attention._fake_quant_ds``): each ``ds_tile`` of
the ``[T, S]`` dS matrix of one (b, h) is
quantized as a tensor of its own by ``nvfp4.quantize(tile, block=(16, 16))`` (Transformer Engine's
order: tile amax, ``S_enc = 2688 / amax``, E4M3 scales of 16×16 blocks, E2M1 codes) and decoded as
``nvfp4.dequantize(·, bf16)`` does (``code * scale * S_dec`` in float32, then bf16). Stochastic
rounding takes its bits from ``ds_rounding_bits`` (a counter hash of (key, b, h, row, col)), so the
kernels and the reference draw the same bits whatever the blocking. Each kernel tile holds whole
ds tiles: the backward's blocks are multiples of ``ds_tile``.

Everything inside the kernels lowers to Triton for sm_90: no float4 casts (E2M1 and E4M3 values
rounded with float32 additions and integer operations on bit patterns, ``_common.e2m1_value`` and
``_common.e4m3_value``), the divisions of the quantizer correctly rounded (PTX ``div.rn.f32`` and,
for reciprocals, ``rcp.rn.f32``; the CPU's division in interpret mode, see ``_common.div_rn``),
power-of-two blocks; see tests/test_kernels_attention.py for the CPU-side CUDA lowering check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax import numerics
from fp4jax.kernels._common import (BLOCK, E2M1_X_E4M3_MAX, F32_SIGN_BITS, ROUNDINGS, abs_bits,
                                    check_positive, check_powers_of_two, div_rn, e2m1_value,
                                    e4m3_value, float_of, int_bits, is_pow2, key_words,
                                    pow2_at_least, recip_rn, ref_words, round_up)

DQ_ACCUMULATIONS = ("recompute", "atomic")
DS_TILE = (64, 64)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Launch settings of the attention kernels (frozen and hashable: a static argument); None takes
  the kernel's default (see each entry point). They change the tiling, not the numerics: the
  results are the same for every setting, but for the float32 summation order of the forward's
  online softmax and of the accumulations over the blocks.

  Attributes:
    block_q: query rows per tile, a power of two.
    block_k: keys per tile, a power of two.
    num_warps: Triton warps per program, a power of two.
    num_stages: Triton pipelining stages, a positive int.
  """

  block_q: int | None = None
  block_k: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    check_powers_of_two(self, lambda name: 1, allow_none=True, exclude=("num_stages",))
    check_positive(self, "num_stages", allow_none=True)


# ----------------------------------------------------------------------------------------------
# dS quantization (shared by the kernels and the jnp path)


def _tile_max(x, rows: int, cols: int):
  """(M, N) -> (M / rows, N / cols): the max of each ``rows x cols`` tile. One axis per reduction
  (Pallas' Triton lowering of a reduction over two axes fails under an abstract mesh)."""
  m, n = x.shape
  return jnp.max(jnp.max(x.reshape(m // rows, rows, n // cols, cols), axis=3), axis=1)


def _expand(s, rows: int, cols: int):
  """Per-tile values (m, n) -> (m * rows, n * cols), each repeated over its tile."""
  m, n = s.shape
  return jnp.broadcast_to(s[:, None, :, None], (m, rows, n, cols)).reshape(m * rows, n * cols)


_F32_TINY = np.float32(2.0**-126)  # the smallest normal float32


def _block_amax(x, rows: int, cols: int):
  """Per ``rows x cols`` block of float32 ``x``: ``max |flush_subnormals(x)|`` with NaN counted as
  +inf, as a max over int32 patterns.

  The patterns of ``|x|`` (sign bit cleared) order like the magnitudes, with every NaN above +inf; the
  flush (below 2^-126 -> 0) and NaN -> +inf are non-decreasing in the pattern, so they are applied to
  each block's max pattern instead of to every element: one AND and one integer max per element, the
  same on every backend (a float max of NaN differs: the GPU's ignores it)."""
  m = _tile_max(abs_bits(x), rows, cols)
  m = jnp.where(m < 0x00800000, 0, jnp.minimum(m, 0x7F800000))
  return float_of(m)


def _fake_quant_blocks(x, block_amax, s_enc, s_dec, block, rounding: str, bits, division: str,
                       valid=None):
  """The encoding steps of ``nvfp4.quantize`` after its amax pass, then ``dequantize(·, bf16)``: E4M3
  scales of the blocks (``block_amax`` per ``block`` of the float32 tile ``x``, from
  ``_block_amax``) against the global ``s_enc`` and ``s_dec`` (per block), E2M1 codes
  (stochastic: uint32 rounding ``bits``, as ``nvfp4.quantize`` takes them), and ``code * scale *
  S_dec`` in float32 cast to bf16. ``valid`` (per block, or None: all): False for the blocks of a
  tensor whose amax is not finite, coded 0 and decoded with their NaN ``s_dec``.

  ``x`` is not flushed: an element below 2^-126 (and a NaN) is coded +0 by the same comparison and
  select that code the zero blocks' elements 0; the others keep their product with the block's
  encode scale. The code
  is never formed: the rounded magnitude comes out as its float32 value (``e2m1_value``) with ``x``'s
  sign bit, which is ``decode_e2m1`` of ``numerics.e2m1_codes``' code."""
  rows, cols = block
  dscale = e4m3_value(jnp.clip(jnp.minimum(block_amax * (s_enc * jnp.float32(numerics.INV6)),
                                            numerics.F32_MAX), 0.0, numerics.E4M3_MAX))
  escale = jnp.minimum(recip_rn(dscale * s_dec, division), numerics.F32_MAX)
  zero_block = dscale == 0 if valid is None else (dscale == 0) | ~valid
  per_elem = functools.partial(_expand, rows=rows, cols=cols)
  ax = jnp.abs(x)
  a = jnp.minimum(ax * per_elem(escale), numerics.E2M1_MAX)  # |x * escale|, as escale > 0
  r = None if bits is None else (bits >> 10).astype(jnp.int32)
  signed = float_of(int_bits(e2m1_value(a, rounding, r)) | (int_bits(x) & F32_SIGN_BITS))
  # One comparison per element drops both the zero blocks and the elements below 2^-126: against
  # NaN (zero blocks) every comparison is false.
  keep = ax >= per_elem(jnp.where(zero_block, jnp.float32(jnp.nan), _F32_TINY))
  decoded = jnp.where(keep, signed, 0.0) * per_elem(dscale) * per_elem(s_dec)
  return decoded.astype(jnp.bfloat16)


def _quantize_tile(ds, bits, ds_tile, rounding: str, division: str):
  """A 2-D float32 dS tile (whole ``ds_tile``s) -> its NVFP4 quantization decoded to bf16.

  ``nvfp4.quantize(t, block=(16, 16), rounding=rounding, bits=bits)`` of each ``ds_tile`` ``t`` then
  ``nvfp4.dequantize(·, bf16)``, step for step (see that function for the order of operations).
  """
  tq, tk = ds_tile
  block_amax = _block_amax(ds, BLOCK, BLOCK)  # (M/16, N/16)
  amax = _tile_max(block_amax, tq // BLOCK, tk // BLOCK)  # per ds tile
  finite = amax <= numerics.F32_MAX
  amax = jnp.where(finite, amax, 0.0)
  s_enc = jnp.minimum(div_rn(E2M1_X_E4M3_MAX, amax, division), numerics.F32_MAX)
  s_enc = jnp.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
  s_dec = jnp.where(finite, recip_rn(s_enc, division), jnp.nan)
  per_block = functools.partial(_expand, rows=tq // BLOCK, cols=tk // BLOCK)
  s_enc_b, s_dec_b, finite_b = per_block(s_enc), per_block(s_dec), per_block(finite)
  return _fake_quant_blocks(ds, jnp.where(finite_b, block_amax, 0.0), s_enc_b, s_dec_b,
                            (BLOCK, BLOCK), rounding, bits, division, finite_b)


# Q(P): 1×16 blocks along the keys and the global scale of amax = 1 (P <= 1), as
# ``fp4jax.ops.attention._probs_operand`` quantizes P: S_enc = 2688 / 1 and S_dec = 1 / 2688, float32
# and correctly rounded.
_P_S_ENC = np.float32(E2M1_X_E4M3_MAX)
_P_S_DEC = np.float32(1.0) / _P_S_ENC


def _quantize_p_tile(p, bits, rounding: str, division: str):
  """A 2-D float32 P tile (keys along the columns, a multiple of 16) -> ``deq(Q(P))`` in bf16: 1×16
  blocks along the keys with the fixed global scale of ``amax = 1``, as ``nvfp4.quantize(·,
  block=(1, 16))`` and ``dequantize(·, bf16)`` of a tensor whose amax is 1. A NaN of P is coded +0."""
  block_amax = _block_amax(p, 1, BLOCK)  # (M, N/16)
  const = lambda v: jnp.full(block_amax.shape, v, jnp.float32)
  return _fake_quant_blocks(p, block_amax, const(_P_S_ENC), const(_P_S_DEC), (1, BLOCK), rounding,
                            bits, division)


def _tile_bits(k1, k2, bh, row0, col0, m: int, n: int):
  """Rounding bits (uint32, (m, n)) of the dS elements in rows ``row0 + [0, m)`` and columns
  ``col0 + [0, n)`` of head ``bh = b * H + h`` (``col0`` and ``n`` multiples of 4): one hash per row
  keyed by (key, b, h), then one hash per 4 consecutive columns whose four bytes round those 4
  elements (``numerics.lane_bits``)."""
  u32 = jnp.uint32
  head = numerics.counter_hash(jnp.asarray(bh).astype(u32), k1, k2)
  rows = jnp.asarray(row0).astype(u32) + lax.broadcasted_iota(u32, (m, 1), 0)
  row_word = numerics.counter_hash(rows, head, k2)
  quads = (jnp.asarray(col0).astype(u32) >> 2) + lax.broadcasted_iota(u32, (1, n // 4), 1)
  h = numerics.counter_hash(quads, row_word, k2)  # (m, n / 4)
  h = jnp.broadcast_to(h[:, :, None], (m, n // 4, 4))
  return numerics.lane_bits(h, lax.broadcasted_iota(u32, (m, n // 4, 4), 2)).reshape(m, n)


def ds_rounding_bits(key, shape) -> jax.Array:
  """uint32 stochastic-rounding bits for dS of ``shape = (B, H, T, S)`` (S a multiple of 4).

  Element (b, h, row, col) gets byte ``col % 4`` of ``counter_hash(col // 4, r, k2)`` with
  ``r = counter_hash(row, counter_hash(b * H + h, k1, k2), k2)`` and ``(k1, k2)`` the key's
  ``counter_words``, placed by ``lane_bits`` for ``nvfp4.quantize``'s ``bits``: the bits depend on
  (key, b, h, row, col) only, so any tiling of dS draws the same ones (the kernels draw them tile
  by tile).
  """
  b_, h_, t, s = shape
  if s % 4:
    raise ValueError(f"ds_rounding_bits: the key axis ({s}) must be a multiple of 4")
  k1, k2 = numerics.counter_words(key)
  bh = jnp.arange(b_ * h_, dtype=jnp.uint32)
  bits = jax.vmap(lambda i: _tile_bits(k1, k2, i, 0, 0, t, s))(bh)
  return bits.reshape(b_, h_, t, s)


def _check_rounding(fn: str, arg: str, rounding, key, key_arg: str):
  """``rounding`` of ``fn``'s argument ``arg`` is one of ``ROUNDINGS``, with a key where it is
  stochastic."""
  if rounding not in ROUNDINGS:
    raise ValueError(f"{fn}: {arg} must be one of {ROUNDINGS}, got {rounding!r}")
  if rounding == "stochastic" and key is None:
    raise ValueError(f"{fn}: {arg}='stochastic' needs a `{key_arg}`")


def _check_ds_tile(ds_tile):
  if (not isinstance(ds_tile, tuple) or len(ds_tile) != 2
      or any(not is_pow2(t) or t < BLOCK for t in ds_tile)):
    raise ValueError(f"ds_tile must be a pair of powers of two >= {BLOCK}, got {ds_tile!r}")


# ----------------------------------------------------------------------------------------------
# Kernels


def _dot(a, b, *, trans_a=False, trans_b=False):
  """``a @ b`` (with either operand transposed) in float32 accumulation."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _scores(q, k, sm_scale):
  """``S = dot(q, kᵀ) * sm_scale``: the one expression of the scores in all three kernels."""
  return _dot(q, k, trans_b=True) * jnp.float32(sm_scale)


def _mask(row0, col0, m: int, n: int, *, causal: bool, n_rows: int | None, n_cols: int | None):
  """Valid (row, col) of an (m, n) tile at (row0, col0): keys < ``n_cols``, rows < ``n_rows``
  (None: no bound needed), col <= row when causal. None when nothing is to be masked."""
  rows = row0 + lax.broadcasted_iota(jnp.int32, (m, n), 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (m, n), 1)
  mask = None
  for cond in ((cols <= rows) if causal else None,
               None if n_cols is None else cols < n_cols,
               None if n_rows is None else rows < n_rows):
    if cond is not None:
      mask = cond if mask is None else mask & cond
  return mask


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, sm_scale, causal, block_k, n_keys,
                pad_keys):
  bq = q_ref.shape[0]
  qi = pl.program_id(2)
  q = q_ref[...]
  row0 = qi * bq

  def body(j, carry, masked):
    m, l, acc = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = _scores(q, k, sm_scale)
    if masked:
      mask = _mask(row0, j * block_k, bq, block_k, causal=causal, n_rows=None,
                   n_cols=n_keys if pad_keys else None)
      if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return m_new, l, acc

  carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros(o_ref.shape, jnp.float32))
  # Key blocks [0, n_full) need no mask; [n_full, n_end) cross the diagonal or the end of the keys.
  # Block 0 always holds a valid key of every row (key 0), so m is finite after it.
  n_blocks = pl.cdiv(n_keys, block_k)
  if causal:
    n_end = jnp.minimum(lax.div(row0 + bq + block_k - 1, block_k), n_blocks)
    n_full = jnp.minimum(lax.div(row0 + 1, block_k), n_keys // block_k)
  else:
    n_end, n_full = n_blocks, n_keys // block_k
  carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
  if causal or pad_keys:
    carry = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), carry)
  m, l, acc = carry
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _probs_tile(q, k, lse, mask, sm_scale):
  """``P = exp(S − lse)`` of one tile, 0 where masked: the one expression of P in the backward and in
  the forward's P·V with a quantized P, so both quantize the same values."""
  p = jnp.exp(_scores(q, k, sm_scale) - lse[:, None])
  return p if mask is None else jnp.where(mask, p, 0.0)


def _p_operand(p, p_quant, dtype, division):
  """P as the operand of P·V and Pᵀ·dO: cast to ``dtype``, or ``deq(Q(P))`` (``p_quant = (words, bh,
  row0, col0, rounding)``, bits from the counter hash of (key, b, h, row, col))."""
  if p_quant is None:
    return p.astype(dtype)
  words, bh, row0, col0, rounding = p_quant
  bits = _tile_bits(words[0], words[1], bh, row0, col0, *p.shape) if rounding == "stochastic" else None
  return _quantize_p_tile(p, bits, rounding, division).astype(dtype)


def _ds_tile(q, k, v, do, lse, delta, mask, *, sm_scale, quant, division, p_quant=None):
  """The P operand (bf16, ``_p_operand``) and the dS operand (bf16) of one (query block, key block)
  tile of the backward."""
  p = _probs_tile(q, k, lse, mask, sm_scale)
  dp = _dot(do, v, trans_b=True)
  ds = (p * (dp - delta[:, None])) * jnp.float32(sm_scale)
  if quant is None:
    ds_op = ds.astype(q.dtype)
  else:
    words, bh, row0, col0, ds_tile, rounding = quant
    bits = None
    if rounding == "stochastic":
      bits = _tile_bits(words[0], words[1], bh, row0, col0, *ds.shape)
    ds_op = _quantize_tile(ds, bits, ds_tile, rounding, division).astype(q.dtype)
  return _p_operand(p, p_quant, do.dtype, division), ds_op


def _dkdv_kernel(w_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *out_refs, sm_scale, causal,
                 block_q, group, n_heads, n_rows, n_keys, pad, ds, division, atomic_dq, p_rounding):
  """dK and dV of one key block; with ``atomic_dq`` also ``dQ += dS·K`` per tile, by atomic adds to
  the float32 dQ (``out_refs = (dq_in, dk, dv, dq)``, dq aliasing dq_in; else ``(dk, dv)``)."""
  dk_ref, dv_ref, dq_ref = (out_refs[1], out_refs[2], out_refs[3]) if atomic_dq else (*out_refs, None)
  bk = k_ref.shape[0]
  b, hk, kj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  col0 = kj * bk
  k, v = k_ref[...], v_ref[...]
  n_blocks = pl.cdiv(n_rows, block_q)
  # Query blocks [i_start, i_full) cross the diagonal; [i_full, n_blocks) see the whole key block.
  i_start = lax.div(col0, block_q) if causal else 0
  i_full = jnp.minimum(lax.div(col0 + bk - 1 + block_q - 1, block_q), n_blocks) if causal else 0

  def body(i, carry, h, masked):
    dk, dv = carry
    rows = pl.ds(i * block_q, block_q)
    q, do = q_ref[rows, h, :], do_ref[rows, h, :]
    lse, delta = lse_ref[h, rows], delta_ref[h, rows]
    mask = None
    if masked:
      mask = _mask(i * block_q, col0, block_q, bk, causal=causal, n_rows=n_rows if pad else None,
                   n_cols=n_keys if pad else None)
    quant = None if ds is None else (ref_words(w_ref), b * n_heads + h, i * block_q, col0, *ds)
    p_quant = None if p_rounding is None else (ref_words(w_ref, 2), b * n_heads + h, i * block_q, col0,
                                               p_rounding)
    p, ds_op = _ds_tile(q, k, v, do, lse, delta, mask, sm_scale=sm_scale, quant=quant,
                        division=division, p_quant=p_quant)
    if dq_ref is not None:
      plgpu.atomic_add(dq_ref, (rows, h, slice(None)), _dot(ds_op, k))
    return dk + _dot(ds_op, q, trans_a=True), dv + _dot(p, do, trans_a=True)

  def head(g, carry):
    h = hk * group + g
    if pad:  # every tile may hold padding: one masked loop
      return lax.fori_loop(i_start, n_blocks, functools.partial(body, h=h, masked=True), carry)
    carry = lax.fori_loop(i_start, i_full, functools.partial(body, h=h, masked=True), carry)
    return lax.fori_loop(i_full, n_blocks, functools.partial(body, h=h, masked=False), carry)

  zeros = jnp.zeros(k_ref.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _key_tile(k_ref, v_ref, j, row0, bq: int, block_k: int, *, masked: bool, causal: bool, pad: bool,
              n_rows: int, n_keys: int):
  """K and V of key block ``j`` and the mask of its tile with the query block at ``row0`` (None
  when ``masked`` is False)."""
  cols = pl.ds(j * block_k, block_k)
  mask = None
  if masked:
    mask = _mask(row0, j * block_k, bq, block_k, causal=causal, n_rows=n_rows if pad else None,
                 n_cols=n_keys if pad else None)
  return k_ref[cols, :], v_ref[cols, :], mask


def _key_blocks(body, carry, *, row0, bq: int, block_k: int, n_blocks, causal: bool, pad: bool):
  """Runs ``body(j, carry, masked)`` over the key blocks that a query block at ``row0`` sees: with
  padding every block masked; causal, the blocks below the diagonal unmasked and those crossing it
  masked (the blocks past it skipped); else every block unmasked."""
  if pad:
    n_end = jnp.minimum(lax.div(row0 + bq + block_k - 1, block_k), n_blocks) if causal else n_blocks
    return lax.fori_loop(0, n_end, functools.partial(body, masked=True), carry)
  if causal:
    n_end = jnp.minimum(lax.div(row0 + bq + block_k - 1, block_k), n_blocks)
    n_full = jnp.minimum(lax.div(row0 + 1, block_k), n_blocks)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    return lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), carry)
  return lax.fori_loop(0, n_blocks, functools.partial(body, masked=False), carry)


def _dq_kernel(w_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, sm_scale, causal,
               block_k, n_heads, n_rows, n_keys, pad, ds, division):
  bq = q_ref.shape[0]
  b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row0 = qi * bq
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  n_blocks = pl.cdiv(n_keys, block_k)

  def body(j, dq, masked):
    k, v, mask = _key_tile(k_ref, v_ref, j, row0, bq, block_k, masked=masked, causal=causal,
                           pad=pad, n_rows=n_rows, n_keys=n_keys)
    quant = None if ds is None else (ref_words(w_ref), b * n_heads + h, row0, j * block_k, *ds)
    _, ds_op = _ds_tile(q, k, v, do, lse, delta, mask, sm_scale=sm_scale, quant=quant,
                        division=division)
    return dq + _dot(ds_op, k)

  dq = _key_blocks(body, jnp.zeros(q_ref.shape, jnp.float32), row0=row0, bq=bq, block_k=block_k,
                   n_blocks=n_blocks, causal=causal, pad=pad)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _pv_kernel(w_ref, q_ref, k_ref, v_ref, lse_ref, o_ref, *, sm_scale, causal, block_k, n_heads,
               n_rows, n_keys, pad, p_rounding, division):
  """``O = deq(Q(P))·V`` of one query block, P = exp(S − lse) from the forward's lse."""
  bq = q_ref.shape[0]
  b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row0 = qi * bq
  q, lse = q_ref[...], lse_ref[...]
  n_blocks = pl.cdiv(n_keys, block_k)

  def body(j, acc, masked):
    k, v, mask = _key_tile(k_ref, v_ref, j, row0, bq, block_k, masked=masked, causal=causal,
                           pad=pad, n_rows=n_rows, n_keys=n_keys)
    p = _probs_tile(q, k, lse, mask, sm_scale)
    p_op = _p_operand(p, (ref_words(w_ref, 2), b * n_heads + h, row0, j * block_k, p_rounding),
                      v.dtype, division)
    return acc + _dot(p_op, v)

  acc = _key_blocks(body, jnp.zeros(o_ref.shape, jnp.float32), row0=row0, bq=bq, block_k=block_k,
                    n_blocks=n_blocks, causal=causal, pad=pad)
  o_ref[...] = acc.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# Wrappers


def _check(name, q, k, v, causal, sm_scale):
  for arg, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name}: {arg} must be [B, T, H, D], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name}: {arg} must be floating, got {x.dtype}")
  b, t, h, d = q.shape
  if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"{name}: k {k.shape} and v {v.shape} must be [B, S, Hk, D] with q's B and D "
                     f"(q is {q.shape})")
  hk = k.shape[2]
  if h % hk:
    raise ValueError(f"{name}: the query heads ({h}) must be a multiple of the key/value heads "
                     f"({hk})")
  if d % BLOCK or d > 256:
    raise ValueError(f"{name}: head dim D={d} must be a multiple of 16, at most 256")
  if causal and k.shape[1] != t:
    raise ValueError(f"{name}: causal attention needs as many keys as queries, got T={t}, "
                     f"S={k.shape[1]}")
  if not isinstance(sm_scale, (float, int)) or not sm_scale > 0:
    raise ValueError(f"{name}: sm_scale must be a positive Python float, got {sm_scale!r}")


def _pad_to(x, axis, size):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _params(num_warps, num_stages):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _block_sizes(name, block_sizes) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"{name}: block_sizes must be an attention.BlockSizes or None, got "
                     f"{type(block_sizes).__name__}")
  return block_sizes


def attention_fwd(q, k, v, *, causal: bool, sm_scale: float,
                  block_sizes: BlockSizes | None = None, interpret: bool = False):
  """Flash attention forward with an online float32 softmax.

  ``S = dot(q, kᵀ) * sm_scale`` (f32 accumulation), ``P = softmax(S)`` (causal: query i sees keys
  j <= i), ``O = P·V`` with P cast to v's dtype, f32 accumulation.

  Reference: ``fp4jax.ops.attention.nvfp4_attention_reference`` (its ``o`` and ``lse`` with
  ``return_stats=True``), whose softmax and P·V run on the same decoded operands.

  Args:
    q: ``[B, T, H, D]`` (bf16: the decoded NVFP4 queries).
    k, v: ``[B, S, Hk, D]``, ``H % Hk == 0``.
    causal: mask keys after the query (needs S == T); key blocks past the diagonal are skipped.
    sm_scale: the softmax scale (``1 / sqrt(D)``).
    block_sizes: launch settings (``BlockSizes``; None fields take the defaults): ``block_q``,
      ``block_k`` rows and keys per tile (default 128 and 64; at most T and S rounded up to a power
      of two), ``num_warps`` (default 4 for D <= 64, else 8), ``num_stages`` (default 3).
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    ``(o [B, T, H, D] q.dtype, lse [B, H, T] float32)``, ``lse = logsumexp(S)`` per row.
  """
  _check("attention_fwd", q, k, v, causal, sm_scale)
  bs = _block_sizes("attention_fwd", block_sizes)
  block_q, block_k, num_warps, num_stages = bs.block_q, bs.block_k, bs.num_warps, bs.num_stages
  b, t, h, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  bq = min(block_q or 128, pow2_at_least(t))
  bk = min(block_k or 64, pow2_at_least(s))
  t_pad, s_pad = round_up(t, bq), round_up(s, bk)
  q, k, v = _pad_to(q, 1, t_pad), _pad_to(k, 1, s_pad), _pad_to(v, 1, s_pad)
  group = h // hk
  warps = num_warps or (4 if d <= 64 else 8)
  kernel = functools.partial(_fwd_kernel, sm_scale=float(sm_scale), causal=causal, block_k=bk,
                             n_keys=s, pad_keys=s != s_pad)
  kv_spec = pl.BlockSpec((None, s_pad, None, d), lambda i, j, qi: (i, 0, j // group, 0))
  o, lse = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((b, t_pad, h, d), q.dtype),
                 jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32)),
      grid=(b, h, t_pad // bq),
      in_specs=[pl.BlockSpec((None, bq, None, d), lambda i, j, qi: (i, qi, j, 0)), kv_spec, kv_spec],
      out_specs=(pl.BlockSpec((None, bq, None, d), lambda i, j, qi: (i, qi, j, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, j, qi: (i, j, qi))),
      compiler_params=_params(warps, num_stages or 3),
      interpret=interpret,
      name="nvfp4_attention_fwd",
  )(q, k, v)
  return o[:, :t], lse[:, :, :t]


def _key_words4(ds_key, p_key):
  """The kernels' key words: dS's two, then P's (zeros for a key that is not used)."""
  return jnp.concatenate([key_words(k) if k is not None else jnp.zeros((2,), jnp.int32)
                          for k in (ds_key, p_key)])


def attention_pv(q, k, v, lse, *, causal: bool, sm_scale: float, p_rounding: str = "nearest",
                 key=None, block_sizes: BlockSizes | None = None, interpret: bool = False):
  """``O = deq(Q(P))·V`` with ``P = exp(S − lse)`` from the forward's log-sum-exp: the output of
  attention with an NVFP4 P (``AttentionConfig.p.format = "nvfp4"``).

  P is quantized tile by tile as ``fp4jax.ops.attention``'s reference quantizes the whole P: 1×16
  blocks along the keys, the global scale of ``amax = 1``; stochastic rounding takes its bits from
  ``ds_rounding_bits(key, ·)`` (element (b, h, row, col)), so ``attention_bwd(p_rounding=...)``, which
  recomputes the same P in its dK/dV kernel, quantizes it identically for ``dV = deq(Q(P))ᵀ·dO``.
  The flash forward (``attention_fwd``) gives ``lse`` and the O with the unquantized P that δ uses.

  Reference: ``fp4jax.ops.attention.nvfp4_attention_reference`` with an NVFP4 P (``p="nvfp4"``).

  Args:
    q, k, v, causal, sm_scale: as ``attention_fwd``.
    lse: ``[B, H, T]`` float32, ``attention_fwd``'s log-sum-exp.
    p_rounding: ``"nearest"`` or ``"stochastic"``.
    key: a jax.random key, for stochastic rounding.
    block_sizes: launch settings (``BlockSizes``; None fields take the defaults): ``block_q``,
      ``block_k`` tile rows and keys (default 64 and 64; at least 16), ``num_warps`` (default 4 for
      D <= 64, else 8), ``num_stages`` (default 2).
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    ``o`` ``[B, T, H, D]`` in q's dtype (float32 accumulation).
  """
  _check("attention_pv", q, k, v, causal, sm_scale)
  bs = _block_sizes("attention_pv", block_sizes)
  block_q, block_k, num_warps, num_stages = bs.block_q, bs.block_k, bs.num_warps, bs.num_stages
  _check_rounding("attention_pv", "p_rounding", p_rounding, key, "key")
  b, t, h, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  if lse.shape != (b, h, t):
    raise ValueError(f"attention_pv: lse must be [B, H, T] = {(b, h, t)}, got {lse.shape}")
  bq = max(BLOCK, min(block_q or 64, pow2_at_least(t)))
  bk = max(BLOCK, min(block_k or 64, pow2_at_least(s)))
  t_pad, s_pad = round_up(t, bq), round_up(s, bk)
  group = h // hk
  q, lse = _pad_to(q, 1, t_pad), _pad_to(lse, 2, t_pad)
  k, v = _pad_to(k, 1, s_pad), _pad_to(v, 1, s_pad)
  words = _key_words4(None, key if p_rounding == "stochastic" else None)
  kernel = functools.partial(
      _pv_kernel, sm_scale=float(sm_scale), causal=causal, block_k=bk, n_heads=h, n_rows=t,
      n_keys=s, pad=t_pad != t or s_pad != s, p_rounding=p_rounding,
      division="backend" if interpret else "ptx")
  q_block = pl.BlockSpec((None, bq, None, d), lambda i, j, qi: (i, qi, j, 0))
  kv_all = pl.BlockSpec((None, s_pad, None, d), lambda i, j, qi: (i, 0, j // group, 0))
  o = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(b, h, t_pad // bq),
      in_specs=[pl.BlockSpec((4,), lambda *_: (0,)), q_block, kv_all, kv_all,
                pl.BlockSpec((None, None, bq), lambda i, j, qi: (i, j, qi))],
      out_specs=q_block,
      compiler_params=_params(num_warps or (4 if d <= 64 else 8), num_stages or 2),
      interpret=interpret,
      name="nvfp4_attention_pv",
  )(words, q, k, v, lse)
  return o[:, :t]


def attention_bwd(q, k, v, o, lse, do, *, causal: bool, sm_scale: float,
                  ds_rounding: str | None = None, key=None, ds_tile=DS_TILE,
                  p_rounding: str | None = None, p_key=None,
                  dq_accumulation: str = "recompute", block_sizes: BlockSizes | None = None,
                  interpret: bool = False):
  """Flash attention backward: ``(dq, dk, dv)`` shaped and typed like q, k, v.

  ``P = exp(S - lse)`` recomputed with the forward's ``S``, ``dP = dO·Vᵀ``, ``δ = rowsum(dO ∘ O)``,
  ``dS = (P ∘ (dP - δ)) * sm_scale`` in float32; ``dQ = dS·K``, ``dK = dSᵀ·Q`` with dS cast to
  bf16, or quantized to NVFP4 per ``ds_tile`` and decoded (``fp4jax.ops.attention._fake_quant_ds``);
  ``dV = Pᵀ·dO`` with P in bf16, or with ``p_rounding`` set ``deq(Q(P))`` as ``attention_pv``
  quantizes it (dS keeps the unquantized P). f32 accumulation; dK and dV sum over the query heads of
  each key/value head.

  Reference: ``fp4jax.ops.attention.nvfp4_attention_vjp_reference`` (dS quantization:
  ``fp4jax.ops.attention._fake_quant_ds``).

  ``dq_accumulation`` chooses how dQ is summed over the key blocks; dK and dV are computed the same
  way by either:

  - ``"recompute"``: a second kernel, one program per query block, forms S, P, dP and dS again (and
    quantizes dS again, to the same values) and sums ``dS·K`` over the key blocks in registers.
    Deterministic: the same inputs give the same bits.
  - ``"atomic"``: the dK/dV kernel adds each tile's ``dS·K`` to a zeroed float32 ``[B, T, H, D]``
    dQ with atomic adds, which is cast to q's dtype at the end. Each dS tile is formed and quantized
    once and dQ needs no kernel of its own, but the order of dQ's float32 sums depends on the order
    in which the programs run, so dQ is not bit-reproducible from run to run (the difference is
    float32 rounding, before the cast); dK and dV are.

  Args:
    q, k, v: the forward's operands (``attention_fwd``).
    o: the forward's output ``[B, T, H, D]``; lse: its ``[B, H, T]`` log-sum-exp.
    do: the cotangent of ``o``.
    causal, sm_scale: as in the forward.
    ds_rounding: None (dS in bf16), ``"nearest"`` or ``"stochastic"`` (NVFP4 dS).
    key: a jax.random key, for stochastic rounding (bits from ``ds_rounding_bits``).
    ds_tile: (rows, cols) of dS sharing one float32 scale, powers of two >= 16.
    p_rounding: None (P in bf16 in ``dV = Pᵀ·dO``), ``"nearest"`` or ``"stochastic"`` (NVFP4 P, the
      same quantization as ``attention_pv``'s).
    p_key: the key of P's stochastic rounding (``attention_pv``'s ``key``).
    dq_accumulation: ``"recompute"`` (default) or ``"atomic"``, see above.
    block_sizes: launch settings (``BlockSizes``; None fields take the defaults): ``block_q``,
      ``block_k`` tile rows and keys (default ``ds_tile`` with NVFP4 dS, else 64 and 64; with NVFP4
      dS, multiples of ``ds_tile``), ``num_warps`` (default 4, or 8 for ``"atomic"`` above D 64),
      ``num_stages`` (default 2).
    interpret: run in Pallas interpret mode (CPU; the programs run one after another, so the atomic
      adds of ``"atomic"`` are plain adds in a fixed order there).

  Returns:
    ``(dq, dk, dv)``: ``[B, T, H, D]`` q.dtype, ``[B, S, Hk, D]`` k.dtype, ``[B, S, Hk, D]`` v.dtype.

  Example (the backward of ``attention_fwd``'s ``(o, lse)``, NVFP4 dS, one dS quantization)::

    o, lse = attention_fwd(q, k, v, causal=True, sm_scale=d**-0.5)
    dq, dk, dv = attention_bwd(q, k, v, o, lse, do, causal=True, sm_scale=d**-0.5,
                               ds_rounding="stochastic", key=key, dq_accumulation="atomic")
  """
  _check("attention_bwd", q, k, v, causal, sm_scale)
  if dq_accumulation not in DQ_ACCUMULATIONS:
    raise ValueError(f"attention_bwd: dq_accumulation must be one of {DQ_ACCUMULATIONS}, got "
                     f"{dq_accumulation!r}")
  bs = _block_sizes("attention_bwd", block_sizes)
  block_q, block_k, num_warps, num_stages = bs.block_q, bs.block_k, bs.num_warps, bs.num_stages
  b, t, h, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  if o.shape != q.shape or do.shape != q.shape:
    raise ValueError(f"attention_bwd: o {o.shape} and do {do.shape} must be shaped like q {q.shape}")
  if lse.shape != (b, h, t):
    raise ValueError(f"attention_bwd: lse must be [B, H, T] = {(b, h, t)}, got {lse.shape}")
  ds = None
  if ds_rounding is not None:
    _check_rounding("attention_bwd", "ds_rounding", ds_rounding, key, "key")
    _check_ds_tile(ds_tile)
    ds = (tuple(ds_tile), ds_rounding)
  if p_rounding is not None:
    _check_rounding("attention_bwd", "p_rounding", p_rounding, p_key, "p_key")
  bq = block_q or (ds_tile[0] if ds else 64)
  bk = block_k or (ds_tile[1] if ds else 64)
  if ds and (bq % ds_tile[0] or bk % ds_tile[1]):
    raise ValueError(f"attention_bwd: blocks ({bq}, {bk}) must be multiples of ds_tile {ds_tile}")
  if not ds:
    bq, bk = min(bq, pow2_at_least(t)), min(bk, pow2_at_least(s))
    if p_rounding is not None:  # P's 1x16 blocks run along the key block
      bk = max(bk, BLOCK)
  t_pad = round_up(t, bq)
  s_pad = round_up(s, bk)
  pad = t_pad != t or s_pad != s
  group = h // hk
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  q, o, do = (_pad_to(x, 1, t_pad) for x in (q, o, do))
  k, v = _pad_to(k, 1, s_pad), _pad_to(v, 1, s_pad)
  lse, delta = _pad_to(lse, 2, t_pad), _pad_to(delta, 2, t_pad)
  words = _key_words4(key if ds and ds[1] == "stochastic" else None,
                      p_key if p_rounding == "stochastic" else None)
  common = dict(sm_scale=float(sm_scale), causal=causal, n_heads=h, n_rows=t, n_keys=s, pad=pad,
                ds=ds, division="backend" if interpret else "ptx")
  atomic = dq_accumulation == "atomic"
  # Warps: 4 for the two-kernel backward at every D; 8 for the atomic kernel above D 64, which also
  # adds a dQ tile per program (the H200 launch sweep of ``benchmarks.attention --sweep``:
  # benchmarks/RESULTS.md, attention).
  params = _params(num_warps or (8 if atomic and d > 64 else 4), num_stages or 2)
  w_spec = pl.BlockSpec((4,), lambda *_: (0,))

  all_rows = pl.BlockSpec((None, t_pad, h, d), lambda i, j, kj: (i, 0, 0, 0))
  kv_block = pl.BlockSpec((None, bk, None, d), lambda i, j, kj: (i, kj, j, 0))
  rows_all_heads = pl.BlockSpec((None, h, t_pad), lambda i, j, kj: (i, 0, 0))
  inputs = [words, q, k, v, do, lse, delta]
  in_specs = [w_spec, all_rows, kv_block, kv_block, all_rows, rows_all_heads, rows_all_heads]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_specs = [kv_block, kv_block]
  if atomic:  # every program adds into the whole float32 dQ of its batch element
    inputs.append(jnp.zeros(q.shape, jnp.float32))
    in_specs.append(all_rows)
    out_shape.append(jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out_specs.append(all_rows)
  grads = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=bq, group=group, atomic_dq=atomic,
                        p_rounding=p_rounding, **common),
      out_shape=tuple(out_shape),
      grid=(b, hk, s_pad // bk),
      in_specs=in_specs,
      out_specs=tuple(out_specs),
      input_output_aliases={len(inputs) - 1: 2} if atomic else {},
      compiler_params=params,
      interpret=interpret,
      name="nvfp4_attention_dkdv_dq" if atomic else "nvfp4_attention_dkdv",
  )(*inputs)
  if atomic:
    dk, dv, dq = grads
    return dq[:, :t].astype(q.dtype), dk[:, :s], dv[:, :s]
  dk, dv = grads

  q_block = pl.BlockSpec((None, bq, None, d), lambda i, j, qi: (i, qi, j, 0))
  kv_all = pl.BlockSpec((None, s_pad, None, d), lambda i, j, qi: (i, 0, j // group, 0))
  row_block = pl.BlockSpec((None, None, bq), lambda i, j, qi: (i, j, qi))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_k=bk, **common),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(b, h, t_pad // bq),
      in_specs=[w_spec, q_block, kv_all, kv_all, q_block, row_block, row_block],
      out_specs=q_block,
      compiler_params=params,
      interpret=interpret,
      name="nvfp4_attention_dq",
  )(words, q, k, v, do, lse, delta)
  return dq[:, :t], dk[:, :s], dv[:, :s]

