"""fp4jax.nvfp4: bit-exactness against the numpy transcription of TE's algorithm, format, errors."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp4jax import _fp32, numerics, nvfp4
from nvfp4_np_reference import dequantize_ref, quantize_ref

BF16 = ml_dtypes.bfloat16


def _inputs():
  rng = np.random.default_rng(1234)
  shape = (64, 256)
  signs = rng.choice([-1.0, 1.0], shape)
  boundary = np.tile(np.linspace(-12, 12, 256), (64, 1))  # TE's boundary pattern
  boundary[::3] += 1e-3
  boundary[1::3] -= 1e-3
  outlier = rng.standard_normal(shape)
  outlier[rng.integers(0, 64, 20), rng.integers(0, 256, 20)] = 1e4
  zero_blocks = rng.standard_normal(shape)
  zero_blocks[:, :32] = 0.0
  zero_blocks[5] = 0.0
  e2m1_grid = rng.choice(nvfp4.E2M1_VALUES, shape) * signs * 0.5 ** rng.integers(0, 3, shape)
  return {
      "normal": rng.standard_normal(shape),
      "student_t2": rng.standard_t(2, shape),
      "lognormal_s3": rng.lognormal(0, 3, shape) * signs,  # E4M3-subnormal and zero block scales
      "lognormal_s6": rng.lognormal(0, 6, shape) * signs,
      "boundary": boundary,
      "outlier": outlier,
      "zero_blocks": zero_blocks,
      "all_zero": np.zeros(shape),
      "tiny": rng.standard_normal(shape) * 1e-28,
      "huge": rng.standard_normal(shape) * 1e30,
      "e2m1_grid": e2m1_grid,  # exact rounding ties after scaling
  }


INPUTS = _inputs()
LAYOUTS = [((1, 16), -1), ((1, 16), 0), ((16, 16), -1)]


@functools.lru_cache(maxsize=None)
def _jit_quantize(block, axis, scale_rule="max", rounding="nearest"):
  """``nvfp4.quantize`` jitted once per layout, rule and rounding (the tests' cases share its programs)."""
  return jax.jit(functools.partial(nvfp4.quantize, block=block, axis=axis, scale_rule=scale_rule, rounding=rounding))


def _codes(t):
  return np.asarray(nvfp4._unpack(t.codes, t.axis))


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("block,axis", LAYOUTS, ids=["1x16_last", "1x16_first", "16x16"])
def test_bit_exact_against_te_transcription(name, dtype, block, axis):
  x = INPUTS[name]
  if dtype == np.float16:
    x = np.clip(x, -6e4, 6e4)
  x = x.astype(dtype)
  t = _jit_quantize(block, axis)(x)
  codes, dscale, s_dec = quantize_ref(x, block, axis)
  np.testing.assert_array_equal(_codes(t), codes)
  np.testing.assert_array_equal(np.asarray(t.block_scales()), dscale)
  assert np.asarray(t.global_scale).view(np.uint32) == np.float32(s_dec).view(np.uint32)
  deq = np.asarray(nvfp4.dequantize(t))
  np.testing.assert_array_equal(deq, dequantize_ref(codes, dscale, s_dec, block, axis))


def test_ties_round_to_even():
  # amax = 6 in the block: dscale = 448, S_dec = 1/448, and x * escale lands exactly on midpoints.
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
  want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0], np.float32)
  x = np.concatenate([mids, -mids])[None, :]
  t = nvfp4.quantize(x)
  assert float(t.block_scales()[0, 0]) == 448.0
  got = np.asarray(t.elements())
  np.testing.assert_array_equal(got[0], np.concatenate([want, -want]))


@pytest.mark.slow
def test_jit_equals_eager_and_layout():
  x = INPUTS["student_t2"].astype(np.float32)
  for block, axis in LAYOUTS:
    a = nvfp4.quantize(x, block=block, axis=axis)
    b = _jit_quantize(block, axis)(x)
    for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
  t = nvfp4.quantize(x, axis=0)
  assert t.codes.shape == (32, 256) and t.codes.dtype == jnp.uint8
  assert t.scales.shape == (4, 256) and t.scales.dtype == jnp.float8_e4m3fn
  assert t.global_scale.shape == () and t.global_scale.dtype == jnp.float32
  t = nvfp4.quantize(x, block=(16, 16))
  assert t.codes.shape == (64, 128) and t.scales.shape == (4, 16) and t.block_scales().shape == (4, 16)
  assert t.elements().shape == x.shape


def test_batched_and_pytree():
  x = np.random.default_rng(0).standard_normal((3, 32, 48)).astype(np.float32)
  t = nvfp4.quantize(x, block=(16, 16))
  codes, dscale, _ = quantize_ref(x, (16, 16))
  np.testing.assert_array_equal(_codes(t), codes)
  np.testing.assert_array_equal(np.asarray(t.block_scales()), dscale)
  leaves, treedef = jax.tree.flatten(t)
  assert len(leaves) == 3
  t2 = jax.tree.unflatten(treedef, leaves)
  assert (t2.shape, t2.block, t2.axis, t2.dtype) == (t.shape, t.block, t.axis, t.dtype)
  assert jax.jit(lambda t: t.dequantize())(t).shape == x.shape


