"""Sharded training: optimizer and schedule factories, the pure train step, and the run loop.

The train state is a plain dict pytree ``{"step", "params", "opt_state", "rng"}`` (params as a
pure dict keyed like ``fp4jax.model``; ``rng`` the uint32 key data of the run's base key — step
``s`` uses ``fold_in(key, s)``). ``make_train_step`` returns a pure function
``(state, batch) -> (state, metrics)``; ``train`` jits it with ``NamedSharding`` in/out shardings
on a (data, fsdp, tensor) mesh and a donated state, and runs it with eval, metrics, checkpoints
and exact resume. The same code runs on 1 CPU, simulated CPU devices, 1–8 GPUs and several hosts
(see ``fp4jax.sharding`` for ``jax.distributed.initialize``).

Batches are dicts ``{"inputs", "targets"}`` of int32 (B_local, T) host arrays (as
``fp4jax.data.make_iterator`` yields; ``fp4jax.data.to_global_batch`` makes them global arrays);
with ``grad_accum = A`` each is split into A micro-batches of B/A examples whose gradients are
averaged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import optim
from fp4jax import sharding as shd
from fp4jax import telemetry
from fp4jax.checkpoint import Checkpointer, CheckpointSaveError
from fp4jax.data import to_global_batch
from fp4jax.layers import Dense
from fp4jax.execution import Execution
from fp4jax.loss import chunked_cross_entropy
from fp4jax.metrics import MetricsWriter, peak_flops
from fp4jax.model import ModelConfig, Transformer, projection_dims
from fp4jax.preemption import StopSignals, TrainingInterrupted
from fp4jax.recipe import Recipe
from fp4jax.workdir import RunLock, identity_changes, record_start

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
    tx = optim.muon_nvfp4(lr, eps=cfg.eps, weight_decay=cfg.weight_decay,
                          ns_operand=recipe.ns_operand, quantize=quant, adam_b1=cfg.b1,
                          adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay,
                          weight_decay_mask=_decay_mask, seed=seed, adam_options=recipe.moments,
                          adam_implementation=impl)
  elif quant:
    tx = optim.adamw_nvfp4(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=_decay_mask, seed=seed, options=recipe.moments, implementation=impl)
  else:
    tx = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=_decay_mask)
  if recipe.lora_lr_scale != 1.0:
    tx = optax.chain(tx, optax.masked(optax.scale(recipe.lora_lr_scale), _lora_mask))
  if cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
  return tx


def abstract_model(model_cfg: ModelConfig, recipe: Recipe, execution: Execution = Execution()):
  """``(graphdef, abstract params)`` of the model, without allocating it."""
  model = nnx.eval_shape(lambda: Transformer(model_cfg, recipe, execution=execution,
                                             rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def init_state(model_cfg: ModelConfig, recipe: Recipe, tx: optax.GradientTransformation,
               mesh, seed: int = 0, execution: Execution = Execution()):
  """A freshly initialized, sharded train state.

  Args:
    model_cfg: model hyperparameters.
    recipe: the precision recipe.
    tx: the optimizer.
    mesh: a (data, fsdp, tensor) mesh.
    seed: parameter init and step RNG seed.
    execution: which code runs each op of the model (part of the graphdef, not of the state).

  Returns:
    ``(graphdef, state, state_shardings)``: ``nnx.merge(graphdef, state["params"])`` is the
    model; the shardings pytree mirrors ``state``.
  """
  graphdef, abstract = abstract_model(model_cfg, recipe, execution)
  p_sh = shd.param_shardings(abstract, mesh, projection_dims(model_cfg))
  rep = shd.replicated(mesh)

  def make_params(key):
    model = Transformer(model_cfg, recipe, rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(model))

  key = jax.random.key(seed)
  # rbg bits for the initializers only: threefry's normal() compiles slowly on CPU.
  init_key = jax.random.key(seed, impl="unsafe_rbg")
  params = jax.jit(make_params, out_shardings=p_sh)(init_key)
  o_sh = optim.state_sharding(jax.eval_shape(tx.init, params), p_sh)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  state = {"step": jax.device_put(jnp.zeros((), jnp.int32), rep), "params": params,
           "opt_state": opt_state,
           "rng": jax.device_put(jax.random.key_data(jax.random.fold_in(key, 2)), rep)}
  shardings = {"step": rep, "params": p_sh, "opt_state": o_sh, "rng": rep}
  return graphdef, state, shardings


def loss_fn(graphdef, params, inputs_BxT, targets_BxT, key, *, execution: Execution = Execution()):
  """Mean next-token cross-entropy of the model ``nnx.merge(graphdef, params)``.

  The LM head and the loss run chunked (``fp4jax.loss.chunked_cross_entropy``): the float32
  (B, T, V) logits are never materialized. Its backward reuses a saved bf16 logits cotangent
  (2 bytes × B·T × V), or, with the model's ``remat`` (the memory-saving setting), recomputes the
  logits instead.

  Args:
    graphdef, params: the model.
    inputs_BxT, targets_BxT: int token ids.
    key: the step's PRNG key (the NVFP4 projections' random bits).
    execution: ``execution.cross_entropy`` runs the loss's pass over the logits
      (``chunked_cross_entropy``'s ``implementation``); the model's ops run as its graphdef says.
  """
  model = nnx.merge(graphdef, params)
  x_BxTxD = model.features(inputs_BxT, key=key)
  return chunked_cross_entropy(x_BxTxD, model.lm_head.kernel[...], targets_BxT,
                               recompute=model.cfg.remat,
                               implementation=execution.cross_entropy)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: Callable | None = None,
                    grad_accum: int = 1, execution: Execution = Execution()):
  """The pure train step ``(state, batch) -> (state, metrics)``.

  Args:
    graphdef: the model graph from ``init_state``.
    tx: the optimizer.
    schedule: learning-rate schedule, reported as metric ``lr``.
    grad_accum: micro-batches per step (the batch's leading axis is split into this many).
    execution: as in ``loss_fn``.

  Returns:
    The step function. ``batch`` is ``{"inputs", "targets"}`` of shape (B, T); metrics are
    float32 scalars ``loss``, ``grad_norm`` and ``lr``.
  """

  def grads_of(params, inputs, targets, key):
    loss = lambda p: loss_fn(graphdef, p, inputs, targets, key, execution=execution)
    return jax.value_and_grad(loss)(params)

  def step_fn(state, batch):
    params, step = state["params"], state["step"]
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
    inputs, targets = batch["inputs"], batch["targets"]
    if grad_accum == 1:
      loss, grads = grads_of(params, inputs, targets, key)
    else:
      b, t = inputs.shape
      mb = (grad_accum, b // grad_accum, t)
      xs = (jnp.arange(grad_accum), inputs.reshape(mb), targets.reshape(mb))

      def micro(carry, x):
        i, inp, tgt = x
        l, g = grads_of(params, inp, tgt, jax.random.fold_in(key, i))
        return (jax.tree.map(jnp.add, carry[0], g), carry[1] + l), None

      zeros = jax.tree.map(jnp.zeros_like, params)
      (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), xs)
      grads = jax.tree.map(lambda g: g / grad_accum, grads)
      loss = loss / grad_accum
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {"step": step + 1, "params": optax.apply_updates(params, updates),
                 "opt_state": opt_state, "rng": state["rng"]}
    lr = schedule(step) if schedule is not None else jnp.nan
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "lr": jnp.asarray(lr, jnp.float32)}
    return new_state, metrics

  return step_fn


def make_resplit(graphdef, params_shardings, seed: int = 0):
  """A jitted ``(params, step) -> params`` that re-splits every LoRA-SVD projection.

  Each ``fp4jax.layers.Dense`` with a low-rank branch takes a new top-r SVD of its effective
  weight ``W_res + A·B`` (which is preserved); other parameters pass through. Params are donated.
  """
  key = jax.random.fold_in(jax.random.key(seed), 3)

  def resplit(params, step):
    model = nnx.merge(graphdef, params)
    k = jax.random.fold_in(key, step)
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
      if isinstance(module, Dense) and module.rank:
        module.resplit(jax.random.fold_in(k, i))
    return nnx.to_pure_dict(nnx.state(model))

  rep = jax.tree.leaves(params_shardings)[0]
  rep = NamedSharding(rep.mesh, P())
  return jax.jit(resplit, in_shardings=(params_shardings, rep), out_shardings=params_shardings,
                 donate_argnums=0)


def make_eval_step(graphdef, execution: Execution = Execution()):
  """``(params, batch) -> mean loss``, with one fixed key for the NVFP4 projections' random bits
  (every evaluation sees the same rounding)."""
  key = jax.random.key(0)

  def eval_fn(params, batch):
    return loss_fn(graphdef, params, batch["inputs"], batch["targets"], key, execution=execution)
  return eval_fn


def jit_steps(graphdef, tx, schedule, shardings, mesh, grad_accum: int = 1,
              execution: Execution = Execution()):
  """The train and eval steps, jitted with shardings (state donated to the train step)."""
  bsh = NamedSharding(mesh, P(shd.BATCH_AXES, None))
  batch_sh = {"inputs": bsh, "targets": bsh}
  rep = shd.replicated(mesh)
  train_jit = jax.jit(make_train_step(graphdef, tx, schedule, grad_accum, execution),
                      in_shardings=(shardings, batch_sh), out_shardings=(shardings, rep),
                      donate_argnums=0)
  eval_jit = jax.jit(make_eval_step(graphdef, execution),
                     in_shardings=(shardings["params"], batch_sh), out_shardings=rep)

  return _UnderMesh(train_jit, mesh), _UnderMesh(eval_jit, mesh)


class _UnderMesh:
  """A jitted function called and lowered under ``mesh`` (``jax.set_mesh``), so the model can pin
  activations to the batch axes while it is traced. ``lower(...)`` gives the ``jax.stages.Lowered``
  (for ``.compile()``, ``.cost_analysis()``, ``.compile().memory_analysis()``)."""

  def __init__(self, jitted, mesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def evaluate(eval_step, params, batches: Iterator, mesh, max_batches: int) -> float:
  """Mean loss over up to ``max_batches`` batches of ``batches`` (NaN if there are none)."""
  losses = []
  for i, batch in enumerate(batches):
    if i >= max_batches:
      break
    losses.append(eval_step(params, to_global_batch(batch, mesh)))
  return float(np.mean(jax.device_get(losses))) if losses else float("nan")


# --------------------------------------------------------------------------- the run loop


class NonFiniteLossError(FloatingPointError):
  """The loss or the gradient norm became NaN/Inf; the message names the step."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Length, batch, loss and bookkeeping of a run.

  Attributes:
    steps: number of updates.
    batch_size: global batch size (examples per update, over all hosts).
    seq_len: tokens per example.
    grad_accum: micro-batches per update.
    seed: parameter init / step RNG seed.
    log_every: write metrics every this many steps (also at the first step of a run, at eval
      steps and at the last step).
    eval_every: evaluate on the held-out split every this many steps (0: only at the end).
    eval_batches: batches per evaluation.
    checkpoint_every: save every this many steps (0: only at the end); saves are async.
    keep_checkpoints: checkpoints kept.
    mesh_shape: (data, fsdp, tensor) sizes; -1 fills with the remaining devices.
    progress: a live progress bar when stdout is a terminal; elsewhere (a log file, a cluster
      job) one line per logged step.
    tensorboard: TensorBoard event files under ``<workdir>/tb`` (needs tensorboardX).
    telemetry_every: at step 1 and every this many steps, before the step, log each module's NVFP4
      quantization error and each projection's energy shares on the step's state and batch
      (``fp4jax.telemetry``; ``telemetry/...`` metrics and ``telemetry_time_s``, its cost): the
      start, every N steps, and the end where N divides ``steps``. 0: off.
  """

  steps: int
  batch_size: int
  seq_len: int
  grad_accum: int = 1
  seed: int = 0
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 8
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  mesh_shape: tuple[int, int, int] = (1, -1, 1)
  progress: bool = True
  tensorboard: bool = True
  telemetry_every: int = 0

  def __post_init__(self):
    for f in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches",
              "keep_checkpoints"):
      if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
        raise ValueError(f"TrainConfig.{f}={getattr(self, f)!r}: expected a positive int")
    if self.batch_size % self.grad_accum:
      raise ValueError(f"TrainConfig: batch_size={self.batch_size} is not divisible by "
                       f"grad_accum={self.grad_accum}")
    if self.eval_every < 0 or self.checkpoint_every < 0:
      raise ValueError("TrainConfig: eval_every and checkpoint_every must be >= 0")
    if not isinstance(self.telemetry_every, int) or self.telemetry_every < 0:
      raise ValueError(f"TrainConfig.telemetry_every={self.telemetry_every!r}: expected an int "
                       ">= 0 (0: off)")


def run_identity(model_cfg: ModelConfig, recipe: Recipe, opt_cfg: OptimizerConfig,
                 train_cfg: TrainConfig, data: Mapping | None = None) -> dict:
  """What a run is: saved with each checkpoint and compared when the run resumes.

  A resumed run must have the same model, recipe and optimizer kind (else its checkpoint does not
  fit); the optimizer's settings, the data, batch size, sequence length and seed may change only
  when allowed (``fp4jax.workdir.identity_changes``). Schedules of the run (steps, logging,
  checkpoint and LoRA re-split cadence) and its ``fp4jax.execution.Execution`` (which code runs
  each op: not an argument here) may change freely.

  Args:
    model_cfg, recipe, opt_cfg, train_cfg: the run's configs.
    data: JSON-able description of the training data (corpus, tokenizer), or None.
  """
  r = {k: v for k, v in recipe.to_dict().items() if k != "lora_resplit_every"}  # a schedule
  return {"model": dataclasses.asdict(model_cfg), "recipe": r, "optimizer": dataclasses.asdict(opt_cfg),
          "batch_size": train_cfg.batch_size, "seq_len": train_cfg.seq_len,
          "seed": train_cfg.seed, "data": dict(data or {})}


class _StepTimer:
  """Seconds per step since the last ``reset`` (call it after anything that is not a step:
  compilation, evaluation, a checkpoint save)."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self._start, self._steps = time.perf_counter(), 0

  def tick(self) -> None:
    """Counts one step."""
    self._steps += 1

  def elapsed(self) -> float:
    """Seconds since the last ``reset``."""
    return time.perf_counter() - self._start

  def seconds_per_step(self) -> float | None:
    """Mean seconds per step since the last ``reset``; None before the first step."""
    return self.elapsed() / self._steps if self._steps else None


def _finite_metrics(step: int, metrics, writer: MetricsWriter, ckpt: Checkpointer) -> dict:
  """The step's metrics as floats; a NaN/Inf loss or gradient norm is logged, then raised, naming
  the last checkpoint whose parameters are finite and bounded (``Checkpointer.last_sound_step``)."""
  vals = {k: float(v) for k, v in jax.device_get(metrics).items()}
  if not (math.isfinite(vals["loss"]) and math.isfinite(vals["grad_norm"])):
    writer.write(step, vals)
    ckpt.wait()
    sound, passed = ckpt.last_sound_step()
    over = f" (newer ones passed over: {'; '.join(passed)})" if passed else ""
    if sound is None:
      last = (f"No checkpoint in {ckpt.directory} has finite, bounded parameters{over}: train "
              "again from the start in a fresh workdir")
    else:
      last = (f"Last checkpoint with finite, bounded parameters: step {sound}{over} in "
              f"{ckpt.directory}" + (f"; to resume from it, move the newer step folders out of "
                                     f"{ckpt.directory}" if passed else ""))
    raise NonFiniteLossError(
        f"non-finite loss {vals['loss']} (grad norm {vals['grad_norm']}) at step {step}; the run "
        f"stopped there. {last}")
  return vals


def _say(text: str) -> None:
  if jax.process_index() == 0:
    print(text, flush=True)


def _position(it) -> str:
  """The data iterator's position, for the resume line."""
  if not hasattr(it, "get_state"):
    return "not saved (this iterator has no get_state)"
  state = it.get_state()
  if isinstance(state, Mapping) and all(isinstance(v, int | float | str) for v in state.values()):
    return " ".join(f"{k}={v}" for k, v in state.items())
  return repr(state)


def _check_eval_data(eval_batches: Callable[[], Iterator]) -> None:
  """Fails now, not at the first evaluation, if the held-out data yields no batch."""
  if next(iter(eval_batches()), None) is None:
    raise ValueError("the evaluation data yields no batch (its split is smaller than one global "
                     "batch?): use a smaller batch_size or seq_len, more held-out text, or train "
                     "without evaluation")


def train(model_cfg: ModelConfig, recipe: Recipe, opt_cfg: OptimizerConfig,
          train_cfg: TrainConfig, workdir, train_iter: Iterator,
          eval_batches: Callable[[], Iterator] | None = None, *, mesh=None,
          data_info: Mapping | None = None, config: Mapping | None = None,
          allow_changes: Sequence[str] = (), execution: Execution = Execution()) -> dict:
  """Trains (or resumes from ``<workdir>/checkpoints``) and logs to ``<workdir>/metrics.jsonl``.

  Progress goes to stdout from process 0: a live bar on a terminal, else one line per logged step
  (step, loss, eval loss, tokens/s, ETA), plus a line when it compiles, evaluates, saves a
  checkpoint or resumes ("resumed from step N of S, data position ...").

  What the run guarantees (``README.md``, Reliability):

  * one run per workdir: ``<workdir>/run.lock`` (``fp4jax.workdir.RunLock``);
  * SIGTERM / SIGINT save a checkpoint at the current step and raise ``TrainingInterrupted``;
    before the first step of this start, they end the process at once (nothing to save);
  * a resume restores the newest checkpoint whose checksums verify (corrupt newer ones are
    reported and moved aside), checks the run's identity (``run_identity``) and truncates
    ``metrics.jsonl`` to the restored step; a failed save is reported and training goes on.

  Args:
    model_cfg: model hyperparameters.
    recipe: the precision recipe.
    opt_cfg: optimizer and schedule.
    train_cfg: steps, batch, loss, logging, eval and checkpoint cadence.
    workdir: run directory.
    train_iter: this host's training batches ``{"inputs", "targets"}`` (B_local, T); its position
      is checkpointed if it has ``get_state`` / ``set_state`` (grain iterators do).
    eval_batches: returns a fresh iterator over the held-out batches (same batches every call).
    mesh: the device mesh (default ``make_mesh(train_cfg.mesh_shape)``).
    data_info: JSON-able description of the training data, part of the run's identity.
    config: JSON-able full config, recorded in ``<workdir>/config.json`` (first start) and
      ``<workdir>/config_history.jsonl`` (every start).
    allow_changes: identity fields a resume may change (``fp4jax.workdir.CHANGEABLE``, e.g.
      "seed", "optimizer.learning_rate"); the changes are recorded in the history.
    execution: which code runs each op (``fp4jax.execution.Execution``); not part of the run's
      identity, so a resume may change it.

  Returns:
    Summary: ``step``, ``loss`` (last), ``eval_loss`` (last), ``tokens_per_s``, ``mfu``.

  Raises:
    NonFiniteLossError: NaN/Inf loss or gradient norm (the message names the step; checkpoints
      up to the last finite step stay).
    TrainingInterrupted: SIGTERM or SIGINT; the message says where the checkpoint was saved.
    RunLockedError: another process trains in ``workdir``.
    IncompatibleCheckpointError: ``workdir`` holds a checkpoint of another model/recipe.
    RunChangedError: the resumed run's identity changed and ``allow_changes`` does not allow it.
    CorruptCheckpointError: every checkpoint in ``workdir`` is corrupt.
    CheckpointSaveError: the final checkpoint could not be saved.
    ValueError: ``train_cfg.steps`` is not above the checkpoint's step; no evaluation batch.
  """
  if opt_cfg.name == "muon" and model_cfg.scan_layers:
    raise ValueError("OptimizerConfig.name='muon' needs ModelConfig.scan_layers=False: Muon "
                     "orthogonalizes 2-D leaves, and scan_layers stacks each run of blocks into "
                     "(L, in, out) leaves")
  workdir = Path(workdir)
  lock = RunLock(workdir)
  with contextlib.ExitStack() as stack:
    if jax.process_index() == 0:
      stack.enter_context(lock)
      for note in lock.notes:
        _say(note)
    stop = stack.enter_context(StopSignals(
        _say, "no step had run since this start, so there was nothing to save; the same "
        "command starts again from the latest checkpoint", lambda: lock.release(force=True)))
    return _train(model_cfg, recipe, opt_cfg, train_cfg, workdir, train_iter, eval_batches,
                  mesh, run_identity(model_cfg, recipe, opt_cfg, train_cfg, data_info), config,
                  allow_changes, stop, execution)


def _train(model_cfg, recipe, opt_cfg, tc, workdir, train_iter, eval_batches, mesh, identity,
           config, allow_changes, stop: StopSignals, execution: Execution) -> dict:
  ckpt = Checkpointer(workdir / "checkpoints", every=tc.checkpoint_every or tc.steps,
                      keep=tc.keep_checkpoints, log=_say)
  start = ckpt.intact_step() or 0
  changes = identity_changes(ckpt.read_meta(start), identity, allow_changes) if start else []
  if start >= tc.steps:
    raise ValueError(f"steps={tc.steps} is not above step {start}, where the run in {workdir} "
                     f"stopped: nothing to train; set steps > {start} to continue it")
  if jax.process_index() == 0:
    record_start(workdir, start, config, changes)
  for c in changes:
    _say(f"resuming with a changed {c} (allowed; recorded in {workdir / 'config_history.jsonl'})")
  if eval_batches is not None:
    _check_eval_data(eval_batches)
  mesh = mesh if mesh is not None else shd.make_mesh(tc.mesh_shape)
  sharded = any(mesh.shape.get(axis, 1) > 1 for axis in ("fsdp", "tensor"))
  tx = make_optimizer(opt_cfg, recipe, tc.steps, seed=tc.seed, sharded_state=sharded,
                      execution=execution)
  schedule = make_schedule(opt_cfg, tc.steps)
  graphdef, state, shardings = init_state(model_cfg, recipe, tx, mesh, tc.seed, execution)
  train_step, eval_step = jit_steps(graphdef, tx, schedule, shardings, mesh, tc.grad_accum,
                                    execution)
  tele = (telemetry.jit_telemetry(model_cfg, recipe, opt_cfg, shardings, mesh, execution=execution)
          if tc.telemetry_every else None)
  every = recipe.lora_resplit_every if recipe.linear == "nvfp4_lorasvd" else 0
  resplit = make_resplit(graphdef, shardings["params"], tc.seed) if every else None
  if start:
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)
    _, state = ckpt.restore(abstract, train_iter, step=start)
  tokens_per_step = tc.batch_size * tc.seq_len
  flops_per_step = model_cfg.flops_per_token(tc.seq_len) * tokens_per_step
  peak = peak_flops(mesh.devices.flat[0])
  summary = {"step": start, "loss": float("nan"), "eval_loss": float("nan"),
             "tokens_per_s": float("nan"), "mfu": None}
  writer = MetricsWriter(workdir, tc.steps, start, progress=tc.progress,
                         tensorboard=tc.tensorboard)
  if start:
    writer.message(f"resumed from step {start} of {tc.steps}, data position "
                   f"{_position(train_iter)} ({ckpt.directory / str(start)})")
  timer = _StepTimer()
  saved = start  # the newest step saved by this run (or restored)

  def is_eval(n: int) -> bool:
    return eval_batches is not None and ((tc.eval_every and n % tc.eval_every == 0)
                                         or n == tc.steps)

  def is_telemetry(n: int) -> bool:
    """Step 1 (the initial state) and every ``telemetry_every`` steps."""
    return tele is not None and (n == 1 or n % tc.telemetry_every == 0)

  def should_log(n: int) -> bool:
    return (n == start + 1 or n % tc.log_every == 0 or is_eval(n) or is_telemetry(n)
            or n == tc.steps)

  try:
    pending = None  # (step, metrics) of a step not synced: fetched while the next one runs
    for n in range(start + 1, tc.steps + 1):
      if stop.requested and n > start + 1:  # state is that of step n - 1
        if pending is not None:
          _finite_metrics(*pending, writer, ckpt)
        _stop(stop, n - 1, saved, state, train_iter, identity, ckpt, writer)
      if n == start + 1:
        writer.message(f"step {n}: compiling the train step ({model_cfg.num_params() / 1e6:.2f}M "
                       f"parameters, {mesh.devices.size} device(s))")
      batch = to_global_batch(next(train_iter), mesh)
      tele_vals = None
      if is_telemetry(n):  # on the state and batch of step n, before the step donates the state
        if n <= start + tc.telemetry_every:
          writer.message(f"step {n}: compiling the telemetry")
        tele_vals = telemetry.measure(tele, state, batch)
        timer.reset()
      state, m = train_step(state, batch)
      if n == start + 1:
        stop.arm()  # compiled: from here on, a signal saves this step's state
      timer.tick()
      if pending is not None:
        summary.update(step=pending[0], loss=_finite_metrics(*pending, writer, ckpt)["loss"])
        pending = None
      if not (should_log(n) or ckpt.should_save(n) or (every and n % every == 0)):
        pending = (n, m)
        writer.advance(n)
        continue
      vals = _finite_metrics(n, m, writer, ckpt)  # waits for the step
      summary.update(step=n, loss=vals["loss"])
      if n == start + 1:
        writer.message(f"step {n}: compiled and ran in {timer.elapsed():.1f} s")
        timer.reset()  # time steps from here on
      if should_log(n):
        dt = timer.seconds_per_step() if n > start + 1 else None
        if dt is not None:
          vals.update(step_time_s=dt, tokens_per_s=tokens_per_step / dt)
          summary["tokens_per_s"] = vals["tokens_per_s"]
          if peak:
            vals["mfu"] = summary["mfu"] = flops_per_step / dt / (peak * mesh.devices.size)
        vals["tokens"] = n * tokens_per_step
        if is_eval(n):
          writer.message(f"step {n}: evaluating ({tc.eval_batches} batches)")
          vals["eval_loss"] = summary["eval_loss"] = evaluate(
              eval_step, state["params"], eval_batches(), mesh, tc.eval_batches)
        writer.write(n, {**vals, **(tele_vals or {})})
        ckpt.poll()  # reports a failed background save now
      if every and n % every == 0 and n < tc.steps:
        state = {**state, "params": resplit(state["params"], state["step"])}
      if ckpt.should_save(n) or n == tc.steps:
        writer.message(f"step {n}: saving a checkpoint to {ckpt.directory / str(n)}")
        if ckpt.save(n, state, train_iter, identity):
          saved = n
      if is_eval(n) or ckpt.should_save(n):
        timer.reset()
      writer.advance(n)
    if not ckpt.wait() or ckpt.latest_step() != tc.steps:
      raise CheckpointSaveError(
          f"the final checkpoint (step {tc.steps}) could not be saved to {ckpt.directory} (see "
          f"the warning above); the latest saved is step {ckpt.latest_step()}")
  finally:
    ckpt.close()
    writer.close()
  summary["workdir"] = str(workdir)
  return summary


def _stop(stop: StopSignals, n: int, saved: int, state, train_iter, identity, ckpt: Checkpointer,
          writer: MetricsWriter):
  """Saves step ``n`` (unless saved already) and raises ``TrainingInterrupted``."""
  path = ckpt.directory / str(n)
  if saved != n:
    writer.message(f"{stop.requested}: saving a checkpoint to {path} before stopping")
    ckpt.save(n, state, train_iter, identity)
  if ckpt.wait() and path.is_dir():
    raise TrainingInterrupted(f"stopped by {stop.requested} at step {n}: checkpoint saved to "
                              f"{path}; the same command resumes from there", stop.signum, n,
                              str(path))
  raise TrainingInterrupted(f"stopped by {stop.requested} at step {n}: the checkpoint could not "
                            f"be saved (see above); the latest saved is step "
                            f"{ckpt.latest_step()} in {ckpt.directory}", stop.signum, n,
                            str(ckpt.directory / str(ckpt.latest_step())))
