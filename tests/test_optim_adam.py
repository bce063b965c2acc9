"""fp4jax.optim.adamw_nvfp4: optax equality, storage rule, zero-moment safety, convergence, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp4jax import _platform, numerics, nvfp4, optim
from fp4jax.optim import _common
from fp4jax.optim.adam import adam_update_bound
from fp4jax.quant import Operand

B1, B2 = 0.9, 0.95
Options = optim.AdamNvfp4Options


def _params():
  # one NVFP4 leaf of each layout (last axis / first axis blocked) and float32 leaves
  return {"w": jnp.ones((64, 64)) * 0.1, "head": jnp.ones((64, 72)) * 0.1,
          "b": jnp.zeros((7,)), "norm": jnp.ones((64,))}


def _grads(params, seed):
  keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([jax.random.normal(k, p.shape) * 10.0 ** jax.random.uniform(
      k, p.shape, minval=-4, maxval=0) for k, p in zip(keys, leaves)])


@pytest.mark.parametrize("nesterov", [False, True])
def test_quantize_false_equals_optax_adamw_bit_for_bit(nesterov):
  params = _params()
  ours = optim.adamw_nvfp4(1e-2, B1, B2, 1e-8, weight_decay=0.1, nesterov=nesterov, quantize=False)
  ref = optax.adamw(1e-2, b1=B1, b2=B2, eps=1e-8, weight_decay=0.1, nesterov=nesterov)
  p1, p2, s1, s2 = params, params, ours.init(params), ref.init(params)
  up1, up2 = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(3):
    g = _grads(params, step)
    u1, s1 = up1(g, s1, p1)
    u2, s2 = up2(g, s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    jax.tree.map(np.testing.assert_array_equal, (u1, p1), (u2, p2))
  jax.tree.map(np.testing.assert_array_equal, (s1[0].mu, s1[0].nu), (s2[0].mu, s2[0].nu))


def test_storage_rule_and_abstract_init():
  assert optim.stores_nvfp4((64, 64), 4096) and _common.block_axis((64, 64)) == 1
  assert optim.stores_nvfp4((64, 72), 4096) and _common.block_axis((64, 72)) == 0
  assert not optim.stores_nvfp4((63, 65), 0)  # no axis is a multiple of 16
  assert not optim.stores_nvfp4((16, 16), 4096)  # tiny
  tx = optim.scale_by_adam_nvfp4()
  state = tx.init(_params())
  assert isinstance(state.mu["w"], nvfp4.NVFP4Tensor) and state.mu["w"].axis == 1
  assert isinstance(state.nu["head"], nvfp4.NVFP4Tensor) and state.nu["head"].axis == 0
  assert state.mu["b"].dtype == jnp.float32 and state.nu["norm"].shape == (64,)
  # zero state == quantize(zeros), and init works on ShapeDtypeStructs
  ref = jax.jit(lambda z: nvfp4.quantize(z, axis=0))(jnp.zeros((64, 72)))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.mu["head"]),
               jax.tree.map(np.asarray, ref))
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), _params())
  assert jax.tree.structure(tx.init(abstract)) == jax.tree.structure(state)


def test_state_bytes_per_param_gpt2_small():
  d, layers, vocab = 768, 12, 50257
  shapes = {"wte": (vocab, d), "wpe": (1024, d), "ln_f": {"g": (d,), "b": (d,)}}
  for i in range(layers):
    shapes[f"h{i}"] = {"ln1": {"g": (d,), "b": (d,)}, "ln2": {"g": (d,), "b": (d,)},
                       "attn": {"w": (d, 3 * d), "b": (3 * d,)}, "proj": {"w": (d, d), "b": (d,)},
                       "fc": {"w": (d, 4 * d), "b": (4 * d,)}, "out": {"w": (4 * d, d), "b": (d,)}}
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  assert 124e6 < n < 125e6
  ours = optim.state_nbytes(jax.eval_shape(optim.adamw_nvfp4(1e-3).init, params)) / n
  ref = optim.state_nbytes(jax.eval_shape(optax.adamw(1e-3).init, params)) / n
  assert ours <= 1.15, ours
  assert abs(ref - 8.0) < 1e-3


@pytest.mark.slow
def test_zero_second_moment_never_explodes():
  # √v of one block: one large entry, the rest flush to code 0; m is 1 everywhere; gradient 0.
  sqrt_v = jnp.full((16, 64), 1e-3).at[:, ::16].set(1e3)
  state = optim.ScaleByAdamNvfp4State(
      count=jnp.asarray(10, jnp.int32), mu={"w": jax.jit(nvfp4.quantize)(jnp.ones((16, 64)))},
      nu={"w": jax.jit(nvfp4.quantize)(sqrt_v)})
  assert float(jnp.min(state.nu["w"].dequantize())) == 0.0  # the flush happened
  g = {"w": jnp.zeros((16, 64))}
  unclipped = optim.scale_by_adam_nvfp4(B1, B2, options=Options(min_size=0, clip_update=False))
  u_plain, _ = jax.jit(unclipped.update)(g, state)
  assert float(jnp.max(jnp.abs(u_plain["w"]))) > 1e6  # what the clip prevents
  u, _ = jax.jit(optim.scale_by_adam_nvfp4(B1, B2, options=Options(min_size=0)).update)(g, state)
  assert float(jnp.max(jnp.abs(u["w"]))) <= float(adam_update_bound(11, B1, B2)) * (1 + 1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_update_bound_is_tight_for_exact_adam(nesterov):
  t = 12
  worst = (B1 / B2) ** np.arange(t)[::-1]  # |g_{t-k}| ∝ (b1/b2)^k attains Cauchy–Schwarz
  for gs, tight in ((worst, not nesterov), (np.random.default_rng(0).uniform(0, 1, t), False)):
    tx, state = optax.scale_by_adam(B1, B2, eps=0.0, nesterov=nesterov), None
    state = tx.init(jnp.zeros(1))
    for g in gs:
      u, state = tx.update(jnp.asarray([g], jnp.float32), state)
    bound = float(adam_update_bound(t, B1, B2, nesterov=nesterov))
    assert float(u[0]) <= bound * (1 + 1e-5)
    if tight:
      assert float(u[0]) == pytest.approx(bound, rel=1e-5)
  assert float(adam_update_bound(1, B1, B2)) == pytest.approx(1.0)


@pytest.mark.slow
def test_stochastic_rounding_lets_a_moment_decay():
  # Each block's first entry keeps m constant (g = m); the others stop getting gradient and must
  # decay like b1^t. Round-to-nearest re-rounds each decayed value back to its grid point.
  x = jnp.tile(jnp.linspace(0.3, 1.0, 16), (16, 4)).at[:, ::16].set(1.0)
  keep = jnp.zeros_like(x).at[:, ::16].set(1.0)
  results = {}
  for rounding in ("stochastic", "nearest"):
    tx = optim.scale_by_adam_nvfp4(B1, B2, options=Options(
        min_size=0, mu=Operand(rounding=rounding), nu=Operand(rounding=rounding), clip_update=False))
    step = jax.jit(tx.update)
    state = tx.init({"w": x})
    _, state = step({"w": x}, state)
    rest = lambda s: jnp.sum(jnp.abs(s.mu["w"].dequantize()) * (1 - keep))
    start = float(rest(state))
    for _ in range(25):
      _, state = step({"w": keep * (1 - B1)}, state)
    results[rounding] = float(rest(state)) / start
  assert results["stochastic"] == pytest.approx(B1**25, rel=0.25)
  assert results["nearest"] > 3 * B1**25


def _train(tx, loss, params, steps):
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  first = None
  for _ in range(steps):
    params, state, value = step(params, state)
    first = value if first is None else first
  return float(first), float(loss(params))


@pytest.mark.slow
def test_converges_on_quadratic_and_regression():
  key1, key2, key3 = jax.random.split(jax.random.key(0), 3)
  target = jax.random.normal(key1, (32, 64))
  scale = jnp.exp(jax.random.uniform(key2, (32, 64), minval=-3, maxval=3))  # ill-conditioned
  quad = lambda p: jnp.sum(scale * (p["w"] - target) ** 2)
  tx = optim.adamw_nvfp4(3e-2, weight_decay=0.0, options=Options(min_size=0))
  first, last = _train(tx, quad, {"w": jnp.zeros((32, 64))}, 300)
  assert last < 1e-3 * first

  x = jax.random.normal(key3, (256, 64))
  w_true = jax.random.normal(key1, (64, 16))
  y = x @ w_true
  mse = lambda p: jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)
  first, last = _train(tx, mse, {"w": jnp.zeros((64, 16)), "b": jnp.zeros((16,))}, 300)
  assert last < 1e-3 * first


@pytest.mark.slow
def test_jit_equals_no_jit_and_state_structure_is_stable():
  params = {"w": jnp.ones((16, 64)) * 0.1, "b": jnp.zeros((7,))}
  tx = optim.adamw_nvfp4(1e-2, options=Options(min_size=0))
  state0 = tx.init(params)
  g = _grads(params, 1)
  u_eager, s_eager = tx.update(g, state0, params)
  u_jit, s_jit = jax.jit(tx.update)(g, state0, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), u_eager, u_jit)
  codes = lambda s: [np.asarray(t.codes) for t in jax.tree.leaves(
      s[0].mu, is_leaf=_common.is_nvfp4) if _common.is_nvfp4(t)]
  for a, b in zip(codes(s_eager), codes(s_jit)):
    assert np.mean(a != b) < 1e-3
  spec = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert spec(s_jit) == spec(state0)

  @jax.jit
  def maybe_step(pred, state):
    return jax.lax.cond(pred, lambda s: tx.update(g, s, params)[1], lambda s: s, state)

  s_skip, s_step = maybe_step(False, state0), maybe_step(True, state0)
  assert spec(s_skip) == spec(s_step) == spec(state0)
  assert int(s_step[0].count) == 1 and int(s_skip[0].count) == 0


def test_stochastic_rounding_is_reproducible_from_seed():
  params = {"w": jnp.zeros((16, 64))}
  g = _grads(params, 3)
  state = optim.scale_by_adam_nvfp4(options=Options(min_size=0)).init(params)
  runs = [jax.jit(optim.scale_by_adam_nvfp4(options=Options(min_size=0), seed=s).update)(
      g, state)[1].mu["w"].codes
          for s in (0, 0, 1)]
  np.testing.assert_array_equal(runs[0], runs[1])
  assert np.any(np.asarray(runs[0]) != np.asarray(runs[2]))


def test_options_default_to_stochastic_nvfp4_moments():
  assert Options().mu == Options().nu == Operand(rounding="stochastic")


@pytest.mark.parametrize("kwargs,match", [
    (dict(mu="nearest"), "AdamNvfp4Options.mu must be an fp4jax.quant.Operand"),
    (dict(nu=Operand(format="bf16")), "AdamNvfp4Options.nu.format must be 'nvfp4'.*quantize=False"),
    (dict(mu=Operand(block=(16, 16))), r"AdamNvfp4Options.mu.block must be \(1, 16\)"),
    (dict(nu=Operand(terms=2)), "AdamNvfp4Options.nu.terms must be 1"),
    (dict(min_size=-1), "min_size must be a non-negative int"),
    (dict(min_size=1.5), "min_size must be a non-negative int"),
    (dict(clip_update="yes"), "clip_update must be a bool")])
def test_bad_options_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Options(**kwargs)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="options must be an AdamNvfp4Options"):
    optim.scale_by_adam_nvfp4(options=dict(min_size=0))
  with pytest.raises(ValueError, match="block_sizes must be an AdamKernelConfig"):
    optim.scale_by_adam_nvfp4(block_sizes=dict(block_rows=64))
  with pytest.raises(ValueError, match="implementation must be one of"):
    optim.scale_by_adam_nvfp4(implementation="triton")
  with pytest.raises(TypeError):  # the storage knobs live in the options object only
    optim.adamw_nvfp4(1e-3, min_size=0)


def test_counter_bits_are_uniform_keyed_and_unbiased_for_rounding():
  key = jax.random.key(3)
  shape = (128, 1024)
  b1 = np.asarray(numerics.counter_bits(jax.random.fold_in(key, 1), shape))
  b2 = np.asarray(numerics.counter_bits(jax.random.fold_in(key, 2), shape))
  b1v = np.asarray(numerics.counter_bits(jax.random.fold_in(key, 1), shape, lane=1))
  np.testing.assert_array_equal(b1, np.asarray(numerics.counter_bits(jax.random.fold_in(key, 1), shape)))
  # 8 random bits on top, then the half step (lane_bits).
  assert np.all(b1 & 0xFFFFFF == 1 << 23) and np.all(b1v & 0xFFFFFF == 1 << 23)
  n = b1.size
  u1, u2, u1v = ((b >> 8).astype(np.float64) / 2**24 for b in (b1, b2, b1v))
  assert abs(u1.mean() - 0.5) < 4 * 0.2887 / np.sqrt(n)
  for b in (b1, b1v):  # top 4 bits and all 8: chi-square, 15 and 255 dof
    for top, bins, limit in ((4, 16, 50), (8, 256, 380)):
      counts = np.bincount((b >> (32 - top)).ravel(), minlength=bins)
      chi2 = np.sum((counts - n / bins) ** 2 / (n / bins))
      assert chi2 < limit, (top, chi2)  # p ~ 1e-5 for a uniform source
  # Unrelated across keys, across the two lanes of one key, and between neighbouring elements (the
  # two bytes of one hash, and the last byte of one hash and the first of the next).
  for a, b in ((u1, u2), (u1, u1v), (u1.ravel()[:-1], u1.ravel()[1:]),
               (u1.ravel()[0::2], u1.ravel()[1::2]), (u1.ravel()[1:-1:2], u1.ravel()[2::2])):
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 4 / np.sqrt(a.size)
  # The lanes' bytes of one pair of elements are the four bytes of one hash.
  h = np.asarray(numerics.counter_hash(jnp.arange(4, dtype=jnp.uint32),
                                      *numerics.counter_words(jax.random.fold_in(key, 1))))
  flat, flat_v = b1.ravel()[:8] >> 24, b1v.ravel()[:8] >> 24
  for i in range(4):
    assert [flat[2 * i], flat[2 * i + 1], flat_v[2 * i], flat_v[2 * i + 1]] == [
        (h[i] >> s) & 0xFF for s in (0, 8, 16, 24)]
  with pytest.raises(ValueError, match="lane"):
    numerics.counter_bits(key, shape, lane=2)
  # Stochastic rounding with these bits is unbiased: the mean over 64 keys approaches x.
  x = jax.random.normal(jax.random.key(0), (64, 256))
  deq = jnp.stack([nvfp4.quantize(x, rounding="stochastic", bits=numerics.counter_bits(
      jax.random.fold_in(key, i), x.shape)).dequantize() for i in range(64)])
  near = nvfp4.quantize(x).dequantize()
  step = jnp.abs(near - x).mean()  # the size of a rounding error
  bias = jnp.abs(deq.mean(0) - x).mean()
  assert bias < 0.3 * step, (bias, step)
  with pytest.raises(ValueError, match="bits must be uint32"):
    nvfp4.quantize(x, rounding="stochastic", bits=jnp.zeros((4,), jnp.uint32))
  with pytest.raises(ValueError, match="not both"):
    nvfp4.quantize(x, rounding="stochastic", key=key, bits=jnp.zeros(x.shape, jnp.uint32))


def test_lane_bits_round_up_with_the_probability_to_within_one_512th():
  """Over the 256 values of a byte, the share of E2M1 roundings that go up is p to within 1/512."""
  bits = numerics.lane_bits(jnp.arange(256, dtype=jnp.uint32), 0)
  for lo, hi in ((0.0, 0.5), (1.0, 1.5), (2.0, 3.0), (4.0, 6.0)):
    for p in (0.0, 1 / 512, 0.3, 0.5, 0.77, 1 - 1 / 1024):
      a = jnp.full((256,), lo + p * (hi - lo), jnp.float32)
      up = np.mean(np.asarray(numerics.e2m1_stochastic_code(a, bits))
                   != np.asarray(numerics.e2m1_stochastic_code(a, jnp.zeros_like(bits))))
      assert abs(up - p) <= 1 / 512 + 1e-6, (lo, p, up)


@pytest.mark.slow
def test_grouped_leaves_equal_ungrouped_bit_for_bit(monkeypatch):
  # The XLA path groups same-shape leaves (vmap) when the default platform is an accelerator, and
  # updates them one by one on the CPU: the same bits.
  rng = np.random.default_rng(0)
  # Shapes whose grouped program XLA:CPU compiles fast with 8 host devices ((64, 128) takes ~50 s).
  shapes = {"a": (128, 512), "b": (128, 512), "d": (64,)}  # a group of 2 and a float32 leaf
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s) * 10.0 ** -i, jnp.float32) for k, s in shapes.items()}
           for i in range(3)]
  results = []
  for platform in ("cuda", "cpu"):
    monkeypatch.setattr(_platform, "default_platform", lambda p=platform: p)
    assert _common.group_by_default() == (platform != "cpu")
    tx = optim.adamw_nvfp4(1e-3, implementation="xla")
    state, step = tx.init(params), jax.jit(tx.update)
    for g in grads:
      u, state = step(g, state, params)
    results.append(jax.tree.leaves((u, state)))
  for a, b in zip(*results):
    np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                  np.asarray(b).reshape(-1).view(np.uint8))


def test_moments_mul_hook_gives_the_rounded_products():
  """``adam_moments(mul=...)`` (the kernels pass PTX mul.rn there) computes the same float32 values
  as the default integer-barrier rounding, here with a plain product on the CPU."""
  rng = np.random.default_rng(0)
  m_old, v_old, g = (jnp.asarray(rng.standard_normal(4096) * 10.0 ** rng.uniform(-6, 2, 4096),
                                 jnp.float32) for _ in range(3))
  v_old = v_old * v_old
  zero = numerics.runtime_zero(jnp.int32(3))
  want = jax.jit(lambda *a: numerics.adam_moments(*a, 0.9, 0.95, zero))(m_old, v_old, g)
  got = jax.jit(lambda *a: numerics.adam_moments(*a, 0.9, 0.95, zero, lambda x, y: x * y))(
      m_old, v_old, g)
  for w, o in zip(want, got):
    np.testing.assert_array_equal(np.asarray(o).view(np.uint32), np.asarray(w).view(np.uint32))
