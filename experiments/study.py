r"""The loss-gap study: BF16 against each NVFP4 module and the full stack, on one config.

  python -m experiments.study --config=experiments/configs/20m.py --workdir=runs/study \
      --arms=all|NAME,NAME [--config.steps=N ...] [--eval_tokens=N] [--collect=experiments/results/NAME]
  python -m experiments.study --list
  python -m experiments.study --fit --results=experiments/results/NAME [--fit_fixed=gamma=0.276]

The study is data: ``experiments.studies.loss_gap.ARMS``, each arm a recipe preset, its changes to
the config (dotted keys, as ``--config.<key>`` sets them), a seed, the arm it is read against and
what it measures (``--list`` prints them). Everything else is the config's, so the arms share the
data, the schedule and (at equal seed) the data order and the initialization. The config is typed
once (``fp4jax.experiment.Experiment``); each arm is a function of that experiment (``Arm.apply``,
with the study's telemetry: ``arm_experiment``), completed by one data step shared by the arms
(``experiments.compare.with_data``), and trains with the launcher (``experiments.train.run``) in
``<workdir>/<arm>``: a finished arm is reused, an interrupted one resumes. It logs the per-module
quantization error every ``telemetry_every`` steps (``fp4jax.telemetry``; the config's value, or
``steps // 10`` when it is 0), and its final checkpoint is evaluated on the held-out split of the
corpus (``experiments.evaluate``; cached in ``<workdir>/<arm>/eval.json``), and on each text that the
config's ``study.eval_also`` names (built-in corpora or folders, separated by commas: e.g. the ``mix``
prose for a study of a code corpus; ``<workdir>/<arm>/eval_<name>.json``, ``eval_texts``).

After the arms of the command, every finished arm of the workdir goes into
``<workdir>/study.jsonl`` (one line per arm) and ``<workdir>/table.md``, printed too. The gap of an
arm is ``100 · (L − L̄) / L̄`` on the held-out loss, against the mean ``L̄`` of the bf16 seeds; the
spread of those seeds (min–max and standard deviation, in % of ``L̄``) is the noise floor, and each
loss and gap carries its standard error over the evaluated batches (``experiments.compare.table``,
the table ``experiments.compare`` writes too); each other text evaluated gets a table and summary of
its own, ``table_<name>.md`` and ``summary_<name>.md``, its gaps against the bf16 seeds' mean on that
text. ``--collect=DIR`` copies the small logs (each arm's
``metrics.jsonl``, ``config.json``, ``eval.json`` and its output under ``--parallel``;
``study.json``, ``study.jsonl``, ``table.md``) into ``DIR`` (e.g. ``experiments/results/<name>``,
read by ``notebooks/loss_gap.ipynb``): results enter the repository this way only.

One arm per command (``--arms=fp4_linear``) fits a machine that limits the length of a command;
the table then grows with each. ``--parallel=N`` trains up to N arms at once, each in a process of
its own on the same device(s) (``<workdir>/logs/<arm>.log`` holds its output): for models small
enough that one arm leaves the GPU mostly idle. Arms trained that way share the device, so the
table marks their throughput (``tokens/s``, ``step ms``) with † (``shared_device`` in their row):
it is not the speed of their recipe. ``<workdir>/study.json`` records the study's config: a workdir of a
study with another config (model, data, steps, ...) is refused; a config field that the recorded
study lacks (a field added since, at its default) is not compared.

A study is a run too (``README.md``, Reliability): one study per workdir (``<workdir>/run.lock``); a
finished arm is reused only if its final checkpoint verifies and its run identity (what
``experiments.train`` checks on resume) is this command's, else the command refuses, naming the
fields (a corrupt final checkpoint trains again from the newest intact step), and only if this
code trained it (``fp4jax.workdir.code_version``): an arm of other code, or of a run that recorded
none, is named with its code, moved to ``<workdir>/<arm>.other-code-<time>`` and trained again,
unless ``--keep_other_code`` reuses it as it is. SIGTERM, SIGINT and
SIGHUP reach each arm in training once (``--parallel``, ``experiments._pool``: the arms run in
sessions of their own, so a terminal's Ctrl-C reaches the parent only, which forwards it); each arm
saves its step and exits, the command waits for them, says which arms stopped at which step, and
exits with status 128 + the signal; the same command resumes every arm. Each row states the step, corpus and size of its
evaluation (``eval_step``, ``eval_text``, ``eval_tokens``, ``eval_max_tokens``); a row evaluated
otherwise than this command asks (``comparable`` false) gets no gap and is not in the noise floor.

``--fit`` fits the scaling law to the finished arms of a results folder, or of a folder of them (one
per grid point of ``experiments/configs/grid.py``), and prints the BF16 law L(N, D) and each recipe's
efficiencies with their bootstrap intervals (``experiments.scaling``); it trains nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import _pool
from experiments import evaluate as evaluate_lib
from experiments import scaling
from experiments import train as launcher
from experiments.compare import BETWEEN_RUNS, add_gaps, run_row, seed_summary, table, with_data
from experiments.evaluate import EVAL_ALSO_GLOB, EVAL_FILE, eval_file
from experiments.studies import Arm
from experiments.studies.loss_gap import ARMS
from fp4jax import corpus as corpus_lib
from fp4jax.experiment import Experiment, TrainConfig
from fp4jax.preemption import StopSignals, TrainingInterrupted
from fp4jax.recipe import upgrade_config
from fp4jax.train import NonFiniteLossError
from fp4jax.workdir import ABSENT, RunLock, diff, make_folder

STUDY_FILE = "study.json"
ROWS_FILE = "study.jsonl"
TABLE_FILE = "table.md"
SUMMARY_FILE = "summary.md"
SHARED_FILE = "shared_device.json"  # {"parallel": N}: the arm trained beside others (--parallel)
ARM_LOGS = ("metrics.jsonl", "config.json", EVAL_FILE, SHARED_FILE)
PROCESS_LOG = "train.log"  # an arm's output under --parallel (<workdir>/logs/<arm>.log), collected
# Config fields that do not change what a run computes: a study may resume with others.
VOLATILE = ("progress", "tensorboard")
# What else each arm is evaluated on (eval_texts): a later command of the study may name other texts.
EVALUATED_ALSO = ("study.eval_also",)
ARM_NAMES = tuple(a.name for a in ARMS)
_BY_NAME = {a.name: a for a in ARMS}


def select_arms(spec: str | Sequence[str]) -> list[Arm]:
  """The arms of ``--arms``: ``all`` or names separated by commas, in the order of ``ARMS``.

  Raises:
    ValueError: an unknown or repeated name, or none.
  """
  names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
  if names == ["all"]:
    return list(ARMS)
  unknown = [n for n in names if n not in _BY_NAME]
  if unknown or not names or len(set(names)) != len(names):
    what = f"unknown arm(s) {unknown}" if unknown else "give distinct arm names"
    raise ValueError(f"--arms={','.join(names)}: {what}; the arms are all, or some of: "
                     f"{', '.join(ARM_NAMES)} (--list prints them)")
  return [a for a in ARMS if a.name in names]


def list_arms(arms: Sequence[Arm] = ARMS) -> str:
  """The arms as a Markdown table: name, preset, changes, seed, baseline, what it measures."""
  lines = ["| arm | preset | changes | seed | baseline | what it measures |",
           "|---|---|---|---:|---|---|"]
  for a in arms:
    changes = ", ".join(f"`{k}={v}`" for k, v in a.changes.items()) or "—"
    lines.append(f"| `{a.name}` | `{a.preset}` | {changes} | {a.seed} | "
                 f"{'—' if a.baseline is None else f'`{a.baseline}`'} | {a.what} |")
  return "\n".join(lines)


def telemetry_every(tc: TrainConfig) -> int:
  """The run's ``telemetry_every``, or ``steps // 10`` (at least 1) when it is 0."""
  return tc.telemetry_every or max(1, tc.steps // 10)


def arm_experiment(exp: Experiment, arm: Arm, telemetry: bool = True) -> Experiment:
  """The experiment of ``arm``: ``arm.apply(exp)`` (the preset's modules, the arm's changes and
  seed) with the study's telemetry (``telemetry_every``; off without ``telemetry``).

  Raises:
    ValueError: the arm does not fit the study's experiment (``Arm.apply``).
  """
  e = arm.apply(exp)
  return e.with_changes({"train.telemetry_every": telemetry_every(e.train) if telemetry else 0})


def check_workdir(cfg, workdir: Path) -> None:
  """Records the study's config in ``<workdir>/study.json``, or checks it against the recorded one
  (a field absent from the recorded config is not compared: the recorded study predates it; nor is
  ``study.eval_also``, which changes no arm's training).

  Raises:
    ValueError: the workdir holds a study of another config (the differing fields are named).
  """
  path = workdir / STUDY_FILE
  mine = {k: v for k, v in cfg.to_dict().items() if k not in VOLATILE}
  if not path.is_file():
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": mine}, indent=1) + "\n")
    return
  theirs = upgrade_config(json.loads(path.read_text())["config"])  # a study recorded in an older layout
  diffs = [d for d in diff(theirs, mine) if d[1] is not ABSENT and d[0] not in EVALUATED_ALSO]
  if diffs:
    shown = "; ".join(f"{k}: study {a!r}, this command {b!r}" for k, a, b in diffs[:6])
    raise ValueError(f"{workdir} holds a study of another config ({shown}{' ...' * (len(diffs) > 6)})"
                     f": use another --workdir, or the study's settings ({path})")


def eval_texts(cfg) -> tuple[str, ...]:
  """The other texts each arm is evaluated on (``study.eval_also``: built-in corpus names or folders,
  separated by commas; none by default), checked before any arm trains.

  Raises:
    ValueError: a text named twice, the run's own corpus, or one whose text is not on this machine
      (the message names the fix).
  """
  texts = [t.strip() for t in str(cfg.get("study", {}).get("eval_also", "") or "").split(",") if t.strip()]
  for i, t in enumerate(texts):
    where = f"config study.eval_also={t!r}"
    if t in texts[:i]:
      raise ValueError(f"{where} is named twice: name each text once")
    if t == cfg.data.corpus:
      raise ValueError(f"{where} is the study's own corpus, which every arm is evaluated on already "
                       "(eval.json): drop it from study.eval_also")
    if not corpus_lib.text_is_here(t):
      raise ValueError(f"{where}: its text is not on this machine, so the arms could not be evaluated "
                       f"on it after training: a built-in corpus ({', '.join(sorted(corpus_lib.CORPORA))}) "
                       "fetched or packed into the data root (`python -m fp4jax.corpus fetch` or `pack`, "
                       "$FP4JAX_DATA_DIR), or an existing folder of .txt files; or drop it from "
                       "study.eval_also")
  return tuple(texts)


def is_finished(workdir: Path, steps: int) -> bool:
  return (workdir / "checkpoints" / str(steps)).is_dir()


def run_arm(exp: Experiment, arm: Arm, workdir: Path, eval_tokens: int | None = None,
            eval_batch_size: int | None = None, keep_other_code: bool = False,
            also: Sequence[str] = ()) -> str:
  """Trains (or reuses, or resumes) one arm, ``exp`` being its experiment (``arm_experiment``,
  completed by ``compare.with_data``), and evaluates it on its corpus and on each text of ``also``
  (``eval_texts``); returns its status ("trained", "reused" or "diverged")."""
  run_dir = workdir / arm.name
  status = "reused"
  if not launcher.finished_run(exp, run_dir, keep_other_code):
    status = "trained"
    for old in (EVAL_FILE, *(p.name for p in run_dir.glob(EVAL_ALSO_GLOB))):  # of an earlier checkpoint
      (run_dir / old).unlink(missing_ok=True)
    if not os.environ.get(_pool.CHILD_ENV):  # trained alone: its throughput is its own
      (run_dir / SHARED_FILE).unlink(missing_ok=True)
    try:
      launcher.run(exp, run_dir)
    except NonFiniteLossError as e:
      print(f"{arm.name}: {e}", flush=True)
      (run_dir / "diverged.json").write_text(json.dumps({"error": str(e)}) + "\n")
      return "diverged"
  (run_dir / "diverged.json").unlink(missing_ok=True)
  evaluate_lib.evaluate_cached(run_dir, exp.data.corpus, exp.train.steps, eval_tokens, eval_batch_size,
                               exp=exp)
  for text in also:
    evaluate_lib.evaluate_cached(run_dir, text, exp.train.steps, eval_tokens, eval_batch_size, exp=exp,
                                 file=eval_file(text))
  return status


def arm_row(exp: Experiment, arm: Arm, workdir: Path, eval_tokens: int | None = None,
            text: str | None = None) -> dict | None:
  """The study's row of one arm (None if it has not run), ``exp`` being the study's experiment
  (its steps, batch, sequence length and corpus): ``compare.run_row`` of its run (with the arm's
  experiment, ``Arm.apply``: its recipe prices the row), with
  the arm's preset, ``changes`` (the ``recipe`` column prints exactly those), seed, group and
  baseline; the bf16 seeds (no baseline) are the reference. ``text``: the row of its evaluation on
  that other text (``eval_file(text)``; None if it has none)."""
  run_dir = workdir / arm.name
  file = run_dir / eval_file(text)
  diverged = (run_dir / "diverged.json").is_file()
  if not diverged and not file.is_file():
    return None
  try:
    ev = None if diverged else json.loads(file.read_text())
  except ValueError as e:  # a study command evaluates a damaged one again; a collected folder cannot
    raise ValueError(f"{file} is damaged ({e}): put back a copy, or run the arm's study "
                     "command again where its checkpoint is (it evaluates the arm again)") from e
  shared = run_dir / SHARED_FILE
  parallel = json.loads(shared.read_text())["parallel"] if shared.is_file() else 1
  return run_row(arm.apply(exp), run_dir, arm.name, arm.recipe_text(), ev, eval_tokens, text=text, seed=arm.seed,
                 reference=arm.baseline is None, baseline=arm.baseline, group=arm.group,
                 preset=arm.preset, changes=dict(arm.changes), shared_device=parallel)


def write_results(exp: Experiment, workdir: Path, eval_tokens: int | None = None) -> tuple[list[dict], str]:
  """Writes ``study.jsonl``, ``table.md`` and ``summary.md`` (``compare.seed_summary``: each recipe
  over its seeds) from every finished arm of ``workdir`` (``exp``: the study's experiment); rows
  evaluated on other than ``eval_tokens`` held-out tokens (at most; None: the whole split) are not
  compared. Each other text that arms were evaluated on (their ``eval_<name>.json``) gets
  ``table_<name>.md`` and ``summary_<name>.md`` alike (``other_texts``)."""
  rows = [r for a in ARMS if (r := arm_row(exp, a, workdir, eval_tokens)) is not None]
  floor = add_gaps(rows)
  with open(workdir / ROWS_FILE, "w") as f:
    for r in rows:
      f.write(json.dumps({**r, "noise_floor": floor}) + "\n")
  platform = rows[0]["platform"] if rows else "?"
  held_out = "the whole held-out split" if eval_tokens is None else \
      f"the first {eval_tokens:,} held-out tokens"
  tc = exp.train
  title = (f"Loss-gap study: config {exp.name}, {tc.steps} steps x {tc.batch_size} x "
           f"{tc.seq_len} tokens, corpus {exp.data.corpus}, on {platform}; eval loss on "
           f"{held_out}. The recipe column is each arm's preset and its changes "
           "(`python -m experiments.study --list`).")
  text = table(rows, floor, title)
  (workdir / TABLE_FILE).write_text(text + "\n")
  (workdir / SUMMARY_FILE).write_text(seed_summary(rows, floor) + "\n")
  for other in other_texts(workdir):
    o_rows = [r for a in ARMS if (r := arm_row(exp, a, workdir, eval_tokens, other)) is not None]
    o_floor = add_gaps(o_rows)
    o_title = (f"The same arms (corpus {exp.data.corpus}) evaluated on {held_out} of another text: "
               f"{other}; gaps against the bf16 seeds' mean on it.")
    table_file, summary_file = other_files(other)
    (workdir / table_file).write_text(table(o_rows, o_floor, o_title) + "\n")
    (workdir / summary_file).write_text(seed_summary(o_rows, o_floor) + "\n")
  return rows, text


def other_texts(workdir: Path) -> list[str]:
  """The other texts that arms of ``workdir`` were evaluated on: the ``text`` of each
  ``<arm>/eval_<name>.json`` (a damaged one is skipped here; its row names it)."""
  texts = set()
  for path in workdir.glob(f"*/{EVAL_ALSO_GLOB}"):
    with contextlib.suppress(ValueError, OSError, AttributeError):
      texts.add(json.loads(path.read_text()).get("text"))
  return sorted(t for t in texts if isinstance(t, str))


def other_files(text: str) -> tuple[str, str]:
  """``(table_<name>.md, summary_<name>.md)``: the table and summary of the evaluations on ``text``."""
  name = eval_file(text)[len("eval_"):-len(".json")]
  return f"table_{name}.md", f"summary_{name}.md"


def collect(workdir: Path, dest: Path) -> list[Path]:
  """Copies the study's small logs into ``dest`` (replacing its arm folders); returns the files.

  ``dest`` gets ``study.json``, ``study.jsonl``, ``table.md``, ``summary.md`` (and the tables and
  summaries of other texts, ``other_files``) and, per arm that has run, ``<arm>/`` with its
  ``ARM_LOGS``, its evaluations on other texts (``eval_<name>.json``) and, for an arm run under
  ``--parallel``, its process's output as ``<arm>/train.log``. This is the one layout of
  ``experiments/results/``.
  """
  make_folder(dest, "collection")
  out = []
  others = [f for t in other_texts(workdir) for f in other_files(t)]
  for name in (STUDY_FILE, ROWS_FILE, TABLE_FILE, SUMMARY_FILE, *others):
    if (workdir / name).is_file():
      out.append(Path(shutil.copy2(workdir / name, dest / name)))
  for arm in ARM_NAMES:
    src = workdir / arm
    if not (src / "metrics.jsonl").is_file():
      continue
    shutil.rmtree(dest / arm, ignore_errors=True)
    (dest / arm).mkdir()
    out += [Path(shutil.copy2(src / f, dest / arm / f)) for f in ARM_LOGS if (src / f).is_file()]
    out += [Path(shutil.copy2(p, dest / arm / p.name)) for p in sorted(src.glob(EVAL_ALSO_GLOB))]
    if (log := workdir / "logs" / f"{arm}.log").is_file():
      out.append(Path(shutil.copy2(log, dest / arm / PROCESS_LOG)))
  return out


def child_command(argv: Sequence[str], arm: str) -> list[str]:
  """The command line of one arm's process under ``--parallel``: this command's flags (``argv``,
  without the program name) with ``--arms=arm`` and without ``--arms``, ``--parallel`` and
  ``--collect`` (the parent collects once all have finished)."""
  out, skip_value = [], False
  for a in argv:
    if skip_value:
      skip_value = False
      continue
    if a.split("=", 1)[0] in ("--arms", "--parallel", "--collect"):
      skip_value = "=" not in a
      continue
    out.append(a)
  return [sys.executable, "-m", "experiments.study", *out, f"--arms={arm}"]


def study(cfg, workdir: str | Path, arms: str | Sequence[str], eval_tokens: int | None = None,
          eval_batch_size: int | None = None, collect_to: str | Path | None = None,
          telemetry: bool = True, parallel: int = 1, argv: Sequence[str] = (),
          keep_other_code: bool = False) -> list[dict]:
  """Runs the selected arms, then writes (and optionally collects) the study's rows and table.

  Args:
    eval_tokens: held-out tokens per arm's evaluation (``experiments.evaluate.eval_tokens``:
      default the config's ``study.eval_tokens``, else the whole validation split).
    parallel: with more than 1, the arms train up to that many at a time, each in a process of its
      own (``experiments._pool.run_parallel``) started with this command's flags ``argv`` (the
      program's command line without its name).
    keep_other_code: reuse a finished arm trained by other code as it is
      (``experiments.train.finished_run``; else it trains again, the old run kept aside).

  Returns:
    The rows of ``study.jsonl`` (every finished arm of the workdir).

  Raises:
    experiments.train.RunsFailedError: after the table, if an arm's process failed under
      ``parallel``.
  """
  workdir = Path(workdir)
  selected = select_arms(arms)
  if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
    raise ValueError(f"--parallel={parallel!r}: give 1 or more arms at a time")
  # The study's experiment is typed once; each arm's is made from it and checked before any trains.
  base = Experiment.from_config(cfg)
  eval_tokens = evaluate_lib.eval_tokens(cfg, eval_tokens, eval_batch_size)
  also = eval_texts(cfg)
  exps = {arm.name: arm_experiment(base, arm, telemetry) for arm in selected}
  child = bool(os.environ.get(_pool.CHILD_ENV))  # an arm of --parallel: the parent holds the lock
  make_folder(workdir, "study")
  if collect_to is not None and not child:  # a --collect that is a file: said now, not after the training
    make_folder(collect_to, "collection")
  lock = RunLock(workdir, "study")
  with lock if not child else contextlib.nullcontext(), StopSignals(
      lambda t: print(t, flush=True), BETWEEN_RUNS, lambda: lock.release(force=True)):
    for note in lock.notes:
      print(note, flush=True)
    check_workdir(cfg, workdir)
    pool = parallel > 1 and len(selected) > 1
    if not pool:  # the arms train in this process: one data step completes them all
      exps = with_data(exps)
    # Every finished arm to reuse is checked before any trains (the parent of a pool prepares the
    # data only for those, so that it leaves the device(s) to its arms' processes).
    if not child:
      for arm in selected:
        launcher.finished_run(exps[arm.name], workdir / arm.name, keep_other_code)
    failed = []
    if pool:
      failed = _pool.run_parallel([(a.name, a.what) for a in selected], parallel, workdir,
                                  lambda name: child_command(argv, name),
                                  on_start=lambda name: _shared(workdir / name, base.train.steps, parallel),
                                  result=lambda name: _eval_loss(workdir / name))
    else:
      for i, arm in enumerate(selected, 1):
        print(f"=== arm {arm.name} ({i}/{len(selected)}): {workdir / arm.name} — {arm.what}",
              flush=True)
        t0 = time.perf_counter()
        try:
          status = run_arm(exps[arm.name], arm, workdir, eval_tokens, eval_batch_size,
                           keep_other_code, also)
        except TrainingInterrupted as e:
          if child:
            raise
          raise launcher.stopped_among(e, "arm", arm.name, [a.name for a in selected[:i - 1]],
                                       [a.name for a in selected[i:]]) from None
        print(f"=== arm {arm.name}: {status} in {time.perf_counter() - t0:.0f} s, eval loss "
              f"{_eval_loss(workdir / arm.name):.4f}", flush=True)
    rows, text = write_results(base, workdir, eval_tokens)
  print("\n" + text + "\n\n" + (workdir / SUMMARY_FILE).read_text().rstrip(), flush=True)
  for other in also:
    table_file, _ = other_files(other)
    if (workdir / table_file).is_file():
      print("\n" + (workdir / table_file).read_text().rstrip(), flush=True)
  if collect_to is not None:
    files = collect(workdir, Path(collect_to))
    print(f"\ncollected {len(files)} files into {collect_to}", flush=True)
  if failed:
    raise launcher.RunsFailedError(f"arm(s) {', '.join(failed)} failed; their output is in "
                                   f"{workdir / 'logs'}/<arm>.log")
  return rows


def _shared(run_dir: Path, steps: int, parallel: int) -> None:
  """Marks an arm that is not finished yet as trained beside others (``SHARED_FILE``)."""
  if not is_finished(run_dir, steps):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SHARED_FILE).write_text(json.dumps({"parallel": parallel}) + "\n")


