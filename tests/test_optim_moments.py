"""AdamNvfp4Options' storage variants: one moment in float32 (``mu=None``, ``nu=None``), leaves kept
float32 by name (``keep_fp32``), the centered, rotated √v (``nu_transform="mean_hadamard"``) and the
roundings (preconditioner space, Four over Six, subtractive dither, EDEN scales). Each gives the same
state bits in the XLA path and the kernels (interpret mode), keeps the optax contract, and leaves the
default's bits alone."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp4jax import numerics, nvfp4, optim
from fp4jax.kernels import adam_nvfp4 as kernel
from fp4jax.nvfp4 import NVFP4Tensor
from fp4jax.optim import _common
from fp4jax.optim.state import CenteredNVFP4Tensor, path_matches
from fp4jax.quant import Operand

# (32, 64): 128 blocks; (5, 48): 15 blocks, a ragged program; (64, 24): blocked along axis 0 (the XLA
# path beside the kernels); (64,): a float32 leaf.
SHAPES = {"w": (32, 64), "odd": (5, 48), "head": (64, 24), "b": (64,)}
# The kernels' cases: one NVFP4 leaf of 165 blocks (three programs of the encode kernel and two of the
# stats kernel at the default sizes, the last of each ragged) and a float32 leaf: one launch of each
# kernel that still spans several programs and a ragged one.
KERNEL_SHAPES = {"odd": (33, 80), "b": (64,)}

VARIANTS = {
    "m_only": dict(nu=None),
    "v_only": dict(mu=None),
    "mean_hadamard": dict(nu_transform="mean_hadamard"),
    "mean_hadamard_nearest": dict(nu=Operand(), nu_transform="mean_hadamard"),
    "preconditioner_sr": dict(nu_sr_space="preconditioner"),
    "four_over_six": dict(mu=Operand(scale_rule="4over6_mse"), nu=Operand(scale_rule="4over6_mae")),
    "dither": dict(mu=Operand(), nu=Operand(), dither=("mu", "nu")),
    "eden": dict(mu=Operand(), nu=Operand(), eden=("mu", "nu")),
}


def _grads(t, shapes=SHAPES):
  keys = jax.random.split(jax.random.key(t), len(shapes))
  return {k: jax.random.normal(kk, s) * 10.0 ** -i for i, (kk, (k, s)) in enumerate(zip(keys, shapes.items()))}


def _run(tx, steps, shapes=SHAPES):
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  state, f, us = tx.init(params), jax.jit(tx.update), []
  for t in range(steps):
    u, state = f(_grads(t, shapes), state, params)
    params = jax.tree.map(lambda p, d: p + d, params, u)
    us.append(u)
  return us, state


def _digest(tree) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(np.asarray(x).tobytes())
  return h.hexdigest()[:16]


def _same_bits(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
  for x, y in zip(la, lb):
    x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.slow
def test_default_bits_are_unchanged():
  """Two AdamW steps of the default options (and of every new field spelled at its default) give the
  state of the optimizer before these fields existed: its digest, computed then."""
  before = "a91ef8c98a44be39"
  options = optim.AdamNvfp4Options(min_size=0)
  assert options == optim.AdamNvfp4Options(min_size=0, mu=Operand(rounding="stochastic"), keep_fp32=(),
                                           nu_transform="none", dither=(), eden=[])
  tx = optim.adamw_nvfp4(1e-2, options=options, implementation="xla")
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state, f = tx.init(params), jax.jit(tx.update)
  for t in range(2):
    u, state = f(_grads(t), state, params)
    params = jax.tree.map(lambda p, d: p + d, params, u)
  assert _digest(state) == before


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.slow
def test_kernels_equal_the_xla_path(name):
  """Two steps from zero: the kernels (interpret mode) store the XLA path's bits; updates agree to
  float32 rounding."""
  options = optim.AdamNvfp4Options(min_size=0, **VARIANTS[name])
  tx = lambda impl: optim.scale_by_adam_nvfp4(options=options, implementation=impl)
  u_x, s_x = _run(tx("xla"), 2, KERNEL_SHAPES)
  u_k, s_k = _run(tx("pallas_interpret"), 2, KERNEL_SHAPES)
  _same_bits(s_k, s_x)
  for a, b in zip(u_k, u_x):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-12), a, b)
  if name == "four_over_six":  # the E4M3 bound 256: S_dec = amax / (256 · 6)
    for t in (s_x.mu["odd"], s_x.nu["odd"]):
      amax = float(jnp.max(jnp.abs(t.dequantize())))
      assert 0.66 * amax / 1536 < float(t.global_scale) <= 1.01 * amax / 1536 * 1.5
  mu_kind, nu_kind = options.kinds
  assert kernel.moment_kind(s_k.mu["odd"]) == mu_kind and kernel.moment_kind(s_k.nu["odd"]) == nu_kind


@pytest.mark.slow
def test_one_moment_in_float32_is_exact_adams():
  """``nu=None``: the float32 v is optax's (v does not depend on m); ``mu=None``: the float32 m is."""
  g = _grads(0)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  ref = optax.scale_by_adam(b1=0.9, b2=0.95)
  r_state = ref.init(params)
  states = {k: optim.scale_by_adam_nvfp4(options=optim.AdamNvfp4Options(min_size=0, **{k: None}),
                                         implementation="xla") for k in ("mu", "nu")}
  s = {k: tx.init(params) for k, tx in states.items()}
  for t in range(3):
    g = _grads(t)
    _, r_state = ref.update(g, r_state)
    for k, tx in states.items():
      _, s[k] = jax.jit(tx.update)(g, s[k])
  for name in ("w", "odd", "head"):
    assert isinstance(s["mu"].nu[name], NVFP4Tensor) and not isinstance(s["mu"].mu[name], NVFP4Tensor)
    np.testing.assert_allclose(s["mu"].mu[name], r_state.mu[name], rtol=1e-6)
    assert isinstance(s["nu"].mu[name], NVFP4Tensor) and not isinstance(s["nu"].nu[name], NVFP4Tensor)
    np.testing.assert_allclose(s["nu"].nu[name], r_state.nu[name], rtol=1e-6)


