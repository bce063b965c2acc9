"""experiments.scaling: the law's fit, the efficiencies, their bootstrap; the grid configs."""

import dataclasses
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import scaling
from experiments.configs import grid
from fp4jax.experiment import Experiment

# Quartet's C4 fit (its notebook's printed constants).
TRUE = scaling.Law(A=127444.7, alpha=0.5785, B=465834.3, beta=0.5389, E=1.3408, gamma=0.2764)
EFFS = {"fp4_linear": (0.8, 0.9), "fp4_full_stack": (0.65, 0.95)}


def _nd(point):
  c = grid.get_config(point)
  return grid.num_params(point[0]), c.steps * c.batch_size * c.seq_len


def synthetic(noise=0.0, seed=0, recipe_points=grid.POINTS):
  """bf16 at every grid point (three seeds at m25), the recipes at ``recipe_points``; log-normal noise."""
  rng = np.random.default_rng(seed)
  out = []
  for point in grid.POINTS:
    n, d = _nd(point)
    for s in range(3 if point == "m25" else 1):
      out.append(scaling.Point("bf16", True, n, d, float(TRUE.loss(n, d)) * math.exp(rng.normal(0, noise)), s))
    if point in recipe_points:
      for name, (en, ed) in EFFS.items():
        loss = float(TRUE.loss(n, d, en, ed)) * math.exp(rng.normal(0, noise))
        out.append(scaling.Point(name, False, n, d, loss, 0))
  return out


def test_law_and_its_derivatives():
  theta = TRUE.theta() + 0.01
  n, d = np.array([1e7, 2e7]), np.array([3e8, 5e8])
  loss, grad = scaling._law_and_grad(theta, n, d, 0.8, 0.9)
  np.testing.assert_allclose(loss, scaling.law_loss(theta, n, d, 0.8, 0.9), rtol=1e-12)
  a, alpha, b, beta, e, gamma = theta
  direct = (math.exp(a) / (n * 0.8) ** alpha + math.exp(b) / (d * 0.9) ** beta) ** gamma + math.exp(e)
  np.testing.assert_allclose(loss, direct, rtol=1e-12)
  for i in range(6):
    step = np.eye(6)[i] * 1e-6
    num = (scaling.law_loss(theta + step, n, d, 0.8, 0.9) - scaling.law_loss(theta - step, n, d, 0.8, 0.9)) / 2e-6
    np.testing.assert_allclose(grad[:, i], num, rtol=1e-5)
  assert scaling.gap_pct(TRUE, 1.0, 1.0) == 0.0
  assert scaling.gap_pct(TRUE, 0.9, 1.0) > 0 and scaling.gap_pct(TRUE, 1.0, 0.9) > 0


def test_exact_losses_give_back_the_law_and_the_efficiencies():
  points = synthetic()
  f = scaling.fit(points, bootstrap=0)
  for n, d in [(1e7, 3e8), (3e9, 64e9)]:
    assert f.law.loss(n, d) == pytest.approx(TRUE.loss(n, d), rel=1e-3)
  for r in f.recipes:
    en, ed = EFFS[r.recipe]
    assert (r.eff_n, r.eff_d) == pytest.approx((en, ed), abs=2e-3)
    assert r.gap_pct == pytest.approx(scaling.gap_pct(TRUE, en, ed), abs=0.02)
    assert r.arms == r.points == 8
  assert f.rms_log_residual < 1e-5


def test_noisy_losses_recover_the_efficiencies_and_the_interval_covers_them():
  points = synthetic(noise=1e-3, seed=1)
  f = scaling.fit(points, bootstrap=50, seed=0)
  assert f.replicates == 50
  for r in f.recipes:
    en, ed = EFFS[r.recipe]
    assert abs(r.eff_n - en) < 0.06 and abs(r.eff_d - ed) < 0.06, r
    assert r.eff_n_ci[0] <= en <= r.eff_n_ci[1], r
    assert r.eff_d_ci[0] <= ed <= r.eff_d_ci[1], r
    true_gap = scaling.gap_pct(TRUE, en, ed)
    assert r.gap_pct_ci[0] <= true_gap <= r.gap_pct_ci[1], (r, true_gap)
    assert r.eff_n_ci[0] < r.eff_n < r.eff_n_ci[1]  # an interval, not a point
  assert set(f.law_ci) == set(scaling.LAW_PARAMS)