def test_packing_round_trip():
  codes = np.random.default_rng(0).integers(0, 16, (4, 32, 16)).astype(np.uint8)
  for axis in range(3):
    packed = nvfp4._pack(jnp.asarray(codes), axis)
    assert packed.shape[axis] == codes.shape[axis] // 2
    np.testing.assert_array_equal(np.asarray(nvfp4._unpack(packed, axis)), codes)
  # Low nibble = even element.
  packed = np.asarray(nvfp4._pack(jnp.asarray(np.array([[1, 2] * 8], np.uint8)), 1))
  assert (packed == 0x21).all()


def test_quantize_is_idempotent():
  x = INPUTS["normal"].astype(np.float32)
  for block, axis in LAYOUTS:
    y = nvfp4.dequantize(nvfp4.quantize(x, block=block, axis=axis))
    z = nvfp4.dequantize(nvfp4.quantize(y, block=block, axis=axis))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(z))


def test_error_bound():
  # Relative error of E2M1 rounding is at most 1/4 of a value's magnitude above the first step,
  # and the overall relative error of Gaussian data is ~ 0.1 (measured figure pinned loosely).
  x = INPUTS["normal"].astype(np.float32)
  y = np.asarray(nvfp4.fake_quant(x))
  rel = np.linalg.norm(y - x) / np.linalg.norm(x)
  assert 0.05 < rel < 0.15, rel


@pytest.mark.slow
def test_nbytes():
  t = nvfp4.quantize(np.ones((128, 256), np.float32))
  assert t.nbytes == 128 * 256 * 4.5 / 8 + 4
  assert t.nbytes == t.codes.nbytes + t.scales.nbytes + t.global_scale.nbytes
  t = nvfp4.quantize(np.ones((128, 256), np.float32), block=(16, 16))
  assert t.nbytes == t.codes.nbytes + t.scales.nbytes + t.global_scale.nbytes == 128 * 128 + 128 + 4


@pytest.mark.slow
def test_stochastic_rounding_unbiased_and_deterministic():
  rng = np.random.default_rng(7)
  x = rng.standard_normal((16, 256)).astype(np.float32)
  keys = jax.random.split(jax.random.key(0), 1024)
  deq = jax.jit(jax.vmap(lambda k: nvfp4.quantize(x, rounding="stochastic", key=k).dequantize()))(keys)
  deq = np.asarray(deq)
  # Each sample lands on one of the two neighbours of x on the scaled grid.
  t_near = nvfp4.quantize(x)
  scale = np.asarray(nvfp4._expand(t_near.block_scales(), x.shape, (1, 16), 1) * t_near.global_scale)
  assert (np.abs(deq - x) <= 2.0 * scale + 1e-12).all()
  # Unbiased: the mean over N keys is within 5 standard errors of x for every element, using the
  # largest possible per-sample spread (a grid step of 2 units, probability 1/2).
  # Elements whose scaled magnitude exceeds 6 (the E4M3 block scale rounded down) are clamped, as in
  # Transformer Engine: SR is unbiased inside the representable range only.
  inside = np.abs(x / scale) <= 6.0
  assert inside.mean() > 0.95
  mean = deq.mean(0)
  assert (np.abs(mean - x)[inside] <= (5 * scale / np.sqrt(len(keys)))[inside] + 1e-7).all()
  # Averaged over all elements, the normalized bias is ~0.
  bias_units = np.mean(((mean - x) / scale)[inside])
  assert abs(bias_units) < 5 * 1.0 / np.sqrt(len(keys) * x.size), bias_units
  # Nearest rounding of the same x is biased by comparison: the SR mean is closer.
  err_sr = np.abs(mean - x).mean()
  err_rn = np.abs(np.asarray(t_near.dequantize()) - x).mean()
  assert err_sr < 0.2 * err_rn
  # Deterministic per key, different across keys.
  a = nvfp4.quantize(x, rounding="stochastic", key=jax.random.key(3))
  b = nvfp4.quantize(x, rounding="stochastic", key=jax.random.key(3))
  c = nvfp4.quantize(x, rounding="stochastic", key=jax.random.key(4))
  np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
  assert (np.asarray(a.codes) != np.asarray(c.codes)).any()
  # Scales do not depend on the rounding mode.
  np.testing.assert_array_equal(np.asarray(a.scales, np.float32), np.asarray(t_near.scales, np.float32))


