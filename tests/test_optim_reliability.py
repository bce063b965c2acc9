"""Every fp4jax.optim transformation under optax's wrappers and on unusual leaves.

Wrappers: ``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.chain``, ``optax.masked``.
Leaves: empty ((0,), (0, 4), (4, 0)), scalar, odd shapes, None, float32 and bfloat16, and one
(64, 64) leaf that takes the NVFP4 path (moments stored as NVFP4 for AdamW; the AdamW side of Muon
and ROOT). Newton–Schulz runs in float32 here (its NVFP4 products have their own tests).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_updates, state_type
from optax.contrib import MuonDimensionNumbers

from fp4jax import nvfp4, optim
from fp4jax.quant import Operand

LR = 1e-2

# name -> (factory, arguments, whether every leaf must be 2-D)
TRANSFORMS = {
    "adamw_nvfp4": (optim.adamw_nvfp4, dict(learning_rate=LR), False),
    "scale_by_adam_nvfp4": (optim.scale_by_adam_nvfp4, dict(), False),
    "muon_nvfp4": (optim.muon_nvfp4, dict(learning_rate=LR, ns_operand=None), False),
    "scale_by_muon_nvfp4": (optim.scale_by_muon_nvfp4, dict(ns_operand=None), True),
    "root": (optim.root, dict(learning_rate=LR, ns_operand=None), False),
    "scale_by_root_nvfp4": (optim.scale_by_root_nvfp4, dict(ns_operand=None), True),
}


def _params(dtype, matrices_only):
  key = jax.random.key(0)
  shapes = {"w": (24, 40), "odd": (3, 5), "e04": (0, 4), "e40": (4, 0)}
  if not matrices_only:  # "embed": NVFP4 moments (AdamW; the AdamW side of Muon and ROOT)
    shapes.update({"embed": (64, 64), "e0": (0,), "scalar": (), "v17": (17,), "t": (3, 5, 7)})
  params = {k: (0.1 * jax.random.normal(jax.random.fold_in(key, i), s)).astype(dtype)
            for i, (k, s) in enumerate(shapes.items())}
  params["none"] = None
  return params


def _grads(params, step):
  return jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32) * 7.0 + step).astype(p.dtype), params)


def _make(name, wrapper, params):
  factory, kwargs, _ = TRANSFORMS[name]
  if wrapper == "inject_hyperparams":
    return optax.inject_hyperparams(factory)(**kwargs)
  tx = factory(**kwargs)
  if wrapper == "MultiSteps":
    return optax.MultiSteps(tx, every_k_schedule=2)
  if wrapper == "masked chain":  # chained after a clip; the odd matrix and the vector left out
    return optax.masked(optax.chain(optax.clip_by_global_norm(1.0), tx),
                        jax.tree.map(lambda p: p.shape not in ((3, 5), (17,)), params))
  return tx


def _run(tx, params, steps, jit=True):
  return run_updates(tx, params, _grads, steps, None if jit else tx.update)


@pytest.mark.parametrize("wrapper", ["inject_hyperparams", "MultiSteps", "masked chain"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.slow
def test_transform_under_wrapper_on_odd_leaves(name, wrapper):
  params = _params(jnp.float32, TRANSFORMS[name][2])
  updates, _, specs = _run(_make(name, wrapper, params), params, steps=2)
  assert all(s == specs[0] for s in specs), "the state's structure, shapes or dtypes changed"
  for u in updates:
    assert u["none"] is None
    for k, p in params.items():
      if p is not None and not isinstance(u[k], optax.MaskedNode):
        assert u[k].shape == p.shape, k
        assert np.all(np.isfinite(np.asarray(u[k], np.float32))), k
  if wrapper == "MultiSteps":  # the first step accumulates, the second applies
    assert not np.any(np.asarray(updates[0]["w"])) and np.any(np.asarray(updates[1]["w"]))
  else:
    assert np.any(np.asarray(updates[-1]["w"]))
  if wrapper == "masked chain":  # a leaf left out passes its gradient through
    np.testing.assert_array_equal(np.asarray(updates[0]["odd"]), np.asarray(_grads(params, 0)["odd"]))


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.slow
def test_bfloat16_params(name):
  params = _params(jnp.bfloat16, TRANSFORMS[name][2])
  # Injected into bfloat16 parameters, optax's hyperparameters are bfloat16 arrays.
  wrappers = ("none", "inject_hyperparams") if name == "adamw_nvfp4" else ("none",)
  for wrapper in wrappers:
    updates, _, specs = _run(_make(name, wrapper, params), params, steps=2)
    assert all(s == specs[0] for s in specs)
    for u in updates:
      assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(u))


def test_jit_equals_no_jit():
  params = {**_params(jnp.float32, True), "v": jnp.ones((17,))}  # both sides of Muon
  tx = _make("muon_nvfp4", "none", params)
  (u_jit,), s_jit, _ = _run(tx, params, steps=1)
  (u_eager,), s_eager, _ = _run(tx, params, steps=1, jit=False)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), u_jit, u_eager)
  assert state_type(s_jit) == state_type(s_eager)


@pytest.mark.parametrize("name", ["adamw_nvfp4", "muon_nvfp4", "root"])
def test_injected_hyperparameters_take_effect(name):
  """A learning rate set to 0 in the state stops the updates; the decays and the weight decay are
  injectable too, and a changed one changes the update."""
  params = _params(jnp.float32, False)
  tx = _make(name, "inject_hyperparams", params)
  decays = {"adamw_nvfp4": ("b1", "b2", "weight_decay"), "muon_nvfp4": ("beta", "adam_b1", "adam_b2"),
            "root": ("beta", "weight_decay", "adam_b2", "outlier_quantile")}[name]
  assert {"learning_rate", *decays} <= set(tx.init(params).hyperparams)
  step = jax.jit(tx.update)
  state = tx.init(params)
  state.hyperparams["learning_rate"] = jnp.zeros_like(state.hyperparams["learning_rate"])
  u, state = step(_grads(params, 0), state, params)
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(u))
  state.hyperparams["learning_rate"] = jnp.asarray(LR, jnp.float32)
  u_first, _ = step(_grads(params, 1), state, params)
  state.hyperparams[decays[0]] = jnp.asarray(0.5, jnp.float32)
  u_other, _ = step(_grads(params, 1), state, params)
  assert not np.array_equal(np.asarray(u_first["w"]), np.asarray(u_other["w"]))


@pytest.mark.slow
def test_traced_adam_constants_and_ns_steps():
  """b1, b2, eps, eps_root and ns_steps as traced arrays skip what needs static values: the
  kernels, which compile the constants in (implementation="pallas" cannot lower on the CPU: the XLA path
  ran), the choice of square root and the Python Newton–Schulz loop; the results are the constant
  ones' (to float32 rounding: optax's constants are float32 arrays)."""
  params = {"w": jax.random.normal(jax.random.key(1), (64, 64))}
  g = _grads(params, 0)
  for eps_root in (0.0, 1e-12):
    plain = optim.scale_by_adam_nvfp4(eps_root=eps_root, implementation="xla")
    injected = optax.inject_hyperparams(optim.scale_by_adam_nvfp4)(eps_root=eps_root,
                                                                    implementation="pallas")
    u1, s1 = jax.jit(plain.update)(g, plain.init(params))
    u2, s2 = jax.jit(injected.update)(g, injected.init(params))
    np.testing.assert_allclose(u2["w"], u1["w"], rtol=1e-5)
    assert np.mean(np.asarray(s1.mu["w"].codes) != np.asarray(s2.inner_state.mu["w"].codes)) < 0.02
  x = jax.random.normal(jax.random.key(2), (20, 40))
  for operand in (None, Operand(format="bf16")):
    traced = jax.jit(lambda x, n, p=operand: optim.newton_schulz(x, steps=n, operand=p))
    np.testing.assert_allclose(traced(x, 5), optim.newton_schulz(x, steps=5, operand=operand),
                               atol=1e-5)


def test_newton_schulz_and_shape_scale_of_empty_matrices():
  shapes = {"e04": (0, 4), "e40": (4, 0), "e00": (0, 0)}
  for shape in shapes.values():
    x = jnp.zeros(shape)
    for operand in (None, Operand(terms=2)):
      assert optim.newton_schulz(x, operand=operand).shape == shape
    for rms in (None, 0.2):
      assert optim.scale_by_shape(rms).update({"w": x}, None)[0]["w"].shape == shape
  for tx in (optim.muon_nvfp4(LR, ns_operand=None), optim.root(LR, ns_operand=None)):
    params = {**{k: jnp.zeros(s) for k, s in shapes.items()}, "v": jnp.ones((16, 32))}
    u, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert all(u[k].shape == s for k, s in shapes.items())
    assert np.all(np.isfinite(np.asarray(u["v"]))) and np.any(np.asarray(u["v"]))


def test_empty_leaves_keep_float32_moments_at_min_size_0():
  assert not optim.stores_nvfp4((0, 64), 0) and optim.stores_nvfp4((1, 16), 0)
  params = {"e": jnp.zeros((0, 64)), "w": jnp.ones((16, 64))}
  tx = optim.adamw_nvfp4(LR, options=optim.AdamNvfp4Options(min_size=0))
  state = tx.init(params)
  assert state[0].mu["e"].dtype == jnp.float32 and isinstance(state[0].mu["w"], nvfp4.NVFP4Tensor)
  u, _ = jax.jit(tx.update)(params, state, params)
  assert u["e"].shape == (0, 64)


def test_bad_outlier_quantile_still_raises():
  with pytest.raises(ValueError, match="outlier_quantile must be in"):
    optim.scale_by_root_nvfp4(outlier_quantile=1.5)
  with pytest.raises(ValueError, match="outlier_quantile must be in"):
    optim.scale_by_root_nvfp4(outlier_quantile=jnp.asarray(0.0))


def _f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _same_bits(a, b):
  np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("nesterov", [False, True])
def test_quantize_false_on_bfloat16_params_equals_optax_adamw_with_float32_moments(nesterov):
  """The documented equality: moments are float32 for every parameter dtype and updates take the
  parameters' dtype, so on bfloat16 parameters adamw_nvfp4(quantize=False) is optax's AdamW
  run on float32 copies of the parameters' gradients with its Adam direction cast to bfloat16, bit for
  bit (optax.adamw alone keeps bfloat16 moments and rounds (1 - b1)·g in bfloat16)."""
  params = {"w": (0.1 * jax.random.normal(jax.random.key(0), (64, 64))).astype(jnp.bfloat16),
            "b": jnp.ones((7,), jnp.bfloat16)}
  ours = optim.adamw_nvfp4(LR, weight_decay=0.1, nesterov=nesterov, quantize=False)
  assert optax.adamw(LR).init(params)[0].mu["w"].dtype == jnp.bfloat16  # what plain optax does
  to_bf16 = optax.GradientTransformation(  # the update back in the gradients' dtype
      optax.init_empty_state, lambda u, s, p=None: (jax.tree.map(lambda x: x.astype(jnp.bfloat16), u), s))
  ref = optax.chain(optax.scale_by_adam(0.9, 0.95, nesterov=nesterov), to_bf16,
                    optax.add_decayed_weights(0.1), optax.scale_by_learning_rate(LR))
  s1, s2, p1, p2 = ours.init(params), ref.init(_f32(params)), params, params
  up1, up2 = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(3):
    g = _grads(params, step)
    u1, s1 = up1(g, s1, p1)
    u2, s2 = up2(_f32(g), s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    jax.tree.map(_same_bits, (u1, p1, s1[0].mu, s1[0].nu), (u2, p2, s2[0].mu, s2[0].nu))
  assert p1["w"].dtype == u1["w"].dtype == jnp.bfloat16 and s1[0].mu["w"].dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp32_muon_momentum_equals_optax_bit_for_bit(dtype):
  """scale_by_muon_nvfp4(ns_operand=None): the momentum is optax.contrib.scale_by_muon's bit for
  bit (on bfloat16 parameters: optax's initialized on float32 copies), the update agrees to float32
  rounding and takes the gradients' dtype."""
  params = {"a": jax.random.normal(jax.random.key(4), (24, 40)).astype(dtype)}
  ours = optim.scale_by_muon_nvfp4(ns_operand=None)
  dims = lambda p: jax.tree.map(lambda _: MuonDimensionNumbers(), p)
  ref = optax.contrib.scale_by_muon(weight_dimension_numbers=dims)
  s1, s2 = ours.init(params), ref.init(_f32(params))
  for step in range(3):
    g = _grads(params, step)
    (u1, s1), (u2, s2) = jax.jit(ours.update)(g, s1), jax.jit(ref.update)(g, s2)
    _same_bits(s1.mu["a"], s2.mu["a"])
    assert u1["a"].dtype == dtype
    tol = 5e-6 if dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(np.asarray(u1["a"], np.float32), u2["a"], atol=tol, rtol=tol)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_nvfp4_moments_stay_finite_and_recover_after_a_gradient_whose_square_overflows(implementation):
  """A finite gradient element of 1e30 (its square overflows float32): optax.adamw stays finite,
  so must the NVFP4 moments, and the other elements' updates are those of a normal step."""
  tx = optim.adamw_nvfp4(LR, weight_decay=0.0, implementation=implementation,
                         options=optim.AdamNvfp4Options(min_size=0, mu=Operand(), nu=Operand()))
  params = {"w": jnp.zeros((32, 64))}
  state = tx.init(params)
  step = jax.jit(tx.update)
  normal = {"w": jnp.sin(jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64))}
  huge = {"w": normal["w"].at[3, 5].set(1e30)}
  u, state = step(huge, state, params)
  assert np.all(np.isfinite(np.asarray(u["w"])))
  assert abs(float(u["w"][3, 5]) + LR) < 0.1 * LR  # the huge element moves by about one lr
  for _ in range(20):
    u, state = step(normal, state, params)
    leaves = jax.tree.leaves(state)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in leaves)
    assert np.all(np.isfinite(np.asarray(u["w"])))
  # After the huge step decays out of v (b2 = 0.95), the other elements step as Adam does again.
  assert np.mean(np.abs(np.asarray(u["w"]))) > 0.3 * LR


