"""fp4jax.kernels.adam_nvfp4: the Pallas update equals the XLA path of scale_by_adam_nvfp4 (interpret
mode on the CPU: state bit for bit, updates to float32 rounding), and lowers to Triton for an H200."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import H200

from fp4jax import _platform, numerics, optim
from fp4jax.kernels import adam_nvfp4 as kernel
from fp4jax.kernels.adam_nvfp4 import AdamKernelConfig
from fp4jax.nvfp4 import NVFP4Tensor
from fp4jax.optim import _common
from fp4jax.quant import Operand

# (64, 128): 512 blocks; (33, 160): 330 blocks, a ragged last program at any power-of-two size;
# "zero": an all-zero gradient (amax 0); "bias": a float32 leaf.
SHAPES = {"w": (64, 128), "odd": (33, 160), "zero": (16, 256), "bias": (128,)}


def _tree(seed, dtype=jnp.float32, nan=False, shapes=SHAPES):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  out = {}
  for i, (k, (name, shape)) in enumerate(zip(keys, shapes.items())):
    x = jax.random.normal(k, shape) * 10.0 ** -i
    out[name] = jnp.zeros(shape) if name == "zero" else x
  if nan:
    out["odd"] = out["odd"].at[3, 5].set(jnp.nan)
  return jax.tree.map(lambda x: x.astype(dtype), out)


def _bits(x):
  x = np.atleast_1d(np.asarray(x))
  return x.view(np.uint8)


def _assert_state_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(_bits(x), _bits(y))


def _assert_updates_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
    # The backends' float32 division and sqrt in u differ by an ulp or two between the two programs.
    np.testing.assert_allclose(np.nan_to_num(x), np.nan_to_num(y), rtol=2e-6, atol=1e-12)


def _tx(impl, rounding="stochastic", config=AdamKernelConfig(), **kw):
  """scale_by_adam_nvfp4 with ``implementation=impl`` on leaves of >= 1024 elements; ``rounding``: both
  moments' or a pair (m, √v)."""
  mu, nu = (rounding, rounding) if isinstance(rounding, str) else rounding
  return optim.scale_by_adam_nvfp4(implementation=impl, block_sizes=config, options=optim.AdamNvfp4Options(
      min_size=1024, mu=Operand(rounding=mu), nu=Operand(rounding=nu)), **kw)


def _run(tx, steps, **tree_kw):
  params = jax.tree.map(jnp.zeros_like, _tree(0, shapes=tree_kw.get("shapes", SHAPES)))
  state, f, us = tx.init(params), jax.jit(tx.update), []
  for t in range(steps):
    u, state = f(_tree(t + 1, **tree_kw), state, params)
    us.append(u)
  return us, state


_XLA_RUNS = {}


def _xla_run(rounding="stochastic", nesterov=False, dtype=jnp.float32, nan=False, shapes=SHAPES):
  """``_run`` of the XLA path for two steps, once per arguments in a test process (the tests compare
  several kernel configurations against the same XLA run)."""
  key = (rounding, nesterov, jnp.dtype(dtype).name, nan, tuple(shapes.items()))
  if key not in _XLA_RUNS:
    _XLA_RUNS[key] = _run(_tx("xla", rounding, nesterov=nesterov), 2, dtype=dtype, nan=nan, shapes=shapes)
  return _XLA_RUNS[key]


