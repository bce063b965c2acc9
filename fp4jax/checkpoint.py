"""Checkpoints of a training run: orbax ``CheckpointManager`` with async saves and checksums.

A checkpoint ``<directory>/<step>`` holds three items:

* ``state``: the train state pytree (params, optimizer state — packed NVFP4 moments included,
  as their uint8 codes / e4m3 scales / f32 global scales —, step, RNG key data), restored
  directly into its shardings;
* ``data``: the input iterator's position (``grain.checkpoint`` for grain iterators; the JSON of
  ``get_state()`` for any other iterator that has ``get_state`` / ``set_state``);
* ``meta``: JSON describing what produced it (``fp4jax.workdir.identity``), compared on resume.

and ``fp4jax_checksums.json``: the size and sha256 of every file of the step, written when the
save completes (before orbax renames the step into place) and verified before a restore. A step
that fails verification is reported as corrupt; ``intact_step`` falls back to the newest step that
verifies, moving the corrupt ones to ``<directory>-corrupt/``. A failed save is reported (``log``)
and the run goes on; the next save tries again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from fp4jax.workdir import IncompatibleCheckpointError, diff

CHECKSUMS = "fp4jax_checksums.json"  # in each step folder: its files' sizes and sha256
# Written by orbax after the step's contents are complete (markers and step metadata).
_UNCHECKED = ("_CHECKPOINT_METADATA", "commit_success.txt")
ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's suffix of a step being saved
# Parameters beyond this magnitude are a diverged run's, not a checkpoint to go back to.
_PARAM_BOUND = 1e6


class CheckpointSaveError(RuntimeError):
  """A checkpoint that must exist (the final one) could not be saved."""


class CorruptCheckpointError(RuntimeError):
  """Every checkpoint of the run failed verification; the message lists what failed."""


def _is_grain(it) -> bool:
  return isinstance(it, grain.DatasetIterator)


def _files(step_dir: Path) -> list[Path]:
  if not step_dir.is_dir():
    return []
  return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS
                and p.name not in _UNCHECKED)


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      h.update(chunk)
  return h.hexdigest()


def write_checksums(step_dir: str | os.PathLike) -> None:
  """Writes ``<step_dir>/fp4jax_checksums.json``: size and sha256 of each file of the step."""
  step_dir = Path(step_dir)
  files = {p.relative_to(step_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
           for p in _files(step_dir)}
  tmp = step_dir / (CHECKSUMS + ".tmp")
  tmp.write_text(json.dumps({"files": files}, indent=0))
  os.replace(tmp, step_dir / CHECKSUMS)


def verify(step_dir: str | os.PathLike) -> str | None:
  """Checks a step against its checksums.

  Returns:
    None if every file is there with its recorded size and sha256; ``"unverified"`` if the step
    has no checksums (written by an older fp4jax, or stopped between the save and the checksums)
    but holds its state and meta; otherwise what failed (the file and how, or that the step folder
    is empty or partial).
  """
  step_dir = Path(step_dir)
  path = step_dir / CHECKSUMS
  if not path.is_file():
    missing = [i for i in ("state", "meta") if not any(_files(step_dir / i))]
    if missing:  # a step folder left empty or half-written (a copy, a crash before orbax's rename)
      return f"{step_dir} is empty or partial (no {' or '.join(missing)} files)"
    return "unverified"
  try:
    want = json.loads(path.read_text())["files"]
  except (ValueError, KeyError, TypeError) as e:
    return f"{path} is unreadable ({e})"
  for rel, rec in want.items():
    p = step_dir / rel
    if not p.is_file():
      return f"{p} is missing"
    if p.stat().st_size != rec["bytes"]:
      return f"{p} has {p.stat().st_size} bytes, {rec['bytes']} when saved"
    if _sha256(p) != rec["sha256"]:
      return f"{p} does not match its sha256 (its contents changed after the save)"
  extra = sorted(set(p.relative_to(step_dir).as_posix() for p in _files(step_dir)) - set(want))
  return f"{step_dir / extra[0]} was not part of the save" if extra else None


# How a full disk reads where no errno says it: tensorstore (orbax) and HF tokenizers put the OS
# error in their message; numpy's ``tofile`` raises ``OSError("N requested and M written")``.
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|os_error_code='(28|122)'|"
                       r"os error (28|122)\b|^\d+ requested and \d+ written$")


def no_space(e: BaseException | None) -> bool:
  """Whether ``e`` (or an exception it was raised from) is a full disk: ENOSPC or EDQUOT, or a
  message that says so (tensorstore, tokenizers, a short write of numpy's ``tofile``)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if _NO_SPACE.search(str(e)):
      return True
    e = e.__cause__ or e.__context__
  return False


class _QuietFullDisk(logging.Filter):
  """Drops orbax's log records of a full disk (each with its traceback): the checkpointer reports
  the failure in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (record.levelno >= logging.ERROR and (no_space(exc) or _NO_SPACE.search(
        record.getMessage())))


_QUIET = _QuietFullDisk()


def quiet_full_disk_logs(quiet: bool = True) -> None:
  """Hides (or, with False, shows again) the error logs with tracebacks that orbax and tensorstore
  write for a full disk; ``Checkpointer`` reports each failed save in one line either way."""
  for name in ("absl", "orbax", ""):
    (logging.getLogger(name).addFilter if quiet else logging.getLogger(name).removeFilter)(_QUIET)


def space_line(path: str | os.PathLike, need_bytes: int | None, what: str) -> str:
  """``no space left on device at <path>: <what> needs about N MB, M MB free there``."""
  path = Path(path)
  probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
  free = shutil.disk_usage(probe).free
  need = f"about {need_bytes / 1e6:,.1f} MB" if need_bytes else "more space"
  return (f"no space left on device at {path}: {what} needs {need}, {free / 1e6:,.1f} MB free "
          "there; free some space or point it at another disk")


def _say(text: str) -> None:
  if jax.process_index() == 0:
    print(text, flush=True)


class Checkpointer:
  """Saves and restores train state, data position and run metadata.

  Args:
    directory: checkpoint folder (created).
    every: save when ``step % every == 0`` (``save`` saves at any step it is called with).
    keep: number of checkpoints kept (the newest).
    async_save: write in a background thread (arrays are copied to host before ``save`` returns,
      so the state's buffers may be donated right after).
    log: prints a message (failed saves, corrupt checkpoints); default prints from process 0.
  """

  def __init__(self, directory: str | os.PathLike, *, every: int, keep: int = 3,
               async_save: bool = True, log: Callable[[str], None] = _say):
    if every < 1 or keep < 1:
      raise ValueError(f"checkpoint every={every} and keep={keep} must be >= 1")
    self.directory = Path(directory).absolute()
    self.every = every
    self.log = log
    self.failure: str | None = None  # why the last save that failed did (None: none failed)
    self._saving: list[int] = []  # steps saved by this process, checksums not yet confirmed
    self._need: int | None = None  # bytes of the last state saved (for a full disk's message)
    async_options = ocp.AsyncOptions(post_finalization_callback=self._on_saved) \
        if async_save else None
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1,
                                           enable_async_checkpointing=async_save, create=True,
                                           async_options=async_options)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.every == 0

  # ------------------------------------------------------------------------- saving

  def _on_saved(self) -> None:
    """orbax's save thread, once a step's files are complete and before the step directory is
    renamed into place: the checksums become part of the step atomically."""
    if jax.process_index() != 0:
      return
    for step in self._saving:
      tmp = list(self.directory.glob(f"{step}{ORBAX_TMP}*"))
      if len(tmp) == 1 and not (tmp[0] / CHECKSUMS).is_file():
        write_checksums(tmp[0])

  def _settle(self) -> bool:
    """Waits for the save in flight; reports a failure; writes checksums the save thread could
    not. Returns False if a save failed."""
    ok = True
    try:
      self._mgr.wait_until_finished()
    except Exception as e:
      ok = False
      step = self._saving[-1] if self._saving else "?"
      why = self.failure = (space_line(self.directory, self._need, f"checkpoint step {step}")
                            if no_space(e) else f"{type(e).__name__}: {e}")
      self.log(f"warning: saving checkpoint step {step} to {self.directory} failed ({why}); "
               "training goes on and the next save tries again")
    for step in self._saving:
      step_dir = self.directory / str(step)
      if jax.process_index() == 0 and step_dir.is_dir() and not (step_dir / CHECKSUMS).is_file():
        write_checksums(step_dir)
    self._saving = []
    return ok

  def save(self, step: int, state, data_iter=None, meta: dict | None = None) -> bool:
    """Starts saving ``state`` (and the data position and ``meta``) as ``step``.

    A failure (of this save, or found now of the previous async one) is reported with ``log``
    and does not raise: the run goes on and the next save tries again.

    Args:
      step: the number of completed updates.
      state: the train state pytree of jax Arrays.
      data_iter: the training data iterator, or None.
      meta: JSON-able description of the run, compared on restore.

    Returns:
      True if a save was started.
    """
    self._settle()
    self._need = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      items.update(_data_save(data_iter))
    self._saving.append(step)
    try:
      started = self._mgr.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:
      self._saving.pop()
      why = self.failure = (space_line(self.directory, self._need, f"checkpoint step {step}")
                            if no_space(e) else f"{type(e).__name__}: {e}")
      self.log(f"warning: could not save checkpoint step {step} to {self.directory} ({why}); "
               "training goes on and the next save tries again")
      return False
    if not self._mgr.is_saving_in_progress():
      self._settle()
    return started

  def poll(self) -> None:
    """Reports a failed background save as soon as it has finished (call it between steps)."""
    if self._saving and not self._mgr.is_saving_in_progress():
      self._settle()

  def wait(self) -> bool:
    """Blocks until pending async saves are on disk; False if one failed (it is reported)."""
    return self._settle()

  def close(self) -> None:
    self._settle()
    self._mgr.close()

  # ------------------------------------------------------------------------- restoring

  def intact_step(self) -> int | None:
    """The newest step that passes ``verify`` (or has no checksums), or None if there is none.

    Corrupt steps newer than it are reported, with what failed, and moved to
    ``<directory>-corrupt/<step>`` (so that the run can save those steps again).

    Raises:
      CorruptCheckpointError: there are steps, and every one is corrupt (nothing is moved).
    """
    corrupt = []
    for step in sorted(self.all_steps(), reverse=True):
      why = verify(self.directory / str(step))
      if why is not None and why != "unverified":
        corrupt.append((step, why))
        continue
      if why == "unverified":
        self.log(f"note: checkpoint {self.directory / str(step)} has no checksums (saved by an "
                 "older fp4jax, or stopped while writing them): restored unverified")
      for bad, reason in corrupt:
        self._quarantine(bad)
        self.log(f"checkpoint {self.directory / str(bad)} is corrupt: {reason}; moved to "
                 f"{self.directory}-corrupt/{bad}")
      if corrupt:
        self.log(f"falling back to step {step}, the newest intact checkpoint")
      return step
    if corrupt:
      raise CorruptCheckpointError(
          f"every checkpoint in {self.directory} is corrupt:\n  "
          + "\n  ".join(f"step {s}: {why}" for s, why in corrupt)
          + f"\nnothing was restored; to train this run from the start, move {self.directory} "
          "away (or delete it)")
    return None

  def _quarantine(self, step: int) -> None:
    if jax.process_index() == 0:
      dest = self.directory.parent / f"{self.directory.name}-corrupt" / str(step)
      dest.parent.mkdir(parents=True, exist_ok=True)
      if dest.exists():
        shutil.rmtree(dest)
      os.rename(self.directory / str(step), dest)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"fp4jax checkpoint {step} moved")
    self._mgr.reload()

  def params_max_abs(self, step: int) -> float:
    """The largest magnitude of the parameters (``state["params"]``) saved as ``step``; NaN if one
    is NaN, inf if one is infinite."""
    state = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    top = 0.0
    for x in jax.tree.leaves(state.state["params"]):
      x = np.abs(np.asarray(jax.device_get(x), np.float32))
      if x.size:
        m = float(np.max(x)) if not np.isnan(x).any() else math.nan
        top = m if math.isnan(m) else max(top, m)
        if math.isnan(top):
          return top
    return top

  def last_sound_step(self, bound: float = _PARAM_BOUND) -> tuple[int | None, list[str]]:
    """The newest step that verifies and whose parameters are finite and at most ``bound`` in
    magnitude (a divergence can save steps of parameters ~1e17 before its loss turns NaN).

    Returns:
      ``(step or None, why each newer step was passed over)``.
    """
    passed = []
    for step in sorted(self.all_steps(), reverse=True):
      why = verify(self.directory / str(step))
      if why not in (None, "unverified"):
        passed.append(f"step {step} is corrupt ({why})")
        continue
      try:
        top = self.params_max_abs(step)
      except Exception as e:
        passed.append(f"step {step} cannot be read ({type(e).__name__})")
        continue
      if not top <= bound:
        passed.append(f"step {step} holds parameters with magnitudes up to {top:.0e}"
                      if math.isfinite(top) else f"step {step} holds non-finite parameters")
        continue
      return step, passed
    return None, passed

  def read_meta(self, step: int) -> dict:
    """The ``meta`` saved with ``step``."""
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore(self, abstract_state, data_iter=None, meta: dict | None = None,
              step: int | None = None):
    """Restores a checkpoint into ``abstract_state``'s shapes, dtypes and shardings.

    Args:
      abstract_state: pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set.
      data_iter: iterator whose position is restored in place (if the checkpoint has one).
      meta: this run's description; any difference to the saved one raises.
      step: the step to restore (default ``intact_step()``).

    Returns:
      ``(step, state)``.

    Raises:
      FileNotFoundError: no checkpoint.
      CorruptCheckpointError: every checkpoint is corrupt.
      IncompatibleCheckpointError: the saved run's meta or tree differs from this run's.
    """
    step = self.intact_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    if meta is not None:
      diffs = [f"{p}: checkpoint {a!r}, this run {b!r}" for p, a, b in diff(self.read_meta(step), meta)]
      if diffs:
        raise IncompatibleCheckpointError(
            f"checkpoint {self.directory}/{step} was written by an incompatible run:\n  "
            + "\n  ".join(diffs) + "\nuse a fresh workdir, or restore with the saved config")
    try:
      restored = self._mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
    except (ValueError, KeyError, TypeError) as e:
      raise IncompatibleCheckpointError(
          f"checkpoint {self.directory}/{step} does not fit this run's state "
          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    if data_iter is not None:
      _data_restore(self._mgr, self.directory / str(step), step, data_iter)
    return step, restored.state


def _data_save(it) -> dict:
  if _is_grain(it):
    return {"data": grain.checkpoint.CheckpointSave(it)}
  if hasattr(it, "get_state"):
    return {"data_json": ocp.args.JsonSave(it.get_state())}
  return {}


def _data_restore(mgr, step_dir: Path, step: int, it) -> None:
  if (step_dir / "data").is_dir() and _is_grain(it):
    mgr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it)))
  elif (step_dir / "data_json").is_dir() and hasattr(it, "set_state"):
    state = mgr.restore(step, args=ocp.args.Composite(data_json=ocp.args.JsonRestore())).data_json
    it.set_state(state)
  elif jax.process_index() == 0:
    print(f"warning: checkpoint step {step} has no data position for this iterator; the data "
          "restarts from its beginning")
