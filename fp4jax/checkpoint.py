"""Checkpoints of a training run: orbax ``CheckpointManager`` with async saves.

A checkpoint holds three items:

* ``state``: the train state pytree (params, optimizer state — packed NVFP4 moments included,
  as their uint8 codes / e4m3 scales / f32 global scales —, step, RNG key data), restored
  directly into its shardings;
* ``data``: the input iterator's position (``grain.checkpoint`` for grain iterators; the JSON of
  ``get_state()`` for any other iterator that has ``get_state`` / ``set_state``);
* ``meta``: JSON describing what produced it (model config, recipe, optimizer), checked on
  restore: restoring into an incompatible config raises ``IncompatibleCheckpointError``.
"""

from __future__ import annotations

import os
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was written by a run whose model, recipe or optimizer differ from this one."""


def _is_grain(it) -> bool:
  return isinstance(it, grain.DatasetIterator)


def _diff(saved, current, prefix="") -> list[str]:
  if isinstance(saved, dict) and isinstance(current, dict):
    out = []
    for k in sorted(set(saved) | set(current)):
      out += _diff(saved.get(k, "<absent>"), current.get(k, "<absent>"), f"{prefix}{k}.")
    return out
  if isinstance(saved, list | tuple) and isinstance(current, list | tuple):
    saved, current = list(saved), list(current)
  return [] if saved == current else [f"{prefix[:-1]}: checkpoint {saved!r}, this run {current!r}"]


class Checkpointer:
  """Saves and restores train state, data position and run metadata.

  Args:
    directory: checkpoint folder (created).
    every: save when ``step % every == 0`` (``save(force=True)`` saves at any step).
    keep: number of checkpoints kept (the newest).
    async_save: write in a background thread (arrays are copied to host before ``save`` returns,
      so the state's buffers may be donated right after).
  """

  def __init__(self, directory: str | os.PathLike, *, every: int, keep: int = 3,
               async_save: bool = True):
    if every < 1 or keep < 1:
      raise ValueError(f"checkpoint every={every} and keep={keep} must be >= 1")
    self.directory = Path(directory).absolute()
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1,
                                           enable_async_checkpointing=async_save, create=True)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.every == 0

  def save(self, step: int, state, data_iter=None, meta: dict | None = None) -> bool:
    """Starts saving ``state`` (and the data position and ``meta``) as ``step``.

    Args:
      step: the number of completed updates.
      state: the train state pytree of jax Arrays.
      data_iter: the training data iterator, or None.
      meta: JSON-able description of the run, compared on restore.

    Returns:
      True if a save was started.
    """
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      items.update(_data_save(data_iter))
    return self._mgr.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, abstract_state, data_iter=None, meta: dict | None = None,
              step: int | None = None):
    """Restores a checkpoint into ``abstract_state``'s shapes, dtypes and shardings.

    Args:
      abstract_state: pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set.
      data_iter: iterator whose position is restored in place (if the checkpoint has one).
      meta: this run's description; any difference to the saved one raises.
      step: the step to restore (default the newest).

    Returns:
      ``(step, state)``.

    Raises:
      FileNotFoundError: no checkpoint.
      IncompatibleCheckpointError: the saved run's meta or tree differs from this run's.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    items = set(self._mgr.item_metadata(step).keys()) if hasattr(self._mgr, "item_metadata") \
        else {"state", "meta"}
    saved_meta = self._mgr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta
    if meta is not None:
      diffs = _diff(saved_meta, meta)
      if diffs:
        raise IncompatibleCheckpointError(
            f"checkpoint {self.directory}/{step} was written by an incompatible run:\n  "
            + "\n  ".join(diffs) + "\nuse a fresh workdir, or restore with the saved config")
    try:
      restored = self._mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
    except (ValueError, KeyError, TypeError) as e:
      raise IncompatibleCheckpointError(
          f"checkpoint {self.directory}/{step} does not fit this run's state (different model, "
          f"recipe or optimizer?): {e}") from e
    if data_iter is not None:
      _data_restore(self._mgr, step, data_iter, items)
    return step, restored.state

  def wait(self) -> None:
    """Blocks until pending async saves are on disk."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()


def _data_save(it) -> dict:
  if _is_grain(it):
    return {"data": grain.checkpoint.CheckpointSave(it)}
  if hasattr(it, "get_state"):
    return {"data_json": ocp.args.JsonSave(it.get_state())}
  return {}


def _data_restore(mgr, step, it, items) -> None:
  if "data" in items and _is_grain(it):
    mgr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it)))
  elif "data_json" in items and hasattr(it, "set_state"):
    state = mgr.restore(step, args=ocp.args.Composite(data_json=ocp.args.JsonRestore())).data_json
    it.set_state(state)
  elif jax.process_index() == 0:
    print(f"warning: checkpoint step {step} has no data position for this iterator; the data "
          "restarts from its beginning")