def test_too_few_points_are_named():
  bf16 = [p for p in synthetic() if p.reference and p.n != grid.num_params("l") and p.d != _nd("m10")[1]]
  with pytest.raises(ValueError, match=r"7 distinct \(N, D\) points .* it has 5: .*fit_fixed"):
    scaling.fit(bf16, bootstrap=0)
  one_size = [p for p in synthetic() if p.reference and p.n == grid.num_params("m")]
  with pytest.raises(ValueError, match="two model sizes N to fit alpha"):
    scaling.fit_law(one_size, fixed={"gamma": 0.2764, "A": 1e5, "B": 4e5})
  with pytest.raises(ValueError, match="no bf16 reference arms"):
    scaling.fit([p for p in synthetic() if not p.reference])
  with pytest.raises(ValueError, match="unknown constant"):
    scaling.fit_law(bf16, fixed={"delta": 1.0})
  with pytest.raises(ValueError, match="positive finite"):
    scaling.fit_law(bf16, fixed={"E": 0.0})
  # Constants held fixed leave fewer to fit: five points fit three.
  f = scaling.fit(bf16, fixed={"alpha": TRUE.alpha, "beta": TRUE.beta, "gamma": TRUE.gamma}, bootstrap=0)
  assert f.law.gamma == TRUE.gamma and f.fixed == ("alpha", "beta", "gamma")
  assert f.law.loss(1e7, 3e8) == pytest.approx(TRUE.loss(1e7, 3e8), rel=1e-3)
  # A recipe at two points is not fitted; the table says what it lacks.
  few = [p for p in synthetic(recipe_points=("m25", "l25")) if p.reference or p.recipe == "fp4_linear"]
  f = scaling.fit(few, bootstrap=0)
  (r,) = f.recipes
  assert math.isnan(r.eff_n) and "3 or more distinct (N, D) points; it has 2" in r.error
  assert "not fitted: fp4_linear: eff_N and eff_D need arms at 3 or more" in scaling.fit_table(f, few)


def test_parse_fixed():
  assert scaling.parse_fixed("gamma=0.276, alpha=0.58") == {"gamma": 0.276, "alpha": 0.58}
  assert scaling.parse_fixed(None) == {}
  for bad in ("gamma", "delta=1", "gamma=x"):
    with pytest.raises(ValueError, match="--fit_fixed"):
      scaling.parse_fixed(bad)


def _row(arm, recipe, reference, n, d, loss, seed=0, **kw):
  return {"arm": arm, "recipe": recipe, "reference": reference, "params": n, "tokens": d, "eval_loss": loss,
          "seed": seed, "status": "ok", "comparable": True, "eval_text": "pycode", "epochs": 1.5, **kw}


def _write_grid(root, points):
  for p in points:
    folder = root / grid.POINTS[[_nd(q) for q in grid.POINTS].index((p.n, p.d))]
    folder.mkdir(exist_ok=True)
    name = ("bf16" if p.reference else p.recipe) + f"_s{p.seed}"
    with open(folder / "study.jsonl", "a") as f:
      f.write(json.dumps(_row(name, p.recipe, p.reference, p.n, p.d, p.loss, p.seed)) + "\n")


def test_results_folders_are_read_and_fitted(tmp_path):
  points = synthetic()
  _write_grid(tmp_path, points)
  with open(tmp_path / "m25" / "study.jsonl", "a") as f:
    n, d = _nd("m25")
    f.write(json.dumps(_row("fp4_linear_s1", "fp4_linear", False, n, d, math.nan, 1, status="diverged")) + "\n")
    f.write(json.dumps(_row("fp4_linear_s2", "fp4_linear", False, n, d, 3.0, 2, comparable=False)) + "\n")
  loaded, notes = scaling.load_points(tmp_path)
  key = lambda p: (p.recipe, p.reference, p.n, p.d, p.loss, p.seed)
  assert sorted(map(key, loaded)) == sorted(map(key, points))
  assert all(p.arm.split("/")[0] in grid.POINTS and p.epochs == 1.5 for p in loaded)
  assert len(notes) == 2 and all("m25/fp4_linear_s" in n for n in notes)
  text = scaling.run_fit(tmp_path, "gamma=0.2764", bootstrap=0)
  assert "gamma 0.2764 (fixed)" in text and "| fp4_full_stack | 8 | 8 | 0.65" in text
  assert "left out (diverged" in text and "More than 4 epochs" not in text
  # On a 100M-token training split m45 reads more than 4 epochs; the table names its arms.
  m45 = grid.epochs(grid.get_config("m45"), 100e6)
  assert m45 > 4
  over = [dataclasses.replace(p, epochs=m45, arm=f"m45/{p.recipe}_s{p.seed}") if p.d == _nd("m45")[1] else p
          for p in points]
  assert ("More than 4 epochs of the training split: m45/bf16_s0, m45/fp4_full_stack_s0, m45/fp4_linear_s0."
          in scaling.fit_table(scaling.fit(over, bootstrap=0), over))
  # One collected study (no subfolders) is read too; two evaluated texts are refused.
  assert len(scaling.load_points(tmp_path / "m25")[0]) == 3 + 2
  with open(tmp_path / "s10" / "study.jsonl", "a") as f:
    f.write(json.dumps(_row("bf16_s9", "bf16", True, 1e7, 1e8, 3.0, 9, eval_text="mix")) + "\n")
  with pytest.raises(ValueError, match="different texts"):
    scaling.load_points(tmp_path)
  with pytest.raises(ValueError, match="no study.jsonl"):
    scaling.load_points(tmp_path / "empty")


