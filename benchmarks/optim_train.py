"""Training comparison of the NVFP4 optimizers against their float32 peers (CPU, tiny byte LM).

Same model, seed and batches for every run (benchmarks/optim_lm.py: 2 blocks, d=128, context 64,
Python stdlib sources as bytes). Re-run on the ``tiny`` experiment config once the training side
is wired to these optimizers.

  python benchmarks/optim_train.py [--steps 300] [--seeds 1] [--only adamw,adamw_nvfp4,...]

Prints a markdown table: final loss (mean of the last 50 steps) and the gap to the peer.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

sys.path.insert(0, __import__("os").path.dirname(__file__))
from optim_lm import stdlib_bytes, train  # noqa: E402

from fp4jax import optim  # noqa: E402

LR_ADAM, LR_MUON, WD = 1e-3, 0.02, 0.1


def _muon_dims(params):
  return jax.tree.map(lambda m: MuonDimensionNumbers() if m else None, optim.default_muon_mask(params))


def _ours(lr, **kw):
  return lambda: optim.muon_nvfp4(lr, adam_learning_rate=LR_ADAM, weight_decay=WD, **kw)


RUNS = {  # name (no commas): (peer, factory)
    "adamw": (None, lambda: optax.adamw(LR_ADAM, b1=0.9, b2=0.95, weight_decay=WD)),
    "adamw_nvfp4": ("adamw", lambda: optim.adamw_nvfp4(LR_ADAM, weight_decay=WD)),
    "muon": (None, lambda: optax.contrib.muon(
        LR_MUON, adam_learning_rate=LR_ADAM, adam_b2=0.95, weight_decay=WD,
        muon_weight_dimension_numbers=_muon_dims)),
    # default: NVFP4 Newton–Schulz, NVFP4 AdamW-side moments, float32 momentum
    "muon_nvfp4": ("muon", _ours(LR_MUON)),
    "muon_nvfp4_mu": ("muon", _ours(LR_MUON, quantize_mu=True)),  # + NVFP4 momentum
    # one change at a time against optax's muon (all through fp4jax.optim.muon_nvfp4):
    "muon_ours_fp32": ("muon", _ours(LR_MUON, ns_precision="fp32", quantize=False)),
    "muon_bf16ns": ("muon", _ours(LR_MUON, ns_precision="bf16", quantize=False)),
    "muon_nvfp4ns_only": ("muon", _ours(LR_MUON, quantize=False)),
    "muon_nvfp4adam_only": ("muon", _ours(LR_MUON, ns_precision="fp32")),
    "muon_nvfp4mu_only": ("muon", _ours(LR_MUON, ns_precision="fp32", quantize=False,
                                        quantize_mu=True)),
    "root_fp32": (None, lambda: optim.root(LR_MUON / 5, ns_precision="fp32", quantize=False,
                                           adam_learning_rate=LR_ADAM)),
    "root_nvfp4": ("root_fp32", lambda: optim.root(LR_MUON / 5, adam_learning_rate=LR_ADAM)),
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--seeds", type=int, default=1)
  ap.add_argument("--only", default=",".join(RUNS))
  args = ap.parse_args(argv)
  names = args.only.split(",")
  data, t0, res = stdlib_bytes(), time.time(), {}
  for name in names:
    finals = []
    for seed in range(args.seeds):
      losses, secs = train(RUNS[name][1](), args.steps, seed=seed, data=data)
      finals.append(float(np.mean(losses[-50:])) if np.all(np.isfinite(losses)) else float("nan"))
      print(f"  {name} seed {seed}: final {finals[-1]:.4f}, first-50 {np.mean(losses[:50]):.4f} "
            f"({secs:.0f} s)", flush=True)
    res[name] = finals
  print(f"\n### Tiny byte LM, {args.steps} steps, {args.seeds} seed(s): final loss (mean of last 50)\n")
  print("| optimizer | final loss | peer | gap to peer |\n|---|---|---|---|")
  for name in names:
    peer = RUNS[name][0]
    gap = ""
    if peer in res:
      base = np.mean(res[peer])
      gap = f"{100 * (np.mean(res[name]) - base) / base:+.2f}%"
    print(f"| {name} | {np.mean(res[name]):.4f} | {peer or '-'} | {gap} |")
  print(f"\n({time.time() - t0:.0f} s, CPU)")


if __name__ == "__main__":
  main()