@pytest.mark.parametrize("rounding,nesterov,dtype,nan", [
    ("stochastic", False, jnp.float32, False),
    ("nearest", False, jnp.float32, False),
    (("nearest", "stochastic"), True, jnp.bfloat16, False),
    ("stochastic", False, jnp.float32, True),
])
@pytest.mark.slow
def test_interpret_equals_xla_path(rounding, nesterov, dtype, nan):
  u_x, s_x = _xla_run(rounding, nesterov, dtype=dtype, nan=nan)
  u_k, s_k = _run(_tx("pallas_interpret", rounding, nesterov=nesterov), 2, dtype=dtype, nan=nan)
  assert isinstance(s_k.mu["w"], NVFP4Tensor) and not isinstance(s_k.mu["bias"], NVFP4Tensor)
  _assert_state_equal(s_k, s_x)
  for a, b in zip(u_k, u_x):
    assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)
    _assert_updates_close(a, b)
  if nan:  # a non-finite moment: NaN global scale, every code 0 (nvfp4.quantize's contract)
    assert np.isnan(np.asarray(s_k.mu["odd"].global_scale))
    assert not np.any(np.asarray(s_k.mu["odd"].codes))
    assert np.isfinite(np.asarray(s_k.mu["w"].global_scale))
  zero = s_k.mu["zero"]  # amax 0: S_dec = 1, all codes and scales 0
  assert float(zero.global_scale) == 1.0 and not np.any(np.asarray(zero.codes))


@pytest.fixture(scope="module")
def xla_second_step():
  """The XLA path's state after one step from zero, and its second step's updates and state (one
  compiled update, shared by the cases that call the kernels directly)."""
  tx = _tx("xla")
  params = jax.tree.map(jnp.zeros_like, _tree(0))
  update = jax.jit(tx.update)
  _, state = update(_tree(1), tx.init(params), params)
  return state, *update(_tree(2), state, params)


@pytest.mark.parametrize("block_rows, stats_block_rows", [(64, 64), (64, 256)])
@pytest.mark.slow
def test_many_programs_and_ragged_tail(block_rows, stats_block_rows, xla_second_step):
  """The kernels called directly with small programs (8 and 6 programs, the last ragged; the first
  pass and encode with programs of different sizes) from a non-zero state give the XLA path's
  state."""
  state, u_x, s_x = xla_second_step

  names = ["odd", "w", "zero"]  # the tree's leaf order (sorted keys); bias is float32
  ids = [sorted(SHAPES).index(n) for n in names]
  hp = kernel.AdamHyper(0.9, 0.95, 1e-8, 0.0, False, True, "stochastic", "stochastic")
  config = AdamKernelConfig(block_rows=block_rows, stats_block_rows=stats_block_rows)

  @jax.jit
  def direct(g, mu, nu, count):
    count_inc = count + 1
    bound = optim.adam_update_bound(count_inc, 0.9, 0.95)
    bcs = numerics.bias_factors(0.9, 0.95, 0.0, count_inc)
    return kernel.update_leaves([g[n] for n in names], [mu[n] for n in names],
                                [nu[n] for n in names], ids, _common.step_key(0, count_inc), hp,
                                bcs, bound, numerics.runtime_zero(count_inc), block_sizes=config,
                                interpret=True)

  us, mus, nus = direct(_tree(2), state.mu, state.nu, state.count)
  for j, n in enumerate(names):
    _assert_state_equal((mus[j], nus[j]), (s_x.mu[n], s_x.nu[n]))
    _assert_updates_close(us[j], u_x[n])


@pytest.mark.slow
def test_leaves_outside_the_kernels_use_the_xla_path():
  """A leaf blocked along its first axis (a (64, 72) LM head) goes through XLA beside the kernels'
  leaves: the same state as implementation="xla"."""
  shapes = {"w": (64, 128), "head": (64, 72)}
  _, s_x = _run(_tx("xla"), 2, shapes=shapes)
  _, s_k = _run(_tx("pallas_interpret"), 2, shapes=shapes)
  assert s_k.mu["head"].axis == 0
  _assert_state_equal(s_k, s_x)


def test_supports_only_last_axis_blocks():
  assert kernel.supports(_common.zeros_nvfp4((64, 128)))
  assert not kernel.supports(_common.zeros_nvfp4((64, 24)))  # blocked along axis 0
  assert not kernel.supports(jnp.zeros((64, 128)))