def _model_like():
  """The parameter paths of fp4jax.model: embed/embedding, lm_head/kernel, a block's projection."""
  return {"embed": {"embedding": 0.1 * jnp.ones((128, 32))},
          "lm_head": {"kernel": 0.1 * jnp.ones((32, 128))},
          "blocks": {"0": {"mlp": {"down": {"kernel": 0.1 * jnp.ones((64, 32))}}}},
          "norm": {"scale": jnp.ones((32,))}}


@pytest.mark.slow
def test_keep_fp32_that_matches_no_parameter_warns():
  """A ``keep_fp32`` name that no parameter's path holds (a misspelling) is said at init, not silently
  ignored; names that match, also for leaves that optax.masked leaves out, say nothing."""
  import warnings
  params = _model_like()
  with pytest.warns(UserWarning, match=r"keep_fp32: \['emb'\] match no parameter's key path"):
    optim.adamw_nvfp4(1e-2, options=optim.AdamNvfp4Options(keep_fp32=("emb", "lm_head"))).init(params)
  mask = jax.tree.map(lambda p: p.ndim == 2, params)
  mask["embed"]["embedding"] = False
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optim.adamw_nvfp4(1e-2, options=optim.AdamNvfp4Options(keep_fp32=("embed", "lm_head"))).init(params)
    optax.masked(optim.adamw_nvfp4(1e-2, options=optim.AdamNvfp4Options(keep_fp32=("embed/embedding",))),
                 mask).init(params)


