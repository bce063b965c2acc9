"""A full disk, from any writer (orbax/tensorstore, numpy's ``tofile``, the tokenizer, a plain
file), is one line naming the path and the space free there, with no traceback unless --verbose;
temporary preparation folders do not outlive a failure or the process that made them; a damaged
shard on read-only storage says so.

A real full disk is simulated by the errors each writer raises on one (as seen on a full tmpfs).
"""

import contextlib
import errno
import logging

import numpy as np
import pytest

from experiments import train as launcher
from fp4jax import corpus as corpus_lib
from fp4jax import data
from fp4jax.checkpoint import _QUIET, no_space
from fp4jax.metrics import MetricsWriter

# What each writer raises on a full disk.
TENSORSTORE = ValueError(
    'RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/100.orbax-checkpoint-tmp/state/'
    '_sharding": Failed to write 7300 bytes to file 13: No space left on device [os_error_code=\'28\']')
NUMPY = OSError("153118 requested and 72678 written")
TOKENIZERS = Exception("No space left on device (os error 28)")


@pytest.mark.parametrize("e", [TENSORSTORE, NUMPY, TOKENIZERS, OSError(errno.ENOSPC, "x"),
                               OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_a_full_disk_is_recognized_from_every_writer(e):
  assert no_space(e)
  try:
    try:
      raise e
    except Exception as inner:
      raise RuntimeError("save failed") from inner
  except RuntimeError as outer:
    assert no_space(outer)


@pytest.mark.parametrize("e", [ValueError("bad value"), OSError(errno.EACCES, "denied"),
                               OSError("5 requested and 5 written, then it broke")])
def test_other_errors_are_not_a_full_disk(e):
  assert not no_space(e)


def test_orbax_full_disk_logs_are_hidden_but_not_other_errors():
  def record(msg, exc=None):
    return logging.LogRecord("absl", logging.ERROR, "future.py", 1, msg, None,
                             (type(exc), exc, None) if exc else None)
  assert not _QUIET.filter(record("_SignalingThread.run() raised an exception", TENSORSTORE))
  assert not _QUIET.filter(record(str(TENSORSTORE)))
  assert _QUIET.filter(record("something else failed", ValueError("bad")))


def test_the_launchers_print_one_line_and_the_traceback_only_if_verbose(tmp_path, capsys):
  def fail():
    raise RuntimeError("the save thread failed") from TENSORSTORE
  for verbose in (False, True):
    with pytest.raises(SystemExit) as ex:
      launcher.report_errors(fail, verbose, tmp_path)
    assert ex.value.code == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: no space left on device at {tmp_path}: writing there needs "
                           "more space,") and "MB free there" in last
    assert ("Traceback" in err) == verbose and (len(err.strip().splitlines()) == 1) != verbose
  with pytest.raises(SystemExit):  # the error's own line, when it has one
    launcher.report_errors(lambda: (_ for _ in ()).throw(OSError(
        errno.ENOSPC, f"no space left on device at {tmp_path}: x needs 1 MB, 0 MB free")))
  assert capsys.readouterr().err.startswith(f"error: no space left on device at {tmp_path}: x ")


def test_metrics_on_a_full_disk_name_their_file(tmp_path):
  w = MetricsWriter(tmp_path, 10, progress=False, tensorboard=False)

  class Full:
    name = str(tmp_path / "metrics.jsonl")

    def write(self, _):
      raise OSError(errno.ENOSPC, "No space left on device")
    closed = False

    def close(self):
      pass
  w._file = Full()
  with pytest.raises(OSError, match=rf"no space left on device at {tmp_path}/metrics.jsonl: the "
                     "metrics of step 3 needs more space"):
    w.write(3, {"loss": 1.0})


@pytest.fixture()
def text_dir(tmp_path):
  d = tmp_path / "text"
  d.mkdir()
  for i in range(6):
    (d / f"doc_{i}.txt").write_text(f"document {i}: " + "the king and the queen. " * 40)
  return d


def test_preparing_on_a_full_disk_is_one_line_and_leaves_no_temporary_folder(text_dir, tmp_path,
                                                                             monkeypatch):
  out = tmp_path / "d" / "tok"
  stale = tmp_path / "d" / ".tok.tmp-999999"  # of a preparation that was killed
  (stale / "sub").mkdir(parents=True)

  def full(*a, **k):
    raise NUMPY
  monkeypatch.setattr(data, "_write_split", lambda *a, **k: full())
  with pytest.raises(OSError) as e:
    data.prepare(text_dir, out)
  assert e.value.errno == errno.ENOSPC
  assert e.value.strerror.startswith(f"no space left on device at {out.parent}: the token shards of "
                                     "text (up to 4 bytes per byte")
  assert sorted(p.name for p in out.parent.iterdir()) == [".tok.lock"]  # no tmp folder, stale or new
  # The command line prints the line alone.
  with pytest.raises(SystemExit, match=r"^error: no space left on device at .*MB free there"):
    data.main(["prepare", f"--corpus={text_dir}", f"--out={out}"])


def test_a_damaged_shard_on_read_only_storage_says_so(text_dir, tmp_path, monkeypatch):
  out = tmp_path / "tok"
  meta = data.prepare(text_dir, out)
  shard = out / meta.splits["validation"]["shards"][0]["file"]
  ids = np.fromfile(shard, "<u2")
  ids[0] ^= 1
  ids.tofile(shard)

  @contextlib.contextmanager
  def read_only(path):
    raise OSError(errno.EROFS, "Read-only file system", str(path))
    yield
  monkeypatch.setattr(corpus_lib, "file_lock", read_only)
  with pytest.raises(ValueError, match=r"validation-00000.bin does not match its sha256 .*, and it is "
                     r"on storage this process cannot write \(Read-only file system: .*copy an intact "
                     r"folder there, or prepare the data in a writable folder"):
    data.prepare(text_dir, out)