def test_decode_e2m1_every_code():
  """The integer decoder gives each of the 16 codes' value, signed zero included, bit for bit."""
  want = np.array(list(nvfp4.E2M1_VALUES) + [-v for v in nvfp4.E2M1_VALUES], np.float32)
  got = np.asarray(jax.jit(numerics.decode_e2m1)(jnp.arange(16, dtype=jnp.uint8)))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_stochastic_code_is_the_probability_rule():
  """The E2M1 stochastic code of a magnitude a in [0, 6] with 22-bit uniform r (top bits): the lower
  grid neighbour lo, plus 1 iff r / 2^22 >= 1 - (a - lo) / (hi - lo), computed here in float64 from
  the grid itself (below 1 on float32(a + 1) - 1, the documented rounding), on every multiple of
  2^-12 in [0, 6] (all boundaries and midpoints), on random magnitudes and on the extreme bits."""
  grid = np.asarray(nvfp4.E2M1_VALUES)
  rng = np.random.default_rng(0)
  a = np.concatenate([np.arange(6 * 4096 + 1) / 4096.0, rng.uniform(0, 6, 20000),
                      rng.uniform(0, 1, 20000), [1 - 2.0**-24, 2.0**-30, 0.25, 0.75]]
                     ).astype(np.float32)
  bits = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
  bits[:50] = 0xFFFFFFFF
  bits[50:100] = 0
  a64 = np.where(a < 1, (a + np.float32(1)).astype(np.float64) - 1, a.astype(np.float64))
  lo = np.searchsorted(grid, a64, side="right") - 1
  hi = np.minimum(lo + 1, 7)
  p = np.where(hi > lo, (a64 - grid[lo]) / (grid[hi] - grid[lo] + (hi == lo)), 0.0)
  r = (bits >> 10).astype(np.float64) / 2.0**22
  want = lo + ((p > 0) & (r >= 1 - p))
  got = np.asarray(jax.jit(numerics.e2m1_stochastic_code)(a, bits))
  np.testing.assert_array_equal(got, want)
  # Unbiased: over all 2^22 values of r, the mean rounded value is a (exact in [1, 6]).
  r_all = (np.arange(2**22, dtype=np.uint32) << 10)
  for x in (1.3, 2.71, 4.5, 5.999):
    codes = np.asarray(jax.jit(numerics.e2m1_stochastic_code)(np.full(r_all.shape, x, np.float32), r_all))
    assert abs(grid[codes].mean() - np.float32(x)) < 1e-12, x


def test_stochastic_rounding_of_grid_values_is_exact():
  # Block 0 holds 2688 (so S_enc = S_dec = 1); every other block is E2M1 grid values times a power
  # of two with a 6·2^k in it, so dscale = 2^k and x·escale lands exactly on the grid: SR must not move it.
  rng = np.random.default_rng(3)
  k = rng.integers(-4, 5, (8, 16, 1)).astype(np.float32)
  x = rng.choice(nvfp4.E2M1_VALUES, (8, 16, 16)) * rng.choice([-1.0, 1.0], (8, 16, 16))
  x[..., 0] = 6.0
  x = (x * 2.0**k).reshape(8, 256).astype(np.float32)
  x[0, :16] = 0.0
  x[0, 0] = 2688.0
  near = nvfp4.quantize(x)
  assert float(near.global_scale) == 1.0
  for seed in range(3):
    sr = nvfp4.quantize(x, rounding="stochastic", key=jax.random.key(seed))
    np.testing.assert_array_equal(np.asarray(sr.codes), np.asarray(near.codes))
  np.testing.assert_array_equal(np.asarray(near.dequantize())[:, 16:], x[:, 16:])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.slow
def test_non_finite_never_comes_back_finite(bad):
  x = INPUTS["normal"].astype(np.float32).copy()
  x[3, 17] = bad
  for block, axis in LAYOUTS:
    for rounding in ("nearest", "stochastic"):
      t = _jit_quantize(block, axis, rounding=rounding)(x, key=jax.random.key(0))
      assert np.isnan(np.asarray(t.global_scale))
      assert np.isnan(np.asarray(t.dequantize())).all()
      assert np.isnan(np.asarray(nvfp4.fake_quant(x.astype(BF16), block=block, axis=axis),
                                 np.float32)).all()


