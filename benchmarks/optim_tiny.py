"""The optimizer comparison on the ``tiny`` experiment config (0.4M-parameter byte model, Shakespeare).

Linear layers, attention and everything else stay at the ``bf16`` recipe; only the optimizer
changes, through ``Recipe.optimizer_states`` / ``Recipe.newton_schulz`` and the config's optimizer
name, with the same data, seed and schedule:

  adamw: optax.adamw                          |  adamw_nvfp4: NVFP4 states
  muon: bf16 Newton–Schulz, float32 states    |  muon_nvfp4: NVFP4 Newton–Schulz + NVFP4 states

  python -m benchmarks.optim_tiny [--steps 200] [--seeds 3] [--workdir /tmp/optim_tiny] [--muon-lr 0.02]
  python -m benchmarks.optim_tiny --tiny     # a CPU smoke run: 10 steps of each optimizer

Needs the built-in Shakespeare corpus (``python -m fp4jax.corpus``; cached under ~/.cache/fp4jax).
Prints a markdown table of final train loss (mean of the last 10% of logged steps) and eval loss,
each averaged over the seeds.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

from experiments import train as launcher
from experiments.compare import run_summary
from experiments.configs.tiny import get_config
from fp4jax import data
from fp4jax.train import train

RUNS = {  # name: (optimizer, optimizer_states, newton_schulz)
    "adamw": ("adamw", "fp32", "bf16"),          # optax.adamw
    "adamw_nvfp4": ("adamw", "nvfp4", "bf16"),
    "muon": ("muon", "fp32", "bf16"),            # muon_nvfp4(ns_operand=Operand(format="bf16"), quantize=False)
    "muon_nvfp4": ("muon", "nvfp4", "nvfp4"),    # NVFP4 Newton–Schulz and NVFP4 states
}


def run_one(name, steps, workdir, muon_lr, seed=0):
  opt, states, ns = RUNS[name]
  cfg = get_config("bf16")
  with cfg.unlocked():
    cfg.steps = steps
    cfg.progress = False
    cfg.checkpoint_every = 0
    cfg.optimizer.name = opt
    cfg.seed = seed
    if opt == "muon":
      cfg.optimizer.learning_rate = muon_lr
  data_dir, meta = launcher.prepare_data(cfg)
  model_cfg, recipe, opt_cfg, train_cfg, execution = launcher.from_config(cfg, meta.vocab_size)
  recipe = recipe.replace(optimizer_states=states, newton_schulz=ns)
  shutil.rmtree(workdir, ignore_errors=True)
  train_iter = data.make_iterator(data_dir, "train", cfg.seq_len, cfg.batch_size, seed=cfg.seed)
  eval_batches = lambda: data.make_iterator(
      data_dir, "validation", cfg.seq_len, cfg.batch_size, shuffle=False, repeat=False)
  t0 = time.time()
  train(model_cfg, recipe, opt_cfg, train_cfg, workdir, train_iter, eval_batches, execution=execution)
  return run_summary(workdir), time.time() - t0


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--workdir", default="/tmp/optim_tiny")
  ap.add_argument("--muon-lr", type=float, default=0.02)
  ap.add_argument("--only", default=",".join(RUNS))
  ap.add_argument("--seeds", type=int, default=1)
  ap.add_argument("--tiny", action="store_true", help="10 steps of each optimizer (CPU smoke run)")
  args = ap.parse_args(argv)
  if args.tiny:
    args.steps = 10
  res = {}
  for name in args.only.split(","):
    runs = []
    for seed in range(args.seeds):
      summary, secs = run_one(name, args.steps, Path(args.workdir) / f"{name}-{seed}", args.muon_lr, seed)
      runs.append(summary)
      print(f"  {name} seed {seed}: {summary} ({secs:.0f} s)", flush=True)
    res[name] = {k: float(np.mean([r[k] for r in runs])) for k in ("train_loss", "eval_loss")}
  print(f"\n### tiny config ({args.steps} steps, {args.seeds} seed(s), bf16 recipe except the "
        "optimizer), CPU\n")
  print("| optimizer | train loss | eval loss | gap (eval) to its fp32 peer |\n|---|---|---|---|")
  peers = {"adamw_nvfp4": "adamw", "muon_nvfp4": "muon"}
  for name, s in res.items():
    gap = ""
    if peers.get(name) in res:
      ref = res[peers[name]]["eval_loss"]
      gap = f"{100 * (s['eval_loss'] - ref) / ref:+.2f}%"
    print(f"| {name} | {s['train_loss']:.4f} | {s['eval_loss']:.4f} | {gap} |")


if __name__ == "__main__":
  main()
