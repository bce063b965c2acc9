"""The run directory's bookkeeping: one run at a time, and what a resumed run may change.

``<workdir>/run.lock`` (JSON: host, pid, start time) is held by the process that trains in the
folder; a second launch is refused, and a lock left by a dead process on this host is taken over.
A run's identity (``identity``: model, recipe, optimizer, data, batch size, sequence length,
seed) is saved with each checkpoint and compared on resume (``diff``): a change is an error unless
the caller allows it, and allowed changes are appended to ``<workdir>/config_history.jsonl`` with
each start of the run. ``<workdir>/config.json`` keeps the config of the run's first start.

A run also records the code it ran (``code_version``: the package version, a digest of the
package's source and, in a git checkout, the commit) in each checkpoint's meta (key ``code``, not
part of the identity: a resume may run other code, and its start records which) and in each line
of the history; launchers reuse a finished run only from the same code (``same_code``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from fp4jax.experiment import Experiment

_LOCK_FILE = "run.lock"
_HISTORY_FILE = "config_history.jsonl"
_CONFIG_FILE = "config.json"

# Identity fields whose change makes a checkpoint unusable (its arrays would not fit), and the
# sections a resumed run may change when asked to.
_FIXED = ("model", "recipe", "optimizer.name")
CHANGEABLE = ("optimizer", "data", "batch_size", "seq_len", "seed")


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was written by a run whose model, recipe or optimizer differ from this one."""


class RunLockedError(RuntimeError):
  """Another live process trains in this run directory."""


class RunChangedError(ValueError):
  """A resumed run's identity differs from its checkpoint's, and the change was not allowed."""


def _pid_start(pid: int) -> str | None:
  """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat``), or None
  where it cannot be read: with the pid, it tells a live holder from a process that reuses its pid."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return stat.rsplit(")", 1)[-1].split()[19]


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def make_folder(path: str | os.PathLike, what: str = "run") -> Path:
  """Creates the folder ``path`` (and its parents) for a run, study or comparison; returns it.

  Raises:
    NotADirectoryError: ``path`` or one of its parents is a file; the message names it and says to
      name a folder (``what`` says whose, e.g. "study").
  """
  path = Path(path)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError) as e:
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
    raise NotADirectoryError(f"the {what}'s folder {path}: {blocker} is a file, not a folder; name a "
                             "new or existing folder") from e
  return path


class RunLock:
  """An exclusive lock on a run directory; a context manager, re-entrant in one process.

  Args:
    workdir: the run directory (created).
    what: what holds the folder, in messages ("run", "study", "comparison").

  Raises (on entry):
    RunLockedError: another process holds the lock (the message names its host and pid), or the
      lock file cannot be read.
  """

  _held: dict[Path, int] = {}  # lock path -> nesting depth, in this process

  def __init__(self, workdir: str | os.PathLike, what: str = "run"):
    self.path = (Path(workdir) / _LOCK_FILE).absolute()
    self.what = what
    self.notes: list[str] = []

  def __enter__(self) -> RunLock:
    if self._held.get(self.path):
      self._held[self.path] += 1
      return self
    make_folder(self.path.parent, self.what)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid_start": _pid_start(os.getpid())}
    for _ in range(3):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        self._take_over_if_stale(me)
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(me, f)
      self._held[self.path] = 1
      return self
    raise RunLockedError(f"could not take the lock {self.path}: other processes keep taking it")

  def _take_over_if_stale(self, me: dict) -> None:
    try:
      holder = json.loads(self.path.read_text())
      host, pid = holder["host"], int(holder["pid"])
    except FileNotFoundError:
      return  # released meanwhile: try again
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise RunLockedError(
          f"{self.path} exists but cannot be read ({e}); if no run uses {self.path.parent}, "
          "delete it and launch again") from e
    plural = "studies" if self.what == "study" else f"{self.what}s"
    two = (f"two {plural} in one folder would overwrite each other's "
           + ("checkpoints" if self.what == "run" else "runs"))
    if host != me["host"]:
      raise RunLockedError(
          f"{self.path.parent} is in use by process {pid} on host {host} (since "
          f"{holder.get('started', '?')}); {two}. Use another --workdir, or delete {self.path} if "
          f"that {self.what} is dead")
    recorded = holder.get("pid_start")
    reused = recorded is not None and _pid_start(pid) not in (None, recorded)
    if pid != me["pid"] and _pid_alive(pid) and not reused:
      raise RunLockedError(
          f"{self.path.parent} is in use by process {pid} on this host (since "
          f"{holder.get('started', '?')}); {two}. Stop that {self.what} or use another --workdir; "
          f"if process {pid} is not that {self.what} (it died and another program got its pid), "
          f"release the lock with `rm {self.path}`")
    # A dead holder on this host: move its lock aside atomically (one taker wins the rename).
    stale = self.path.with_name(f"{_LOCK_FILE}.stale-{os.getpid()}")
    try:
      os.rename(self.path, stale)
    except FileNotFoundError:
      return
    stale.unlink(missing_ok=True)
    why = "its pid now belongs to another process" if reused else "no longer running"
    self.notes.append(f"took over the lock of process {pid} ({why}) on {host}")

  def __exit__(self, *exc) -> None:
    self.release()

  def release(self, force: bool = False) -> None:
    """Releases one level of the lock (all with ``force``); the file is removed when the
    outermost level exits."""
    depth = self._held.get(self.path, 0)
    if depth > 1 and not force:
      self._held[self.path] = depth - 1
      return
    self._held.pop(self.path, None)
    try:
      holder = json.loads(self.path.read_text())
    except (OSError, ValueError):
      return
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
      self.path.unlink(missing_ok=True)


CODE_KEY = "code"  # the code's record in a checkpoint's meta, beside the identity


@functools.cache
def code_version() -> dict:
  """The code this process runs: ``{"version", "source", "commit"?, "dirty"?}``.

  ``source`` is the sha256 over the path and bytes of every ``.py`` file of the ``fp4jax`` package
  (its kernels included), so a copy of the same code on another machine has the same one;
  ``commit`` is the git commit of the checkout holding the package, where there is one (``dirty``
  True when the package differs from it).
  """
  import fp4jax

  pkg = Path(fp4jax.__file__).resolve().parent
  h = hashlib.sha256()
  for root, dirs, files in os.walk(pkg, followlinks=True):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    for name in sorted(files):
      if name.endswith(".py"):
        path = Path(root) / name
        h.update(path.relative_to(pkg).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
  out = {"version": fp4jax.__version__, "source": h.hexdigest()}
  try:
    git = lambda *a: subprocess.run(["git", "-C", str(pkg), *a], capture_output=True, text=True,
                                    timeout=10, check=True).stdout.strip()
    out["commit"] = git("rev-parse", "HEAD")
    out["dirty"] = bool(git("status", "--porcelain", "--", ".", str(pkg.parent / "kernels")))
  except (OSError, subprocess.SubprocessError):
    pass  # not a git checkout, or no git: the source digest alone says what ran
  return out


def describe_code(code: Mapping | None) -> str:
  """A recorded ``code_version`` in a few words (None: a run that recorded none)."""
  if not code:
    return "code that was not recorded (a run from before runs recorded their code)"
  commit = code.get("commit")
  at = f"commit {commit[:10]}{' + local changes' if code.get('dirty') else ''}, " if commit else ""
  return f"fp4jax {code.get('version')} ({at}source {str(code.get('source'))[:12]})"


def same_code(saved: Mapping | None, current: Mapping | None = None) -> bool:
  """Whether a recorded ``code_version`` is this process's (the same package source)."""
  current = code_version() if current is None else current
  return bool(saved) and saved.get("source") == current.get("source")