@pytest.mark.slow
def test_fake_quant_straight_through_gradient():
  x = INPUTS["normal"][:16, :64].astype(np.float32)
  g = jax.grad(lambda x: jnp.sum(nvfp4.fake_quant(x) * 3.0))(x)
  np.testing.assert_array_equal(np.asarray(g), np.full_like(x, 3.0))
  xb = x.astype(BF16)
  y = nvfp4.fake_quant(xb, block=(16, 16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(nvfp4.quantize(xb, block=(16, 16)).dequantize(), np.float32))


def test_scaled_elements_exact_in_bf16():
  t = nvfp4.quantize(INPUTS["lognormal_s3"].astype(np.float32))
  a = np.asarray(t.scaled_elements(jnp.float32))
  b = np.asarray(t.scaled_elements(jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_agrees_with_jax_scaled_dot_general_forward():
  """jax.nn.scaled_dot_general(nvfp4) quantizes with a fixed global scale and (x / gs) / dscale.

  With power-of-two scales the orders of float operations agree exactly, so on such data the
  product must equal ours up to f32 summation order. On general float32 data they differ only at
  E2M1 rounding ties: we check that the disagreements are a tiny fraction, each one E2M1 step.
  """
  from jax._src.cudnn import scaled_matmul_stablehlo as sms

  with jax.numpy_rank_promotion("allow"):  # jax's own code broadcasts implicitly
    _check_scaled_dot_general(sms)


def _check_scaled_dot_general(sms):
  rng = np.random.default_rng(5)
  x = rng.standard_normal((32, 128)).astype(np.float32)
  w = rng.standard_normal((48, 128)).astype(np.float32)
  cfg = jax.nn.get_scaled_dot_general_config("nvfp4")
  x, w = jnp.asarray(x), jnp.asarray(w)
  theirs = jax.nn.scaled_dot_general(x, w, (((1,), (1,)), ((), ())), configs=[cfg, cfg, cfg])

  # Per-block agreement of the quantized values (global scale 1 on both sides via amax = 2688).
  def pin(a):  # put a 2688 in one place so S_enc == 1 exactly
    a = np.array(a)
    a[0, 0] = 2688.0
    return a

  xp, wp = pin(x), pin(w)
  q_theirs, s_theirs = sms.quantize(jnp.asarray(xp)[None], cfg)
  deq_theirs = (np.asarray(q_theirs[0], np.float32)
                * np.repeat(np.asarray(s_theirs[0], np.float32), 16, -1))
  ours = nvfp4.quantize(xp)
  assert float(ours.global_scale) == 1.0
  np.testing.assert_array_equal(np.asarray(ours.block_scales()), np.asarray(s_theirs[0], np.float32))
  deq_ours = np.asarray(ours.dequantize())
  diff = deq_ours != deq_theirs
  assert diff.mean() < 1e-2, diff.mean()
  # Where they differ, the two are neighbouring grid values around a tie of x / dscale.
  step = np.abs(deq_ours - deq_theirs)[diff] / np.repeat(np.asarray(ours.block_scales()), 16, -1)[diff]
  assert (step <= 2.0).all()

  # The forward product: with the same quantized operands, equal to f32 summation order.
  cfg1 = jax.nn.get_scaled_dot_general_config("nvfp4")
  theirs_p = jax.nn.scaled_dot_general(jnp.asarray(xp), jnp.asarray(wp), (((1,), (1,)), ((), ())),
                                       configs=[cfg1, cfg1, cfg1])
  ours_p = nvfp4.fake_quant(xp) @ nvfp4.fake_quant(wp).T
  rel = np.linalg.norm(np.asarray(theirs_p) - np.asarray(ours_p)) / np.linalg.norm(np.asarray(ours_p))
  assert rel < 1e-2, rel
  assert np.isfinite(np.asarray(theirs)).all()


@pytest.mark.slow
def test_gemm_applies_the_global_scales_one_at_a_time():
  """``nvfp4.gemm`` (and ``optim.nvfp4_dot`` on it) multiplies by one global scale, then the other:
  two operands of amax 1e-20 have global scales ~3.7e-24, whose product (~1.4e-47) underflows
  float32, while their product (~4e-37, a normal float32) comes out right."""
  from fp4jax import optim
  a, b = jnp.full((16, 4096), 1e-20, jnp.float32), jnp.full((4096, 16), 1e-20, jnp.float32)
  qa, qb = nvfp4.quantize(a), nvfp4.quantize(b, axis=0)
  assert float(qa.global_scale * qb.global_scale) == 0.0  # the product of the scales underflows
  want = 4096 * 1e-20 * 1e-20
  for got in (jax.jit(nvfp4.gemm)(qa, qb), jax.jit(optim.nvfp4_dot)(a, b),
              jax.jit(optim.nvfp4_gram)(a)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  x = jax.random.normal(jax.random.key(0), (32, 64))
  qx = nvfp4.quantize(x)
  ref = jnp.dot(qx.dequantize(), qx.dequantize().T, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(nvfp4.gemm(qx, qx, ((1,), (1,))), ref, rtol=1e-5, atol=1e-5)


def test_hadamard_orthonormal_and_invertible():
  key = jax.random.key(0)
  h = np.asarray(nvfp4.hadamard_matrix(key))
  np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-7)
  assert set(np.unique(np.abs(h))) == {0.25}
  x = np.random.default_rng(0).standard_normal((48, 32)).astype(np.float32)
  for axis in (0, 1):
    y = nvfp4.hadamard(x, key, axis)
    np.testing.assert_allclose(np.asarray(nvfp4.hadamard(y, key, axis, inverse=True)), x, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(y)), np.linalg.norm(x), rtol=1e-6)
  # Cancels in a product over the transformed axis.
  a = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
  b = np.random.default_rng(2).standard_normal((64, 24)).astype(np.float32)
  ha, hb = nvfp4.hadamard(a, key, 0), nvfp4.hadamard(b, key, 0)
  np.testing.assert_allclose(np.asarray(ha).T @ np.asarray(hb), a.T @ b, atol=1e-4)
  # Spreads an outlier over its block.
  e = np.zeros((1, 16), np.float32)
  e[0, 3] = 16.0
  np.testing.assert_allclose(np.abs(np.asarray(nvfp4.hadamard(e, key))), 4.0)


def test_div_rn_matches_ieee_including_subnormals():
  rng = np.random.default_rng(0)
  n = 50_000
  a = (rng.uniform(0, 1, n) * 2.0 ** rng.integers(-149, 127, n)).astype(np.float32)
  b = (rng.uniform(0, 1, n) * 2.0 ** rng.integers(-149, 127, n)).astype(np.float32)
  a[:5], b[5:10] = 0.0, 0.0
  # Subnormal quotients at rounding ties (odd multiples of 2^-149 halved), and operands of few mantissa
  # bits (exact and short quotients, where the remainder's sticky bit decides).
  k = rng.integers(1, 1 << 20, 2000)
  few = lambda: rng.integers(1, 64, 2000) * 2.0 ** rng.integers(-140, 100, 2000)
  a = np.concatenate([a, k * 2.0**-149, few()]).astype(np.float32)
  b = np.concatenate([b, 2.0 ** rng.integers(1, 4, 2000), few()]).astype(np.float32)
  with np.errstate(all="ignore"):
    want = a / b
  got = np.asarray(jax.jit(numerics.div_rn)(a, b))
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)  # 0 / 0
  np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _off_by_ulps(k):
  """A square root ``k`` ulps off (the backend's sqrt stands in for an inexact one, as the H200's)."""
  return lambda z: jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(jnp.sqrt(z), jnp.int32) + k, jnp.float32)


@pytest.mark.parametrize("off", [0, 1, -1, 2, -2])
def test_sqrt_rn_matches_ieee_including_subnormals_and_specials(off):
  rng = np.random.default_rng(0)
  bits = rng.integers(0, 0x7F800000, 200_000, dtype=np.int64).astype(np.uint32)  # every binade
  squares = (rng.integers(1 << 23, 1 << 24, 1000).astype(np.float32) * 2.0**-20) ** 2  # exact roots
  x = np.concatenate([bits.view(np.float32), squares, np.nextafter(squares, 0), np.array(
      [0.0, -0.0, np.inf, -np.inf, -1.0, np.nan, 1.0, 2.0, 0.25, 1e-45, 3.4e38, 4.0 - 2**-21,
       1.0 + 2**-23], np.float32)])
  with np.errstate(invalid="ignore"):
    want = np.sqrt(x)
  fn = numerics.sqrt_rn if off == 0 else functools.partial(_fp32._sqrt_corrected,
                                                         approx_sqrt=_off_by_ulps(off))
  got = np.asarray(jax.jit(fn)(x))
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_round_to_e4m3_matches_ml_dtypes():
  v = np.concatenate([np.linspace(0, 448, 20001), np.linspace(0, 2**-5, 5001)]).astype(np.float32)
  value, code = jax.jit(numerics.round_to_e4m3)(v)
  want = v.astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(code), want.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(value), want.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(numerics.e4m3_to_f32(code)), want.astype(np.float32))


