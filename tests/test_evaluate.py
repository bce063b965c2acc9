"""experiments.evaluate: a run's checkpoint on any text, and its errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_pydoc_text

from experiments import evaluate as ev
from experiments import train as launcher
from experiments.configs import tiny
from fp4jax import data
from fp4jax.experiment import Experiment
from fp4jax.metrics import read_jsonl

pytestmark = pytest.mark.slow  # every test reads a run trained in the module fixture

REPO = Path(__file__).resolve().parents[1]
T, B = 32, 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny run trained 3 steps on a folder of real text (CPython's docs), evaluated at the end
  on every whole batch of its validation split."""
  root = tmp_path_factory.mktemp("eval")
  text = write_pydoc_text(root / "text")
  cfg = tiny.get_config()
  cfg.update(steps=3, batch_size=B, seq_len=T, eval_batches=1000, checkpoint_every=0,
             mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  cfg.execution.cross_entropy = "xla"
  cfg.model.update(d_model=32, n_layers=1, n_heads=2)
  cfg.data.update(corpus=str(text), dir=str(root / "tokens"))
  launcher.run(cfg, root / "run")
  exp = launcher.prepare_data(Experiment.from_config(cfg))  # the run's experiment, as a launcher holds it
  return root / "run", text, str(root / "tokens"), exp


@pytest.fixture(scope="module")
def run(trained):
  return trained[:3]


def test_own_validation_split_equals_the_train_loops_eval_loss(trained):
  workdir, text, tokens, exp = trained
  eval_loss = read_jsonl(workdir / "metrics.jsonl")[-1]["eval_loss"]
  whole = data.num_windows(tokens, "validation", T) // B * B  # the loop's whole batches
  r = ev.evaluate(workdir, str(text), split="validation", max_tokens=whole * T)
  assert r["step"] == 3 and r["windows"] == whole and r["split"] == "validation"
  assert r["loss"] == pytest.approx(eval_loss, abs=1e-4)
  # The loss is the mean of the batches' means; its standard error is over those batches.
  assert r["batch_windows"] == [B] * (whole // B)
  assert r["loss"] == pytest.approx(np.mean(r["batch_losses"]), rel=1e-12)
  assert r["loss_se"] == pytest.approx(np.std(r["batch_losses"], ddof=1) / np.sqrt(whole // B), rel=1e-9)
  assert 0 < r["loss_se"] < 0.5
  # A launcher's experiment stands for the recorded config: the same evaluation, bit for bit.
  typed = ev.evaluate(workdir, str(text), split="validation", max_tokens=whole * T, exp=exp)
  assert typed["batch_losses"] == r["batch_losses"] and typed["loss"] == r["loss"]
  # The folder whole (default split), with a last partial batch: a different, sensible loss.
  r = ev.evaluate(workdir, str(text), batch_size=3)
  assert r["split"] == "all" and r["windows"] > whole and abs(r["loss"] - eval_loss) < 0.5
  assert r["perplexity"] == pytest.approx(2.718281828 ** r["loss"])


def test_cli_prints_and_appends_a_json_line(run, tmp_path):
  workdir, text, _ = run
  out = tmp_path / "r.jsonl"
  cmd = [sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}",
         f"--text={text / '000-assert.txt'}", "--max_tokens=64", f"--out={out}"]
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "loss " in r.stdout and "perplexity" in r.stdout and "64 tokens" in r.stdout
  assert "±" not in r.stdout  # one batch: no standard error
  row = json.loads(out.read_text())
  assert row["tokens"] == 64 and row["step"] == 3 and row["split"] == "all"
  bad = subprocess.run(cmd[:3] + [f"--workdir={tmp_path / 'nope'}", f"--text={text}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1 and bad.stderr.startswith("error: no run at ")
  assert len(bad.stderr.strip().splitlines()) == 1


def test_errors_name_the_problem(run, tmp_path):
  workdir, text, _ = run
  with pytest.raises(FileNotFoundError, match="no run at"):
    ev.evaluate(tmp_path / "nope", str(text))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="not a run of experiments.train"):
    ev.evaluate(tmp_path / "empty", str(text))
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  shutil.copy(workdir / "config.json", fresh / "config.json")
  with pytest.raises(FileNotFoundError, match="has no checkpoint yet"):
    ev.evaluate(fresh, str(text))
  with pytest.raises(FileNotFoundError, match="neither a built-in corpus"):
    ev.evaluate(workdir, str(tmp_path / "no-text"))
  (tmp_path / "none").mkdir()
  with pytest.raises(ValueError, match="holds no .txt files"):
    ev.evaluate(workdir, str(tmp_path / "none"))
  binary = tmp_path / "binary"
  binary.mkdir()
  (binary / "a.txt").write_bytes("héllo".encode("utf-16"))
  with pytest.raises(ValueError, match="a.txt is not utf-8 text"):
    ev.evaluate(workdir, str(binary))
  short = tmp_path / "short.txt"
  short.write_text("tiny")
  with pytest.raises(ValueError, match="fewer than one window"):
    ev.evaluate(workdir, str(short))
  with pytest.raises(ValueError, match="needs a corpus or a folder"):
    ev.evaluate(workdir, str(short), split="validation")


def test_out_is_checked_before_the_evaluation(tmp_path):
  """``--out`` that is a folder, or in a missing folder, is refused with the fix (main checks it before
  evaluating); a new or existing file in an existing folder passes."""
  from experiments.evaluate import check_out
  with pytest.raises(IsADirectoryError, match=f"--out={tmp_path} is a folder: name a file"):
    check_out(tmp_path)
  with pytest.raises(FileNotFoundError, match=f"its folder {tmp_path / 'no'} does not exist or is not a folder"):
    check_out(tmp_path / "no" / "r.jsonl")
  (tmp_path / "f").write_text("")
  with pytest.raises(FileNotFoundError, match="does not exist or is not a folder"):
    check_out(tmp_path / "f" / "r.jsonl")
  check_out(tmp_path / "r.jsonl")
  check_out(tmp_path / "f")


def test_a_damaged_config_json_is_named(tmp_path):
  """A run whose ``config.json`` is not JSON (or not text) is named with the fix, not a bare decoder error."""
  (tmp_path / "config.json").write_text("{bad")
  with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'} is damaged .*put back a copy of it"):
    ev.read_run(tmp_path)
  (tmp_path / "config.json").write_bytes(b"\xff\xfe")
  with pytest.raises(ValueError, match="is damaged .*codec can't decode"):
    ev.read_run(tmp_path)
