"""The launchers' numeric settings are range-checked where they enter (a flag, a config field, a
library argument), and a cached evaluation is reused only for what it measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import compare
from experiments import evaluate as ev
from experiments import study as st
from experiments.configs import tiny
from fp4jax import data

REPO = Path(__file__).resolve().parents[1]


def _cfg(**over):
  cfg = tiny.get_config()
  cfg.update(steps=3, batch_size=4, seq_len=16, mesh_shape=(1, 1, 1), **over)
  return cfg


@pytest.mark.parametrize("tokens,batch,match", [
    (-3, None, r"--eval_tokens=-3: give an int, at least one window \(seq_len 16\)"),
    (8, None, r"--eval_tokens=8: give an int, at least one window"),
    (None, 0, r"--eval_batch_size=0: give an int, at least 1"),
    (None, -3, r"--eval_batch_size=-3: give an int, at least 1"),
])
def test_evaluation_sizes_are_refused_before_any_run(tmp_path, tokens, batch, match):
  with pytest.raises(ValueError, match=match):
    st.study(_cfg(), tmp_path / "s", "bf16_s0", eval_tokens=tokens, eval_batch_size=batch)
  with pytest.raises(ValueError, match=match):
    compare.compare(_cfg(), ["bf16"], tmp_path / "c", eval_tokens=tokens, eval_batch_size=batch)
  assert not (tmp_path / "s" / "bf16_s0").exists() and not (tmp_path / "c" / "bf16").exists()


def test_the_configs_eval_tokens_and_the_study_flags(tmp_path):
  cfg = _cfg()
  cfg.study = {"eval_tokens": 0}
  with pytest.raises(ValueError, match=r"config study.eval_tokens=0: give an int"):
    ev.eval_tokens(cfg)
  assert ev.eval_tokens(cfg, 64) == 64  # the flag wins
  with pytest.raises(ValueError, match=r"--parallel=0: give 1 or more"):
    st.study(_cfg(), tmp_path, "bf16_s0", parallel=0)


def test_a_negative_evaluation_batch_is_refused_not_a_loss_of_zero(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"config": _cfg().to_dict(), "vocab_size": 384,
                                               "data_dir": str(tmp_path / "tokens")}))
  with pytest.raises(ValueError, match=r"--batch_size=-3: give an int, at least 1"):
    ev.evaluate(run, "shakespeare", batch_size=-3)
  with pytest.raises(ValueError, match=r"--max_tokens=0: give an int, at least one window"):
    ev.evaluate(run, "shakespeare", max_tokens=0)
  # The command line refuses it as it parses the flag.
  r = subprocess.run([sys.executable, "-m", "experiments.evaluate", f"--workdir={run}",
                      "--text=shakespeare", "--batch_size=-3", f"--out={tmp_path / 'o.jsonl'}"],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "--batch_size=-3" in r.stderr and "loss" not in r.stdout
  assert not (tmp_path / "o.jsonl").exists()


def test_a_cached_evaluation_is_keyed_by_what_it_measured(tmp_path, monkeypatch):
  run = tmp_path / "run"
  step = run / "checkpoints" / "3"
  step.mkdir(parents=True)
  (step / "fp4jax_checksums.json").write_text('{"a": 1}')
  (run / "config.json").write_text(json.dumps({"config": {"batch_size": 4}}))
  calls = []

  def fake(workdir, text, split, max_tokens, batch_size, exp=None):
    ev.check_size(max_tokens, batch_size, 16)
    calls.append(batch_size)
    return {"step": 3, "loss": 2.0 + len(calls), "batch_size": batch_size or 4,
            "checkpoint": ev.checkpoint_digest(step)}
  monkeypatch.setattr(ev, "evaluate", fake)
  first = ev.evaluate_cached(run, "shakespeare", 3, 64)
  assert ev.evaluate_cached(run, "shakespeare", 3, 64, 4) == first  # the run's batch: the same
  assert ev.evaluate_cached(run, "shakespeare", 3, 64, 2)["loss"] == 4.0  # another batch
  with pytest.raises(ValueError, match="--batch_size=-3"):
    ev.evaluate_cached(run, "shakespeare", 3, 64, -3)
  assert json.loads((run / ev.EVAL_FILE).read_text())["loss"] == 4.0  # nothing refused is kept
  (step / "fp4jax_checksums.json").write_text('{"a": 2}')  # trained again to the same step
  assert ev.evaluate_cached(run, "shakespeare", 3, 64, 2)["loss"] == 5.0
  assert calls == [None, 2, 2]


def test_data_sizes_are_refused_where_they_enter(tmp_path):
  with pytest.raises(ValueError, match=r"data vocab_size=-5 \(--config.data.vocab_size"):
    data.prepare(tmp_path, tmp_path / "o", tokenizer="bpe", vocab_size=-5)
  with pytest.raises(ValueError, match=r"shard_tokens=0 \(--shard_tokens"):
    data.prepare(tmp_path, tmp_path / "o", shard_tokens=0)


@pytest.mark.parametrize("shape", [(0, 1, 1), (1, -1, -1), (1, 1), (1, 2.0, 1), "111"])
def test_a_mesh_shape_out_of_range_is_refused_with_the_config(shape):
  from fp4jax.experiment import TrainConfig
  with pytest.raises(ValueError, match=r"TrainConfig.mesh_shape=.*expected 3 sizes \(data, fsdp, "
                     r"tensor\), each >= 1, one of them may be -1"):
    TrainConfig(steps=1, batch_size=1, seq_len=1, mesh_shape=shape)
  TrainConfig(steps=1, batch_size=1, seq_len=1, mesh_shape=[2, -1, 1])


@pytest.mark.parametrize("field,value", [("rope_theta", 0.0), ("rope_theta", float("nan")),
                                         ("init_std", -0.02), ("norm_eps", -1e-6),
                                         ("norm_eps", float("inf"))])
def test_model_floats_out_of_range_are_refused_with_the_config(field, value):
  from fp4jax.model import ModelConfig
  with pytest.raises(ValueError, match=rf"ModelConfig.{field}={value!r}: expected a finite number"):
    ModelConfig(vocab_size=None, d_model=32, n_layers=1, n_heads=2, **{field: value})
  ModelConfig(vocab_size=None, d_model=32, n_layers=1, n_heads=2, norm_eps=0.0)