def test_kernel_config_is_validated_and_hashable():
  default = AdamKernelConfig()
  assert hash(default) == hash(AdamKernelConfig()) and default != AdamKernelConfig(launch_group=1)
  for kw, match in ((dict(block_rows=96), "block_rows must be a power of two"),
                    (dict(stats_block_rows=0), "stats_block_rows must be a positive int"),
                    (dict(atomic_slots=-1), "atomic_slots must be a positive int"),
                    (dict(num_warps=4.0), "num_warps must be a positive int"),
                    (dict(evict_hints=1), "evict_hints must be a bool")):
    with pytest.raises(ValueError, match=match):
      AdamKernelConfig(**kw)
  hp = kernel.AdamHyper(0.9, 0.95, 1e-8, 0.0, False, True, "nearest", "nearest")
  z = _common.zeros_nvfp4((16, 64))
  with pytest.raises(ValueError, match="block_sizes must be an AdamKernelConfig"):
    kernel.update_leaves([jnp.zeros((16, 64))], [z], [z], [0], None, hp, (1.0, 1.0, 1.0, 0.0),
                         1.0, jnp.int32(0), block_sizes={"block_rows": 64}, interpret=True)


def test_auto_follows_the_default_device():
  assert _platform.default_platform() == "cpu"
  with jax.default_device("cpu"):
    assert _platform.default_platform() == "cpu"


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_lowers_to_triton_for_h200(triton_modules, rounding):
  """Two Triton kernels per NVFP4 leaf of its own size (``stats`` and ``encode``) and nothing per
  element left to XLA; the encoder divides and takes square roots with PTX's correctly rounded
  instructions; ragged leaves load with masks."""
  tx = _tx("pallas", rounding)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  state = jax.eval_shape(tx.init, params)
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(tx.update).trace(params, state).lower(lowering_platforms=("cuda",)).as_text()
  n_leaves = 3
  assert hlo.count("__gpu$xla.gpu.triton") == 2 * n_leaves, hlo
  assert len(triton_modules) == 2 * n_leaves
  stats = [m for m in triton_modules if "@adam_nvfp4_stats" in m]
  encode = [m for m in triton_modules if "@adam_nvfp4_encode" in m]
  assert len(stats) == len(encode) == n_leaves
  for m in encode:
    assert "div.rn.f32" in m and "sqrt.rn.f32" in m
  # The (33, 160) leaf: 330 blocks, not a multiple of either kernel's blocks per program, so its loads
  # carry masks (and only its).
  config = AdamKernelConfig()
  for modules, br in ((encode, config.block_rows), (stats, config.stats_block_rows)):
    assert 330 % br and 512 % br == 0 and 4096 // 16 % br == 0
    masked = [m for m in modules if re.search(rf"tt\.load %\w+, %\w+, %\w+ : tensor<{br}x8x", m)]
    assert len(masked) == 1, [m[:200] for m in masked]



def _uses_pallas(tx, monkeypatch, platform, shapes=SHAPES):
  """Whether ``tx.update``'s jaxpr calls a Pallas kernel when the default platform is ``platform``."""
  monkeypatch.setattr(_platform, "default_platform", lambda: platform)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  state = jax.eval_shape(tx.init, params)
  update = lambda *args: tx.update(*args)
  return "pallas_call" in str(jax.make_jaxpr(update)(params, state, params))


def test_auto_takes_the_kernels_on_a_cuda_gpu_only(monkeypatch):
  options = optim.AdamNvfp4Options(min_size=1024)
  tx = optim.adamw_nvfp4(1e-3, options=options)
  assert _uses_pallas(tx, monkeypatch, "cuda")
  assert not _uses_pallas(tx, monkeypatch, "cpu")
  assert not _uses_pallas(tx, monkeypatch, "rocm")
  assert not _uses_pallas(optim.adamw_nvfp4(1e-3, options=options, implementation="xla"), monkeypatch, "cuda")


