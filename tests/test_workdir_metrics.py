"""Deleted or missing checkpoints never silently discard a run's metrics: a start that would drop
rows no lost save explains keeps them in a copy beside ``metrics.jsonl`` and says so (a run
whose checkpoints were deleted: test_data_prepared's slow test)."""

import json

from fp4jax.metrics import set_aside


def _rows(workdir, steps):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                 for s in steps) + '{"step": 99, "lo')


def test_rows_are_set_aside_only_when_no_lost_save_explains_their_loss(tmp_path):
  _rows(tmp_path, range(1, 61))
  assert set_aside(tmp_path, 50, 10) is None  # steps 51-60 were not saved yet: trained again
  assert set_aside(tmp_path, 40, 10)[1] == 60  # newer checkpoints deleted
  copy, last = set_aside(tmp_path, 0, 10)  # every checkpoint gone
  assert last == 60 and copy.parent == tmp_path and copy.name.startswith("metrics.jsonl.")
  assert copy.read_text() == (tmp_path / "metrics.jsonl").read_text()
  assert copy != set_aside(tmp_path, 0, 10)[0]
  assert set_aside(tmp_path / "fresh", 0, 10) is None
