"""The recipe's schedule in the run loop (``Recipe.bf16_fwd_last``) and its per-projection override
(``Recipe.down_x``), on the tiny CPU model and real text (CPython's documentation, as in
``test_train.py``)."""

import dataclasses

import jax
import pytest
from flax import nnx

from fp4jax import data
from fp4jax import sharding as shd
from fp4jax.checkpoint import Checkpointer
from fp4jax.layers import NVFP4Matmul
from fp4jax.metrics import read_jsonl
from fp4jax.model import ModelConfig, Transformer
from fp4jax.recipe import OperandOverride, get_recipe
from fp4jax.train import (OptimizerConfig, TrainConfig, abstract_model, init_state, loss_fn, make_optimizer,
                          train)

T, B = 32, 8
MODEL = ModelConfig(vocab_size=272, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, dtype="float32")
OPT = OptimizerConfig(learning_rate=3e-3, warmup_steps=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  import pydoc_data.topics
  text = tmp_path_factory.mktemp("text")
  for i, (name, body) in enumerate(sorted(pydoc_data.topics.topics.items())[:40]):
    (text / f"{i:03d}-{name}.txt").write_text(body)
  out = tmp_path_factory.mktemp("tokens") / "pydoc-byte"
  data.prepare(str(text), out, tokenizer="byte")
  return str(out)


class _Preempted(Exception):
  pass


class _StopAfter:
  """The batches of ``it``, dying after ``n`` of them (a preemption)."""

  def __init__(self, it, n):
    self.it, self.n = it, n

  def __iter__(self):
    return self

  def __next__(self):
    if self.n == 0:
      raise _Preempted()
    self.n -= 1
    return next(self.it)

  def get_state(self):
    return self.it.get_state()

  def set_state(self, state):
    self.it.set_state(state)


def _metrics(workdir):
  rows = {r["step"]: r for r in read_jsonl(workdir / "metrics.jsonl")}
  return {s: (r["loss"], r["grad_norm"], r.get("eval_loss")) for s, r in sorted(rows.items())}


def _state(workdir, recipe, tc, step):
  mesh = shd.make_mesh((1, 1, 1))
  _, state, sh = init_state(MODEL, recipe, make_optimizer(OPT, recipe, tc.steps), mesh, tc.seed)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh)
  ckpt = Checkpointer(workdir / "checkpoints", every=1)
  try:
    _, restored = ckpt.restore(abstract, step=step)
  finally:
    ckpt.close()
  return jax.device_get(restored)


@pytest.mark.slow
def test_bf16_forward_tail_switches_at_its_step_and_resumes_exactly(data_dir, tmp_path, capsys):
  tc = TrainConfig(steps=6, batch_size=B, seq_len=T, log_every=1, eval_batches=1,
                   checkpoint_every=2, mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  recipe = get_recipe("fp4_linear", bf16_fwd_last=0.5)  # steps 4..6 (1-based) run BF16 forwards
  assert recipe.bf16_fwd_from(tc.steps) == 3
  it = lambda: data.make_iterator(data_dir, "train", T, B, seed=0)
  ev = lambda: data.make_iterator(data_dir, "validation", T, B)
  train(MODEL, recipe, OPT, tc, tmp_path / "straight", it(), ev)
  assert "step 4: the forward GEMMs run in BF16 from here to step 6" in capsys.readouterr().out
  with pytest.raises(_Preempted):  # dies after step 3; the last checkpoint is step 2
    train(MODEL, recipe, OPT, tc, tmp_path / "resumed", _StopAfter(it(), 3), ev)
  train(MODEL, recipe, OPT, tc, tmp_path / "resumed", it(), ev)  # steps 3..6: across the switch
  straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
  assert list(straight) == list(resumed) == list(range(1, 7))
  assert straight == resumed  # exact: loss, gradient norm and evaluation of every step
  a, b = _state(tmp_path / "straight", recipe, tc, 6), _state(tmp_path / "resumed", recipe, tc, 6)
  jax.tree.map(lambda x, y: x.tobytes() == y.tobytes() or pytest.fail("params differ"), a, b)
  # Step 5's loss is the BF16-forward model's loss of its batch (the state after step 4, its key).
  state = _state(tmp_path / "straight", recipe, tc, 4)
  batches = it()
  for _ in range(4):
    next(batches)
  batch, key = next(batches), jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), 4)
  loss = {}
  for name, r in (("nvfp4", recipe), ("bf16_fwd", recipe.at_step(4, tc.steps))):
    graphdef, _ = abstract_model(MODEL, r)
    loss[name] = float(jax.jit(lambda p, i, t, k, g=graphdef: loss_fn(g, p, i, t, k))(
        state["params"], batch["inputs"], batch["targets"], key))
  assert straight[5][0] == pytest.approx(loss["bf16_fwd"], rel=1e-6)
  assert abs(straight[5][0] - loss["nvfp4"]) > 100 * abs(straight[5][0] - loss["bf16_fwd"])


def test_down_x_changes_the_down_projection_alone():
  recipe = get_recipe("fp4_linear", down_x=OperandOverride(format="bf16"))
  model = Transformer(MODEL, recipe, rngs=nnx.Rngs(0))
  plain = get_recipe("fp4_linear").matmul
  for block in model.blocks:
    for dense in (block.attn.qkv, block.attn.o, block.mlp.gate_up):
      assert isinstance(dense.matmul, NVFP4Matmul) and dense.matmul.config == plain
    assert block.mlp.down.matmul.config == dataclasses.replace(plain, x=dataclasses.replace(plain.x, format="bf16"))
  # The default override builds the same model as before it existed (same config objects).
  model = Transformer(MODEL, get_recipe("fp4_linear"), rngs=nnx.Rngs(0))
  assert all(b.mlp.down.matmul.config is plain for b in model.blocks)

