r"""Train several recipes on identical data, seed and schedule; print the loss-gap table.

  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare [--config.steps=N ...]

Each recipe (a preset of ``fp4jax.recipe``: it sets the config's ``recipe.linear``,
``recipe.attention``, ``recipe.optimizer_states`` and ``recipe.newton_schulz``, and keeps the other
recipe fields) trains in ``<workdir>/<recipe>`` (an existing finished run is reused, an unfinished
one resumes). Every recipe's config is checked before any trains. The table reports, per recipe, the final eval loss and the mean train loss over the
last 10% of logged steps, and their gap relative to the first recipe (``bf16`` by default) in
percent, ``100 · (L − L_ref) / L_ref`` (the paper's metric). It is also written to
``<workdir>/gap_table.md`` and ``<workdir>/gap_table.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import train as launcher
from fp4jax.metrics import read_jsonl
from fp4jax.recipe import MODULES, get_recipe
from fp4jax.train import NonFiniteLossError


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "parent run directory")
  flags.DEFINE_list("recipes", ["bf16", "fp4_linear"],
                    "recipes to compare; the first is the reference")
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  launcher.define_cache_flag()


def run_summary(workdir: str | Path, tail: float = 0.1) -> dict:
  """Final train loss (mean of the last ``tail`` of logged steps) and eval loss of one run."""
  path = Path(workdir) / "metrics.jsonl"
  if not path.is_file():
    return {"status": "no metrics"}
  rows = list({r["step"]: r for r in read_jsonl(path)}.values())
  losses = [(r["step"], float(r["loss"])) for r in rows if "loss" in r]
  evals = [(r["step"], float(r["eval_loss"])) for r in rows if "eval_loss" in r]
  if not losses:
    return {"status": "no metrics"}
  last = max(s for s, _ in losses)
  k = max(1, math.ceil(tail * len(losses)))
  tail_losses = [v for _, v in sorted(losses)[-k:]]
  times = [float(r["step_time_s"]) for r in rows if "step_time_s" in r]
  return {"status": "ok", "step": last, "train_loss": sum(tail_losses) / len(tail_losses),
          "eval_loss": sorted(evals)[-1][1] if evals else float("nan"),
          "step_time_s": sorted(times)[len(times) // 2] if times else float("nan")}


def gap_table(results: dict[str, dict]) -> str:
  """A Markdown table of losses and relative gaps (%) to the first recipe."""
  names = list(results)
  ref = results[names[0]]
  lines = ["| recipe | steps | train loss | gap % | eval loss | gap % | step time s |",
           "|---|---:|---:|---:|---:|---:|---:|"]

  def gap(r, key):
    a, b = r.get(key, math.nan), ref.get(key, math.nan)
    return f"{100 * (a - b) / b:+.2f}" if math.isfinite(a) and math.isfinite(b) else "–"

  for name in names:
    r = results[name]
    if r.get("status") != "ok":
      lines.append(f"| {name} | {r.get('status')} | | | | | |")
      continue
    lines.append(f"| {name} | {r['step']} | {r['train_loss']:.4f} | {gap(r, 'train_loss')} | "
                 f"{r['eval_loss']:.4f} | {gap(r, 'eval_loss')} | {r['step_time_s']:.3g} |")
  return "\n".join(lines)


def recipe_configs(cfg, recipes: list[str]) -> dict:
  """The config of each recipe, every one checked (``ValueError`` on the first bad one) before
  anything trains."""
  if not recipes or len(set(recipes)) != len(recipes):
    raise ValueError(f"--recipes={','.join(recipes)}: give distinct recipe names")
  out = {}
  for name in recipes:
    preset = get_recipe(name)
    c = cfg.copy_and_resolve_references()
    c.recipe.update({k: getattr(preset, k) for k in MODULES})
    launcher.from_config(c, vocab_size=c.model.vocab_size or 256)
    out[name] = c
  return out


def compare(cfg, recipes: list[str], workdir: str | Path) -> dict[str, dict]:
  """Trains each recipe (same config otherwise) under ``workdir/<recipe>``; returns summaries."""
  workdir = Path(workdir)
  configs = recipe_configs(cfg, recipes)
  results = {}
  for i, (name, c) in enumerate(configs.items(), 1):
    print(f"\n=== recipe {name} ({i}/{len(recipes)}): {workdir / name}", flush=True)
    if (workdir / name / "checkpoints" / str(c.steps)).is_dir():
      print(f"{name}: already trained to step {c.steps}; reusing it")
      results[name] = run_summary(workdir / name)
      continue
    try:
      launcher.run(c, workdir / name)
      results[name] = run_summary(workdir / name)
    except NonFiniteLossError as e:
      results[name] = {**run_summary(workdir / name), "status": "diverged"}
      print(f"{name}: {e}")
  return results


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  fl = flags.FLAGS
  launcher.check_command_line(argv, "python -m experiments.compare --config=experiments/configs/"
                              "tiny.py --recipes=bf16,fp4_linear --workdir=runs/compare",
                              "config", "workdir")
  launcher.enable_compilation_cache(fl.compilation_cache)
  results = launcher.report_errors(lambda: compare(fl.config, fl.recipes, fl.workdir),
                                   fl.verbose)
  table = gap_table(results)
  workdir = Path(fl.workdir)
  (workdir / "gap_table.md").write_text(table + "\n")
  (workdir / "gap_table.json").write_text(json.dumps(results, indent=1))
  print(f"\nLoss gap to {fl.recipes[0]} ({fl.config.name}, {fl.config.steps} steps, "
        f"seed {fl.config.seed}):\n")
  print(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
