"""Sharded training, in three modules, with their names gathered here:

- ``fp4jax.optim.factory``: ``OptimizerConfig``, ``make_schedule``, ``make_optimizer``;
- ``fp4jax.step``: the pure part (``init_state``, ``loss_fn``, ``make_train_step``, ``jit_steps``,
  ``evaluate``);
- ``fp4jax.loop``: the run loop, ``fp4jax.loop.train(exp, workdir, ...)`` over a typed
  ``fp4jax.experiment.Experiment`` (``TrainConfig`` is one of its parts).

``train`` here takes the experiment's parts one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from fp4jax import loop
from fp4jax.execution import Execution
from fp4jax.experiment import Experiment, TrainConfig
from fp4jax.loop import NonFiniteLossError
from fp4jax.model import ModelConfig
from fp4jax.optim.factory import LORA_PARAMS, OPTIMIZERS, SCHEDULES, OptimizerConfig, make_optimizer, make_schedule
from fp4jax.optim.factory import _lora_mask as _lora_mask  # imported from here by tests
from fp4jax.recipe import Recipe
from fp4jax.step import abstract_model, evaluate, init_state, jit_steps, loss_fn, make_eval_step, make_train_step

__all__ = [
    "LORA_PARAMS",
    "OPTIMIZERS",
    "SCHEDULES",
    "NonFiniteLossError",
    "OptimizerConfig",
    "TrainConfig",
    "abstract_model",
    "evaluate",
    "init_state",
    "jit_steps",
    "loss_fn",
    "make_eval_step",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "train",
]


def train(model_cfg: ModelConfig, recipe: Recipe, opt_cfg: OptimizerConfig,
          train_cfg: TrainConfig, workdir, train_iter: Iterator,
          eval_batches: Callable[[], Iterator] | None = None, *, mesh=None,
          data_info: Mapping | None = None, config: Mapping | None = None,
          allow_changes: Sequence[str] = (), execution: Execution = Execution()) -> dict:
  """``fp4jax.loop.train`` of the experiment of these parts (its docstring says what a run does
  and raises).

  Args:
    model_cfg: model hyperparameters.
    recipe: the precision recipe.
    opt_cfg: optimizer and schedule.
    train_cfg: steps, batch, loss, logging, eval and checkpoint cadence.
    workdir: run directory.
    train_iter: this host's training batches ``{"inputs", "targets"}`` (B_local, T).
    eval_batches: returns a fresh iterator over the held-out batches (same batches every call).
    mesh: the device mesh (default ``make_mesh(train_cfg.mesh_shape)``).
    data_info: JSON-able description of the training data, part of the run's identity.
    config: JSON-able full config, recorded in ``<workdir>/config.json``.
    allow_changes: identity fields a resume may change (``fp4jax.workdir.CHANGEABLE``).
    execution: which code runs each op; not part of the run's identity.

  Returns:
    Summary: ``step``, ``loss`` (last), ``eval_loss`` (last), ``tokens_per_s``, ``mfu``,
    ``workdir``.
  """
  exp = Experiment(model=model_cfg, recipe=recipe, optimizer=opt_cfg, train=train_cfg,
                   execution=execution, data_info=data_info)
  return loop.train(exp, workdir, train_iter, eval_batches, mesh=mesh, config=config,
                    allow_changes=allow_changes)
