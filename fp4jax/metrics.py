"""Run metrics: JSONL, TensorBoard event files and a live progress bar.

``MetricsWriter(workdir)`` appends one JSON object per logged step to ``<workdir>/metrics.jsonl``
(a resumed run first drops the rows after the step it resumes from, so each step has one row)
and, when ``tensorboardX`` is installed, writes the same scalars as TensorBoard event files under
``<workdir>/tb``. On a terminal it shows a live ``rich`` progress bar; elsewhere (output to a file,
a cluster job) or with ``progress=False`` it prints one line per logged step instead. Only process
0 writes, in a multi-host run.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import jax

from fp4jax.checkpoint import no_space, space_line

# bf16 dense peak of one chip, FLOP/s (for MFU); matched against jax.Device.device_kind.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
}


def peak_flops(device: jax.Device | None = None) -> float | None:
  """Dense bf16 peak FLOP/s of ``device`` (default the first device), or None if unknown/CPU."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return None
  kind = device.device_kind
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):
    if name in kind:
      return PEAK_FLOPS[name]
  return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """All entries of a ``metrics.jsonl`` file."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def format_step(step: int, total_steps: int, metrics: dict) -> str:
  """One log line: step, loss, eval loss, learning rate, tokens/s, step time and ETA (the
  remaining steps at ``step_time_s``)."""
  width = len(str(total_steps))
  parts = [f"step {step:>{width}}/{total_steps}"]
  parts += [f"{name} {metrics[k]:.4f}" for k, name in (("loss", "loss"), ("eval_loss", "eval"))
            if k in metrics]
  if "lr" in metrics:
    parts.append(f"lr {metrics['lr']:.3g}")
  if "tokens_per_s" in metrics:
    parts.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
  if "step_time_s" in metrics:
    parts.append(f"{metrics['step_time_s'] * 1e3:.1f} ms/step")
    parts.append(f"ETA {_duration((total_steps - step) * metrics['step_time_s'])}")
  return " | ".join(parts)


def _truncate(path: Path, last_step: int) -> None:
  """Keeps the rows of ``path`` up to ``last_step`` (and drops an unfinished last line)."""
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and row.get("step", 0) <= last_step:
      keep.append(line if line.endswith("\n") else line + "\n")
  if len(keep) != len(lines):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def set_aside(workdir: str | os.PathLike, start: int, every: int) -> tuple[Path, int] | None:
  """Keeps a copy of ``<workdir>/metrics.jsonl`` before a start would drop rows that no lost
  save explains: any row on a fresh start (step 0: the checkpoints are gone), or rows more than
  ``every`` steps (the checkpoint cadence) past the step the run resumes from (newer checkpoints
  were deleted). Rows after ``start`` within one cadence are steps not yet saved when the run
  stopped, trained again as usual.

  Returns:
    ``(copy, last step it holds)``, or None when nothing is set aside. The copy is
    ``metrics.jsonl.<time>`` beside it; ``metrics.jsonl`` itself is then truncated as usual.
  """
  path = Path(workdir) / "metrics.jsonl"
  if not path.is_file():
    return None
  last = 0
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict) and isinstance(row.get("step"), int):
        last = max(last, row["step"])
  if not last or (start and last <= start + every):
    return None
  copy = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}")
  while copy.exists():
    copy = copy.with_name(copy.name + "+")
  shutil.copy2(path, copy)
  return copy, last


def _clean(v):
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/inf; keep them readable
  return v


class MetricsWriter:
  """Writes metrics of one run; use as a context manager.

  Args:
    workdir: run directory (created).
    total_steps: steps of the run, for the progress bar.
    initial_step: step the run starts from (after a resume); rows of ``metrics.jsonl`` after it
      (steps that were not checkpointed, and are trained again) are removed.
    progress: show a live progress bar when stdout is a terminal (else, and with False, one
      printed line per ``write``).
    tensorboard: also write TensorBoard event files (needs ``tensorboardX``).
  """

  def __init__(self, workdir: str | os.PathLike, total_steps: int, initial_step: int = 0, *,
               progress: bool = True, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self.workdir = Path(workdir)
    self.total_steps = total_steps
    self._tb = None
    self._progress = None
    if not self.enabled:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    path = self.workdir / "metrics.jsonl"
    if path.is_file():
      _truncate(path, initial_step)
    self._file = open(path, "a")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(str(self.workdir / "tb"))
      except ImportError:
        self._tb = None
    if progress and sys.stdout.isatty():
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                 TimeRemainingColumn)
      self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
      self._task = self._progress.add_task("train", total=total_steps, completed=initial_step,
                                           info="")
      self._progress.start()

  def write(self, step: int, metrics: dict) -> None:
    """Logs ``metrics`` (str -> number) at ``step``: a JSONL line, TB scalars, and the bar's text
    or a printed line (``format_step``)."""
    if not self.enabled:
      return
    entry = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
    try:
      self._file.write(json.dumps(entry) + "\n")
      self._file.flush()
    except OSError as e:
      if not no_space(e):
        raise
      raise OSError(errno.ENOSPC, space_line(self._file.name, None, f"the metrics of step {step}")) from e
    if self._tb is not None:
      for k, v in metrics.items():
        if isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, int(step))
    if self._progress is not None:
      parts = [f"{k}={metrics[k]:.4g}" for k in ("loss", "eval_loss", "lr") if k in metrics]
      if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:.3g} tok/s")
      self._progress.update(self._task, info=" ".join(parts))
    else:
      print(format_step(step, self.total_steps, metrics), flush=True)

  def advance(self, step: int) -> None:
    """Moves the progress bar to ``step`` completed steps."""
    if self._progress is not None:
      self._progress.update(self._task, completed=step)

  def message(self, text: str) -> None:
    """Prints a line above the progress bar (or plainly), from process 0 only."""
    if not self.enabled:
      return
    if self._progress is not None:
      self._progress.console.print(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if not self.enabled:
      return
    if self._progress is not None:
      self._progress.stop()
      self._progress = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if not self._file.closed:
      self._file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