def test_keep_fp32_by_path_and_the_optax_wrappers():
  """``keep_fp32=("embed", "lm_head")`` with the method's √v (``nu_transform="mean_hadamard"``): those
  leaves' moments are float32 with optax.adamw's arithmetic (the same up to XLA's fusion of the whole
  tree); the block's stay NVFP4, its √v centered; optax.masked, MultiSteps and inject_hyperparams keep
  the same storage."""
  params = _model_like()
  grads = jax.tree.map(lambda p: jnp.sin(7.0 * jnp.arange(p.size).reshape(p.shape) + p), params)
  options = optim.AdamNvfp4Options(min_size=0, keep_fp32=("embed", "lm_head"), nu_transform="mean_hadamard")
  tx = optim.adamw_nvfp4(1e-2, options=options, implementation="xla")
  state = tx.init(params)
  u, state = jax.jit(tx.update)(grads, state, params)
  ref = optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1)
  u_ref, _ = ref.update(grads, ref.init(params), params)
  for path in (("embed", "embedding"), ("lm_head", "kernel")):
    leaf = state[0].mu[path[0]][path[1]]
    assert not isinstance(leaf, NVFP4Tensor) and leaf.dtype == jnp.float32
    np.testing.assert_allclose(u[path[0]][path[1]], u_ref[path[0]][path[1]], rtol=1e-6, atol=1e-9)
  assert isinstance(state[0].mu["blocks"]["0"]["mlp"]["down"]["kernel"], NVFP4Tensor)

  mask = jax.tree.map(lambda p: p.ndim == 2, params)
  wrapped = (optax.masked(optim.adamw_nvfp4(1e-2, options=options), mask),
             optax.MultiSteps(optim.adamw_nvfp4(1e-2, options=options), every_k_schedule=2),
             optax.inject_hyperparams(optim.adamw_nvfp4, static_args=("options",))(
                 learning_rate=1e-2, options=options))
  is_adam = lambda x: isinstance(x, optim.ScaleByAdamNvfp4State)
  for w in wrapped:
    s = w.init(params)
    adam = [x for x in jax.tree.leaves(s, is_leaf=is_adam) if is_adam(x)]
    assert adam, type(w)
    for a in adam:
      assert isinstance(a.nu["blocks"]["0"]["mlp"]["down"]["kernel"], CenteredNVFP4Tensor)
      for moment in (a.mu, a.nu):
        assert isinstance(moment["blocks"]["0"]["mlp"]["down"]["kernel"], NVFP4Tensor)
        for kept in (moment["embed"]["embedding"], moment["lm_head"]["kernel"]):
          assert not isinstance(kept, NVFP4Tensor), type(w)
    for _ in range(2):
      _, s2 = jax.jit(w.update)(grads, s, params)
      assert jax.tree.structure(s2) == jax.tree.structure(s)
      s = s2


def test_path_matches():
  path = jax.tree_util.tree_flatten_with_path({"embed": {"embedding": 1}})[0][0][0]
  assert path_matches(path, ("embed",)) and path_matches(path, ("embed/embedding",))
  assert not path_matches(path, ("embedding/embed",)) and not path_matches(path, ("lm_head",))


@pytest.mark.parametrize("kw,match", [
    (dict(mu=None, nu=None), "mu and nu are both None"),
    (dict(keep_fp32="lm_head"), "keep_fp32 must be a tuple"),
    (dict(keep_fp32=("embed/",)), "keep_fp32 must be a tuple"),
    (dict(nu_transform="hadamard"), "nu_transform must be one of"),
    (dict(nu=None, nu_transform="mean_hadamard"), "needs nu"),
    (dict(mu=Operand(format="bf16")), "mu=None"),
    (dict(nu_sr_space="update"), "nu_sr_space must be one of"),
    (dict(nu=Operand(), nu_sr_space="preconditioner"), "needs nu=Operand"),
    (dict(nu_transform="mean_hadamard", nu_sr_space="preconditioner"), "needs nu=Operand"),
    (dict(mu=Operand(), dither="mu"), "dither must be a tuple"),
    (dict(mu=Operand(), dither=("m",)), "dither must be a tuple"),
    (dict(mu=Operand(), dither=("mu", "mu")), "dither must be a tuple"),
    (dict(dither=("mu",)), "needs mu=Operand"),
    (dict(mu=Operand(scale_rule="4over6_mse"), eden=("mu",)), "needs mu=Operand"),
    (dict(nu=None, eden=("nu",)), "needs nu=Operand"),
    (dict(nu=Operand(), nu_transform="mean_hadamard", dither=("nu",)), "needs nu_transform='none'"),
    (dict(mu=Operand(), dither=("mu",), eden=("mu",)), "both in dither and eden"),
])
def test_options_are_validated(kw, match):
  with pytest.raises(ValueError, match=match):
    optim.AdamNvfp4Options(**kw)


