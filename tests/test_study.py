"""experiments.study: the arm table, the gap arithmetic, a two-arm study with --collect and reuse;
the LoRA-SVD branch's learning-rate scale (Recipe.lora_lr_scale) in the optimizer."""

import dataclasses
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import study as st
from experiments import compare
from experiments import evaluate as ev
from experiments.configs import tiny
from experiments.configs._base import dataclass_config
from experiments.studies import Arm
from fp4jax import data
from fp4jax import price
from fp4jax.experiment import Experiment
from fp4jax.recipe import MODULES, PRESETS, get_recipe, preset_changes
from fp4jax.train import OptimizerConfig, _lora_mask, abstract_model, make_optimizer, make_schedule


def test_every_arm_builds_a_valid_experiment():
  cfg = tiny.get_config()
  exp = Experiment.from_config(cfg)
  assert len(set(st.ARM_NAMES)) == len(st.ARMS)
  for arm in st.ARMS:
    e = st.arm_experiment(exp, arm)
    for k in MODULES:
      assert getattr(e.recipe, k) == arm.changes.get(f"recipe.{k}", getattr(PRESETS[arm.preset], k)), arm.name
    for key, v in arm.changes.items():
      node = {"recipe": e.recipe, "optimizer": e.optimizer}[key.split(".")[0]]
      for part in key.split(".")[1:]:
        node = getattr(node, part)
      if key != "recipe.lora_resplit_every":
        assert node == (tuple(v) if isinstance(v, list) else v), (arm.name, key)
    assert e.train.seed == arm.seed and e.train.telemetry_every == cfg.steps // 10
    assert arm.baseline in (None, *st.ARM_NAMES), arm.name
    assert arm.what and arm.group
  assert [a.seed for a in st.ARMS if a.baseline is None] == [0, 1, 2]
  resplit = st.arm_experiment(exp, st.select_arms("lorasvd_resplit10")[0])
  assert resplit.recipe.lora_resplit_every == cfg.steps // 10
  assert st.arm_experiment(exp, st.ARMS[0], telemetry=False).train.telemetry_every == 0


