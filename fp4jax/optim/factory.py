"""The optimizer of a training run: its config, its learning-rate schedule and its optax chain.

``make_optimizer(cfg, recipe, total_steps)`` wires ``OptimizerConfig`` (AdamW or Muon, the
schedule, clipping, weight decay) to the precision recipe's optimizer settings (NVFP4 moments,
NVFP4 Newton–Schulz, the LoRA-SVD branch's learning-rate scale). It reads only the recipe's
attributes, so this module imports no model code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from fp4jax.execution import Execution
from fp4jax.optim.adam import adamw_nvfp4
from fp4jax.optim.muon import muon_nvfp4

if TYPE_CHECKING:
  from fp4jax.recipe import Recipe

SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer and learning-rate schedule.

  Attributes:
    name: "adamw" or "muon" (``fp4jax.optim.muon_nvfp4``: Muon on 2-D block weights, AdamW on
      the embedding, the LM head and vectors; the learning rate is shared).
    learning_rate: peak learning rate.
    b1, b2, eps: Adam moments' decay rates and epsilon.
    weight_decay: decoupled weight decay, applied to parameters with ndim >= 2.
    grad_clip: clip the global gradient norm to this (0 disables).
    schedule: "cosine" (warmup + cosine to ``min_lr_ratio``), "wsd" (warmup, stable, linear
      decay over the last ``decay_fraction`` of the steps to ``min_lr_ratio``) or "constant"
      (after warmup).
    warmup_steps: linear warmup from 0.
    decay_fraction: WSD only.
    min_lr_ratio: final learning rate as a fraction of the peak.
  """

  name: str = "adamw"
  learning_rate: float = 3e-3
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  schedule: str = "cosine"
  warmup_steps: int = 100
  decay_fraction: float = 0.2
  min_lr_ratio: float = 0.1

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"OptimizerConfig.name={self.name!r}: expected one of {OPTIMIZERS}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimizerConfig.schedule={self.schedule!r}: expected one of {SCHEDULES}")
    if not 0 < self.learning_rate < math.inf:
      raise ValueError(f"OptimizerConfig.learning_rate={self.learning_rate}: must be a finite "
                       "number > 0")
    for f, lo, hi in (("b1", 0, 1), ("b2", 0, 1), ("min_lr_ratio", 0, 1), ("decay_fraction", 0, 1)):
      if not lo <= getattr(self, f) <= hi:
        raise ValueError(f"OptimizerConfig.{f}={getattr(self, f)}: must be in [{lo}, {hi}]")
    for f in ("eps", "weight_decay", "grad_clip"):
      if not 0 <= getattr(self, f) < math.inf:
        raise ValueError(f"OptimizerConfig.{f}={getattr(self, f)}: must be a finite number >= 0")
    if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
      raise ValueError(f"OptimizerConfig.warmup_steps={self.warmup_steps!r}: must be an int >= 0")


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """The learning-rate schedule of ``cfg`` over ``total_steps`` updates.

  Args:
    cfg: optimizer config.
    total_steps: number of updates of the run.

  Returns:
    An optax schedule ``step -> lr``.
  """
  peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
  warm = min(cfg.warmup_steps, max(total_steps - 1, 0))
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(warm, 1), max(total_steps, warm + 1),
                                              end_value=end)
  warmup = optax.linear_schedule(0.0, peak, max(warm, 1))
  if cfg.schedule == "constant":
    return optax.join_schedules([warmup, optax.constant_schedule(peak)], [warm])
  decay = max(1, int(round(cfg.decay_fraction * total_steps)))
  stable = max(total_steps - warm - decay, 0)
  return optax.join_schedules(
      [warmup, optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay)],
      [warm, warm + stable])


def _decay_mask(params):
  return jax.tree.map(lambda x: x.ndim >= 2, params)


LORA_PARAMS = ("lora_a", "lora_b")  # the low-rank branch's parameters (fp4jax.layers.Dense)


def _lora_mask(params):
  """True for the leaves of the LoRA-SVD branch (a key ``lora_a`` or ``lora_b`` in their path)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: any(getattr(k, "key", None) in LORA_PARAMS for k in path), params)


def reset_lora_moments(opt_state):
  """``opt_state`` with every leaf that belongs to a LoRA-SVD factor (a key ``lora_a`` or ``lora_b``
  in its path: Adam's m and v, NVFP4 moments' codes and scales, Muon's momentum) set to zero; the
  step counts and every other leaf unchanged."""
  is_lora = _lora_mask(opt_state)
  return jax.tree.map(lambda x, lora: jnp.zeros_like(x) if lora else x, opt_state, is_lora)


def make_optimizer(cfg: OptimizerConfig, recipe: Recipe, total_steps: int,
                   seed: int = 0, sharded_state: bool = False,
                   execution: Execution = Execution()) -> optax.GradientTransformation:
  """The optimizer of a run: clipping, then AdamW or Muon, with the recipe's state format.

  Args:
    cfg: optimizer config.
    recipe: ``optimizer_states`` ("fp32"/"nvfp4") with ``moments`` (how NVFP4 moments are
      stored), ``newton_schulz`` ("bf16"/"nvfp4", Muon's Newton–Schulz operands) and
      ``lora_lr_scale`` (the LoRA-SVD branch's updates times this;
      at 1.0 the chain has no such step).
    total_steps: for the schedule.
    seed: seed of the stochastic rounding of NVFP4 optimizer states.
    sharded_state: the mesh shards parameters and optimizer state (FSDP or tensor parallel): NVFP4
      AdamW then updates through XLA where ``execution.optimizer`` is "auto" (XLA partitions the
      update; the Pallas kernels take whole leaves).
    execution: ``execution.optimizer`` runs the NVFP4 AdamW update.

  Returns:
    An ``optax.GradientTransformation``.
  """
  lr = make_schedule(cfg, total_steps)
  quant = recipe.optimizer_states == "nvfp4"
  impl = "xla" if sharded_state and execution.optimizer == "auto" else execution.optimizer
  if cfg.name == "muon":
    # One Muon implementation for every recipe (so a comparison changes only the precision):
    # NS operands in recipe.newton_schulz, momentum / Adam moments NVFP4 if optimizer_states is.
    tx = muon_nvfp4(lr, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    ns_operand=recipe.ns_operand, quantize=quant, adam_b1=cfg.b1,
                    adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay,
                    weight_decay_mask=_decay_mask, seed=seed, adam_options=recipe.moments,
                    adam_implementation=impl)
  elif quant:
    tx = adamw_nvfp4(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=_decay_mask, seed=seed, options=recipe.moments, implementation=impl)
  else:
    tx = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=_decay_mask)
  if recipe.lora_lr_scale != 1.0:
    tx = optax.chain(tx, optax.masked(optax.scale(recipe.lora_lr_scale), _lora_mask))
  if cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
  return tx