@pytest.mark.parametrize(
    "kwargs,shape,match",
    [
        (dict(), (4, 24), r"axis 1: size 24 is not a multiple of 16"),
        (dict(axis=0), (20, 32), r"axis 0: size 20 is not a multiple of 16"),
        (dict(block=(16, 16)), (24, 32), r"axis 0 has size 24, not a multiple of 16"),
        (dict(block=(16, 16)), (32,), r"needs ndim >= 2"),
        (dict(block=(8, 8)), (32, 32), r"block must be \(1, 16\) or \(16, 16\)"),
        (dict(block=16), (32, 32), r"block must be"),
        (dict(axis=2), (32, 32), r"axis 2 out of range"),
        (dict(rounding="up"), (32, 32), r"rounding must be one of"),
        (dict(rounding="stochastic"), (32, 32), r"needs a `key`"),
    ],
)
def test_errors(kwargs, shape, match):
  with pytest.raises(ValueError, match=match):
    nvfp4.quantize(np.zeros(shape, np.float32), **kwargs)


def test_error_on_integer_input_and_hadamard_axis():
  with pytest.raises(ValueError, match="floating-point"):
    nvfp4.quantize(np.zeros((4, 16), np.int32))
  with pytest.raises(ValueError, match="not a multiple of 16"):
    nvfp4.hadamard(np.zeros((4, 24), np.float32), jax.random.key(0))


# ----------------------------------------------------------------------------------------------
# Four over Six


def _ftz(a):
  a = np.asarray(a, np.float32)
  return np.where(np.abs(a) < np.float32(2.0**-126), np.float32(0.0), a)


