"""fp4jax.kernels.attention: interpret-mode numerics against a jnp attention that materializes S, P and
dS, the in-kernel dS quantizer bit for bit against nvfp4.quantize, and the CUDA (Triton) lowering for
an abstract H200."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import H200, RUN_OPTIMIZED
from jax.experimental import pallas as pl

from fp4jax import numerics, nvfp4
from fp4jax.kernels import _common as C
from fp4jax.kernels import attention as A
from fp4jax.ops.attention import _ds_bits as ds_bits
from fp4jax.ops.attention import _fake_quant_ds as fake_quant_ds
from fp4jax.quant import Operand


def _inputs(b, t, h, hk, d, s=None, seed=0):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  q = rng.standard_normal((b, t, h, d)) * 1.5
  k = rng.standard_normal((b, s, hk, d)) * 1.5
  v = rng.standard_normal((b, s, hk, d))
  do = rng.standard_normal((b, t, h, d))
  return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))


def _heads(x, h):
  """[B, S, Hk, D] -> [B, S, H, D]: each key/value head repeated for its query heads."""
  return jnp.repeat(x, h // x.shape[2], axis=2)


def _reference(q, k, v, do, *, causal, ds_rounding=None, key=None, ds_tile=A.DS_TILE):
  """Attention with materialized S, P and dS, the kernels' numerics: (o, lse, dq, dk, dv).

  ``fp4jax.ops.attention`` holds the op's reference; this one takes the decoded q, k as they are (no
  quantization of its own), as the kernels do, and gives the log-sum-exp and all three gradients."""
  b, t, h, d = q.shape
  scale = d**-0.5
  kh, vh = _heads(k, h), _heads(v, h)
  s = jnp.einsum("bthd,bshd->bhts", q, kh, preferred_element_type=jnp.float32) * jnp.float32(scale)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.exp(s - lse[..., None])
  pb = p.astype(jnp.bfloat16)
  o = jnp.einsum("bhts,bshd->bthd", pb, vh, preferred_element_type=jnp.float32).astype(q.dtype)
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
  dp = jnp.einsum("bthd,bshd->bhts", do, vh, preferred_element_type=jnp.float32)
  ds = (p * (dp - delta[..., None])) * jnp.float32(scale)
  if ds_rounding is None:
    dsq = ds.astype(jnp.bfloat16)
  else:
    # fp4jax.ops.attention's reference quantizer (nvfp4.quantize per ds tile) and its bits.
    bits = ds_bits(key, ds.shape) if ds_rounding == "stochastic" else None
    dsq = fake_quant_ds(ds, ds_tile=ds_tile, rounding=ds_rounding, bits=bits).astype(jnp.bfloat16)
  dq = jnp.einsum("bhts,bshd->bthd", dsq, kh, preferred_element_type=jnp.float32)
  dkh = jnp.einsum("bhts,bthd->bshd", dsq, q, preferred_element_type=jnp.float32)
  dvh = jnp.einsum("bhts,bthd->bshd", pb, do, preferred_element_type=jnp.float32)
  group = lambda x: x.reshape(*k.shape[:3], h // k.shape[2], d).sum(3).astype(k.dtype)
  return o, lse, dq.astype(q.dtype), group(dkh), group(dvh)


def _close(got, want, rtol):
  """Max |got - want| within rtol of max |want| (bf16 outputs, different summation orders)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape
  err = np.abs(got - want).max()
  assert err <= rtol * np.abs(want).max(), (err, np.abs(want).max())


# (B, T, H, Hk, D, causal, block_q, block_k): GQA, T not a multiple of the blocks, block_q != block_k.
CASES = [
    (1, 64, 2, 2, 64, True, 32, 32),
    (1, 80, 4, 2, 64, True, 32, 16),
    (2, 48, 2, 1, 128, False, 16, 32),
    (1, 64, 4, 1, 64, False, 64, 16),
]


@pytest.mark.parametrize("b,t,h,hk,d,causal,bq,bk", CASES)
def test_forward_matches_reference(b, t, h, hk, d, causal, bq, bk):
  q, k, v, do = _inputs(b, t, h, hk, d, seed=t + d)
  o, lse = A.attention_fwd(q, k, v, causal=causal, sm_scale=d**-0.5, block_sizes=A.BlockSizes(bq, bk),
                           interpret=True)
  o_r, lse_r, *_ = _reference(q, k, v, do, causal=causal)
  assert o.dtype == q.dtype and lse.shape == (b, h, t) and lse.dtype == jnp.float32
  np.testing.assert_allclose(lse, lse_r, rtol=1e-6, atol=1e-5)
  _close(o, o_r, 1e-2)  # P in bf16, normalized after P·V instead of before