def _config_with(cfg, arm: Arm):
  """The arm's config as ``--config.<key>`` flags would make it: the ConfigDict set field by field."""
  c = cfg.copy_and_resolve_references()
  for k, v in preset_changes(arm.preset).items():  # a preset's own op config is a section
    c.recipe[k] = dataclass_config(v) if dataclasses.is_dataclass(v) else v
  for key, value in arm.changes.items():
    *path, leaf = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[leaf] = max(1, c.steps // -value) if key == "recipe.lora_resplit_every" and value < 0 else value
  c.seed = arm.seed
  return c


def test_an_arm_of_the_experiment_equals_the_arm_typed_from_its_config():
  """``Arm.apply`` on the typed experiment gives what typing the arm's config gives, field for field
  and type for type (an int for a float field becomes a float, a list a tuple), for every arm."""
  cfg = tiny.get_config()
  exp = Experiment.from_config(cfg)
  extra = (Arm("ints", "fp4_linear", {"recipe.lora_lr_scale": 4, "optimizer.learning_rate": 1}),
           Arm("list", "bf16", {"mesh_shape": [1, 1, 1], "eval_every": 7}, 2))
  for arm in (*st.ARMS, *extra):
    mine, typed = arm.apply(exp), Experiment.from_config(_config_with(cfg, arm))
    assert mine == typed, arm.name
    assert json.dumps(mine.to_config()) == json.dumps(typed.to_config()), arm.name


def test_a_preset_of_its_own_matmul_and_the_schedule_arms_type_as_their_config(monkeypatch):
  """A preset that sets its own ``matmul`` (not only the modules) applies whole in an arm, and the
  arm equals its config set flag by flag; so do the BF16-forward tail and the down-input override."""
  mine = get_recipe("fp4_linear", matmul={"x": {"scale_rule": "4over6_mse"}, "w": {"scale_rule": "4over6_mse"}})
  monkeypatch.setitem(PRESETS, "fp4_linear_4over6", mine)
  cfg = tiny.get_config()
  exp = Experiment.from_config(cfg)
  arm = Arm("m", "fp4_linear_4over6", {"recipe.matmul.x.terms": 2, "recipe.down_x.format": "bf16",
                                       "recipe.bf16_fwd_last": 0.1})
  assert arm.apply(exp) == Experiment.from_config(_config_with(cfg, arm))
  assert arm.apply(exp).recipe == mine.replace(matmul={"x": {"terms": 2}}, down_x={"format": "bf16"},
                                               bf16_fwd_last=0.1)


def test_an_arm_is_a_function_of_the_experiment():
  exp = Experiment.from_config(tiny.get_config())
  arm = Arm("x", "fp4_linear", {"recipe.lora_rank": 4, "optimizer.name": "muon", "steps": 7}, 3, "fp4_linear",
            "test")
  e = arm.apply(exp)
  assert (e.recipe.linear, e.recipe.lora_rank, e.optimizer.name, e.train.seed, e.train.steps) == (
      "nvfp4", 4, "muon", 3, 7)
  assert (exp.recipe.linear, exp.recipe.lora_rank, exp.optimizer.name, exp.train.seed) == ("bf16", 16, "adamw", 0)
  assert arm.recipe_text() == "fp4_linear, recipe.lora_rank=4, optimizer.name=muon, steps=7"
  with pytest.raises(ValueError, match=r"arm y: changes key 'recipe.lora_rnk' is not a field"):
    Arm("y", "bf16", {"recipe.lora_rnk": 4}).apply(exp)
  with pytest.raises(ValueError, match=r"arm y: changes key 'recipe.nope.x' is not a field"):
    Arm("y", "bf16", {"recipe.nope.x": 1}).apply(exp)
  for key in ("study.eval_tokens", "train.seed", "data_info"):  # not keys of the config's root
    with pytest.raises(ValueError, match=rf"arm y: changes key '{key}' is not a field"):
      Arm("y", "bf16", {key: 1}).apply(exp)
  with pytest.raises(ValueError, match=r"arm y: changes recipe.lora_rank='4': expected a value of type int"):
    Arm("y", "bf16", {"recipe.lora_rank": "4"}).apply(exp)
  with pytest.raises(ValueError, match=r"arm y: changes recipe.matmul.hadamard=1: expected a value of type bool"):
    Arm("y", "bf16", {"recipe.matmul.hadamard": 1}).apply(exp)
  with pytest.raises(ValueError, match=r"arm y: .*lora_rank=-1"):
    Arm("y", "bf16", {"recipe.lora_rank": -1}).apply(exp)
  with pytest.raises(ValueError, match=r"arm y: preset 'fp3'"):
    Arm("y", "fp3").apply(exp)


def test_select_arms():
  assert [a.name for a in st.select_arms("all")] == list(st.ARM_NAMES)
  # The order of ARMS, whatever the order of the flag.
  assert [a.name for a in st.select_arms("fp4_linear,bf16_s1")] == ["bf16_s1", "fp4_linear"]
  with pytest.raises(ValueError, match=r"unknown arm\(s\) \['nope'\].*fp4_full_stack.*--list"):
    st.select_arms("fp4_linear,nope")
  with pytest.raises(ValueError, match="distinct"):
    st.select_arms("fp4_linear,fp4_linear")


@pytest.mark.slow
def test_cli_errors(tmp_path):
  repo = st.Path(st.__file__).parents[1]

  def run(*args):
    cmd = [sys.executable, "-m", "experiments.study", f"--workdir={tmp_path / 's'}", *args]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)

  r = run("--config=experiments/configs/tiny.py", "--arms=fp4,bf16_s0")
  assert r.returncode == 1 and r.stderr.startswith("error: --arms=fp4,bf16_s0: unknown arm(s) ['fp4']")
  assert all(a in r.stderr for a in st.ARM_NAMES)
  r = run(f"--config={tmp_path / 'nope.py'}", "--arms=all")
  assert r.returncode == 1 and "nope.py" in r.stderr and "No such file" in r.stderr
  # An override of a field the config does not have: one line (no traceback) naming the flag.
  r = run("--config=experiments/configs/tiny.py", "--config.optimizer.lr=1", "--config.model.d_modl=3",
          "--arms=bf16_s0")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.strip() == ("FATAL Flags parsing error: flag --config.optimizer.lr: config.optimizer has no "
                              "field 'lr'; its fields: b1, b2, decay_fraction, eps, grad_clip, learning_rate, "
                              "min_lr_ratio, name, schedule, warmup_steps, weight_decay")
  r = run("--config=experiments/configs/tiny.py", "--config.model.d_modl=3", "--arms=bf16_s0")
  assert r.returncode == 1 and "flag --config.model.d_modl: config.model has no field 'd_modl'; did you " \
      "mean 'd_model'?; its fields: d_ff, d_model," in r.stderr, r.stderr
  # A config file that refuses its argument (a grid point that is not one): its error's line alone.
  r = run("--config=experiments/configs/grid.py:m99", "--arms=bf16_s0")
  assert r.returncode == 1 and r.stderr.strip() == (
      "FATAL Flags parsing error: flag --config=experiments/configs/grid.py:m99: grid.py:m99: name a grid point "
      "after ':' (grid.py:m25 or grid.py:m25,fp4_linear); the points are s10, s25, s50, m10, m25, m45, l10, l25"), \
      r.stderr
  assert not (tmp_path / "s").exists()


