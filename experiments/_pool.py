"""A pool of launcher processes on one machine, with the stop signals forwarded to each.

``run_parallel`` runs one command per job, up to ``parallel`` at once, each in a session of its own
with its output in ``<workdir>/logs/<job>.log``. The parent records SIGTERM, SIGINT and SIGHUP and forwards
each one once to every running job; each job saves its step and exits, no further job starts, and
``TrainingInterrupted`` names where each stopped, finished or did not start. A second signal is
forwarded too (a job then exits without waiting for its checkpoint) and the parent stops waiting:
the jobs still alive ``KILL_AFTER`` seconds later are killed with their sessions. A job's process that
outlives its parent (killed by SIGKILL) stops itself as on SIGTERM (``watch_parent``).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fp4jax.preemption import SIGNALS, TrainingInterrupted

# Set in the pool's processes: their jobs train beside others (the value is ``parallel``).
CHILD_ENV = "FP4JAX_STUDY_PARALLEL"
PARENT_ENV = "FP4JAX_STUDY_PARENT"  # the parent's pid: a job whose parent died stops itself
KILL_AFTER = 3.0  # seconds the jobs get to exit after a second signal, before SIGKILL


class Forward:
  """The parent's handling of SIGTERM / SIGINT / SIGHUP: a signal is recorded (Python handler) and
  the pool's loop forwards each one to every running job once."""

  def __enter__(self) -> Forward:
    self.received: list[int] = []
    self._active = threading.current_thread() is threading.main_thread()
    if self._active:
      self._old = {s: signal.signal(s, lambda signum, _: self.received.append(signum))
                   for s in SIGNALS}
      self._old_fd = signal.set_wakeup_fd(-1)  # an enclosing StopSignals must not exit now
    return self

  def __exit__(self, *exc) -> None:
    if self._active:
      signal.set_wakeup_fd(self._old_fd)
      for s, h in self._old.items():
        signal.signal(s, h)


def watch_parent() -> None:
  """In a job's process: a parent that died (SIGKILL) leaves no orphan; the job stops as on
  SIGTERM (saving its step). Nothing outside a pool (``PARENT_ENV`` unset)."""
  parent = int(os.environ.get(PARENT_ENV, "0"))

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
  if parent:
    threading.Thread(target=watch, name="fp4jax-study-parent", daemon=True).start()


def _stop_line(log: Path) -> str:
  """The job's own line about its stop (``stopped by ...``), or its last line."""
  lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
  return next((x for x in reversed(lines) if x.startswith("stopped by")), lines[-1])


