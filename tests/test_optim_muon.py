"""fp4jax.optim Newton–Schulz, muon_nvfp4 and root: optax equality, NVFP4 products, routing, ROOT."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from fp4jax import analysis, nvfp4, optim
from fp4jax.optim import ns
from fp4jax.quant import Operand

MUON = jnp.asarray(optim.MUON_COEFFS)


def _matrix(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_fp32_newton_schulz_matches_optax(shape):
  x = _matrix(shape)
  ref = optax.contrib._muon.orthogonalize_via_newton_schulz(x, MUON, 5)
  np.testing.assert_allclose(optim.newton_schulz(x, operand=None), ref, atol=2e-6)


@pytest.mark.slow
def test_nvfp4_products_equal_dequantized_reference_and_two_terms_are_closer():
  a, b = _matrix((32, 64), 1), _matrix((64, 48), 2)
  deq = jax.jit(lambda x, axis: nvfp4.quantize(x, axis=axis).dequantize(), static_argnums=1)
  hi = lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST)
  one = jax.jit(optim.nvfp4_dot)(a, b)
  np.testing.assert_allclose(one, hi(deq(a, 1), deq(b, 0)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jax.jit(optim.nvfp4_gram)(a), hi(deq(a, 1), deq(a, 1).T),
                             rtol=1e-5, atol=1e-5)
  exact = hi(a, b)
  err = lambda y: float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))
  one, two = err(one), err(jax.jit(ns.nvfp4_dot, static_argnums=2)(a, b, Operand(terms=2)))
  assert 0.05 < one < 0.2 and two < one / 5  # measured: 0.139 vs 0.016


def test_two_term_products_are_the_leading_term_gemms():
  """Two-term operands: ``Q2 = Q(a − Q1)`` from the materialized ``Q1`` (``quant.quantize_terms``),
  and the product is exactly ``Q1·P1 + Q1·P2 + Q2·P1`` in that order (``Q2·P2`` left out), jitted
  or not; only NVFP4 operands in 1×16 round-to-nearest blocks are taken."""
  a, b = _matrix((32, 64), 1), _matrix((64, 48), 2)
  a1, b1 = nvfp4.quantize(a, axis=-1), nvfp4.quantize(b, axis=0)
  a2 = nvfp4.quantize(a - a1.dequantize(jnp.float32), axis=-1)
  b2 = nvfp4.quantize(b - b1.dequantize(jnp.float32), axis=0)
  gemm = lambda u, v: nvfp4.gemm(u, v, ((1,), (0,)))
  want = gemm(a1, b1) + gemm(a1, b2) + gemm(a2, b1)
  two = Operand(terms=2)
  for got in (ns.nvfp4_dot(a, b, two), jax.jit(ns.nvfp4_dot, static_argnums=2)(a, b, two)):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
  with pytest.raises(ValueError, match="nvfp4_dot: operand must be an NVFP4"):
    optim.nvfp4_dot(a, b, Operand(format="bf16"))
  with pytest.raises(ValueError, match="round-to-nearest"):
    optim.nvfp4_gram(a, Operand(rounding="stochastic"))
  with pytest.raises(ValueError, match="newton_schulz: operand must be a fp4jax.quant.Operand or None"):
    optim.newton_schulz(a, operand="nvfp4")


@pytest.mark.slow
def test_nvfp4_products_use_scaled_matmul_on_fp4_tensor_cores(monkeypatch):
  """Where the device has FP4 tensor cores, the products go through ``jax.nn.scaled_matmul`` (on the
  CPU: its float32 dequantize-then-dot) with the same value up to summation order."""
  from fp4jax import _platform
  a, b = _matrix((32, 64), 1), _matrix((64, 48), 2)
  decoded = ns.nvfp4_dot(a, b, Operand(terms=2))
  monkeypatch.setattr(_platform, "fp4_tensor_cores", lambda: True)
  # A fresh function: a jitted trace of nvfp4_dot from another test would be reused as it is.
  assert "scaled_matmul" in str(jax.make_jaxpr(lambda a, b: ns.nvfp4_dot(a, b, Operand(terms=2)))(a, b))
  np.testing.assert_allclose(ns.nvfp4_dot(a, b, Operand(terms=2)), decoded, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_nvfp4_newton_schulz_orthogonalizes():
  x = _matrix((20, 40), 3)  # not multiples of 16: the padded path
  ref = optim.newton_schulz(x, operand=None)
  two = jax.jit(lambda x: optim.newton_schulz(x, operand=Operand(terms=2)))(x)
  assert two.shape == x.shape
  e = analysis.orthogonality_error(two)
  assert 0.55 < e["s_min"] and e["s_max"] < 1.3
  assert float(jnp.linalg.norm(two - ref) / jnp.linalg.norm(ref)) < 0.2


@pytest.mark.parametrize("nesterov", [True, False])
def test_unquantized_muon_matches_optax_scale_by_muon(nesterov):
  params = {"a": _matrix((24, 40), 4), "b": _matrix((24, 40), 5), "c": _matrix((40, 16), 6)}
  ours = optim.scale_by_muon_nvfp4(ns_operand=None, nesterov=nesterov)
  dims = lambda p: jax.tree.map(lambda _: MuonDimensionNumbers(), p)
  ref = optax.contrib.scale_by_muon(nesterov=nesterov, weight_dimension_numbers=dims)
  s1, s2 = ours.init(params), ref.init(params)
  up1, up2 = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(3):
    g = jax.tree.map(lambda p: p * (step + 1.0) + step, params)
    (u1, s1), (u2, s2) = up1(g, s1), up2(g, s2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-6), u1, u2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), s1.mu, s2.mu)


def _model_params():
  return {"embed": {"embedding": jnp.zeros((64, 32))}, "lm_head": {"kernel": jnp.zeros((32, 64))},
          "block0": {"attn": {"qkv": {"kernel": jnp.zeros((32, 96))}}, "norm": {"scale": jnp.ones(32)}}}


def _muon_leaves(state):
  mu = state.inner_states["muon"].inner_state[0].mu
  return sorted(jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(
      mu, is_leaf=lambda x: isinstance(x, (optax.MaskedNode, nvfp4.NVFP4Tensor)))
      if not isinstance(x, optax.MaskedNode))


def test_muon_routes_embedding_head_and_vectors_to_adamw():
  params = _model_params()
  state = optim.muon_nvfp4(1e-2, adam_options=optim.AdamNvfp4Options(min_size=0)).init(params)
  assert _muon_leaves(state) == ["['block0']['attn']['qkv']['kernel']"]
  # default: float32 momentum (mu_dtype to change it), NVFP4 moments on the AdamW side
  assert state.inner_states["muon"].inner_state[0].mu["block0"]["attn"]["qkv"]["kernel"].dtype == jnp.float32
  assert isinstance(state.inner_states["adam"].inner_state[0].nu["embed"]["embedding"], nvfp4.NVFP4Tensor)
  bf16 = optim.muon_nvfp4(1e-2, mu_dtype=jnp.bfloat16).init(params)
  assert bf16.inner_states["muon"].inner_state[0].mu["block0"]["attn"]["qkv"]["kernel"].dtype == jnp.bfloat16
  assert _muon_leaves(optim.root(1e-2).init(params)) == ["['block0']['attn']['qkv']['kernel']"]
  # optax's dimension-number masks work too; None -> AdamW
  dims = jax.tree.map(lambda _: None, params)
  dims["lm_head"]["kernel"] = MuonDimensionNumbers(0, 1)
  assert _muon_leaves(optim.muon_nvfp4(1e-2, muon_mask=dims).init(params)) == ["['lm_head']['kernel']"]
  dims["lm_head"]["kernel"] = MuonDimensionNumbers(1, 0)
  with pytest.raises(ValueError, match="reduction_axis=0"):
    optim.muon_nvfp4(1e-2, muon_mask=dims).init(params)
  with pytest.raises(ValueError, match="2-D"):
    optim.scale_by_muon_nvfp4().init({"w": jnp.zeros((2, 16, 16))})
  with pytest.raises(ValueError, match="ns_operand must be a fp4jax.quant.Operand or None"):
    optim.scale_by_muon_nvfp4(ns_operand="fp32")
  with pytest.raises(ValueError, match="ns_operand=.*round-to-nearest"):
    optim.scale_by_muon_nvfp4(ns_operand=Operand(rounding="stochastic"))


def test_root_coefficients_and_soft_thresholding_match_reference_step():
  assert optim.root_coeffs((8192, 2048)) == optim.ROOT_NS_COEFFS[(2048, 8192)]
  assert optim.root_coeffs((100, 300)) == optim.MUON_COEFFS
  g = _matrix((32, 48), 7).at[0, :4].mul(50.0)  # a few outliers
  tx = optim.scale_by_root_nvfp4(ns_operand=None)
  u, state = jax.jit(tx.update)({"w": g}, tx.init({"w": g}))
  # ROOT's first step: Nesterov momentum of one gradient is g up to scale; clip at the 0.9-quantile.
  thr = np.quantile(np.abs(np.asarray(g)), 0.9) * 1.0
  ref = optim.newton_schulz(np.clip(np.asarray(g), -thr, thr), optim.MUON_COEFFS, operand=None,
                            eps=1e-7)
  np.testing.assert_allclose(u["w"], ref, atol=1e-4)
  plain = optim.newton_schulz(g, operand=None)
  assert float(jnp.linalg.norm(plain - ref)) > 0.1  # the thresholding mattered


def test_shape_scaling():
  u = {"w": jnp.ones((16, 64))}
  np.testing.assert_allclose(optim.scale_by_shape().update(u, None)[0]["w"], 2.0)
  np.testing.assert_allclose(optim.scale_by_shape(0.2).update(u, None)[0]["w"], 0.2 * 8.0)


@pytest.mark.slow
def test_nvfp4_muon_trains_and_state_is_stable_under_cond():
  key1, key2 = jax.random.split(jax.random.key(8))
  x = jax.random.normal(key1, (128, 32))
  w_true = jax.random.normal(key2, (32, 32)) / 6
  # "w": Muon with NVFP4 Newton–Schulz; "embed" (no gradient): NVFP4 moments on the AdamW side.
  loss = lambda p: jnp.mean((x @ p["w"] - x @ w_true) ** 2) + 0.0 * jnp.sum(p["embed"])
  tx = optim.muon_nvfp4(0.05, adam_options=optim.AdamNvfp4Options(min_size=0))
  params = {"w": jnp.zeros((32, 32)), "embed": jnp.zeros((16, 32))}
  state0 = tx.init(params)

  @jax.jit
  def step(params, state, do):
    grads = jax.grad(loss)(params)
    def apply(args):
      params, state = args
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    return jax.lax.cond(do, apply, lambda args: args, (params, state))

  spec = lambda s: jax.tree.map(lambda a: (a.shape, a.dtype), s)
  assert isinstance(state0.inner_states["adam"].inner_state[0].mu["embed"], nvfp4.NVFP4Tensor)
  p_skip, s_skip = step(params, state0, False)
  assert spec(s_skip) == spec(state0) and float(loss(p_skip)) == float(loss(params))
  first = float(loss(params))
  state = state0
  for _ in range(60):
    params, state = step(params, state, True)
  assert spec(state) == spec(state0)
  assert float(loss(params)) < 0.05 * first
