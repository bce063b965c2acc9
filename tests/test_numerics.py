"""``numerics.bf16_rn``: the bfloat16 rounding that XLA cannot fold away on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import numerics


def test_bf16_rn_equals_the_cast_bit_for_bit():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      np.finfo(np.float32).tiny, 1e-45, -1e-45, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-23],
                     np.float32)  # overflow, subnormals, both kinds of tie and just above one
  x = np.concatenate([x[np.isfinite(x)], special])
  got = np.asarray(jax.jit(numerics.bf16_rn)(x)).view(np.uint32)
  want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)).view(np.uint32)
  np.testing.assert_array_equal(got, want)
  assert got[-3:].view(np.float32).tolist() == [1.0, 1.0 + 2**-6, 1.0 + 2**-7]  # ties to even


def test_bf16_rn_keeps_nan_and_differentiates_as_the_identity():
  nan = np.array([np.nan, -np.nan], np.float32)
  assert np.all(np.isnan(np.asarray(numerics.bf16_rn(nan))))
  x = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.float32) * 1.001
  np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: jnp.sum(numerics.bf16_rn(x) * x))(x)),
                                np.asarray(numerics.bf16_rn(x) + x))
