"""Deleted or missing checkpoints never silently discard a run's metrics: a start that would drop
rows no lost save explains keeps them in a copy beside ``metrics.jsonl`` and says so."""

import json
import shutil

import pytest

from fp4jax import data
from fp4jax.metrics import read_jsonl, set_aside


def _rows(workdir, steps):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                 for s in steps) + '{"step": 99, "lo')


def test_rows_are_set_aside_only_when_no_lost_save_explains_their_loss(tmp_path):
  _rows(tmp_path, range(1, 61))
  assert set_aside(tmp_path, 50, 10) is None  # steps 51-60 were not saved yet: trained again
  assert set_aside(tmp_path, 40, 10)[1] == 60  # newer checkpoints deleted
  copy, last = set_aside(tmp_path, 0, 10)  # every checkpoint gone
  assert last == 60 and copy.parent == tmp_path and copy.name.startswith("metrics.jsonl.")
  assert copy.read_text() == (tmp_path / "metrics.jsonl").read_text()
  assert copy != set_aside(tmp_path, 0, 10)[0]
  assert set_aside(tmp_path / "fresh", 0, 10) is None


@pytest.mark.slow
def test_a_run_whose_checkpoints_were_deleted_keeps_its_old_rows(tmp_path, capsys):
  import pydoc_data.topics

  from fp4jax.model import ModelConfig
  from fp4jax.recipe import get_recipe
  from fp4jax.train import OptimizerConfig, TrainConfig, train

  text = tmp_path / "text"
  text.mkdir()
  for i, (name, body) in enumerate(sorted(pydoc_data.topics.topics.items())[:12]):
    (text / f"{i:03d}-{name}.txt").write_text(body)
  tokens = tmp_path / "tokens"
  data.prepare(text, tokens)
  tc = TrainConfig(steps=4, batch_size=4, seq_len=16, log_every=1, checkpoint_every=2,
                   mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  model = ModelConfig(vocab_size=384, d_model=32, n_layers=1, n_heads=2, dtype="float32")
  opt = OptimizerConfig(learning_rate=3e-3, warmup_steps=2, schedule="constant")
  work = tmp_path / "run"

  def run():
    it = data.make_iterator(tokens, "train", 16, 4)
    return train(model, get_recipe("bf16"), opt, tc, work, it)
  run()
  shutil.rmtree(work / "checkpoints")
  unfinished = work / "checkpoints" / "2.orbax-checkpoint-tmp-1234"  # a save cut short
  (unfinished / "state").mkdir(parents=True)
  capsys.readouterr()
  run()
  out = capsys.readouterr().out
  assert f"removed {unfinished}: a save that an earlier start did not finish" in out
  assert not unfinished.exists()
  assert "holds steps up to 4, but the run starts from step 0 (no checkpoint in" in out
  kept = [p for p in work.iterdir() if p.name.startswith("metrics.jsonl.")]
  assert len(kept) == 1 and [r["step"] for r in read_jsonl(kept[0])] == [1, 2, 3, 4]
  assert [r["step"] for r in read_jsonl(work / "metrics.jsonl")] == [1, 2, 3, 4]
