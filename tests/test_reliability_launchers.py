"""The launchers built on experiments.train keep a run's guarantees: experiments.study (sequential
and --parallel) and experiments.compare stop on a signal with every arm saved, hold their workdir,
reuse a finished run only at the same identity, and never compare evaluations of other sizes.

Subprocess tests start the launchers on a tiny config and send them real signals.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_config, write_pydoc_text

from experiments import compare
from experiments import evaluate as evaluate_lib
from experiments import study as st
from experiments import train as launcher
from fp4jax import data
from fp4jax.checkpoint import verify
from fp4jax.experiment import Experiment
from fp4jax.workdir import RunChangedError, RunLock, RunLockedError

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
SMALL = {"batch_size": 4, "seq_len": 16, "eval_batches": 1, "checkpoint_every": 1000,
         "log_every": 1, "mesh_shape": (1, 1, 1), "progress": False, "tensorboard": False,
         "eval_every": 0, "execution.cross_entropy": "xla", "model.d_model": 32,
         "model.n_layers": 1, "model.n_heads": 2, "optimizer.schedule": "constant",
         "optimizer.warmup_steps": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_pydoc_text(tmp_path_factory.mktemp("text"))


def _settings(corpus, tokens, **over):
  return {**SMALL, "data.corpus": str(corpus), "data.dir": str(tokens), **over}




def _flags(settings):
  return [f"--config.{k}={'(1,1,1)' if k == 'mesh_shape' else v}" for k, v in settings.items()]


def _wait_for(pred, timeout=240):
  t0 = time.monotonic()
  while not pred():
    assert time.monotonic() - t0 < timeout, "timed out"
    time.sleep(0.2)


def _logged(path: Path, marker: str) -> bool:
  return path.is_file() and marker in path.read_text(errors="replace")


# --------------------------------------------------------------------------- signals


@pytest.mark.slow
def test_parallel_study_stopped_by_ctrl_c_saves_every_arm_and_resumes(tmp_path, corpus):
  settings = _settings(corpus, tmp_path / "tokens", steps=2000)
  work = tmp_path / "study"
  cmd = [sys.executable, "-m", "experiments.study", "--config=experiments/configs/tiny.py",
         f"--workdir={work}", "--arms=bf16_s0,bf16_s1,bf16_s2", "--parallel=2", "--notelemetry",
         "--compilation_cache=", "--eval_tokens=64", *_flags(settings)]
  # Its own session, as a terminal's job: Ctrl-C is SIGINT to the whole process group.
  proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  logs = [work / "logs" / f"{a}.log" for a in ("bf16_s0", "bf16_s1")]
  _wait_for(lambda: all(_logged(p, "   3/2000 | loss") for p in logs))
  os.killpg(proc.pid, signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGINT, out + err
  assert err.startswith("stopped by SIGINT: arm bf16_s"), err
  assert "not started: bf16_s2" in err  # more arms than slots: the pending one never starts
  for arm in ("bf16_s0", "bf16_s1"):
    assert f"arm {arm}: stopped by SIGINT at step" in err and "resumes every arm" in err
  steps = {}
  for arm, log in zip(("bf16_s0", "bf16_s1"), logs, strict=True):
    text = log.read_text()
    # One signal reached the arm: it saved (a second one would have skipped the save).
    assert text.count("SIGINT: saving a checkpoint") == 1 and "not waiting" not in text, text
    n = int(text.split("stopped by SIGINT at step ")[1].split(":")[0])
    assert f"arm {arm}: stopped by SIGINT at step {n}" in out
    assert verify(work / arm / "checkpoints" / str(n)) is None
    steps[arm] = n
  assert not (work / "run.lock").exists()
  assert not any((work / a / "run.lock").exists() for a in steps)
  # The same command resumes each arm where it stopped; the logs keep the first part.
  proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  _wait_for(lambda: all(_logged(p, f"resumed from step {steps[a]} of 2000")
                        for a, p in zip(steps, logs, strict=True)))
  os.killpg(proc.pid, signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGINT, out + err
  for log in logs:
    assert log.read_text().count("stopped by SIGINT") == 2  # each stop, once


@pytest.mark.slow
def test_compare_stopped_by_sigterm_names_where_each_recipe_stopped(tmp_path, corpus):
  settings = _settings(corpus, tmp_path / "tokens", steps=2000)
  work = tmp_path / "cmp"
  cmd = [sys.executable, "-m", "experiments.compare", "--config=experiments/configs/tiny.py",
         f"--workdir={work}", "--recipes=bf16,fp4_linear", "--compilation_cache=",
         *_flags(settings)]
  proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  out = []
  for line in proc.stdout:
    out.append(line)
    if "   3/2000 | loss" in line:
      proc.send_signal(signal.SIGTERM)
      break
  rest, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, "".join(out) + rest + err
  last = err.strip().splitlines()[-1]
  assert last.startswith("stopped by SIGTERM: recipe bf16 at step "), err
  assert "not started: fp4_linear" in last and "checkpoint saved to" in last
  assert not (work / "run.lock").exists() and not (work / "fp4_linear").exists()


# --------------------------------------------------------------------------- workdir, reuse, evals


def test_one_study_or_comparison_per_workdir(tmp_path):
  sleeper = subprocess.Popen(["sleep", "60"])
  try:
    tmp_path.mkdir(exist_ok=True)
    holder = {"host": os.uname().nodename, "pid": sleeper.pid}
    (tmp_path / "run.lock").write_text(json.dumps(holder))
    cfg = tiny_config(SMALL)
    with pytest.raises(RunLockedError, match=f"in use by process {sleeper.pid}.*two studies"):
      st.study(cfg, tmp_path, "bf16_s0", telemetry=False)
    with pytest.raises(RunLockedError, match="two comparisons.*rm .*run.lock"):
      compare.compare(cfg, ["bf16"], tmp_path)
  finally:
    sleeper.kill()
    sleeper.wait()


def test_a_lock_of_a_reused_pid_is_taken_over(tmp_path):
  sleeper = subprocess.Popen(["sleep", "60"])
  try:  # a live process with the holder's pid but another start time: not the holder
    (tmp_path / "run.lock").write_text(json.dumps(
        {"host": os.uname().nodename, "pid": sleeper.pid, "pid_start": "1"}))
    with RunLock(tmp_path) as lock:
      assert lock.notes == [f"took over the lock of process {sleeper.pid} (its pid now belongs to "
                            f"another process) on {os.uname().nodename}"]
  finally:
    sleeper.kill()
    sleeper.wait()


@pytest.mark.slow
def test_reuse_needs_the_same_identity_and_rows_state_their_eval(tmp_path, corpus, capsys, monkeypatch):
  settings = _settings(corpus, tmp_path / "tokens", steps=3, checkpoint_every=1)
  work = tmp_path / "cmp"
  compare.compare(tiny_config(settings), ["bf16"], work)
  capsys.readouterr()
  # Reusing the run (check, evaluation, row) types the config once and prepares the data once.
  calls = []
  typed, prepare = Experiment.from_config.__func__, data.prepare
  monkeypatch.setattr(Experiment, "from_config",
                      classmethod(lambda cls, cfg: calls.append("typed") or typed(cls, cfg)))
  monkeypatch.setattr(data, "prepare", lambda *a, **k: calls.append("prepared") or prepare(*a, **k))
  results = compare.compare(tiny_config(settings), ["bf16"], work)
  assert calls == ["typed", "prepared"]
  monkeypatch.undo()
  assert "already trained to step 3 with these settings; reusing it" in capsys.readouterr().out
  # The final checkpoint evaluated on the whole held-out split, with its standard error.
  whole = data.num_windows(str(tmp_path / "tokens"), "validation", 16) * 16
  assert results["bf16"]["eval_step"] == 3 and results["bf16"]["eval_tokens"] == whole
  assert results["bf16"]["eval_loss_se"] > 0 and results["bf16"]["eval_max_tokens"] is None
  other = tiny_config({**settings, "optimizer.learning_rate": 1e-3, "seed": 5})
  with pytest.raises(RunChangedError, match=r"(?s)finished run of other settings.*"
                     r"optimizer.learning_rate: checkpoint 0.005, this run 0.001.*seed: "
                     r"checkpoint 0, this run 5"):
    compare.compare(other, ["bf16"], work)

  # A study arm: its evaluation's step and size are in its row; another --eval_tokens is another
  # evaluation, and an arm left with one of another size is not compared.
  study = tmp_path / "study"
  cfg = tiny_config(settings)
  st.study(cfg, study, "bf16_s0,bf16_s1", eval_tokens=64, telemetry=False)
  rows = st.study(cfg, study, "bf16_s0", eval_tokens=32, telemetry=False)
  by = {r["arm"]: r for r in rows}
  assert (by["bf16_s0"]["eval_max_tokens"], by["bf16_s0"]["eval_tokens"]) == (32, 32)
  assert by["bf16_s0"]["eval_step"] == 3 and by["bf16_s0"]["comparable"]
  assert by["bf16_s1"]["eval_max_tokens"] == 64 and not by["bf16_s1"]["comparable"]
  assert math.isnan(by["bf16_s1"]["gap_pct"])
  floor = json.loads((study / st.ROWS_FILE).read_text().splitlines()[0])["noise_floor"]
  assert floor["n"] == 1
  table = (study / st.TABLE_FILE).read_text()
  assert "not compared ‡" in table and "Reference (bf16_s0): eval loss" in table
  # A finished arm whose final checkpoint is corrupt is evaluated (and recorded) at its fallback.
  arm = study / "bf16_s1"
  step_dir = arm / "checkpoints" / "3"
  big = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
  big.write_bytes(big.read_bytes()[:-8] + b"\0" * 8)
  exp = launcher.prepare_data(st.arm_experiment(Experiment.from_config(cfg), st.select_arms("bf16_s1")[0], False))
  assert not launcher.finished_run(exp, arm)
  assert "is corrupt" in capsys.readouterr().out
  (arm / st.EVAL_FILE).unlink()
  assert evaluate_lib.evaluate_cached(arm, str(corpus), 3, 32, None)["step"] == 2
  row = st.arm_row(Experiment.from_config(cfg), st.select_arms("bf16_s1")[0], study, 32)
  assert row["eval_step"] == 2 and not row["comparable"]


def test_a_diverged_recipe_is_a_row_of_its_own(tmp_path, corpus, monkeypatch):
  """A recipe whose loss turns NaN is reported as diverged (no evaluation, no gap); the others go on."""
  from fp4jax.loop import NonFiniteLossError

  def diverge(exp, run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"data_dir": exp.data.dir, "num_params": 1}))
    raise NonFiniteLossError(f"{exp.recipe.linear}: loss is NaN at step 2")

  monkeypatch.setattr(launcher, "run", diverge)
  rows = compare.compare(tiny_config(_settings(corpus, tmp_path / "tokens", steps=3)), ["bf16", "fp4_linear"],
                         tmp_path / "cmp")
  assert [r["status"] for r in rows.values()] == ["diverged", "diverged"]
  assert rows["fp4_linear"]["seed"] == 0 and math.isnan(rows["fp4_linear"]["gap_pct"])


def test_distributed_without_a_coordinator_names_what_to_set(tmp_path):
  env = {k: v for k, v in ENV.items() if k not in launcher.DISTRIBUTED_ENV}
  r = subprocess.run([sys.executable, "-m", "experiments.train", "--config=experiments/configs/"
                      "tiny.py", f"--workdir={tmp_path}", "--distributed"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 1, r.stderr
  err = r.stderr.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --distributed found no coordinator"), r.stderr
  assert "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID" in err[0]
