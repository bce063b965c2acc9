"""Ablations of ``adamw_nvfp4``'s storage options (``AdamNvfp4Options``), measured on the CPU.

Part 1, shadow states: a float32 ``optax.adamw`` trains the tiny byte LM (benchmarks/optim_lm.py);
at every step each candidate ``scale_by_adam_nvfp4`` gets the *same* gradient, keeps its own NVFP4
state and produces an update, compared with float32 Adam's update on the NVFP4-stored leaves:

  rel_err   ‖u − u_ref‖ / ‖u_ref‖, mean over the second half of the run
  max|u|    largest update element over the run (float32 Adam: <= 1.16 by its bound)
  >2×       share of elements with |u| > 2 |u_ref| + 0.05 (over-large updates), second half

Part 2, training: each candidate trains the model itself (--lr, wd 0.1, same seed and data);
final loss = mean of the last 50 steps.

  python -m benchmarks.optim_states [--steps 200] [--train-steps 400] [--only shadow|train] [--lr 1e-3]
  python -m benchmarks.optim_states --tiny     # a CPU smoke run of both parts
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.optim_lm import batches, init_model, loss_of, stdlib_bytes, train
from fp4jax import optim
from fp4jax.quant import Operand

_LOG_SCALE = 2.0**-40  # log-companded candidate: store log2(1 + v / c)
LOG_MAP = (lambda v: jnp.log2(1.0 + v / _LOG_SCALE), lambda y: (jnp.exp2(y) - 1.0) * _LOG_SCALE)

Options = optim.AdamNvfp4Options
NEAREST = dict(mu=Operand(), nu=Operand())
CANDIDATES = {
    "stochastic, clip (default)": Options(),
    "nearest, clip": Options(**NEAREST),
    "m stochastic, sqrt v nearest, clip": Options(nu=Operand()),
    "stochastic, no clip": Options(clip_update=False),
    "nearest, no clip": Options(**NEAREST, clip_update=False),
}
TRAIN_CANDIDATES = tuple(CANDIDATES)
B1, B2, LR, WD = 0.9, 0.95, 1e-3, 0.1


def _set_lr(lr):
  global LR
  LR = lr


def shadow(steps: int, seed: int = 0):
  data = stdlib_bytes()
  graphdef, params = init_model(seed)
  loss_fn = loss_of(graphdef)
  ref = optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD)
  core_ref = optax.scale_by_adam(B1, B2)
  cands = {k: optim.scale_by_adam_nvfp4(B1, B2, options=v) for k, v in CANDIDATES.items()}
  quantized = jax.tree.map(lambda p: optim.stores_nvfp4(p.shape, optim.DEFAULT_MIN_SIZE), params)

  @jax.jit
  def ref_step(params, st, core_st, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    u, st = ref.update(grads, st, params)
    u_core, core_st = core_ref.update(grads, core_st)
    return optax.apply_updates(params, u), st, core_st, grads, u_core

  @functools.partial(jax.jit, static_argnums=0)
  def cand_step(name, grads, st, u_ref):
    u, st = cands[name].update(grads, st)
    pick = lambda t: jnp.concatenate(
        [x.ravel() for x, q in zip(jax.tree.leaves(t), jax.tree.leaves(quantized)) if q])
    u, r = pick(u), pick(u_ref)
    err = jnp.linalg.norm(u - r) / jnp.linalg.norm(r)
    over = jnp.mean(jnp.abs(u) > 2 * jnp.abs(r) + 0.05)
    return st, err, jnp.max(jnp.abs(u)), over, jnp.max(jnp.abs(r))

  st, core_st = ref.init(params), core_ref.init(params)
  cst = {k: t.init(params) for k, t in cands.items()}
  rec = {k: [] for k in cands}
  ref_max, it = 0.0, batches(data, 16, 64, seed + 1)
  for i in range(steps):
    x, y = next(it)
    params, st, core_st, grads, u_ref = ref_step(params, st, core_st, x, y)
    for k in cands:
      cst[k], err, umax, over, rmax = cand_step(k, grads, cst[k], u_ref)
      rec[k].append((float(err), float(umax), float(over)))
    ref_max = max(ref_max, float(rmax))
    if (i + 1) % 50 == 0 or i + 1 == steps:
      print(f"  shadow step {i + 1}/{steps}", flush=True)
      _print_shadow(_rows(rec, i + 1), ref_max, i + 1)
  return _rows(rec, steps), ref_max


def _rows(rec, steps):
  rows = []
  for k, r in rec.items():
    r = np.asarray(r)
    half = r[steps // 2:]
    rows.append((k, half[:, 0].mean(), r[:, 1].max(), half[:, 2].mean()))
  return rows


def _print_shadow(rows, ref_max, steps):
  print(f"\n### Shadow states, {steps} steps, lr {LR:g}, tiny byte LM (CPU); float32 Adam "
        f"max|u| = {ref_max:.3f}\n")
  print("| options | rel_err | max abs(u) | >2x share |\n|---|---|---|---|")
  for k, err, umax, over in rows:
    print(f"| {k} | {err:.3f} | {umax:.3g} | {over:.2e} |", flush=True)


def train_all(steps: int, seeds=(0,), names=TRAIN_CANDIDATES):
  out = {}
  runs = {"fp32 optax.adamw": lambda: optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD)}
  for k in names:
    runs[k] = functools.partial(optim.adamw_nvfp4, LR, B1, B2, weight_decay=WD, options=CANDIDATES[k])
  for k, make in runs.items():
    finals = []
    for s in seeds:
      losses, secs = train(make(), steps, seed=s)
      finals.append(np.mean(losses[-50:]) if np.all(np.isfinite(losses)) else np.nan)
      print(f"  train {k} seed {s}: {finals[-1]:.4f} ({secs:.0f} s)", flush=True)
    out[k] = finals
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--train-steps", type=int, default=400)
  ap.add_argument("--seeds", type=int, default=1)
  ap.add_argument("--only", choices=("shadow", "train"), default=None)
  ap.add_argument("--lr", type=float, default=LR)
  ap.add_argument("--tiny", action="store_true", help="a few steps of each part (CPU smoke run)")
  ap.add_argument("--train-candidates", default=None, metavar="NAMES",
                  help="';'-separated names of the candidates to train (default: TRAIN_CANDIDATES)")
  args = ap.parse_args(argv)
  names = TRAIN_CANDIDATES if args.train_candidates is None else args.train_candidates.split(";")
  unknown = [n for n in names if n not in CANDIDATES]
  if unknown:
    ap.error(f"--train-candidates: unknown {unknown}; known: {sorted(CANDIDATES)}")
  _set_lr(args.lr)
  if args.tiny:
    args.steps, args.train_steps = 4, 60
  t0 = time.time()
  if args.only != "train":
    shadow(args.steps)
  if args.only != "shadow":
    res = train_all(args.train_steps, tuple(range(args.seeds)), names)
    base = np.mean(res["fp32 optax.adamw"])
    print(f"\n### Training, {args.train_steps} steps, lr {LR:g}, seeds {args.seeds}, final loss "
          "(last 50)\n")
    print("| optimizer | final loss | vs fp32 |\n|---|---|---|")
    for k, v in res.items():
      print(f"| {k} | {np.mean(v):.4f} | {100 * (np.mean(v) - base) / base:+.2f}% |")
  print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
  main()
