r"""Train several recipes on identical data, seed and schedule; print the loss-gap table.

  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare [--config.steps=N ...]

Each recipe (a preset of ``fp4jax.recipe``: it sets the config's ``recipe.linear``,
``recipe.attention``, ``recipe.optimizer_states`` and ``recipe.newton_schulz``, and keeps the other
recipe fields) trains in ``<workdir>/<recipe>`` (an existing finished run is reused, an unfinished
one resumes). Every recipe's config is checked before any trains, and so is every finished run
that would be reused: one of other settings (learning rate, seed, sequence length, ...; the run
identity ``experiments.train`` checks on resume) is refused, naming the fields. The table reports,
per recipe, the final eval loss (with the step and the number of held-out tokens it was evaluated
on) and the mean train loss over the last 10% of logged steps, and their gap relative to the first
recipe (``bf16`` by default) in percent, ``100 · (L − L_ref) / L_ref`` (the paper's metric); an eval
loss of another step, size or corpus than the reference's is not compared. It is also written to
``<workdir>/gap_table.md`` and ``<workdir>/gap_table.json``.

One comparison per workdir (``<workdir>/run.lock``). SIGTERM, SIGINT or SIGHUP stop the recipe in
training as they stop ``experiments.train`` (a checkpoint at the current step); the command then
says which recipes finished and which did not start, and exits with status 128 + the signal; the
same command resumes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import train as launcher
from fp4jax import data
from fp4jax.metrics import read_jsonl
from fp4jax.preemption import StopSignals, TrainingInterrupted
from fp4jax.recipe import MODULES, get_recipe
from fp4jax.train import NonFiniteLossError
from fp4jax.workdir import RunLock

BETWEEN_RUNS = ("no run was training (data, checks, evaluation or the table): nothing to save; "
                "the same command resumes")


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "parent run directory")
  flags.DEFINE_list("recipes", ["bf16", "fp4_linear"],
                    "recipes to compare; the first is the reference")
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  launcher.define_cache_flag()


def _eval_size(workdir: Path, step: int | None) -> dict:
  """The corpus and number of held-out tokens of the run's in-training evaluation."""
  try:
    run = json.loads((workdir / "config.json").read_text())
    c = run["config"]
    n = data.num_windows(run["data_dir"], "validation", c["seq_len"]) // c["batch_size"]
    tokens = min(c["eval_batches"], n) * c["batch_size"] * c["seq_len"]
    return {"eval_step": step, "eval_tokens": tokens, "eval_text": c["data"]["corpus"]}
  except (OSError, ValueError, KeyError, TypeError):
    return {"eval_step": step, "eval_tokens": None, "eval_text": None}


def run_summary(workdir: str | Path, tail: float = 0.1) -> dict:
  """Final train loss (mean of the last ``tail`` of logged steps) and eval loss of one run, with
  the step, size (``eval_tokens``) and corpus (``eval_text``) of that evaluation."""
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
          "step_time_s": sorted(times)[len(times) // 2] if times else float("nan"),
          **_eval_size(Path(workdir), sorted(evals)[-1][0] if evals else None)}


EVAL_KEYS = ("eval_step", "eval_tokens", "eval_text")


def gap_table(results: dict[str, dict]) -> str:
  """A Markdown table of losses and relative gaps (%) to the first recipe. Each eval loss states
  the step and the held-out tokens it was evaluated on; one of another step, size or corpus than
  the reference's is not compared ("not compared")."""
  names = list(results)
  ref = results[names[0]]
  lines = ["| recipe | steps | train loss | gap % | eval loss | gap % | eval step | eval tokens "
           "| step time s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

  def gap(r, key):
    a, b = r.get(key, math.nan), ref.get(key, math.nan)
    if key == "eval_loss" and any(r.get(k) != ref.get(k) for k in EVAL_KEYS):
      return "not compared"
    return f"{100 * (a - b) / b:+.2f}" if math.isfinite(a) and math.isfinite(b) else "–"

  def size(r, key):
    return "–" if r.get(key) is None else f"{r[key]:,}" if key == "eval_tokens" else str(r[key])

  for name in names:
    r = results[name]
    if r.get("status") != "ok":
      lines.append(f"| {name} | {r.get('status')} | | | | | | | |")
      continue
    lines.append(f"| {name} | {r['step']} | {r['train_loss']:.4f} | {gap(r, 'train_loss')} | "
                 f"{r['eval_loss']:.4f} | {gap(r, 'eval_loss')} | {size(r, 'eval_step')} | "
                 f"{size(r, 'eval_tokens')} | {r['step_time_s']:.3g} |")
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
  """Trains each recipe (same config otherwise) under ``workdir/<recipe>``; returns summaries.

  Raises:
    RunLockedError: another comparison runs in ``workdir``.
    RunChangedError: a finished run to reuse has other settings.
    TrainingInterrupted: a stop signal (the message names where each recipe stopped).
  """
  workdir = Path(workdir)
  configs = recipe_configs(cfg, recipes)
  results = {}
  with RunLock(workdir, "comparison") as lock, StopSignals(
      lambda t: print(t, flush=True), BETWEEN_RUNS, lambda: lock.release(force=True)):
    for note in lock.notes:
      print(note, flush=True)
    # Every finished run is checked before anything trains.
    finished = {name: launcher.finished_run(c, workdir / name) for name, c in configs.items()}
    for i, (name, c) in enumerate(configs.items(), 1):
      print(f"\n=== recipe {name} ({i}/{len(recipes)}): {workdir / name}", flush=True)
      if finished[name]:
        print(f"{name}: already trained to step {c.steps} with these settings; reusing it")
        results[name] = run_summary(workdir / name)
        continue
      try:
        launcher.run(c, workdir / name)
        results[name] = run_summary(workdir / name)
      except NonFiniteLossError as e:
        results[name] = {**run_summary(workdir / name), "status": "diverged"}
        print(f"{name}: {e}")
      except TrainingInterrupted as e:
        raise launcher.stopped_among(e, "recipe", name, list(results),
                                     list(configs)[i:]) from None
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
