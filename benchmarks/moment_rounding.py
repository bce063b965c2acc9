"""How each rounding of ``adamw_nvfp4``'s moments stores a realistic moment, measured on the CPU.

Float32 ``optax.adamw`` trains the tiny byte LM (benchmarks/optim_lm.py) for ``--steps``; its m and
√v on the leaves the storage rule stores as NVFP4 are then encoded ``--draws`` times (a fresh key
each) by each rounding of ``AdamNvfp4Options`` and decoded as ``scale_by_adam_nvfp4`` decodes them:

  nearest      Operand(rounding="nearest")
  stochastic   Operand(rounding="stochastic") (the default)
  dither       dither=(name,): subtractive dither, offset subtracted on decoding
  eden         eden=(name,): nearest codes, EDEN-calibrated E4M3 scales rounded stochastically

Per moment, over all its NVFP4 leaves (x the moment, x̂ one draw's decoded moment, E over draws):

  rmse   sqrt(E‖x̂ − x‖²) / ‖x‖
  bias   ‖E[x̂] − x‖ / ‖x‖ (its floor at this many draws: rmse / sqrt(draws) for an unbiased rounding)
  align  E⟨x, x̂⟩ / ‖x‖² − 1 (Quartet II's magnitude misalignment)
  zero   share of the nonzero entries of √v decoded at or below 0

  python -m benchmarks.moment_rounding [--steps 300] [--draws 32]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.optim_lm import SEQ, batches, init_model, loss_of, stdlib_bytes
from fp4jax import numerics
from fp4jax.optim import _common
from fp4jax.optim.state import DEFAULT_MIN_SIZE, stores_nvfp4

ROUNDINGS = ("nearest", "stochastic", "dither", "eden")


def moments(steps: int, seed: int = 0, lr: float = 1e-3):
  """Float32 AdamW's (m, √v) leaves after ``steps`` on the byte LM, those the storage rule stores as
  NVFP4."""
  graphdef, params = init_model(seed)
  loss = loss_of(graphdef)
  tx = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  data = batches(stdlib_bytes(), 16, SEQ, seed)
  for _ in range(steps):
    params, opt_state = step(params, opt_state, *next(data))
  adam = opt_state[0]
  keep = lambda x: stores_nvfp4(x.shape, DEFAULT_MIN_SIZE)
  mu = [x for x in jax.tree.leaves(adam.mu) if keep(x)]
  nu = [jnp.sqrt(x) for x in jax.tree.leaves(adam.nu) if keep(x)]
  return mu, nu


def stored(x, rounding: str, key, lane: int):
  """One draw of ``x`` stored and decoded by ``rounding``."""
  zero = numerics.runtime_zero(0)
  if rounding == "dither":
    return _common.decode_dithered(_common.encode_dithered(x, key, zero, lane), key, lane)
  if rounding == "eden":
    return _common.decode(_common.encode_eden(x, key, zero, lane))
  return _common.decode(_common.encode(x, rounding, key, lane))


def measure(leaves, rounding: str, draws: int, lane: int) -> dict:
  sq = bias2 = dot = norm2 = 0.0
  zeros = nonzero = 0
  encode = jax.jit(lambda x, k: stored(x, rounding, k, lane))
  for i, x in enumerate(leaves):
    x = np.asarray(x, np.float64)
    ys = np.stack([np.asarray(encode(jnp.asarray(x, jnp.float32), jax.random.key(1000 * i + d)), np.float64)
                   for d in range(draws)])
    sq += np.mean(np.sum((ys - x) ** 2, axis=tuple(range(1, ys.ndim))))
    bias2 += np.sum((ys.mean(0) - x) ** 2)
    dot += np.mean(np.sum(ys * x, axis=tuple(range(1, ys.ndim))))
    norm2 += np.sum(x * x)
    zeros += np.sum((ys <= 0) & (x > 0)) / draws
    nonzero += np.sum(x > 0)
  return {"rmse": np.sqrt(sq / norm2), "bias": np.sqrt(bias2 / norm2), "align": dot / norm2 - 1,
          "zero": zeros / max(nonzero, 1)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--draws", type=int, default=32)
  args = parser.parse_args(argv)
  mu, nu = moments(args.steps)
  print(f"{sum(x.size for x in mu)} elements in {len(mu)} leaves, {args.steps} steps, {args.draws} draws")
  print(f"{'moment':6} {'rounding':11} {'rmse':>8} {'bias':>8} {'align':>9} {'zero':>8}")
  for name, leaves, lane in (("m", mu, 0), ("sqrt v", nu, 1)):
    for rounding in ROUNDINGS:
      r = measure(leaves, rounding, args.draws, lane)
      zero = f"{r['zero']:8.4%}" if lane else f"{'-':>8}"
      print(f"{name:6} {rounding:11} {r['rmse']:8.4f} {r['bias']:8.4f} {r['align']:+9.5f} {zero}", flush=True)


if __name__ == "__main__":
  main()