@pytest.mark.parametrize("b,t,h,hk,d,causal,bq,bk", CASES)
def test_backward_bf16_ds_matches_reference(b, t, h, hk, d, causal, bq, bk):
  q, k, v, do = _inputs(b, t, h, hk, d, seed=t + d)
  o, lse, dq_r, dk_r, dv_r = _reference(q, k, v, do, causal=causal)
  dq, dk, dv = A.attention_bwd(q, k, v, o, lse, do, causal=causal, sm_scale=d**-0.5,
                               block_sizes=A.BlockSizes(bq, bk), interpret=True)
  assert (dq.dtype, dk.shape, dv.shape) == (q.dtype, k.shape, v.shape)
  for got, want in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
    _close(got, want, 2e-2)


@pytest.mark.parametrize("rounding,causal,t,blocks,ds_tile", [
    ("stochastic", True, 128, (64, 64), (64, 64)),
    ("nearest", False, 96, (64, 32), (64, 32)),  # padded to 128, two ds tiles of 32 per key block
    ("stochastic", True, 64, (64, 32), (32, 32)),  # finer second-level scales: two tiles per block
])
@pytest.mark.slow
def test_backward_nvfp4_ds_matches_reference(rounding, causal, t, blocks, ds_tile):
  b, h, hk, d = 1, 2, 1, 64
  q, k, v, do = _inputs(b, t, h, hk, d, seed=7)
  key = jax.random.key(5)
  o, lse, dq_r, dk_r, dv_r = _reference(q, k, v, do, causal=causal, ds_rounding=rounding, key=key,
                                        ds_tile=ds_tile)
  dq, dk, dv = A.attention_bwd(q, k, v, o, lse, do, causal=causal, sm_scale=d**-0.5,
                               ds_rounding=rounding, key=key, ds_tile=ds_tile,
                               block_sizes=A.BlockSizes(*blocks), interpret=True)
  _check_nvfp4_grads((dq, dk, dv), (dq_r, dk_r, dv_r), _reference(q, k, v, do, causal=causal)[2:])


def _check_nvfp4_grads(got, want, bf16):
  """NVFP4-dS gradients against the reference's. dS differs from the reference's in the last bits
  (summation order), which moves a few E2M1 codes at rounding boundaries; the bf16-dS gradients
  ``bf16`` are far off (quantization error)."""
  for g, w, b in zip(got[:2], want[:2], bf16[:2], strict=True):
    err = np.abs(np.float32(g) - np.float32(w)).max()
    assert err < 0.25 * np.abs(np.float32(b) - np.float32(w)).max(), err
    _close(g, w, 4e-2)
  _close(got[2], want[2], 2e-2)


# (B, T, H, Hk, D, causal, block_q, block_k, ds_rounding, ds_tile): GQA in each, causal and full,
# T not a multiple of the blocks, dS in bf16 and NVFP4 (both roundings).
ATOMIC_CASES = [
    (1, 80, 4, 2, 64, True, 32, 16, None, None),
    (1, 128, 4, 2, 64, True, 64, 64, "stochastic", (64, 64)),
    (2, 96, 2, 1, 64, False, 64, 32, "nearest", (64, 32)),  # padded to 128
]


@pytest.mark.parametrize("b,t,h,hk,d,causal,bq,bk,rounding,ds_tile", ATOMIC_CASES)
@pytest.mark.slow
def test_backward_atomic_dq_matches_reference_and_recompute(b, t, h, hk, d, causal, bq, bk, rounding,
                                                           ds_tile):
  """``dq_accumulation="atomic"`` (one kernel, dQ by atomic adds) against the reference with the
  tolerances of the two-kernel tests; dK and dV bit for bit those of ``"recompute"`` (the same
  computation), dQ within a bf16 rounding of its dQ (only the float32 summation order differs)."""
  q, k, v, do = _inputs(b, t, h, hk, d, seed=t + h)
  key = jax.random.key(9)
  o, lse, *want = _reference(q, k, v, do, causal=causal, ds_rounding=rounding, key=key,
                             ds_tile=ds_tile or A.DS_TILE)
  bwd = functools.partial(A.attention_bwd, q, k, v, o, lse, do, causal=causal, sm_scale=d**-0.5,
                          ds_rounding=rounding, key=key, ds_tile=ds_tile or A.DS_TILE,
                          block_sizes=A.BlockSizes(bq, bk), interpret=True)
  atomic, recompute = bwd(dq_accumulation="atomic"), bwd(dq_accumulation="recompute")
  assert [(x.shape, x.dtype) for x in atomic] == [(x.shape, x.dtype) for x in (q, k, v)]
  if rounding is None:
    for got, w in zip(atomic, want, strict=True):
      _close(got, w, 2e-2)
  else:
    _check_nvfp4_grads(atomic, want, _reference(q, k, v, do, causal=causal)[2:])
  for got, other in zip(atomic[1:], recompute[1:], strict=True):
    np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                  np.asarray(other, np.float32).view(np.uint32))
  dq_a, dq_r = np.asarray(atomic[0], np.float32), np.asarray(recompute[0], np.float32)
  np.testing.assert_allclose(dq_a, dq_r, rtol=2**-7, atol=1e-3 * np.abs(dq_r).max())


