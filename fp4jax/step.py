"""The pure training step: train state, loss, train and eval steps, and their jitted forms.

The train state is a plain dict pytree ``{"step", "params", "opt_state", "rng"}`` (params as a
pure dict keyed like ``fp4jax.model``; ``rng`` the uint32 key data of the run's base key — step
``s`` uses ``fold_in(key, s)``). ``make_train_step`` returns a pure function
``(state, batch) -> (state, metrics)``; ``jit_steps`` jits it with ``NamedSharding`` in/out
shardings on a (data, fsdp, tensor) mesh and a donated state. The same code runs on 1 CPU,
simulated CPU devices, 1–8 GPUs and several hosts (see ``fp4jax.sharding``).

Batches are dicts ``{"inputs", "targets"}`` of int32 (B, T) arrays (``fp4jax.data.to_global_batch``
makes a host's batch a global array); with ``grad_accum = A`` each is split into A micro-batches
of B/A examples whose gradients are averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import optim
from fp4jax import sharding as shd
from fp4jax.data import to_global_batch
from fp4jax.execution import Execution
from fp4jax.loss import chunked_cross_entropy
from fp4jax.model import ModelConfig, Transformer, projection_dims
from fp4jax.recipe import Recipe


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
    model = Transformer(model_cfg, recipe, execution=execution, rngs=nnx.Rngs(params=key))
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


def make_eval_step(graphdef, execution: Execution):
  """``(params, batch) -> mean loss``, with one fixed key for the NVFP4 projections' random bits
  (every evaluation sees the same rounding); ``execution`` as in ``loss_fn``."""
  key = jax.random.key(0)

  def eval_fn(params, batch):
    return loss_fn(graphdef, params, batch["inputs"], batch["targets"], key, execution=execution)
  return eval_fn


def jit_steps(graphdef, tx, schedule, shardings, mesh, grad_accum: int = 1, *,
              execution: Execution):
  """The train and eval steps, jitted with shardings (state donated to the train step).

  Args:
    graphdef: the model graph from ``init_state``.
    tx: the optimizer.
    schedule: learning-rate schedule (metric ``lr``), or None.
    shardings: the train state's shardings (``init_state``'s third output).
    mesh: the (data, fsdp, tensor) mesh; the batch is split over its batch axes.
    grad_accum: micro-batches per step.
    execution: which code runs the loss (``loss_fn``); the model's ops run as its graphdef says.

  Returns:
    ``(train_step, eval_step)``: ``(state, batch) -> (state, metrics)`` and
    ``(params, batch) -> loss``, each called (and ``lower``-ed) under ``mesh``.
  """
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
