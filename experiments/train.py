r"""Launcher: train one experiment config.

  python -m experiments.train --config=experiments/configs/tiny.py[:recipe] --workdir=runs/tiny \
      [--config.steps=N --config.<field>=<value> ...] [--distributed]

Prepares the data (``fp4jax.data.prepare``; reused when already there), writes
``<workdir>/config.json``, then trains with ``fp4jax.train.train``: metrics in
``<workdir>/metrics.jsonl`` and ``<workdir>/tb``, checkpoints in ``<workdir>/checkpoints``.
Running the same command again resumes from the last checkpoint.

Several hosts: start the same command on every host with ``--distributed``; it calls
``jax.distributed.initialize()``, which finds the coordinator under SLURM, Open MPI and TPU pods
(elsewhere set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``). The
workdir and the data folder must be on a shared file system; process 0 prepares the data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags



def define_flags() -> None:
  """The launcher's flags (defined only when run as a program, so the module imports cleanly)."""
  config_flags.DEFINE_config_file("config", None, "experiment config file[:recipe]",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "run directory (metrics, checkpoints)")
  flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first")


def from_config(cfg, vocab_size: int | None = None):
  """Typed arguments of ``fp4jax.train.train`` from an experiment ConfigDict.

  Args:
    cfg: the experiment config.
    vocab_size: the data's vocabulary, used when ``cfg.model.vocab_size`` is None (rounded up to
      a multiple of 128).

  Returns:
    ``(ModelConfig, Recipe, OptimizerConfig, TrainConfig)``.
  """
  from fp4jax.model import ModelConfig
  from fp4jax.recipe import get_recipe
  from fp4jax.train import OptimizerConfig, TrainConfig
  model = dict(cfg.model)
  if model["vocab_size"] is None:
    if vocab_size is None:
      raise ValueError("config model.vocab_size is None and no data vocabulary is known")
    model["vocab_size"] = -(-vocab_size // 128) * 128
  recipe = get_recipe(cfg.recipe, bf16_first_blocks=cfg.bf16_first_blocks,
                      bf16_last_blocks=cfg.bf16_last_blocks, lora_rank=cfg.lora_rank,
                      lora_resplit_every=cfg.lora_resplit_every)
  train_cfg = TrainConfig(
      steps=cfg.steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, grad_accum=cfg.grad_accum,
      seed=cfg.seed, log_every=cfg.log_every, eval_every=cfg.eval_every,
      eval_batches=cfg.eval_batches, checkpoint_every=cfg.checkpoint_every,
      keep_checkpoints=cfg.keep_checkpoints, mesh_shape=tuple(cfg.mesh_shape),
      progress=cfg.progress)
  return ModelConfig(**model), recipe, OptimizerConfig(**dict(cfg.optimizer)), train_cfg


def prepare_data(cfg) -> tuple[str, object]:
  """Prepares (or reuses) the token shards of ``cfg.data``; returns ``(data_dir, meta)``."""
  import jax
  from jax.experimental import multihost_utils

  from fp4jax import data
  if jax.process_count() > 1 and cfg.data.dir is None:
    raise ValueError("a multi-host run needs --config.data.dir on a shared file system")
  if jax.process_index() == 0:
    meta = data.prepare(cfg.data.corpus, cfg.data.dir, tokenizer=cfg.data.tokenizer,
                        vocab_size=cfg.data.vocab_size)
    out = cfg.data.dir or data.default_out_dir(meta.corpus["name"], cfg.data.tokenizer,
                                               cfg.data.vocab_size)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("fp4jax data prepared")
    if jax.process_index() != 0:
      out, meta = cfg.data.dir, data.read_meta(cfg.data.dir)
  return str(out), meta


def run(cfg, workdir: str | os.PathLike) -> dict:
  """Trains ``cfg`` in ``workdir`` (resuming if it holds a checkpoint); returns the summary."""
  import jax

  from fp4jax import data
  from fp4jax.train import train
  from fp4jax.recipe import get_recipe
  get_recipe(cfg.recipe).check_available()  # fail before preparing data
  data_dir, meta = prepare_data(cfg)
  model_cfg, recipe, opt_cfg, train_cfg = from_config(cfg, meta.vocab_size)
  recipe.check_available()
  data.check_compat(meta, model_cfg.vocab_size, seq_len=cfg.seq_len)
  workdir = Path(workdir)
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(
        {"config": cfg.to_dict(), "data_dir": data_dir, "vocab_size": model_cfg.vocab_size,
         "num_params": model_cfg.num_params(), "devices": jax.device_count(),
         "platform": jax.default_backend()}, indent=1, default=str))
  train_iter = data.make_iterator(data_dir, "train", cfg.seq_len, cfg.batch_size, seed=cfg.seed)
  eval_batches = lambda: data.make_iterator(  # noqa: E731
      data_dir, "validation", cfg.seq_len, cfg.batch_size, shuffle=False, repeat=False)
  return train(model_cfg, recipe, opt_cfg, train_cfg, workdir, train_iter, eval_batches)


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if flags.FLAGS.workdir is None:
    raise app.UsageError("--workdir is required")
  if flags.FLAGS.distributed:
    import jax
    jax.distributed.initialize()
  summary = run(flags.FLAGS.config, flags.FLAGS.workdir)
  print(json.dumps(summary))


if __name__ == "__main__":
  define_flags()
  app.run(main)