def test_options_from_a_config_list():
  assert optim.AdamNvfp4Options(keep_fp32=["embed", "lm_head"]).keep_fp32 == ("embed", "lm_head")


def _heavy_tailed_root(key, shape):
  """A √v-like tensor: log-normal rows and columns (a few large), within-row noise."""
  k1, k2, k3 = jax.random.split(key, 3)
  rows = jnp.exp(1.5 * jax.random.normal(k1, (shape[0], 1)))
  cols = jnp.exp(0.5 * jax.random.normal(k2, (1, shape[1])))
  return 1e-3 * rows * cols * jnp.exp(0.3 * jax.random.normal(k3, shape))


def test_hadamard_signs_are_key_zeros():
  signs = nvfp4.hadamard_matrix(jax.random.key(0))[:, 0] * 4.0
  np.testing.assert_array_equal(signs, np.asarray(kernel.HADAMARD_SIGNS, np.float32))


@pytest.mark.slow
def test_centered_codec():
  """``encode_centered``: the rotated deviations are ``nvfp4.hadamard(x - mean, key(0))``; decoding
  inverts it, is never below ``CENTERED_FLOOR`` times the block mean, and on a heavy-tailed √v has a
  smaller relative error than plain NVFP4 (both nearest)."""
  x = _heavy_tailed_root(jax.random.key(1), (64, 128))
  t = _common.encode_centered(x, "nearest", None)
  assert isinstance(t, CenteredNVFP4Tensor) and t.mean.shape == t.scales.shape
  mean = t.mean.astype(jnp.float32)
  rotated = nvfp4.hadamard(x - jnp.repeat(mean, 16, axis=-1), jax.random.key(0))
  q = nvfp4.quantize(rotated, rounding="nearest")
  _same_bits((q.codes, q.scales, q.global_scale), (t.codes, t.scales, t.global_scale))
  dec = t.dequantize()
  assert bool(jnp.all(dec >= kernel.CENTERED_FLOOR * jnp.repeat(mean, 16, axis=-1)))
  err = lambda d: float(jnp.linalg.norm(d - x) / jnp.linalg.norm(x))
  plain = err(nvfp4.quantize(x, rounding="nearest").dequantize())
  assert err(dec) < 0.6 * plain, (err(dec), plain)
  assert t.nbytes == 64 * 128 * 11 // 16 + 4  # 5.5 bits per element, and the global scale
  zero = _common.zeros_centered((16, 32))
  assert not np.any(np.asarray(zero.dequantize()))


def test_center_rotate_and_uncenter_are_the_same_bits_in_both_layouts():
  """The kernels' layout (a list of 16 arrays, element i of each block in the i-th) and the XLA path's
  (one array, the blocks on its last axis) give the same means, deviations and decoded roots, on
  heavy-tailed data with zero blocks, subnormals and equal elements."""
  x = np.array(_heavy_tailed_root(jax.random.key(3), (192, 16)).reshape(24, 8, 16))
  x[0] = 0.0
  x[1, :, ::2] = np.float32(2.0**-140)  # subnormal: flushed
  x[2] = np.float32(3.0)
  cols = lambda a: [a[..., i] for i in range(16)]
  mean_a, y_a = kernel.center_rotate(jnp.asarray(x))
  mean_l, y_l = kernel.center_rotate(cols(jnp.asarray(x)))
  _same_bits((mean_a, y_a), (mean_l, jnp.stack(y_l, axis=-1)))
  y = jnp.asarray(np.asarray(y_a) * np.float32(0.75))  # decoded deviations are not the exact ones
  _same_bits(kernel.uncenter(y, mean_a), jnp.stack(kernel.uncenter(cols(y), mean_a), axis=-1))
  back = np.asarray(kernel.uncenter(y_a, mean_a))[3:]  # the unaltered blocks round-trip
  np.testing.assert_allclose(back, x[3:], rtol=1e-5)