def _tile_quantizer_kernel(w_ref, ds_ref, out_ref, *, ds_tile, rounding, row0, col0, bh):
  """The kernels' dS tile step on one block: rounding bits at (row0, col0), quantize, decode."""
  m, n = ds_ref.shape
  bits = None
  if rounding == "stochastic":
    k1, k2 = C.ref_words(w_ref)
    bits = A._tile_bits(k1, k2, bh, row0, col0, m, n)
  out_ref[...] = A._quantize_tile(ds_ref[...], bits, ds_tile, rounding, "backend")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_in_kernel_ds_quantizer_is_bit_exact(rounding):
  """The tile quantizer run inside a Pallas kernel (interpret mode) on a block at an offset, against
  ``fake_quant_ds`` of the whole dS with ``ds_rounding_bits``, and both against ``nvfp4.quantize`` of
  each ds tile: bit for bit. Tiles of zeros, of values near 1e-37 (a subnormal S_dec: only the
  exact division of ``fake_quant_ds`` and the GPU's handle it, so not the interpret-mode block), a
  spread over 10 decades."""
  rng = np.random.default_rng(1)
  b, h, t, s = 2, 3, 128, 192
  x = rng.standard_normal((b, h, t, s)) * 10.0 ** rng.uniform(-8, 2, (b, h, t, s))
  x[0, 0, :64, :64] = 0.0
  x[1, 2, 64:, 64:128] *= 1e-37
  ds = jnp.asarray(x, jnp.float32)
  key = jax.random.key(11)
  bits = A.ds_rounding_bits(key, ds.shape) if rounding == "stochastic" else None
  whole = np.asarray(fake_quant_ds(ds, ds_tile=(64, 32), rounding=rounding, bits=bits)
                     .astype(jnp.bfloat16), np.float32)

  @jax.jit
  def per_tile(tile, tbits):
    t = nvfp4.quantize(tile, block=(16, 16), rounding=rounding, bits=tbits)
    return nvfp4.dequantize(t, jnp.bfloat16)

  for (bi, hi, i, j) in [(0, 0, 0, 0), (1, 2, 64, 96), (0, 1, 0, 160)]:
    tile = ds[bi, hi, i:i + 64, j:j + 32]
    want = per_tile(tile, None if bits is None else bits[bi, hi, i:i + 64, j:j + 32])
    np.testing.assert_array_equal(whole[bi, hi, i:i + 64, j:j + 32].view(np.uint32),
                                  np.asarray(want, np.float32).view(np.uint32))
  # The kernel's code on a 64 x 64 block at (64, 64) of head (0, 1): two ds tiles.
  words = C.key_words(key)
  bi, hi = 0, 1
  kernel = functools.partial(_tile_quantizer_kernel, ds_tile=(64, 32), rounding=rounding, row0=64,
                             col0=64, bh=bi * h + hi)
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
                       interpret=True)(words, ds[bi, hi, 64:128, 64:128])
  np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                whole[bi, hi, 64:128, 64:128].view(np.uint32))


def _mismatches_over_float32(f, g, top):
  """How many float32 patterns in [0, ``top``] give ``f`` and ``g`` different float32 patterns."""
  chunk = 1 << 25

  @functools.partial(jax.jit, compiler_options=RUN_OPTIMIZED)
  def count(start):
    b = jnp.minimum(start + jnp.arange(chunk, dtype=jnp.uint32), jnp.uint32(top))
    x = jax.lax.bitcast_convert_type(b, jnp.float32)
    as_bits = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jnp.sum(as_bits(f(x)) != as_bits(g(x)))

  return sum(int(count(jnp.uint32(s))) for s in range(0, top + 1, chunk))


@pytest.mark.slow
def test_e2m1_value_nearest_equals_the_codes_on_every_float32():
  """The kernels' E2M1 rounding to nearest (``(a + M) - M``) is ``decode_e2m1(e2m1_rne_code(a))`` on
  every float32 in [0, 6]."""
  top = int(np.float32(6.0).view(np.uint32))
  assert _mismatches_over_float32(lambda a: C.e2m1_value(a, "nearest", None),
                                  lambda a: numerics.decode_e2m1(numerics.e2m1_rne_code(a)), top) == 0


@pytest.mark.slow
def test_e4m3_value_equals_round_to_e4m3_on_every_float32():
  """The kernels' E4M3 block-scale rounding (``(v + M) - M``) is ``round_to_e4m3``'s value on every
  float32 in [0, 448]."""
  top = int(np.float32(448.0).view(np.uint32))
  assert _mismatches_over_float32(C.e4m3_value, lambda v: numerics.round_to_e4m3(v)[0], top) == 0


