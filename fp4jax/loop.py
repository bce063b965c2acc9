"""The run loop: trains an ``Experiment`` in a run directory, with eval, metrics, checkpoints and
exact resume.

``train(exp, workdir, train_iter, eval_batches)`` builds the optimizer (``fp4jax.optim.factory``)
and the jitted steps (``fp4jax.step``), restores the newest intact checkpoint of ``workdir`` if
there is one, and runs the steps that are left. Batches are dicts ``{"inputs", "targets"}`` of
int32 (B_local, T) host arrays (as ``fp4jax.data.make_iterator`` yields).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import sharding as shd
from fp4jax import telemetry
from fp4jax.checkpoint import ORBAX_TMP, Checkpointer, CheckpointSaveError
from fp4jax.data import to_global_batch
from fp4jax.layers import Dense
from fp4jax.metrics import MetricsWriter, peak_flops, set_aside
from fp4jax.optim.factory import make_optimizer, make_schedule, reset_lora_moments
from fp4jax.preemption import StopSignals, TrainingInterrupted
from fp4jax.recipe import LORA_RESPLIT_MOMENTS, LORA_RESPLIT_SVDS
from fp4jax.step import abstract_model, evaluate, init_state, jit_steps
from fp4jax.workdir import (CODE_KEY, RunLock, code_version, describe_code, identity, identity_changes,
                            record_start, same_code)

if TYPE_CHECKING:
  from fp4jax.experiment import Experiment


class NonFiniteLossError(FloatingPointError):
  """The loss or the gradient norm became NaN/Inf; the message names the step."""


def train(exp: Experiment, workdir: str | Path, train_iter: Iterator,
          eval_batches: Callable[[], Iterator] | None = None, *, mesh=None,
          config: Mapping | None = None, allow_changes: Sequence[str] = ()) -> dict:
  """Trains ``exp`` (or resumes it from ``<workdir>/checkpoints``), logging to
  ``<workdir>/metrics.jsonl``.

  Progress goes to stdout from process 0: a live bar on a terminal, else one line per logged step
  (step, loss, eval loss, tokens/s, ETA), plus a line when it compiles, evaluates, saves a
  checkpoint or resumes ("resumed from step N of S, data position ...").

  What the run guarantees (``README.md``, Reliability):

  * one run per workdir: ``<workdir>/run.lock`` (``fp4jax.workdir.RunLock``);
  * SIGTERM / SIGINT save a checkpoint at the current step and raise ``TrainingInterrupted``;
    before the first step of this start, they end the process at once (nothing to save);
  * a resume restores the newest checkpoint whose checksums verify (corrupt newer ones are
    reported and moved aside), checks the run's identity (``fp4jax.workdir.identity``) and
    truncates ``metrics.jsonl`` to the restored step; rows that no lost save explains (a start
    from step 0 over logged steps, or more than one checkpoint interval dropped: checkpoints were
    deleted) are first copied beside it (``fp4jax.metrics.set_aside``), and said;
  * a failed save is reported and training goes on.

  Args:
    exp: the run (``fp4jax.experiment.Experiment``) with its vocabulary set; ``exp.data_info``
      is part of the run's identity, ``exp.execution`` is not (a resume may change it).
    workdir: run directory.
    train_iter: this host's training batches ``{"inputs", "targets"}`` (B_local, T); its position
      is checkpointed if it has ``get_state`` / ``set_state`` (grain iterators do).
    eval_batches: returns a fresh iterator over the held-out batches (same batches every call).
    mesh: the device mesh (default ``make_mesh(exp.train.mesh_shape)``).
    config: JSON-able full config, recorded in ``<workdir>/config.json`` (first start) and
      ``<workdir>/config_history.jsonl`` (every start).
    allow_changes: identity fields a resume may change (``fp4jax.workdir.CHANGEABLE``, e.g.
      "seed", "optimizer.learning_rate"); the changes are recorded in the history.

  Returns:
    Summary: ``step``, ``loss`` (last), ``eval_loss`` (last), ``tokens_per_s``, ``mfu``,
    ``workdir``.

  Raises:
    NonFiniteLossError: NaN/Inf loss or gradient norm (the message names the step; checkpoints
      up to the last finite step stay).
    TrainingInterrupted: SIGTERM or SIGINT; the message says where the checkpoint was saved.
    RunLockedError: another process trains in ``workdir``.
    IncompatibleCheckpointError: ``workdir`` holds a checkpoint of another model/recipe.
    RunChangedError: the resumed run's identity changed and ``allow_changes`` does not allow it.
    CorruptCheckpointError: every checkpoint in ``workdir`` is corrupt.
    CheckpointSaveError: the final checkpoint could not be saved.
    ValueError: ``exp.train.steps`` is not above the checkpoint's step; no evaluation batch; no
      vocabulary.
  """
  if exp.optimizer.name == "muon" and exp.model.scan_layers:
    raise ValueError("OptimizerConfig.name='muon' needs ModelConfig.scan_layers=False: Muon "
                     "orthogonalizes 2-D leaves, and scan_layers stacks each run of blocks into "
                     "(L, in, out) leaves")
  if exp.model.vocab_size is None:
    raise ValueError("Experiment.model.vocab_size is None: set it, or complete the experiment "
                     "with its data first (Experiment.with_data)")
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
    return _run(exp, workdir, train_iter, eval_batches, mesh, config, allow_changes, stop)


def _run(exp: Experiment, workdir: Path, train_iter, eval_batches, mesh, config, allow_changes,
         stop: StopSignals) -> dict:
  tc = exp.train
  ckpt = Checkpointer(workdir / "checkpoints", every=tc.checkpoint_every or tc.steps,
                      keep=tc.keep_checkpoints, log=_say)
  if jax.process_index() == 0:  # this start holds the run's lock: no save of another is under way
    for unfinished in sorted(ckpt.directory.glob(f"*{ORBAX_TMP}*")):
      shutil.rmtree(unfinished, ignore_errors=True)
      _say(f"removed {unfinished}: a save that an earlier start did not finish")
  start = ckpt.intact_step() or 0
  ident = identity(exp)
  saved = ckpt.read_meta(start) if start else {}
  changes = identity_changes(saved, ident, allow_changes) if start else []
  if start >= tc.steps:
    raise ValueError(f"steps={tc.steps} is not above step {start}, where the run in {workdir} "
                     f"stopped: nothing to train; set steps > {start} to continue it")
  if jax.process_index() == 0:
    record_start(workdir, start, config, changes)
    if kept := set_aside(workdir, start, ckpt.every):
      where = (f"step {start}" if start else
               f"step 0 (no checkpoint in {ckpt.directory}: deleted, or none was saved)")
      _say(f"{workdir / 'metrics.jsonl'} holds steps up to {kept[1]}, but the run starts from "
           f"{where}; its rows are kept in {kept[0]} and metrics.jsonl goes on from step {start}")
  for c in changes:
    _say(f"resuming with a changed {c} (allowed; recorded in {workdir / 'config_history.jsonl'})")
  if start and not same_code(saved.get(CODE_KEY)):
    _say(f"resuming step {start}, saved by {describe_code(saved.get(CODE_KEY))}, with "
         f"{describe_code(code_version())} (recorded in {workdir / 'config_history.jsonl'})")
  if eval_batches is not None:
    _check_eval_data(eval_batches)
  loop = _Loop(exp, workdir, ckpt, stop, mesh, train_iter, eval_batches, start,
               {**ident, CODE_KEY: code_version()})
  try:
    for n in range(start + 1, tc.steps + 1):
      loop.begin(n)
      batch = to_global_batch(next(train_iter), loop.mesh)
      tele_vals = loop.telemetry(n, batch)
      loop.step(n, batch)
      if not loop.must_sync(n):
        loop.defer(n)
        continue
      loop.log(n, tele_vals)
      loop.resplit(n)
      loop.save(n)
      loop.end(n)
    loop.check_final()
  finally:
    ckpt.close()
    loop.writer.close()
  return {**loop.summary, "workdir": str(workdir)}


class _Loop:
  """The state and bookkeeping of one start of a run: the train state, the jitted steps, the
  checkpointer, the metrics writer, the step timer, the summary and the stop signals."""

  def __init__(self, exp: Experiment, workdir: Path, ckpt: Checkpointer, stop: StopSignals, mesh,
               train_iter, eval_batches, start: int, ident: dict):
    tc = self.tc = exp.train
    self.ckpt, self.stop, self.train_iter, self.eval_batches = ckpt, stop, train_iter, eval_batches
    self.start, self.first, self.identity = start, start + 1, ident
    self.mesh = mesh = mesh if mesh is not None else shd.make_mesh(tc.mesh_shape)
    sharded = any(mesh.shape.get(axis, 1) > 1 for axis in ("fsdp", "tensor"))
    model_cfg, recipe, execution = exp.model, exp.recipe, exp.execution
    tx = make_optimizer(exp.optimizer, recipe, tc.steps, seed=tc.seed, sharded_state=sharded,
                        execution=execution)
    schedule = make_schedule(exp.optimizer, tc.steps)
    graphdef, state, shardings = init_state(model_cfg, recipe, tx, mesh, tc.seed, execution)
    self.train_step, self.eval_step = jit_steps(graphdef, tx, schedule, shardings, mesh,
                                                tc.grad_accum, execution=execution)
    # Steps from `switch` on (0-based) run the recipe's late phase (Recipe.at_step: the forward
    # GEMMs in BF16, and attention's q, k with bf16_fwd_attention): a second graphdef of the same
    # parameters, its steps compiled at first use.
    # The telemetry keeps measuring the recipe's own quantization.
    self.switch, self.bf16_fwd_last = recipe.bf16_fwd_from(tc.steps), recipe.bf16_fwd_last
    late_recipe = recipe.at_step(tc.steps - 1, tc.steps)
    self.late_what = " and ".join(
        w for w, changed in (("the forward GEMMs", late_recipe.matmul != recipe.matmul),
                             ("attention's scores", late_recipe.attention_op != recipe.attention_op)) if changed)
    self.late_steps = None
    if late_recipe != recipe:
      late, _ = abstract_model(model_cfg, late_recipe, execution)
      self.late_steps = jit_steps(late, tx, schedule, shardings, mesh, tc.grad_accum,
                                  execution=execution)
    self.tele = (telemetry.jit_telemetry(model_cfg, recipe, exp.optimizer, shardings, mesh,
                                         execution=execution) if tc.telemetry_every else None)
    self.every = recipe.lora_resplit_every if recipe.linear == "nvfp4_lorasvd" else 0
    self.resplit_fn = (make_lora_resplit(graphdef, shardings, tc.seed, moments=recipe.lora_resplit_moments,
                                         svd=recipe.lora_resplit_svd) if self.every else None)
    if start:
      abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              state, shardings)
      _, state = ckpt.restore(abstract, train_iter, step=start)
    self.state = state
    self.tokens_per_step = tc.batch_size * tc.seq_len
    self.flops_per_step = model_cfg.flops_per_token(tc.seq_len) * self.tokens_per_step
    self.peak = peak_flops(mesh.devices.flat[0])
    self.num_params = model_cfg.num_params()
    self.summary = {"step": start, "loss": float("nan"), "eval_loss": float("nan"),
                    "tokens_per_s": float("nan"), "mfu": None}
    self.writer = MetricsWriter(workdir, tc.steps, start, progress=tc.progress,
                                tensorboard=tc.tensorboard)
    if start:
      self.writer.message(f"resumed from step {start} of {tc.steps}, data position "
                          f"{_position(train_iter)} ({ckpt.directory / str(start)})")
    self.timer = _StepTimer()
    self.saved = start  # the newest step saved by this run (or restored)
    self.pending = None  # (step, metrics) of a step not synced: fetched while the next one runs
    self.metrics = None  # of the step just run

  def is_eval(self, n: int) -> bool:
    return self.eval_batches is not None and ((self.tc.eval_every and n % self.tc.eval_every == 0)
                                              or n == self.tc.steps)

  def is_telemetry(self, n: int) -> bool:
    """Step 1 (the initial state) and every ``telemetry_every`` steps."""
    return self.tele is not None and (n == 1 or n % self.tc.telemetry_every == 0)

  def should_log(self, n: int) -> bool:
    return (n == self.first or n % self.tc.log_every == 0 or self.is_eval(n)
            or self.is_telemetry(n) or n == self.tc.steps)

  def is_resplit(self, n: int) -> bool:
    return bool(self.every) and n % self.every == 0

  def late(self, n: int) -> bool:
    """Whether step ``n`` (1-based) runs the recipe's late phase (``Recipe.at_step``)."""
    return self.late_steps is not None and n > self.switch

  def steps_of(self, n: int):
    """``(train_step, eval_step)`` of step ``n``: the eval step evaluates the model as it trained."""
    return self.late_steps if self.late(n) else (self.train_step, self.eval_step)

  def begin(self, n: int) -> None:
    """Stops (saving step ``n - 1``) if a signal asked to; says the first step compiles, and
    the first step of the late phase."""
    if self.stop.requested and n > self.first:  # state is that of step n - 1
      if self.pending is not None:
        self._finite(*self.pending)
      self._stop(n - 1)
    if n == self.first:
      self.writer.message(f"step {n}: compiling the train step ({self.num_params / 1e6:.2f}M "
                          f"parameters, {self.mesh.devices.size} device(s))")
    if self.late(n) and (n == self.first or not self.late(n - 1)):
      self.writer.message(f"step {n}: {self.late_what} run in BF16 from here to step {self.tc.steps} "
                          f"(recipe.bf16_fwd_last={self.bf16_fwd_last})"
                          + ("" if n == self.first else "; compiling that train step"))

  def telemetry(self, n: int, batch) -> dict | None:
    """The telemetry of step ``n``'s state and batch, before the step donates the state."""
    if not self.is_telemetry(n):
      return None
    if n <= self.start + self.tc.telemetry_every:
      self.writer.message(f"step {n}: compiling the telemetry")
    vals = telemetry.measure(self.tele, self.state, batch)
    self.timer.reset()
    return vals

  def step(self, n: int, batch) -> None:
    """Runs step ``n``; syncs the metrics of the step before it, which ran meanwhile."""
    self.state, self.metrics = self.steps_of(n)[0](self.state, batch)
    if n == self.first:
      self.stop.arm()  # compiled: from here on, a signal saves this step's state
    if n > self.first and self.late(n) and not self.late(n - 1):  # it compiled: time from here on
      jax.block_until_ready(self.metrics)
      self.timer.reset()
    else:
      self.timer.tick()
    if self.pending is not None:
      self.summary.update(step=self.pending[0], loss=self._finite(*self.pending)["loss"])
      self.pending = None

  def must_sync(self, n: int) -> bool:
    """Whether step ``n`` is logged, saved or re-split (else its metrics are fetched later)."""
    return self.should_log(n) or self.ckpt.should_save(n) or self.is_resplit(n)

  def defer(self, n: int) -> None:
    self.pending = (n, self.metrics)
    self.writer.advance(n)

  def log(self, n: int, tele_vals: dict | None) -> None:
    """Waits for step ``n``; writes its metrics (and evaluates) where it is logged."""
    vals = self._finite(n, self.metrics)
    self.summary.update(step=n, loss=vals["loss"])
    if n == self.first:
      self.writer.message(f"step {n}: compiled and ran in {self.timer.elapsed():.1f} s")
      self.timer.reset()  # time steps from here on
    if not self.should_log(n):
      return
    dt = self.timer.seconds_per_step() if n > self.first else None
    if dt is not None:
      vals.update(step_time_s=dt, tokens_per_s=self.tokens_per_step / dt)
      self.summary["tokens_per_s"] = vals["tokens_per_s"]
      if self.peak:
        vals["mfu"] = self.summary["mfu"] = (self.flops_per_step / dt
                                             / (self.peak * self.mesh.devices.size))
    vals["tokens"] = n * self.tokens_per_step
    if self.is_eval(n):
      self.writer.message(f"step {n}: evaluating ({self.tc.eval_batches} batches)")
      vals["eval_loss"] = self.summary["eval_loss"] = evaluate(
          self.steps_of(n)[1], self.state["params"], self.eval_batches(), self.mesh,
          self.tc.eval_batches)
    self.writer.write(n, {**vals, **(tele_vals or {})})
    self.ckpt.poll()  # reports a failed background save now

  def resplit(self, n: int) -> None:
    if self.is_resplit(n) and n < self.tc.steps:
      params, opt_state = self.resplit_fn(self.state["params"], self.state["opt_state"], self.state["step"])
      self.state = {**self.state, "params": params, "opt_state": opt_state}

  def save(self, n: int) -> None:
    if self.ckpt.should_save(n) or n == self.tc.steps:
      self.writer.message(f"step {n}: saving a checkpoint to {self.ckpt.directory / str(n)}")
      if self.ckpt.save(n, self.state, self.train_iter, self.identity):
        self.saved = n

  def end(self, n: int) -> None:
    if self.is_eval(n) or self.ckpt.should_save(n):
      self.timer.reset()
    self.writer.advance(n)

  def check_final(self) -> None:
    ckpt, steps = self.ckpt, self.tc.steps
    if not ckpt.wait() or ckpt.latest_step() != steps:
      why = f": {ckpt.failure}" if ckpt.failure else " (see the warning above)"
      raise CheckpointSaveError(
          f"the final checkpoint (step {steps}) could not be saved to {ckpt.directory}{why}; the "
          f"latest saved is step {ckpt.latest_step()}")

  def _finite(self, step: int, metrics) -> dict:
    return _finite_metrics(step, metrics, self.writer, self.ckpt)

  def _stop(self, n: int):
    """Saves step ``n`` (unless saved already) and raises ``TrainingInterrupted``."""
    ckpt, stop = self.ckpt, self.stop
    path = ckpt.directory / str(n)
    if self.saved != n:
      self.writer.message(f"{stop.requested}: saving a checkpoint to {path} before stopping")
      ckpt.save(n, self.state, self.train_iter, self.identity)
    if ckpt.wait() and path.is_dir():
      raise TrainingInterrupted(f"stopped by {stop.requested} at step {n}: checkpoint saved to "
                                f"{path}; the same command resumes from there", stop.signum, n,
                                str(path))
    raise TrainingInterrupted(f"stopped by {stop.requested} at step {n}: the checkpoint could not "
                              f"be saved (see above); the latest saved is step "
                              f"{ckpt.latest_step()} in {ckpt.directory}", stop.signum, n,
                              str(ckpt.directory / str(ckpt.latest_step())))


