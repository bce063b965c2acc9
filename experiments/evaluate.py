r"""Evaluate a run's latest checkpoint on any text: mean loss and perplexity.

  python -m experiments.evaluate --workdir=runs/tiny --text=FOLDER_OR_CORPUS \
      [--split=validation|all] [--max_tokens=N] [--batch_size=N] [--out=results.jsonl]

Restores the newest intact checkpoint of ``--workdir`` (``fp4jax.checkpoint``), tokenizes the text
with the run's tokenizer (its data folder's ``meta.json``, recorded in ``<workdir>/config.json``)
and computes the mean next-token loss over windows of the run's ``seq_len`` (window i is tokens
``[i·T, i·T + T + 1)`` of the documents, each followed by EOS, as ``fp4jax.data`` cuts them) with
the train loop's evaluation step. ``--text`` is:

* a built-in corpus name (``shakespeare``, ``mix``): its ``validation`` split by default, the
  documents held out from training (``--split=all`` adds the training documents);
* a folder of ``.txt`` files: evaluated whole by default; ``--split=validation`` takes the
  documents that training on that folder holds out (``fp4jax.corpus.text_dir_corpus``);
* one ``.txt`` file: evaluated whole.

The run's own corpus, where its text is not on this machine (a GPU machine given only the token
folder), is evaluated from the validation shards of the run's data folder (``from_shards``: the
same windows), each shard checked against its sha256 first.

Prints one line (loss and its standard error, perplexity, tokens, step); ``--out`` appends it as a
JSON line. The standard error is that of the mean over the evaluated batches (the text's own
variation: another sample of held-out text of this size would move the loss by about that much).
Evaluation runs on one device.

The launchers (``experiments.compare``, ``experiments.study``) evaluate each run's final checkpoint
here, on ``eval_tokens(cfg)`` held-out tokens (the whole held-out split unless the config says
otherwise), and keep the result in ``<run>/eval.json`` (``evaluate_cached``); a study evaluates each
arm on other texts too where its config names them (``study.eval_also``), each kept in
``<run>/eval_<name>.json`` (``eval_file``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging

from experiments import train as launcher
from fp4jax import corpus as corpus_lib
from fp4jax import data
from fp4jax import sharding as shd
from fp4jax import tokenizer as tokenizer_lib
from fp4jax.checkpoint import CHECKSUMS, Checkpointer
from fp4jax.experiment import Experiment
from fp4jax.train import abstract_model, jit_steps, make_optimizer, make_schedule

SPLITS = ("validation", "all")
EVAL_FILE = "eval.json"
EVAL_ALSO_GLOB = "eval_*.json"  # a run's evaluations on other texts (eval_file)


def eval_file(text: str | None = None) -> str:
  """The file of a run folder that keeps its evaluation on ``text``: ``eval.json`` for the run's own
  corpus (None), ``eval_<name>.json`` for another text, ``<name>`` the built-in corpus's name or
  the folder's or file's name (characters other than letters, digits, ``.``, ``-`` and ``_``
  replaced by ``_``)."""
  if text is None:
    return EVAL_FILE
  name = text if text in corpus_lib.CORPORA else Path(text).name
  return f"eval_{re.sub(r'[^A-Za-z0-9._-]+', '_', name) or '_'}.json"


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "run directory of experiments.train")
  flags.DEFINE_string("text", None, "built-in corpus name, folder of .txt files, or a .txt file")
  flags.DEFINE_enum("split", None, SPLITS, "validation (default for a corpus) or all (default "
                    "for a folder or file)")
  flags.DEFINE_integer("max_tokens", None, "evaluate at most this many tokens", lower_bound=1)
  flags.DEFINE_integer("batch_size", None, "windows per batch (default: the run's batch size)",
                       lower_bound=1)
  flags.DEFINE_string("encoding", None, "encoding of the .txt files (default: the run's)")
  flags.DEFINE_string("out", None, "append the result as a JSON line to this file")
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  launcher.define_cache_flag()


def read_run(workdir: str | os.PathLike) -> dict:
  """``<workdir>/config.json``, with a clear error for a missing run or a damaged file."""
  workdir = Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise NotADirectoryError(f"no run at {workdir}: it is a file, not a run's folder")
  if not workdir.is_dir():
    raise FileNotFoundError(f"no run at {workdir}: the folder does not exist")
  path = workdir / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{workdir} is not a run of experiments.train (no config.json)")
  try:
    return json.loads(path.read_text())
  except ValueError as e:  # JSONDecodeError, or bytes that are not text
    raise ValueError(f"{path} is damaged ({e}): the run's recorded config cannot be read; put back a copy "
                     "of it, or train again in a new folder") from e


def documents(text: str, split: str | None) -> tuple[list[Path], str]:
  """The text files of ``--text`` and the split they were taken from (see the module docstring)."""
  if text in corpus_lib.CORPORA:
    files = corpus_lib.builtin_corpus(text)
    split = split or "validation"
    return list(files.validation if split == "validation" else files.train + files.validation), \
        split
  path = Path(text)
  if path.is_file():
    if split == "validation":
      raise ValueError(f"--split=validation needs a corpus or a folder; {path} is one file "
                       "(evaluated whole)")
    return [path], "all"
  if not path.is_dir():
    raise FileNotFoundError(f"--text={text}: neither a built-in corpus "
                            f"{sorted(corpus_lib.CORPORA)} nor an existing folder or .txt file")
  split = split or "all"
  if split == "validation":
    return list(corpus_lib.text_dir_corpus(path).validation), split
  files = sorted(path.rglob("*.txt"))
  if not files:
    raise ValueError(f"{path} holds no .txt files")
  return files, split


def windows(tok: tokenizer_lib.Tokenizer, files: Sequence[Path], seq_len: int,
            encoding: str = "utf-8", shard_tokens: int = data.DEFAULT_SHARD_TOKENS) -> np.ndarray:
  """(N, seq_len + 1) int32 windows of the documents, each followed by EOS, as ``fp4jax.data``
  cuts a split: consecutive windows of a shard of ``shard_tokens`` tokens, overlapping by one."""
  ids = [np.append(tok.encode_batch([corpus_lib.read_text(f, encoding)])[0], tok.eos_id)
         for f in files]
  stream = np.concatenate(ids).astype(np.int32)
  out = [data.cut_windows(stream[s:s + shard_tokens], seq_len) for s in range(0, len(stream), shard_tokens)]
  w = np.concatenate(out) if out else np.zeros((0, seq_len + 1), np.int32)
  if not len(w):
    raise ValueError(f"the text has {len(stream)} tokens, fewer than one window of seq_len + 1 = "
                     f"{seq_len + 1}")
  return w


def check_size(max_tokens: int | None, batch_size: int | None, seq_len: int,
               names: tuple[str, str] = ("--max_tokens", "--batch_size")) -> None:
  """Checks an evaluation's size before anything runs.

  Args:
    max_tokens: tokens to evaluate at most (None: all); at least one window of ``seq_len``.
    batch_size: windows per batch (None: the run's); at least 1.
    seq_len: the run's sequence length.
    names: how the two settings are named in the message (flags or config fields).

  Raises:
    ValueError: a setting out of range, naming it and its range.
  """
  for name, value, low in ((names[0], max_tokens, seq_len), (names[1], batch_size, 1)):
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      what = f"at least one window (seq_len {seq_len})" if low == seq_len else "at least 1"
      raise ValueError(f"{name}={value!r}: give an int, {what}")


def from_shards(text: str, split: str | None, exp: Experiment, data_dir: str | os.PathLike) -> bool:
  """Whether the held-out windows of ``text`` come from the run's token folder: ``text`` is the
  run's own corpus, its validation split is asked for, its text is not on this machine
  (``fp4jax.corpus.text_is_here``) and ``data_dir`` holds that corpus. The shards hold the same
  documents in the same order, tokenized by the same tokenizer; cut into shards of
  ``fp4jax.data.DEFAULT_SHARD_TOKENS`` (``prepare``'s default) they give the same windows as the
  text."""
  if text != exp.data.corpus or split not in (None, "validation") or corpus_lib.text_is_here(text):
    return False
  try:
    meta = data.read_meta(data_dir)
  except (OSError, ValueError):
    return False
  return meta.corpus.get("name") == corpus_lib.corpus_name(text) and "validation" in meta.splits


def evaluate(workdir: str | os.PathLike, text: str, split: str | None = None,
             max_tokens: int | None = None, batch_size: int | None = None,
             encoding: str | None = None, exp: Experiment | None = None) -> dict:
  """Loss and perplexity of the latest checkpoint of ``workdir`` on ``text``.

  Args:
    exp: the run's experiment, completed by its data step (``experiments.train.prepare_data``), as
      a launcher that trained or checked the run holds it; default: the run's recorded config
      (``<workdir>/config.json``), typed here.

  Returns:
    ``{"workdir", "step", "text", "split", "loss", "loss_se", "perplexity", "tokens", "windows",
    "seq_len", "batch_size", "checkpoint", "batch_losses", "batch_windows"}``; ``loss`` is the mean
    over the windows' target tokens (nats), ``loss_se`` its standard error over the batches
    (``standard_error``), ``batch_losses`` the mean of each batch of ``batch_windows`` windows, in
    order, and ``checkpoint`` the digest of the evaluated checkpoint (``checkpoint_digest``).

  Raises:
    ValueError: ``max_tokens`` or ``batch_size`` out of range (``check_size``), or no window.
    FileNotFoundError: no run or no checkpoint in ``workdir``.
  """
  run = read_run(workdir)
  if exp is None:
    exp = Experiment.from_config(run["config"])
    if exp.model.vocab_size is None:
      exp = exp.with_changes({"model.vocab_size": run["vocab_size"]})
  model_cfg, recipe, opt_cfg, tc, execution = exp.model, exp.recipe, exp.optimizer, exp.train, exp.execution
  check_size(max_tokens, batch_size, tc.seq_len)
  ckpt_dir = Path(workdir) / "checkpoints"
  if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
    raise FileNotFoundError(f"run {workdir} has no checkpoint yet (nothing in {ckpt_dir})")
  if exp.data.tokenizer == "byte":
    tok = tokenizer_lib.ByteTokenizer()
  else:
    tok = data.load_tokenizer(run["data_dir"])
  if from_shards(text, split, exp, run["data_dir"]):
    w, split = data.split_windows(run["data_dir"], "validation", tc.seq_len), "validation"
  else:
    files, split = documents(text, split)
    # Built-in corpora are stored as UTF-8; user text is in the run's (or the given) encoding.
    enc = "utf-8" if text in corpus_lib.CORPORA else encoding or exp.data.encoding
    w = windows(tok, files, tc.seq_len, enc)
  if max_tokens is not None:
    w = w[:max_tokens // tc.seq_len]

  mesh = shd.make_mesh((1, 1, 1))
  tx = make_optimizer(opt_cfg, recipe, tc.steps, seed=tc.seed, execution=execution)
  graphdef, params = abstract_model(model_cfg, recipe, execution)
  rep = shd.replicated(mesh)
  abstract = {"step": jax.ShapeDtypeStruct((), np.int32), "params": params,
              "opt_state": jax.eval_shape(tx.init, params),
              "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}
  shardings = jax.tree.map(lambda _: rep, abstract)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abstract)
  ckpt = Checkpointer(ckpt_dir, every=1)
  try:
    step, state = ckpt.restore(abstract)
  finally:
    ckpt.close()
  # The model as it trained at its last step (after a BF16-forward switch: Recipe.at_step).
  graphdef, _ = abstract_model(model_cfg, recipe.at_step(step - 1, tc.steps), execution)
  _, eval_step = jit_steps(graphdef, tx, make_schedule(opt_cfg, tc.steps), shardings, mesh,
                           execution=execution)
  b = batch_size or tc.batch_size
  losses, sizes = [], []
  for i in range(0, len(w), b):
    chunk = w[i:i + b]
    batch = data.to_global_batch({"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}, mesh)
    losses.append(float(eval_step(state["params"], batch)))
    sizes.append(len(chunk))
  total = 0.0
  for loss_i, n in zip(losses, sizes, strict=True):
    total += loss_i * n
  loss = total / len(w)
  return {"workdir": str(workdir), "step": int(step), "text": str(text), "split": split,
          "loss": loss, "loss_se": standard_error(losses, sizes), "perplexity": math.exp(loss),
          "tokens": int(w.shape[0] * tc.seq_len), "windows": int(w.shape[0]),
          "seq_len": tc.seq_len, "batch_size": b, "checkpoint": checkpoint_digest(ckpt_dir / str(step)),
          "batch_losses": losses, "batch_windows": sizes}


def checkpoint_digest(step_dir: str | os.PathLike) -> str | None:
  """What identifies a saved checkpoint: the sha256 of its checksum file (the size and sha256 of
  each of its files, ``fp4jax.checkpoint``); None for a step without one."""
  path = Path(step_dir) / CHECKSUMS
  return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def standard_error(values: Sequence[float], weights: Sequence[float]) -> float:
  """Standard error of the weighted mean of per-batch means (each batch one sample, weighted by its
  windows): ``sqrt(n / (n - 1) · Σ (w_i (x_i − x̄))²) / Σ w_i``, which for equal batches is the
  sample standard deviation over ``√n``. NaN for fewer than two batches."""
  n = len(values)
  if n < 2:
    return math.nan
  total = float(sum(weights))
  mean = sum(x * w for x, w in zip(values, weights, strict=True)) / total
  ss = sum((w * (x - mean)) ** 2 for x, w in zip(values, weights, strict=True))
  return math.sqrt(n / (n - 1) * ss) / total


def eval_tokens(cfg, tokens: int | None = None, batch_size: int | None = None) -> int | None:
  """The held-out tokens a launcher evaluates a run on: ``tokens`` if given, else the config's
  ``eval_tokens`` (``study.eval_tokens``, for a corpus whose held-out split is large), else None:
  the whole held-out split.

  Raises:
    ValueError: the tokens (``--eval_tokens`` or ``study.eval_tokens``) or ``batch_size``
      (``--eval_batch_size``) out of range (``check_size``, against the config's ``seq_len``).
  """
  name = "--eval_tokens"
  if tokens is None:
    tokens, name = cfg.get("study", {}).get("eval_tokens"), "config study.eval_tokens"
  check_size(tokens, batch_size, cfg.seq_len, (name, "--eval_batch_size"))
  return tokens


def evaluate_cached(workdir: str | os.PathLike, text: str, steps: int, max_tokens: int | None,
                    batch_size: int | None = None, exp: Experiment | None = None,
                    file: str = EVAL_FILE) -> dict:
  """``evaluate`` of a finished run on the ``validation`` split of ``text``, kept in
  ``<workdir>/<file>`` (``eval.json``; ``eval_file`` names those of other texts than the run's
  corpus) and reused while what it measured is what is asked: the step, text,
  ``max_tokens``, batch size (``batch_size``, else the run's) and the checkpoint itself (its
  digest: a run trained again to the same step is evaluated again). Settings out of range are
  refused before anything is evaluated or written.

  ``step`` in the result is the step evaluated: the newest intact checkpoint's, which is not
  ``steps`` if the final checkpoint turned out corrupt (said; the result is still written, and a
  launcher does not compare it).
  """
  workdir = Path(workdir)
  path = workdir / file
  run_batch = exp.train.batch_size if exp is not None else read_run(workdir)["config"]["batch_size"]
  key = {"text": text, "max_tokens": max_tokens, "batch_size": batch_size or run_batch,
         "checkpoint": checkpoint_digest(workdir / "checkpoints" / str(steps))}
  if path.is_file():
    try:
      cached = json.loads(path.read_text())
    except ValueError:  # a damaged cache: evaluated again
      cached = {}
    if cached.get("step") == steps and all(cached.get(k) == v for k, v in key.items()):
      return cached
  r = evaluate(workdir, text, "validation", max_tokens, batch_size, exp=exp)
  r.update(key)
  if r["step"] != steps:
    print(f"{workdir.name}: evaluated at step {r['step']}, not {steps}: the final checkpoint is "
          "not intact; the row says so and is not compared", flush=True)
  tmp = path.with_name(file + ".tmp")
  tmp.write_text(json.dumps(r, indent=1) + "\n")
  os.replace(tmp, path)
  return r


def check_out(out: str | os.PathLike) -> None:
  """Raises unless ``out`` can take ``--out``'s line: IsADirectoryError where it is a folder,
  FileNotFoundError where its folder is missing (or is a file); each message names the fix."""
  out = Path(out)
  if out.is_dir():
    raise IsADirectoryError(f"--out={out} is a folder: name a file (the result is appended to it as a JSON line)")
  if not out.parent.is_dir():
    raise FileNotFoundError(f"--out={out}: its folder {out.parent} does not exist or is not a folder; name a "
                            "file in an existing folder")


def main(argv):
  logging.set_verbosity(logging.WARNING)
  fl = flags.FLAGS
  launcher.check_command_line(argv, "python -m experiments.evaluate --workdir=runs/tiny "
                              "--text=shakespeare", "workdir", "text")
  if fl.out:  # checked before the evaluation, not after it
    launcher.report_errors(lambda: check_out(fl.out), fl.verbose, fl.out)
  launcher.enable_compilation_cache(fl.compilation_cache)
  r = launcher.report_errors(lambda: evaluate(fl.workdir, fl.text, fl.split, fl.max_tokens,
                                              fl.batch_size, fl.encoding), fl.verbose, fl.workdir)
  se = f" ± {r['loss_se']:.4f}" if math.isfinite(r["loss_se"]) else ""  # one batch: none
  print(f"loss {r['loss']:.4f}{se} | perplexity {r['perplexity']:.3f} | {r['tokens']:,} tokens "
        f"({r['windows']} windows of {r['seq_len']}) | {r['text']} ({r['split']}) | step "
        f"{r['step']} of {r['workdir']}", flush=True)
  if fl.out:
    def append():
      with open(fl.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    launcher.report_errors(append, fl.verbose, fl.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
