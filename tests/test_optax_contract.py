"""The optax contract, checked for every fp4jax.optim transformation and configuration.

One parametrized battery in the spirit of optax's ``contrib/_common_test.py``: for each entry of
``CONFIGS`` and each parameter dtype optax supports, the state keeps its type (tree structure, shapes,
dtypes) through ``update``, updates come back in the parameters' dtype, ``jit`` equals eager,
``lax.scan`` and ``lax.cond`` run over steps, ``init`` under ``jax.eval_shape`` builds the state's type,
the state keeps its shardings under auto and explicit mesh axes, ``optax.tree_utils.tree_map_params``
maps a params-shaped tree over the state, optax's wrappers compose, and a small problem converges.
A new transformation joins by one line in ``CONFIGS``.

conftest.py gives every test process 8 CPU devices (XLA_FLAGS).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import RUN_OPTIMIZED, run_updates, state_type
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import optim
from fp4jax.quant import Operand

LR = 1e-2
ALL_NVFP4 = optim.AdamNvfp4Options(min_size=0)

# name -> a factory of the transformation. Every configuration a user can pick that changes which
# code runs (NVFP4 or float32 moments, NVFP4 or fp32 Newton–Schulz, the kernel or XLA) has a line.
CONFIGS = {
    "adamw_nvfp4": lambda: optim.adamw_nvfp4(LR, weight_decay=0.1, options=ALL_NVFP4),
    "adamw_nvfp4_nearest": lambda: optim.adamw_nvfp4(
        LR, options=optim.AdamNvfp4Options(min_size=0, mu=Operand(), nu=Operand())),
    "adamw_nvfp4_xla": lambda: optim.adamw_nvfp4(LR, options=ALL_NVFP4, implementation="xla"),
    "adamw_unquantized": lambda: optim.adamw_nvfp4(LR, quantize=False),
    # The method's storage: √v mean-removed and Hadamard-rotated (CenteredNVFP4Tensor leaves), m rounded
    # to nearest with subtractive dither, the embedding's moments float32 (by path).
    "adamw_nvfp4_method": lambda: optim.adamw_nvfp4(LR, weight_decay=0.1, options=optim.AdamNvfp4Options(
        min_size=0, mu=Operand(), nu_transform="mean_hadamard", dither=("mu",), keep_fp32=("embed",))),
    "scale_by_adam_nvfp4": lambda: optim.scale_by_adam_nvfp4(options=ALL_NVFP4),
    "muon_nvfp4": lambda: optim.muon_nvfp4(LR, adam_options=ALL_NVFP4),
    "muon_fp32": lambda: optim.muon_nvfp4(LR, ns_operand=None, adam_options=ALL_NVFP4),
    "muon_unquantized": lambda: optim.muon_nvfp4(LR, ns_operand=None, quantize=False),
    "root": lambda: optim.root(LR, adam_options=ALL_NVFP4),
}

# The configurations whose Newton–Schulz products take NVFP4 operands.
NVFP4_NEWTON_SCHULZ = ("muon_nvfp4", "root")

# One configuration per distinct code path (the kernel, XLA and float32 AdamW; NVFP4, float32 and
# unquantized Muon), for the properties that each cost a compilation per configuration: jit against
# eager, scan and cond, wrappers, shardings. The others share these paths (``scale_by_adam_nvfp4``
# is ``adamw_nvfp4``'s core, ``adamw_nvfp4_nearest`` differs only in a rounding mode,
# ``adamw_nvfp4_method`` in its storage: its optax wrappers are tests/test_optim_moments.py's, ``root`` is
# Muon's NVFP4 Newton–Schulz with other coefficients) and take the per-dtype and convergence tests.
CODE_PATHS = ["adamw_nvfp4", "adamw_nvfp4_xla", "adamw_unquantized", "muon_nvfp4", "muon_fp32",
              "muon_unquantized"]

# The fast tier runs the AdamW paths and unquantized Muon; the Newton–Schulz configurations (NVFP4 and
# float32 operands, a second compilation of each product) and AdamW's XLA twin of the kernel path run in
# the slow tier (``pytest -m slow``).
_SLOW = ("muon_nvfp4", "muon_fp32", "root", "adamw_nvfp4_xla")


def _tiered(names):
  return [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in names]


REAL = [jnp.float32, jnp.bfloat16, jnp.float16]
COMPLEX = [jnp.complex64]


def _params(dtype=jnp.float32):
  """A matrix (Muon's side), an embedding and a vector (AdamW's side), all NVFP4-sized."""
  shapes = {"w": (32, 64), "embed": (64, 32), "b": (64,)}
  key = jax.random.key(0)
  out = {}
  for i, (k, s) in enumerate(shapes.items()):
    x = 0.1 * jax.random.normal(jax.random.fold_in(key, i), s)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      x = x + 0.05j * jax.random.normal(jax.random.fold_in(key, 10 + i), s)
    out[k] = x.astype(dtype)
  return out


def _grads(params, step):
  return jax.tree.map(lambda p: (jnp.sin(p * 7.0 + step) + 0.01).astype(p.dtype), params)


def _steps(tx, params, n, update=None):
  return run_updates(tx, params, _grads, n, update)


@functools.lru_cache(maxsize=None)
def _two_steps(name):
  """``_steps`` of a fresh ``CONFIGS[name]`` for two steps on the float32 ``_params``: computed once per
  configuration in a test process (several tests compare against it)."""
  return _steps(CONFIGS[name](), _params(), 2)


def _close(a, b, rtol=1e-5, atol=1e-7):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol,
                                                       atol=atol), a, b)


@pytest.mark.parametrize("name", _tiered(CONFIGS))
def test_state_type_is_stable_and_updates_take_the_params_dtype(name):
  """Every dtype optax supports, side by side in one tree (``{dtype: _params(dtype)}``, one compilation
  per configuration): the state keeps its type, each update comes back finite in its parameter's
  dtype, and complex updates keep their phase."""
  params = {jnp.dtype(d).name: _params(d) for d in REAL + COMPLEX}
  updates, _, types = _steps(CONFIGS[name](), params, 2)
  assert all(t == types[0] for t in types), "update changed the state's structure, shape or dtype"
  for u in updates:
    for d, group in params.items():
      for k, p in group.items():
        assert u[d][k].dtype == p.dtype, (d, k, u[d][k].dtype)
        assert np.all(np.isfinite(np.asarray(u[d][k]))), (d, k)
  # The phase is kept, not dropped.
  assert all(np.any(np.imag(np.asarray(u["complex64"][k])) != 0) for u in updates[1:] for k in params["complex64"])


@pytest.mark.parametrize("name", _tiered(CONFIGS))
def test_float64_params_keep_their_dtype(name):
  with jax.enable_x64(True):
    params = _params(jnp.float64)
    updates, _, types = _steps(CONFIGS[name](), params, 2)
    assert all(t == types[0] for t in types)
    assert all(u[k].dtype == jnp.float64 for u in updates for k in params)


@pytest.mark.parametrize("name", _tiered(CODE_PATHS))
def test_jit_equals_eager_and_eval_shape_init_is_the_state_type(name):
  tx, params = CONFIGS[name](), _params()
  assert state_type(jax.eval_shape(tx.init, params)) == state_type(tx.init(params))
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  assert state_type(tx.init(shapes)) == state_type(tx.init(params))
  u_jit, s_jit, _ = _two_steps(name)
  u_eager, s_eager, _ = _steps(tx, params, 2, update=tx.update)
  # NVFP4 codes may differ by one code where XLA fuses a division differently from eager.
  _close(u_jit, u_eager, rtol=2e-2, atol=1e-4)
  assert state_type(s_jit) == state_type(s_eager)


@pytest.mark.parametrize("name", _tiered(CODE_PATHS))
def test_scan_and_cond_over_steps(name):
  tx, params = CONFIGS[name](), _params()
  grads = [_grads(params, s) for s in range(3)]

  def body(carry, g):
    p, state = carry
    u, state = tx.update(g, state, p)
    return (optax.apply_updates(p, u), state), u

  stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
  (p_scan, s_scan), _ = jax.jit(lambda c, g: jax.lax.scan(body, c, g))((params, tx.init(params)),
                                                                       stacked)
  p_loop, s_loop = params, tx.init(params)
  step = jax.jit(body)
  for g in grads:
    (p_loop, s_loop), _ = step((p_loop, s_loop), g)
  _close(p_scan, p_loop, rtol=1e-4, atol=1e-5)
  assert state_type(s_scan) == state_type(s_loop)

  @jax.jit
  def maybe_step(take, p, state, g):  # both branches must return the same type
    return jax.lax.cond(take, lambda: tx.update(g, state, p), lambda: (jax.tree.map(
        jnp.zeros_like, g), state))
  u, state = maybe_step(True, params, tx.init(params), grads[0])
  assert state_type(state) == state_type(tx.init(params))
  assert np.any(np.asarray(u["w"]))


@pytest.mark.parametrize("name", _tiered(CODE_PATHS))
def test_optax_wrappers_compose(name):
  """optax's chain, masked, apply_if_finite and MultiSteps around the transformation, nested in one
  stack (one compilation): every step keeps the state's type, and the masked-out leaf is passed
  through untouched while the others update."""
  params = _params()
  inner = optax.masked(optax.chain(optax.clip_by_global_norm(1.0), CONFIGS[name]()),
                       {"w": True, "embed": True, "b": False})
  tx = optax.MultiSteps(optax.apply_if_finite(inner, max_consecutive_errors=2), every_k_schedule=2)
  updates, _, types = _steps(tx, params, 4)
  assert all(t == types[0] for t in types)
  assert not np.any(np.asarray(updates[0]["w"]))  # MultiSteps accumulates the first of every 2 steps
  assert np.any(np.asarray(updates[1]["w"])) and np.any(np.asarray(updates[1]["embed"]))
  mean_b = (np.asarray(_grads(params, 0)["b"]) + np.asarray(_grads(params, 1)["b"])) / 2  # params unchanged
  np.testing.assert_allclose(np.asarray(updates[1]["b"]), mean_b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", _tiered(CONFIGS))
def test_tree_map_params_maps_a_params_shaped_tree(name):
  """optax's documented use: partition specs of the state from the parameters' specs."""
  tx, params = CONFIGS[name](), _params()
  state = tx.init(params)
  specs = {"w": P("data", "model"), "embed": P(None, "model"), "b": P()}
  keep_masked = lambda m, spec: m if isinstance(m, optax.MaskedNode) else spec
  mapped = optax.tree_utils.tree_map_params(tx, keep_masked, state, specs,
                                            transform_non_params=lambda _: P(),
                                            is_leaf=optim.is_state_leaf)
  spec_leaves = jax.tree.leaves(mapped, is_leaf=lambda x: isinstance(x, P))
  assert spec_leaves and all(isinstance(s, P) for s in spec_leaves)
  assert P("data", "model") in spec_leaves  # a moment of "w" took "w"'s spec
  # The same with shapes: f sees each moment beside its parameter's leaf.
  same = lambda m, p: isinstance(m, optax.MaskedNode) or m.shape == p.shape
  seen = optax.tree_utils.tree_map_params(tx, same, state, params,
                                          transform_non_params=lambda _: True,
                                          is_leaf=optim.is_state_leaf)
  assert all(jax.tree.leaves(seen))


def _mesh(axis_type):
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


SPECS = {"w": P("data", "model"), "embed": P(None, "model"), "b": P("data")}


def _shardings(tree):
  return [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", _tiered(CODE_PATHS))
@pytest.mark.slow
def test_init_builds_the_shardings_update_returns(name, axis_type):
  tx, mesh = CONFIGS[name](), _mesh(axis_type)
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in SPECS.items()})
    # Under auto axes a traced parameter's sharding is XLA's choice, not the program's: init on the
    # concrete sharded parameters (or jit it with state_sharding's out_shardings); under explicit
    # axes the sharding is the parameters' type, and a jitted init sees it.
    state = jax.jit(tx.init)(params) if axis_type == AxisType.Explicit else tx.init(params)
    step, sharded = jax.jit(tx.update), []
    for s in range(2):
      updates, new_state = step(_grads(params, s), state, params)
      assert state_type(new_state) == state_type(state)
      assert [sh.spec for sh in _shardings(new_state)] == [sh.spec for sh in _shardings(state)]
      state, params = new_state, optax.apply_updates(params, updates)
      sharded.append(jax.device_get(updates))
    assert updates["w"].sharding.spec == P("data", "model")
  # Sharded equals unsharded, to rounding: the partitioner may sum in another order.
  unsharded, _, _ = _two_steps(name)
  for s in range(2):
    if name in NVFP4_NEWTON_SCHULZ:
      # Newton–Schulz with NVFP4 operands (five quintic iterations, slope ~3.4 on small singular
      # values) turns a partitioned sum's rounding into another draw of the same quantization
      # error: the two results are as far apart as either is from float32 Newton–Schulz (~0.12
      # relative Frobenius for Muon, ~0.2 for ROOT), and no farther. Leaves outside
      # Newton–Schulz agree elementwise.
      for k in sharded[s]:
        a, b = np.asarray(sharded[s][k]), np.asarray(unsharded[s][k])
        if k == "w":
          assert np.linalg.norm(a - b) <= 0.3 * np.linalg.norm(b), (s, k)
        else:
          _close(a, b, rtol=2e-2, atol=1e-4)
    else:
      _close(sharded[s], unsharded[s], rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("name", _tiered(CONFIGS))
@pytest.mark.slow
def test_converges_on_a_least_squares_problem(name):
  key = jax.random.key(1)
  a = jax.random.normal(key, (64, 32))
  target = {"w": jax.random.normal(jax.random.fold_in(key, 1), (32, 64)) * 0.1,
            "embed": jax.random.normal(jax.random.fold_in(key, 2), (64, 32)) * 0.1,
            "b": jnp.linspace(-0.1, 0.1, 64)}
  loss = lambda p: sum(jnp.mean((a @ p[k] - a @ target[k]) ** 2) for k in ("w",)) + sum(
      jnp.mean((p[k] - target[k]) ** 2) for k in ("embed", "b"))
  tx = CONFIGS[name]()
  if name.startswith("scale_by_"):  # a direction: the learning rate is the caller's
    tx = optax.chain(tx, optax.scale(-LR))
  params = jax.tree.map(jnp.zeros_like, target)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    g = jax.grad(loss)(params)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  start = float(loss(params))
  for _ in range(300):
    params, state = step(params, state)
  assert float(loss(params)) < 0.05 * start


@pytest.mark.parametrize("rounding", ["stochastic"])
@pytest.mark.slow
def test_nvfp4_moments_settle_within_half_a_learning_rate_of_optax(rounding):
  """The tolerance README states: 10,000 steps at a constant learning rate on a quadratic; every
  parameter ends within 0.5·lr of optax.adamw's (whose own distance to the minimum is ~0.04·lr).

  The two scans' time is their run: both compiled at XLA's default CPU level (conftest's
  ``RUN_OPTIMIZED``; 2x faster)."""
  target = jax.random.normal(jax.random.key(0), (128, 128))
  loss = lambda p: 0.5 * jnp.sum((p - target) ** 2)

  def run(tx):
    def body(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), None
    p = jnp.zeros_like(target)
    scan = jax.jit(lambda c: jax.lax.scan(body, c, None, length=10_000),
                   compiler_options=RUN_OPTIMIZED)
    (p, _), _ = scan((p, tx.init(p)))
    return np.asarray(p)

  ref = run(optax.adamw(LR, b1=0.9, b2=0.95, weight_decay=0.0))
  ours = run(optim.adamw_nvfp4(LR, weight_decay=0.0, options=optim.AdamNvfp4Options(
      min_size=0, mu=Operand(rounding=rounding), nu=Operand(rounding=rounding))))
  assert np.max(np.abs(ours - ref)) < 0.5 * LR
  assert np.max(np.abs(ours - ref)) > 0  # the moments were quantized
