"""Token shards on disk and the grain input pipeline.

Data directory (format_version 1), written by ``prepare`` / ``python -m fp4jax.data prepare``::

  <dir>/meta.json           format_version, dtype, vocab_size, eos_id, tokenizer, splits,
                            corpus, licenses, fingerprint (see DataMeta)
  <dir>/tokenizer.json      for 'bpe' and user-given tokenizers (HF tokenizers format)
  <dir>/<split>-NNNNN.bin   raw little-endian token ids: uint16 if vocab_size <= 65536,
                            else uint32 (read with np.memmap); splits: train, validation

A split is its documents in corpus order, each followed by ``eos_id``, cut into shards of at
most ``shard_tokens`` tokens (a document may span two shards). ``meta["splits"][split]`` is
``{"num_tokens", "num_docs", "shards": [{"file", "num_tokens", "max_id", "sha256"}]}`` (``max_id``,
the largest token id of the shard, and ``sha256``, its checksum, are absent in data written before
they were recorded).

``check_data`` verifies a data directory against a run before its first step: shard files and
sizes, each shard's sha256 (where recorded; else a scan of every id against the vocabulary), one
global batch per split, token ids below the model's vocabulary. It only reads: a prepared folder on
read-only storage works (``prepare`` reuses one without taking its lock).

Examples are fixed windows: window i of a shard is tokens ``[i*T, i*T + T + 1)``, giving
``inputs = w[:-1]`` and ``targets = w[1:]`` (int32, shape [T]). Windows do not cross shards,
so up to T tokens per shard go unused. The train split is shuffled by seed, reshuffled every
epoch and repeated forever; validation is one ordered pass over whole global batches.

Multi-host: every host builds the same global window order and takes every
``process_count``-th window from ``process_index``, so the global batch of each step is the
same set of windows whatever the number of hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fp4jax import corpus as corpus_lib
from fp4jax.checkpoint import no_space, space_line
from fp4jax import tokenizer as tokenizer_lib
from fp4jax.sharding import BATCH_AXES

_FORMAT_VERSION = 1
SPLITS = ("train", "validation")
_META_FILE = "meta.json"
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MB of uint16 per shard
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclasses.dataclass(frozen=True)
class DataMeta:
  """The contents of ``meta.json``.

  Attributes:
    format_version: layout version (1).
    dtype: "uint16" or "uint32" (little-endian token ids in the .bin shards).
    vocab_size: the tokenizer's vocabulary, EOS included; every id is < vocab_size.
    eos_id: the id appended after each document.
    tokenizer: {"kind": "byte" | "bpe" | "file", plus "file", "sha256", "eos_token"}.
    splits: per split {"num_tokens", "num_docs", "shards": [{"file", "num_tokens", "max_id"}]}.
    corpus: {"name", "fingerprint"} of the text the shards came from.
    licenses: one dict per corpus source (name, package, version, license).
    fingerprint: sha256 of everything that determines the shards (reuse key).
  """

  format_version: int
  dtype: str
  vocab_size: int
  eos_id: int
  tokenizer: dict
  splits: dict
  corpus: dict
  licenses: list
  fingerprint: str

  def __post_init__(self):
    if self.format_version != _FORMAT_VERSION:
      raise ValueError(f"meta.json format_version {self.format_version}, this fp4jax reads "
                       f"{_FORMAT_VERSION}; prepare the data again")
    if self.dtype not in _DTYPES:
      raise ValueError(f"meta.json dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
    if not 0 < self.vocab_size <= np.iinfo(_DTYPES[self.dtype]).max + 1:
      raise ValueError(f"meta.json vocab_size {self.vocab_size} does not fit dtype {self.dtype}")
    if not 0 <= self.eos_id < self.vocab_size:
      raise ValueError(f"meta.json eos_id {self.eos_id} outside vocab {self.vocab_size}")

  @property
  def np_dtype(self) -> np.dtype:
    return _DTYPES[self.dtype]

  def num_tokens(self, split: str) -> int:
    return int(self._split(split)["num_tokens"])

  def _split(self, split: str) -> dict:
    if split not in self.splits:
      raise ValueError(f"unknown split {split!r}; this data has {sorted(self.splits)}")
    return self.splits[split]


def read_meta(data_dir: str | os.PathLike) -> DataMeta:
  """Reads ``<data_dir>/meta.json``; FileNotFoundError (with the fix) if absent."""
  path = Path(data_dir) / _META_FILE
  if not path.is_file():
    what = "folder" if not Path(data_dir).is_dir() else _META_FILE
    raise FileNotFoundError(f"no data at {data_dir} ({what} missing); make it with `python -m "
                            f"fp4jax.data prepare --corpus=CORPUS --out={data_dir}` (CORPUS and the "
                            "tokenizer flags those it was made with: `prepare --help` lists them), or "
                            "name the folder that holds it")
  d = json.loads(path.read_text())
  names = {f.name for f in dataclasses.fields(DataMeta)}
  if missing := names - d.keys():
    raise ValueError(f"{path} lacks {sorted(missing)}; prepare the data again")
  return DataMeta(**{k: d[k] for k in names})


def check_compat(meta: DataMeta, vocab_size: int, *, seq_len: int | None = None) -> None:
  """Raises ValueError if a model with ``vocab_size`` (and ``seq_len``) cannot use this data."""
  if vocab_size < meta.vocab_size:
    raise ValueError(
        f"model vocab_size={vocab_size} is smaller than the data's vocabulary "
        f"{meta.vocab_size} ({meta.tokenizer.get('kind')} tokenizer): ids up to "
        f"{meta.vocab_size - 1} would index past the embedding; use vocab_size >= "
        f"{meta.vocab_size} (e.g. {-(-meta.vocab_size // 128) * 128})")
  if vocab_size > np.iinfo(np.int32).max:
    raise ValueError(f"model vocab_size={vocab_size} does not fit the int32 batches")
  if seq_len is not None:
    for split in meta.splits:
      if longest_shard(meta, split) < seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is longer than split {split!r} allows "
                         f"(longest shard {longest_shard(meta, split)} tokens; a window "
                         "needs seq_len + 1)")


def longest_shard(meta: DataMeta, split: str) -> int:
  return max((int(s["num_tokens"]) for s in meta._split(split)["shards"]), default=0)


def _scan_max_id(path: Path, meta: DataMeta, shard: dict, chunk: int = 1 << 26) -> int:
  ids = np.memmap(path, meta.np_dtype, "r", shape=(int(shard["num_tokens"]),))
  return max((int(ids[i:i + chunk].max()) for i in range(0, len(ids), chunk)), default=-1)


_VERIFIED: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256 found, in this process


def _sha256(path: Path) -> str:
  st = path.stat()
  key = (str(path.absolute()), st.st_size, st.st_mtime_ns)
  if key not in _VERIFIED:
    h = hashlib.sha256()
    with open(path, "rb") as f:
      while chunk := f.read(1 << 24):
        h.update(chunk)
    _VERIFIED[key] = h.hexdigest()
  return _VERIFIED[key]


def shard_damage(data_dir: str | os.PathLike, meta: DataMeta, shard: dict) -> str | None:
  """What is wrong with one shard, or None: missing, of another size than ``meta.json`` gives,
  not matching its recorded sha256, or (without a checksum) holding an id outside the vocabulary."""
  path = Path(data_dir) / shard["file"]
  if not path.is_file():
    return f"shard {path} is missing"
  size, want = path.stat().st_size, int(shard["num_tokens"]) * meta.np_dtype.itemsize
  if size != want:
    return f"shard {path} has {size} bytes, meta.json says {want} (truncated or from another run)"
  if "sha256" in shard:
    if _sha256(path) != shard["sha256"]:
      return f"shard {path} does not match its sha256 in meta.json (changed after it was prepared)"
    top = int(shard.get("max_id", -1))
  else:
    top = _scan_max_id(path, meta, shard)
  if top >= meta.vocab_size:
    return (f"shard {path} holds token id {top}, but the data's vocabulary (meta.json) is "
            f"{meta.vocab_size}: the shard is damaged or from another tokenizer")
  return None


def check_data(data_dir: str | os.PathLike, vocab_size: int, seq_len: int,
               global_batch_size: int, splits: Sequence[str] = SPLITS) -> DataMeta:
  """Checks, before training, that a run can use ``data_dir``.

  Every shard of ``splits`` must exist with the size and sha256 ``meta.json`` gives (data without
  checksums: every id of the shard is checked against the vocabulary instead); each split must hold
  at least one global batch of ``seq_len`` windows; every token id must be below ``vocab_size``.

  Args:
    data_dir: a data directory made by ``prepare``.
    vocab_size: the model's vocabulary.
    seq_len: tokens per example.
    global_batch_size: examples per step over all hosts.
    splits: the splits the run reads.

  Returns:
    The data's meta.

  Raises:
    FileNotFoundError, ValueError: what is wrong, naming the file and the fix.
  """
  meta = read_meta(data_dir)
  check_compat(meta, vocab_size)
  again = ("prepare the data again (`python -m fp4jax.data prepare` with the same settings and "
           f"--out={data_dir} prepares a damaged folder again; or delete {data_dir} and launch "
           "again)")
  for split in splits:
    try:
      n = len(TokenWindows(data_dir, split, seq_len))
    except ValueError as e:
      raise ValueError(f"{e}; {again}" if "truncated" in str(e) else str(e)) from e
    if n < global_batch_size:
      raise ValueError(
          f"split {split!r} of {data_dir} has {n} windows of seq_len={seq_len} "
          f"({meta.num_tokens(split)} tokens), fewer than one batch of {global_batch_size}: use "
          "a smaller batch_size or seq_len, or more text")
    for shard in meta._split(split)["shards"]:
      # check_compat made sure vocab_size >= meta.vocab_size
      if why := shard_damage(data_dir, meta, shard):
        raise ValueError(f"{why}; {again}")
  return meta


# --------------------------------------------------------------------------- writing shards


def _write_split(tok: tokenizer_lib.Tokenizer, files: Sequence[Path], out: Path, split: str,
                 dtype: np.dtype, shard_tokens: int, encoding: str = "utf-8",
                 docs_per_call: int = 64) -> dict:
  shards: list[dict] = []
  f = None
  total = 0
  try:
    for start in range(0, len(files), docs_per_call):
      texts = [corpus_lib.read_text(p, encoding) for p in files[start:start + docs_per_call]]
      for ids in tok.encode_batch(texts):
        ids = np.append(ids, tok.eos_id).astype(dtype)
        pos = 0
        while pos < len(ids):
          if f is None or shards[-1]["num_tokens"] == shard_tokens:
            if f is not None:
              f.close()
            shards.append({"file": f"{split}-{len(shards):05d}.bin", "num_tokens": 0,
                           "max_id": -1})
            f = open(out / shards[-1]["file"], "wb")
          take = min(len(ids) - pos, shard_tokens - shards[-1]["num_tokens"])
          ids[pos:pos + take].tofile(f)
          shards[-1]["num_tokens"] += take
          shards[-1]["max_id"] = max(shards[-1]["max_id"], int(ids[pos:pos + take].max()))
          pos += take
        total += len(ids)
  finally:
    if f is not None:
      f.close()
  for s in shards:
    s["sha256"] = _sha256(out / s["file"])
  return {"num_tokens": total, "num_docs": len(files), "shards": shards}


def _tokenizer_tag(tokenizer: str, vocab_size: int | None) -> str:
  if tokenizer == "byte":
    return "byte"
  if tokenizer == "bpe":
    if vocab_size is None:
      raise ValueError("tokenizer='bpe' needs vocab_size (e.g. --vocab_size=8192)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 258 <= vocab_size <= 1 << 31:
      raise ValueError(f"data vocab_size={vocab_size!r} (--config.data.vocab_size, or --vocab_size of "
                       "`python -m fp4jax.data prepare`): a BPE vocabulary is an int in [258, 2**31] "
                       "(256 bytes + EOS + merges), e.g. 8192")
    return f"bpe{vocab_size}"
  if not Path(tokenizer).is_file():
    raise ValueError(f"tokenizer must be 'byte', 'bpe' or an existing tokenizer.json file, "
                     f"got {tokenizer!r}")
  return "file-" + tokenizer_lib.sha256_file(tokenizer)[:10]


def default_out_dir(corpus_name: str, tokenizer: str = "byte", vocab_size: int | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Path:
  """``<data root>/tokens/<corpus>-<byte | bpeN | file-HASH>``: where ``prepare`` writes."""
  return corpus_lib.data_root(cache_dir) / "tokens" / (
      f"{corpus_name}-{_tokenizer_tag(tokenizer, vocab_size)}")


def _shards_ok(data_dir: Path, meta: DataMeta) -> bool:
  return all(shard_damage(data_dir, meta, s) is None
             for sp in meta.splits.values() for s in sp["shards"])


def _reusable(out: Path, fingerprint: str) -> DataMeta | None:
  """The meta of ``out`` if it already holds intact data of ``fingerprint`` (reads only)."""
  if not (out / _META_FILE).is_file():
    return None
  try:
    old = read_meta(out)
  except ValueError:
    return None
  return old if old.fingerprint == fingerprint and _shards_ok(out, old) else None


def _request_fingerprint(corpus_fingerprint: str, tag: str, vocab_size: int | None,
                         shard_tokens: int, encoding: str) -> str:
  """The reuse key of a data folder: sha256 of everything that determines its shards."""
  request = {"format_version": _FORMAT_VERSION, "corpus": corpus_fingerprint, "tokenizer": tag,
             "vocab_size": vocab_size, "shard_tokens": shard_tokens}
  if encoding != "utf-8":
    request["encoding"] = encoding
  return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()


def _check_token_folder(out: Path) -> None:
  """NotADirectoryError where the token folder ``out`` is a file, naming the flags that set it."""
  if out.exists() and not out.is_dir():
    raise NotADirectoryError(f"the token folder {out} is a file, not a folder (--config.data.dir for "
                             "experiments.train, --out for `python -m fp4jax.data prepare`): name the folder "
                             "of prepared tokens, or a new one to prepare them into")


def prepared_data(corpus: str | os.PathLike, out_dir: str | os.PathLike | None = None, *,
                  tokenizer: str = "byte", vocab_size: int | None = None,
                  shard_tokens: int = DEFAULT_SHARD_TOKENS,
                  cache_dir: str | os.PathLike | None = None,
                  encoding: str = "utf-8") -> DataMeta | None:
  """The meta of data already prepared from ``corpus`` with these settings, found without its text.

  ``out_dir`` (default ``default_out_dir``) is reused when its ``meta.json`` names the corpus and
  was made with these settings (tokenizer, vocabulary, shard size, encoding: its fingerprint,
  recomputed from the corpus fingerprint it records) and every shard matches its size and sha256.
  What the text itself holds cannot be checked without it: ``prepare`` calls this only where the
  text is not on this machine.

  Returns:
    The meta, or None if ``out_dir`` holds no prepared data.

  Raises:
    ValueError: ``out_dir`` holds another corpus, or ``corpus`` made with other settings, or a
      damaged shard; the message says that the text to prepare it again is not here.
    NotADirectoryError: ``out_dir`` is a file.
  """
  name = corpus_lib.corpus_name(corpus)
  out = (Path(out_dir) if out_dir is not None
         else default_out_dir(name, tokenizer, vocab_size, cache_dir))
  _check_token_folder(out)
  if not (out / _META_FILE).is_file():
    return None
  meta = read_meta(out)
  absent = (f"the text of corpus {name!r} is not on this machine to prepare it again (copy the "
            f"token folder again, or the text: {corpus})")
  if meta.corpus.get("name") != name:
    raise ValueError(f"{out} holds corpus {meta.corpus.get('name')!r}, not {name!r}, and {absent}; "
                     f"to train on what it holds, set the corpus to {meta.corpus.get('name')!r} "
                     "(--config.data.corpus)")
  want = _request_fingerprint(meta.corpus.get("fingerprint", ""), _tokenizer_tag(tokenizer, vocab_size),
                              vocab_size, shard_tokens, encoding)
  if want != meta.fingerprint:
    raise ValueError(
        f"{out} holds {name} prepared with other settings than this run's (tokenizer "
        f"{tokenizer}, vocab_size {vocab_size}, shard_tokens {shard_tokens}, encoding {encoding}; "
        f"the folder: {meta.tokenizer.get('kind')} tokenizer, vocab {meta.vocab_size}), and "
        f"{absent}; set the run's data settings to the folder's")
  for sp in meta.splits.values():
    for shard in sp["shards"]:
      if why := shard_damage(out, meta, shard):
        raise ValueError(f"{why}; {absent}")
  return meta


def prepare(corpus: str | os.PathLike | corpus_lib.CorpusFiles,
            out_dir: str | os.PathLike | None = None, *, tokenizer: str = "byte",
            vocab_size: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            cache_dir: str | os.PathLike | None = None, overwrite: bool = False,
            encoding: str = "utf-8") -> DataMeta:
  """Tokenizes a corpus into shards; reuses ``out_dir`` if it already holds the same data.

  A folder that holds the same data with a missing, truncated or damaged shard (its sha256) is
  prepared again. An intact folder is reused without writing anything (read-only storage works).

  Where the corpus's text is not on this machine (a built-in corpus neither cached nor packed in the
  data root, a folder that is gone), a folder that already holds it, prepared with these settings
  and intact (every shard's sha256), is used without the text and without the network
  (``prepared_data``); the text is needed only to prepare.

  Processes of one machine that prepare the same folder at once take turns (a lock file beside it):
  the first tokenizes, the others reuse its folder. Hosts that share a network disk should still
  prepare on one process only (e.g. ``jax.process_index() == 0``).

  Args:
    corpus: a built-in corpus name ("shakespeare", "mix"), a folder of .txt files, or
      a CorpusFiles.
    out_dir: the data directory (default ``<data root>/tokens/<corpus>-<tokenizer>``).
    tokenizer: "byte", "bpe" (trained on the train split; needs vocab_size) or the path of a
      tokenizer.json.
    vocab_size: the BPE vocabulary (EOS included).
    shard_tokens: the most tokens per .bin shard.
    cache_dir: the data root for built-in corpora (default ``$FP4JAX_DATA_DIR``).
    overwrite: replace an ``out_dir`` that holds different data instead of raising.
    encoding: the text files' encoding (decoded strictly: a file that is not text in it, or holds
      NUL characters, is an error naming it).

  Returns:
    The meta of the data directory.
  """
  if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 2:
    raise ValueError(f"shard_tokens={shard_tokens!r} (--shard_tokens of `python -m fp4jax.data "
                     "prepare`): give an int >= 2")
  tag = _tokenizer_tag(tokenizer, vocab_size)  # checks the settings before any text is read
  if out_dir is not None:
    _check_token_folder(Path(out_dir))
  if not corpus_lib.text_is_here(corpus, cache_dir):  # what is prepared serves without the text
    meta = prepared_data(corpus, out_dir, tokenizer=tokenizer, vocab_size=vocab_size,
                         shard_tokens=shard_tokens, cache_dir=cache_dir, encoding=encoding)
    if meta is not None:
      where = out_dir or default_out_dir(corpus_lib.corpus_name(corpus), tokenizer, vocab_size, cache_dir)
      print(f"{corpus}: its text is not here; using the data prepared from it in {where} (corpus "
            f"fingerprint {meta.corpus.get('fingerprint', '?')[:12]}, every shard's sha256 checked)",
            flush=True)
      return meta
  files = corpus_lib.resolve_corpus(corpus, cache_dir)
  out = (Path(out_dir) if out_dir is not None
         else default_out_dir(files.name, tokenizer, vocab_size, cache_dir))
  if out_dir is None:  # a given one was checked above, before any text was read
    _check_token_folder(out)
  fingerprint = _request_fingerprint(files.fingerprint, tag, vocab_size, shard_tokens, encoding)
  other = ("use another folder (--config.data.dir for experiments.train, --out for `python -m "
           "fp4jax.data prepare`), or replace it (`python -m fp4jax.data prepare --overwrite`)")
  if (old := _reusable(out, fingerprint)) is not None:  # no lock: the folder may be read-only
    return old
  # One process tokenizes; the others that want the same folder wait here, then reuse it.
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(corpus_lib.file_lock(out.with_name(f".{out.name}.lock")))
    except OSError as e:
      if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        raise
      raise ValueError(f"{out}: {_what_is_wrong(out, fingerprint)}, and it is on storage this process "
                       f"cannot write ({e.strerror}: {e.filename}), so it cannot be prepared there: "
                       "copy an intact folder there, or prepare the data in a writable folder "
                       "(--config.data.dir for experiments.train, --out for `python -m fp4jax.data "
                       "prepare`)") from e
    if (out / _META_FILE).is_file():
      old = read_meta(out)
      if old.fingerprint == fingerprint:
        if _shards_ok(out, old):
          return old
        print(f"{out}: a shard is missing, truncated or damaged; preparing the data again",
              flush=True)
      elif not overwrite:
        raise ValueError(f"{out} already holds other data ({old.corpus.get('name')}, "
                         f"{old.tokenizer.get('kind')} tokenizer, vocab {old.vocab_size}); {other}")
    elif out.exists() and any(out.iterdir()) and not overwrite:
      raise ValueError(f"{out} is a non-empty folder without {_META_FILE}; {other}")
    # Temporary folders of this one left by a process that died (it holds the lock no more).
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
      shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
      return _write(files, tokenizer, vocab_size, tmp, out, shard_tokens, encoding, fingerprint)
    except Exception as e:  # the tokenizers library raises plain Exceptions
      if not no_space(e):
        raise
      shutil.rmtree(tmp, ignore_errors=True)  # the space free once it is gone
      text = sum(p.stat().st_size for s in SPLITS for p in files.split(s))
      raise OSError(errno.ENOSPC, space_line(
          out.parent, 4 * text, f"the token shards of {files.name} (up to 4 bytes per byte of its "
          f"{text / 1e6:,.1f} MB of text)")) from e
    finally:
      shutil.rmtree(tmp, ignore_errors=True)


def _what_is_wrong(out: Path, fingerprint: str) -> str:
  """Why ``out`` cannot be reused as it is: a damaged shard, other data, or no data."""
  if not (out / _META_FILE).is_file():
    return "it holds no prepared data"
  try:
    meta = read_meta(out)
  except ValueError as e:
    return str(e)
  if meta.fingerprint != fingerprint:
    return f"it holds other data ({meta.corpus.get('name')}, {meta.tokenizer.get('kind')} tokenizer)"
  return next((why for sp in meta.splits.values() for sh in sp["shards"]
               if (why := shard_damage(out, meta, sh))), "a shard is damaged")


def _write(files, tokenizer, vocab_size, tmp: Path, out: Path, shard_tokens: int, encoding: str,
           fingerprint: str) -> DataMeta:
  """Tokenizes into ``tmp``, then renames it to ``out``."""
  train_texts = (corpus_lib.read_text(p, encoding) for p in files.train)
  tok = tokenizer_lib.make_tokenizer(tokenizer, train_texts, tmp, vocab_size=vocab_size)
  dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
  splits = {s: _write_split(tok, files.split(s), tmp, s, _DTYPES[dtype], shard_tokens,
                            encoding) for s in SPLITS}
  meta = DataMeta(format_version=_FORMAT_VERSION, dtype=dtype, vocab_size=tok.vocab_size,
                  eos_id=tok.eos_id, tokenizer=tok.spec(), splits=splits,
                  corpus={"name": files.name, "fingerprint": files.fingerprint},
                  licenses=list(files.licenses), fingerprint=fingerprint)
  (tmp / _META_FILE).write_text(json.dumps(dataclasses.asdict(meta), indent=1))
  if out.exists():
    shutil.rmtree(out)
  tmp.rename(out)
  return meta


def load_tokenizer(data_dir: str | os.PathLike) -> tokenizer_lib.Tokenizer:
  """The tokenizer the shards of ``data_dir`` were made with (for decoding samples)."""
  return tokenizer_lib.load_tokenizer(read_meta(data_dir).tokenizer, data_dir)


# --------------------------------------------------------------------------- reading


class TokenWindows:
  """A grain data source: window i -> {"inputs": int32[T], "targets": int32[T]}.

  Shards are memory-mapped lazily, so the source pickles cheaply into grain workers.
  """

  def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int):
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    meta = read_meta(data_dir)
    shards = meta._split(split)["shards"]
    self._paths = [Path(data_dir) / s["file"] for s in shards]
    self._sizes = [int(s["num_tokens"]) for s in shards]
    for p, n in zip(self._paths, self._sizes, strict=True):
      if not p.is_file():
        raise FileNotFoundError(f"shard {p} is missing; prepare the data again")
      if p.stat().st_size != n * meta.np_dtype.itemsize:
        raise ValueError(f"shard {p} has {p.stat().st_size} bytes, meta.json says {n} tokens "
                         f"of {meta.dtype}: truncated or from another run")
    self.seq_len, self.dtype = seq_len, meta.np_dtype
    counts = [max(n - 1, 0) // seq_len for n in self._sizes]
    self._starts = np.cumsum([0, *counts])
    self._mmaps: list[np.ndarray] | None = None
    if len(self) == 0:
      raise ValueError(f"seq_len={seq_len} is longer than split {split!r} allows (longest "
                       f"shard {max(self._sizes, default=0)} tokens; a window needs seq_len + 1)")

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"window {index} out of range [0, {len(self)})")
    if self._mmaps is None:
      self._mmaps = [np.memmap(p, self.dtype, "r", shape=(n,))
                     for p, n in zip(self._paths, self._sizes, strict=True)]
    s = int(np.searchsorted(self._starts, index, side="right")) - 1
    off = (index - int(self._starts[s])) * self.seq_len
    w = np.asarray(self._mmaps[s][off:off + self.seq_len + 1], np.int32)
    return {"inputs": w[:-1], "targets": w[1:]}

  def __getstate__(self):
    return {**self.__dict__, "_mmaps": None}


def split_windows(data_dir: str | os.PathLike, split: str, seq_len: int) -> np.ndarray:
  """Every window of one split in order, as (N, seq_len + 1) int32 (``TokenWindows``' cut), after
  checking each of its shards (size and sha256, ``shard_damage``).

  Raises:
    ValueError: a damaged shard (named), or no window.
  """
  meta = read_meta(data_dir)
  for shard in meta._split(split)["shards"]:
    if why := shard_damage(data_dir, meta, shard):
      raise ValueError(f"{why}; prepare the data again")
  src = TokenWindows(data_dir, split, seq_len)  # checks the sizes; at least one window
  return np.concatenate([cut_windows(np.memmap(path, meta.np_dtype, "r", shape=(n,)), seq_len)
                         for path, n in zip(src._paths, src._sizes, strict=True)])


def cut_windows(ids, seq_len: int) -> np.ndarray:
  """The windows of one shard's token stream ``ids``, as ``TokenWindows`` reads them: consecutive
  (N, seq_len + 1) int32 rows, each overlapping the next by one token, N = (len − 1) // seq_len."""
  n = max(len(ids) - 1, 0) // seq_len
  return np.asarray(ids[np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]], np.int32)


