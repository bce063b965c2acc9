"""Offline tokenizers for the fp4jax data pipeline (no hub downloads, ever).

Three kinds, all with one end-of-document token appended after every document:

* ``byte``: UTF-8 bytes 0..255 plus EOS = 256 (vocab 257). Zero dependencies.
* ``bpe``: a byte-level BPE trained with the HF ``tokenizers`` library on the
  *training split only*, saved as ``tokenizer.json`` beside the shards. EOS is the
  special token ``<|endoftext|>`` (id 0).
* ``file``: a user-given ``tokenizer.json`` (HF ``tokenizers`` format), copied beside
  the shards and identified by its sha256. Its EOS token must exist in the vocab.

Every tokenizer has ``vocab_size``, ``eos_id``, ``encode_batch(texts)`` and
``decode(ids)``, and a JSON ``spec()`` that ``load_tokenizer`` turns back into it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

EOS_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...
  def decode(self, ids: Sequence[int]) -> str: ...
  def spec(self) -> dict[str, Any]: ...


def sha256_file(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255, EOS = 256."""

  vocab_size: int = 257
  eos_id: int = 256

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def spec(self) -> dict[str, Any]:
    return {"kind": "byte"}


def _import_tokenizers():
  try:
    import tokenizers
  except ImportError as e:
    raise ImportError(
        "the 'bpe' and tokenizer.json tokenizers need the HF `tokenizers` package "
        "(pip install tokenizers); the 'byte' tokenizer needs nothing") from e
  return tokenizers


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
  """A HF ``tokenizers`` tokenizer loaded from a tokenizer.json file."""

  path: str
  kind: str  # "bpe" (trained here) or "file" (user-given)
  eos_token: str
  sha256: str
  _tok: Any = dataclasses.field(repr=False, compare=False)
  vocab_size: int = 0
  eos_id: int = 0

  @classmethod
  def from_file(cls, path: str | os.PathLike, *, kind: str = "file",
                eos_token: str = EOS_TEXT) -> HFTokenizer:
    """Loads ``path``; ValueError if the file is unreadable or lacks ``eos_token``."""
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"tokenizer file not found: {path}")
    tk = _import_tokenizers()
    try:
      tok = tk.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type
      raise ValueError(f"{path} is not a valid HF tokenizer.json: {e}") from e
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
      raise ValueError(f"tokenizer {path} has no EOS token {eos_token!r}; pass the right "
                       "eos_token (e.g. '</s>') or add it as a special token")
    return cls(path=str(path), kind=kind, eos_token=eos_token, sha256=sha256_file(path),
               _tok=tok, vocab_size=tok.get_vocab_size(with_added_tokens=True),
               eos_id=int(eos_id))

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(list(texts))]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def spec(self) -> dict[str, Any]:
    return {"kind": self.kind, "file": Path(self.path).name, "sha256": self.sha256,
            "eos_token": self.eos_token}


def train_bpe(texts: Iterable[str], vocab_size: int,
              out_path: str | os.PathLike) -> HFTokenizer:
  """Trains a byte-level BPE on ``texts`` (the training split) and saves it.

  Training is deterministic: the same texts give the same tokenizer.json.

  Args:
    texts: the documents to learn merges from.
    vocab_size: total vocabulary, including the 256 byte symbols and the EOS token.
    out_path: where to write the tokenizer.json.

  Returns:
    The trained tokenizer, loaded back from ``out_path``.
  """
  if vocab_size < 258 or vocab_size > 1 << 31:
    raise ValueError(f"bpe vocab_size must be in [258, 2**31] (256 bytes + EOS + merges), "
                     f"got {vocab_size}")
  tk = _import_tokenizers()
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TEXT],
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  seen = [0]

  def counted():
    for t in texts:
      seen[0] += 1
      yield t

  tok.train_from_iterator(counted(), trainer)
  if not seen[0]:
    raise ValueError("train_bpe needs at least one training document")
  tok.save(str(out_path))
  return HFTokenizer.from_file(out_path, kind="bpe")


def make_tokenizer(name: str, train_texts: Iterable[str], out_dir: Path, *,
                   vocab_size: int | None = None, eos_token: str = EOS_TEXT) -> Tokenizer:
  """Builds the tokenizer a ``prepare`` run asked for, writing any file into ``out_dir``.

  Args:
    name: "byte", "bpe", or a path to a tokenizer.json.
    train_texts: the training split's documents (consumed by "bpe" only).
    out_dir: the data directory; a tokenizer.json lands there for "bpe" and files.
    vocab_size: required for "bpe"; for the others it must match or be None.
    eos_token: the EOS token of a user-given tokenizer.json.

  Returns:
    The tokenizer.
  """
  if name == "byte":
    tok = ByteTokenizer()
  elif name == "bpe":
    if vocab_size is None:
      raise ValueError("tokenizer='bpe' needs vocab_size (e.g. --vocab_size=8192)")
    tok = train_bpe(train_texts, vocab_size, out_dir / TOKENIZER_FILE)
  else:
    src = Path(name)
    if not src.is_file():
      raise ValueError(f"tokenizer must be 'byte', 'bpe' or an existing tokenizer.json file, "
                       f"got {name!r}")
    dst = out_dir / TOKENIZER_FILE
    if src.resolve() != dst.resolve():
      shutil.copyfile(src, dst)
    tok = HFTokenizer.from_file(dst, kind="file", eos_token=eos_token)
  if name != "bpe" and vocab_size is not None and vocab_size != tok.vocab_size:
    raise ValueError(f"vocab_size={vocab_size} given, but tokenizer {name!r} has "
                     f"vocab {tok.vocab_size}")
  return tok


def load_tokenizer(spec: dict[str, Any], data_dir: str | os.PathLike) -> Tokenizer:
  """Rebuilds the tokenizer recorded in a data dir's meta.json ``tokenizer`` entry."""
  kind = spec.get("kind")
  if kind == "byte":
    return ByteTokenizer()
  if kind in ("bpe", "file"):
    tok = HFTokenizer.from_file(Path(data_dir) / spec["file"], kind=kind,
                                eos_token=spec.get("eos_token", EOS_TEXT))
    if spec.get("sha256") and tok.sha256 != spec["sha256"]:
      raise ValueError(f"{tok.path} does not match the sha256 in meta.json: the shards "
                       "were tokenized with another tokenizer")
    return tok
  raise ValueError(f"unknown tokenizer kind {kind!r} in meta.json")
