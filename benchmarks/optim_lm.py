"""The byte-level LM of ``optim_states`` and ``optim_ns``: ``fp4jax.model`` at a CPU size, fixed seeds.

``MODEL``: a ``fp4jax.model.Transformer`` with 2 blocks, d=128, 4 heads, float32 compute, at the
``bf16`` recipe (no projection quantized: only the optimizer differs between runs), trained on
Python's own standard-library sources (local, no network), bytes as tokens, context 64. Its loss,
train step and parameters are ``fp4jax.train``'s (``loss_fn``, ``make_train_step``); parameter
names are the model's (``embed``, ``lm_head``), which the Muon/ROOT routing sends to AdamW.
"""

from __future__ import annotations

import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fp4jax import train as train_lib
from fp4jax.model import ModelConfig, Transformer
from fp4jax.recipe import get_recipe

VOCAB = 256
SEQ = 64
MODEL = ModelConfig(vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=4, dtype="float32")
RECIPE = get_recipe("bf16")


def stdlib_bytes(max_bytes: int = 4 << 20) -> np.ndarray:
  """The first ``max_bytes`` of the standard library's ``*.py`` files, in sorted path order."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
  """Endless (inputs, targets) uint8->int32 windows at random offsets from a seeded generator."""
  rng = np.random.default_rng(seed)
  while True:
    off = rng.integers(0, len(data) - seq - 1, batch)
    w = np.stack([data[o:o + seq + 1] for o in off]).astype(np.int32)
    yield w[:, :-1], w[:, 1:]


def init_model(seed: int = 0):
  """``(graphdef, params)`` of ``MODEL``: params a pure dict keyed like ``fp4jax.model``."""
  graphdef, state = nnx.split(Transformer(MODEL, RECIPE, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def loss_of(graphdef):
  """``loss(params, inputs_BxT, targets_BxT)``: ``fp4jax.train.loss_fn`` of the model (no random
  bits: the recipe quantizes nothing)."""
  def loss(params, inputs_BxT, targets_BxT):
    return train_lib.loss_fn(graphdef, params, inputs_BxT, targets_BxT, None)
  return loss


def train(tx: optax.GradientTransformation, steps: int, *, seed: int = 0, data=None,
          batch: int = 16, seq: int = SEQ, log_every: int = 0, name: str = ""):
  """Trains ``MODEL`` with ``tx`` (``fp4jax.train.make_train_step``); returns the per-step losses
  (np.ndarray) and seconds."""
  data = stdlib_bytes() if data is None else data
  graphdef, params = init_model(seed)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
           "rng": jax.random.key_data(jax.random.key(seed))}
  step = jax.jit(train_lib.make_train_step(graphdef, tx), donate_argnums=0)
  losses, it, t0 = [], batches(data, batch, seq, seed + 1), time.perf_counter()
  for i in range(steps):
    x, y = next(it)
    state, metrics = step(state, {"inputs": x, "targets": y})
    losses.append(float(metrics["loss"]))
    if log_every and (i + 1) % log_every == 0:
      print(f"  {name} step {i + 1}: loss {np.mean(losses[-log_every:]):.4f}", flush=True)
  return np.asarray(losses), time.perf_counter() - t0

