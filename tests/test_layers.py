"""fp4jax.layers: fp4_dense and lora_svd_dense (SVD split, re-split, randomized SVD, gradients, errors)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax import nvfp4
from fp4jax.layers import fp4_dense, lora_svd_dense, lora_svd_split, randomized_svd
from fp4jax.ops import MatmulConfig, nvfp4_matmul

K, N, R = 64, 48, 8
BF16 = MatmulConfig.bf16()
NVFP4 = MatmulConfig.nvfp4()


def _spiked(k=K, n=N, seed=0, spikes=(8.0, 6.0, 4.0, 3.0, 2.0, 1.5)):
  """Gaussian bulk plus a few directions ``spikes`` times the bulk's edge: a trained-like spectrum."""
  rng = np.random.default_rng(seed)
  u, _ = np.linalg.qr(rng.standard_normal((k, len(spikes))))
  v, _ = np.linalg.qr(rng.standard_normal((n, len(spikes))))
  edge = 1.0 + np.sqrt(n / k)  # largest singular value of the bulk
  w = rng.standard_normal((k, n)) / np.sqrt(k) + (u * (edge * np.asarray(spikes))) @ v.T
  return jnp.asarray(w, jnp.float32)


def _const_init(w):
  return lambda key, shape, dtype: w.astype(dtype)


