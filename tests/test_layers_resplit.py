"""The LoRA-SVD re-split of a run: aligned factors, the moments' handling, the SVD method, and an
exact resume across a re-split (fp4jax.layers.lora_svd_split, fp4jax.loop.make_lora_resplit,
fp4jax.optim.factory.reset_lora_moments)."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import Preempted, StopAfter, write_pydoc_text
from flax import nnx

from fp4jax import data
from fp4jax import sharding as shd
from fp4jax.layers import Dense, lora_svd_split
from fp4jax.loop import make_lora_resplit
from fp4jax.metrics import read_jsonl
from fp4jax.model import ModelConfig, Transformer
from fp4jax.ops import MatmulConfig
from fp4jax.optim.factory import reset_lora_moments
from fp4jax.recipe import get_recipe
from fp4jax.train import OptimizerConfig, TrainConfig, make_optimizer, train

RECIPE = get_recipe("fp4_linear", linear="nvfp4_lorasvd", lora_rank=4, lora_resplit_every=3)


def _bits(a):
  a = np.asarray(a)
  return a.reshape(-1).view(np.uint8)


def test_aligned_split_follows_the_old_factors_columns():
  """A target that is the split's own factor with columns permuted and negated comes back (to bf16
  rounding), with the same product A·B; the unaligned split ignores it."""
  ku, kv, kn = jax.random.split(jax.random.key(0), 3)
  u, v = jnp.linalg.qr(jax.random.normal(ku, (64, 6)))[0], jnp.linalg.qr(jax.random.normal(kv, (48, 6)))[0]
  w = (u * jnp.array([12.0, 10, 8, 6, 5, 4])[None, :]) @ v.T + 0.1 * jax.random.normal(kn, (64, 48))
  a0, b0, _ = lora_svd_split(w, 6)
  signed_perm = np.eye(6)[[2, 0, 1, 5, 4, 3]] * np.array([1, -1, 1, -1, -1, 1])
  target = a0 @ signed_perm
  a1, b1, res1 = lora_svd_split(w, 6, align_to=target)
  np.testing.assert_allclose(a1, target, atol=1e-2 * float(jnp.abs(a0).max()))
  np.testing.assert_allclose(b1, signed_perm.T @ b0, atol=1e-2 * float(jnp.abs(b0).max()))
  np.testing.assert_allclose(res1 + a1 @ b1, w, atol=4e-7 * float(jnp.abs(w).max()))
  np.testing.assert_allclose(a1 @ b1, a0 @ b0, atol=1e-2 * float(jnp.abs(a0 @ b0).max()))
  assert not np.allclose(a0, target, atol=1e-2)


def _model_state(opt_cfg):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2)
  graphdef, state = nnx.split(nnx.jit(lambda: Transformer(cfg, RECIPE, rngs=nnx.Rngs(0)))())
  params = nnx.to_pure_dict(state)
  tx = make_optimizer(opt_cfg, RECIPE, 10)
  opt_state = jax.jit(tx.init)(params)
  # Moments as after some training: one update from a made-up gradient.
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
  _, opt_state = jax.jit(tx.update)(grads, opt_state, params)
  mesh = shd.make_mesh((1, 1, 1))
  p_sh = shd.param_shardings(params, mesh)
  o_sh = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), opt_state)
  return graphdef, params, opt_state, {"params": p_sh, "opt_state": o_sh}


def _leaves_by_lora(tree):
  flat = jax.tree_util.tree_leaves_with_path(tree)
  lora = lambda path: any(getattr(k, "key", None) in ("lora_a", "lora_b") for k in path)
  return [v for p, v in flat if lora(p)], [v for p, v in flat if not lora(p)]


def _resplit_reference(graphdef, params, step, seed=0):
  """Every LoRA-SVD projection re-split by its layer's SVD with the key ``fold_in(fold_in(fold_in(
  key(seed), 3), step), i)`` of its place ``i`` in ``nnx.iter_modules``; the optimizer untouched."""
  def resplit(params, step):
    model = nnx.merge(graphdef, params)
    k = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 3), step)
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
      if isinstance(module, Dense) and module.rank:
        module.resplit(jax.random.fold_in(k, i))
    return nnx.to_pure_dict(nnx.state(model))
  return jax.jit(resplit)(params, step)


def test_lora_resplit_rejects_unknown_modes():
  with pytest.raises(ValueError, match="moments='rotate'"):
    make_lora_resplit(None, None, moments="rotate")
  with pytest.raises(ValueError, match="svd='full'"):
    make_lora_resplit(None, None, svd="full")


@pytest.mark.slow
def test_lora_resplit_options():
  """Defaults: the reference re-split's params bit for bit, the optimizer state untouched. "reset":
  the factors' moments zero, every other leaf kept. "aligned" with a randomized SVD: the effective
  weight kept, the factors nearer the old ones than a fresh split's."""
  graphdef, params, opt_state, sh = _model_state(OptimizerConfig())
  copy = lambda t: jax.tree.map(jnp.array, t)
  step = jnp.int32(6)
  want = _resplit_reference(graphdef, copy(params), step)
  got, got_opt = make_lora_resplit(graphdef, sh)(copy(params), copy(opt_state), step)
  assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(jax.tree.leaves(got_opt), jax.tree.leaves(opt_state)))

  _, reset = make_lora_resplit(graphdef, sh, moments="reset")(copy(params), copy(opt_state), step)
  (lora, other), (lora0, other0) = _leaves_by_lora(reset), _leaves_by_lora(opt_state)
  assert lora and all(not np.any(np.asarray(v)) for v in lora) and any(np.any(np.asarray(v)) for v in lora0)
  assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(other, other0))
  assert jax.tree.structure(reset) == jax.tree.structure(reset_lora_moments(opt_state))

  gu = lambda p: p["blocks"][0]["mlp"]["gate_up"]
  eff = lambda d: np.asarray(d["kernel"]) + np.asarray(d["lora_a"]) @ np.asarray(d["lora_b"])
  drifted = copy(params)
  drifted["blocks"][0]["mlp"]["gate_up"]["kernel"] = gu(params)["kernel"] + 0.05
  old = jax.device_get(gu(drifted))
  aligned, _ = make_lora_resplit(graphdef, sh, moments="aligned", svd="randomized")(copy(drifted), copy(opt_state),
                                                                                   step)
  fresh, _ = make_lora_resplit(graphdef, sh, svd="randomized")(copy(drifted), copy(opt_state), step)
  aligned, fresh = jax.device_get(gu(aligned)), jax.device_get(gu(fresh))
  np.testing.assert_allclose(eff(aligned), eff(old), atol=2e-5)
  dist = lambda d: float(np.linalg.norm(d["lora_a"] - old["lora_a"]))
  assert dist(aligned) < dist(fresh), (dist(aligned), dist(fresh))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_resume_across_a_resplit_is_exact(tmp_path):
  """Re-splits at steps 3 and 6 (the moments reset, a randomized SVD); a run preempted after step 6
  resumes from its step-4 checkpoint and ends with the uninterrupted run's losses and state, bit for
  bit. The branch's GEMMs are bf16 here: the re-split, not the quantizer, is under test."""
  text = write_pydoc_text(tmp_path / "text")
  tokens = tmp_path / "tokens"
  data.prepare(str(text), tokens, tokenizer="byte")
  model = ModelConfig(vocab_size=272, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, dtype="float32")
  opt = OptimizerConfig(learning_rate=3e-3, warmup_steps=2)
  tc = TrainConfig(steps=8, batch_size=4, seq_len=32, log_every=1, checkpoint_every=4, mesh_shape=(1, 1, 1),
                   progress=False, tensorboard=False)
  it = lambda: data.make_iterator(str(tokens), "train", 32, 4, seed=0)
  recipe = dataclasses.replace(RECIPE, matmul=MatmulConfig.bf16(), lora_resplit_moments="reset",
                               lora_resplit_svd="randomized")
  full = train(model, recipe, opt, tc, tmp_path / "full", it())
  with pytest.raises(Preempted):
    train(model, recipe, opt, tc, tmp_path / "resumed", StopAfter(it(), 6))
  resumed = train(model, recipe, opt, tc, tmp_path / "resumed", it())
  losses = lambda w: {r["step"]: r["loss"] for r in read_jsonl(Path(w) / "metrics.jsonl")}
  assert losses(tmp_path / "full") == losses(tmp_path / "resumed") and full["loss"] == resumed["loss"]
  state = lambda w: ocp.PyTreeCheckpointer().restore(str(Path(w) / "checkpoints" / "8" / "state"))
  a, b = state(tmp_path / "full"), state(tmp_path / "resumed")
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