def num_windows(data_dir: str | os.PathLike, split: str, seq_len: int) -> int:
  """Windows per epoch; after ``step`` steps, epochs seen = step * global_batch / this."""
  return len(TokenWindows(data_dir, split, seq_len))


def make_dataset(data_dir: str | os.PathLike, split: str, seq_len: int, global_batch_size: int,
                 *, seed: int = 0, shuffle: bool | None = None, repeat: bool | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> grain.MapDataset:
  """This host's batches of one split, as a grain MapDataset.

  Args:
    data_dir: a data directory made by ``prepare``.
    split: "train" or "validation".
    seq_len: tokens per example (T).
    global_batch_size: examples per step over all hosts.
    seed: the shuffle seed (same on every host).
    shuffle: default True for train, False otherwise.
    repeat: default True for train (forever, reshuffled each epoch); otherwise one pass over
      the first ``num_windows // global_batch_size`` whole global batches.
    process_index: this host (default ``jax.process_index()``).
    process_count: number of hosts (default ``jax.process_count()``).

  Returns:
    A dataset of {"inputs", "targets"}: int32 [global_batch_size // process_count, T].
  """
  pi = jax.process_index() if process_index is None else process_index
  pc = jax.process_count() if process_count is None else process_count
  if pc < 1 or not 0 <= pi < pc:
    raise ValueError(f"need 0 <= process_index < process_count, got {pi}, {pc}")
  if global_batch_size < 1 or global_batch_size % pc:
    raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                     f"process_count={pc}")
  src = TokenWindows(data_dir, split, seq_len)
  shuffle = split == "train" if shuffle is None else shuffle
  repeat = split == "train" if repeat is None else repeat
  ds = grain.MapDataset.source(src)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if repeat:
    ds = ds.repeat(None)
  else:
    usable = len(src) // global_batch_size * global_batch_size
    if usable == 0:
      raise ValueError(f"split {split!r} has {len(src)} windows of seq_len={seq_len}, fewer "
                       f"than global_batch_size={global_batch_size}")
    ds = ds[:usable]
  return ds[pi::pc].batch(global_batch_size // pc, drop_remainder=True)


def make_iterator(data_dir: str | os.PathLike, split: str, seq_len: int, global_batch_size: int,
                  *, num_threads: int = 2, prefetch: int = 4,
                  **kwargs: Any) -> grain.DatasetIterator:
  """``make_dataset`` as a checkpointable iterator (kwargs as there).

  ``it.get_state()`` is a small JSON-able dict and ``it.set_state(state)`` resumes with
  exactly the batches that followed; with orbax, save it as
  ``grain.checkpoint.CheckpointSave(it)`` inside ``ocp.args.Composite``.
  """
  ds = make_dataset(data_dir, split, seq_len, global_batch_size, **kwargs)
  opts = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  return iter(ds.to_iter_dataset(opts))


def to_global_batch(batch: Mapping[str, np.ndarray], mesh: Mesh,
                    spec: PartitionSpec | None = None) -> dict[str, jax.Array]:
  """This host's batch as global jax Arrays, batch axis sharded on the mesh.

  Args:
    batch: host-local arrays, leading axis = global_batch_size // process_count.
    mesh: the device mesh.
    spec: default ``P(fp4jax.sharding.BATCH_AXES)``, over those of these axes the mesh has.

  Returns:
    The same keys, as jax Arrays of the global batch.
  """
  if spec is None:
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    spec = PartitionSpec(axes or None)
  sharding = NamedSharding(mesh, spec)
  first = spec[0] if len(spec) else None
  names = () if first is None else (first,) if isinstance(first, str) else tuple(first)
  shards = int(np.prod([mesh.shape[a] for a in names]))

  def put(x):
    x = np.asarray(x)
    global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    if global_shape[0] % shards:
      raise ValueError(f"global batch {global_shape[0]} is not divisible by the {shards} "
                       f"devices of mesh axes {names}")
    return jax.make_array_from_process_local_data(sharding, x, global_shape)

  return {k: put(v) for k, v in batch.items()}


# --------------------------------------------------------------------------- CLI


def _summary(meta: DataMeta, out: Path) -> Iterator[str]:
  yield f"data\t{out}"
  yield (f"tokenizer\t{meta.tokenizer['kind']}\tvocab {meta.vocab_size}\teos {meta.eos_id}"
         f"\t{meta.dtype}")
  for split, s in meta.splits.items():
    yield f"{split}\t{s['num_docs']} docs\t{s['num_tokens']} tokens\t{len(s['shards'])} shards"


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m fp4jax.data",
                              description="Tokenize a corpus into fp4jax token shards.")
  sub = p.add_subparsers(dest="command", required=True)
  pp = sub.add_parser("prepare", help="tokenize a corpus (idempotent)")
  pp.add_argument("--corpus", default="shakespeare",
                  help=f"built-in {sorted(corpus_lib.CORPORA)} or a folder of .txt files")
  pp.add_argument("--out", default=None, help="data dir (default <data root>/tokens/...)")
  pp.add_argument("--tokenizer", default="byte", help="byte | bpe | path/to/tokenizer.json")
  pp.add_argument("--vocab_size", type=int, default=None, help="BPE vocabulary size")
  pp.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS)
  pp.add_argument("--data_dir", default=None, help="data root (default $FP4JAX_DATA_DIR)")
  pp.add_argument("--overwrite", action="store_true",
                  help="replace an --out folder that holds other data")
  pp.add_argument("--encoding", default="utf-8", help="encoding of the .txt files")
  pp.add_argument("--verbose", action="store_true", help="print the traceback of errors")
  pi = sub.add_parser("info", help="print a data dir's summary")
  pi.add_argument("dir")
  a = p.parse_args(argv)
  try:
    if a.command == "info":
      meta, out = read_meta(a.dir), Path(a.dir)
    else:
      out = Path(a.out) if a.out else default_out_dir(corpus_lib.corpus_name(a.corpus),
                                                      a.tokenizer, a.vocab_size, a.data_dir)
      meta = prepare(a.corpus, out, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                     shard_tokens=a.shard_tokens, cache_dir=a.data_dir, overwrite=a.overwrite,
                     encoding=a.encoding)
  except (ValueError, OSError, corpus_lib.CorpusUnavailableError) as e:
    if getattr(a, "verbose", False) or os.environ.get("FP4JAX_VERBOSE", "") not in ("", "0"):
      traceback.print_exc()
    full = isinstance(e, OSError) and e.strerror and "no space left on device at" in e.strerror
    raise SystemExit(f"error: {e.strerror if full else e}") from None
  print("\n".join(_summary(meta, out)))


if __name__ == "__main__":
  main()
