r"""Launcher: train one experiment config.

  python -m experiments.train --config=experiments/configs/tiny.py[:recipe] --workdir=runs/tiny \
      [--config.steps=N --config.<field>=<value> --config.model.<field>=<value> ...] [--distributed]

Every field of the config can be set on the command line (``experiments/configs/_base.py`` lists
the sections: ``recipe``, ``model``, ``optimizer``, ``data``, and the ``TrainConfig`` fields at the
top level). Types the config once (``fp4jax.experiment.Experiment.from_config``), prepares the
data (``fp4jax.data.prepare``; reused when already there), which completes the experiment with its
vocabulary, writes ``<workdir>/config.json``, then trains with ``fp4jax.loop.train``: metrics in
``<workdir>/metrics.jsonl`` and ``<workdir>/tb``, checkpoints in ``<workdir>/checkpoints``, one
progress line per logged step on stdout when it is not a terminal. Running the same command again
resumes from the last checkpoint.

A run refuses a workdir another live process trains in, and a resume that changes the run's
identity (optimizer settings, data, batch size, sequence length, seed) unless
``--allow_changes=<field>,...`` allows it (recorded in ``<workdir>/config_history.jsonl``).
Compiled programs are kept in JAX's persistent compilation cache (``--compilation_cache``, default
``$FP4JAX_CACHE`` or ``~/.cache/fp4jax/xla``; empty turns it off), so a resumed run, another seed
of the same config, or a second launch skips most of XLA's compilation.
SIGTERM / Ctrl-C / SIGHUP save a checkpoint at the current step and exit with status 128 + the signal.
Errors in the command line, config or data print as one ``error:`` message (what is wrong, what to
do); ``--verbose`` (or ``FP4JAX_VERBOSE=1``) adds the traceback.

Several hosts: start the same command on every host with ``--distributed``; it calls
``jax.distributed.initialize()``, which finds the coordinator under SLURM, Open MPI and TPU pods
(elsewhere set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``). The
workdir and the data folder must be on a shared file system; process 0 prepares the data.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
from absl import app, flags, logging
from jax.experimental import multihost_utils
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from fp4jax import data, loop
from fp4jax.checkpoint import (Checkpointer, CheckpointSaveError, CorruptCheckpointError, no_space,
                               quiet_full_disk_logs, space_line, verify)
from fp4jax.corpus import CorpusUnavailableError
from fp4jax.experiment import Experiment
from fp4jax.loop import NonFiniteLossError
from fp4jax.preemption import SIGNALS, TrainingInterrupted
from fp4jax.recipe import MODULES
from fp4jax.workdir import (CODE_KEY, RunChangedError, RunLock, RunLockedError, code_version,
                            describe_code, identity, identity_diffs, same_code)


class RunsFailedError(RuntimeError):
  """Runs a launcher started in processes of their own failed; the message names their logs."""


# Errors of the user's command, config, data or run directory: printed as one message.
USER_ERRORS = (ValueError, OSError, CorpusUnavailableError, RunLockedError, CorruptCheckpointError,
               CheckpointSaveError, NonFiniteLossError, RunsFailedError)


def define_flags() -> None:
  """The launcher's flags (defined only when run as a program, so the module imports cleanly)."""
  config_flags.DEFINE_config_file("config", None, "experiment config file[:recipe]",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "run directory (metrics, checkpoints)")
  flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first")
  flags.DEFINE_list("allow_changes", [], "identity fields a resume may change (optimizer, data, "
                    "batch_size, seq_len, seed, or a field inside one, e.g. "
                    "optimizer.learning_rate)")
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  define_cache_flag()


def default_cache_dir() -> str:
  """``$FP4JAX_CACHE`` if set, else ``~/.cache/fp4jax/xla``."""
  return os.environ.get("FP4JAX_CACHE") or str(Path.home() / ".cache" / "fp4jax" / "xla")


def define_keep_flag() -> None:
  flags.DEFINE_bool("keep_other_code", False, "reuse a finished run trained by other code (another "
                    "fp4jax source, or one that recorded none) as it is, instead of training it again")


def define_cache_flag() -> None:
  flags.DEFINE_string("compilation_cache", default_cache_dir(),
                      "directory of JAX's persistent compilation cache (empty: off)")


def enable_compilation_cache(path: str | os.PathLike | None) -> None:
  """Points JAX's persistent compilation cache at ``path`` (created if missing); None or "" leaves
  JAX's setting alone. Programs that took at least ``jax_persistent_cache_min_compile_time_secs``
  (1 s by default) to compile are written there and loaded instead of recompiled by any later
  process that builds the same program on the same backend and JAX version. A directory that cannot
  be created is reported and the run goes on without the cache."""
  if not path:
    return
  path = Path(path).expanduser()
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    print(f"compilation cache off: cannot create {path}: {e}", file=sys.stderr, flush=True)
    return
  jax.config.update("jax_compilation_cache_dir", str(path))