@pytest.mark.slow
def test_e2m1_value_stochastic_equals_the_codes():
  """The kernels' stochastic E2M1 rounding is ``decode_e2m1(e2m1_stochastic_code(a, bits))``: 2^25
  random (a, bits) pairs (a uniform over the float32 patterns of [0, 6] and over the values), and
  every E2M1 grid point, tie and their float32 neighbours against every byte of ``lane_bits``."""
  top = int(np.float32(6.0).view(np.uint32))
  n = 1 << 22

  def count(a, bits):
    want = numerics.decode_e2m1(numerics.e2m1_stochastic_code(a, bits))
    got = C.e2m1_value(a, "stochastic", (bits >> 10).astype(jnp.int32))
    as_bits = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jnp.sum(as_bits(got) != as_bits(want))

  @functools.partial(jax.jit, compiler_options=RUN_OPTIMIZED)
  def random_mismatches(key):
    ka, kb, kc, kd = jax.random.split(key, 4)
    a = jax.lax.bitcast_convert_type(jax.random.randint(ka, (n,), 0, top + 1, jnp.int32), jnp.float32)
    a = jnp.where(jax.random.bernoulli(kc, 0.5, (n,)), jax.random.uniform(kd, (n,), jnp.float32, 0, 6), a)
    return count(a, jax.random.bits(kb, (n,), jnp.uint32))

  for key in jax.random.split(jax.random.key(5), 8):
    assert int(random_mismatches(key)) == 0
  grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6], np.float32)
  pats = grid.view(np.int32)[:, None] + np.arange(-3, 4, dtype=np.int32)[None, :]
  a = np.clip(pats.reshape(-1), 0, top).view(np.float32)
  a = np.repeat(a, 256)
  bits = numerics.lane_bits(jnp.tile(jnp.arange(256, dtype=jnp.uint32), a.size // 256), 0)
  assert int(jax.jit(count, compiler_options=RUN_OPTIMIZED)(jnp.asarray(a), bits)) == 0


def _encoders_reference(x, block_amax_fn, s_enc, s_dec, block, rounding, bits, valid=None):
  """``_fake_quant_blocks`` written with ``fp4jax.numerics``' encoders (flush, NaN -> inf amax,
  E4M3 byte then its decode, E2M1 codes then their decode): the order of ``nvfp4.quantize``."""
  rows, cols = block
  x32 = numerics.flush_subnormals(x)
  block_amax = block_amax_fn(jnp.where(jnp.isnan(x32), jnp.inf, jnp.abs(x32)))
  if valid is not None:
    block_amax = jnp.where(valid, block_amax, 0.0)
  _, dcode = numerics.e4m3_block_scales(block_amax, s_enc * jnp.float32(numerics.INV6))
  dscale = numerics.e4m3_to_f32(dcode)
  escale = jnp.minimum(1.0 / (dscale * s_dec), numerics.F32_MAX)
  zero_block = dscale == 0 if valid is None else (dscale == 0) | ~valid
  e = functools.partial(A._expand, rows=rows, cols=cols)
  code = numerics.e2m1_codes(x32, e(escale), e(zero_block), rounding, bits, jnp.int32)
  return (numerics.decode_e2m1(code) * e(dscale) * e(s_dec)).astype(jnp.bfloat16)


def _ds_tile_reference(ds, bits, ds_tile, rounding):
  """``_quantize_tile`` with ``fp4jax.numerics``' encoders (``_encoders_reference``)."""
  tq, tk = ds_tile
  x32 = numerics.flush_subnormals(ds)
  block_amax = A._tile_max(jnp.where(jnp.isnan(x32), jnp.inf, jnp.abs(x32)), 16, 16)
  amax = A._tile_max(block_amax, tq // 16, tk // 16)
  finite = amax <= numerics.F32_MAX
  amax = jnp.where(finite, amax, 0.0)
  s_enc = jnp.minimum(2688.0 / amax, numerics.F32_MAX)
  s_enc = jnp.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
  s_dec = jnp.where(finite, 1.0 / s_enc, jnp.nan)
  e = functools.partial(A._expand, rows=tq // 16, cols=tk // 16)
  return _encoders_reference(ds, lambda ax: A._tile_max(ax, 16, 16), e(s_enc), e(s_dec), (16, 16),
                             rounding, bits, e(finite))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.slow
def test_tile_quantizers_equal_the_numerics_encoders_on_special_values(rounding):
  """The dS and P tile quantizers (pattern amax, value-domain E4M3 and E2M1 rounding, sign from the
  pattern, subnormals dropped by the final select) against the same steps written with
  ``fp4jax.numerics``' encoders, bit for bit, on tiles with zeros, -0, subnormals, values near the
  float32 limits, NaN and infinities (a NaN of P only with rounding to nearest: there its code is 0
  in both, while ``e2m1_stochastic_code`` of a NaN is not defined)."""
  rng = np.random.default_rng(7)
  bits = A._tile_bits(jnp.uint32(123), jnp.uint32(456), 7, 64, 128, 128, 128)
  bits = bits if rounding == "stochastic" else None
  # Each side one compiled program per tile (as in the kernels), not op by op.
  quantize_tile = jax.jit(A._quantize_tile, static_argnums=(2, 3, 4))
  ds_reference = jax.jit(_ds_tile_reference, static_argnums=(2, 3))
  const = lambda v: jnp.full((128, 8), v, jnp.float32)
  quantize_p = jax.jit(lambda p, bits: A._quantize_p_tile(p, bits, rounding, "backend"))
  p_reference = jax.jit(lambda p, bits: _encoders_reference(
      p, lambda ax: A._tile_max(ax, 1, 16), const(A._P_S_ENC), const(A._P_S_DEC), (1, 16), rounding, bits))
  for trial in range(7):
    x = (rng.standard_normal((128, 128)) * 10.0 ** rng.uniform(-8, 2, (128, 128))).astype(np.float32)
    x[:16, :16] = 0.0
    x[16:32, :16] = -0.0
    x[32:48, :16] = (rng.standard_normal((16, 16)) * 1e-39).astype(np.float32)  # subnormals
    x[48:64, :16] *= np.float32(1e-37)
    x[48, 5], x[49, 6], x[50, 7] = 1e-40, -1e-41, -np.float32(2.0**-126)
    x[64:80, 16:32] = (rng.standard_normal((16, 16)) * 1e-39).astype(np.float32)
    x[64, 16] = 2.0**-126  # the block's max is the smallest normal, its other elements subnormal
    if trial == 1:
      x[70, 70] = np.nan
    if trial == 2:
      x[5, 100] = np.inf
    if trial == 3:
      x[100, 5], x[100, 100] = -np.inf, np.nan
    if trial == 4:
      x[64:, 64:] *= np.float32(1e30)
    if trial == 5:
      x *= np.float32(1e-33)
    if trial == 6:
      x[:64, 64:] = np.float32(3.0e38) * np.sign(x[:64, 64:])
    ds = jnp.asarray(x)
    for tile in ((64, 64), (64, 32), (128, 128), (16, 16)):
      got = np.asarray(quantize_tile(ds, bits, tile, rounding, "backend"))
      want = np.asarray(ds_reference(ds, bits, tile, rounding))
      np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    p = np.minimum(np.abs(x), 1.0)
    if rounding == "stochastic":
      p = np.where(np.isnan(p), 0.5, p)
    p = jnp.asarray(p)
    got, want = np.asarray(quantize_p(p, bits)), np.asarray(p_reference(p, bits))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def _p_quantizer_kernel(w_ref, p_ref, out_ref, *, rounding, row0, col0, bh):
  """The kernels' P tile step on one block (``_p_operand``): bits at (row0, col0), quantize, decode."""
  out_ref[...] = A._p_operand(p_ref[...], (C.ref_words(w_ref), bh, row0, col0, rounding),
                              jnp.bfloat16, "backend")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.slow
def test_in_kernel_p_quantizer_is_bit_exact(rounding):
  """The P tile quantizer inside a Pallas kernel (interpret mode), on a block at an offset, against the
  op's reference quantization of the whole P (``_probs_operand``: 1x16 blocks along the keys, the
  global scale of amax = 1, bits from ``ds_bits``), bit for bit. P spans 1 down to 1e-30 (flushed
  below 2^-126), with a block of zeros and exact ones."""
  from fp4jax.ops import attention as ops
  rng = np.random.default_rng(3)
  b, hk, g, t, s = 1, 2, 2, 64, 96
  x = np.exp(-rng.exponential(8.0, (b, hk, g, t, s))) * 10.0 ** -rng.integers(0, 30, (b, hk, g, t, s))
  x[0, 1, 0, :16, 32:48] = 0.0
  x[0, 0, 1, 5, :] = 1.0
  p = jnp.asarray(x, jnp.float32)
  key = jax.random.key(9)
  config = ops.AttentionConfig.nvfp4(p=Operand(rounding=rounding))
  keys = {"p": key}
  whole = np.asarray(ops._probs_operand(p, config, keys, jnp.bfloat16), np.float32)
  assert (whole != np.asarray(p.astype(jnp.bfloat16), np.float32)).mean() > 0.3  # it quantizes
  words = C.key_words(key)
  for kv, gi, row0, col0 in [(0, 1, 0, 0), (1, 0, 16, 32), (1, 1, 32, 64)]:
    h = kv * g + gi
    kernel = functools.partial(_p_quantizer_kernel, rounding=rounding, row0=row0, col0=col0,
                               bh=0 * (hk * g) + h)
    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 32), jnp.bfloat16),
                         interpret=True)(words, p[0, kv, gi, row0:row0 + 32, col0:col0 + 32])
    np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                  whole[0, kv, gi, row0:row0 + 32, col0:col0 + 32].view(np.uint32))