def identity(exp: Experiment) -> dict:
  """What a run is: saved with each checkpoint and compared when the run resumes.

  A resumed run must have the same model, recipe and optimizer kind (else its checkpoint does not
  fit); the optimizer's settings, the data, batch size, sequence length and seed may change only
  when allowed (``identity_changes``). The schedules of the run (steps, logging, checkpoint and
  LoRA re-split cadence) and its ``fp4jax.execution.Execution`` (which code runs each op) may
  change freely.

  Args:
    exp: the run (``fp4jax.experiment.Experiment``).

  Returns:
    JSON-able ``{"model", "recipe", "optimizer", "batch_size", "seq_len", "seed", "data"}``;
    ``data`` is ``exp.data_info`` (``{}`` if None).
  """
  r = {k: v for k, v in exp.recipe.to_dict().items() if k != "lora_resplit_every"}  # a schedule
  return {"model": dataclasses.asdict(exp.model), "recipe": r,
          "optimizer": dataclasses.asdict(exp.optimizer), "batch_size": exp.train.batch_size,
          "seq_len": exp.train.seq_len, "seed": exp.train.seed, "data": dict(exp.data_info or {})}


ABSENT = "<absent>"  # diff's value on the side that lacks a key


def diff(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
  """The leaves where two nested JSON-like trees differ.

  Args:
    a, b: nested mappings (an identity, a config); lists and tuples compare as lists.
    prefix: prepended to every path.

  Returns:
    ``(dotted path, value in a, value in b)`` for each differing leaf, sorted by key; a key that
    one side lacks is a leaf whose value there is ``ABSENT`` (drop those with ``a is ABSENT`` to
    compare only what ``a`` records, e.g. an identity saved before a field existed).
  """
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    out = []
    for k in sorted(set(a) | set(b)):
      out += diff(a.get(k, ABSENT), b.get(k, ABSENT), f"{prefix}{k}.")
    return out
  if isinstance(a, list | tuple) and isinstance(b, list | tuple):
    a, b = list(a), list(b)
  return [] if a == b else [(prefix[:-1], a, b)]


def _saved_diff(saved: Mapping, current: Mapping) -> list[tuple[str, object, object]]:
  """``diff`` over the fields ``saved`` records (a checkpoint written before a field existed); a
  recipe saved in an older layout is compared upgraded (``fp4jax.recipe.upgrade_config``: the
  re-split's fields of an identity that held them under ``optimizer`` are the recipe's), and a saved
  ``recipe.matmul`` without ``rounding_bits`` as ``"random"``, the stream it ran (the field's
  default then), so that such a run does not resume on another stream."""
  # the recipe imports the ops; identities stay light
  from fp4jax.recipe import recorded_rounding_bits, upgrade_config

  saved = upgrade_config({k: v for k, v in saved.items() if k != CODE_KEY})  # CODE_KEY: what ran it, not what it is
  recipe = saved.get("recipe")
  matmul = recipe.get("matmul") if isinstance(recipe, dict) else None
  if isinstance(matmul, dict) and "rounding_bits" not in matmul:  # saved before the field existed
    saved["recipe"] = {**recipe, "matmul": {**matmul, "rounding_bits": recorded_rounding_bits(matmul)}}
  return [d for d in diff(saved, current) if d[1] is not ABSENT]


def _under(path: str, sections: Iterable[str]) -> bool:
  return any(path == s or path.startswith(s + ".") for s in sections)


def identity_diffs(saved: Mapping, current: Mapping) -> list[str]:
  """``"<field>: checkpoint <saved>, this run <current>"`` for each field that differs (a field the
  saved identity lacks is not compared)."""
  return [f"{p}: checkpoint {a!r}, this run {b!r}" for p, a, b in _saved_diff(saved, current)]


def identity_changes(saved: Mapping, current: Mapping, allow: Iterable[str] = ()) -> list[str]:
  """Compares a checkpoint's run identity with this run's.

  Args:
    saved: the identity stored with the checkpoint.
    current: this run's identity.
    allow: identity fields or sections (of ``CHANGEABLE``, e.g. "seed", "optimizer",
      "optimizer.learning_rate") that may differ.

  Returns:
    One line per allowed change, ``"<field>: <saved> -> <current>"``.

  Raises:
    ValueError: ``allow`` names something that is not changeable.
    fp4jax.checkpoint.IncompatibleCheckpointError: the model, recipe or optimizer kind differs.
    RunChangedError: another field differs and is not allowed.
  """
  allow = tuple(allow)
  if bad := [a for a in allow if not _under(a, CHANGEABLE)]:
    raise ValueError(f"allow_changes {bad}: a resumed run may change only {list(CHANGEABLE)} "
                     "(or a field inside them, e.g. optimizer.learning_rate)")
  diffs = _saved_diff(saved, current)
  fixed = [f"{p}: checkpoint {a!r}, this run {b!r}" for p, a, b in diffs if _under(p, _FIXED)]
  if fixed:
    raise IncompatibleCheckpointError(
        "the checkpoint was written by a different model, recipe or optimizer:\n  "
        + "\n  ".join(fixed) + "\nuse a fresh workdir, or resume with the checkpoint's settings")
  refused = [(p, a, b) for p, a, b in diffs if not _under(p, allow)]
  if refused:
    fields = sorted({p for p, _, _ in refused})
    raise RunChangedError(
        "resuming would change the run:\n  "
        + "\n  ".join(f"{p}: checkpoint {a!r}, this run {b!r}" for p, a, b in refused)
        + f"\nresume with the checkpoint's settings, use a fresh workdir, or allow the change "
        f"(--allow_changes={','.join(fields)} on the command line; train(..., "
        f"allow_changes={tuple(fields)}))")
  return [f"{p}: {a!r} -> {b!r}" for p, a, b in diffs]


def record_start(workdir: str | os.PathLike, step: int, config: Mapping | None,
                 changes: list[str]) -> None:
  """Appends this start of the run (with the code it runs, ``code_version``) to
  ``config_history.jsonl``; writes ``config.json`` on a fresh start (a resumed run never
  overwrites it)."""
  workdir = make_folder(workdir)
  if config is not None and (step == 0 or not (workdir / _CONFIG_FILE).is_file()):
    (workdir / _CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
  entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "step": step, "host": socket.gethostname(),
           "pid": os.getpid(), "changes": changes, "code": code_version(), "config": config}
  with open(workdir / _HISTORY_FILE, "a") as f:
    f.write(json.dumps(entry, default=str) + "\n")