def run_parallel(jobs: Sequence[tuple[str, str]], parallel: int, workdir: Path,
                 command: Callable[[str], list[str]], *, kind: str = "arm",
                 on_start: Callable[[str], None] = lambda name: None,
                 result: Callable[[str], float] = lambda name: math.nan) -> list[str]:
  """Runs ``command(name)`` for each job ``(name, what)``, up to ``parallel`` processes at once.

  Each process runs in a session of its own, appending to ``<workdir>/logs/<name>.log``; the pool prints
  when each starts and ends. The processes do not preallocate device memory and each may take up
  to ``0.9 / parallel`` of it (``XLA_PYTHON_CLIENT_PREALLOCATE`` false,
  ``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set); ``CHILD_ENV`` and ``PARENT_ENV`` are set.

  Args:
    jobs: ``(name, what)`` in the order to start them; ``what`` is printed when one starts.
    parallel: processes at a time.
    workdir: the folder of the jobs; their logs go to its ``logs`` folder (created).
    command: the command line of a job.
    kind: what a job is, in the messages (``arm``).
    on_start: called before a job's process starts.
    result: the eval loss of a job that exited with status 0 (printed; NaN: none).

  Returns:
    The names of the jobs whose process failed.

  Raises:
    TrainingInterrupted: SIGTERM, SIGINT or SIGHUP reached the parent; it was forwarded once to
      every running job (each saves its step and exits), no further job started, and the message
      names where each stopped, finished or did not start once all have exited. A second signal
      is forwarded too, and the jobs alive ``KILL_AFTER`` seconds later are killed.
  """
  logs = workdir / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  repo = str(Path(__file__).resolve().parents[1])
  env = {**os.environ, CHILD_ENV: str(parallel), PARENT_ENV: str(os.getpid()),
         "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # Each process's allocator may grow to this share of the device, so together they fit on it.
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
  pending, running, failed, done = list(jobs), {}, [], 0
  finished, stopped = [], {}
  with Forward() as fwd:
    try:
      # After a signal no job starts: the pool waits for the running ones only.
      while running or (pending and not fwd.received):
        if len(fwd.received) > 1:  # a second signal: stop waiting for the jobs' checkpoints
          _forward(running, fwd.received)
          _kill(running, KILL_AFTER)
          for name, (proc, log, _, _) in running.items():
            log.close()
            stopped[name] = (_stop_line(logs / f"{name}.log") if proc.returncode != -signal.SIGKILL
                             else "killed on the second signal (its newest complete checkpoint "
                             "stays valid)")
            print(f"=== {kind} {name}: {stopped[name]}", flush=True)
          running.clear()
          break
        while pending and len(running) < parallel and not fwd.received:
          name, what = pending.pop(0)
          on_start(name)
          cmd = command(name)
          log = open(logs / f"{name}.log", "a")  # closed when its process ends
          log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
          log.flush()
          proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
          running[name] = [proc, log, time.perf_counter(), 0]
          print(f"=== {kind} {name}: started ({len(running)} running, {done}/{len(jobs)} done), "
                f"log {logs / (name + '.log')} — {what}", flush=True)
        time.sleep(0.2)
        _forward(running, fwd.received)
        for name, (proc, log, t0, _) in list(running.items()):
          if proc.poll() is None:
            continue
          log.close()
          del running[name]
          done += 1
          rc = proc.returncode
          if fwd.received and rc in [128 + s for s in SIGNALS] + [-s for s in SIGNALS]:
            stopped[name] = _stop_line(logs / f"{name}.log")
            print(f"=== {kind} {name}: {stopped[name]}", flush=True)
          elif rc:
            failed.append(name)
            tail = (logs / f"{name}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
            print(f"=== {kind} {name}: FAILED (exit {rc}) in "
                  f"{time.perf_counter() - t0:.0f} s: {tail[0]}", flush=True)
          else:
            finished.append(name)
            print(f"=== {kind} {name}: done in {time.perf_counter() - t0:.0f} s, eval loss "
                  f"{result(name):.4f} ({done}/{len(jobs)})", flush=True)
    finally:  # an error in the parent: its jobs stop as on SIGTERM (each saves its step)
      for proc, _, _, _ in running.values():
        if proc.poll() is None:
          proc.terminate()
      for proc, log, _, _ in running.values():
        proc.wait()
        log.close()
  if fwd.received:
    signum = fwd.received[0]
    parts = [f"stopped by {signal.Signals(signum).name}: "
             + "; ".join(f"{kind} {n}: {line}" for n, line in stopped.items())]
    if finished:
      parts.append(f"finished: {', '.join(finished)}")
    if failed:
      parts.append(f"failed: {', '.join(failed)} (see {logs})")
    if pending:
      parts.append(f"not started: {', '.join(n for n, _ in pending)}")
    raise TrainingInterrupted("; ".join(parts) + f"; the same command resumes every {kind}", signum,
                              -1, str(workdir))
  return failed


def _forward(running: dict, received: list[int]) -> None:
  """Sends each signal of ``received`` that a running job has not had yet to it (once each)."""
  for entry in running.values():
    for signum in received[entry[3]:]:
      if entry[0].poll() is None:
        entry[0].send_signal(signum)
    entry[3] = len(received)


def _kill(running: dict, grace: float) -> None:
  """Waits up to ``grace`` seconds for the running jobs, then kills each one's session (the job
  and anything it started: no orphan)."""
  deadline = time.monotonic() + grace
  for proc, _, _, _ in running.values():
    try:
      proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for proc, _, _, _ in running.values():
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group's id is its pid
    proc.wait()
