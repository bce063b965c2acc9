"""fp4jax.kernels.nvfp4_quantize: the kernels equal nvfp4.quantize bit for bit (interpret mode on the
CPU), the decoded operand equals scaled_elements, and every variant lowers to Triton for an H200."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import H200, RUN_OPTIMIZED

from fp4jax import numerics, nvfp4
from fp4jax.kernels import _common as C
from fp4jax.kernels import nvfp4_quantize as kq

# Small tiles: several programs per axis and ragged edges on the CPU.
SMALL = kq.BlockSizes(quantize_elements=256, amax_elements=512)
KEY, HKEY = jax.random.key(7), jax.random.key(9)


_STATIC = ("block", "axis", "rounding", "bit_source", "scale_rule", "decoded", "block_sizes", "amax", "interpret")
# The kernels and their reference, each one program (not an op-by-op run of its jnp code).
_quantize = jax.jit(kq.quantize, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _reference(x, **kw):
  """``quantize_reference``'s tensor, its decoded operand and its float32 values."""
  t = kq.quantize_reference(x, **kw)
  return t, t.scaled_elements(jnp.bfloat16), t.dequantize(jnp.float32)


def _bits(a):
  a = np.asarray(a)
  if a.dtype == ml_dtypes.float8_e4m3fn or a.dtype == ml_dtypes.bfloat16 or a.dtype.kind == "f":
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
  return a


def _assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype
    gn, wn = np.isnan(np.asarray(g, np.float32)), np.isnan(np.asarray(w, np.float32))
    np.testing.assert_array_equal(gn, wn)
    np.testing.assert_array_equal(np.where(gn, 0, _bits(g)), np.where(wn, 0, _bits(w)))


