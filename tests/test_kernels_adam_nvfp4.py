"""fp4jax.kernels.adam_nvfp4: the Pallas update equals the XLA path of scale_by_adam_nvfp4 (interpret
mode on the CPU: state bit for bit, updates to float32 rounding), and lowers to Triton for an H200."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import H200

from fp4jax import optim
from fp4jax.nvfp4 import NVFP4Tensor
from fp4jax.kernels import adam_nvfp4 as kernel
from fp4jax.optim import _common

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


def _run(tx, steps, **tree_kw):
  params = jax.tree.map(jnp.zeros_like, _tree(0, shapes=tree_kw.get("shapes", SHAPES)))
  state, f, us = tx.init(params), jax.jit(tx.update), []
  for t in range(steps):
    u, state = f(_tree(t + 1, **tree_kw), state, params)
    us.append(u)
  return us, state


@pytest.mark.parametrize("rounding,nesterov,dtype,nan,amax", [
    ("stochastic", False, jnp.float32, False, "bound"),
    ("nearest", False, jnp.float32, False, "bound"),
    (("nearest", "stochastic"), True, jnp.bfloat16, False, "bound"),
    ("stochastic", False, jnp.float32, True, "bound"),
    ("stochastic", False, jnp.float32, False, "exact"),
    ("stochastic", False, jnp.float32, True, "exact"),
])
def test_interpret_equals_xla_path(rounding, nesterov, dtype, nan, amax):
  kw = dict(rounding=rounding, nesterov=nesterov, min_size=1024, amax=amax)
  u_x, s_x = _run(optim.scale_by_adam_nvfp4(kernel="xla", **kw), 2, dtype=dtype, nan=nan)
  u_k, s_k = _run(optim.scale_by_adam_nvfp4(kernel="pallas_interpret", **kw), 2, dtype=dtype, nan=nan)
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


@pytest.mark.parametrize("block_rows, stats_block_rows, amax",
                         [(64, 64, "bound"), (128, 128, "exact"), (64, 256, "bound"),
                          (64, 256, "exact")])
def test_many_programs_and_ragged_tail(block_rows, stats_block_rows, amax):
  """The kernels called directly with small programs (8 and 6 programs, the last ragged; the first
  pass and encode with programs of different sizes; both amax rules) from a non-zero state give the
  XLA path's state."""
  tx = optim.scale_by_adam_nvfp4(kernel="xla", min_size=1024, amax=amax)
  params = jax.tree.map(jnp.zeros_like, _tree(0))
  _, state = jax.jit(tx.update)(_tree(1), tx.init(params), params)
  u_x, s_x = jax.jit(tx.update)(_tree(2), state, params)

  names = ["odd", "w", "zero"]  # the tree's leaf order (sorted keys); bias is float32
  ids = [sorted(SHAPES).index(n) for n in names]
  hp = kernel.AdamHyper(0.9, 0.95, 1e-8, 0.0, False, True, "stochastic", "stochastic", amax)

  @jax.jit
  def direct(g, mu, nu, count):
    count_inc = count + 1
    bound = optim.adam_update_bound(count_inc, 0.9, 0.95)
    bcs = _common.bias_factors(0.9, 0.95, 0.0, count_inc)
    return kernel.update_leaves([g[n] for n in names], [mu[n] for n in names],
                                [nu[n] for n in names], ids, _common.step_key(0, count_inc), hp,
                                bcs, bound, _common.runtime_zero(count_inc),
                                block_rows=block_rows, stats_block_rows=stats_block_rows,
                                interpret=True)

  us, mus, nus = direct(_tree(2), state.mu, state.nu, state.count)
  for j, n in enumerate(names):
    _assert_state_equal((mus[j], nus[j]), (s_x.mu[n], s_x.nu[n]))
    _assert_updates_close(us[j], u_x[n])


def test_options_outside_the_kernels_use_the_xla_path():
  """Storage options the kernels do not implement fall back to XLA: same state as kernel="xla"."""
  kw = dict(min_size=1024, mu_storage="normalized", nu_transform="quarter")
  _, s_x = _run(optim.scale_by_adam_nvfp4(kernel="xla", **kw), 1)
  _, s_k = _run(optim.scale_by_adam_nvfp4(kernel="pallas_interpret", **kw), 1)
  _assert_state_equal(s_k, s_x)


def test_supports_only_last_axis_blocks():
  assert kernel.supports(_common.zeros_nvfp4((64, 128)))
  assert not kernel.supports(_common.zeros_nvfp4((64, 24)))  # blocked along axis 0
  assert not kernel.supports(jnp.zeros((64, 128)))