@pytest.mark.slow
def test_attention_pv_and_quantized_p_backward_match_reference():
  """``attention_pv`` (O = deq(Q(P))·V) and ``attention_bwd(p_rounding=...)``'s dV = deq(Q(P))ᵀ·dO
  against the same products from the reference's quantized P, GQA and T not a multiple of the
  blocks; the backward's dQ and dK do not depend on P's quantization."""
  from fp4jax.ops import attention as ops
  b, t, h, hk, d = 1, 80, 4, 2, 64
  q, k, v, do = _inputs(b, t, h, hk, d, seed=4)
  key = jax.random.key(6)
  o, lse, dq_r, dk_r, _ = _reference(q, k, v, do, causal=True)
  kh, vh = _heads(k, h), _heads(v, h)
  s = jnp.einsum("bthd,bshd->bhts", q, kh, preferred_element_type=jnp.float32) * jnp.float32(d**-0.5)
  s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  p = jnp.exp(s - lse[..., None]).reshape(b, hk, h // hk, t, t)
  for rounding in ("nearest", "stochastic"):
    config = ops.AttentionConfig.nvfp4(p=Operand(rounding=rounding))
    pq = ops._probs_operand(p, config, {"p": key}, jnp.bfloat16).reshape(b, h, t, t)
    o_want = jnp.einsum("bhts,bshd->bthd", pq, vh, preferred_element_type=jnp.float32)
    dv_want = jnp.einsum("bhts,bthd->bshd", pq, do, preferred_element_type=jnp.float32)
    dv_want = dv_want.reshape(b, t, hk, h // hk, d).sum(3)
    o_pv = A.attention_pv(q, k, v, lse, causal=True, sm_scale=d**-0.5, p_rounding=rounding, key=key,
                          block_sizes=A.BlockSizes(32, 16), interpret=True)
    dq, dk, dv = A.attention_bwd(q, k, v, o, lse, do, causal=True, sm_scale=d**-0.5,
                                 block_sizes=A.BlockSizes(32, 16), p_rounding=rounding, p_key=key, interpret=True)
    _close(o_pv, o_want.astype(jnp.bfloat16), 1e-2)
    _close(dv, dv_want.astype(jnp.bfloat16), 1e-2)
    assert np.abs(np.float32(o_pv) - np.float32(o)).max() > 0.01  # Q(P) moved O
    _close(dq, dq_r, 2e-2)
    _close(dk, dk_r, 2e-2)


def test_ds_rounding_bits_depend_on_the_element_only():
  key = jax.random.key(2)
  bits = np.asarray(A.ds_rounding_bits(key, (2, 3, 32, 64)))
  k1, k2 = numerics.counter_words(key)
  tile = np.asarray(A._tile_bits(k1, k2, 1 * 3 + 2, 16, 32, 16, 32))
  np.testing.assert_array_equal(tile, bits[1, 2, 16:32, 32:64])
  assert ((bits & 0xFFFFFF) == 1 << 23).all()  # lane_bits: a byte, then the half step
  byte = bits >> 24
  assert len(np.unique(byte)) == 256 and abs(byte.mean() - 127.5) < 3
  # Other heads, other keys: other bits.
  assert np.mean(bits[0, 0] == bits[0, 1]) < 0.02
  other = np.asarray(A.ds_rounding_bits(jax.random.key(3), (2, 3, 32, 64)))
  assert np.mean(other == bits) < 0.02


def test_bad_arguments_raise_value_errors():
  q, k, v, do = _inputs(1, 32, 2, 1, 64)
  fwd = functools.partial(A.attention_fwd, causal=True, sm_scale=0.125, interpret=True)
  lse = jnp.zeros((1, 2, 32), jnp.float32)
  bwd = functools.partial(A.attention_bwd, causal=True, sm_scale=0.125, interpret=True)
  pv = functools.partial(A.attention_pv, causal=True, sm_scale=0.125, interpret=True)
  for call, args, kw, match in [
      (fwd, (q[0], k, v), {}, r"\[B, T, H, D\]"),
      (fwd, (q, k[:, :16], v[:, :16]), {}, "causal"),
      (fwd, (q, k, v[..., :32]), {}, "k .* and v"),
      (fwd, (q[..., :24], k[..., :24], v[..., :24]), {}, "multiple of 16"),
      (fwd, (q[:, :, :1], k.repeat(2, 2), v.repeat(2, 2)), {}, "multiple of the key/value heads"),
      (fwd, (q, k, v), dict(block_sizes=(64, 64)), "block_sizes"),
      (fwd, (q, k, v), dict(sm_scale=-1.0), "sm_scale"),
      (bwd, (q, k, v, q, lse[:, :1], do), {}, "lse"),
      (bwd, (q, k, v, q, lse, do[:, :16]), {}, "do"),
      (bwd, (q, k, v, q, lse, do), dict(ds_rounding="up"), "rounding"),
      (bwd, (q, k, v, q, lse, do), dict(ds_rounding="stochastic"), "key"),
      (bwd, (q, k, v, q, lse, do), dict(ds_rounding="nearest", ds_tile=(24, 64)), "ds_tile"),
      (bwd, (q, k, v, q, lse, do), dict(ds_rounding="nearest", block_sizes=A.BlockSizes(block_q=32)),
       "multiples of ds_tile"),
      (bwd, (q, k, v, q, lse, do), dict(dq_accumulation="sum"), "dq_accumulation"),
      (bwd, (q, k, v, q, lse, do), dict(p_rounding="up"), "p_rounding"),
      (bwd, (q, k, v, q, lse, do), dict(p_rounding="stochastic"), "p_key"),
      (pv, (q, k, v, lse[:, :1]), {}, "lse"),
      (pv, (q, k, v, lse), dict(p_rounding="up"), "p_rounding"),
      (pv, (q, k, v, lse), dict(p_rounding="stochastic"), "key"),
  ]:
    with pytest.raises(ValueError, match=match):
      call(*args, **kw)


def test_block_sizes_are_validated():
  """``BlockSizes``: None (the kernel's default) or powers of two; stages a positive int."""
  assert A.BlockSizes() == A.BlockSizes(None, None, None, None)
  A.BlockSizes(block_q=16, block_k=128, num_warps=8, num_stages=3)
  for kw, match in [(dict(block_q=48), "block_q"), (dict(block_k=0), "block_k"),
                    (dict(num_warps=6), "num_warps"), (dict(block_q=64.0), "block_q"),
                    (dict(num_stages=0), "num_stages"), (dict(num_stages=True), "num_stages")]:
    with pytest.raises(ValueError, match=match):
      A.BlockSizes(**kw)
  with pytest.raises(dataclasses.FrozenInstanceError):
    A.BlockSizes().block_q = 64


def test_entry_points_name_their_reference():
  """Each kernel entry point's jnp reference is beside it or named in its docstring."""
  from fp4jax.kernels import adam_nvfp4, cross_entropy, nvfp4_quantize
  for fn, ref in [(A.attention_fwd, "nvfp4_attention_reference"),
                  (A.attention_pv, "nvfp4_attention_reference"),
                  (A.attention_bwd, "nvfp4_attention_vjp_reference"),
                  (nvfp4_quantize.quantize, "quantize_reference"),
                  (cross_entropy.softmax_xent_rows, "softmax_xent_rows_reference"),
                  (adam_nvfp4.update_leaves, 'implementation="xla"')]:
    assert ref in fn.__doc__, fn.__name__
  assert callable(nvfp4_quantize.quantize_reference)
  assert callable(cross_entropy.softmax_xent_rows_reference)


def test_shared_helpers_are_defined_once():
  """The kernels' shared pieces are defined in ``fp4jax.kernels._common`` and imported, not copied
  (a function of that name defined in a kernel module is a second copy)."""
  import inspect

  from fp4jax.kernels import adam_nvfp4, cross_entropy, nvfp4_quantize
  shared = {name for name, f in vars(C).items() if inspect.isfunction(f) and f.__module__ == C.__name__}
  for module in (A, adam_nvfp4, cross_entropy, nvfp4_quantize):
    for name, f in vars(module).items():
      if inspect.isfunction(f) and f.__module__ == module.__name__:
        assert name.lstrip("_") not in shared, (module.__name__, name)
  assert nvfp4_quantize.BIT_SOURCES is numerics.BIT_SOURCES
  assert nvfp4_quantize.stochastic_bits is numerics.stochastic_bits


# (D, causal, ds_rounding, GQA group, ds_tile): both head dims, dS in bf16 and NVFP4 (both roundings),
# the default and the finest dS tiles (16×16 blocks of the backward's kernels).
LOWER_CASES = [
    (64, True, "stochastic", 2, A.DS_TILE),
    (128, True, "stochastic", 1, A.DS_TILE),
    (128, False, "nearest", 4, A.DS_TILE),
    (128, True, None, 2, A.DS_TILE),
    (64, True, "stochastic", 2, (16, 16)),
]


@pytest.mark.parametrize("d,causal,ds_rounding,group,ds_tile", LOWER_CASES)
def test_lowers_to_triton_for_h200(triton_modules, d, causal, ds_rounding, group, ds_tile):
  """The CUDA lowering of jitted forward and backward for an abstract H200 (no GPU): one Triton call
  forward, two backward (dK/dV and dQ), each verified; the dS quantizer divides with div.rn.f32 and
  rcp.rn.f32 and uses no float4/float8 type."""
  b, t, h = 2, 1024, 8
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, h // group, d), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  fwd = jax.jit(functools.partial(A.attention_fwd, causal=causal, sm_scale=d**-0.5))
  bwd = jax.jit(functools.partial(A.attention_bwd, causal=causal, sm_scale=d**-0.5,
                                  ds_rounding=ds_rounding, ds_tile=ds_tile))
  with jax.sharding.use_abstract_mesh(H200):  # abstract values only in here
    hlo_f = fwd.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    hlo_b = bwd.trace(q, k, k, q, lse, q, key=key).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo_f.count("__gpu$xla.gpu.triton") == 1 and hlo_b.count("__gpu$xla.gpu.triton") == 2
  assert len(triton_modules) == 3
  fwd_ir, dkdv_ir, dq_ir = triton_modules
  assert "@nvfp4_attention_fwd" in fwd_ir and "@nvfp4_attention_dkdv" in dkdv_ir
  assert "@nvfp4_attention_dq" in dq_ir
  for ir in triton_modules:
    assert not re.search(r"f4E2M1|f8E4M3", ir)
    assert ir.count("tt.dot") >= (1 if ir is fwd_ir else 3) + (ir is fwd_ir)
  for ir in (dkdv_ir, dq_ir):
    assert ("div.rn.f32" in ir) == ("rcp.rn.f32" in ir) == (ds_rounding is not None)


@pytest.mark.parametrize("d,causal,ds_rounding,group", [(64, True, "stochastic", 2),
                                                        (128, False, None, 1)])
def test_atomic_backward_lowers_to_triton_for_h200(triton_modules, d, causal, ds_rounding, group):
  """``dq_accumulation="atomic"`` lowers for an abstract H200 to one verified Triton call whose dQ
  output aliases the zeroed float32 dQ operand, adding float32 tiles with ``atomic_rmw fadd``."""
  b, t, h = 2, 1024, 8
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, h // group, d), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  bwd = jax.jit(functools.partial(A.attention_bwd, causal=causal, sm_scale=d**-0.5,
                                  ds_rounding=ds_rounding, dq_accumulation="atomic"))
  with jax.sharding.use_abstract_mesh(H200):
    hlo = bwd.trace(q, k, k, q, lse, q, key=key).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 1 and len(triton_modules) == 1
  call = next(line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line)
  assert "output_operand_alias<output_tuple_indices = [2]" in call
  assert f"tensor<{b}x{t}x{h}x{d}xf32>)" in call  # the float32 dQ is the third output
  (ir,) = triton_modules
  assert "@nvfp4_attention_dkdv_dq" in ir and not re.search(r"f4E2M1|f8E4M3", ir)
  adds = re.findall(r"tt\.atomic_rmw fadd, .*: \(tensor<(\d+)x(\d+)x!tt\.ptr<f32>>", ir)
  assert adds and all(int(n) == d for _, n in adds)
  assert ir.count("tt.dot") >= 5  # S, dP, dV, dK, dQ
  assert ("div.rn.f32" in ir) == ("rcp.rn.f32" in ir) == (ds_rounding is not None)