def _row(arm, loss, reference=False, status="ok", baseline=None, comparable=True, batches=None):
  ok = status == "ok"
  return {"arm": arm, "status": status, "reference": reference, "baseline": baseline,
          "recipe": "fp4_linear, recipe.lora_rank=4", "eval_step": 3 if ok else None,
          "eval_tokens": 256 if ok else 0, "eval_text": "shakespeare" if ok else None,
          "eval_max_tokens": 256 if ok else None, "comparable": ok and comparable,
          "eval_batch_losses": batches, "eval_batch_windows": None if batches is None else [4] * len(batches),
          "eval_loss_se": math.nan if batches is None else statistics.stdev(batches) / math.sqrt(len(batches)),
          "seed": 0, "eval_loss": loss, "train_loss": loss + 0.1,
          "tokens": 1000, "params": 10, "tokens_per_s": 5.0, "epochs": 0.5, "step_time_s": 0.2}


def test_seed_summary_holds_each_recipe_against_the_noise_floor():
  """One line per recipe over its seeds: their gaps, the mean paired gap to the baselines and a verdict
  against the reference's seed spread (here 0.50% of 2.0): inside it none, beyond it lower or higher."""
  def row(arm, loss, recipe, baseline=None, reference=False):
    return {**_row(arm, loss, reference=reference, baseline=baseline), "recipe": recipe}
  rows = [row("bf16_s0", 2.00, "bf16", reference=True), row("bf16_s1", 2.01, "bf16", reference=True),
          row("a", 2.10, "fp4", "bf16_s0"), row("a_s1", 2.12, "fp4", "bf16_s1"),
          row("b", 2.095, "fp4, x", "a"), row("b_s1", 2.125, "fp4, x", "a_s1"),  # -0.24 and +0.24 points
          row("c", 2.05, "fp4, y", "a"), row("c_s1", 2.08, "fp4, y", "a_s1"),  # -2.4 and -1.9 points
          row("d", 2.20, "fp4, z", "a")]
  floor = compare.add_gaps(rows)
  assert floor["spread_pct"] == pytest.approx(100 * 0.01 / 2.005)
  lines = {line.split(" | ")[0][2:]: line for line in compare.seed_summary(rows, floor).splitlines()
           if line.startswith("| ") and not line.startswith("| recipe")}
  assert lines["bf16"].endswith("| reference |")
  assert lines["fp4"].startswith("| fp4 | a, a_s1 | +4.74, +5.74 | +5.24 | +5.00 (bf16_s0), +5.47 (bf16_s1) | "
                                 "+5.24 | higher |"), lines["fp4"]
  assert lines["fp4, x"].endswith("| -0.24 (a), +0.24 (a_s1) | -0.00 | none |"), lines["fp4, x"]
  assert lines["fp4, y"].endswith("| lower |") and lines["fp4, z"].endswith("| +4.76 (a) | +4.76 | one seed |")


def test_a_damaged_eval_json_of_a_collected_arm_is_named(tmp_path):
  """Reading a collected folder (no checkpoint to evaluate again), a damaged ``eval.json`` stops the table
  with the file named and the fix, not a bare decoder error."""
  from fp4jax.experiment import Experiment
  (tmp_path / "bf16_s0").mkdir()
  (tmp_path / "bf16_s0" / st.EVAL_FILE).write_text("{x")
  with pytest.raises(ValueError, match=f"{tmp_path / 'bf16_s0' / st.EVAL_FILE} is damaged .*put back a copy"):
    st.arm_row(Experiment.from_config(tiny.get_config()), st.select_arms("bf16_s0")[0], tmp_path)