def _eval_loss(run_dir: Path) -> float:
  """The arm's held-out loss (``eval.json``); NaN for a diverged arm, which has none."""
  path = run_dir / EVAL_FILE
  return json.loads(path.read_text()).get("loss", math.nan) if path.is_file() else math.nan


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "the study's folder: one run folder per arm")
  flags.DEFINE_string("arms", None, f"all, or some of: {','.join(ARM_NAMES)}")
  flags.DEFINE_bool("list", False, "print the arms (name, preset, changes, seed, baseline, what) "
                    "and exit")
  flags.DEFINE_integer("eval_tokens", None, "evaluate at most this many held-out tokens",
                       lower_bound=1)
  flags.DEFINE_integer("eval_batch_size", None, "evaluation batch (default: the run's)",
                       lower_bound=1)
  flags.DEFINE_string("collect", None, "copy the small logs into this folder")
  flags.DEFINE_bool("telemetry", True, "log the per-module quantization error (--notelemetry: off)")
  flags.DEFINE_integer("parallel", 1, "train up to this many arms at once, one process each",
                       lower_bound=1)
  flags.DEFINE_bool("fit", False, "fit the scaling law of the arms in --results and print it "
                    "(experiments.scaling)")
  flags.DEFINE_string("results", None, "with --fit: a collected study's folder, or a folder of them")
  flags.DEFINE_string("fit_fixed", None, "with --fit: law constants held fixed, e.g. gamma=0.276,alpha=0.58")
  flags.DEFINE_integer("fit_bootstrap", 200, "with --fit: bootstrap replicates of the intervals (0: none)",
                       lower_bound=0)
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  launcher.define_cache_flag()
  launcher.define_keep_flag()


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  fl = flags.FLAGS
  if fl.list:
    print(list_arms())
    return
  if fl.fit:
    if not fl.results:
      raise app.UsageError("--fit needs --results=FOLDER (e.g. --results=experiments/results/grid_h100)")
    launcher.report_errors(lambda: print(scaling.run_fit(fl.results, fl.fit_fixed, fl.fit_bootstrap)),
                           fl.verbose)
    return
  launcher.check_command_line(argv, "python -m experiments.study --config=experiments/configs/"
                              "tiny.py --workdir=runs/study --arms=all", "config", "workdir",
                              "arms")
  launcher.enable_compilation_cache(fl.compilation_cache)
  _pool.watch_parent()
  launcher.report_errors(lambda: study(fl.config, fl.workdir, fl.arms, fl.eval_tokens,
                                       fl.eval_batch_size, fl.collect, fl.telemetry, fl.parallel,
                                       sys.argv[1:], fl.keep_other_code), fl.verbose, fl.workdir)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=launcher.parse_flags)