@pytest.mark.parametrize("p_rounding", ["nearest", "stochastic"])
def test_quantized_p_kernels_lower_to_triton_for_h200(triton_modules, p_rounding):
  """With an NVFP4 P: ``attention_pv`` and the dK/dV kernel that quantizes P lower for an abstract
  H200 to verified Triton modules with no float4/float8 type, with correctly rounded reciprocals
  (rcp.rn.f32; P's global scale is a constant, so only the dK/dV kernel's dS divides, div.rn.f32)."""
  b, t, h, d = 2, 1024, 8, 128
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, h // 2, d), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  pv = jax.jit(functools.partial(A.attention_pv, causal=True, sm_scale=d**-0.5, p_rounding=p_rounding))
  bwd = jax.jit(functools.partial(A.attention_bwd, causal=True, sm_scale=d**-0.5,
                                  ds_rounding="stochastic", p_rounding=p_rounding))
  with jax.sharding.use_abstract_mesh(H200):
    hlo_pv = pv.trace(q, k, k, lse, key=key).lower(lowering_platforms=("cuda",)).as_text()
    hlo_b = bwd.trace(q, k, k, q, lse, q, key=key, p_key=key).lower(
        lowering_platforms=("cuda",)).as_text()
  assert hlo_pv.count("__gpu$xla.gpu.triton") == 1 and hlo_b.count("__gpu$xla.gpu.triton") == 2
  pv_ir, dkdv_ir, dq_ir = triton_modules
  assert "@nvfp4_attention_pv" in pv_ir and "@nvfp4_attention_dkdv" in dkdv_ir
  for ir in triton_modules:
    assert not re.search(r"f4E2M1|f8E4M3", ir) and "rcp.rn.f32" in ir
  assert "div.rn.f32" not in pv_ir and "div.rn.f32" in dkdv_ir
  assert pv_ir.count("tt.dot") >= 2  # S and P·V
