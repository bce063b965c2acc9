"""fp4jax.analysis: the error studies, outside the op and optimizer namespaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import analysis, ops, optim


def test_error_studies_live_in_analysis_only():
  assert callable(analysis.ds_scale_error) and callable(analysis.orthogonality_error)
  assert not hasattr(ops, "ds_scale_error") and not hasattr(optim, "orthogonality_error")
  # The storage rule, bytes and shardings of the states: a public module, re-exported.
  assert optim.state_sharding is optim.state.state_sharding
  assert optim.stores_nvfp4 is optim.state.stores_nvfp4


def test_orthogonality_error_of_an_orthogonal_matrix():
  q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((32, 32)))
  e = analysis.orthogonality_error(jnp.asarray(q[:16], jnp.float32))
  assert e["s_min"] == pytest.approx(1.0, abs=1e-6) and e["s_max"] == pytest.approx(1.0, abs=1e-6)
  assert e["max_dev"] < 1e-6 and e["s_std"] < 1e-6


def test_ds_scale_error_needs_a_key_for_stochastic_rounding():
  x = jax.random.normal(jax.random.key(0), (1, 16, 1, 16))
  with pytest.raises(ValueError, match="needs `key`"):
    analysis.ds_scale_error(x, x, x, x, config=ops.AttentionConfig.nvfp4(q="bf16", k="bf16"))