def _x(dtype=jnp.bfloat16, shape=(2, 16, K), seed=1):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp4dense_bf16_equals_plain_dense_and_nvfp4_equals_the_op():
  layer = fp4_dense(K, N, config=BF16, rngs=nnx.Rngs(0), use_bias=True)
  layer.bias[...] = jnp.arange(N, dtype=jnp.float32)
  x = _x()
  want = jnp.dot(x, layer.kernel[...].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  want = want.astype(jnp.bfloat16) + layer.bias[...].astype(jnp.bfloat16)[None, None]
  np.testing.assert_array_equal(layer(x), want)
  assert layer.kernel[...].dtype == jnp.float32 and layer(x).dtype == jnp.bfloat16
  assert fp4_dense(K, N, config=BF16, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16).kernel[...].dtype == jnp.bfloat16
  assert fp4_dense(K, N, config=BF16, rngs=nnx.Rngs(0), dtype=jnp.float32)(x).dtype == jnp.float32

  q = fp4_dense(K, N, config=NVFP4, rngs=nnx.Rngs(0))
  key = jax.random.key(3)
  got = jax.jit(lambda x, w, k: (q(x, key=k), nvfp4_matmul(x, w, key=k, config=NVFP4)))(x, q.kernel[...], key)
  np.testing.assert_array_equal(*got)


def test_lorasvd_init_preserves_w_and_is_a_balanced_top_r_svd():
  w = _spiked()
  layer = lora_svd_dense(K, N, rank=R, config=BF16, rngs=nnx.Rngs(0), kernel_init=_const_init(w))
  w_eff = layer.effective_kernel()
  np.testing.assert_allclose(w_eff, w, rtol=0, atol=4 * np.finfo(np.float32).eps * float(jnp.abs(w).max()))
  a, b = layer.lora_a[...], layer.lora_b[...]
  assert a.shape == (K, R) and b.shape == (R, N)
  # A, B are exactly bf16 (the branch's compute dtype), A = U√Σ, B = √Σ Vᵀ: AᵀA ≈ BBᵀ ≈ diag(Σ).
  assert np.array_equal(a, a.astype(jnp.bfloat16).astype(jnp.float32))
  s = np.linalg.svd(np.asarray(w), compute_uv=False)
  np.testing.assert_allclose(np.diag(a.T @ a), s[:R], rtol=1e-2)
  np.testing.assert_allclose(np.diag(b @ b.T), s[:R], rtol=1e-2)
  # What is left in W_res is the rest of the spectrum.
  s_res = np.linalg.svd(np.asarray(layer.kernel[...]), compute_uv=False)
  np.testing.assert_allclose(s_res[: N - R], s[R:], rtol=2e-2)


def test_lorasvd_takes_error_out_of_the_quantized_weight():
  """On a spiked spectrum the residual quantizes with much less error than W itself."""
  w = _spiked()
  a, b, w_res = lora_svd_split(w, R)
  q = jax.jit(lambda w: nvfp4.quantize(w, block=(16, 16)).dequantize())
  direct = _rel(q(w), w)
  split = _rel(q(w_res) + a @ b, w)
  assert split < 0.5 * direct, (split, direct)
  a0, b0, w_res0 = lora_svd_split(w, 0)
  assert a0.shape == (K, 0) and b0.shape == (0, N) and np.array_equal(w_res0, w)


def test_resplit_preserves_the_effective_weight():
  layer = lora_svd_dense(K, N, rank=R, config=BF16, rngs=nnx.Rngs(0), kernel_init=_const_init(_spiked()))
  # Emulate training: move all three parameters.
  ks = jax.random.split(jax.random.key(0), 3)
  for p, k in zip((layer.kernel, layer.lora_a, layer.lora_b), ks):
    p[...] = p[...] + 0.05 * jax.random.normal(k, p[...].shape)
  before = layer.effective_kernel()
  old_a = layer.lora_a[...]
  layer.resplit()
  after = layer.effective_kernel()
  np.testing.assert_allclose(after, before, rtol=0, atol=8 * np.finfo(np.float32).eps * float(jnp.abs(before).max()))
  assert not np.allclose(old_a, layer.lora_a[...])
  s = np.linalg.svd(np.asarray(before), compute_uv=False)
  np.testing.assert_allclose(np.linalg.svd(np.asarray(layer.kernel[...]), compute_uv=False)[0], s[R], rtol=2e-2)
  # From a jitted training step too; with bf16 A, B (exact after a split) W_eff is still kept.
  layer = lora_svd_dense(K, N, rank=R, config=BF16, rngs=nnx.Rngs(0), lora_param_dtype=jnp.bfloat16)
  assert layer.lora_a[...].dtype == jnp.bfloat16 and layer.kernel[...].dtype == jnp.float32
  before = layer.effective_kernel()
  nnx.jit(lambda m: m.resplit())(layer)
  np.testing.assert_allclose(layer.effective_kernel(), before, rtol=0, atol=1e-6 * float(jnp.abs(before).max()))


def test_randomized_svd_finds_the_top_directions_and_split_stays_exact():
  w = _spiked(128, 96)
  u, s, vt = randomized_svd(w, R, jax.random.key(0), oversample=8, power_iters=2)
  s_exact = np.linalg.svd(np.asarray(w), compute_uv=False)
  np.testing.assert_allclose(s[:4], s_exact[:4], rtol=1e-3)  # the spikes
  np.testing.assert_allclose(u.T @ u, np.eye(R), atol=1e-5)
  np.testing.assert_allclose(vt @ vt.T, np.eye(R), atol=1e-5)
  a, b, w_res = lora_svd_split(w, R, method="randomized", key=jax.random.key(0))
  np.testing.assert_allclose(w_res + a @ b, w, atol=4e-7 * float(jnp.abs(w).max()))
  layer = lora_svd_dense(128, 96, rank=R, config=BF16, rngs=nnx.Rngs(0), kernel_init=_const_init(w),
                       svd="randomized")
  np.testing.assert_allclose(layer.effective_kernel(), w, atol=4e-7 * float(jnp.abs(w).max()))
  with pytest.raises(ValueError, match="needs a `key`"):
    layer.resplit()
  layer.resplit(jax.random.key(1))


@pytest.mark.slow
def test_lorasvd_forward_and_gradients():
  """y = nvfp4_matmul(x, W_res) + (x·A)·B in bf16; gradients reach all three params through nnx.jit."""
  layer = lora_svd_dense(K, N, rank=R, config=NVFP4, rngs=nnx.Rngs(0), kernel_init=_const_init(_spiked()))
  x, key = _x(), jax.random.key(5)

  @nnx.jit
  def run(m, x, key):
    def loss(m):
      return jnp.sum(m(x, key=key).astype(jnp.float32) ** 2)
    y = m(x, key=key)
    a, b = m.lora_a[...].astype(jnp.bfloat16), m.lora_b[...].astype(jnp.bfloat16)
    xa = jnp.dot(x, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    want = nvfp4_matmul(x, m.kernel[...], key=key, config=NVFP4)
    want = want + jnp.dot(xa, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return y, want, nnx.grad(loss)(m)

  y, want, grads = run(layer, x, key)
  np.testing.assert_array_equal(y, want)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 16, N)
  for name in ("kernel", "lora_a", "lora_b"):
    g = grads[name][...]
    assert g.dtype == jnp.float32 and g.shape == getattr(layer, name)[...].shape
    assert np.all(np.isfinite(g)) and float(jnp.abs(g).max()) > 0, name
  # Same key, same step: the jitted layer is deterministic.
  y2, _, grads2 = run(layer, x, key)
  np.testing.assert_array_equal(y, y2)
  np.testing.assert_array_equal(grads["kernel"][...], grads2["kernel"][...])


def test_jit_equals_no_jit_for_the_layers():
  layer = lora_svd_dense(K, N, rank=R, config=BF16, rngs=nnx.Rngs(0), use_bias=True)
  x = _x()
  np.testing.assert_array_equal(layer(x), nnx.jit(lambda m, x: m(x))(layer, x))


def test_bad_arguments_raise_clear_errors():
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match="rank must be in"):
    lora_svd_dense(K, N, rank=0, config=BF16, rngs=rngs)
  with pytest.raises(ValueError, match="rank must be in"):
    lora_svd_dense(K, N, rank=N + 1, config=BF16, rngs=rngs)
  with pytest.raises(ValueError, match="svd method"):
    lora_svd_dense(K, N, rank=R, config=BF16, rngs=rngs, svd="qr")
  with pytest.raises(ValueError, match="config must be a MatmulConfig"):
    fp4_dense(K, N, config="nvfp4", rngs=rngs)
  layer = fp4_dense(K, N, config=NVFP4, rngs=rngs)
  with pytest.raises(ValueError, match="needs `key`"):
    layer(_x())
  with pytest.raises(ValueError, match="disagree on K"):
    layer(_x(shape=(2, 16, 32)), key=jax.random.key(0))
  with pytest.raises(ValueError, match="not a multiple of 16"):
    fp4_dense(K, 40, config=NVFP4, rngs=rngs)(_x(), key=jax.random.key(0))
  with pytest.raises(ValueError, match="rank must be in"):
    lora_svd_split(jnp.ones((8, 8)), 9)
  with pytest.raises(ValueError, match="2-D"):
    lora_svd_split(jnp.ones((8,)), 1)


@pytest.mark.slow
def test_one_dense_with_an_injected_matmul():
  """fp4_dense / lora_svd_dense are Dense with NVFP4Matmul (and a rank); Dense.split gives column
  groups: separate GEMMs for the bf16 matmul, slices of the one GEMM for NVFP4 (same bits)."""
  from fp4jax.layers import Dense, MixedMatmul, NVFP4Matmul
  q = fp4_dense(K, N, config=NVFP4, rngs=nnx.Rngs(0))
  assert type(q) is Dense and q.matmul == NVFP4Matmul(NVFP4) and q.rank == 0
  lora = lora_svd_dense(K, N, rank=R, config=NVFP4, rngs=nnx.Rngs(0))
  assert type(lora) is Dense and lora.rank == R
  x, key = _x(), jax.random.key(2)
  cols = (lambda a: a[..., :16], lambda a: a[..., 16:])
  for layer in (Dense(K, N, rngs=nnx.Rngs(0)), q, lora):
    whole = layer(x, key=key)
    for part, c in zip(layer.split(x, cols, key=key), cols, strict=True):
      np.testing.assert_array_equal(part, c(whole))
  bf16 = Dense(K, N, rngs=nnx.Rngs(0))
  assert bf16.matmul == MixedMatmul() and "mixed_matmul_split" in str(
      jax.make_jaxpr(lambda x: bf16.split(x, cols))(x))
  with pytest.raises(ValueError, match="no low-rank branch"):
    bf16.resplit()
  with pytest.raises(ValueError, match="config must be a MatmulConfig"):
    NVFP4Matmul("nvfp4")
  with pytest.raises(ValueError, match="execution must be a MatmulExecution"):
    NVFP4Matmul(NVFP4, "xla")
