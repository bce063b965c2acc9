"""fp4jax.ops.mixed_matmul: forward == jnp.dot with float32 accumulation, backward GEMMs in bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import mixed_matmul, mixed_matmul_split, mixed_matmul_vjp_reference


def _data(shape_x=(3, 40, 48), n=80, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k1, shape_x, jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(k2, (shape_x[-1], n), jnp.float32) * 0.1
  dy = jax.random.normal(k3, shape_x[:-1] + (n,), jnp.float32)
  return x, w, dy


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_forward_equals_dot_with_f32_accumulation(out_dtype):
  x, w, _ = _data()
  y = mixed_matmul(x, w, jnp.bfloat16, out_dtype)
  ref = jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  assert y.dtype == (out_dtype or jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(ref.astype(y.dtype), np.float32))


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_backward_is_bf16_gemms_of_the_rounded_cotangent(out_dtype):
  x, w, dy = _data()
  y, vjp = jax.vjp(lambda x, w: mixed_matmul(x, w, jnp.bfloat16, out_dtype), x, w)
  dx, dw = vjp(dy.astype(y.dtype))
  assert dx.dtype == x.dtype and dw.dtype == w.dtype == jnp.float32
  rdx, rdw = mixed_matmul_vjp_reference(x, w, dy)
  # dx is rounded to bf16 once (2^-8 relative); dw has float32 output (summation order only).
  np.testing.assert_allclose(np.asarray(dx, np.float32), rdx, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-4)
  # and it is far from the exact-precision gradient of an unrounded cotangent: the rounding is real
  exact_dx = jnp.einsum("btn,kn->btk", dy, w, precision="highest")
  assert float(jnp.max(jnp.abs(dx.astype(jnp.float32) - exact_dx))) > 1e-4


def test_float32_dtype_is_plain_matmul_and_grads():
  x, w, dy = _data()
  x = x.astype(jnp.float32)
  f = lambda x, w: mixed_matmul(x, w, jnp.float32)
  g = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
  y1, v1 = jax.vjp(f, x, w)
  y2, v2 = jax.vjp(g, x, w)
  np.testing.assert_array_equal(y1, y2)
  for a, b in zip(v1(dy), v2(dy), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # summation order only


def test_grad_under_jit_and_2d_input():
  x, w, dy = _data((32, 48))
  loss = lambda x, w: jnp.sum(mixed_matmul(x, w).astype(jnp.float32) * dy)
  gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  rdx, rdw = mixed_matmul_vjp_reference(x, w, dy)
  np.testing.assert_allclose(np.asarray(gx, np.float32), rdx, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(gw, rdw, rtol=1e-5, atol=1e-4)


def _qkv_layout(kv, g, h=8, d=48, seed=1):
  """x, the model's fused qkv kernel (D, kv·(g+2)·H: [q_1..q_g, k, v] per KV head), cotangents."""
  x, w, _ = _data((3, 40, d), kv * (g + 2) * h, seed)
  keys = jax.random.split(jax.random.key(seed + 1), 3)
  dys = tuple(jax.random.normal(k, (3, 40, m * h)).astype(jnp.bfloat16)
              for k, m in zip(keys, (kv * g, kv, kv), strict=True))
  return x, w, dys


def _split_kernels(w, kv, g, h=8):
  w = w.reshape(w.shape[0], kv, g + 2, h)
  return tuple(a.reshape(w.shape[0], -1) for a in (w[:, :, :g], w[:, :, g], w[:, :, g + 1]))


def _fused_then_sliced(x, w, kv, g, h=8):
  y = mixed_matmul(x, w).reshape(*x.shape[:-1], kv, g + 2, h)
  return tuple(a.reshape(*x.shape[:-1], -1)
               for a in (y[..., :g, :], y[..., g, :], y[..., g + 1, :]))


@pytest.mark.parametrize("kv,g", [(4, 1), (2, 3)])  # MHA, GQA
def test_split_equals_fused_gemm_then_slices(kv, g):
  """q, k, v as three GEMMs == one fused GEMM sliced: forward bit for bit; dx within one bf16 ulp
  (float32 sums of three partial products vs one accumulation), dkernel to float32 rounding."""
  x, w, dys = _qkv_layout(kv, g)
  split = lambda x, w: mixed_matmul_split(x, _split_kernels(w, kv, g))
  ys0, vjp0 = jax.vjp(lambda x, w: _fused_then_sliced(x, w, kv, g), x, w)
  ys1, vjp1 = jax.vjp(split, x, w)
  for y0, y1 in zip(ys0, ys1, strict=True):
    assert y1.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  (dx0, dw0), (dx1, dw1) = vjp0(dys), vjp1(dys)
  assert dx1.dtype == x.dtype and dw1.dtype == jnp.float32
  ulps = np.abs(np.asarray(dx1).view(np.int16).astype(np.int32) - np.asarray(dx0).view(np.int16))
  assert ulps.max() <= 1 and (ulps == 0).mean() > 0.99, (ulps.max(), (ulps == 0).mean())
  np.testing.assert_allclose(dw1, dw0, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(dw0))))
  # The op alone against the float32 reference of the concatenated kernels.
  ks = _split_kernels(w, kv, g)
  dx, dks = jax.vjp(mixed_matmul_split, x, ks)[1](dys)
  rdx, rdk = mixed_matmul_vjp_reference(x, jnp.concatenate(ks, -1), jnp.concatenate(dys, -1))
  np.testing.assert_allclose(np.asarray(dx, np.float32), rdx, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(jnp.concatenate(dks, -1), rdk, rtol=1e-5, atol=1e-4)
  # jit == no-jit.

  def forward_and_grads(x, w, dys):
    ys, vjp = jax.vjp(split, x, w)
    return (*ys, *vjp(dys))

  for a, b in zip(jax.jit(forward_and_grads)(x, w, dys), (*ys1, dx1, dw1), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