def _data(shape, dtype, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.t(k1, 3.0, shape) * jnp.exp(jax.random.normal(k2, shape))  # heavy tails
  return x.astype(dtype)


# (name, shape, dtype, kwargs): each layout of the kernels, each rounding and bit source, the
# Hadamard transform along the token axis and along the last axis.
CASES = [
    ("rows nearest", (3, 5, 64), jnp.bfloat16, dict(), SMALL),
    ("rows stochastic", (24, 80), jnp.float32, dict(rounding="stochastic", key=KEY), None),
    ("tiles nearest", (2, 32, 48), jnp.float32, dict(block=(16, 16)), SMALL),
    ("tiles counter", (48, 32), jnp.bfloat16,
     dict(block=(16, 16), rounding="stochastic", key=KEY, bit_source="counter"), None),
    ("axis1 of 3 counter", (3, 32, 20), jnp.bfloat16,
     dict(axis=1, rounding="stochastic", key=KEY, bit_source="counter"), None),
    ("axis0 hadamard stochastic", (48, 40), jnp.bfloat16,
     dict(axis=0, hadamard_key=HKEY, rounding="stochastic", key=KEY), SMALL),
    ("last hadamard nearest", (20, 48), jnp.float32, dict(hadamard_key=HKEY), None),
    ("last hadamard stochastic", (20, 48), jnp.bfloat16,
     dict(hadamard_key=HKEY, rounding="stochastic", key=KEY), SMALL),
    ("last hadamard counter", (24, 80), jnp.float32,
     dict(hadamard_key=HKEY, rounding="stochastic", key=KEY, bit_source="counter"), SMALL),
    ("rows counter, divisor tiles", (40, 384), jnp.bfloat16,
     dict(rounding="stochastic", key=KEY, bit_source="counter"), SMALL),
]


@pytest.mark.parametrize("name,shape,dtype,kw,sizes", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_interpret_equals_nvfp4_quantize(name, shape, dtype, kw, sizes):
  """``quantize_reference`` is ``nvfp4.quantize`` (of ``nvfp4.hadamard(x)`` with a Hadamard key) with the
  bits of ``stochastic_bits``; ``SMALL`` tiles give several programs per axis and ragged edges."""
  x = _data(shape, dtype)
  got, dec = _quantize(x, decoded=True, block_sizes=sizes or kq.BlockSizes(), interpret=True, **kw)
  want, want_dec, want_f32 = _reference(x, **kw)
  _assert_same(got, want)
  # The decoded operand: scaled_elements in bf16, the global scale not applied.
  assert dec.dtype == jnp.bfloat16 and dec.shape == x.shape
  _assert_same(dec, want_dec)
  np.testing.assert_array_equal(np.asarray(dec, np.float32) * np.float32(want.global_scale), np.asarray(want_f32))


@pytest.mark.parametrize("fill", ["data", "nan"])
@pytest.mark.parametrize("kw", [dict(), dict(axis=0, hadamard_key=HKEY), dict(block=(16, 16))],
                         ids=["rows", "hadamard", "tiles"])
@pytest.mark.slow
def test_xla_amax_pass_equals_the_kernel(kw, fill):
  """``amax="xla"``: the first pass as an XLA reduction gives the kernel's tensor bit for bit (of the
  Hadamard transform too, and a NaN reaches the global scale either way)."""
  x = _data((48, 64), jnp.float32)
  if fill == "nan":
    x = x.at[3, 7].set(jnp.nan)
  got = _quantize(x, amax="xla", block_sizes=SMALL, interpret=True, **kw)
  _assert_same(got, _quantize(x, block_sizes=SMALL, interpret=True, **kw))
  assert np.isnan(float(got.global_scale)) == (fill == "nan")


@pytest.mark.parametrize("shape,axis,hadamard,used", [
    ((65536, 768), -1, False, 1.0),   # 48 blocks per row: 3 tiles of 16, none masked
    ((65536, 2304), -1, False, 1.0),
    ((8192, 384), 0, True, 1.0),      # 384 columns: 3 tiles of 128
    ((8192, 384), -1, True, 1.0),
    ((16384, 16384), -1, False, 1.0),
    ((64, 80), -1, False, 5 / 8),     # 5 blocks: no power of two >= 8 divides them, one masked tile
])
def test_tiles_divide_the_contiguous_axis(shape, axis, hadamard, used):
  """The share of the programs' block slots that hold blocks of the tensor (the rest are masked)."""
  lay = kq._layout(shape, (1, 16), axis % len(shape), hadamard, kq.BlockSizes().quantize_elements)
  grid = kq._grid(lay)
  tile_b = lay.tile[2] if lay.kind == "pairs" or lay.mid else lay.tile[1]
  assert lay.n_a * lay.n_b / (grid[0] * lay.tile[0] * grid[1] * tile_b) == used


@pytest.mark.slow
def test_stochastic_bits_are_nvfp4s():
  """The bits ``quantize_reference`` passes are those ``nvfp4.quantize`` draws from a key, and
  ``numerics.counter_bits``."""
  x = _data((16, 32), jnp.float32)
  _assert_same(kq.quantize_reference(x, rounding="stochastic", key=KEY),
               nvfp4.quantize(x, rounding="stochastic", key=KEY))
  np.testing.assert_array_equal(kq.stochastic_bits(KEY, (16, 32), "counter"),
                                numerics.counter_bits(KEY, (16, 32)))


@pytest.mark.parametrize("fill", ["zeros", "nan", "inf"])
@pytest.mark.slow
def test_zeros_and_non_finite_as_nvfp4(fill):
  x = _data((32, 64), jnp.float32)
  if fill == "zeros":
    x = jnp.zeros_like(x)
  else:
    x = x.at[5, 17].set(jnp.nan if fill == "nan" else -jnp.inf)
  got = _quantize(x, block_sizes=SMALL, interpret=True)
  _assert_same(got, jax.jit(nvfp4.quantize)(x))
  if fill == "zeros":
    assert float(got.global_scale) == 1.0 and not np.asarray(got.codes).any()
  else:  # non-finite: NaN global scale and every code zero
    assert np.isnan(float(got.global_scale)) and not np.asarray(got.codes).any()


def _numpy_butterfly(x, signs):
  """``H16 · (s ⊙ x) / 4`` along the last axis in NumPy float32: strides 1, 2, 4, 8, sum first."""
  v = [x[..., i] * signs[i] for i in range(16)]
  for stride in (1, 2, 4, 8):
    for i in range(16):
      if not i & stride:
        v[i], v[i + stride] = v[i] + v[i + stride], v[i] - v[i + stride]
  return np.stack(v, axis=-1) * np.float32(0.25)


def test_hadamard_is_one_fixed_order_of_additions():
  """``nvfp4.hadamard`` (which the kernels fuse) is the butterfly, bit for bit, on heavy-tailed
  data where a matrix product's rounding would depend on its summation order; it is the matrix
  ``hadamard_matrix(key)`` to float32 rounding."""
  x = _data((64, 32), jnp.float32)
  signs = np.asarray(kq.hadamard_signs(HKEY))
  want = _numpy_butterfly(np.asarray(x).T.reshape(32, 4, 16), signs).reshape(32, 64).T
  got = nvfp4.hadamard(x, HKEY, 0)
  _assert_same(got, jnp.asarray(want))
  _assert_same(jax.jit(nvfp4.hadamard, static_argnums=2)(x, HKEY, 0), got)
  h = np.asarray(nvfp4.hadamard_matrix(HKEY), np.float64)
  matrix = np.einsum("bi,ij->bj", np.asarray(x, np.float64).T.reshape(-1, 16), h).reshape(32, 64).T
  np.testing.assert_allclose(got, matrix, rtol=1e-5, atol=1e-5 * float(np.abs(matrix).max()))
  inverse = nvfp4.hadamard(got, HKEY, 0, inverse=True)
  np.testing.assert_allclose(inverse, x, rtol=1e-5, atol=1e-5 * float(jnp.abs(x).max()))


def test_bad_arguments():
  x = jnp.ones((32, 48), jnp.float32)
  with pytest.raises(ValueError, match="multiple of 16"):
    kq.quantize(jnp.ones((32, 40)), interpret=True)
  with pytest.raises(ValueError, match="multiple of 16"):
    kq.quantize(jnp.ones((24, 32)), block=(16, 16), interpret=True)
  with pytest.raises(ValueError, match="needs a `key`"):
    kq.quantize(x, rounding="stochastic", interpret=True)
  with pytest.raises(ValueError, match="bit_source"):
    kq.quantize(x, rounding="stochastic", key=KEY, bit_source="philox", interpret=True)
  with pytest.raises(ValueError, match="threefry2x32"):
    kq.quantize(x, rounding="stochastic", key=jax.random.key(0, impl="rbg"), interpret=True)
  with pytest.raises(ValueError, match="Hadamard"):
    kq.quantize(x, block=(16, 16), hadamard_key=HKEY, interpret=True)
  with pytest.raises(ValueError, match="floating-point"):
    kq.quantize(jnp.ones((4, 16), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    kq.BlockSizes(quantize_elements=100)
  with pytest.raises(ValueError, match="amax must be one of"):
    kq.quantize(x, amax="cuda", interpret=True)


def _mixed(shape, dtype, seed=0):
  """``_data`` with every other 16 rows (along axis -2) uniform in [-1, 1]: blocks and tiles of both
  kinds, where Four over Six keeps the amax-to-4 scale and where it keeps amax to 6."""
  uniform = jax.random.uniform(jax.random.key(seed + 100), shape, jnp.float32, -1.0, 1.0)
  rows = (jnp.arange(shape[-2]) // 16 % 2 == 0)[:, None]
  return jnp.where(rows, uniform, _data(shape, jnp.float32, seed)).astype(dtype)


# (name, shape, dtype, kwargs, block sizes) with a 4/6 rule: each layout, the Hadamard transform.
CASES_4OVER6 = [
    ("rows mse", (3, 5, 64), jnp.bfloat16, dict(scale_rule="4over6_mse"), SMALL),
    ("rows mae, divisor tiles", (40, 384), jnp.bfloat16, dict(scale_rule="4over6_mae"), SMALL),
    ("tiles mse", (2, 32, 48), jnp.float32, dict(block=(16, 16), scale_rule="4over6_mse"), SMALL),
    ("tiles mae", (48, 32), jnp.bfloat16, dict(block=(16, 16), scale_rule="4over6_mae"), None),
    ("axis1 of 3 mae", (3, 32, 20), jnp.bfloat16, dict(axis=1, scale_rule="4over6_mae"), None),
    ("axis0 mse", (48, 40), jnp.float32, dict(axis=0, scale_rule="4over6_mse"), SMALL),
    ("axis0 hadamard mse", (48, 40), jnp.bfloat16, dict(axis=0, hadamard_key=HKEY, scale_rule="4over6_mse"),
     SMALL),
    ("last hadamard mae", (20, 48), jnp.float32, dict(hadamard_key=HKEY, scale_rule="4over6_mae"), None),
]


@pytest.mark.parametrize("name,shape,dtype,kw,sizes", CASES_4OVER6, ids=[c[0] for c in CASES_4OVER6])
@pytest.mark.slow
def test_4over6_interpret_equals_nvfp4_quantize(name, shape, dtype, kw, sizes):
  """Four over Six: the kernels' codes, scales, global scale and decoded operand are
  ``nvfp4.quantize(..., scale_rule=...)``'s bit for bit, on data where some blocks keep the amax-to-4
  scale and others amax to 6."""
  from test_nvfp4 import quantize_4over6_ref

  x = _mixed(shape, dtype)
  got, dec = _quantize(x, decoded=True, block_sizes=sizes or kq.BlockSizes(), interpret=True, **kw)
  want, want_dec, _ = _reference(x, **kw)
  _assert_same(got, want)
  _assert_same(dec, want_dec)
  if "hadamard_key" not in kw:
    map4 = quantize_4over6_ref(np.asarray(x), want.block, want.axis, kw["scale_rule"])[3]
    assert map4.any() and not map4.all()


def test_4over6_bad_arguments():
  x = jnp.ones((32, 48), jnp.float32)
  with pytest.raises(ValueError, match="scale_rule must be one of"):
    kq.quantize(x, scale_rule="mse", interpret=True)
  with pytest.raises(ValueError, match="rounding='nearest' only"):
    kq.quantize(x, rounding="stochastic", key=KEY, scale_rule="4over6_mse", interpret=True)


def test_gradient_is_zero_as_nvfp4():
  x = _data((16, 32), jnp.float32)
  g = jax.grad(lambda a: jnp.sum(kq.quantize(a, decoded=True, interpret=True)[1].astype(jnp.float32)))(x)
  np.testing.assert_array_equal(g, 0.0)


LOWERING = [
    ((48, 96), dict()),
    ((2, 32, 64), dict(block=(16, 16), rounding="stochastic")),
    ((40, 96), dict(rounding="stochastic", bit_source="counter")),
    ((48, 96), dict(axis=0, hadamard=True, rounding="stochastic")),
    ((48, 96), dict(axis=0, rounding="stochastic", bit_source="counter")),
    ((40, 96), dict(hadamard=True)),
    ((64, 384), dict(rounding="stochastic", bit_source="counter")),  # divisor tiles (24 blocks per row)
]


@pytest.mark.parametrize("shape,kw", LOWERING, ids=[str(i) for i in range(len(LOWERING))])
def test_lowers_to_triton_for_h200(triton_modules, shape, kw):
  """Two Triton kernels (amax, quantize) and a handful of XLA ops around them; the quantizer divides
  with PTX's correctly rounded instruction."""
  kw = dict(kw)
  hadamard = kw.pop("hadamard", False)

  def f(x, key, hkey, amax="kernel"):
    return kq.quantize(x, key=key if kw.get("rounding") == "stochastic" else None,
                       hadamard_key=hkey if hadamard else None, decoded=True, amax=amax, **kw)

  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(f).trace(x, KEY, HKEY).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 2
  assert len(triton_modules) == 2
  amax, quant = sorted(triton_modules, key=lambda m: "nvfp4_quantize" in m)
  assert "@nvfp4_amax" in amax and "@nvfp4_quantize" in quant
  assert quant.count("div.rn.f32") >= 2  # the global scales and the block scales
  # Without the Hadamard signs (a jax.random draw in XLA), the program around the kernels is small.
  if not hadamard:
    assert len(hlo.splitlines()) < 200
  # With the amax pass in XLA: the quantizing kernel alone.
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(functools.partial(f, amax="xla")).trace(x, KEY, HKEY).lower(
        lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 1


LOWERING_4OVER6 = [
    ((48, 96), dict(scale_rule="4over6_mse")),
    ((2, 32, 64), dict(block=(16, 16), scale_rule="4over6_mae")),
    ((2, 32, 64), dict(block=(16, 16), scale_rule="4over6_mse")),
    ((48, 96), dict(axis=0, scale_rule="4over6_mae")),
    ((48, 96), dict(axis=0, hadamard=True, scale_rule="4over6_mse")),
    ((40, 96), dict(hadamard=True, scale_rule="4over6_mae")),
]


@pytest.mark.parametrize("shape,kw", LOWERING_4OVER6, ids=[str(i) for i in range(len(LOWERING_4OVER6))])
def test_4over6_lowers_to_triton_for_h200(triton_modules, shape, kw):
  """The 4/6 quantizer lowers to one Triton kernel of its own name beside the amax pass, without
  float4 or float8 types; it divides with PTX's correctly rounded instruction (the global scales,
  ``block_amax / 6``, both candidates' ``escale``) and rounds ``x * S_enc`` (and, for MSE, each
  square) with PTX ``mul.rn.f32``, which ptxas never fuses into the error sums."""
  kw = dict(kw)
  hadamard = kw.pop("hadamard", False)
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  f = lambda x, hkey: kq.quantize(x, hadamard_key=hkey if hadamard else None, decoded=True, **kw)
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(f).trace(x, HKEY).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 2
  amax, quant = sorted(triton_modules, key=lambda m: "nvfp4_quantize" in m)
  assert "@nvfp4_amax" in amax and f"_{kw['scale_rule']}" in quant
  for module in triton_modules:
    assert "f4E2M1" not in module and "f8E4M3" not in module
  assert quant.count("div.rn.f32") >= 4
  assert quant.count("mul.rn.f32") >= (2 if kw["scale_rule"] == "4over6_mse" else 1)


def test_max_rule_is_the_default_kernel():
  """``scale_rule="max"`` lowers to the very program of the default call (the 4/6 code is a separate
  branch under the static rule)."""
  x = jax.ShapeDtypeStruct((48, 96), jnp.bfloat16)
  lower = lambda **kw: jax.jit(lambda x: kq.quantize(x, decoded=True, **kw)).trace(x).lower(
      lowering_platforms=("cuda",)).as_text()
  with jax.sharding.use_abstract_mesh(H200):
    assert lower(scale_rule="max") == lower()


def _mismatches_on_every_float32(top: float, count) -> int:
  """``count(a)`` (mismatches of a float32 array) summed over every float32 in [0, top], in chunks."""
  top_bits, chunk = int(np.float32(top).view(np.uint32)), 1 << 25

  @functools.partial(jax.jit, compiler_options=RUN_OPTIMIZED)
  def chunk_count(start):
    b = start + jnp.arange(chunk, dtype=jnp.uint32)
    return count(jax.lax.bitcast_convert_type(jnp.minimum(b, jnp.uint32(top_bits)), jnp.float32))

  return sum(int(chunk_count(jnp.uint32(s))) for s in range(0, top_bits + 1, chunk))


@pytest.mark.slow
def test_e2m1_rne_magnitude_equals_thresholds_on_every_float32():
  """The kernels' E2M1 rounding (float32 patterns and ``rint(2a)``) is ``numerics.e2m1_rne_code`` on
  every float32 in [0, 6]."""
  assert _mismatches_on_every_float32(
      6.0, lambda a: jnp.sum(C.e2m1_rne_magnitude(a) != numerics.e2m1_rne_code(a))) == 0


def test_block_scale_is_the_value_of_its_byte():
  """``e4m3_block_scales``' value is ``e4m3_to_f32`` of its byte (the kernels skip the decode)."""
  v = jnp.concatenate([jnp.asarray(numerics.e4m3_to_f32(jnp.arange(127, dtype=jnp.uint8))),
                       jax.random.uniform(KEY, (1 << 16,), jnp.float32, 0.0, 448.0),
                       jnp.exp2(jax.random.uniform(HKEY, (1 << 16,), jnp.float32, -12.0, 9.0))])
  value, byte = numerics.e4m3_block_scales(v, jnp.float32(1.0))
  _assert_same(numerics.e4m3_to_f32(byte), value)


@pytest.mark.slow
def test_e4m3_block_scales_equal_numerics_on_every_float32():
  """The kernels' E4M3 block-scale rounding (pattern rounding, ``v + 2^14`` below 2^-6) gives
  ``numerics.e4m3_block_scales``' value and byte for every float32 in [0, 448] (``m = 1``)."""
  def count(v):
    value, byte = C.e4m3_block_scales(v, jnp.float32(1.0))
    want_value, want_byte = numerics.e4m3_block_scales(v, jnp.float32(1.0))
    same_value = jax.lax.bitcast_convert_type(value, jnp.uint32) == jax.lax.bitcast_convert_type(
        want_value, jnp.uint32)
    return jnp.sum(~same_value | (byte != want_byte))

  assert _mismatches_on_every_float32(448.0, count) == 0
  # Above 448 (the kernels clip with one min): 448 and its byte, as numerics.
  big = jnp.asarray([448.00003, 480.0, 1e30, 3.4028235e38, np.inf], jnp.float32)
  value, byte = C.e4m3_block_scales(big, jnp.float32(1.0))
  want_value, want_byte = numerics.e4m3_block_scales(big, jnp.float32(1.0))
  _assert_same(value, want_value)
  _assert_same(byte.astype(jnp.uint8), want_byte)
