"""fp4jax.optim on 8 simulated CPU devices, through orbax, and inside flax nnx.Optimizer.

conftest.py gives every test process 8 CPU devices (XLA_FLAGS); plain jit runs on device 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import nvfp4, optim
from fp4jax.quant import Operand


def _mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {"w": jax.random.normal(k1, (64, 128)), "embed": jax.random.normal(k2, (128, 64)),
          "b": jax.random.normal(k3, (64,))}


SPECS = {"w": P("data", "model"), "embed": P(None, "model"), "b": P()}


def _bits(tree):
  """Leaves as raw integers, so float8 scales and NaNs compare exactly."""
  def one(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind in "fV" or x.dtype.itemsize == 1 else x
  return jax.tree.map(one, tree)


def _grads(step):
  return jax.tree.map(lambda p: jnp.sin(p * (step + 1.0)), _params())


ALL_NVFP4 = optim.AdamNvfp4Options(min_size=0)


@pytest.mark.parametrize("make", [lambda: optim.adamw_nvfp4(1e-2, options=ALL_NVFP4),
                                  lambda: optim.muon_nvfp4(1e-2, adam_options=ALL_NVFP4, ns_operand=None)],
                         ids=["adamw", "muon"])
@pytest.mark.slow
def test_state_sharding_follows_params_and_sharded_equals_unsharded(make):
  tx, mesh, params = make(), _mesh(), _params()
  p_sh = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  s_sh = optim.state_sharding(jax.eval_shape(tx.init, params), p_sh)
  sharded_params = jax.device_put(params, p_sh)
  state = jax.jit(tx.init, out_shardings=s_sh)(sharded_params)
  moments = [t for t in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nvfp4.NVFP4Tensor))
             if isinstance(t, nvfp4.NVFP4Tensor)]
  assert moments
  for t in moments:  # packed codes and their scales sharded together, like the parameter
    if t.shape == (64, 128):  # "w", P("data", "model")
      assert t.codes.sharding.spec == t.scales.sharding.spec == P("data", "model")
      assert t.codes.addressable_shards[0].data.shape == (16, 32)
      assert t.scales.addressable_shards[0].data.shape == (16, 4)
    elif t.shape == (128, 64):  # "embed", P(None, "model")
      assert t.codes.sharding.spec == t.scales.sharding.spec == P(None, "model")
      assert t.codes.addressable_shards[0].data.shape == (128, 16)
      assert t.scales.addressable_shards[0].data.shape == (128, 2)
    assert t.global_scale.sharding.is_fully_replicated

  step_sh = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
  step_1 = jax.jit(tx.update)
  state_1 = tx.init(params)
  for step in range(2):
    g = _grads(step)
    u_sh, state = step_sh(jax.device_put(g, p_sh), state, sharded_params)
    u_1, state_1 = step_1(g, state_1, params)
    assert u_sh["w"].sharding.spec == P("data", "model")
  # The partitioner may fuse (and, for Muon's norms and matmuls, sum) in another order: float32
  # results agree to rounding (optax.adamw itself differs by 1 ulp), NVFP4 codes almost all agree.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), u_sh, u_1)
  is_q = lambda x: isinstance(x, nvfp4.NVFP4Tensor)
  for a, b in zip(jax.tree.leaves(state, is_leaf=is_q), jax.tree.leaves(state_1, is_leaf=is_q)):
    if is_q(a):
      assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) < 0.01
      np.testing.assert_allclose(a.global_scale, b.global_scale, rtol=1e-6)
    else:
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_orbax_round_trip_of_packed_state_into_shardings(tmp_path):
  tx = optim.muon_nvfp4(1e-2, adam_options=ALL_NVFP4, ns_operand=Operand(format="bf16"))
  mesh, params = _mesh(), _params()
  p_sh = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  abstract = jax.eval_shape(tx.init, params)
  s_sh = optim.state_sharding(abstract, p_sh)
  state = jax.jit(tx.init, out_shardings=s_sh)(jax.device_put(params, p_sh))
  _, state = jax.jit(tx.update, out_shardings=(p_sh, s_sh))(_grads(0), state, params)

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, s_sh)
  restored = ckpt.restore(tmp_path / "state", target)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, _bits(restored), _bits(state))
  jax.tree.map(lambda r, s: r.sharding.is_equivalent_to(s.sharding, r.ndim) or pytest.fail(str(r.sharding)),
               restored, state)


@pytest.mark.slow
def test_state_sharding_drops_mesh_axes_a_leaf_does_not_divide():
  """A (16, 64) weight sharded 8 ways along its last axis: its NVFP4 codes (16, 32) keep the axis,
  its E4M3 scales (16, 4) cannot (4 blocks over 8 devices) and are replicated along it; a float32
  moment keeps the parameter's sharding and the global scale is replicated."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  params = {"w": jnp.ones((16, 64)), "b": jnp.ones((64,))}
  p_sh = {"w": NamedSharding(mesh, P(None, "x")), "b": NamedSharding(mesh, P("x"))}
  tx = optim.adamw_nvfp4(1e-2, options=ALL_NVFP4)
  s_sh = optim.state_sharding(jax.eval_shape(tx.init, params), p_sh)
  mu = s_sh[0].mu
  assert mu["w"].codes.spec == P(None, "x") and mu["w"].scales.spec == P(None, None)
  assert mu["w"].global_scale.spec == P()
  assert s_sh[0].count.spec == P()
  state = jax.jit(tx.init, out_shardings=s_sh)(jax.device_put(params, p_sh))
  _, state = jax.jit(tx.update, out_shardings=(p_sh, s_sh))(params, state, params)
  assert state[0].mu["w"].codes.addressable_shards[0].data.shape == (16, 4)
  assert state[0].mu["w"].scales.addressable_shards[0].data.shape == (16, 4)
  small = optim.adamw_nvfp4(1e-2)  # "w" under min_size: float32 moments, sharded like "w"
  f32 = optim.state_sharding(jax.eval_shape(small.init, params), p_sh)[0].mu
  assert f32["w"].spec == P(None, "x") and f32["b"].spec == P("x")


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(16, 64, rngs=rngs)
    self.fc2 = nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.fc1(x)))


@pytest.mark.slow
def test_trains_a_flax_nnx_mlp_through_nnx_optimizer():
  model = _MLP(nnx.Rngs(0))
  tx = optim.adamw_nvfp4(1e-2, weight_decay=0.0, options=optim.AdamNvfp4Options(min_size=256))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (128, 16))
  y = jnp.tanh(x @ jax.random.normal(kw, (16, 16)))

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(150)]
  assert losses[-1] < 0.1 * losses[0]
  stored = [t for t in jax.tree.leaves(nnx.as_pure(opt.opt_state),
                                      is_leaf=lambda v: isinstance(v, nvfp4.NVFP4Tensor))
            if isinstance(t, nvfp4.NVFP4Tensor)]
  assert len(stored) == 4  # fc1/fc2 kernels, m and √v; the biases stay float32 (min_size)
