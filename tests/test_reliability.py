"""A run never loses work: stop signals, one run per workdir, checksummed checkpoints, honest
resumes, and launcher errors a person can act on (CPU, tiny model, real text).

Subprocess tests run ``python -m experiments.train`` on a tiny config and send it real signals.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from conftest import Preempted, StopAfter, tiny_config, write_pydoc_text

from experiments import compare
from experiments import train as launcher
from experiments.configs import tiny
from fp4jax import data
from fp4jax.checkpoint import CheckpointSaveError, CorruptCheckpointError, verify
from fp4jax.metrics import read_jsonl
from fp4jax.model import ModelConfig
from fp4jax.recipe import get_recipe
from fp4jax.train import OptimizerConfig, TrainConfig, train
from fp4jax.workdir import RunChangedError, RunLock, RunLockedError, make_folder

REPO = Path(__file__).resolve().parents[1]
T, B = 32, 8
MODEL = ModelConfig(vocab_size=272, d_model=32, n_layers=1, n_heads=2, dtype="float32")
OPT = OptimizerConfig(learning_rate=3e-3, warmup_steps=2, schedule="constant")
RECIPE = get_recipe("bf16")
# Launcher settings of the subprocess tests (dotted config paths).
TINY = {"log_every": 1, "model.d_model": 32, "model.n_layers": 1, "batch_size": 4, "seq_len": 16,
        "mesh_shape": (1, 1, 1), "tensorboard": False, "execution.cross_entropy": "xla", "eval_every": 0,
        "eval_batches": 1, "checkpoint_every": 1000, "optimizer.schedule": "constant",
        "optimizer.warmup_steps": 2}
# The subprocess computes as the test process does (conftest's matmul precision).
ENV = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}



@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  return write_pydoc_text(tmp_path_factory.mktemp("text"), 20)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, text_dir):
  out = tmp_path_factory.mktemp("tokens") / "pydoc-byte"
  data.prepare(str(text_dir), out, tokenizer="byte")
  return str(out)


def _settings(text_dir, tokens_dir, **over):
  return {**TINY, "data.corpus": str(text_dir), "data.dir": str(tokens_dir), **over}




def _cli(settings, workdir, arg=None):
  config = "experiments/configs/tiny.py" + (f":{arg}" if arg else "")
  args = [f"--config.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
          for k, v in settings.items()]
  args = [a.replace("mesh_shape=1,1,1", "mesh_shape=(1,1,1)") for a in args]
  return [sys.executable, "-m", "experiments.train", f"--config={config}",
          f"--workdir={workdir}", *args]


def _launch(cmd):
  return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1)


def _signal_when(proc, marker, signum, delay=0.0):
  """Sends ``signum`` once a line containing ``marker`` is printed; returns (output, rc, seconds
  from the signal to the exit)."""
  out, sent = [], None
  for line in proc.stdout:
    out.append(line)
    if sent is None and marker in line:
      time.sleep(delay)
      proc.send_signal(signum)
      sent = time.monotonic()
  rc = proc.wait(timeout=120)
  return "".join(out), rc, (time.monotonic() - sent) if sent else None


def _losses(workdir):
  rows = read_jsonl(Path(workdir) / "metrics.jsonl")
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
  return {r["step"]: r["loss"] for r in rows}


# --------------------------------------------------------------------------- signals


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_rerun_continues_exactly(tmp_path, text_dir):
  settings = _settings(text_dir, tmp_path / "tokens")
  run = tmp_path / "run"
  out, rc, _ = _signal_when(_launch(_cli({**settings, "steps": 3000}, run)), "   3/3000 | loss",
                            signal.SIGTERM)
  assert rc == 128 + signal.SIGTERM, out[-3000:]
  last = out.strip().splitlines()[-1]
  assert last.startswith("stopped by SIGTERM at step ") and "checkpoint saved to" in last, out
  n = int(last.split("at step ")[1].split(":")[0])
  assert 3 <= n < 3000 and (run / "checkpoints" / str(n)).is_dir()  # not a multiple of 1000
  assert verify(run / "checkpoints" / str(n)) is None  # checksummed
  assert not (run / "run.lock").exists()
  # The rerun resumes at step n: its losses equal an uninterrupted run's.
  steps = n + 3
  launcher.run(tiny_config({**settings, "steps": steps}), run)
  launcher.run(tiny_config({**settings, "steps": steps}), tmp_path / "ref")
  got, ref = _losses(run), _losses(tmp_path / "ref")
  assert list(got) == list(ref) == list(range(1, steps + 1))
  for s in ref:
    assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=0), s


@pytest.mark.slow
def test_interrupt_during_compilation_exits_at_once(tmp_path, text_dir):
  # The NVFP4 train step compiles for seconds on the CPU; Ctrl-C must not wait for it.
  run = tmp_path / "run"
  cmd = _cli(_settings(text_dir, tmp_path / "tokens", steps=20), run, arg="fp4_linear")
  out, rc, dt = _signal_when(_launch(cmd), "compiling the train step", signal.SIGINT, 0.2)
  assert rc == 128 + signal.SIGINT, out[-3000:]
  assert dt < 3, f"took {dt:.1f} s to stop"
  assert "stopped by SIGINT: no step had run" in out and "compiled and ran" not in out, out
  assert not (run / "run.lock").exists() and not list((run / "checkpoints").iterdir())


# --------------------------------------------------------------------------- one run per workdir


def test_run_lock(tmp_path):
  lock_file = tmp_path / "run.lock"
  with RunLock(tmp_path) as lock:
    holder = json.loads(lock_file.read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with RunLock(tmp_path):  # re-entrant in one process (launcher, then train)
      pass
    assert lock_file.exists() and not lock.notes
  assert not lock_file.exists()
  sleeper = subprocess.Popen(["sleep", "60"])
  try:
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid}))
    with pytest.raises(RunLockedError, match=f"in use by process {sleeper.pid} on this host"):
      RunLock(tmp_path).__enter__()
  finally:
    sleeper.kill()
    sleeper.wait()
  with RunLock(tmp_path) as lock:  # the holder died: its lock is taken over, saying so
    assert lock.notes == [f"took over the lock of process {sleeper.pid} (no longer running) on "
                          f"{socket.gethostname()}"]
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
  lock_file.write_text(json.dumps({"host": "node-17", "pid": 1234}))
  with pytest.raises(RunLockedError, match="process 1234 on host node-17.*delete .*run.lock"):
    RunLock(tmp_path).__enter__()
  lock_file.write_text("")
  with pytest.raises(RunLockedError, match="cannot be read"):
    RunLock(tmp_path).__enter__()


def test_a_workdir_that_is_a_file_is_named_with_the_fix(tmp_path):
  from experiments.evaluate import read_run
  afile = tmp_path / "afile"
  afile.write_text("")
  for path in (afile, afile / "sub"):
    with pytest.raises(NotADirectoryError, match=f"study's folder {path}: {afile} is a file, not a folder"):
      make_folder(path, "study")
    with pytest.raises(NotADirectoryError, match=f"{afile} is a file, not a folder; name a new or existing"):
      RunLock(path).__enter__()
  with pytest.raises(NotADirectoryError, match="it is a file, not a run's folder"):
    read_run(afile)
  assert make_folder(tmp_path / "a" / "b").is_dir() and make_folder(tmp_path / "a").is_dir()
  # A study's --collect that is a file is said before any arm trains.
  from experiments import study
  with pytest.raises(NotADirectoryError, match=f"the collection's folder {afile}: {afile} is a file"):
    study.study(tiny.get_config(), tmp_path / "st", "bf16_s0", collect_to=afile, telemetry=False)
  assert sorted(p.name for p in (tmp_path / "st").iterdir()) == []  # nothing trained or written


@pytest.mark.slow
def test_second_launch_on_a_workdir_is_refused(tmp_path, text_dir):
  run = tmp_path / "run"
  run.mkdir()
  (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
  r = subprocess.run(_cli(_settings(text_dir, tmp_path / "tokens", steps=2), run), cwd=REPO,
                     env=ENV, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stdout + r.stderr
  err = r.stderr.strip().splitlines()
  assert len(err) == 1 and f"in use by process {os.getpid()}" in err[0], r.stderr
  assert sorted(p.name for p in run.iterdir()) == ["run.lock"]  # nothing written


# --------------------------------------------------------------------------- checkpoints


def _train(workdir, data_dir, steps, seed=0, train_iter=None, **kw):
  tc = TrainConfig(steps=steps, batch_size=B, seq_len=T, seed=seed, log_every=1,
                   checkpoint_every=2, mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  it = train_iter or data.make_iterator(data_dir, "train", T, B, seed=seed)
  return train(MODEL, RECIPE, OPT, tc, workdir, it, **kw)


def _flip_a_byte(step_dir: Path) -> Path:
  path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)
  raw = bytearray(path.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  path.write_bytes(bytes(raw))
  return path


@pytest.mark.slow
def test_corrupt_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, data_dir, capsys):
  _train(tmp_path, data_dir, 6)
  first = _losses(tmp_path)
  ckpts = tmp_path / "checkpoints"
  assert sorted(int(p.name) for p in ckpts.iterdir()) == [2, 4, 6]
  bad = _flip_a_byte(ckpts / "6")
  capsys.readouterr()
  _train(tmp_path, data_dir, 8)
  out = capsys.readouterr().out
  assert f"checkpoint {ckpts / '6'} is corrupt: {bad} does not match its sha256" in out, out
  assert "falling back to step 4, the newest intact checkpoint" in out
  assert "resumed from step 4 of 8, data position" in out
  assert (tmp_path / "checkpoints-corrupt" / "6").is_dir()  # kept for inspection, out of the way
  again = _losses(tmp_path)
  assert list(again) == list(range(1, 9))
  for s in (5, 6):  # recomputed from step 4: the same as before the corruption
    assert again[s] == pytest.approx(first[s], rel=1e-6, abs=0)
  # Every step corrupt: a clear error, nothing restored, nothing moved.
  steps = sorted(int(p.name) for p in ckpts.iterdir())
  _flip_a_byte(ckpts / str(steps[0]))
  (ckpts / str(steps[1]) / "meta" / "metadata").unlink()
  with open(_flip_a_byte(ckpts / str(steps[2])), "r+b") as f:
    f.truncate(3)
  with pytest.raises(CorruptCheckpointError) as e:
    _train(tmp_path, data_dir, 10)
  msg = str(e.value)
  assert "every checkpoint in" in msg and "move" in msg and "does not match its sha256" in msg
  assert "is missing" in msg and "bytes" in msg
  assert sorted(int(p.name) for p in ckpts.iterdir()) == steps


def test_failed_save_is_reported_and_training_goes_on(tmp_path, data_dir, capsys, monkeypatch):
  real_save = ocp.CheckpointManager.save

  def save(self, step, *a, **k):
    if step in (2, 6):
      raise OSError(28, "No space left on device")
    return real_save(self, step, *a, **k)

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(CheckpointSaveError, match=r"final checkpoint \(step 6\).*latest saved is "
                     r"step 4"):
    _train(tmp_path, data_dir, 6)
  out = capsys.readouterr().out
  assert "warning: could not save checkpoint step 2" in out
  # A full disk: one line with the path, the space the checkpoint needs and the space free.
  assert f"no space left on device at {tmp_path / 'checkpoints'}: checkpoint step 2 needs about" \
      in out and "MB free there" in out
  assert "next save tries again" in out
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4]
  assert list(_losses(tmp_path)) == list(range(1, 7))  # the run went on after the failure


# --------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resume_is_honest(tmp_path, data_dir, capsys, caplog):
  corpus = {"corpus": {"name": "pydoc", "fingerprint": "abc"}}
  config = {"note": "first"}
  it = StopAfter(data.make_iterator(data_dir, "train", T, B, seed=0), 3)
  with pytest.raises(Preempted):  # killed after step 3; the last checkpoint is step 2
    _train(tmp_path, data_dir, 6, train_iter=it, data_info=corpus, config=config)
  assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
  capsys.readouterr()
  _train(tmp_path, data_dir, 6, data_info=corpus, config={"note": "second"})
  out = capsys.readouterr().out
  resumed = [line for line in out.splitlines() if line.startswith("resumed")]
  assert resumed == [f"resumed from step 2 of 6, data position next_index=2 "
                     f"({tmp_path / 'checkpoints' / '2'})"], out
  assert not [r for r in caplog.records if "could not be restored" in r.getMessage()]
  assert list(_losses(tmp_path)) == list(range(1, 7))  # one row per step
  assert json.loads((tmp_path / "config.json").read_text()) == {"note": "first"}
  # A changed seed, batch or corpus is refused, naming the fields and the way to allow it.
  with pytest.raises(RunChangedError, match=r"(?s)data.corpus.name: checkpoint 'pydoc', this run "
                     r"'other'.*seed: checkpoint 0, this run 1.*--allow_changes=data.corpus.name,"
                     r"seed"):
    _train(tmp_path, data_dir, 8, seed=1, data_info={"corpus": {**corpus["corpus"],
                                                                "name": "other"}})
  with pytest.raises(ValueError, match="steps=6 is not above step 6.*nothing to train"):
    _train(tmp_path, data_dir, 6, data_info=corpus)
  capsys.readouterr()
  _train(tmp_path, data_dir, 8, seed=1, data_info=corpus, allow_changes=("seed",),
         config={"note": "third"})
  assert "resuming with a changed seed: 0 -> 1 (allowed" in capsys.readouterr().out
  history = read_jsonl(tmp_path / "config_history.jsonl")
  assert [h["step"] for h in history] == [0, 2, 6]
  assert history[-1]["changes"] == ["seed: 0 -> 1"] and history[-1]["config"] == {"note": "third"}
  assert json.loads((tmp_path / "config.json").read_text()) == {"note": "first"}


def test_one_identity_and_one_diff():
  import dataclasses

  from fp4jax.execution import Execution
  from fp4jax.experiment import Experiment
  from fp4jax.workdir import ABSENT, diff, identity, identity_changes, identity_diffs
  a = {"model": {"d": 1, "old": 2}, "seq": [1, 2], "same": {"x": (3,)}}
  b = {"model": {"d": 2, "new": 3}, "seq": (1, 2), "same": {"x": [3]}}
  assert diff(a, b) == [("model.d", 1, 2), ("model.new", ABSENT, 3), ("model.old", 2, ABSENT)]
  # A resume compares what the checkpoint recorded: a field added since is not a change.
  assert identity_diffs(a, b) == ["model.d: checkpoint 1, this run 2",
                                  "model.old: checkpoint 2, this run '<absent>'"]
  tc = TrainConfig(steps=4, batch_size=B, seq_len=T, mesh_shape=(1, 1, 1))
  exp = Experiment(MODEL, get_recipe("fp4_linear_lorasvd"), OPT, tc,
                   data_info={"corpus": {"name": "pydoc"}})
  ident = identity(exp)
  assert set(ident) == {"model", "recipe", "optimizer", "batch_size", "seq_len", "seed", "data"}
  assert ident["data"] == {"corpus": {"name": "pydoc"}} and ident["model"]["vocab_size"] == 272
  assert json.loads(json.dumps(ident))["recipe"]["linear"] == "nvfp4_lorasvd"
  # Schedules and the execution are not what a run is; the seed is, and may change when allowed.
  same = exp.with_changes({"train.steps": 9, "train.log_every": 3, "recipe.lora_resplit_every": 5})
  assert identity(dataclasses.replace(same, execution=Execution(attention="xla"))) == ident
  reseeded = identity(exp.with_changes({"train.seed": 1}))
  assert identity_changes(ident, reseeded, ("seed",)) == ["seed: 0 -> 1"]
  with pytest.raises(RunChangedError, match="seed: checkpoint 0, this run 1"):
    identity_changes(ident, reseeded)


def test_launcher_types_the_config_once_and_prepares_the_data_once(tmp_path, text_dir,
                                                                   monkeypatch):
  from fp4jax.experiment import Experiment
  calls = []
  typed, prepare = Experiment.from_config.__func__, data.prepare
  monkeypatch.setattr(Experiment, "from_config",
                      classmethod(lambda cls, cfg: calls.append("typed") or typed(cls, cfg)))
  monkeypatch.setattr(data, "prepare", lambda *a, **k: calls.append("prepared") or prepare(*a, **k))
  settings = _settings(text_dir, tmp_path / "tokens", steps=2, progress=False)
  summary = launcher.run(tiny_config(settings), tmp_path / "run")
  assert calls == ["typed", "prepared"] and summary["step"] == 2
  recorded = json.loads((tmp_path / "run" / "config.json").read_text())
  assert recorded["config"] == json.loads(json.dumps(tiny_config(settings).to_dict()))
  assert recorded["vocab_size"] == 384
  # The completed experiment serves the reuse check as is: nothing typed or prepared again.
  exp = launcher.prepare_data(launcher.experiment(tiny_config(settings)))
  calls.clear()
  assert launcher.finished_run(exp, tmp_path / "run") and calls == []
  with pytest.raises(RunChangedError, match="seed: checkpoint 0, this run 1"):
    launcher.finished_run(exp.with_changes({"train.seed": 1}), tmp_path / "run")
  assert not launcher.finished_run(exp.with_changes({"train.steps": 3}), tmp_path / "run")


def test_empty_evaluation_data_fails_before_the_first_step(tmp_path, data_dir):
  with pytest.raises(ValueError, match="evaluation data yields no batch"):
    _train(tmp_path, data_dir, 4, eval_batches=lambda: iter([]))
  assert not list((tmp_path / "checkpoints").iterdir())
  assert not (tmp_path / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- user errors


@pytest.mark.parametrize("make,match", [
    (lambda: OptimizerConfig(learning_rate=float("inf")), "finite number > 0"),
    (lambda: OptimizerConfig(learning_rate=-1e-3), "finite number > 0"),
    (lambda: OptimizerConfig(learning_rate=float("nan")), "finite number > 0"),
    (lambda: OptimizerConfig(weight_decay=-0.1), "weight_decay=-0.1"),
    (lambda: OptimizerConfig(b2=1.5), r"b2=1.5: must be in \[0, 1\]"),
    (lambda: OptimizerConfig(eps=float("inf")), "eps=inf"),
    (lambda: TrainConfig(steps=-3, batch_size=8, seq_len=32), "steps=-3"),
])
def test_nonsense_values_are_rejected(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_compare_checks_every_recipe_before_training(tmp_path):
  with pytest.raises(ValueError, match="unknown recipe 'bogus'"):
    compare.compare(tiny.get_config(), ["bf16", "bogus"], tmp_path)
  cfg = tiny.get_config()
  cfg.optimizer.learning_rate = float("inf")
  with pytest.raises(ValueError, match="learning_rate=inf"):
    compare.compare(cfg, ["bf16", "fp4_linear"], tmp_path)
  assert not list(tmp_path.iterdir())  # nothing trained


@pytest.mark.parametrize("args,rc,want", [
    ([], 2, "error: missing --config"),
    (["--config=experiments/configs/tiny.py", "--config.optimizer.learning_rate=inf"], 1,
     "error: OptimizerConfig.learning_rate=inf: must be a finite number > 0"),
    (["--config=experiments/configs/tiny.py", "--config.steps=0", "--verbose"], 1,
     "error: TrainConfig.steps=0: expected a positive int"),
])
@pytest.mark.slow
def test_launcher_user_errors_are_short(tmp_path, args, rc, want):
  r = subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", *args],
                     cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
  assert r.returncode == rc, r.stderr
  err = r.stderr.strip().splitlines()
  assert err[-1 if rc == 1 else 0].startswith(want), r.stderr
  if "--verbose" in args:
    assert "Traceback" in r.stderr
  else:
    assert "Traceback" not in r.stderr and len(err) <= 2, r.stderr
  assert not (tmp_path / "checkpoints").exists()


def test_an_empty_or_partial_step_folder_falls_back_like_a_corrupt_one(tmp_path, capsys):
  import jax.numpy as jnp

  from fp4jax.checkpoint import Checkpointer
  ckpts = tmp_path / "checkpoints"
  ckpt = Checkpointer(ckpts, every=1, async_save=False)
  ckpt.save(2, {"w": jnp.ones(3)}, meta={"a": 1})
  ckpt.close()
  (ckpts / "4").mkdir()  # empty, as a copy or a crash can leave it
  (ckpts / "6" / "state").mkdir(parents=True)  # partial
  ckpt = Checkpointer(ckpts, every=1, async_save=False)
  assert ckpt.intact_step() == 2
  out = capsys.readouterr().out
  assert f"checkpoint {ckpts / '6'} is corrupt: {ckpts / '6'} is empty or partial" in out
  assert f"checkpoint {ckpts / '4'} is corrupt" in out and "falling back to step 2" in out
  assert sorted(p.name for p in (tmp_path / "checkpoints-corrupt").iterdir()) == ["4", "6"]
  ckpt.close()