def report_errors(fn: Callable[[], object], verbose: bool = False,
                  where: str | os.PathLike | None = None) -> object:
  """Runs ``fn``; a user error exits with ``error: <message>`` (and the traceback if
  ``verbose``), an interrupted run with its one line and status 128 + the signal.

  A full disk, from any writer (orbax/tensorstore, numpy, the tokenizer, a file), is one line
  naming the path (the error's file, else ``where``) and the space free there; without
  ``verbose`` the error logs with tracebacks that orbax writes for it are hidden
  (``fp4jax.checkpoint.quiet_full_disk_logs``)."""
  verbose = verbose or os.environ.get("FP4JAX_VERBOSE", "") not in ("", "0")
  quiet_full_disk_logs(not verbose)
  try:
    return fn()
  except TrainingInterrupted as e:
    for s in SIGNALS:  # the stop is done: another signal (a second Ctrl-C) adds nothing now
      signal.signal(s, signal.SIG_IGN)
    print(str(e), file=sys.stderr, flush=True)
    raise SystemExit(e.exit_code) from None
  except KeyboardInterrupt:  # Ctrl-C outside a run (an evaluation, a check): nothing to save
    if verbose:
      traceback.print_exc()
    print("stopped by SIGINT: nothing was training, nothing to save", file=sys.stderr, flush=True)
    raise SystemExit(128 + signal.SIGINT) from None
  except Exception as e:
    full = no_space(e)
    if not (full or isinstance(e, USER_ERRORS)):
      raise
    if verbose:
      traceback.print_exc()
    hint = "" if verbose else " (--verbose shows the traceback)"
    print(f"error: {full_disk_line(e, where) if full else e}{hint}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None


def full_disk_line(e: BaseException, where: str | os.PathLike | None) -> str:
  """The one line of a full disk: the error's own when it names the path and the space
  (``fp4jax.checkpoint.space_line``), else one made from its file (or ``where``)."""
  text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
  if "no space left on device at" in text:
    return text[text.index("no space left on device at"):]
  path = next((x.filename for x in (e, e.__cause__, e.__context__)
               if isinstance(x, OSError) and x.filename), None) or where or os.getcwd()
  return space_line(path, None, "writing there")


def parse_flags(argv: Sequence[str]) -> list[str]:
  """``app.run``'s flag parser for the launchers with a ``--config``: absl's, except that an override
  of a field the config does not have (``--config.optimizer.lr=1``), which ml_collections raises as a
  bare ``AttributeError``, is reported as absl reports a bad flag: one line naming the flag and the
  fields that are there, and exit status 1; so is a config file whose ``get_config`` refuses its
  argument (``--config=experiments/configs/grid.py:m99``: the error's own line, not its traceback)."""
  spec = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  loaded = None  # the config as ml_collections' own loader reads it (absl's parse below reads it again)
  if spec is not None:
    try:
      loaded = ConfigFileFlagParser("config").parse(spec)
    except ValueError as e:  # ml_collections puts the traceback in the text; its last line is the error
      line = str(e).strip().splitlines()[-1].removeprefix("ValueError: ")
      print(f"FATAL Flags parsing error: flag --config={spec}: {line}", file=sys.stderr, flush=True)
      raise SystemExit(1) from None
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:
    text = str(e)  # ml_collections' KeyError, quoted: "'lr'", or "'d_modl'\nDid you mean ...?"
    overrides = [a[2:].split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
    found = next(((o, c) for o in overrides for c in o.split(".")[1:]
                  if re.search(rf"\\?'{re.escape(c)}\\?'", text)), None)
    if found is None:
      raise
    path, key = found
    parts = path.split(".")[1:]
    parent = ".".join(parts[:parts.index(key)])
    fields = ""
    try:
      node = loaded
      for name in filter(None, parent.split(".")):
        node = node[name]
      fields = f"; its fields: {', '.join(sorted(node.keys()))}"
    except Exception:  # the listing is a courtesy; the error line stands without it
      pass
    where = f"config.{parent}" if parent else "the config"
    if m := re.search(r'Did you mean "([^"]+)"', text):
      fields = f"; did you mean {m[1]!r}?" + fields
    print(f"FATAL Flags parsing error: flag --{path}: {where} has no field {key!r}{fields}",
          file=sys.stderr, flush=True)
    raise SystemExit(1) from None


def check_command_line(argv: Sequence[str], example: str, *required: str) -> None:
  """Exits with a two-line message (what is wrong, an example command) on positional arguments
  or a missing required flag."""
  missing = [n for n in required if getattr(flags.FLAGS, n) is None]
  if len(argv) > 1 or missing:
    what = (f"unexpected arguments {argv[1:]}" if len(argv) > 1
            else f"missing {', '.join('--' + n for n in missing)}")
    print(f"error: {what}\n  e.g. {example}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def experiment(cfg) -> Experiment:
  """``cfg`` typed (``Experiment.from_config``), or ``cfg`` itself if it is an ``Experiment``."""
  return cfg if isinstance(cfg, Experiment) else Experiment.from_config(cfg)


def from_config(cfg, vocab_size: int | None = None):
  """The parts of ``Experiment.from_config(cfg)``, with ``model.vocab_size`` set.

  Args:
    cfg: the experiment config.
    vocab_size: the data's vocabulary, used when ``cfg.model.vocab_size`` is None (rounded up to
      a multiple of 128).

  Returns:
    ``(ModelConfig, Recipe, OptimizerConfig, TrainConfig, Execution)``.

  Raises:
    ValueError: a key that no dataclass has, an invalid value, or no vocabulary.
  """
  exp = Experiment.from_config(cfg)
  if exp.model.vocab_size is None:
    if vocab_size is None:
      raise ValueError("config model.vocab_size is None and no data vocabulary is known")
    exp = exp.with_changes({"model.vocab_size": -(-vocab_size // 128) * 128})
  return exp.model, exp.recipe, exp.optimizer, exp.train, exp.execution


DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed() -> None:
  """``jax.distributed.initialize()``; without a coordinator (no SLURM, Open MPI or TPU pod found,
  and the environment variables unset) a ``ValueError`` that says what to set."""
  try:
    jax.distributed.initialize()
  except ValueError as e:
    if "coordinator" not in str(e):
      raise
    unset = [v for v in DISTRIBUTED_ENV if not os.environ.get(v)]
    raise ValueError(
        f"--distributed found no coordinator ({e}): jax.distributed.initialize() detects SLURM, "
        f"Open MPI and TPU pods; elsewhere set {', '.join(DISTRIBUTED_ENV)} on every host (e.g. "
        "JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 on the first); "
        f"unset now: {', '.join(unset) or 'none'}. One host needs no --distributed") from e


def prepare_data(exp: Experiment) -> Experiment:
  """Prepares (or reuses) the token shards of ``exp.data``.

  Returns:
    ``exp`` completed with its data (``Experiment.with_data``): the shards' folder, their
    description (part of the run's identity) and, where ``model.vocab_size`` is None, the data's
    vocabulary.
  """
  spec = exp.data
  if jax.process_count() > 1 and spec.dir is None:
    raise ValueError("a multi-host run needs --config.data.dir on a shared file system")
  if jax.process_index() == 0:
    print(f"preparing data: corpus {spec.corpus}, tokenizer {spec.tokenizer}", flush=True)
    meta = data.prepare(spec.corpus, spec.dir, tokenizer=spec.tokenizer,
                        vocab_size=spec.vocab_size, encoding=spec.encoding)
    out = spec.dir or data.default_out_dir(meta.corpus["name"], spec.tokenizer, spec.vocab_size)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("fp4jax data prepared")
    if jax.process_index() != 0:
      out, meta = spec.dir, data.read_meta(spec.dir)
  return exp.with_data(str(out), {"corpus": meta.corpus, "tokenizer": meta.tokenizer,
                                  "vocab_size": meta.vocab_size})


_KEPT: set[str] = set()  # runs of other code reused (and said) in this process


def finished_run(exp, workdir: str | os.PathLike, keep_other_code: bool = False) -> bool:
  """Whether ``workdir`` holds a finished run of ``exp`` that a launcher may reuse as is.

  True if its checkpoint of step ``exp.train.steps`` verifies and was saved by a run of the same
  identity (``fp4jax.workdir.identity``) and the same code (``fp4jax.workdir.code_version``);
  False if there is no such step, or it is corrupt (said; training again resumes from the newest
  intact step), or it was saved by other code or by a run that recorded none: then the message
  names that code and the run is moved to ``<workdir>.other-code-<time>`` (kept; training again
  starts afresh), unless ``keep_other_code`` reuses it as it is (said too).

  Args:
    exp: an ``Experiment`` (its data is prepared here unless it was) or an experiment config.
    workdir: the run's folder.
    keep_other_code: reuse a finished run of the same identity whatever code trained it.

  Raises:
    RunChangedError: the finished run has another identity (the fields are named).
  """
  exp = experiment(exp)
  steps = exp.train.steps
  step_dir = Path(workdir) / "checkpoints" / str(steps)
  if not step_dir.is_dir():
    return False
  if (why := verify(step_dir)) not in (None, "unverified"):
    print(f"the final checkpoint {step_dir} is corrupt ({why}): training again from the newest "
          "intact step", flush=True)
    return False
  if exp.data_info is None:
    exp = prepare_data(exp)
  ckpt = Checkpointer(step_dir.parent, every=1)
  try:
    saved = ckpt.read_meta(steps)
  finally:
    ckpt.close()
  if diffs := identity_diffs(saved, identity(exp)):
    raise RunChangedError(
        f"{workdir} holds a finished run of other settings, so it cannot stand for this one:\n  "
        + "\n  ".join(diffs) + "\nuse another --workdir, or that run's settings")
  code = saved.get(CODE_KEY)
  if same_code(code):
    return True
  theirs, mine = describe_code(code), describe_code(code_version())
  if keep_other_code:
    if (said := str(Path(workdir).absolute())) not in _KEPT:  # once per run in a process
      _KEPT.add(said)
      print(f"{workdir}: reusing the run trained by {theirs}, not by this {mine} "
            "(--keep_other_code)", flush=True)
    return True
  aside = Path(f"{Path(workdir)}.other-code-{time.strftime('%Y%m%d-%H%M%S')}")
  os.rename(workdir, aside)
  print(f"{workdir} was trained by {theirs}, not by this {mine}: training it again (the old run is "
        f"kept in {aside}; --keep_other_code reuses it as it is)", flush=True)
  return False


def stopped_among(e: TrainingInterrupted, kind: str, name: str, done: Sequence[str],
                  pending: Sequence[str]) -> TrainingInterrupted:
  """The interruption of a launcher of several runs (a study's arms, a comparison's recipes), ``e``
  being that of run ``name``: one message saying where each stopped; the same exit status."""
  parts = [f"stopped by {e.signal_name}: {kind} {name} at step {e.step} ({e})"]
  if done:
    parts.append(f"finished: {', '.join(done)}")
  if pending:
    parts.append(f"not started: {', '.join(pending)}")
  return TrainingInterrupted("; ".join(parts) + "; the same command resumes every one",
                             e.exit_code - 128, e.step, e.checkpoint)


def run(exp, workdir: str | os.PathLike, allow_changes: Sequence[str] = ()) -> dict:
  """Trains an experiment in ``workdir`` (resuming if it holds a checkpoint); returns the summary.

  Args:
    exp: an ``Experiment``, or an experiment config (typed here, once: every field is checked
      before the data is prepared). Its data is prepared here unless ``exp.data_info`` is set
      (``prepare_data`` ran), and checked (``fp4jax.data.check_data``) before the model is built.
    workdir: the run's folder.
    allow_changes: identity fields a resume may change.
  """
  recorded = exp.to_config() if isinstance(exp, Experiment) else exp.to_dict()
  exp = experiment(exp)
  workdir = Path(workdir)
  with RunLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext() as lock:
    for note in getattr(lock, "notes", ()):
      print(note, flush=True)
    if exp.data_info is None:
      exp = prepare_data(exp)
    tc, data_dir = exp.train, exp.data.dir
    meta = data.check_data(data_dir, exp.model.vocab_size, tc.seq_len, tc.batch_size)
    if jax.process_index() == 0:
      modules = ", ".join(f"{k}={getattr(exp.recipe, k)}" for k in MODULES)
      print(f"training {exp.name} in {workdir}: recipe {modules}", flush=True)
    config = {"config": recorded, "data_dir": data_dir, "vocab_size": exp.model.vocab_size,
              "train_tokens": meta.num_tokens("train"),
              "num_params": exp.model.num_params(), "devices": jax.device_count(),
              "platform": jax.default_backend(), "code": code_version()}
    train_iter = data.make_iterator(data_dir, "train", tc.seq_len, tc.batch_size, seed=tc.seed)
    eval_batches = lambda: data.make_iterator(
        data_dir, "validation", tc.seq_len, tc.batch_size, shuffle=False, repeat=False)
    return loop.train(exp, workdir, train_iter, eval_batches, config=config,
                      allow_changes=allow_changes)


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  fl = flags.FLAGS
  check_command_line(argv, "python -m experiments.train --config=experiments/configs/tiny.py "
                     "--workdir=runs/tiny", "config", "workdir")
  if fl.distributed:
    report_errors(initialize_distributed, fl.verbose)
  enable_compilation_cache(fl.compilation_cache)
  summary = report_errors(lambda: run(fl.config, fl.workdir, fl.allow_changes), fl.verbose,
                          fl.workdir)
  print(json.dumps(summary))


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)
