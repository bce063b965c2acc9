"""A run records the code it ran; the launchers reuse a finished run only from the same code, else
they name the code that trained it and train it again (the old run kept), unless asked to keep it."""

import jax.numpy as jnp
import pytest

from experiments import train as launcher
from experiments.configs import tiny
from fp4jax.checkpoint import Checkpointer
from fp4jax.experiment import Experiment
from fp4jax.workdir import CODE_KEY, code_version, describe_code, identity, identity_changes


@pytest.fixture(scope="module")
def exp():
  cfg = tiny.get_config()
  cfg.update(steps=3, mesh_shape=(1, 1, 1))
  e = Experiment.from_config(cfg)
  return e.with_data("/nowhere", {"corpus": {"name": "x"}, "tokenizer": {"kind": "byte"},
                                  "vocab_size": 257}).with_changes({"model.vocab_size": 384})


def _finished(workdir, exp, code):
  """A run of ``exp`` saved at its last step, recorded as trained by ``code`` (None: no record)."""
  meta = identity(exp) if code is None else {**identity(exp), CODE_KEY: code}
  ckpt = Checkpointer(workdir / "checkpoints", every=1)
  ckpt.save(exp.train.steps, {"x": jnp.zeros(2)}, meta=meta)
  assert ckpt.wait()
  ckpt.close()


def test_the_code_record_names_the_package_source():
  code = code_version()
  assert code["version"] and len(code["source"]) == 64
  assert describe_code(code).startswith(f"fp4jax {code['version']} (")
  assert "not recorded" in describe_code(None)
  # The record rides with the identity in a checkpoint's meta but is not part of it.
  assert identity_changes({"seed": 0, CODE_KEY: {"source": "other"}}, {"seed": 0}) == []


def test_a_finished_run_is_reused_only_from_the_same_code(tmp_path, exp, capsys):
  same, other, old = tmp_path / "same", tmp_path / "other", tmp_path / "old"
  _finished(same, exp, code_version())
  _finished(other, exp, {"version": "0.0.9", "source": "ab" * 32, "commit": "e39efc4" + "0" * 33})
  _finished(old, exp, None)
  assert launcher.finished_run(exp, same)
  capsys.readouterr()
  assert launcher.finished_run(exp, other, keep_other_code=True)
  assert "reusing the run trained by fp4jax 0.0.9 (commit e39efc4000, source abababababab)" \
      in capsys.readouterr().out
  assert not launcher.finished_run(exp, other)
  out = capsys.readouterr().out
  assert f"{other} was trained by fp4jax 0.0.9 (commit e39efc4000" in out
  assert "training it again (the old run is kept in" in out and "--keep_other_code" in out
  assert not other.exists() and len(list(tmp_path.glob("other.other-code-*/checkpoints/3"))) == 1
  assert not launcher.finished_run(exp, old)
  assert "was trained by code that was not recorded" in capsys.readouterr().out