def test_standard_error_over_batches():
  x = [2.0, 2.5, 1.5, 2.2]
  assert ev.standard_error(x, [8] * 4) == pytest.approx(statistics.stdev(x) / 2)
  # A last partial batch weighs by its windows: the mean is the windows' mean.
  w = [8, 8, 8, 2]
  mean = sum(a * b for a, b in zip(x, w, strict=True)) / sum(w)
  assert ev.standard_error(x, w) == pytest.approx(
      math.sqrt(4 / 3 * sum((b * (a - mean)) ** 2 for a, b in zip(x, w, strict=True))) / sum(w))
  assert math.isnan(ev.standard_error([2.0], [8]))


def test_gaps_against_the_reference_mean_and_their_spread():
  ref = [2.0, 2.1, 2.3]
  rows = [_row(f"bf16_s{i}", v, True) for i, v in enumerate(ref)]
  rows += [_row("fp4_linear", 2.2, baseline="bf16_s1"), _row("fp4_full_stack", math.nan, status="diverged")]
  floor = compare.add_gaps(rows)
  mean = sum(ref) / 3
  assert floor["n"] == 3 and floor["mean"] == pytest.approx(mean) and floor["arms"] == ["bf16_s0", "bf16_s1", "bf16_s2"]
  assert (floor["min"], floor["max"]) == (2.0, 2.3)
  assert floor["spread_pct"] == pytest.approx(100 * 0.3 / mean)
  assert floor["std_pct"] == pytest.approx(100 * statistics.stdev(ref) / mean)
  assert rows[3]["gap_pct"] == pytest.approx(100 * (2.2 - mean) / mean)
  assert sum(r["gap_pct"] for r in rows[:3]) == pytest.approx(0, abs=1e-9)
  assert math.isnan(rows[4]["gap_pct"])
  assert rows[3]["baseline_gap_pct"] == pytest.approx(100 * (2.2 - 2.1) / 2.1)
  assert math.isnan(rows[0]["baseline_gap_pct"]) and math.isnan(rows[3]["gap_se_pct"])
  text = compare.table(rows, floor)
  assert f"spread {100 * 0.3 / mean:.2f}%" in text and "Reference (bf16_s0, bf16_s1, bf16_s2)" in text
  assert (f"| fp4_linear | fp4_linear, recipe.lora_rank=4 | 0 | 2.2000 | 3 | 256 | "
          f"{100 * (2.2 - mean) / mean:+.2f} | {100 * 0.1 / 2.1:+.2f} (bf16_s1) |") in text
  assert "| fp4_full_stack | fp4_linear, recipe.lora_rank=4 | 0 | diverged | – | – | – | – |" in text
  # A row evaluated otherwise (another size, step or corpus) has no gap and is not in the floor.
  rows = [_row(f"bf16_s{i}", v, True) for i, v in enumerate(ref)]
  rows += [_row("bf16_s9", 9.0, True, comparable=False),
           _row("fp4_linear", 2.2, baseline="bf16_s9", comparable=False)]
  floor = compare.add_gaps(rows)
  assert floor["n"] == 3 and floor["mean"] == pytest.approx(mean)
  assert math.isnan(rows[4]["gap_pct"]) and math.isnan(rows[4]["baseline_gap_pct"])
  text = compare.table(rows, floor)
  assert "| fp4_linear | fp4_linear, recipe.lora_rank=4 | 0 | 2.2000 | 3 | 256 | not compared ‡ | – |" in text
  assert "‡ evaluated at another step" in text
  # Without a finished reference there are no gaps.
  rows = [_row("fp4_linear", 2.2)]
  assert compare.add_gaps(rows) == {"n": 0} and math.isnan(rows[0]["gap_pct"])
  assert "no reference run" in compare.table(rows, {"n": 0})


def test_gaps_carry_the_paired_standard_error_of_the_same_batches():
  a, b = [2.0, 3.0, 2.5, 2.1], [2.1, 3.0, 2.7, 2.1]
  rows = [_row("bf16", sum(a) / 4, True, batches=a), _row("fp4", sum(b) / 4, baseline="bf16", batches=b),
          _row("other", 2.4, baseline="bf16")]
  floor = compare.add_gaps(rows)
  se = statistics.stdev([y - x for x, y in zip(a, b, strict=True)]) / 2
  assert rows[1]["gap_se_pct"] == pytest.approx(100 * se / floor["mean"])
  assert rows[1]["baseline_gap_se_pct"] == pytest.approx(rows[1]["gap_se_pct"])
  # The batches differ much more than the two runs do on each: the gap is known far better than
  # either loss.
  assert rows[1]["gap_se_pct"] < 100 * rows[1]["eval_loss_se"] / floor["mean"] / 3
  assert math.isnan(rows[2]["gap_se_pct"])  # its batches are not known
  text = compare.table(rows, floor)
  assert "Reference (bf16): eval loss 2.4000, one seed" in text
  assert (f"| fp4 | fp4_linear, recipe.lora_rank=4 | 0 | 2.4750 ± {rows[1]['eval_loss_se']:.4f} | 3 | 256 | "
          f"{rows[1]['gap_pct']:+.2f} ± {rows[1]['gap_se_pct']:.2f} | {rows[1]['gap_pct']:+.2f} ± "
          f"{rows[1]['gap_se_pct']:.2f} (bf16) |") in text
  assert "A gap within about twice its ± is not resolved" in text


