"""fp4jax.kernels.cross_entropy: interpret-mode numerics against the reference and float64 numpy, the
CUDA (Triton) lowering for an abstract H200, argument checks, and the error under jax.grad."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import H200

from fp4jax.kernels.cross_entropy import BlockSizes, softmax_xent_rows, softmax_xent_rows_reference


def _inputs(c, v, seed=0):
  """Logits over a wide range (per-row scales 1e-2..50, offsets +-100) with rows that stress the
  kernels: the max in the last column behind a rising ramp (the online max grows every tile), one
  dominant logit (most probabilities underflow), a constant row. Targets include 0 and V-1;
  every fifth weight is 0."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((c, v)) * 10.0 ** rng.uniform(-2, 1.7, (c, 1)) + rng.uniform(-100, 100, (c, 1))
  x[2] = np.linspace(-30.0, 30.0, v)
  x[3] = rng.standard_normal(v)
  x[3, v // 2] = 120.0
  x[4] = 5.0
  tgt = rng.integers(0, v, c)
  tgt[0], tgt[1], tgt[3] = 0, v - 1, v // 2
  w = rng.uniform(0.1, 2.0, c)
  w[::5] = 0.0
  return (jnp.asarray(x, jnp.float32), jnp.asarray(tgt, jnp.int32), jnp.asarray(w, jnp.float32))


def _bf16_ulps(a, b):
  """Elementwise distance in bf16 ulps, counting across zero. Magnitudes below 2**-120 count as 0:
  XLA's CPU flushes subnormal exp results (the wide-range rows' tails) before the weight scales
  them, float64 does not."""
  def ordered(x):
    x = np.asarray(x, np.float32)
    x = np.where(np.abs(x) < 2.0**-120, 0.0, x)
    bits = x.astype(jnp.bfloat16).view(np.uint16).astype(np.int32)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
  return np.abs(ordered(a) - ordered(b))


def _float64_truth(x, tgt, w):
  x = np.asarray(x, np.float64)
  m = x.max(axis=1, keepdims=True)
  lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
  onehot = np.arange(x.shape[1])[None, :] == np.asarray(tgt)[:, None]
  return lse, (np.exp(x - lse[:, None]) - onehot) * np.asarray(w, np.float64)[:, None]


def test_reference_matches_float64():
  x, tgt, w = _inputs(32, 1000)
  lse, tl, dl = softmax_xent_rows_reference(x, tgt, w)
  lse64, dl64 = _float64_truth(x, tgt, w)
  np.testing.assert_allclose(lse, lse64, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(tl, np.asarray(x)[np.arange(32), np.asarray(tgt)])
  assert _bf16_ulps(dl, dl64.astype(np.float32)).max() <= 1
  assert dl.dtype == jnp.bfloat16 and lse.dtype == tl.dtype == jnp.float32


# (C, V, rows_per_program, tile_v): V a power of two, ragged (300, 1000), C not a multiple of the
# rows per program (30 / 4), tiles that divide V and tiles with a ragged tail, one tile > V, the
# default tile.
CASES = [
    (32, 256, 1, 64),
    (30, 300, 4, 128),
    (32, 1000, 1, 256),
    (32, 1000, 2, 4096),
    (30, 300, 4, None),
]


@pytest.mark.parametrize("c,v,r,tile", CASES)
def test_kernel_matches_reference_in_interpret_mode(c, v, r, tile):
  x, tgt, w = _inputs(c, v, seed=v + c)
  lse, tl, dl = softmax_xent_rows(x, tgt, w, block_sizes=BlockSizes(rows_per_program=r, tile_v=tile),
                                 interpret=True)
  lse_r, tl_r, dl_r = softmax_xent_rows_reference(x, tgt, w)
  assert lse.shape == tl.shape == (c,) and dl.shape == (c, v) and dl.dtype == jnp.bfloat16
  np.testing.assert_allclose(lse, lse_r, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, _float64_truth(x, tgt, w)[0], rtol=2e-6, atol=2e-6)
  # The target logit is picked, not computed: exact.
  np.testing.assert_array_equal(tl, np.asarray(x)[np.arange(c), np.asarray(tgt)])
  np.testing.assert_array_equal(tl, tl_r)
  ulps = _bf16_ulps(dl, dl_r)
  assert ulps.max() <= 1, ulps.max()
  assert np.mean(ulps == 0) >= 0.99, np.mean(ulps == 0)
  dl = np.asarray(dl, np.float32)
  assert not dl[::5].any()  # w == 0 rows: no cotangent (their lse was checked above)
  live = np.asarray(w) > 0
  # softmax sums to one, the one-hot takes one off: each live row of dl sums to ~0, with the
  # target's entry (p - 1) * w <= 0.
  np.testing.assert_allclose(dl[live].sum(axis=1), 0.0, atol=2e-2)
  assert np.all(dl[live, np.asarray(tgt)[live]] <= 0)


def test_float32_dl_and_out_of_range_targets():
  c, v = 8, 300  # V_pad = 512: target 400 lies in the padding columns
  x, tgt, w = _inputs(c, v, seed=3)
  tgt = tgt.at[5].set(-1).at[6].set(v).at[7].set(400)
  lse, tl, dl = softmax_xent_rows(x, tgt, w, jnp.float32, block_sizes=BlockSizes(tile_v=128),
                               interpret=True)
  lse_r, tl_r, dl_r = softmax_xent_rows_reference(x, tgt, w, jnp.float32)
  assert dl.dtype == jnp.float32
  np.testing.assert_allclose(lse, lse_r, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dl, dl_r, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(tl[5:], 0.0)  # matches no column
  assert np.all(np.asarray(dl)[5:] >= 0)  # no one-hot subtracted


def test_grad_raises_a_clear_error():
  x, tgt, w = _inputs(8, 256)
  loss = lambda x: jnp.sum(softmax_xent_rows(x, tgt, w, interpret=True)[0])
  with pytest.raises(TypeError, match="not differentiable"):
    jax.grad(loss)(x)
  # Inside a custom_vjp forward rule (fp4jax.loss's use) it is not differentiated: no error.
  f = jax.custom_vjp(loss)
  f.defvjp(lambda x: (loss(x), None), lambda _, g: (jnp.zeros((8, 256)) * g,))
  assert jax.grad(f)(x).shape == (8, 256)


def test_bad_arguments_raise_value_errors():
  x, tgt, w = _inputs(8, 256)
  call = functools.partial(softmax_xent_rows, interpret=True)
  for args, kw, match in [
      ((x[0], tgt, w), {}, "2-D"),
      ((x.astype(jnp.bfloat16), tgt, w), {}, "float32"),
      ((x, tgt[:7], w), {}, "tgt_C"),
      ((x, tgt.astype(jnp.float32), w), {}, "tgt_C"),
      ((x, tgt, w[:7]), {}, "w_C"),
      ((x, tgt, tgt), {}, "w_C"),
      ((x, tgt, w, jnp.int32), {}, "dl_dtype"),
      ((x[:, :0], tgt, w), {}, "empty"),
      ((x, tgt, w), dict(block_sizes=dict(tile_v=128)), "block_sizes"),
  ]:
    with pytest.raises(ValueError, match=match):
      call(*args, **kw)


def test_block_sizes_are_validated():
  """``BlockSizes``: None (the default) or powers of two, at most 32 warps; stages a positive int."""
  assert BlockSizes() == BlockSizes(None, None, None, None)
  BlockSizes(rows_per_program=4, num_warps=32, tile_v=4096, num_stages=2)
  for kw, match in [(dict(rows_per_program=3), "rows_per_program"), (dict(tile_v=100), "tile_v"),
                    (dict(num_warps=64), "num_warps"), (dict(num_stages=0), "num_stages"),
                    (dict(num_warps=4.0), "num_warps")]:
    with pytest.raises(ValueError, match=match):
      BlockSizes(**kw)


# (C, V, kwargs, the kernel's loads of logits): two reads per tile (statistics, then the cotangent).
# Masks only where needed: the ragged column tail (V < V_pad: its peeled last tile) and the ragged
# row tail (C not a multiple of the rows per program; no padding copy in XLA).
LOWER_CASES = [
    (64, 32768, {}, ["1x2048"] * 2),
    (64, 50304, {}, ["1x2048", "1x2048 masked"] * 2),
    (62, 50304, dict(rows_per_program=4, tile_v=2048), ["4x2048 masked"] * 4),
    (16, 70000, dict(num_warps=8), ["1x2048", "1x2048 masked"] * 2),  # BlockSizes fields
]


@pytest.mark.parametrize("c,v,kw,loads", LOWER_CASES)
def test_lowers_to_triton_for_h200(triton_modules, c, v, kw, loads):
  """The CUDA lowering of a jitted call for an abstract H200 (no GPU): one Triton custom call does
  all the work (no exp or reduction left to XLA), and the kernel reads the logits as intended."""
  f = jax.jit(functools.partial(softmax_xent_rows, block_sizes=BlockSizes(**kw)))
  args = (jax.ShapeDtypeStruct((c, v), jnp.float32), jax.ShapeDtypeStruct((c,), jnp.int32),
          jax.ShapeDtypeStruct((c,), jnp.float32))
  with jax.sharding.use_abstract_mesh(H200):  # abstract values only in here
    hlo = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 1, hlo
  assert "stablehlo.exponential" not in hlo and "stablehlo.reduce" not in hlo, hlo
  assert len(triton_modules) == 1
  ttir = triton_modules[0]
  assert "@softmax_xent" in ttir
  # Loads through f32 pointers of a 2-D block are the logits' (lse's are 1-D); a masked load has
  # mask and other operands.
  found = [block + (" masked" if extra else "") for extra, block in
           re.findall(r"tt\.load %\w+((?:, %\w+)*) : tensor<(\d+x\d+)x!tt\.ptr<f32>>", ttir)]
  assert found == loads, found
  assert re.search(rf"num_warps = {kw.get('num_warps', 4)} : i32", hlo)


def test_auto_implementation_follows_the_default_platform(monkeypatch):
  """``chunked_cross_entropy(implementation="auto")`` takes the kernel only where computations go
  to a CUDA GPU; an unknown implementation names the op."""
  from fp4jax import _platform
  from fp4jax.loss import chunked_cross_entropy
  x, w = jnp.zeros((2, 8, 16), jnp.bfloat16), jnp.zeros((16, 64), jnp.float32)
  t = jnp.zeros((2, 8), jnp.int32)
  # The kernel is the forward rule of the loss's custom_vjp: a gradient traces it.
  loss = lambda impl: jax.grad(lambda w: chunked_cross_entropy(x, w, t, implementation=impl))(w)
  for platform, kernel in (("cuda", True), ("rocm", False), ("cpu", False)):
    monkeypatch.setattr(_platform, "default_platform", lambda p=platform: p)
    assert ("pallas_call" in str(jax.make_jaxpr(lambda: loss("auto"))())) == kernel, platform
    assert "pallas_call" not in str(jax.make_jaxpr(lambda: loss("xla"))())
  with pytest.raises(ValueError, match="chunked_cross_entropy: implementation must be one of"):
    loss("cuda")
