"""Stopping a run on SIGTERM, SIGINT or SIGHUP without losing work.

Inside ``StopSignals``, the first SIGTERM, SIGINT or SIGHUP (a cluster's preemption notice, Ctrl-C,
a closed terminal) is a
request that the train loop sees after the step it is in: it saves a checkpoint there and raises
``TrainingInterrupted``. Until ``arm`` is called (while setting up and compiling, before the first
step of this start has run: nothing would be lost), a signal ends the process at once instead — a Python signal
handler would run only after an XLA compilation returns, which can take minutes. A watcher thread
woken through ``signal.set_wakeup_fd`` prints why and exits with status 128 + the signal number.
A second signal also ends the process at once, without waiting for a checkpoint being written
(the previous complete checkpoint stays valid: orbax renames a step into place only when done).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class TrainingInterrupted(KeyboardInterrupt):
  """The run stopped on a signal after saving a checkpoint.

  Attributes:
    signal_name: "SIGTERM", "SIGINT" or "SIGHUP".
    step: the step saved.
    checkpoint: the checkpoint's path.
    exit_code: 128 + the signal number (the shell's code for a process ended by it).
  """

  def __init__(self, message: str, signum: int, step: int, checkpoint: str):
    super().__init__(message)
    self.signal_name = signal.Signals(signum).name
    self.step, self.checkpoint, self.exit_code = step, checkpoint, 128 + signum


class StopSignals:
  """Turns SIGTERM / SIGINT / SIGHUP into a stop request (a context manager; inert off the main
  thread). Nested instances (a study around its arms' runs) each see the signals while they are the
  innermost; an immediate exit calls the ``before_exit`` of every active one, innermost first.

  Args:
    say: prints a line (the reason of an immediate exit).
    until_armed: the reason printed when a signal before ``arm`` ends the process at once.
    before_exit: called before an immediate exit (e.g. releasing the run's lock).
  """

  _active_stack: list[StopSignals] = []

  def __init__(self, say: Callable[[str], None], until_armed: str,
               before_exit: Callable[[], None] | None = None):
    self._say, self._before_exit = say, before_exit
    self._lock = threading.Lock()
    self._count = 0
    self._signum: int | None = None
    self._instant: str | None = until_armed
    self._active = False

  @property
  def requested(self) -> str | None:
    """The name of the signal received, or None."""
    return signal.Signals(self._signum).name if self._signum else None

  @property
  def signum(self) -> int | None:
    return self._signum

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is not threading.main_thread():
      return self
    self._old = {s: signal.signal(s, self._record) for s in SIGNALS}
    self._r, self._w = os.pipe()
    os.set_blocking(self._w, False)
    self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
    self._thread = threading.Thread(target=self._watch, name="fp4jax-stop-signals", daemon=True)
    self._active = True
    self._active_stack.append(self)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    if not self._active:
      return
    self._active = False
    if self in self._active_stack:
      self._active_stack.remove(self)
    signal.set_wakeup_fd(self._old_fd)
    for s, h in self._old.items():
      signal.signal(s, h)
    os.write(self._w, b"\0")  # wakes the watcher, which then returns
    self._thread.join(timeout=5)
    os.close(self._r)
    os.close(self._w)

  def _record(self, signum, frame) -> None:  # the Python-level handler: the loop polls the flag
    del frame
    with self._lock:
      self._signum = self._signum or signum

  def _watch(self) -> None:
    while True:
      data = os.read(self._r, 64)
      if not self._active or not data:
        return
      for signum in data:
        if signum not in SIGNALS:
          continue
        with self._lock:
          self._signum = self._signum or signum
          self._count += 1
          if self._instant is not None:
            why = self._instant
          elif self._count > 1:
            why = "not waiting for the checkpoint being saved (the previous one stays valid)"
          else:
            continue
        self._exit_now(signum, why)

  def _exit_now(self, signum: int, why: str) -> None:
    self._say(f"stopped by {signal.Signals(signum).name}: {why}")
    try:
      for s in reversed(self._active_stack):
        if s._before_exit is not None:
          with contextlib.suppress(Exception):
            s._before_exit()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(128 + signum)

  def arm(self) -> None:
    """From now on the first signal is a request (``requested``), not an immediate exit."""
    with self._lock:
      self._instant = None
