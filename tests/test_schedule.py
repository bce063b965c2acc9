"""The recipe's schedule in the run loop (``Recipe.bf16_fwd_last``) and its per-projection override
(``Recipe.down_x``), on the tiny CPU model and real text (CPython's documentation, as in
``test_train.py``)."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import Preempted, StopAfter, write_pydoc_text
from flax import nnx

from experiments import evaluate as ev
from experiments import train as launcher
from experiments.configs import tiny
from fp4jax import data
from fp4jax import sharding as shd
from fp4jax.checkpoint import Checkpointer
from fp4jax.experiment import Experiment
from fp4jax.layers import NVFP4Matmul
from fp4jax.metrics import read_jsonl
from fp4jax.model import ModelConfig, Transformer
from fp4jax.recipe import OperandOverride, get_recipe
from fp4jax.train import abstract_model, loss_fn, make_optimizer

T, B = 32, 4
MODEL = ModelConfig(vocab_size=272, d_model=32, n_layers=2, n_heads=2, dtype="float32")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
  """fp4_linear with its last 3 of 6 steps' forward GEMMs in BF16, on a one-block model and a
  folder of real text (CPython's docs), prepared once; checkpoints every 2 steps, evaluated at the
  end on the whole validation split."""
  root = tmp_path_factory.mktemp("schedule")
  text = write_pydoc_text(root / "text")
  cfg = tiny.get_config("fp4_linear")
  cfg.update(steps=6, batch_size=B, seq_len=T, log_every=1, eval_batches=1000, checkpoint_every=2,
             mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  cfg.recipe.bf16_fwd_last = 0.5
  cfg.execution.cross_entropy = "xla"
  cfg.model.update(d_model=32, n_layers=1, n_heads=2, dtype="float32")
  cfg.data.update(corpus=str(text), dir=str(root / "tokens"))
  return launcher.prepare_data(Experiment.from_config(cfg)), text


def _metrics(workdir):
  rows = {r["step"]: r for r in read_jsonl(workdir / "metrics.jsonl")}
  return {s: (r["loss"], r["grad_norm"], r.get("eval_loss")) for s, r in sorted(rows.items())}


def _state(workdir, exp, step):
  """The train state saved at ``step`` (its shapes without building one: nothing compiles)."""
  rep = shd.replicated(shd.make_mesh((1, 1, 1)))
  _, params = abstract_model(exp.model, exp.recipe)
  abstract = {"step": jax.ShapeDtypeStruct((), np.int32), "params": params,
              "opt_state": jax.eval_shape(make_optimizer(exp.optimizer, exp.recipe, exp.train.steps).init, params),
              "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abstract)
  ckpt = Checkpointer(workdir / "checkpoints", every=1)
  try:
    _, restored = ckpt.restore(abstract, step=step)
  finally:
    ckpt.close()
  return jax.device_get(restored)


@pytest.mark.slow
def test_bf16_forward_tail_switches_at_its_step_resumes_exactly_and_evaluates_as_trained(
    experiment, tmp_path, capsys, monkeypatch):
  exp, text = experiment
  recipe, tc = exp.recipe, exp.train
  assert recipe.bf16_fwd_from(tc.steps) == 3  # steps 4..6 (1-based) run BF16 forwards
  launcher.run(exp, tmp_path / "straight")
  assert "step 4: the forward GEMMs run in BF16 from here to step 6" in capsys.readouterr().out
  make_iterator = data.make_iterator
  dies = lambda d, split, *a, **k: (StopAfter(make_iterator(d, split, *a, **k), 3) if split == "train"
                                    else make_iterator(d, split, *a, **k))
  monkeypatch.setattr(data, "make_iterator", dies)
  with pytest.raises(Preempted):  # dies after step 3; the last checkpoint is step 2
    launcher.run(exp, tmp_path / "resumed")
  monkeypatch.setattr(data, "make_iterator", make_iterator)
  launcher.run(exp, tmp_path / "resumed")  # steps 3..6: across the switch
  straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
  assert list(straight) == list(resumed) == list(range(1, 7))
  assert straight == resumed  # exact: loss, gradient norm and evaluation of every step
  a, b = _state(tmp_path / "straight", exp, 6), _state(tmp_path / "resumed", exp, 6)
  jax.tree.map(lambda x, y: x.tobytes() == y.tobytes() or pytest.fail("params differ"), a, b)
  # Step 5's loss is the BF16-forward model's loss of its batch (the state after step 4, its key).
  state = _state(tmp_path / "straight", exp, 4)
  batches = make_iterator(exp.data.dir, "train", T, B, seed=tc.seed)
  for _ in range(4):
    next(batches)
  batch, key = next(batches), jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), 4)
  loss = {}
  for name, r in (("nvfp4", recipe), ("bf16_fwd", recipe.at_step(4, tc.steps))):
    graphdef, _ = abstract_model(exp.model, r)
    loss[name] = float(jax.jit(lambda p, i, t, k, g=graphdef: loss_fn(g, p, i, t, k))(
        state["params"], batch["inputs"], batch["targets"], key))
  assert straight[5][0] == pytest.approx(loss["bf16_fwd"], rel=1e-6)
  assert abs(straight[5][0] - loss["nvfp4"]) > 100 * abs(straight[5][0] - loss["bf16_fwd"])
  # The held-out evaluation evaluates the model as it trained last: the loop's final eval_loss.
  whole = data.num_windows(exp.data.dir, "validation", T) // B * B
  r = ev.evaluate(tmp_path / "straight", str(text), split="validation", max_tokens=whole * T, exp=exp)
  assert r["step"] == 6 and r["loss"] == pytest.approx(straight[6][2], abs=1e-5)


def test_the_late_phase_builds_bf16_scores_with_bf16_fwd_attention():
  """With ``bf16_fwd_attention`` the late phase's model computes NVFP4 attention with q and k
  unquantized (dS as before); the early phase's and the plain tail's attention are the recipe's."""
  from fp4jax.model import NVFP4Attention
  recipe = get_recipe("fp4_linear", attention="nvfp4", bf16_fwd_last=0.5, bf16_fwd_attention=True)
  configs = {}
  for phase, step in (("early", 0), ("late", 9)):
    model = nnx.eval_shape(lambda s=step: Transformer(MODEL, recipe.at_step(s, 10), rngs=nnx.Rngs(0)))
    ops = [b.attn.attention_op for b in model.blocks]
    assert all(isinstance(op, NVFP4Attention) for op in ops)
    configs[phase] = ops[0].config
  assert configs["early"] == recipe.attention_op
  assert (configs["late"].q.format, configs["late"].k.format, configs["late"].ds) == (
      "bf16", "bf16", recipe.attention_op.ds)
  tail = get_recipe("fp4_linear", attention="nvfp4", bf16_fwd_last=0.5)
  model = nnx.eval_shape(lambda: Transformer(MODEL, tail.at_step(9, 10), rngs=nnx.Rngs(0)))
  assert model.blocks[0].attn.attention_op.config == tail.attention_op


def test_down_x_changes_the_down_projection_alone():
  recipe = get_recipe("fp4_linear", down_x=OperandOverride(format="bf16"))
  model = nnx.eval_shape(lambda: Transformer(MODEL, recipe, rngs=nnx.Rngs(0)))
  plain = get_recipe("fp4_linear").matmul
  for block in model.blocks:
    for dense in (block.attn.qkv, block.attn.o, block.mlp.gate_up):
      assert isinstance(dense.matmul, NVFP4Matmul) and dense.matmul.config == plain
    assert block.mlp.down.matmul.config == dataclasses.replace(plain, x=dataclasses.replace(plain.x, format="bf16"))
  # The default override builds the same model as before it existed (same config objects).
  model = nnx.eval_shape(lambda: Transformer(MODEL, get_recipe("fp4_linear"), rngs=nnx.Rngs(0)))
  assert all(b.mlp.down.matmul.config is plain for b in model.blocks)

