r"""Train several recipes on identical data, seed and schedule; print the loss-gap table.

  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare [--eval_tokens=N] [--config.steps=N ...]

Each recipe (a preset of ``fp4jax.recipe``: it sets the config's ``recipe.linear``,
``recipe.attention``, ``recipe.optimizer_states``, ``recipe.newton_schulz`` and any field the preset
sets apart from the default, and keeps the other recipe fields) trains in ``<workdir>/<recipe>`` (an
existing finished run is reused, an unfinished one resumes). The config is typed once
(``fp4jax.experiment.Experiment``), each recipe's
experiment made from it (``recipe_experiments``) and completed by one data step shared by all
(``with_data``); every one is checked before any trains, and so is every finished run that would
be reused: one of other settings (learning rate, seed, sequence length, ...; the run
identity ``experiments.train`` checks on resume) is refused, naming the fields; one trained by other
code (another fp4jax source, ``fp4jax.workdir.code_version``, or a run that recorded none) is named
with its code, moved to ``<workdir>/<recipe>.other-code-<time>`` and trained again, unless
``--keep_other_code`` reuses it as it is.

Each final checkpoint is evaluated on the held-out split of the corpus (``experiments.evaluate``:
the whole split, unless ``--eval_tokens`` or the config's ``study.eval_tokens`` caps it; cached in
``<workdir>/<recipe>/eval.json``). The table (``table``, the one ``experiments.study`` writes too)
gives per recipe the eval loss with its standard error over the evaluated batches, the train loss
(mean of the last 10% of logged steps), and the eval loss's gap to the first recipe (``bf16`` by
default) in percent, ``100 · (L − L_ref) / L_ref`` (the paper's metric), with the standard error of
that gap over the same batches: a gap within about twice it is not resolved by the evaluation, and
one seed per recipe says nothing of the seed-to-seed spread (``experiments.study``'s bf16 seeds
measure it). An evaluation of another step, size or corpus than the reference's is not compared. The
table is also written to ``<workdir>/gap_table.md`` and its rows to ``<workdir>/gap_table.json``.

One comparison per workdir (``<workdir>/run.lock``). SIGTERM, SIGINT or SIGHUP stop the recipe in
training as they stop ``experiments.train`` (a checkpoint at the current step); the command then
says which recipes finished and which did not start, and exits with status 128 + the signal; the
same command resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import evaluate as evaluate_lib
from experiments import train as launcher
from fp4jax import data
from fp4jax import price as price_lib
from fp4jax.experiment import DataSpec, Experiment
from fp4jax.recipe import recorded_rounding_bits
from fp4jax.metrics import read_jsonl
from fp4jax.optim.factory import make_optimizer
from fp4jax.optim.state import state_nbytes
from fp4jax.preemption import StopSignals, TrainingInterrupted
from fp4jax.recipe import preset_changes
from fp4jax.step import abstract_model
from fp4jax.train import NonFiniteLossError
from fp4jax.workdir import RunLock

BETWEEN_RUNS = ("no run was training (data, checks, evaluation or the table): nothing to save; "
                "the same command resumes")


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "parent run directory")
  flags.DEFINE_list("recipes", ["bf16", "fp4_linear"],
                    "recipes to compare; the first is the reference")
  flags.DEFINE_integer("eval_tokens", None, "evaluate at most this many held-out tokens "
                       "(default: the config's study.eval_tokens, else the whole split)", lower_bound=1)
  flags.DEFINE_integer("eval_batch_size", None, "evaluation batch (default: the run's)",
                       lower_bound=1)
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  launcher.define_cache_flag()
  launcher.define_keep_flag()


def run_summary(workdir: str | Path, tail: float = 0.1) -> dict:
  """Final train loss (mean of the last ``tail`` of logged steps), last step and median step time
  of one run, from its ``metrics.jsonl``; ``status`` ``"ok"`` or ``"no metrics"``."""
  path = Path(workdir) / "metrics.jsonl"
  if not path.is_file():
    return {"status": "no metrics"}
  rows = list({r["step"]: r for r in read_jsonl(path)}.values())
  losses = [(r["step"], float(r["loss"])) for r in rows if "loss" in r]
  if not losses:
    return {"status": "no metrics"}
  k = max(1, math.ceil(tail * len(losses)))
  tail_losses = [v for _, v in sorted(losses)[-k:]]
  times = [float(r["step_time_s"]) for r in rows if "step_time_s" in r]
  return {"status": "ok", "step": max(s for s, _ in losses),
          "train_loss": sum(tail_losses) / len(tail_losses),
          "step_time_s": sorted(times)[len(times) // 2] if times else float("nan")}


def state_bytes_per_param(exp: Experiment) -> float:
  """The bytes of optimizer state per model parameter of ``exp``: its optimizer (AdamW or Muon) with its
  recipe's state format (``optimizer_states``, ``moments``) over its model's parameters (LoRA-SVD factors
  included), counted from shapes (``jax.eval_shape`` of the optimizer's ``init`` over the abstract
  parameters; ``fp4jax.optim.state.state_nbytes``: NVFP4 codes, E4M3 and global scales, centered
  means, float32 leaves, step counts). ``exp.model.vocab_size`` must be set. AdamW in float32 is 8
  (two float32 moments) plus its step counts; NVFP4 moments about 1.1 (4-bit codes and an E4M3 scale
  per 16, for m and √v), more where leaves stay float32 (vectors, ``moments.keep_fp32``)."""
  if exp.model.vocab_size is None:
    raise ValueError("state_bytes_per_param: the experiment's model has no vocab_size yet (run the data "
                     "step, experiments.compare.with_data, or set model.vocab_size)")
  return _state_bytes_per_param(exp.model, exp.recipe, exp.optimizer, exp.train.steps)


@functools.lru_cache(maxsize=256)
def _state_bytes_per_param(model, recipe, optimizer, steps) -> float:
  tx = make_optimizer(optimizer, recipe, steps)
  _, params = abstract_model(model, recipe)
  n = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  return state_nbytes(jax.eval_shape(tx.init, params)) / n


def rounding_bits(config: Mapping) -> str | None:
  """The random stream of the NVFP4 linear layers' stochastic rounding in a run's recorded config
  (``config.json``'s ``config``): ``MatmulConfig.rounding_bits`` (``"random"``: ``jax.random.bits``;
  ``"counter"``: ``fp4jax.numerics.counter_bits``; ``fp4jax.recipe.recorded_rounding_bits`` for a run
  recorded before the field existed), None where the linear layers are not NVFP4. Attention's dS and
  the NVFP4 moments always take the counter hash."""
  recipe = config.get("recipe", {})
  if not str(recipe.get("linear", "bf16")).startswith("nvfp4"):
    return None
  return recorded_rounding_bits(recipe.get("matmul", {}))


def run_row(exp: Experiment, run_dir: Path, name: str, recipe: str, ev: Mapping | None,
            eval_tokens: int | None, *, text: str | None = None, **fields) -> dict:
  """One row of the table: the run in ``run_dir`` of experiment ``exp`` (its steps, batch, sequence
  length, seed and corpus), its evaluation ``ev`` (``experiments.evaluate``; None: it diverged) and
  ``fields`` (``reference``, ``baseline``, ``seed``, ...). ``comparable`` says the evaluation is
  the one asked for: step ``exp.train.steps``, the experiment's corpus (or ``text``, for an
  evaluation on another text), at most ``eval_tokens`` tokens. The run's ``config.json`` gives the
  vocabulary and the training split's size, so a run folder copied away from its data is read alike
  (a run recorded without the split's size reads it from the data folder where that still exists;
  the epochs are NaN where it does not)."""
  s = run_summary(run_dir)
  run = evaluate_lib.read_run(run_dir)
  train_tokens = run.get("train_tokens")
  if train_tokens is None:
    with contextlib.suppress(FileNotFoundError):
      train_tokens = data.read_meta(run["data_dir"]).num_tokens("train")
  tc = exp.train
  tokens = tc.steps * tc.batch_size * tc.seq_len
  step_time = s.get("step_time_s", math.nan)
  status = "diverged" if ev is None else s["status"]
  ev = ev or {}
  if exp.model.vocab_size is None:
    exp = dataclasses.replace(exp, model=dataclasses.replace(exp.model, vocab_size=run["vocab_size"]))
  comparable = (status == "ok" and ev.get("step") == tc.steps
                and ev.get("text") == (text or exp.data.corpus) and ev.get("max_tokens") == eval_tokens)
  return {"arm": name, "recipe": recipe, "status": status, "reference": False, "baseline": None,
          "seed": tc.seed, **fields,
          "eval_loss": ev.get("loss", math.nan), "eval_loss_se": ev.get("loss_se", math.nan),
          "eval_tokens": ev.get("tokens", 0), "eval_step": ev.get("step"),
          "eval_text": ev.get("text"), "eval_max_tokens": ev.get("max_tokens"),
          "eval_batch_losses": ev.get("batch_losses"), "eval_batch_windows": ev.get("batch_windows"),
          "comparable": comparable, "price": price_lib.price(exp.recipe, exp.model, tc.steps),
          "state_bytes_per_param": state_bytes_per_param(exp), "rounding_bits": rounding_bits(run.get("config", {})),
          "train_loss": s.get("train_loss", math.nan),
          "step": s.get("step", 0), "tokens": tokens, "params": run["num_params"],
          "tokens_per_s": tc.batch_size * tc.seq_len / step_time if step_time > 0 else math.nan,
          "epochs": tokens / train_tokens if train_tokens else math.nan, "step_time_s": step_time,
          "platform": run.get("platform"), "devices": run.get("devices"), "code": run.get("code")}


def _paired_se(row: Mapping, refs: Sequence[Mapping]) -> float:
  """Standard error of ``row``'s eval loss minus the mean of ``refs``' over the same batches (NaN
  unless every one was evaluated on the same batches)."""
  sizes = [r.get("eval_batch_windows") for r in (row, *refs)]
  if not refs or any(s is None or s != sizes[0] for s in sizes):
    return math.nan
  ref = [sum(v) / len(refs) for v in zip(*(r["eval_batch_losses"] for r in refs), strict=True)]
  diff = [a - b for a, b in zip(row["eval_batch_losses"], ref, strict=True)]
  return evaluate_lib.standard_error(diff, sizes[0])


def add_gaps(rows: list[dict]) -> dict:
  """Adds each row's gaps: ``gap_pct`` (eval loss against the mean of the reference rows, those
  with ``reference`` true) and ``baseline_gap_pct`` (against the row named by its ``baseline``,
  NaN without one), in % of the reference's loss, each with the standard error of the paired
  difference over the same evaluated batches (``gap_se_pct``, ``baseline_gap_se_pct``; NaN where
  the batches are not known or not the same). Rows whose ``comparable`` is false (evaluated at
  another step, size or corpus) get NaN gaps and are not in the reference.

  Returns:
    The reference's noise floor ``{"n", "arms", "mean", "min", "max", "std", "spread_pct",
    "std_pct"}`` (``spread_pct``: (max − min) / mean in %; ``std``: sample standard deviation,
    0 for one run), or ``{"n": 0}`` without a finished reference.
  """
  ok = {r["arm"]: r for r in rows
        if r.get("comparable", True) and r["status"] == "ok" and math.isfinite(r["eval_loss"])}
  for r in rows:
    base = ok.get(r.get("baseline"))
    mine = r["eval_loss"] if r["arm"] in ok else math.nan
    b = base["eval_loss"] if base else math.nan
    r["baseline_gap_pct"] = 100 * (mine - b) / b
    r["baseline_gap_se_pct"] = 100 * _paired_se(r, [base]) / b if base and r["arm"] in ok else math.nan
  refs = [r for r in ok.values() if r.get("reference")]
  if not refs:
    for r in rows:
      r["gap_pct"] = r["gap_se_pct"] = math.nan
    return {"n": 0}
  ref = [r["eval_loss"] for r in refs]
  mean = sum(ref) / len(ref)
  std = statistics.stdev(ref) if len(ref) > 1 else 0.0
  for r in rows:
    mine = r["arm"] in ok
    r["gap_pct"] = 100 * (r["eval_loss"] - mean) / mean if mine else math.nan
    r["gap_se_pct"] = 100 * _paired_se(r, refs) / mean if mine else math.nan
  return {"n": len(ref), "arms": [r["arm"] for r in refs], "mean": mean, "min": min(ref),
          "max": max(ref), "std": std, "spread_pct": 100 * (max(ref) - min(ref)) / mean,
          "std_pct": 100 * std / mean}


def _fmt(x, spec: str) -> str:
  return format(x, spec) if isinstance(x, int | float) and math.isfinite(x) else "–"


def _pm(value: float, se: float, spec: str, se_spec: str) -> str:
  """``value ± se``, or ``value`` alone where the error is not known."""
  if not (isinstance(value, int | float) and math.isfinite(value)):
    return "–"
  return format(value, spec) + (f" ± {format(se, se_spec)}" if isinstance(se, int | float)
                                and math.isfinite(se) else "")


_BITS_TEXT = {"random": "jax.random", "counter": "counter"}  # the table's words for ``rounding_bits``


def table(rows: list[dict], floor: Mapping, title: str = "", notes: Sequence[str] = ()) -> str:
  """The Markdown table of a study or comparison: what the gaps mean, one line per row (``add_gaps``
  has run), and ``notes`` (lines printed under the header).

  Columns: the run, its recipe (the preset and the changes it was given), seed, eval loss ± its
  standard error over the evaluated batches, the evaluation's step and tokens, the gap to the
  reference ± the paired standard error, the gap to the row's baseline likewise, the recipe's
  price (``fp4jax.price.price``: linear-GEMM time on FP4 tensor cores, BF16 = 1), the optimizer
  state's bytes per parameter (``state_bytes_per_param``; – for rows written before it), the random
  stream of the linear layers' stochastic rounding (``rounding_bits``: ``jax.random`` or ``counter``;
  – without NVFP4 linear layers or for rows written before it), train loss,
  tokens, parameters, throughput (marked † for runs that shared the device), epochs, step time.
  """
  lines = [title, ""] if title else []
  if floor.get("n", 0) > 1:
    lines.append(f"Reference ({', '.join(floor['arms'])}): mean eval loss {floor['mean']:.4f} over "
                 f"{floor['n']} seed(s), min–max {floor['min']:.4f}–{floor['max']:.4f} (spread "
                 f"{floor['spread_pct']:.2f}% of the mean, std {floor['std_pct']:.2f}%): gaps inside "
                 "that spread are training noise.")
  elif floor.get("n") == 1:
    lines.append(f"Reference ({floor['arms'][0]}): eval loss {floor['mean']:.4f}, one seed: the "
                 "seed-to-seed spread of the loss is not measured here (experiments.study's bf16 "
                 "seeds measure it), so a gap smaller than that spread says nothing of the recipe.")
  else:
    lines.append("no reference run has finished: no gaps yet.")
  if any(math.isfinite(r.get("eval_loss_se", math.nan)) for r in rows):
    lines.append("± is a standard error over the evaluated held-out batches: beside an eval loss, "
                 "the text's own variation; beside a gap, that of the difference on the same "
                 "batches. A gap within about twice its ± is not resolved by this evaluation.")
  else:
    lines.append("These evaluations recorded no per-batch losses, so no standard errors: the "
                 "spread of the reference seeds is the measure of noise.")
  lines += list(notes)
  lines += ["", "| arm | recipe | seed | eval loss | eval step | eval tokens | gap % | vs baseline % "
            "| price | state B/param | SR bits | train loss | tokens | params | tokens/s | epochs | step ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    diverged = r["status"] == "diverged"
    if r["status"] not in ("ok", "diverged"):
      lines.append(f"| {r['arm']} | {r['recipe']} | {r['seed']} | {r['status']} |" + " |" * 13)
      continue
    eval_loss = "diverged" if diverged else _pm(r["eval_loss"], r.get("eval_loss_se"), ".4f", ".4f")
    mark = " †" if r.get("shared_device", 1) > 1 else ""
    other = not diverged and not r.get("comparable", True)
    gap = "not compared ‡" if other else _pm(r["gap_pct"], r.get("gap_se_pct"), "+.2f", ".2f")
    base = r.get("baseline_gap_pct", math.nan)
    vs = (f"{_pm(base, r.get('baseline_gap_se_pct'), '+.2f', '.2f')} ({r['baseline']})"
          if math.isfinite(base) else "–")
    ev_step = "–" if r.get("eval_step") is None else str(r["eval_step"])
    ev_tokens = f"{r['eval_tokens']:,}" if r.get("eval_tokens") else "–"
    lines.append(f"| {r['arm']} | {r['recipe']} | {r['seed']} | {eval_loss} | {ev_step} | "
                 f"{ev_tokens} | {gap} | {vs} | {_fmt(r.get('price', math.nan), '.3f')} | "
                 f"{_fmt(r.get('state_bytes_per_param', math.nan), '.2f')} | "
                 f"{_BITS_TEXT.get(r.get('rounding_bits'), '–')} | {_fmt(r['train_loss'], '.4f')} | "
                 f"{_fmt(r['tokens'], ',')} | {_fmt(r['params'], ',')} | "
                 f"{_fmt(r['tokens_per_s'], ',.0f')}{mark} | {_fmt(r['epochs'], '.3g')} | "
                 f"{_fmt(1000 * r['step_time_s'], '.0f')}{mark} |")
  if any(r["status"] == "ok" and not r.get("comparable", True) for r in rows):
    lines += ["", "‡ evaluated at another step, on another corpus or number of tokens than this "
              "command's evaluation: not compared (run it again with that run's name and this "
              "command's `--eval_tokens` to evaluate it again)."]
  shared = sorted({r["shared_device"] for r in rows if r.get("shared_device", 1) > 1})
  if shared:
    lines += ["", f"† trained with up to {shared[-1]} arms at once on the same device(s) "
              "(`--parallel`): the throughput of a shared device, not of the recipe."]
  return "\n".join(lines)


def seed_summary(rows: Sequence[Mapping], floor: Mapping) -> str:
  """The Markdown table of each recipe over its seeds: one line per distinct ``recipe`` text (a
  preset and its changes; the rows of one are its seeds), in the order of the rows, with the seeds'
  gaps to the reference mean (``gap_pct``, %), their mean, each seed's paired gap to its baseline
  (``baseline_gap_pct``, points, the baselines named) and their mean, and a verdict that holds the
  mean against the reference's seed spread (``floor["spread_pct"]``, the noise floor): "none" where
  it is inside it, "lower" or "higher" (loss) beyond it, "one seed" (or "one paired seed") where
  only one seed has a gap to its baseline. Only rows that ``add_gaps`` compared count; the
  reference's own line has no verdict.
  """
  spread = floor.get("spread_pct", math.nan) if floor.get("n", 0) > 1 else math.nan
  groups: dict[str, list[Mapping]] = {}
  for r in rows:
    if math.isfinite(r.get("gap_pct", math.nan)):
      groups.setdefault(r["recipe"], []).append(r)
  lines = [f"Each recipe over its seeds. Noise floor: the reference's seed spread, {_fmt(spread, '.2f')}%; a "
           "mean difference inside it is reported as none.", "",
           "| recipe | arms | gap % per seed | mean gap % | vs baseline per seed (points) | mean vs baseline "
           "| verdict |", "|---|---|---|---:|---|---:|---|"]
  for recipe, rs in groups.items():
    gaps = [r["gap_pct"] for r in rs]
    vs = [(r["baseline_gap_pct"], r["baseline"]) for r in rs if math.isfinite(r.get("baseline_gap_pct", math.nan))]
    mean_vs = statistics.fmean(v for v, _ in vs) if vs else math.nan
    if rs[0].get("reference"):
      verdict = "reference"
    elif len(vs) < 2:
      verdict = ("one seed" if len(rs) == 1 else "one paired seed") if vs else "–"
    elif not math.isfinite(spread):
      verdict = "no noise floor"
    elif abs(mean_vs) <= spread:
      verdict = "none"
    else:
      verdict = "lower" if mean_vs < 0 else "higher"
    per_vs = ", ".join(f"{v:+.2f} ({b})" for v, b in vs) or "–"
    lines.append(f"| {recipe} | {', '.join(r['arm'] for r in rs)} | {', '.join(f'{g:+.2f}' for g in gaps)} | "
                 f"{statistics.fmean(gaps):+.2f} | {per_vs} | {_fmt(mean_vs, '+.2f')} | {verdict} |")
  return "\n".join(lines)


def with_data(exps: Mapping[str, Experiment]) -> dict[str, Experiment]:
  """Each experiment completed by the data step (``experiments.train.prepare_data``), which runs
  once per distinct ``data`` spec (the runs of a comparison or study share theirs)."""
  prepared: dict[DataSpec, Experiment] = {}
  out = {}
  for name, e in exps.items():
    if e.data not in prepared:
      prepared[e.data] = launcher.prepare_data(e)
    done = prepared[e.data]
    out[name] = e.with_data(done.data.dir, done.data_info)
  return out


def recipe_experiments(exp: Experiment, recipes: list[str]) -> dict[str, Experiment]:
  """The experiment of each recipe: ``exp`` with the preset's fields (``preset_changes``), every one
  checked (``ValueError`` on the first bad one) before anything trains."""
  if not recipes or len(set(recipes)) != len(recipes):
    raise ValueError(f"--recipes={','.join(recipes)}: give distinct recipe names")
  out = {}
  for name in recipes:
    out[name] = exp.with_changes({f"recipe.{k}": v for k, v in preset_changes(name).items()})
  return out


def compare(cfg, recipes: list[str], workdir: str | Path, eval_tokens: int | None = None,
            eval_batch_size: int | None = None, keep_other_code: bool = False) -> dict[str, dict]:
  """Trains each recipe (same config otherwise) under ``workdir/<recipe>`` and evaluates it.

  Args:
    eval_tokens: held-out tokens per evaluation (``experiments.evaluate.eval_tokens``: default the
      config's ``study.eval_tokens``, else the whole held-out split).
    eval_batch_size: windows per evaluation batch (default: the run's batch size).
    keep_other_code: reuse a finished run trained by other code as it is
      (``experiments.train.finished_run``; else it trains again, the old run kept aside).

  Returns:
    The rows of the table by recipe, with their gaps (``add_gaps``; the first recipe is the
    reference and every other's baseline).

  Raises:
    RunLockedError: another comparison runs in ``workdir``.
    RunChangedError: a finished run to reuse has other settings.
    TrainingInterrupted: a stop signal (the message names where each recipe stopped).
  """
  workdir = Path(workdir)
  exps = recipe_experiments(Experiment.from_config(cfg), recipes)
  eval_tokens = evaluate_lib.eval_tokens(cfg, eval_tokens, eval_batch_size)
  results = {}
  with RunLock(workdir, "comparison") as lock, StopSignals(
      lambda t: print(t, flush=True), BETWEEN_RUNS, lambda: lock.release(force=True)):
    for note in lock.notes:
      print(note, flush=True)
    exps = with_data(exps)
    # Every finished run is checked before anything trains.
    finished = {name: launcher.finished_run(e, workdir / name, keep_other_code)
                for name, e in exps.items()}
    for i, (name, e) in enumerate(exps.items(), 1):
      print(f"\n=== recipe {name} ({i}/{len(recipes)}): {workdir / name}", flush=True)
      diverged = False
      if finished[name]:
        print(f"{name}: already trained to step {e.train.steps} with these settings; reusing it")
      else:
        try:
          launcher.run(e, workdir / name)
        except NonFiniteLossError as err:
          print(f"{name}: {err}")
          diverged = True
        except TrainingInterrupted as err:
          raise launcher.stopped_among(err, "recipe", name, list(results),
                                       list(exps)[i:]) from None
      ev = None if diverged else evaluate_lib.evaluate_cached(
          workdir / name, e.data.corpus, e.train.steps, eval_tokens, eval_batch_size, exp=e)
      results[name] = run_row(e, workdir / name, name, name, ev, eval_tokens, reference=i == 1,
                              baseline=None if i == 1 else recipes[0])
  add_gaps(list(results.values()))
  return results


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  fl = flags.FLAGS
  launcher.check_command_line(argv, "python -m experiments.compare --config=experiments/configs/"
                              "tiny.py --recipes=bf16,fp4_linear --workdir=runs/compare",
                              "config", "workdir")
  launcher.enable_compilation_cache(fl.compilation_cache)
  results = launcher.report_errors(
      lambda: compare(fl.config, fl.recipes, fl.workdir, fl.eval_tokens, fl.eval_batch_size,
                      fl.keep_other_code),
      fl.verbose, fl.workdir)
  rows = list(results.values())
  floor = add_gaps(rows)
  c, size = fl.config, rows[0].get("eval_max_tokens")
  held_out = "the whole held-out split" if size is None else f"the first {size:,} held-out tokens"
  title = (f"Loss gap to {fl.recipes[0]} ({c.name}, {c.steps} steps x {c.batch_size} x {c.seq_len} "
           f"tokens, seed {c.seed}, corpus {c.data.corpus}): eval loss on {held_out}.")
  text = table(rows, floor, title)
  workdir = Path(fl.workdir)
  (workdir / "gap_table.md").write_text(text + "\n")
  (workdir / "gap_table.json").write_text(json.dumps(results, indent=1))
  print("\n" + text)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=launcher.parse_flags)
