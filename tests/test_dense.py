"""fp4jax.ops.mixed_matmul: forward == jnp.dot with float32 accumulation, backward GEMMs in bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import mixed_matmul, mixed_matmul_vjp_reference


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
  f = lambda x, w: mixed_matmul(x, w, jnp.float32)  # noqa: E731
  g = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)  # noqa: E731
  y1, v1 = jax.vjp(f, x, w)
  y2, v2 = jax.vjp(g, x, w)
  np.testing.assert_array_equal(y1, y2)
  for a, b in zip(v1(dy), v2(dy), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # summation order only


def test_grad_under_jit_and_2d_input():
  x, w, dy = _data((32, 48))
  loss = lambda x, w: jnp.sum(mixed_matmul(x, w).astype(jnp.float32) * dy)  # noqa: E731
  gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  rdx, rdw = mixed_matmul_vjp_reference(x, w, dy)
  np.testing.assert_allclose(np.asarray(gx, np.float32), rdx, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(gw, rdw, rtol=1e-5, atol=1e-4)