@pytest.mark.parametrize("name", ["m_only", "v_only", "mean_hadamard", "preconditioner_sr", "four_over_six",
                                  "dither", "eden"])
def test_lowers_to_triton_for_h200(triton_modules, name):
  """Each storage variant's two kernels lower to Triton (verified IR): a float32 moment's loads and
  stores, the centered √v's column splits, butterflies and bfloat16 means, the preconditioner-space
  rounding, Four over Six's two candidates, the dither's two keys, EDEN's block sums and scale
  rounding."""
  from conftest import H200
  options = optim.AdamNvfp4Options(min_size=0, **VARIANTS[name])
  tx = optim.scale_by_adam_nvfp4(options=options, implementation="pallas")
  params = {"w": jax.ShapeDtypeStruct((32, 64), jnp.float32)}
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(tx.update).trace(params, jax.eval_shape(tx.init, params)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert hlo.count("__gpu$xla.gpu.triton") == 2 and len(triton_modules) == 2
  encode = [m for m in triton_modules if "@adam_nvfp4_encode" in m]
  assert encode and "sqrt.rn.f32" in encode[0]


@pytest.mark.slow
def test_preconditioner_space_rounding():
  """Over 256 draws on a heavy-tailed √v: preconditioner-space rounding keeps ``E[1 / (√v + eps)]``
  where value-space rounding overstates it (Jensen), stores far fewer nonzero entries as 0, and uses
  ``encode``'s scales."""
  s = _heavy_tailed_root(jax.random.key(2), (16, 64))
  eps, c2 = 1e-8, 1.0
  h = lambda x: 1.0 / (x * c2 + eps)
  keys = jax.random.split(jax.random.key(3), 256)
  value = jax.jit(jax.vmap(lambda k: _common.encode(s, "stochastic", k, lane=1).dequantize()))(keys)
  precond = jax.jit(jax.vmap(lambda k: _common.encode_preconditioned(
      s, k, c2, eps, jnp.int32(0)).dequantize()))(keys)
  t = _common.encode(s, "stochastic", keys[0], lane=1)
  p = _common.encode_preconditioned(s, keys[0], c2, eps, jnp.int32(0))
  _same_bits((t.scales, t.global_scale), (p.scales, p.global_scale))
  # Entries whose two neighbours are both nonzero (a zero neighbour makes h's mean unbounded).
  lower = jnp.min(jnp.stack([value.min(0), precond.min(0)]), axis=0) > 0
  bias = lambda d: float(jnp.mean(jnp.abs(jnp.mean(h(d), axis=0) / h(s) - 1.0), where=lower))
  assert bias(precond) < 0.02 < bias(value), (bias(precond), bias(value))
  zeros = lambda d: float(jnp.mean(d == 0))
  assert zeros(precond) < 0.1 * zeros(value) and zeros(value) > 0.002, (zeros(precond), zeros(value))


def _draws(fn, x, n=128):
  """``n`` decoded draws of ``fn(x, key)`` (a fresh key each), stacked."""
  return jax.jit(jax.vmap(lambda k: fn(x, k)))(jax.random.split(jax.random.key(5), n))


def test_dither_codec():
  """Subtractive dither: the nearest encoding's scales; decoding with the writing key inverts the
  index map around the codes less ``u``; over draws the decoded moment is far less biased than
  rounding to nearest, and its error smaller than stochastic rounding's."""
  x = jax.random.normal(jax.random.key(4), (32, 64)) * jnp.exp(jax.random.normal(jax.random.key(6), (32, 1)))
  zero, key = jnp.int32(0), jax.random.key(7)
  t = _common.encode_dithered(x, key, zero, lane=0)
  near = _common.encode(x, "nearest", None)
  _same_bits((t.scales, t.global_scale), (near.scales, near.global_scale))
  u = kernel.dither_uniform(numerics.counter_bits(key, x.shape, 0))
  assert float(jnp.min(u)) > -0.5 and float(jnp.max(u)) < 0.5 and abs(float(jnp.mean(u))) < 0.02
  grid = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
  np.testing.assert_array_equal(kernel.e2m1_index(grid), np.arange(8.0))
  np.testing.assert_array_equal(kernel.e2m1_index(-grid[1:]), -np.arange(1.0, 8.0))
  y = t.elements()  # grid values; the dithered values are the index map's inverse at index - u
  v = kernel.dithered_values(nvfp4._unpack(t.codes, 1), numerics.counter_bits(key, x.shape, 0))
  np.testing.assert_allclose(kernel.e2m1_index(v), kernel.e2m1_index(y) - u, atol=1e-6)
  scale = jnp.repeat(t.block_scales(), 16, axis=-1)
  np.testing.assert_array_equal(_common.decode_dithered(t, key, 0), (v * scale) * t.global_scale)
  dith = _draws(lambda x, k: _common.decode_dithered(_common.encode_dithered(x, k, zero, 1), k, 1), x)
  sr = _draws(lambda x, k: _common.encode(x, "stochastic", k, lane=1).dequantize(), x)
  rel = lambda d: float(jnp.linalg.norm(d) / jnp.linalg.norm(x))
  bias_near, bias_dith = rel(near.dequantize() - x), rel(dith.mean(0) - x)
  assert bias_dith < 0.3 * bias_near, (bias_dith, bias_near)
  rmse = lambda d: float(jnp.sqrt(jnp.mean(jnp.sum((d - x[None]) ** 2, axis=(1, 2)))) / jnp.linalg.norm(x))
  assert rmse(dith) < rmse(sr), (rmse(dith), rmse(sr))


def test_eden_codec():
  """EDEN: the codes are the nearest encoding's, the scales move by at most one E4M3 step from
  ``c · dscale``, and over draws the decoded moment's magnitude misalignment ⟨x, x̂⟩/‖x‖² − 1 is far
  below rounding to nearest's."""
  x = _heavy_tailed_root(jax.random.key(8), (32, 64))
  zero = jnp.int32(0)
  near = _common.encode(x, "nearest", None)
  t = _common.encode_eden(x, jax.random.key(9), zero, lane=1)
  _same_bits((t.codes, t.global_scale), (near.codes, near.global_scale))
  q, d = near.elements(), near.block_scales()
  a = x * jnp.repeat(_common.nvfp4._escale_table(near.global_scale)[
      jax.lax.bitcast_convert_type(near.scales, jnp.uint8).astype(jnp.int32)], 16, axis=-1)
  c = jnp.sum((a * a).reshape(32, 4, 16), -1) / jnp.sum((a * q).reshape(32, 4, 16), -1)
  ratio = t.block_scales() / (c * d)
  assert float(jnp.max(jnp.abs(ratio - 1.0))) <= 0.126, float(jnp.max(jnp.abs(ratio - 1.0)))
  draws = _draws(lambda x, k: _common.encode_eden(x, k, zero, 1).dequantize(), x)
  align = lambda d: abs(float(jnp.mean(jnp.sum(d * x[None], axis=(-2, -1))) / jnp.sum(x * x)) - 1.0)
  assert align(draws) < 0.2 * align(near.dequantize()[None]), (align(draws), align(near.dequantize()[None]))