def test_bad_arguments():
  with pytest.raises(ValueError, match="kernel must be one of"):
    optim.scale_by_adam_nvfp4(kernel="triton")
  hp = kernel.AdamHyper(0.9, 0.95, 1e-8, 0.0, False, True, "nearest", "nearest")
  z = _common.zeros_nvfp4((16, 64))
  args = ([jnp.zeros((16, 64))], [z], [z], [0], None, hp, (1.0, 1.0, 1.0), 1.0, jnp.int32(0))
  with pytest.raises(ValueError, match="^block_rows must be a power of two"):
    kernel.update_leaves(*args, block_rows=96, interpret=True)
  with pytest.raises(ValueError, match="stats_block_rows must be a power of two"):
    kernel.update_leaves(*args, stats_block_rows=0, interpret=True)


def test_auto_follows_the_default_device():
  assert _common.default_platform() == "cpu"
  with jax.default_device("cpu"):
    assert _common.default_platform() == "cpu"


@pytest.mark.parametrize("rounding,amax", [("stochastic", "bound"), ("nearest", "bound"),
                                           ("stochastic", "exact")])
def test_lowers_to_triton_for_h200(triton_modules, rounding, amax):
  """Two Triton kernels per NVFP4 leaf of its own size (a first pass, ``gmax`` or ``stats``, and ``encode``) and
  nothing per element left to XLA; the encoder divides and takes square roots with PTX's correctly
  rounded instructions; ragged leaves load with masks."""
  tx = optim.scale_by_adam_nvfp4(kernel="pallas", rounding=rounding, min_size=1024, amax=amax)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  state = jax.eval_shape(tx.init, params)
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(tx.update).trace(params, state).lower(lowering_platforms=("cuda",)).as_text()
  n_leaves = 3
  assert hlo.count("__gpu$xla.gpu.triton") == 2 * n_leaves, hlo
  assert len(triton_modules) == 2 * n_leaves
  first = "@adam_nvfp4_gmax" if amax == "bound" else "@adam_nvfp4_stats"
  stats = [m for m in triton_modules if first in m]
  encode = [m for m in triton_modules if "@adam_nvfp4_encode" in m]
  assert len(stats) == len(encode) == n_leaves
  for m in encode:
    assert "div.rn.f32" in m and "sqrt.rn.f32" in m
  # The (33, 160) leaf: 330 blocks, not a multiple of either kernel's blocks per program, so its loads
  # carry masks (and only its).
  for modules, br in ((encode, kernel.BLOCK_ROWS), (stats, kernel.STATS_BLOCK_ROWS)):
    assert 330 % br and 512 % br == 0 and 4096 // 16 % br == 0
    masked = [m for m in modules if re.search(rf"tt\.load %\w+, %\w+, %\w+ : tensor<{br}x8x", m)]
    assert len(masked) == 1, [m[:200] for m in masked]



def _uses_pallas(tx, monkeypatch, platform, shapes=SHAPES):
  """Whether ``tx.update``'s jaxpr calls a Pallas kernel when the default platform is ``platform``."""
  monkeypatch.setattr(_common, "default_platform", lambda: platform)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  state = jax.eval_shape(tx.init, params)
  update = lambda *args: tx.update(*args)  # noqa: E731 (a new function: no cached trace)
  return "pallas_call" in str(jax.make_jaxpr(update)(params, state, params))


def test_auto_takes_the_kernels_on_a_cuda_gpu_only(monkeypatch):
  tx = optim.adamw_nvfp4(1e-3, min_size=1024)
  assert _uses_pallas(tx, monkeypatch, "cuda")
  assert not _uses_pallas(tx, monkeypatch, "cpu")
  assert not _uses_pallas(tx, monkeypatch, "rocm")
  assert not _uses_pallas(optim.adamw_nvfp4(1e-3, min_size=1024, kernel="xla"), monkeypatch, "cuda")


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


@pytest.mark.parametrize("amax", ["exact", "bound"])
def test_first_pass_with_spread_atomics(monkeypatch, triton_modules, amax):
  """``ATOMIC_SLOTS`` (each max folded into several copies, reduced by XLA; 1: one address) gives the
  XLA path's state in interpret mode, with more programs than copies and the reverse, and lowers to
  Triton for an H200."""
  for slots in (1, 4, 64):
    monkeypatch.setattr(kernel, "ATOMIC_SLOTS", slots)
    kw = dict(min_size=1024, amax=amax)
    _, s_x = _run(optim.scale_by_adam_nvfp4(kernel="xla", **kw), 2)
    _, s_k = _run(optim.scale_by_adam_nvfp4(kernel="pallas_interpret", **kw), 2)
    _assert_state_equal(s_k, s_x)
  tx = optim.scale_by_adam_nvfp4(kernel="pallas", **kw)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  with jax.sharding.use_abstract_mesh(H200):
    jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(
        lowering_platforms=("cuda",))
  assert len(triton_modules) == 6


