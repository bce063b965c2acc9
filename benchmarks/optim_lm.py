"""A tiny byte-level Transformer LM for ``optim_states`` and ``optim_ns`` (CPU-sized, fixed seeds).

2 blocks, d=128, 4 heads, context 64, trained on Python's own standard-library sources (local, no
network), bytes as tokens: small enough to train every candidate optimizer state on a CPU.
Parameter names follow the usual conventions (``embed``, ``pos_embed``, ``lm_head``), so the
Muon/ROOT routing sends them to AdamW.
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB = 256


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


def init_params(key, d: int = 128, layers: int = 2, seq: int = 64, mlp: int = 4):
  keys = iter(jax.random.split(key, 4 + 4 * layers))
  normal = lambda shape, std=0.02: std * jax.random.normal(next(keys), shape)  # noqa: E731
  blocks = [{
      "ln1": jnp.ones((d,)), "qkv": normal((d, 3 * d)), "proj": normal((d, d)) / np.sqrt(2 * layers),
      "ln2": jnp.ones((d,)), "fc1": normal((d, mlp * d)), "fc2": normal((mlp * d, d)) / np.sqrt(2 * layers),
  } for _ in range(layers)]
  return {"embed": normal((VOCAB, d)), "pos_embed": normal((seq, d)), "blocks": blocks,
          "ln_f": jnp.ones((d,)), "lm_head": normal((d, VOCAB))}


def _rms_norm(x_BxTxD, scale_D):
  return x_BxTxD * jax.lax.rsqrt(jnp.mean(x_BxTxD**2, -1, keepdims=True) + 1e-6) * scale_D


def forward(params, tokens_BxT, heads: int = 4):
  b, t = tokens_BxT.shape
  x = params["embed"][tokens_BxT] + params["pos_embed"][None, :t]
  d = x.shape[-1]
  mask_TxT = jnp.tril(jnp.ones((t, t), bool))
  for blk in params["blocks"]:
    h = _rms_norm(x, blk["ln1"])
    q, k, v = jnp.split(h @ blk["qkv"], 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    s_BxHxTxT = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    p = jax.nn.softmax(jnp.where(mask_TxT, s_BxHxTxT, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d)
    x = x + o @ blk["proj"]
    h = _rms_norm(x, blk["ln2"])
    x = x + jax.nn.gelu(h @ blk["fc1"]) @ blk["fc2"]
  return _rms_norm(x, params["ln_f"]) @ params["lm_head"]


def loss_fn(params, inputs_BxT, targets_BxT):
  logits = forward(params, inputs_BxT)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxT).mean()


def train(tx: optax.GradientTransformation, steps: int, *, seed: int = 0, data=None,
          batch: int = 16, seq: int = 64, log_every: int = 0, name: str = ""):
  """Trains the tiny LM with ``tx``; returns the per-step losses (np.ndarray) and seconds."""
  data = stdlib_bytes() if data is None else data
  params = init_params(jax.random.key(seed), seq=seq)
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses, it, t0 = [], batches(data, batch, seq, seed + 1), time.perf_counter()
  for i in range(steps):
    x, y = next(it)
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(float(loss))
    if log_every and (i + 1) % log_every == 0:
      print(f"  {name} step {i + 1}: loss {np.mean(losses[-log_every:]):.4f}", flush=True)
  return np.asarray(losses), time.perf_counter() - t0
