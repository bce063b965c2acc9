"""fp4jax.train, checkpoints, metrics and the experiments launcher (CPU, tiny model, real text).

The text is CPython's own documentation (``pydoc_data.topics``, shipped with every Python), cut
into documents and tokenized byte-level by ``fp4jax.data.prepare``: real English, no network.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Preempted, StopAfter, write_pydoc_text
from jax.sharding import PartitionSpec as P

from fp4jax import data, optim
from fp4jax import sharding as shd
from fp4jax.checkpoint import IncompatibleCheckpointError
from fp4jax.data import to_global_batch
from fp4jax.execution import Execution
from fp4jax.metrics import read_jsonl
from fp4jax.model import ModelConfig
from fp4jax.recipe import get_recipe
from fp4jax.train import (NonFiniteLossError, OptimizerConfig, TrainConfig, init_state, jit_steps,
                          loss_fn, make_optimizer, make_schedule, train)

T, B = 32, 8
MODEL = ModelConfig(vocab_size=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    dtype="float32")
OPT = OptimizerConfig(learning_rate=3e-3, warmup_steps=5)
REPO = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  return write_pydoc_text(tmp_path_factory.mktemp("text"), 40)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, text_dir):
  out = tmp_path_factory.mktemp("tokens") / "pydoc-byte"
  data.prepare(str(text_dir), out, tokenizer="byte")
  return str(out)


def _iters(data_dir, batch=B):
  it = data.make_iterator(data_dir, "train", T, batch, seed=0)
  ev = lambda: data.make_iterator(data_dir, "validation", T, batch)
  return it, ev


def _losses(workdir, key="loss"):
  rows = {r["step"]: r for r in read_jsonl(Path(workdir) / "metrics.jsonl")}
  return {s: r[key] for s, r in sorted(rows.items()) if key in r}


@pytest.mark.slow
def test_loss_falls_on_real_text(data_dir, tmp_path):
  it, ev = _iters(data_dir)
  tc = TrainConfig(steps=30, batch_size=B, seq_len=T, log_every=5, eval_every=15, eval_batches=2,
                   mesh_shape=(1, 1, 1), progress=False)
  s = train(MODEL, get_recipe("bf16"), OPT, tc, tmp_path, it, ev)
  losses = _losses(tmp_path)
  assert list(losses) == [1, 5, 10, 15, 20, 25, 30]
  assert losses[1] == pytest.approx(math.log(MODEL.vocab_size), abs=0.2)
  assert losses[30] < losses[1] - 1.5  # byte-level text: 5.6 -> ~3 nats in 30 steps
  evals = _losses(tmp_path, "eval_loss")
  assert list(evals) == [15, 30] and evals[30] < evals[15] < losses[1]
  row = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl")}[30]
  for k in ("grad_norm", "lr", "tokens_per_s", "step_time_s", "tokens"):
    assert k in row and row[k] > 0
  assert "mfu" not in row  # CPU: no known peak
  assert s["step"] == 30 and s["loss"] == losses[30] and s["eval_loss"] == evals[30]
  assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard event file
  assert (tmp_path / "checkpoints" / "30").is_dir()  # final checkpoint


@pytest.mark.slow
def test_sharded_2x2x2_equals_single_device(data_dir):
  assert jax.device_count() == 8
  batch_np = next(data.make_iterator(data_dir, "train", T, B, seed=1))
  tx = make_optimizer(OPT, get_recipe("bf16"), 10)
  sched = make_schedule(OPT, 10)
  out = {}
  for shape in ((1, 1, 1), (2, 2, 2)):
    mesh = shd.make_mesh(shape)
    graphdef, state, shardings = init_state(MODEL, get_recipe("bf16"), tx, mesh, seed=0)
    batch = to_global_batch(batch_np, mesh)
    key = jax.random.key(0)
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(graphdef, p, b["inputs"], b["targets"],
                                                    key)))
    grads = grad_fn(state["params"], batch)
    step, _ = jit_steps(graphdef, tx, sched, shardings, mesh, execution=Execution())
    state, metrics = step(state, batch)
    out[shape] = jax.device_get((metrics, grads, state["params"]))
    if shape == (2, 2, 2):
      qkv = state["params"]["blocks"][0]["attn"]["qkv"]["kernel"]
      assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
      assert len(qkv.sharding.device_set) == 8
  (m1, g1, p1), (m8, g8, p8) = out[(1, 1, 1)], out[(2, 2, 2)]
  assert m1["loss"] == pytest.approx(m8["loss"], rel=1e-6)
  assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g1, g8)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p8)


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_run(data_dir, tmp_path):
  tc = TrainConfig(steps=10, batch_size=B, seq_len=T, log_every=1, checkpoint_every=4,
                   mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  recipe = get_recipe("bf16")
  it, _ = _iters(data_dir)
  full = train(MODEL, recipe, OPT, tc, tmp_path / "full", it)
  it, _ = _iters(data_dir)
  with pytest.raises(Preempted):  # dies after 6 steps; the last checkpoint is step 4
    train(MODEL, recipe, OPT, tc, tmp_path / "resumed", StopAfter(it, 6))
  assert _losses(tmp_path / "resumed")[6] > 0  # steps 5, 6 ran, then were lost
  it, _ = _iters(data_dir)  # a fresh iterator: its position comes from the checkpoint
  resumed = train(MODEL, recipe, OPT, tc, tmp_path / "resumed", it)
  a, b = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
  assert list(a) == list(b) == list(range(1, 11))
  for s in range(1, 11):  # steps 5..10 were recomputed after the restore
    assert a[s] == pytest.approx(b[s], rel=1e-6, abs=0), s
  assert full["loss"] == resumed["loss"] and resumed["step"] == 10
  # Restoring into another model is a clear error.
  other = ModelConfig(**{**MODEL.__dict__, "d_model": 32})
  with pytest.raises(IncompatibleCheckpointError, match="model.d_model: checkpoint 64, this run 32"):
    train(other, recipe, OPT, tc, tmp_path / "resumed", *_iters(data_dir))
  with pytest.raises(IncompatibleCheckpointError, match="recipe.linear"):
    train(MODEL, get_recipe("fp4_linear"), OPT, tc, tmp_path / "resumed", *_iters(data_dir))


class _PoisonAt:
  """Batches from ``it``; batch ``n`` (1-based) gets an out-of-vocabulary id (-> NaN loss)."""

  def __init__(self, it, n, bad_id):
    self.it, self.n, self.bad_id, self.i = it, n, bad_id, 0

  def __iter__(self):
    return self

  def __next__(self):
    self.i += 1
    b = dict(next(self.it))
    if self.i == self.n:
      b["inputs"] = b["inputs"].copy()
      b["inputs"][0, 0] = self.bad_id
    return b


def test_nan_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
  tc = TrainConfig(steps=10, batch_size=B, seq_len=T, log_every=1, checkpoint_every=2,
                   mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  it, _ = _iters(data_dir)
  with pytest.raises(NonFiniteLossError, match="at step 5.*Last checkpoint with "
                     "finite, bounded parameters: step 4 in"):
    train(MODEL, get_recipe("bf16"), OPT, tc, tmp_path, _PoisonAt(it, 5, 10_000))
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2, 4]
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert rows[-1]["step"] == 5 and rows[-1]["loss"] == "nan"


def test_divergence_names_the_last_checkpoint_with_bounded_parameters(tmp_path):
  from fp4jax.checkpoint import Checkpointer
  from fp4jax.metrics import MetricsWriter
  from fp4jax.loop import _finite_metrics
  ckpt = Checkpointer(tmp_path / "checkpoints", every=2, keep=5, async_save=False)
  for step, w in ((2, 1.5), (4, 3e17), (6, float("nan"))):
    ckpt.save(step, {"params": {"w": jnp.full((4,), w)}, "step": jnp.int32(step)})
  ckpt.wait()
  assert ckpt.last_sound_step() == (2, ["step 6 holds non-finite parameters",
                                        "step 4 holds parameters with magnitudes up to 3e+17"])
  writer = MetricsWriter(tmp_path, 10, 6, progress=False, tensorboard=False)
  nan = {"loss": jnp.float32(jnp.nan), "grad_norm": jnp.float32(1.0)}
  with pytest.raises(NonFiniteLossError, match=r"at step 7.*Last checkpoint with finite, bounded "
                     r"parameters: step 2 \(newer ones passed over: step 6 holds non-finite "
                     r"parameters; step 4 holds parameters with magnitudes up to 3e\+17\)"):
    _finite_metrics(7, nan, writer, ckpt)
  writer.close()
  ckpt.close()


@pytest.mark.slow
def test_grad_accumulation_matches_full_batch(data_dir):
  batch_np = next(data.make_iterator(data_dir, "train", T, B, seed=2))
  mesh = shd.make_mesh((1, 1, 1))
  tx = make_optimizer(OPT, get_recipe("bf16"), 10)
  res = []
  for accum in (1, 4):
    graphdef, state, sh = init_state(MODEL, get_recipe("bf16"), tx, mesh, seed=0)
    step, _ = jit_steps(graphdef, tx, None, sh, mesh, grad_accum=accum, execution=Execution())
    _, m = step(state, to_global_batch(batch_np, mesh))
    res.append(jax.device_get(m))
  assert res[0]["loss"] == pytest.approx(res[1]["loss"], rel=1e-5)
  assert res[0]["grad_norm"] == pytest.approx(res[1]["grad_norm"], rel=1e-4)


def test_schedules():
  cos = make_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 100)
  assert float(cos(0)) == 0 and float(cos(10)) == pytest.approx(1.0)
  assert float(cos(100)) == pytest.approx(0.1, abs=1e-6)
  wsd = make_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=10, schedule="wsd",
                                      decay_fraction=0.2, min_lr_ratio=0.0), 100)
  assert [float(wsd(s)) for s in (5, 10, 50, 80)] == pytest.approx([0.5, 1, 1, 1])
  assert float(wsd(90)) == pytest.approx(0.5) and float(wsd(100)) == pytest.approx(0.0)


@pytest.mark.parametrize("make,match", [
    (lambda: TrainConfig(steps=0, batch_size=8, seq_len=32), "steps=0"),
    (lambda: TrainConfig(steps=1, batch_size=6, seq_len=32, grad_accum=4), "not divisible"),
    (lambda: OptimizerConfig(schedule="linear"), "schedule='linear'"),
    (lambda: OptimizerConfig(name="sgd"), "name='sgd'"),
    (lambda: OptimizerConfig(learning_rate=0.0), "learning_rate"),
])
def test_config_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_data_errors(data_dir):
  meta = data.read_meta(data_dir)
  with pytest.raises(ValueError, match="vocab_size=128 is smaller"):
    data.check_compat(meta, 128)
  mesh = shd.make_mesh((2, 2, 2))
  bad = {"inputs": np.zeros((6, T), np.int32), "targets": np.zeros((6, T), np.int32)}
  with pytest.raises(ValueError, match="global batch 6 is not divisible by the 4 devices"):
    to_global_batch(bad, mesh)


@pytest.mark.slow
def test_launcher_cli_writes_metrics(tmp_path):
  text_dir = write_pydoc_text(tmp_path / "text", 20)
  cmd = [sys.executable, "-m", "experiments.train", "--config=experiments/configs/tiny.py",
         f"--workdir={tmp_path / 'run'}", "--config.steps=4", "--config.log_every=2",
         "--config.eval_every=4", "--config.eval_batches=1", "--config.model.d_model=32",
         "--config.model.n_layers=1", "--config.batch_size=4", "--config.seq_len=16",
         "--config.mesh_shape=(1,1,1)", f"--config.data.corpus={text_dir}",
         f"--config.data.dir={tmp_path / 'tokens'}", "--config.tensorboard=False",
         "--config.recipe.bf16_last_blocks=1", "--config.recipe.matmul.hadamard=False",
         "--config.execution.cross_entropy=xla",
         f"--compilation_cache={tmp_path / 'xla_cache'}"]
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert any((tmp_path / "xla_cache").iterdir())  # the compiled step, for the resume below
  rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [row["step"] for row in rows] == [1, 2, 4]
  assert not (tmp_path / "run" / "tb").exists()
  # Output to a pipe: one line per logged step, and a line for compiling, evaluating, saving.
  out = r.stdout
  for want in ("step 1: compiling", "step 1/4 | loss", "step 2/4 | loss", "ETA",
               "step 4: evaluating", "step 4: saving a checkpoint", "step 4/4 | loss"):
    assert want in out, out
  assert all("loss" in row for row in rows) and "eval_loss" in rows[-1]
  cfg = json.loads((tmp_path / "run" / "config.json").read_text())
  assert cfg["config"]["steps"] == 4 and cfg["vocab_size"] == 384  # 257 rounded up to 128
  assert cfg["config"]["recipe"]["bf16_last_blocks"] == 1
  assert cfg["config"]["recipe"]["matmul"]["hadamard"] is False
  # Which code runs an op is not part of the run: a resume may change it.
  r = subprocess.run(cmd + ["--config.steps=5", "--config.execution.attention=xla"], cwd=REPO,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "resumed from step 4 of 5" in r.stdout, r.stdout + r.stderr[-3000:]
  bad = subprocess.run(cmd[:4] + ["--config.no_such_field=1"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode != 0 and "no_such_field" in bad.stderr


def test_init_state_is_deterministic_and_sharded():
  mesh = shd.make_mesh((1, 4, 2))
  tx = make_optimizer(OPT, get_recipe("bf16"), 10)
  _, s1, sh = init_state(MODEL, get_recipe("bf16"), tx, mesh, seed=3)
  _, s2, _ = init_state(MODEL, get_recipe("bf16"), tx, mesh, seed=3)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), s1["params"], s2["params"])
  mu = s1["opt_state"][1][0].mu["blocks"][0]["mlp"]["down"]["kernel"]
  assert mu.sharding.spec == sh["params"]["blocks"][0]["mlp"]["down"]["kernel"].spec
  assert int(s1["step"]) == 0 and s1["rng"].dtype == jnp.uint32
  # Packed NVFP4 moments follow their parameter's sharding where their own shape divides.
  from fp4jax.nvfp4 import NVFP4Tensor
  tx4 = make_optimizer(OPT, get_recipe("bf16", optimizer_states="nvfp4"), 10)
  abstract = jax.eval_shape(tx4.init, s1["params"])
  o_sh = optim.state_sharding(abstract, sh["params"])
  mu = o_sh[1][0].mu
  qkv, head = mu["blocks"][0]["attn"]["qkv"]["kernel"], mu["lm_head"]["kernel"]
  assert isinstance(qkv, NVFP4Tensor)
  assert qkv.codes.spec == P("fsdp", "tensor") and qkv.global_scale.spec == P()
  assert head.scales.spec == P("fsdp", None)  # 272 / 16 = 17 scale columns: not over 2


@pytest.mark.slow
def test_checkpoint_roundtrip_with_packed_nvfp4_optimizer_states(data_dir, tmp_path):
  from fp4jax.checkpoint import Checkpointer
  from fp4jax.nvfp4 import NVFP4Tensor
  recipe = get_recipe("bf16", optimizer_states="nvfp4")
  mesh = shd.make_mesh((1, 1, 1))
  tx = make_optimizer(OPT, recipe, 10)
  graphdef, state, sh = init_state(MODEL, recipe, tx, mesh, seed=0)
  step, _ = jit_steps(graphdef, tx, None, sh, mesh, execution=Execution())
  it = data.make_iterator(data_dir, "train", T, B, seed=0)
  for _ in range(2):
    state, _ = step(state, to_global_batch(next(it), mesh))
  packed = [x for x in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(
      x, NVFP4Tensor)) if isinstance(x, NVFP4Tensor)]
  assert packed and packed[0].codes.dtype == jnp.uint8
  ckpt = Checkpointer(tmp_path, every=1)
  ckpt.save(2, state, it, {"run": "a"})
  ckpt.wait()
  saved = jax.device_get(state)
  nxt = next(it)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state, sh)
  it2 = data.make_iterator(data_dir, "train", T, B, seed=0)
  n, restored = Checkpointer(tmp_path, every=1).restore(abstract, it2, {"run": "a"})
  assert n == 2
  jax.tree.map(lambda a, b: (a.dtype == b.dtype and a.tobytes() == b.tobytes()) or pytest.fail(
      f"{a.dtype} {b.dtype}"), saved, jax.device_get(restored))  # bit-exact, every dtype
  np.testing.assert_array_equal(next(it2)["inputs"], nxt["inputs"])  # data position restored
  _, m1 = step(state, to_global_batch(nxt, mesh))
  _, m2 = step(restored, to_global_batch(nxt, mesh))
  assert float(m1["loss"]) == float(m2["loss"])
  with pytest.raises(IncompatibleCheckpointError, match="run: checkpoint 'a', this run 'b'"):
    Checkpointer(tmp_path, every=1).restore(abstract, None, {"run": "b"})
  ckpt.close()


def test_muon_optimizer_steps(data_dir):
  # The NVFP4 variants (newton_schulz / optimizer_states = "nvfp4") are the same call with other
  # flags; their numerics are tested with fp4jax.optim (their CPU compile is too slow for here).
  r = get_recipe("bf16")
  opt = OptimizerConfig(name="muon", learning_rate=0.02, warmup_steps=1)
  tx = make_optimizer(opt, r, 10)
  mesh = shd.make_mesh((1, 1, 1))
  graphdef, state, sh = init_state(MODEL, r, tx, mesh)
  step, _ = jit_steps(graphdef, tx, None, sh, mesh, execution=Execution())
  it = data.make_iterator(data_dir, "train", T, B, seed=0)
  losses = []
  for _ in range(3):
    state, m = step(state, to_global_batch(next(it), mesh))
    losses.append(float(m["loss"]))
  assert all(np.isfinite(losses)) and losses[2] < losses[0]


def test_lora_resplit_keeps_effective_weights():
  from flax import nnx

  from fp4jax.loop import make_lora_resplit
  from fp4jax.model import Transformer
  recipe = get_recipe("fp4_linear", linear="nvfp4_lorasvd", lora_rank=4, lora_resplit_every=10)
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2)
  graphdef, state = nnx.split(Transformer(cfg, recipe, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  sh = shd.param_shardings(params, shd.make_mesh((1, 2, 1)))
  gu = lambda p: p["blocks"][0]["mlp"]["gate_up"]
  eff = lambda d: np.asarray(d["kernel"]) + np.asarray(d["lora_a"]) @ np.asarray(d["lora_b"])
  before = jax.device_get(gu(params))
  # Train-like drift: perturb the residual so the split is no longer the SVD of W_eff.
  params["blocks"][0]["mlp"]["gate_up"]["kernel"] = gu(params)["kernel"] + 0.05
  drifted = jax.device_get(gu(params))
  resplit = make_lora_resplit(graphdef, {"params": sh, "opt_state": {}})  # no optimizer state to carry
  after = jax.device_get(gu(resplit(params, {}, jnp.int32(10))[0]))
  np.testing.assert_allclose(eff(after), eff(drifted), atol=2e-5)
  assert not np.allclose(after["lora_a"], before["lora_a"])  # a new split was taken
  assert get_recipe("bf16").lora_resplit_every == 0


def test_benchmark_model_is_the_125m_config():
  import importlib

  from benchmarks import train_step
  from experiments.train import from_config
  c125 = importlib.import_module("experiments.configs.125m")
  model, *_ = from_config(c125.get_config(), vocab_size=32768)
  assert train_step.model_config(tiny=False) == model
  assert 120e6 < model.num_params() < 140e6


def test_config_fields_come_from_the_dataclasses():
  """Every dataclass field is in the experiment config with the dataclass's default, and the
  mapping back (``Experiment.from_config``) rejects keys that no dataclass has."""
  import dataclasses

  import ml_collections
  from experiments.configs import tiny
  from experiments.train import from_config
  from fp4jax.experiment import DataSpec, Experiment
  from fp4jax.ops import AttentionConfig, MatmulConfig
  from fp4jax.recipe import Recipe
  cfg = tiny.get_config("fp4_linear")
  exp = Experiment.from_config(cfg)
  assert exp.recipe == get_recipe("fp4_linear") and exp.optimizer.b2 == OptimizerConfig().b2
  assert exp.train.tensorboard is True and exp.execution == Execution() and exp.train.steps == 200
  assert exp.model.vocab_size is None and exp.model.qk_norm == ModelConfig(1, 8, 1, 1).qk_norm
  assert exp.data == DataSpec() and exp.name == "tiny" and exp.data_info is None
  for section, cls in (("model", ModelConfig), ("optimizer", OptimizerConfig), ("recipe", Recipe),
                       ("execution", Execution), ("recipe.matmul", MatmulConfig),
                       ("recipe.attention_op", AttentionConfig), ("data", DataSpec)):
    assert set(cfg[section]) == {f.name for f in dataclasses.fields(cls)}
  assert {f.name for f in dataclasses.fields(TrainConfig)} <= set(cfg)
  # The experiment written out in the config's layout types back to itself.
  assert Experiment.from_config(ml_collections.ConfigDict(exp.to_config())) == exp
  # The launcher's parts, with the data's vocabulary rounded up to 128.
  model, recipe, opt, tc, execution = from_config(cfg, vocab_size=257)
  assert model == dataclasses.replace(exp.model, vocab_size=384)
  assert (recipe, opt, tc, execution) == (exp.recipe, exp.optimizer, exp.train, exp.execution)
  # A nested recipe field is one key of the config; its section maps back to the op's config.
  cfg.recipe.matmul.hadamard = False
  cfg.recipe.attention_op.ds_tile = [32, 32]
  recipe = Experiment.from_config(cfg).recipe
  assert recipe.matmul == MatmulConfig.nvfp4(hadamard=False)
  assert recipe.attention_op.ds_tile == (32, 32)
  for section, key in (("optimizer", "momentum"), ("recipe.matmul", "hadamrd"),
                       ("execution", "kernel"), ("data", "corpse")):
    bad = tiny.get_config("fp4_linear")
    with bad.unlocked():
      bad[section][key] = 0
    with pytest.raises(ValueError, match=rf"config.{section}: unknown key\(s\) \['{key}'\]"):
      Experiment.from_config(bad)


def test_the_data_step_completes_the_experiment_and_changes_are_dotted():
  from flax import nnx

  from experiments.configs import tiny
  from fp4jax.experiment import Experiment
  from fp4jax.model import Transformer
  exp = Experiment.from_config(tiny.get_config("fp4_linear"))
  with pytest.raises(ValueError, match="vocab_size is None"):
    Transformer(exp.model, exp.recipe, rngs=nnx.Rngs(0))
  info = {"corpus": {"name": "pydoc"}, "tokenizer": {"kind": "byte"}, "vocab_size": 257}
  done = exp.with_data("/data/pydoc-byte", info)
  assert done.model.vocab_size == 384 and done.data.dir == "/data/pydoc-byte"
  assert done.data_info == info and exp.model.vocab_size is None  # a new experiment
  assert exp.with_changes({"model.vocab_size": 300}).with_data("/d", info).model.vocab_size == 300
  changed = done.with_changes({"recipe.matmul.hadamard": False, "train.seed": 3,
                               "optimizer.learning_rate": 1e-3})
  assert not changed.recipe.matmul.hadamard and changed.recipe.linear == "nvfp4"
  assert (changed.train.seed, changed.optimizer.learning_rate, changed.model) == (3, 1e-3, done.model)
  with pytest.raises(ValueError, match="OptimizerConfig.learning_rate=-1.0"):  # validated again
    done.with_changes({"optimizer.learning_rate": -1.0})
  with pytest.raises(ValueError, match=r"train.sed: TrainConfig has no field 'sed'"):
    done.with_changes({"train.sed": 1})
  with pytest.raises(ValueError, match=r"train.seed.x: 'x' is inside a value of type int"):
    done.with_changes({"train.seed.x": 1})


@pytest.mark.slow
def test_loss_fn_is_the_cross_entropy_of_the_model_logits():
  """loss_fn runs the LM head chunked (no (B, T, V) logits) but is the same loss and gradient."""
  from flax import nnx
  from fp4jax.loss import cross_entropy
  cfg = ModelConfig(**{**MODEL.__dict__, "dtype": "bfloat16"})
  graphdef, state, _ = init_state(cfg, get_recipe("bf16"), make_optimizer(OPT, get_recipe("bf16"),
                                                                        10), shd.make_mesh((1, 1, 1)))
  params = state["params"]
  tok = jax.random.randint(jax.random.key(0), (2, T + 1), 0, cfg.vocab_size)
  x, y, key = tok[:, :-1], tok[:, 1:], jax.random.key(1)
  full = lambda p: cross_entropy(nnx.merge(graphdef, p)(x, key=key), y)
  l0, g0 = jax.jit(jax.value_and_grad(full))(params)
  l1, g1 = jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, x, y, key)))(params)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12)