def test_grid_configs():
  ref = Experiment.from_config(importlib.import_module("experiments.configs.20m").get_config())
  for point in grid.POINTS:
    c = grid.get_config(point)
    exp = Experiment.from_config(c)
    n = grid.num_params(point[0])
    assert 7e6 < n < 40e6
    tokens = c.steps * c.batch_size * c.seq_len
    assert tokens / n == pytest.approx(int(point[1:]), rel=2e-3)
    assert c.data.corpus == "pycode_mix" and c.study.eval_tokens == 1_048_576
    assert exp.optimizer == ref.optimizer and exp.recipe == ref.recipe
    assert (c.batch_size, c.seq_len) == (ref.train.batch_size, ref.train.seq_len)
    # Every recipe fits one 10-minute command at every point, within 4 epochs of the planned corpus.
    for recipe in grid.STEP_MS_20M_H100:
      assert 1.5 < grid.predicted_minutes(c, recipe) <= grid.CALL_LIMIT_MIN, (point, recipe)
    assert 0.5 < grid.epochs(c) <= grid.MAX_EPOCHS == 4, point
  # The study's rule: three sizes at 25 or more tokens per parameter, three data sizes at the middle one.
  assert grid.POINTS == ("s10", "s25", "s50", "m10", "m25", "m45", "l10", "l25")
  assert all(max(r) >= 25 for r in grid.TOKENS_PER_PARAM.values()) and len(grid.TOKENS_PER_PARAM["m"]) == 3
  # The largest size is the 20m model's shape.
  l_model = dataclasses.replace(Experiment.from_config(grid.get_config("l25")).model, vocab_size=8192)
  assert l_model.num_params() == dataclasses.replace(ref.model, vocab_size=8192).num_params() == 16_914_048
  assert grid.get_config("m25,fp4_linear").recipe.linear == "nvfp4"
  for bad in (None, "", "x25", "m30", "m50", "l50"):
    with pytest.raises(ValueError, match="name a grid point.* the points are s10, s25, s50, m10, m25, m45, l10, l25$"):
      grid.get_config(bad)
  table = grid.plan_table()
  assert "| epochs of 135.9M |" in table and "| l25 | 16,914,048 | 423M | 25.0 | 12,904 | 106M | 3.11 | 4.3 |" in table
  assert "| m45 | 11,365,440 | 511M | 45.0 | 15,608 | 128M | 3.76 |" in table
  assert "| m45 | 11,365,440 | 511M | 45.0 | 15,608 | 128M | 5.11 ✗ |" in grid.plan_table(("bf16",), 100e6)


def test_plot_fit_draws_each_recipe():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  points = synthetic()
  fig = scaling.plot_fit(scaling.fit(points, bootstrap=0), points)
  ax, bx = fig.axes
  # Per recipe (bf16 and two): its points and its curve, on both axes.
  assert len(ax.lines) == len(bx.lines) == 6
  assert ax.get_title() == "D = 25 · N" and bx.get_title() == "N = 11.37M"
  assert [len(line.get_xdata()) for line in ax.lines[::2]] == [3, 3, 3]
  assert [len(line.get_xdata()) for line in bx.lines[::2]] == [3, 3, 3]
  matplotlib.pyplot.close(fig)


@pytest.mark.slow
def test_study_fit_command(tmp_path):
  _write_grid(tmp_path, synthetic())
  env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent), "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "experiments.study", "--fit", f"--results={tmp_path}", "--fit_bootstrap=0"]
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "| fp4_linear | 8 | 8 | 0.800 |" in out.stdout
  assert "fitted to 10 bf16 arm(s) at 8 (N, D) point(s)" in out.stdout
  out = subprocess.run(cmd[:4] + [f"--results={tmp_path / 'm25'}"], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode != 0 and "error: the bf16 law needs 7 distinct (N, D) points" in out.stderr
