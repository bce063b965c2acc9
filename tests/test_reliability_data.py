"""Data is checked before the first step: text encodings, batch-sized splits, token ids below the
vocabulary, shard sizes, and messages that name the file and a fix that exists."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import write_docs

from fp4jax import data

@pytest.fixture()
def text_dir(tmp_path):
  return write_docs(tmp_path / "text", 6, "doc_{i}.txt")


def test_utf16_and_binary_text_are_rejected_or_decoded_on_request(text_dir, tmp_path):
  texts = {p.name: p.read_text() for p in text_dir.iterdir()}
  ref = data.prepare(text_dir, tmp_path / "utf8")
  doc = text_dir / "doc_3.txt"
  doc.write_bytes(texts["doc_3.txt"].encode("utf-16"))
  with pytest.raises(ValueError, match=r"doc_3.txt is not utf-8 text: byte 0xff at offset 0 "
                     r"\(it starts with a UTF-16 byte-order mark\).*--config.data.encoding="):
    data.prepare(text_dir, tmp_path / "o")
  doc.write_bytes(texts["doc_3.txt"].encode("utf-16-le"))  # no byte-order mark: NULs
  with pytest.raises(ValueError, match="doc_3.txt contains NUL characters.*--encoding="):
    data.prepare(text_dir, tmp_path / "o")
  doc.write_bytes(bytes(range(256)) * 4)  # binary
  with pytest.raises(ValueError, match="doc_3.txt is not utf-8 text"):
    data.prepare(text_dir, tmp_path / "o")
  assert not (tmp_path / "o").exists()
  # The corpus in UTF-16, with its encoding given, gives the tokens of its UTF-8 version.
  utf16 = tmp_path / "text16"
  utf16.mkdir()
  for name, text in texts.items():
    (utf16 / name).write_bytes(text.encode("utf-16"))
  meta = data.prepare(utf16, tmp_path / "u16", encoding="utf-16")
  assert meta.splits == ref.splits
  np.testing.assert_array_equal(np.fromfile(tmp_path / "u16" / "train-00000.bin", "<u2"),
                                np.fromfile(tmp_path / "utf8" / "train-00000.bin", "<u2"))
  with pytest.raises(ValueError, match="unknown text encoding 'klingon'"):
    data.prepare(utf16, tmp_path / "k", encoding="klingon")


def test_splits_must_hold_one_batch(text_dir, tmp_path):
  out = tmp_path / "d"
  meta = data.prepare(text_dir, out)
  windows = (meta.splits["validation"]["num_tokens"] - 1) // 16
  data.check_data(out, 384, 16, windows)
  with pytest.raises(ValueError, match=rf"split 'validation' of {out} has {windows} windows of "
                     rf"seq_len=16 .*fewer than one batch of {windows + 1}: use a smaller "
                     "batch_size or seq_len"):
    data.check_data(out, 384, 16, windows + 1)
  with pytest.raises(ValueError, match="split 'train'.*fewer than one batch"):
    data.check_data(out, 384, 16, 10_000, splits=("train",))


def _synthetic(path: Path, top: int, vocab: int, record_max: bool) -> Path:
  path.mkdir(parents=True)
  splits = {}
  for split in ("train", "validation"):
    ids = np.arange(400, dtype="<u2") % (top + 1)
    ids.tofile(path / f"{split}-00000.bin")
    shard = {"file": f"{split}-00000.bin", "num_tokens": 400}
    if record_max:
      shard["max_id"] = top
    splits[split] = {"num_tokens": 400, "num_docs": 1, "shards": [shard]}
  (path / "meta.json").write_text(json.dumps({
      "format_version": 1, "dtype": "uint16", "vocab_size": vocab, "eos_id": 0,
      "tokenizer": {"kind": "byte"}, "splits": splits, "corpus": {"name": "s"}, "licenses": [],
      "fingerprint": "x"}))
  return path


@pytest.mark.parametrize("record_max", [True, False])
def test_token_ids_beyond_the_vocabulary_are_found(tmp_path, record_max):
  ok = _synthetic(tmp_path / "ok", 299, 300, record_max)
  data.check_data(ok, 384, 8, 4)
  bad = _synthetic(tmp_path / "bad", 350, 300, record_max)  # ids past meta's vocabulary
  with pytest.raises(ValueError, match=r"train-00000.bin holds token id 350, but the data's "
                     r"vocabulary \(meta.json\) is 300.*prepare the data again"):
    data.check_data(bad, 384, 8, 4)
  with pytest.raises(ValueError, match="model vocab_size=256 is smaller"):
    data.check_data(ok, 256, 8, 4)


def test_prepare_records_the_largest_id(text_dir, tmp_path):
  meta = data.prepare(text_dir, tmp_path / "d")
  for split in ("train", "validation"):
    for shard in meta.splits[split]["shards"]:
      ids = np.fromfile(tmp_path / "d" / shard["file"], "<u2")
      assert shard["max_id"] == ids.max() == 256  # EOS


def test_damaged_shards_and_other_data(text_dir, tmp_path, capsys):
  out = tmp_path / "d"
  data.prepare(text_dir, out)
  shard = out / "train-00000.bin"
  good = shard.read_bytes()
  shard.write_bytes(good[:100])
  with pytest.raises(ValueError, match=r"train-00000.bin has 100 bytes.*truncated.*python -m "
                     r"fp4jax.data prepare"):
    data.check_data(out, 384, 16, 4)
  data.prepare(text_dir, out)  # the same data, damaged: prepared again
  assert "a shard is missing, truncated or damaged; preparing the data again" in \
      capsys.readouterr().out
  assert shard.read_bytes() == good
  # Damaged in place, every id still in the vocabulary: its checksum finds it, naming the shard.
  raw = bytearray(good)
  raw[10] = (raw[10] + 1) % 200
  shard.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"shard .*train-00000.bin does not match its sha256 in "
                     r"meta.json.*--out="):
    data.check_data(out, 384, 16, 4)
  data.prepare(text_dir, out)
  assert "damaged; preparing the data again" in capsys.readouterr().out
  assert shard.read_bytes() == good
  with pytest.raises(ValueError, match=r"already holds other data.*--config.data.dir for "
                     r"experiments.train.*python -m fp4jax.data prepare --overwrite"):
    data.prepare(text_dir, out, shard_tokens=1000)
  with pytest.raises(SystemExit):  # the flags the messages name exist
    data.main(["prepare", "--help"])
  usage = capsys.readouterr().out
  assert "--overwrite" in usage and "--encoding" in usage


def test_prepared_data_is_reused_without_writing_beside_it(text_dir, tmp_path, monkeypatch):
  out = tmp_path / "ro" / "d"
  meta = data.prepare(text_dir, out)
  lock = out.with_name(f".{out.name}.lock")
  lock.unlink(missing_ok=True)
  before = sorted(p.name for p in out.parent.iterdir())

  def no_lock(path):
    raise PermissionError(13, "Read-only file system", str(path))
  monkeypatch.setattr(data.corpus_lib, "file_lock", no_lock)  # what read-only storage does
  assert data.prepare(text_dir, out) == meta
  data.check_data(out, 384, 16, 4)
  assert sorted(p.name for p in out.parent.iterdir()) == before and not lock.exists()
