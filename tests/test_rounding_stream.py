"""The stochastic-rounding bit streams, ``"counter"`` (``numerics.counter_bits``) against ``"random"``
(``jax.random.bits``), through ``nvfp4.quantize(..., rounding="stochastic", bits=...)``.

The counter stream is checked at 32-bit indices (every tensor of fewer than 2^32 elements: the bits
of a reference written out here in numpy, as the hash was defined for 32-bit indices) and at 64-bit
ones (a window of a tensor of 2^40 elements, ``offset``: no tensor that large fits this machine).
Every statistic is compared with its exact expectation: for the counter stream the quantizer's
outcome depends on one byte per element, so the expectation over the 256 bytes is enumerated; for
the random stream (22 bits) the expectation is the unbiased rounding itself. Thresholds are |z| < 5
and a chi-square p-value above 1e-4, fixed seeds throughout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from fp4jax import numerics, nvfp4

KEY = jax.random.key(20261206)
HIGH = 2**40 + 2**33  # a window of a 2^41-element tensor: its pair indices' high word is 2^7 + 1
SOURCES = ("random", "counter", "counter_high")
Z_MAX, P_MIN = 5.0, 1e-4
M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# The reference: the counter hash written out in numpy


def _mix32_np(x):
  x = np.asarray(x, np.uint64) & M32
  x ^= x >> 16
  x = (x * 0x7FEB352D) & M32
  x ^= x >> 15
  x = (x * 0x846CA68B) & M32
  return x ^ (x >> 16)


def _words_np(key):
  data = np.asarray(jax.random.key_data(key)).reshape(-1).astype(np.uint64)
  return _mix32_np(data[0] ^ 0x9E3779B9), _mix32_np(data[-1] ^ 0x85EBCA6B)


def _byte_bits_np(h, byte):
  return (((h >> (8 * byte)) & 0xFF) << 24) | (1 << 23)


def counter_bits_32(key, shape, lane=0):
  """The counter bits of tensors of fewer than 2^32 elements, with 32-bit flat indices: element ``e``
  takes byte ``2 * lane + e % 2`` of ``mix(mix((e // 2) ^ k1) + k2)``."""
  size = int(np.prod(shape))
  assert size < 2**32
  k1, k2 = _words_np(key)
  e = np.arange(size, dtype=np.uint64)
  h = _mix32_np(((_mix32_np((e >> 1) ^ k1) + k2) & M32))
  return _byte_bits_np(h, 2 * lane + (e & 1)).astype(np.uint32).reshape(shape)


def counter_bits_64(key, first, n, lane=0):
  """The counter bits of flat elements ``first + [0, n)`` of a tensor of any size: the pair index's
  high word ``hi`` keys the hash through ``k2 ^ mix(hi)``; ``mix(0) = 0``."""
  k1, k2 = _words_np(key)
  e = [first + i for i in range(n)]
  pair_hi = np.array([(i >> 1) >> 32 for i in e], np.uint64)
  pair_lo = np.array([(i >> 1) & M32 for i in e], np.uint64)
  h = _mix32_np((_mix32_np(pair_lo ^ k1) + (k2 ^ _mix32_np(pair_hi))) & M32)
  return _byte_bits_np(h, 2 * lane + np.array([i & 1 for i in e], np.uint64)).astype(np.uint32)


@pytest.mark.parametrize("shape", [(7,), (4, 8), (3, 5, 16), (2, 33)])
@pytest.mark.parametrize("lane", [0, 1])
def test_counter_bits_are_those_of_32_bit_indices(shape, lane):
  key = jax.random.fold_in(KEY, len(shape))
  np.testing.assert_array_equal(numerics.counter_bits(key, shape, lane), counter_bits_32(key, shape, lane))


@pytest.mark.parametrize("first", [0, 5, 2**32 - 24, 2**33 - 8, HIGH - 3, 2**64 - 16])
@pytest.mark.parametrize("lane", [0, 1])
def test_counter_bits_of_a_window(first, lane):
  """``offset``: the elements ``[first, first + 16)`` of a larger tensor, across 2^32 (the end of
  32-bit element indices), 2^33 (of 32-bit pair indices) and up to 2^64."""
  got = numerics.counter_bits(KEY, (2, 8), lane, offset=first)
  np.testing.assert_array_equal(np.asarray(got).reshape(-1), counter_bits_64(KEY, first, 16, lane))


def test_64_bit_indices_leave_32_bit_bits_unchanged():
  """Below 2^33 elements the pair index's high word is 0: the 64-bit hash is the 32-bit one (the
  reference's two forms agree), and a window through the 64-bit path (which starts past 2^32)
  continues the 32-bit path's bits."""
  key = jax.random.fold_in(KEY, 1)
  np.testing.assert_array_equal(counter_bits_64(key, 0, 40), counter_bits_32(key, (40,)))
  straddle = np.asarray(numerics.counter_bits(key, (32,), offset=2**32 - 16))
  below = np.asarray(numerics.counter_bits(key, (15,), offset=2**32 - 16))  # the last 32-bit index is 2^32 - 2
  np.testing.assert_array_equal(straddle[:15], below)
  np.testing.assert_array_equal(straddle[16:], np.asarray(numerics.counter_bits(key, (16,), offset=2**32)))


def test_counter_bits_trace_past_2_32_elements():
  """A tensor of more than 2^32 elements (traced, not allocated) takes counter bits and quantizes."""
  x = jax.ShapeDtypeStruct((2**16 + 16, 2**16), jnp.bfloat16)
  t = jax.eval_shape(lambda x, k: nvfp4.quantize(x, rounding="stochastic", bits=numerics.counter_bits(k, x.shape, 1)),
                     x, KEY)
  assert t.codes.shape == (2**16 + 16, 2**15)


@pytest.mark.parametrize("size,first,row", [(37, 2**32 - 8, 4), (9, 3, 1), (100, 0, 8), (5, 2**64 - 5, None),
                                            (70000, 2**32 - 65536, None), (0, 7, None)])
def test_flat_index_words(size, first, row):
  hi, lo = (np.asarray(w).astype(object) for w in numerics.flat_index_words(size, first, row))
  np.testing.assert_array_equal((hi << 32) | lo, np.array([first + i for i in range(size)], object))


@pytest.mark.parametrize("bad", [dict(lane=2), dict(offset=-1), dict(offset=1.0), dict(offset=True),
                                 dict(offset=2**64 - 15)])
def test_counter_bits_rejects(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    numerics.counter_bits(KEY, (16,), **bad)


# ----------------------------------------------------------------------------------------------
# Draws and their exact expectations


def _bits(source, key, shape, lane=0, offset=0):
  if source == "random":
    return jax.random.bits(key, shape, jnp.uint32)
  return numerics.counter_bits(key, shape, lane, offset=offset + (HIGH if source == "counter_high" else 0))


def _dequantize(x, bits):
  return nvfp4.quantize(x, rounding="stochastic", bits=bits).dequantize()


@functools.partial(jax.jit, static_argnames=("source", "lane", "offset"))
def _draws(x, keys, source, lane=0, offset=0):
  """The dequantized stochastic roundings of ``x``, one per key: (keys, *x.shape)."""
  return jax.vmap(lambda k: _dequantize(x, _bits(source, k, x.shape, lane, offset)))(keys)


@jax.jit
def _per_byte(x):
  """``x`` rounded with bits 0 (always down), 2^32 - 1 (up unless on the grid) and each of the 256
  counter bytes (``lane_bits``), every element alike: (258, *x.shape)."""
  words = jnp.concatenate([jnp.array([0, M32], jnp.uint32), numerics.lane_bits(jnp.arange(256, dtype=jnp.uint32), 0)])
  return jax.vmap(lambda b: _dequantize(x, jnp.full(x.shape, b)))(words)


def _moments(x, source):
  """Per element of ``x`` (float64, flat): the two neighbouring grid values ``lo``, ``hi`` (in x's
  units, signed; equal for an element on the grid or clamped to its block's 6, whose rounding is
  certain), the probability ``p`` of rounding to ``hi``, the expectation and the variance of one
  rounding under ``source``: enumerated over the 256 bytes for the counter streams, the exact
  unbiased rounding for the random one."""
  xf = np.asarray(x, np.float64).reshape(-1)
  lo, hi, *q = np.asarray(_per_byte(x), np.float64).reshape(258, -1)
  step = hi - lo
  if source == "random":
    p = np.divide(xf - lo, step, out=np.zeros_like(xf), where=step != 0)
    return lo, hi, p, lo + p * step, p * (1 - p) * step**2
  q = np.array(q)
  return lo, hi, (q == hi).mean(0) * (step != 0), q.mean(0), q.var(0)


def _keys(base, n, start=0):
  return jax.vmap(functools.partial(jax.random.fold_in, base))(jnp.arange(start, start + n, dtype=jnp.uint32))


# ----------------------------------------------------------------------------------------------
# The error of k averaged roundings falls as 1/k


def _gaussian(shape, seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return jax.random.normal(k1, shape) * jnp.exp(jax.random.normal(k2, shape[:-1] + (1,)))


def _check_mean_of_k(source, ks, shape):
  """Over the elements whose rounding is random (not on the grid, not clamped to 6 by their block's
  rounded scale: a bias that every stream shares)."""
  x = _gaussian(shape, 1)
  lo, hi, _, mean, var = _moments(x, source)
  ok = lo != hi
  xf, mean, var = (v[ok] for v in (np.asarray(x, np.float64).reshape(-1), mean, var))
  bias2, n = (mean - xf) ** 2, xf.size
  base, chunk = jax.random.fold_in(KEY, 11), 128
  q = np.concatenate([np.asarray(_draws(x, _keys(base, chunk, j), source), np.float64).reshape(chunk, -1)[:, ok]
                      for j in range(0, sum(ks), chunk)])
  mse, se, want, start = [], [], [], 0
  for k in ks:  # disjoint groups of draws: independent estimates
    e2 = (q[start:start + k].mean(0) - xf) ** 2
    start += k
    mse.append(e2.mean())
    se.append(e2.std() / np.sqrt(n))
    want.append((bias2 + var / k).mean())
  mse, se, want = map(np.array, (mse, se, want))
  z = (mse - want) / se
  assert np.abs(z).max() < Z_MAX, (source, z)
  # The slope of log MSE against log k, against the expected curve's (-1, up to the 8-bit bias).
  lk, w = np.log(ks), (mse / se) ** 2
  lk_c = lk - (w * lk).sum() / w.sum()
  slope = lambda y: (w * lk_c * y).sum() / (w * lk_c**2).sum()  # weighted least squares
  slope_se = 1 / np.sqrt((w * lk_c**2).sum())
  assert abs(slope(np.log(mse)) - slope(np.log(want))) < Z_MAX * slope_se, (source, slope(np.log(mse)))
  assert abs(slope(np.log(want)) + 1) < 0.01  # no floor within k <= 1024: the bias term is tiny
  # The largest k's point on the 1/k line through k = 1 (the expected MSE of one rounding), within
  # its sampling error and the 8-bit bias that the line leaves out.
  v1, k = (bias2 + var).mean(), ks[-1]
  assert abs(mse[-1] * k / v1 - 1) < Z_MAX * se[-1] / mse[-1] + bias2.mean() * k / v1
  return mse


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_mean_of_k_roundings_error_falls_as_1_over_k_to_1024(source):
  _check_mean_of_k(source, [2**j for j in range(11)], (16, 256))


# ----------------------------------------------------------------------------------------------
# Misalignment <x, q> / <x, x> - 1


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_mean_misalignment_is_zero(source):
  """Over the elements whose rounding is random (``_check_mean_of_k``)."""
  x = _gaussian((32, 256), 2)
  lo, hi, _, mean, _ = _moments(x, source)
  ok = lo != hi
  xf, mean = np.asarray(x, np.float64).reshape(-1)[ok], mean[ok]
  q = np.asarray(_draws(x, _keys(jax.random.fold_in(KEY, 12), 256), source), np.float64).reshape(256, -1)[:, ok]
  xx = xf @ xf
  m = q @ xf / xx - 1
  want = mean @ xf / xx - 1  # 0 for the random stream; the 8-bit probabilities' tiny bias for the counter
  assert abs(want) < 1e-4
  assert abs(m.mean() - want) < Z_MAX * m.std(ddof=1) / np.sqrt(m.size), (m.mean(), want, m.std())


# ----------------------------------------------------------------------------------------------
# Round-up frequency against the fractional position


SEGMENTS = ((0, 0.5), (0.5, 1), (1, 1.5), (1.5, 2), (2, 3), (3, 4), (4, 6))  # E2M1's steps
EDGES = (0, 0.01, 0.1, 0.2, 0.3, 0.4, 0.49, 0.499, 0.5, 0.5, 0.501, 0.51, 0.6, 0.7, 0.8, 0.9, 0.99, 1)


def _grid_data(per_cell, seed):
  """Rows of 16: element 0 is ±6 (every block's and the tensor's amax: the scales are 448 and 1/448,
  a scaled value is the value), the others sit in a step of E2M1 (each of ``SEGMENTS``) at a
  fractional position in one bin of ``EDGES`` (the bin [0.5, 0.5] is the midpoint itself: the
  tie), ``per_cell`` of each (segment, bin), in random order and sign. Returns x and each element's
  cell (-1 for the amax)."""
  rng = np.random.default_rng(seed)
  vals, cells = [], []
  for s, (lo, hi) in enumerate(SEGMENTS):
    for b, (f0, f1) in enumerate(zip(EDGES[:-1], EDGES[1:])):
      f = rng.uniform(f0, f1, per_cell) if f1 > f0 else np.full(per_cell, f0)
      vals.append(lo + f * (hi - lo))
      cells.append(np.full(per_cell, s * (len(EDGES) - 1) + b))
  order = rng.permutation(sum(v.size for v in vals))
  vals, cells = np.concatenate(vals)[order], np.concatenate(cells)[order]
  rows = -(-vals.size // 15)
  pad = rows * 15 - vals.size
  vals, cells = np.concatenate([vals, np.full(pad, 3.0)]), np.concatenate([cells, np.full(pad, -1)])
  x = np.concatenate([np.full((rows, 1), 6.0), vals.reshape(rows, 15)], axis=1)
  cell = np.concatenate([np.full((rows, 1), -1), cells.reshape(rows, 15)], axis=1)
  x *= rng.choice([-1.0, 1.0], x.shape)
  return jnp.asarray(x, jnp.float32), cell.reshape(-1)


def _ups(q, lo, hi):
  """Round-up decisions (n, elements): 1 where a rounding gave ``hi``."""
  q = np.asarray(q, np.float64).reshape(q.shape[0], -1)
  assert ((q == lo) | (q == hi)).all()  # every rounding is to one of the two neighbours
  return (q == hi) & (lo != hi)


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_round_up_frequency_chi2(source):
  x, cell = _grid_data(30, 3)
  lo, hi, p, _, _ = _moments(x, source)
  free = cell >= 0
  xf, lo_f, hi_f = (np.abs(v[free]) for v in (np.asarray(x, np.float64).reshape(-1), lo, hi))
  f = (xf - lo_f) / (hi_f - lo_f)  # the fractional position in its step
  assert ((f > 0) & (f < 1)).all()
  if source != "random":  # 8 bits: each probability within 1/512 of the position (lane_bits)
    assert np.abs(p[free] - f).max() <= 1 / 512 + 1e-6
  n = 256
  u = _ups(_draws(x, _keys(jax.random.fold_in(KEY, 13), n), source), lo, hi)
  ncell = len(SEGMENTS) * (len(EDGES) - 1)
  obs = np.bincount(cell[free], u.sum(0)[free], ncell)
  exp = n * np.bincount(cell[free], p[free], ncell)
  var = n * np.bincount(cell[free], (p * (1 - p))[free], ncell)
  fixed = var == 0  # cells whose roundings are certain (8 bits: positions below 1/512 of a step)
  np.testing.assert_array_equal(obs[fixed], exp[fixed])
  chi2 = (((obs - exp) ** 2)[~fixed] / var[~fixed]).sum()
  assert stats.chi2.sf(chi2, (~fixed).sum()) > P_MIN, chi2


# ----------------------------------------------------------------------------------------------
# No correlation between round-up decisions


def _z_products(r_a, r_b):
  """z of the sum of products of standardized residuals over pairs (0 mean, unit variance each
  under independence)."""
  prod = (r_a * r_b).reshape(-1)
  return prod.sum() / np.sqrt(prod.size)


def _residuals(q, lo, hi, p, ok):
  u = _ups(q, lo, hi)
  return np.where(ok, (u - p) / np.sqrt(np.where(ok, p * (1 - p), 1)), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_no_correlation(source):
  """Standardized round-up residuals of element pairs: neighbours in a row (the two elements of one
  counter hash, and of adjacent hashes), in a column, lanes 0 and 1 of the counter stream, one step
  and the next (``fold_in`` of the step), two layers (distinct keys) at one step, and for the
  counter the same element at pair indices of a different high word."""
  x, _ = _grid_data(30, 4)
  lo, hi, p, _, _ = _moments(x, source)
  ok = (p > 0.05) & (p < 0.95)
  n = 64
  layer = [jax.random.fold_in(KEY, 100 + i) for i in range(2)]
  r = lambda keys, **kw: _residuals(_draws(x, keys, source, **kw), lo, hi, p, ok)
  now, later, other = r(_keys(layer[0], n)), r(_keys(layer[0], n, 1)), r(_keys(layer[1], n))
  w = x.shape[1]
  flat = now.reshape(n, -1)
  z = {"same hash": _z_products(flat[:, 0::2], flat[:, 1::2]),
       "adjacent hashes": _z_products(flat[:, 1:-1:2], flat[:, 2::2]),
       "column": _z_products(flat[:, :-w], flat[:, w:]),
       "steps": _z_products(now, later), "layers": _z_products(now, other)}
  if source != "random":
    z["lanes"] = _z_products(now, r(_keys(layer[0], n), lane=1))
    z["high word"] = _z_products(now, r(_keys(layer[0], n), offset=2**33 * 3))
  assert max(abs(v) for v in z.values()) < Z_MAX, z


@pytest.mark.parametrize("source", ["counter", "counter_high"])
def test_counter_bytes_uniform(source):
  """Each lane's bytes over 2^16 elements and 4 keys: chi-square against uniform, and every byte
  word ends in the half step (``lane_bits``)."""
  for lane in (0, 1):
    bits = np.asarray(jax.vmap(lambda k: _bits(source, k, (2**16,), lane))(_keys(KEY, 4)))
    assert ((bits & 0xFFFFFF) == 1 << 23).all()
    counts = np.bincount((bits >> 24).reshape(-1), minlength=256)
    assert stats.chisquare(counts).pvalue > P_MIN