def test_train_uses_xla_when_the_state_is_sharded(monkeypatch):
  """fp4jax.train's optimizer: the kernels see whole leaves, so a sharded state updates through XLA."""
  from fp4jax.recipe import get_recipe
  from fp4jax.train import OptimizerConfig, make_optimizer
  recipe = get_recipe("bf16", optimizer_states="nvfp4")
  shapes = {"embedding": (256, 64), "w": (64, 128)}  # Muon sends the embedding to AdamW
  for name in ("adamw", "muon"):
    cfg = OptimizerConfig(name=name)
    assert _uses_pallas(make_optimizer(cfg, recipe, 10), monkeypatch, "cuda", shapes)
    tx = make_optimizer(cfg, recipe, 10, sharded_state=True)
    assert not _uses_pallas(tx, monkeypatch, "cuda", shapes)


@pytest.mark.slow
def test_first_pass_with_spread_atomics(triton_modules):
  """``atomic_slots`` (each max folded into several copies, reduced by XLA; 1: one address) gives
  the XLA path's state in interpret mode with fewer copies than programs (1) and about as many (4; the
  default, 64, more copies than programs, is ``test_interpret_equals_xla_path``'s), and lowers to
  Triton for an H200."""
  _, s_x = _xla_run()
  for slots in (1, 4):
    _, s_k = _run(_tx("pallas_interpret", config=AdamKernelConfig(atomic_slots=slots)), 2)
    _assert_state_equal(s_k, s_x)
  tx = _tx("pallas", config=AdamKernelConfig(atomic_slots=4))
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  with jax.sharding.use_abstract_mesh(H200):
    jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(
        lowering_platforms=("cuda",))
  assert len(triton_modules) == 6


# Leaves of three sizes that repeat: 8192 elements (a, b, w; b of another shape), 5280 (odd, odd2:
# ragged programs), and 4096 (zero) alone.
GROUPED = {"a": (64, 128), "b": (128, 64), "odd": (33, 160), "odd2": (33, 160), "w": (64, 128),
           "zero": (16, 256), "bias": (128,)}


@pytest.mark.parametrize("group,launches,interpret", [(12, 3, True), (2, 4, False)])
@pytest.mark.slow
def test_leaves_of_one_size_share_launches(triton_modules, group, launches, interpret):
  """Leaves of one size and dtype share each kernel's launch, at most ``launch_group`` at a time (their
  programs side by side, a branch per leaf): the XLA path's state in interpret mode, a NaN leaf and
  ragged programs included, and fewer Triton calls for an H200 (6 NVFP4 leaves: 6 launches per kernel
  unshared). Groups of 12 give launches of three leaves, two and one, every kind of launch that groups of
  2 make (two, one, two, one): those run in interpret mode once, and each group size is lowered."""
  config = AdamKernelConfig(launch_group=group)
  if interpret:
    u_x, s_x = _xla_run(nan=True, shapes=GROUPED)
    u_k, s_k = _run(_tx("pallas_interpret", config=config), 2, nan=True, shapes=GROUPED)
    _assert_state_equal(s_k, s_x)
    for a, b in zip(u_k, u_x):
      _assert_updates_close(a, b)
  tx = _tx("pallas", config=config)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in GROUPED.items()}
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 2 * launches, hlo
  assert len(triton_modules) == 2 * launches


@pytest.mark.parametrize("hints", [False, True])
def test_eviction_hints_lower_where_asked(triton_modules, hints):
  """``evict_hints``: ``encode`` lowers with the hints on its loads and its update's stores when on,
  and no kernel has hints when off. (Interpret mode ignores the hints, so whether they change a value
  is a GPU check: tests/gpu/test_optim_gpu.py runs the default config, hints on.)"""
  config = AdamKernelConfig(evict_hints=hints)
  tx = _tx("pallas", config=config)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in GROUPED.items()}
  with jax.sharding.use_abstract_mesh(H200):
    jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(lowering_platforms=("cuda",))
  encode = [m for m in triton_modules if "@adam_nvfp4_encode" in m]
  assert encode and all(("evict_first" in m and "evict_last" in m) == bool(hints) for m in encode)
  assert not any("evict_" in m for m in triton_modules if "@adam_nvfp4_stats" in m)