@pytest.mark.parametrize("make, match", [
    (lambda: optim.adamw_nvfp4(LR, b2=1.5), r"b2 must be in \[0, 1\)"),
    (lambda: optim.adamw_nvfp4(LR, b1=-0.1), r"b1 must be in \[0, 1\)"),
    (lambda: optim.adamw_nvfp4(LR, eps=-1e-8), "eps must be >= 0"),
    (lambda: optim.scale_by_adam_nvfp4(eps_root=-1.0), "eps_root must be >= 0"),
    (lambda: optim.muon_nvfp4(LR, beta=1.0), r"beta must be in \[0, 1\)"),
    (lambda: optim.muon_nvfp4(LR, ns_steps=-1), "ns_steps must be an int >= 0"),
    (lambda: optim.muon_nvfp4(LR, ns_steps=2.5), "ns_steps must be an int >= 0"),
    (lambda: optim.muon_nvfp4(LR, adam_b2=2.0), r"b2 must be in \[0, 1\)"),
])
def test_hyperparameters_out_of_range_raise_naming_the_argument(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_prefix_muon_mask_gives_params_shaped_inner_states():
  """A label (or None) at a subtree covers its leaves, as optax expands a prefix mask."""
  params = {"blocks": {"w1": jnp.ones((32, 64)), "w2": jnp.ones((64, 32))},
            "embed": jnp.ones((64, 32))}
  mask = {"blocks": True, "embed": False}
  tx = optim.muon_nvfp4(LR, ns_operand=None, muon_mask=mask,
                        adam_options=optim.AdamNvfp4Options(min_size=0))
  state = tx.init(params)
  muon_mu = state.inner_states["muon"].inner_state[0].mu
  assert jax.tree.structure(muon_mu, is_leaf=optim.is_state_leaf) == jax.tree.structure(params)
  assert isinstance(muon_mu["embed"], optax.MaskedNode)
  assert muon_mu["blocks"]["w1"].shape == (32, 64)
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  p_sh = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      "data", "model")), params)
  s_sh = optim.state_sharding(jax.eval_shape(tx.init, params), p_sh)
  mu_sh = s_sh.inner_states["muon"].inner_state[0].mu
  assert mu_sh["blocks"]["w1"].spec == jax.sharding.PartitionSpec("data", "model")
  u, _ = jax.jit(tx.update)(params, state, params)
  assert np.any(np.asarray(u["blocks"]["w1"])) and np.any(np.asarray(u["embed"]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_float32_moments_square_the_gradient_in_float32(dtype):
  """A gradient element whose square underflows in its own dtype (1e-4² in float16) still gives an
  update of about one learning rate (the square is taken in the moment's float32)."""
  tx = optim.adamw_nvfp4(LR, weight_decay=0.0, quantize=False)
  params = {"w": jnp.zeros((8, 8), dtype)}
  g = {"w": jnp.full((8, 8), 1e-4, dtype)}
  u, _ = tx.update(g, tx.init(params), params)
  assert u["w"].dtype == dtype
  np.testing.assert_allclose(np.asarray(u["w"], np.float32), -LR, rtol=1e-2)