# Leaves of three sizes that repeat: 8192 elements (a, b, w; b of another shape), 5280 (odd, odd2:
# ragged programs), and 4096 (zero) alone.
GROUPED = {"a": (64, 128), "b": (128, 64), "odd": (33, 160), "odd2": (33, 160), "w": (64, 128),
           "zero": (16, 256), "bias": (128,)}


@pytest.mark.parametrize("amax,group,launches", [("exact", 12, 3), ("exact", 2, 4), ("bound", 12, 3)])
def test_leaves_of_one_size_share_launches(monkeypatch, triton_modules, amax, group, launches):
  """Leaves of one size and dtype share each kernel's launch, at most ``LAUNCH_GROUP`` at a time (their
  programs side by side, a branch per leaf): the XLA path's state in interpret mode, a NaN leaf and
  ragged programs included, and fewer Triton calls for an H200 (6 NVFP4 leaves: 6 launches per kernel
  unshared)."""
  monkeypatch.setattr(kernel, "LAUNCH_GROUP", group)
  kw = dict(min_size=1024, amax=amax)
  u_x, s_x = _run(optim.scale_by_adam_nvfp4(kernel="xla", **kw), 2, nan=True, shapes=GROUPED)
  u_k, s_k = _run(optim.scale_by_adam_nvfp4(kernel="pallas_interpret", **kw), 2, nan=True,
                  shapes=GROUPED)
  _assert_state_equal(s_k, s_x)
  for a, b in zip(u_k, u_x):
    _assert_updates_close(a, b)
  tx = optim.scale_by_adam_nvfp4(kernel="pallas", **kw)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in GROUPED.items()}
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 2 * launches, hlo
  assert len(triton_modules) == 2 * launches


@pytest.mark.parametrize("hints", [0, 1])
def test_eviction_hints_change_no_values(monkeypatch, triton_modules, hints):
  """``EVICT_HINTS``: on or off, the same state as the XLA path in interpret mode; ``encode`` lowers
  with the hints on its loads and its update's stores when on, and no kernel has hints when off."""
  monkeypatch.setattr(kernel, "EVICT_HINTS", hints)
  kw = dict(min_size=1024)
  _, s_x = _run(optim.scale_by_adam_nvfp4(kernel="xla", **kw), 2, shapes=GROUPED)
  _, s_k = _run(optim.scale_by_adam_nvfp4(kernel="pallas_interpret", **kw), 2, shapes=GROUPED)
  _assert_state_equal(s_k, s_x)
  tx = optim.scale_by_adam_nvfp4(kernel="pallas", **kw)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in GROUPED.items()}
  with jax.sharding.use_abstract_mesh(H200):
    jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(lowering_platforms=("cuda",))
  encode = [m for m in triton_modules if "@adam_nvfp4_encode" in m]
  assert encode and all(("evict_first" in m and "evict_last" in m) == bool(hints) for m in encode)
  assert not any("evict_" in m for m in triton_modules if "@adam_nvfp4_stats" in m)


def test_launch_settings_parse_and_restore():
  """``parse_settings`` reads ``NAME=V[+NAME=V]`` and names a bad item; ``settings`` sets the module's
  launch settings inside its block only, and refuses unknown names."""
  assert kernel.parse_settings("EVICT_HINTS=1+LAUNCH_GROUP=6") == {"EVICT_HINTS": 1, "LAUNCH_GROUP": 6}
  for bad in ("EVICT_HINT=1", "LAUNCH_GROUP=x", "LAUNCH_GROUP"):
    with pytest.raises(ValueError, match=bad.split("=")[0]):
      kernel.parse_settings(bad)
  before = (kernel.LAUNCH_GROUP, kernel.EVICT_HINTS)
  with kernel.settings(LAUNCH_GROUP=before[0] + 3, EVICT_HINTS=1 - before[1]):
    assert (kernel.LAUNCH_GROUP, kernel.EVICT_HINTS) == (before[0] + 3, 1 - before[1])
  assert (kernel.LAUNCH_GROUP, kernel.EVICT_HINTS) == before
  with pytest.raises(ValueError, match="NOPE"):
    with kernel.settings(NOPE=1):
      pass