def _to_blocks(a, block, axis):
  """``a`` as (..., blocks, 16) (1×16) or (..., tiles, 16 rows, 16 columns) (16×16)."""
  if block == (16, 16):
    *lead, m, n = a.shape
    t = a.reshape(*lead, m // 16, 16, n // 16, 16)
    return np.moveaxis(t, -3, -2).reshape(*lead, (m // 16) * (n // 16), 16, 16)
  am = np.moveaxis(a, axis % a.ndim, -1)
  return am.reshape(*am.shape[:-1], am.shape[-1] // 16, 16)


def _from_blocks(b, shape, block, axis):
  if block == (16, 16):
    *lead, m, n = shape
    t = b.reshape(*lead, m // 16, n // 16, 16, 16)
    return np.moveaxis(t, -2, -3).reshape(shape)
  moved = list(shape)
  moved.append(moved.pop(axis % len(shape)))
  return np.moveaxis(b.reshape(moved), -1, axis % len(shape))


def _block_sum_ref(e, block):
  """Float32 sums of the last axis in order; 16×16: each row's, then the rows pairwise (8, 4, 2, 1)."""
  rows = e[..., 0]
  for i in range(1, 16):
    rows = (rows + e[..., i]).astype(np.float32)
  if block == (1, 16):
    return rows
  v = [rows[..., r] for r in range(16)]
  while len(v) > 1:
    h = len(v) // 2
    v = [(v[r] + v[r + h]).astype(np.float32) for r in range(h)]
  return v[0]


def quantize_4over6_ref(x, block, axis, rule):
  """Numpy/ml_dtypes transcription of Four over Six in Transformer Engine's order (nvfp4's docstring):
  ``(codes shaped like x, dscale per block, s_dec, map4 per block, (err4, err6) per block)``."""
  f32, flt_max = np.float32, np.finfo(np.float32).max
  x = _ftz(np.asarray(x).astype(f32))
  xb = _to_blocks(x, block, axis)  # (..., B, 16) or (..., B, 16, 16)
  tail = (-1,) if block == (1, 16) else (-2, -1)
  bamax = np.abs(xb).max(axis=tail)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    amax = f32(np.abs(x).max())
    s_enc = f32(np.minimum(f32(1536.0) / amax, flt_max))
    if amax == 0 or s_enc == 0:
      s_enc = f32(1.0)
    s_dec = f32(f32(1.0) / s_enc)
    base = (_ftz(bamax / f32(6.0)) * s_enc).astype(f32)
    sx = _ftz(xb * s_enc)
    cands = []
    for v in ((base * f32(1.5)).astype(f32), base):
      d = np.minimum(v, f32(448.0)).astype(ml_dtypes.float8_e4m3fn).astype(f32)
      escale = np.minimum(f32(1.0) / (d * s_dec), flt_max).astype(f32)
      de = d.reshape(d.shape + (1,) * len(tail))
      y = np.clip(xb * escale.reshape(de.shape), -6, 6).astype(f32)
      q = y.astype(ml_dtypes.float4_e2m1fn)
      codes = np.where((y == 0) | (de == 0), 0, q.view(np.uint8) & 0xF).astype(np.uint8)
      qv = np.where(de == 0, f32(0.0), q.astype(f32))
      e = _ftz(qv * de - sx)
      e = np.abs(e) if rule == "4over6_mae" else _ftz(e * e)
      cands.append((codes, d, _block_sum_ref(e, block)))
  (c4, d4, e4), (c6, d6, e6) = cands
  map4 = e4 < e6
  pick = map4.reshape(map4.shape + (1,) * len(tail))
  codes = _from_blocks(np.where(pick, c4, c6), x.shape, block, axis)
  dscale = np.where(map4, d4, d6)
  if block == (16, 16):
    *lead, m, n = x.shape
    dscale = dscale.reshape(*lead, m // 16, n // 16)
    map4 = map4.reshape(dscale.shape)
  else:
    dscale = np.moveaxis(dscale, -1, axis % x.ndim)
    map4 = np.moveaxis(map4, -1, axis % x.ndim)
  return codes, dscale, s_dec, map4, (e4, e6)


RULES_4OVER6 = ("4over6_mse", "4over6_mae")


@pytest.mark.parametrize("rule", RULES_4OVER6)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block,axis", LAYOUTS, ids=["1x16_last", "1x16_first", "16x16"])
def test_4over6_bit_exact_against_numpy_transcription(rule, dtype, block, axis):
  for name, x in sorted(INPUTS.items()):
    x = x.astype(dtype)
    t = _jit_quantize(block, axis, rule)(x)
    codes, dscale, s_dec, _, _ = quantize_4over6_ref(x, block, axis, rule)
    np.testing.assert_array_equal(_codes(t), codes, err_msg=name)
    np.testing.assert_array_equal(np.asarray(t.block_scales()), dscale, err_msg=name)
    assert np.asarray(t.global_scale).view(np.uint32) == np.float32(s_dec).view(np.uint32), name
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(t)),
                                  dequantize_ref(codes, dscale, s_dec, block, axis), err_msg=name)


def _crafted():
  """Rows of 16 (one 1×16 block each) with global amax 6, so S_enc = 1536 / 6 = 256: the amax-6
  block's candidate scales are 256 (amax to 6) and 384 (amax to 4), both exact in E4M3."""
  rows = {
      "four wins": [6.0] + [4.5] * 15,      # to 4: 6 -> 4, 4.5 -> 3, exact; to 6: 4.5 -> 4
      "six wins": [6.0] + [1.0] * 15,       # to 6: exact; to 4: 1 -> 2/3 -> 0.5 (0.75)
      "tie": [6.0, 3.0] + [0.0] * 14,       # exact either way: the amax-to-6 scale
      "all zero": [0.0] * 16,
      "one huge": [5.0] + [0.01] * 15,      # to 6: 5 -> scale 208, 5 -> 6 (6.15); to 4: 320, 5 -> 4
      "negative four wins": [-6.0] + [-4.5] * 15,
  }
  return list(rows), np.array(list(rows.values()), np.float32)


@pytest.mark.parametrize("rule", RULES_4OVER6)
def test_4over6_choice_on_crafted_blocks(rule):
  names, x = _crafted()
  t = nvfp4.quantize(x, scale_rule=rule)
  codes, dscale, s_dec, map4, (e4, e6) = quantize_4over6_ref(x, (1, 16), -1, rule)
  np.testing.assert_array_equal(_codes(t), codes)
  np.testing.assert_array_equal(np.asarray(t.block_scales()), dscale)
  assert float(t.global_scale) == 1 / 256
  want = {"four wins": True, "six wins": False, "tie": False, "all zero": False, "one huge": True,
          "negative four wins": True}
  assert dict(zip(names, map4[:, 0].tolist())) == want
  scales = dict(zip(names, np.asarray(t.block_scales())[:, 0].tolist()))
  assert scales == {"four wins": 384.0, "six wins": 256.0, "tie": 256.0, "all zero": 0.0, "one huge": 320.0,
                    "negative four wins": 384.0}
  deq = np.asarray(t.dequantize())
  for exact in ("four wins", "six wins", "tie", "all zero", "negative four wins"):
    np.testing.assert_array_equal(deq[names.index(exact)], x[names.index(exact)])
  i = names.index("tie")
  assert e4[i, 0] == e6[i, 0] == 0.0
  np.testing.assert_array_equal(_codes(t)[names.index("all zero")], 0)


@pytest.mark.parametrize("rule", RULES_4OVER6)
@pytest.mark.parametrize("block,axis", LAYOUTS, ids=["1x16_last", "1x16_first", "16x16"])
def test_4over6_never_worse_than_its_amax_to_6_candidate(rule, block, axis):
  """Per block, the kept candidate's error (float64, from the dequantized values) is at most that of
  the amax-to-6 candidate under the same global scale; over the tensor, below the "max" rule's."""
  x = INPUTS["lognormal_s3"].astype(np.float32)
  t = _jit_quantize(block, axis, rule)(x)
  _, _, _, map4, _ = quantize_4over6_ref(x, block, axis, rule)
  err = (lambda d: (d - x.astype(np.float64)) ** 2) if rule == "4over6_mse" else (
      lambda d: np.abs(d - x.astype(np.float64)))
  per_block = lambda d: _to_blocks(err(np.asarray(d, np.float64)), block, axis).reshape(
      *_to_blocks(x, block, axis).shape[:-1 if block == (1, 16) else -2], -1).sum(-1)
  got, six = per_block(nvfp4.dequantize(t)), per_block(_six_candidate(x, block, axis))
  map4 = _to_blocks(np.repeat(np.repeat(map4, 16, -2), 16, -1) if block == (16, 16) else
                    np.repeat(map4, 16, axis), block, axis).reshape(*got.shape, -1)[..., 0]
  assert map4.any() and not map4.all()
  assert np.all(got <= six * (1 + 1e-6))
  np.testing.assert_array_equal(got[~map4], six[~map4])  # kept: the amax-to-6 candidate itself
  assert np.all(got[map4] < six[map4])
  max_rule = nvfp4.dequantize(_jit_quantize(block, axis, "max")(x))
  assert got.sum() < per_block(max_rule).sum()


def _six_candidate(x, block, axis):
  """Dequantized amax-to-6 candidate of 4/6 (S_enc from 256), from the numpy transcription."""
  f32 = np.float32
  x = _ftz(x.astype(f32))
  xb = _to_blocks(x, block, axis)
  tail = (-1,) if block == (1, 16) else (-2, -1)
  amax = f32(np.abs(x).max())
  s_enc = f32(f32(1536.0) / amax)
  s_dec = f32(f32(1.0) / s_enc)
  d = np.minimum(_ftz(np.abs(xb).max(axis=tail) / f32(6.0)) * s_enc, f32(448.0)).astype(
      ml_dtypes.float8_e4m3fn).astype(f32)
  de = d.reshape(d.shape + (1,) * len(tail))
  with np.errstate(divide="ignore"):
    escale = np.minimum(f32(1.0) / (de * s_dec), np.finfo(f32).max).astype(f32)
  q = np.clip(xb * escale, -6, 6).astype(f32).astype(ml_dtypes.float4_e2m1fn).astype(f32)
  return _from_blocks(np.where(de == 0, 0, q) * de * s_dec, x.shape, block, axis).astype(np.float64)


# Relative squared and absolute errors, sum (d - x)^2 / sum x^2 and sum |d - x| / sum |x|, of the
# standard-normal 64×256 tensor of INPUTS (float32), per scale rule and layout.
GOLDEN_ERRORS = {
    ("max", (1, 16)): (9.136863e-03, 8.975633e-02),
    ("4over6_mse", (1, 16)): (7.743050e-03, 8.657714e-02),
    ("4over6_mae", (1, 16)): (7.979812e-03, 8.548693e-02),
    ("max", (16, 16)): (1.229393e-02, 1.087252e-01),
    ("4over6_mse", (16, 16)): (1.230887e-02, 1.092287e-01),
    ("4over6_mae", (16, 16)): (1.237698e-02, 1.090097e-01),
}


@pytest.mark.parametrize("rule,block", list(GOLDEN_ERRORS), ids=[f"{r}-{b[0]}x{b[1]}" for r, b in GOLDEN_ERRORS])
def test_golden_errors_per_scale_rule(rule, block):
  """Pinned error figures: 4/6 takes 15% off the squared error of 1×16 blocks of Gaussian data (its
  rule's own metric the lowest); 16×16 tiles (256 elements under one scale) rarely map to 4."""
  x = INPUTS["normal"].astype(np.float32)
  d = np.asarray(_jit_quantize(block, -1, rule)(x).dequantize(), np.float64)
  x = x.astype(np.float64)
  got = (((d - x) ** 2).sum() / (x**2).sum(), np.abs(d - x).sum() / np.abs(x).sum())
  np.testing.assert_allclose(got, GOLDEN_ERRORS[rule, block], rtol=1e-5)


def test_4over6_errors_and_non_finite():
  x = np.ones((4, 32), np.float32)
  with pytest.raises(ValueError, match="scale_rule must be one of"):
    nvfp4.quantize(x, scale_rule="4over6")
  with pytest.raises(ValueError, match="rounding='nearest' only"):
    nvfp4.quantize(x, rounding="stochastic", key=jax.random.key(0), scale_rule="4over6_mae")
  x[1, 3] = np.nan
  t = nvfp4.quantize(x, scale_rule="4over6_mse")
  assert np.isnan(float(t.global_scale)) and not np.asarray(t.codes).any()
  assert np.isnan(np.asarray(t.dequantize())).all()
  # The global scale under 4/6: S_enc = 1536 / amax.
  assert float(nvfp4.quantize(np.full((1, 16), 3.0, np.float32), scale_rule="4over6_mae").global_scale) == 1 / 512


def test_code_indices_and_encode_scales_are_quantizes_own():
  """``code_indices`` / ``with_code_indices`` round-trip the packed codes; ``encode_scales`` is the
  factor the codes were rounded at: x · escale rounded to nearest E2M1 gives the codes' values."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8)) * 3.0, jnp.float32)
  t = nvfp4.quantize(x, axis=0)
  code = t.code_indices()
  assert code.shape == x.shape and code.dtype == jnp.uint8 and int(code.max()) < 16
  again = t.with_code_indices(code)
  np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(t.codes))
  flipped = t.with_code_indices(code ^ 8)  # the sign bit: every value negated
  np.testing.assert_array_equal(np.asarray(flipped.dequantize()), -np.asarray(t.dequantize()))
  scaled = x * jnp.repeat(t.encode_scales(), 16, axis=0)
  grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
  nearest = np.asarray(grid[np.abs(np.abs(np.asarray(scaled))[..., None] - grid).argmin(-1)])
  np.testing.assert_array_equal(np.abs(np.asarray(t.elements())), nearest)


def test_div_rn_normal_is_ieee_division_on_normal_floats_and_by_constants():
  """``div_rn_normal`` on the CPU (its IEEE division) gives ``div_rn``'s bits, numpy's, wherever the
  operands and the quotient are normal or the quotient overflows, also with a constant divisor (which
  XLA would otherwise turn into a product by a rounded reciprocal); it flushes a subnormal quotient."""
  from fp4jax._fp32 import div_rn_normal
  rng = np.random.default_rng(0)
  n = 50_000
  a = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-126, 128, n)).astype(np.float32)
  b = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-126, 128, n)).astype(np.float32)
  with np.errstate(all="ignore"):
    want = a / b
  keep = ~((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny))
  got = np.asarray(jax.jit(div_rn_normal)(a, b))
  np.testing.assert_array_equal(got[keep].view(np.uint32), want[keep].view(np.uint32))
  np.testing.assert_array_equal(got[~keep], 0.0)
  assert (~keep).sum() > 100 and np.isinf(want).sum() > 100
  for c in (6.0, 3.0, 2688.0, 10.0):  # 1/c inexact: a product by it rounds differently for some a
    with np.errstate(all="ignore"):
      want = a / np.float32(c)
    got = np.asarray(jax.jit(lambda a, c=c: div_rn_normal(a, jnp.float32(c)))(a))
    keep = np.abs(want) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got[keep].view(np.uint32), want[keep].view(np.uint32))
    assert (a * (np.float32(1) / np.float32(c)) != want)[keep].any()  # the trap is exercised
  # On other backends it is div_rn: lowered for CUDA, its integer long division (shifts) is there.
  lower = lambda *platform: jax.jit(div_rn_normal).trace(a[:16], b[:16]).lower(
      lowering_platforms=platform or None).as_text()
  assert "shift_left" in lower("cuda") and "shift_left" not in lower()


def test_global_scales_with_the_cpus_division_keep_the_exact_bits_down_to_normal_decode_scales():
  """``_global_scales`` (the CPU's division) equals ``div_rn``'s straight-line ``S_enc``, ``S_dec`` and
  escale table for amax from 0 and the smallest normal to FLT_MAX, under both E4M3 bounds, wherever
  ``S_dec`` is normal; below (amax < ~3e-35) the CPU stores ``S_dec = 0``."""
  rng = np.random.default_rng(0)
  amax = np.concatenate([[0.0, np.finfo(np.float32).tiny, 1e-36, 1e-34, 1.0, 6.0, 448.0,
                          np.finfo(np.float32).max],
                         rng.uniform(1, 2, 400) * 2.0 ** rng.integers(-126, 128, 400)]).astype(np.float32)
  for e4m3_max in (nvfp4.E4M3_MAX, nvfp4.E4M3_MAX_4OVER6):
    got = jax.jit(jax.vmap(lambda a, e=e4m3_max: nvfp4._global_scales(a, e)))(amax)

    def exact(a, e=e4m3_max):
      s_enc = nvfp4._encode_scale(numerics.div_rn(jnp.float32(e * 6.0), a), a)
      s_dec = numerics.div_rn(jnp.float32(1.0), s_enc)
      table = numerics.div_rn(jnp.float32(1.0), numerics.e4m3_to_f32(nvfp4._E4M3_CODES) * s_dec)
      return s_enc, s_dec, jnp.minimum(table, numerics.F32_MAX)
    want = jax.jit(jax.vmap(exact))(amax)
    normal = np.asarray(want[1]) >= np.finfo(np.float32).tiny
    assert not normal[1] and normal[3]  # a subnormal S_dec is covered, and the first normal ones
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g)[normal].view(np.uint32),
                                    np.asarray(w)[normal].view(np.uint32))
    np.testing.assert_array_equal(np.asarray(got[1])[~normal], 0.0)
