"""The optimizer comparison on the ``tiny`` experiment config (0.4M-parameter byte model, Shakespeare).

Linear layers, attention and everything else stay at the ``bf16`` recipe; only the optimizer
changes, through ``Recipe.optimizer_states`` / ``Recipe.newton_schulz`` and the config's optimizer
name, with the same data, seed and schedule:

  adamw, fp32 states   |  adamw, NVFP4 states (adamw_nvfp4)
  muon, bf16 NS, fp32  |  muon, NVFP4 NS + NVFP4 states (muon_nvfp4)

  python benchmarks/optim_tiny.py [--steps 200] [--workdir /tmp/optim_tiny] [--muon-lr 0.02]

Needs the built-in Shakespeare corpus (``python -m fp4jax.corpus``; cached under ~/.cache/fp4jax).
Prints a markdown table of final train loss (mean of the last 10% of logged steps) and eval loss.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import train as launcher  # noqa: E402
from experiments.compare import run_summary  # noqa: E402
from experiments.configs.tiny import get_config  # noqa: E402

RUNS = {  # name: (optimizer, optimizer_states, newton_schulz)
    "adamw, fp32 states": ("adamw", "fp32", "bf16"),
    "adamw_nvfp4": ("adamw", "nvfp4", "bf16"),
    "muon, bf16 NS, fp32 states": ("muon", "fp32", "bf16"),
    "muon_nvfp4 (NVFP4 NS + states)": ("muon", "nvfp4", "nvfp4"),
}


def run_one(name, steps, workdir, muon_lr):
  from fp4jax import data
  from fp4jax.train import train
  opt, states, ns = RUNS[name]
  cfg = get_config("bf16")
  with cfg.unlocked():
    cfg.steps = steps
    cfg.progress = False
    cfg.checkpoint_every = 0
    cfg.optimizer.name = opt
    if opt == "muon":
      cfg.optimizer.learning_rate = muon_lr
  data_dir, meta = launcher.prepare_data(cfg)
  model_cfg, recipe, opt_cfg, train_cfg = launcher.from_config(cfg, meta.vocab_size)
  recipe = recipe.replace(optimizer_states=states, newton_schulz=ns)
  shutil.rmtree(workdir, ignore_errors=True)
  train_iter = data.make_iterator(data_dir, "train", cfg.seq_len, cfg.batch_size, seed=cfg.seed)
  eval_batches = lambda: data.make_iterator(  # noqa: E731
      data_dir, "validation", cfg.seq_len, cfg.batch_size, shuffle=False, repeat=False)
  t0 = time.time()
  train(model_cfg, recipe, opt_cfg, train_cfg, workdir, train_iter, eval_batches)
  return run_summary(workdir), time.time() - t0


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--workdir", default="/tmp/optim_tiny")
  ap.add_argument("--muon-lr", type=float, default=0.02)
  ap.add_argument("--only", default=",".join(RUNS))
  args = ap.parse_args(argv)
  res = {}
  for name in args.only.split(","):
    res[name] = run_one(name, args.steps, Path(args.workdir) / name.replace(" ", "_"), args.muon_lr)
    print(f"  {name}: {res[name][0]} ({res[name][1]:.0f} s)", flush=True)
  print(f"\n### tiny config ({args.steps} steps, bf16 recipe except the optimizer), CPU\n")
  print("| optimizer | train loss | eval loss | gap (eval) to its fp32 peer |\n|---|---|---|---|")
  peers = {"adamw_nvfp4": "adamw, fp32 states",
           "muon_nvfp4 (NVFP4 NS + states)": "muon, bf16 NS, fp32 states"}
  for name, (s, _) in res.items():
    gap = ""
    if peers.get(name) in res:
      ref = res[peers[name]][0]["eval_loss"]
      gap = f"{100 * (s['eval_loss'] - ref) / ref:+.2f}%"
    print(f"| {name} | {s.get('train_loss', float('nan')):.4f} | {s.get('eval_loss', float('nan')):.4f} | {gap} |")


if __name__ == "__main__":
  main()