def _small_config(steps=3):
  cfg = tiny.get_config()
  cfg.update(steps=steps, batch_size=4, seq_len=32, eval_batches=1, checkpoint_every=0,
             mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  cfg.execution.cross_entropy = "xla"
  cfg.model.update(d_model=32, n_layers=1, n_heads=2)
  return cfg


def test_a_study_recorded_with_the_resplit_choices_under_the_optimizer(tmp_path):
  """A study.json recorded when ``lora_resplit_moments``/``_svd`` were optimizer fields is the same
  study; a different choice there is refused, named as the recipe's field."""
  cfg = _small_config()
  st.check_workdir(cfg, tmp_path)
  path = tmp_path / st.STUDY_FILE
  recorded = json.loads(path.read_text())
  for field in ("lora_resplit_moments", "lora_resplit_svd"):
    recorded["config"]["optimizer"][field] = recorded["config"]["recipe"].pop(field)
  path.write_text(json.dumps(recorded))
  st.check_workdir(cfg, tmp_path)
  recorded["config"]["optimizer"]["lora_resplit_moments"] = "aligned"
  path.write_text(json.dumps(recorded))
  with pytest.raises(ValueError, match="recipe.lora_resplit_moments: study 'aligned', this command 'keep'"):
    st.check_workdir(cfg, tmp_path)


@pytest.mark.slow
def test_two_arms_collect_and_reuse(tmp_path, capsys, monkeypatch):
  # The study types its config once and prepares the (shared) data once, however many arms.
  calls = []
  typed, prepare = Experiment.from_config.__func__, data.prepare
  monkeypatch.setattr(Experiment, "from_config",
                      classmethod(lambda cls, cfg: calls.append("typed") or typed(cls, cfg)))
  monkeypatch.setattr(data, "prepare", lambda *a, **k: calls.append("prepared") or prepare(*a, **k))
  cfg = _small_config()
  work, dest = tmp_path / "study", tmp_path / "results"
  rows = st.study(cfg, work, "bf16_s0,bf16_s1", eval_tokens=256, collect_to=dest, telemetry=False)
  assert calls == ["typed", "prepared"]
  out = capsys.readouterr().out
  assert "=== arm bf16_s0 (1/2)" in out and "=== arm bf16_s1: trained" in out
  assert [r["arm"] for r in rows] == ["bf16_s0", "bf16_s1"]
  evals = [json.loads((work / a / st.EVAL_FILE).read_text()) for a in ("bf16_s0", "bf16_s1")]
  assert all(e["step"] == 3 and e["split"] == "validation" and e["tokens"] == 256 for e in evals)
  assert evals[0]["loss"] != evals[1]["loss"]  # two seeds
  mean = (evals[0]["loss"] + evals[1]["loss"]) / 2
  lines = [json.loads(x) for x in (dest / st.ROWS_FILE).read_text().splitlines()]
  assert [r["arm"] for r in lines] == ["bf16_s0", "bf16_s1"]
  for r, e in zip(lines, evals, strict=True):
    assert r["eval_loss"] == e["loss"] and r["gap_pct"] == pytest.approx(100 * (e["loss"] - mean) / mean)
    assert r["tokens"] == 3 * 4 * 32 and r["seed"] == int(r["arm"][-1]) and r["params"] > 0
    assert r["price"] == 1.0  # fp4jax.price of the bf16 recipe
    assert r["noise_floor"]["n"] == 2 and r["epochs"] > 0 and r["step_time_s"] > 0
  table = (dest / st.TABLE_FILE).read_text()
  assert f"mean eval loss {mean:.4f} over 2 seed(s)" in table
  assert table.count("| bf16_s") == 2
  summary = (dest / st.SUMMARY_FILE).read_text()  # collected, and printed after the table
  assert "| bf16 | bf16_s0, bf16_s1 |" in summary and summary.strip().endswith("| reference |")
  assert out.index(summary.splitlines()[0]) > out.index(f"mean eval loss {mean:.4f}")
  for arm in ("bf16_s0", "bf16_s1"):
    assert sorted(p.name for p in (dest / arm).iterdir()) == sorted(set(st.ARM_LOGS) - {st.SHARED_FILE})
  assert (dest / st.STUDY_FILE).is_file()
  # The collected folder is read without the data it was trained on (copied to another machine).
  data_dir = Path(json.loads((dest / "bf16_s0" / "config.json").read_text())["data_dir"])
  data_dir.rename(data_dir.with_name("moved"))
  try:
    again, _ = st.write_results(Experiment.from_config(cfg), dest, 256)
  finally:
    data_dir.with_name("moved").rename(data_dir)
  assert [(r["eval_loss"], r["epochs"], r["gap_pct"]) for r in again] == \
      [(r["eval_loss"], r["epochs"], r["gap_pct"]) for r in lines]

  # A finished arm is reused (not trained again); a study of another config is refused.
  before = (work / "bf16_s0" / "metrics.jsonl").read_text()
  calls.clear()
  again = st.study(cfg, work, "bf16_s0", eval_tokens=256, telemetry=False)
  assert calls == ["typed", "prepared"]
  assert "=== arm bf16_s0: reused" in capsys.readouterr().out
  assert (work / "bf16_s0" / "metrics.jsonl").read_text() == before
  assert [r["eval_loss"] for r in again] == [e["loss"] for e in evals]
  with pytest.raises(ValueError, match="another config.*steps: study 3, this command 4"):
    st.study(_small_config(steps=4), work, "bf16_s0", telemetry=False)
  # A field the recorded study lacks (added to the code since) is not compared.
  recorded = json.loads((work / st.STUDY_FILE).read_text())
  del recorded["config"]["recipe"]["lora_lr_scale"]
  (work / st.STUDY_FILE).write_text(json.dumps(recorded))
  st.check_workdir(cfg, work)


def test_other_texts_are_named_once_and_checked_before_training(tmp_path):
  """``study.eval_also``: each other text named once, not the study's corpus, its text here; each
  gets its own file in the run folder (``eval_file``)."""
  import ml_collections
  text = tmp_path / "prose notes"
  text.mkdir()
  cfg = _small_config()
  assert st.eval_texts(cfg) == ()  # none by default
  cfg.study = ml_collections.ConfigDict({"eval_also": f" {text}, shakespeare "})
  cfg.data.corpus = str(tmp_path / "code")
  assert st.eval_texts(cfg) == (str(text), "shakespeare")
  assert ev.eval_file(str(text)) == "eval_prose_notes.json" and ev.eval_file("mix") == "eval_mix.json"
  assert ev.eval_file() == ev.EVAL_FILE == "eval.json"
  assert st.other_files("mix") == ("table_mix.md", "summary_mix.md")
  # A later command of the same study may evaluate on other texts: not another study.
  work = tmp_path / "study"
  cfg.study.eval_also = "shakespeare"
  st.check_workdir(cfg, work)
  cfg.study.eval_also = str(text)
  st.check_workdir(cfg, work)
  for also, match in ((f"{text},{text}", "is named twice"), (str(tmp_path / "code"), "the study's own corpus"),
                      (str(tmp_path / "gone"), "its text is not on this machine")):
    cfg.study.eval_also = also
    with pytest.raises(ValueError, match=f"study.eval_also=.*{match}"):
      st.eval_texts(cfg)


@pytest.mark.slow
def test_arms_evaluated_on_another_text_get_its_table(tmp_path, capsys):
  """An arm is evaluated on each ``study.eval_also`` text too (its ``eval_<name>.json``, the same
  held-out tokens), and the study writes, prints and collects that text's table and summary."""
  import ml_collections
  from conftest import write_pydoc_text
  prose = write_pydoc_text(tmp_path / "prose", n_docs=30)
  cfg = _small_config()
  cfg.study = ml_collections.ConfigDict({"eval_also": str(prose)})
  work, dest = tmp_path / "study", tmp_path / "results"
  st.study(cfg, work, "bf16_s0,bf16_s1", eval_tokens=128, collect_to=dest, telemetry=False)
  out = capsys.readouterr().out
  for arm in ("bf16_s0", "bf16_s1"):
    own = json.loads((work / arm / ev.EVAL_FILE).read_text())
    other = json.loads((work / arm / "eval_prose.json").read_text())
    assert own["text"] == cfg.data.corpus and other["text"] == str(prose)
    assert other["tokens"] == own["tokens"] == 128 and other["step"] == own["step"] == 3
    assert other["loss"] != own["loss"] and math.isfinite(other["loss"])
    assert (dest / arm / "eval_prose.json").read_text() == (work / arm / "eval_prose.json").read_text()
  losses = [json.loads((work / a / "eval_prose.json").read_text())["loss"] for a in ("bf16_s0", "bf16_s1")]
  mean = sum(losses) / 2
  table = (dest / "table_prose.md").read_text()
  assert f"evaluated on the first 128 held-out tokens of another text: {prose}" in table
  assert f"mean eval loss {mean:.4f} over 2 seed(s)" in table and table.count("| bf16_s") == 2
  assert (dest / "summary_prose.md").read_text().strip().endswith("| reference |")
  assert table.strip() in out
  # Rewritten from the collected folder alone: the same table.
  st.write_results(Experiment.from_config(cfg), dest, 128)
  assert (dest / "table_prose.md").read_text() == table


def test_child_command_keeps_the_flags_but_arms_parallel_and_collect():
  argv = ["--config=c.py", "--config.steps=3", "--arms", "a,b", "--parallel=2", "--collect", "out",
          "--workdir=w", "--notelemetry"]
  assert st.child_command(argv, "bf16_s1")[1:] == [
      "-m", "experiments.study", "--config=c.py", "--config.steps=3", "--workdir=w", "--notelemetry",
      "--arms=bf16_s1"]


@pytest.mark.slow
def test_parallel_arms_train_in_processes_of_their_own(tmp_path):
  repo = st.Path(st.__file__).parents[1]
  work, dest = tmp_path / "study", tmp_path / "results"
  cmd = [sys.executable, "-m", "experiments.study", "--config=experiments/configs/tiny.py",
         f"--workdir={work}", "--arms=bf16_s0,bf16_s1", "--parallel=2", f"--collect={dest}",
         "--eval_tokens=256", "--notelemetry", "--compilation_cache=", "--config.steps=3",
         "--config.batch_size=4", "--config.seq_len=32", "--config.eval_batches=1",
         "--config.checkpoint_every=0", "--config.progress=False", "--config.tensorboard=False",
         "--config.execution.cross_entropy=xla", "--config.model.d_model=32", "--config.model.n_layers=1",
         "--config.model.n_heads=2", "--config.mesh_shape=(1,1,1)"]
  r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  for arm in ("bf16_s0", "bf16_s1"):
    assert f"=== arm {arm}: started" in r.stdout and f"=== arm {arm}: done" in r.stdout
    assert "=== arm" in (work / "logs" / f"{arm}.log").read_text()  # the arm's own process
    assert json.loads((work / arm / st.SHARED_FILE).read_text()) == {"parallel": 2}
    assert (dest / arm / st.SHARED_FILE).is_file()
    assert (dest / arm / st.PROCESS_LOG).read_text() == (work / "logs" / f"{arm}.log").read_text()
  rows = [json.loads(x) for x in (dest / st.ROWS_FILE).read_text().splitlines()]
  assert [(r["arm"], r["shared_device"]) for r in rows] == [("bf16_s0", 2), ("bf16_s1", 2)]
  assert rows[0]["eval_loss"] != rows[1]["eval_loss"]
  table = (dest / st.TABLE_FILE).read_text()
  assert table.count(" † |") == 4 and "† trained with up to 2 arms at once" in table

  # An arm whose process fails is named, with its log, after the table of the others.
  bad = [c for c in cmd if not c.startswith(("--collect", "--workdir"))]
  bad += [f"--workdir={tmp_path / 'bad'}", f"--config.data.corpus={tmp_path / 'no_such_text'}"]
  r = subprocess.run(bad, cwd=repo, capture_output=True, text=True, timeout=600)
  assert r.returncode == 1, r.stderr[-2000:]
  assert "=== arm bf16_s0: FAILED" in r.stdout and "no_such_text" in r.stdout
  assert r.stderr.startswith("error: arm(s) bf16_s0, bf16_s1 failed") or \
      r.stderr.startswith("error: arm(s) bf16_s1, bf16_s0 failed")
  assert "no_such_text" in (tmp_path / "bad" / "logs" / "bf16_s0.log").read_text()


def _toy_params():
  k = jax.random.split(jax.random.key(0), 4)
  return {"blocks": {0: {"qkv": {"kernel": jax.random.normal(k[0], (16, 32)),
                                 "lora_a": jax.random.normal(k[1], (16, 4)),
                                 "lora_b": jax.random.normal(k[2], (4, 32))}}},
          "norm": {"scale": jnp.ones(16)}, "embed": {"embedding": jax.random.normal(k[3], (8, 16))}}


def _updates(tx, params, steps=3):
  state, out, update = tx.init(params), None, tx.update
  for i in range(steps):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), params)
    out, state = update(grads, state, params)
  return out


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_lora_lr_scale(opt):
  cfg = OptimizerConfig(name=opt, learning_rate=1e-2, warmup_steps=0)
  params = _toy_params()
  is_lora = _lora_mask(params)
  assert sorted(jax.tree.leaves(jax.tree.map(int, is_lora))) == [0, 0, 0, 1, 1]
  base = _updates(make_optimizer(cfg, get_recipe("fp4_linear", linear="nvfp4_lorasvd"), 10), params)
  if opt == "adamw":  # 1.0 is the plain optimizer: clip + optax.adamw, bit for bit
    plain = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                        optax.adamw(make_schedule(cfg, 10), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay,
                                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    jax.tree.map(np.testing.assert_array_equal, base, _updates(plain, params))
  for scale in (0.0, 0.5):
    tx = make_optimizer(cfg, get_recipe("fp4_linear", linear="nvfp4_lorasvd", lora_lr_scale=scale), 10)
    got = _updates(tx, params)
    jax.tree.map(lambda g, b, m, s=scale: np.testing.assert_allclose(g, b * s if m else b, rtol=1e-6),
                 got, base, is_lora)
  frozen = get_recipe("fp4_linear", linear="nvfp4_lorasvd", lora_lr_scale=0.0)
  new = optax.apply_updates(params, _updates(make_optimizer(cfg, frozen, 10), params))
  np.testing.assert_array_equal(new["blocks"][0]["qkv"]["lora_a"], params["blocks"][0]["qkv"]["lora_a"])
  assert not np.array_equal(new["blocks"][0]["qkv"]["kernel"], params["blocks"][0]["qkv"]["kernel"])


def test_lora_mask_finds_every_branch_of_the_model():
  cfg = tiny.get_config()
  exp = Experiment.from_config(cfg).with_changes({"model.vocab_size": 256})
  recipe = exp.recipe
  _, params = abstract_model(exp.model, get_recipe("fp4_linear_lorasvd"))
  paths = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(_lora_mask(params)) if m]
  projections = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
                 if "kernel" in jax.tree_util.keystr(p) and "blocks" in jax.tree_util.keystr(p)]
  assert len(paths) == 2 * len(projections) > 0
  assert all("lora_a" in p or "lora_b" in p for p in paths)
  with pytest.raises(ValueError, match="lora_lr_scale"):
    recipe.replace(lora_lr_scale=-1.0)