def make_lora_resplit(graphdef, shardings, seed: int = 0, *, moments: str = "keep", svd: str = "layer"):
  """A jitted ``(params, opt_state, step) -> (params, opt_state)`` that re-splits every LoRA-SVD
  projection (``fp4jax.layers.Dense`` with a low-rank branch) and treats its optimizer state as
  ``moments`` says; params and optimizer state are donated.

  Each projection takes a new top-r SVD of its effective weight ``W_res + A·B`` (which is kept),
  with a key of its own from ``seed``, the step and its place in the model: ``fold_in(fold_in(
  fold_in(key(seed), 3), step), i)`` for the i-th module of ``nnx.iter_modules``.

  Args:
    graphdef: the model's graph definition.
    shardings: the train state's shardings (``"params"`` and ``"opt_state"``).
    seed: the run's seed.
    moments: ``Recipe.lora_resplit_moments``: ``"keep"`` (the new SVD factors, every
      moment kept), ``"aligned"`` (the new factors rotated onto the old ones' columns, every moment
      kept) or ``"reset"`` (the new SVD factors, the moments of ``lora_a``/``lora_b`` zeroed).
    svd: ``Recipe.lora_resplit_svd``: ``"layer"`` (each layer's SVD method),
      ``"randomized"`` or ``"exact"``.

  Returns:
    The jitted function.

  Raises:
    ValueError: ``moments`` or ``svd`` is not one of its choices.
  """
  for name, value, choices in (("moments", moments, LORA_RESPLIT_MOMENTS), ("svd", svd, LORA_RESPLIT_SVDS)):
    if value not in choices:
      raise ValueError(f"make_lora_resplit: {name}={value!r}: expected one of {choices}")
  key = jax.random.fold_in(jax.random.key(seed), 3)
  method = None if svd == "layer" else svd

  def resplit(params, opt_state, step):
    model = nnx.merge(graphdef, params)
    k = jax.random.fold_in(key, step)
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
      if isinstance(module, Dense) and module.rank:
        module.resplit(jax.random.fold_in(k, i), method=method, aligned=moments == "aligned")
    if moments == "reset":
      opt_state = reset_lora_moments(opt_state)
    return nnx.to_pure_dict(nnx.state(model)), opt_state

  p_sh, o_sh = shardings["params"], shardings["opt_state"]
  rep = NamedSharding(jax.tree.leaves(p_sh)[0].mesh, P())
  return jax.jit(resplit, in_shardings=(p_sh, o_sh, rep), out_shardings=(p_sh, o_sh), donate_argnums=(0, 1))


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
