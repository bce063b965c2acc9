"""fp4jax.analysis: the error studies, outside the op and optimizer namespaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import analysis, ops, optim
from fp4jax.quant import BF16


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
    analysis.ds_scale_error(x, x, x, x, config=ops.AttentionConfig.nvfp4(q=BF16, k=BF16))


def _np_shares(a, k=16):
  s2 = np.linalg.svd(np.asarray(a, np.float64), compute_uv=False) ** 2
  return s2[:k].sum() / s2.sum(), a.shape[0] * np.square(a.mean(0)).sum() / np.square(a).sum()


@pytest.mark.parametrize("kind", ["gaussian", "rank1_noise", "mean_dominated", "wide"])
def test_energy_shares_match_numpy_svd(kind):
  rng = np.random.default_rng(0)
  g = rng.standard_normal((1152, 384))
  a = {"gaussian": g,
       "rank1_noise": 30 * np.outer(rng.standard_normal(1152), rng.standard_normal(384)) / 384 ** 0.5
       + g,
       "mean_dominated": g + 3.0 * rng.standard_normal(384),
       "wide": rng.standard_normal((384, 1152))}[kind]
  top, mean = _np_shares(a)
  got_top = float(analysis.top_energy_share(jnp.asarray(a, jnp.float32)))
  got_mean = float(analysis.mean_energy_share(jnp.asarray(a, jnp.float32)))
  assert got_top == pytest.approx(top, rel=1e-4) and got_mean == pytest.approx(mean, rel=1e-4)
  assert got_mean <= float(analysis.top_energy_share(jnp.asarray(a), k=1)) + 1e-6
  if kind in ("gaussian", "wide"):  # a flat spectrum: the top 16 of 384 hold ~10%
    assert 0.08 < got_top < 0.13 and got_mean < 0.01
  elif kind == "rank1_noise":
    assert got_top > 0.5 and got_mean < 0.01
  else:
    assert got_mean > 0.85 and got_top > got_mean


def test_energy_shares_edge_cases():
  z = jnp.zeros((32, 16), jnp.bfloat16)
  assert float(analysis.top_energy_share(z)) == 0.0 and float(analysis.mean_energy_share(z)) == 0.0
  low = jnp.asarray(np.random.default_rng(1).standard_normal((64, 8)) @
                    np.random.default_rng(2).standard_normal((8, 48)), jnp.float32)
  assert float(analysis.top_energy_share(low, k=8)) == pytest.approx(1.0, abs=1e-5)
  assert float(analysis.top_energy_share(low, k=100)) == pytest.approx(1.0, abs=1e-6)
  ones = jnp.ones((10, 7))
  assert float(analysis.mean_energy_share(ones)) == pytest.approx(1.0, abs=1e-6)
  with pytest.raises(ValueError, match="k=0"):
    analysis.top_energy_share(ones, k=0)
  with pytest.raises(ValueError, match="2-D"):
    analysis.mean_energy_share(jnp.ones((2, 3, 4)))