def test_list_prints_every_arm_and_study_md_points_to_it():
  text = st.list_arms()
  for arm in st.ARMS:
    changes = ", ".join(f"`{k}={v}`" for k, v in arm.changes.items()) or "—"
    assert f"| `{arm.name}` | `{arm.preset}` | {changes} | {arm.seed} |" in text
  md = (st.Path(st.__file__).parent / "STUDY.md").read_text()
  assert "python -m experiments.study --list" in md
  # The arms are not copied there: no per-arm table to drift.
  assert "`q_fwd_w`" not in md and "`lorasvd_rank32`" not in md


def test_an_arm_row_is_priced_by_the_arms_recipe(tmp_path, monkeypatch):
  # The row of an arm describes the arm's experiment (recipe, seed), not the study's base config.
  arm = next(a for a in st.ARMS if a.name == "fp4_linear_s1")
  (tmp_path / arm.name).mkdir()
  (tmp_path / arm.name / st.EVAL_FILE).write_text("{}")
  seen = {}
  monkeypatch.setattr(st, "run_row", lambda exp, *a, **k: seen.update(exp=exp) or {})
  st.arm_row(Experiment.from_config(_small_config()), arm, tmp_path)
  assert seen["exp"].recipe.linear == "nvfp4" and seen["exp"].train.seed == 1
  assert price.price(seen["exp"].recipe, seen["exp"].model, seen["exp"].train.steps) == 0.25
