"""experiments._pool under stop signals, with more jobs than slots: the parent exits 128 + the
signal once its running jobs have saved, names where each stands, starts no pending job; a second
signal ends it at once and leaves no job alive.

The jobs are small Python processes that behave as a launcher does on a signal (print the line
``stopped by SIG... at step N`` and exit 128 + the signal), so each test takes about a second.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A job: counts steps; on the first signal it "saves" for `save_s` seconds, says where it stopped
# and exits 128 + the signal; `stubborn` ignores every signal (a save that never ends).
JOB = textwrap.dedent("""
    import os, signal, sys, time
    name, save_s, stubborn = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
    got = []
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      signal.signal(s, lambda n, _: got.append(n))
    mark = os.path.join(os.environ["MARKS"], name)
    with open(mark + ".tmp", "w") as f:  # renamed whole: the test never reads a half-written pid
      f.write(str(os.getpid()))
    os.replace(mark + ".tmp", mark + ".pid")
    step = 0
    while True:
      time.sleep(0.05)
      step += 1
      if got and not stubborn:
        time.sleep(save_s)
        print(f"stopped by {signal.Signals(got[0]).name} at step {step}: checkpoint saved", flush=True)
        os._exit(128 + got[0])
""")

# The parent: runs the pool over `jobs` (one per argument), `parallel` at a time.
PARENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from experiments import _pool
    from fp4jax.preemption import TrainingInterrupted
    workdir, parallel, save_s, stubborn, *names = sys.argv[1:]
    _pool.KILL_AFTER = 0.5
    job = [sys.executable, "-c", {job!r}]
    try:
      _pool.run_parallel([(n, "a job") for n in names], int(parallel), Path(workdir),
                         lambda n: [*job, n, save_s, stubborn], kind="arm")
    except TrainingInterrupted as e:
      print(e, file=sys.stderr, flush=True)
      raise SystemExit(e.exit_code)
""").format(job=JOB)


@pytest.fixture
def started():
  procs = []
  yield procs
  for p in procs:  # a pool that hung (a failed test) goes with its jobs
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def _start(tmp_path, names, procs, parallel=2, save_s=0.0, stubborn=False):
  marks = tmp_path / "marks"
  marks.mkdir()
  env = {**os.environ, "MARKS": str(marks), "PYTHONPATH": str(REPO)}
  proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "w"), str(parallel),
                           str(save_s), "1" if stubborn else "0", *names], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  procs.append(proc)
  t0 = time.monotonic()
  while len(list(marks.glob("*.pid"))) < min(parallel, len(names)):
    assert proc.poll() is None and time.monotonic() - t0 < 30, proc.communicate()
    time.sleep(0.05)
  return proc, {p.stem: int(p.read_text()) for p in marks.glob("*.pid")}


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie is dead (its parent, the pool, has exited and init reaps it).
  stat = Path(f"/proc/{pid}/stat")
  return stat.is_file() and stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_with_pending_jobs_ends_the_pool(tmp_path, started, sig):
  proc, pids = _start(tmp_path, ["a", "b", "c"], started, save_s=0.3)
  # Ctrl-C, a closed terminal or a scheduler reach the parent's group only (the jobs run in
  # sessions of their own): the parent forwards it.
  t0 = time.monotonic()
  os.killpg(proc.pid, sig)
  out, err = proc.communicate(timeout=20)
  assert time.monotonic() - t0 < 5, "the pool waited for a job that never starts"
  assert proc.returncode == 128 + sig, out + err
  name = signal.Signals(sig).name
  assert f"=== arm a: stopped by {name} at step" in out and f"=== arm b: stopped by {name}" in out
  assert err.startswith(f"stopped by {name}: arm a: stopped by {name} at step")
  assert "not started: c; the same command resumes every arm" in err
  assert sorted(pids) == ["a", "b"] and not (tmp_path / "w" / "logs" / "c.log").exists()


def test_a_second_signal_ends_the_pool_at_once_without_orphans(tmp_path, started):
  proc, pids = _start(tmp_path, ["a", "b", "c"], started, stubborn=True)
  os.killpg(proc.pid, signal.SIGINT)
  time.sleep(0.5)
  assert proc.poll() is None  # the first Ctrl-C waits for the jobs' checkpoints
  t0 = time.monotonic()
  os.killpg(proc.pid, signal.SIGINT)
  out, err = proc.communicate(timeout=20)
  assert time.monotonic() - t0 < 3
  assert proc.returncode == 128 + signal.SIGINT, out + err
  assert "arm a: killed on the second signal" in err and "not started: c" in err
  assert not any(_alive(p) for p in pids.values())


def test_ctrl_c_outside_a_run_is_one_line_and_status_130(capsys):
  from experiments import train as launcher

  def evaluating():
    raise KeyboardInterrupt
  with pytest.raises(SystemExit) as e:
    launcher.report_errors(evaluating)
  assert e.value.code == 128 + signal.SIGINT
  assert capsys.readouterr().err == "stopped by SIGINT: nothing was training, nothing to save\n"
