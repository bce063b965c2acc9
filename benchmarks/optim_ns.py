"""Newton–Schulz in NVFP4 vs BF16 vs FP32: orthogonality, error along K, error along iterations (CPU).

Tables (markdown, last):

1. Singular values of the Newton–Schulz output (Muon's coefficients, 5 steps) on random and
   trained-like matrices, and the relative distance to the fp32 output. ``nvfp4`` is the two-term
   operand mode the optimizers use.
2. Relative error of one product C = A·B (A: 64×K, B: K×64, Gaussian) against float64, as K grows,
   for each operand format with float32 accumulation, and NVFP4 operands with a bfloat16 accumulator
   (partial sums of each 16-element block added into a bf16 running sum, as a low-precision
   accumulator would).
3. Distance to the fp32 iterate after each Newton–Schulz step (error compounding), also for one
   NVFP4 tensor per operand (``nvfp4_dot(operand=Operand())``), whose singular values leave the basin.

  python -m benchmarks.optim_ns [--quick]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.optim_lm import init_model, loss_of, stdlib_bytes
from fp4jax import analysis, optim
from fp4jax.optim import ns
from fp4jax.quant import Operand

PRECS = {"fp32": None, "bf16": Operand(format="bf16"), "nvfp4": ns.NS_OPERAND}  # newton_schulz's operand


def matrices(quick: bool):
  rng = np.random.default_rng(0)
  n = 128 if quick else 256
  out = {f"gaussian {n}x{n}": rng.standard_normal((n, n)),
         f"gaussian {n}x{4 * n}": rng.standard_normal((n, 4 * n))}
  u, _ = np.linalg.qr(rng.standard_normal((n, n)))
  v, _ = np.linalg.qr(rng.standard_normal((2 * n, n)))
  out[f"power-law spectrum s_i=1/i {n}x{2 * n}"] = (u * (1.0 / np.arange(1, n + 1))) @ v.T
  heavy = rng.standard_t(2, (n, 2 * n))
  out[f"Student-t(2) entries {n}x{2 * n}"] = heavy
  thr = np.quantile(np.abs(heavy), 0.9)
  out[f"same, ROOT-clipped at q0.9 {n}x{2 * n}"] = np.clip(heavy, -thr, thr)
  data = stdlib_bytes(1 << 16)
  x = np.stack([data[i * 65:i * 65 + 64] for i in range(16)]).astype(np.int32)
  graphdef, params = init_model(0)
  grads = jax.grad(loss_of(graphdef))(params, x, np.roll(x, -1, 1))
  for name, g in (("gate_up", grads["blocks"][0]["mlp"]["gate_up"]["kernel"]),
                  ("qkv", grads["blocks"][0]["attn"]["qkv"]["kernel"])):
    out[f"byte-LM gradient, {name} {g.shape[0]}x{g.shape[1]}"] = np.asarray(g)
  return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def table_orthogonality(mats):
  rows = []
  for name, x in mats.items():
    ref = jax.jit(lambda x: optim.newton_schulz(x, operand=None))(x)
    for p in PRECS:
      y = jax.jit(lambda x, p=p: optim.newton_schulz(x, operand=PRECS[p]))(x)
      e = analysis.orthogonality_error(y)
      dist = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
      rows.append((name, p, e["s_min"], e["s_max"], e["s_std"], dist))
      print(f"  {name} {p}: {e}", flush=True)
  return rows


def _bf16_accumulated(a, b):
  """NVFP4 operands, each 16-element block's partial product summed in f32, running sum in bf16."""
  qa = ns._terms(a, -1, Operand())[0]
  qb = ns._terms(b, 0, Operand())[0]
  ea, eb = qa.scaled_elements(jnp.float32), qb.scaled_elements(jnp.float32)
  k = a.shape[1]
  parts = jnp.einsum("mkb,kbn->kmn", ea.reshape(a.shape[0], k // 16, 16),
                     eb.reshape(k // 16, 16, b.shape[1]), precision=jax.lax.Precision.HIGHEST)
  acc = jax.lax.scan(lambda c, p: ((c + p).astype(jnp.bfloat16).astype(jnp.float32), None),
                     jnp.zeros(parts.shape[1:], jnp.float32), parts)[0]
  return (acc * qa.global_scale) * qb.global_scale


def table_k(ks):
  rng = np.random.default_rng(1)
  fns = {
      "bf16 operands, f32 acc": jax.jit(lambda a, b: jnp.dot(a.astype(jnp.bfloat16), b.astype(
          jnp.bfloat16), preferred_element_type=jnp.float32)),
      "nvfp4 operands, f32 acc": jax.jit(lambda a, b: optim.nvfp4_dot(a, b, Operand())),
      "nvfp4 two-term, f32 acc": jax.jit(lambda a, b: optim.nvfp4_dot(a, b, Operand(terms=2))),
      "nvfp4 operands, bf16 acc": jax.jit(_bf16_accumulated),
  }
  rows = []
  for k in ks:
    a64, b64 = rng.standard_normal((64, k)), rng.standard_normal((k, 64))
    exact = a64 @ b64
    a, b = jnp.asarray(a64, jnp.float32), jnp.asarray(b64, jnp.float32)
    errs = {name: float(np.linalg.norm(np.asarray(f(a, b), np.float64) - exact) / np.linalg.norm(exact))
            for name, f in fns.items()}
    rows.append((k, errs))
    print(f"  K={k}: {errs}", flush=True)
  return rows


def table_steps(x, steps=5):
  coeffs = optim.MUON_COEFFS
  xs = {}
  one_term = (lambda a, b: optim.nvfp4_dot(a, b), optim.nvfp4_gram, optim.nvfp4_gram)
  for p in (*PRECS, "nvfp4_1term"):
    mm, gram, square = one_term if p == "nvfp4_1term" else ns._products(PRECS[p])
    a, b, c = coeffs
    y = x / (jnp.linalg.norm(x) + 1e-8)
    if p.startswith("nvfp4"):
      y = jnp.pad(y, ((0, -y.shape[0] % 16), (0, -y.shape[1] % 16)))
    step = jax.jit(lambda y: a * y + mm(b * gram(y) + c * square(gram(y)), y))
    traj = []
    for _ in range(steps):
      y = step(y)
      traj.append(y[:x.shape[0], :x.shape[1]])
    xs[p] = traj
  rows = []
  for i in range(steps):
    ref = xs["fp32"][i]
    rows.append([float(jnp.linalg.norm(xs[p][i] - ref) / jnp.linalg.norm(ref))
                 for p in ("bf16", "nvfp4", "nvfp4_1term")]
                + [float(np.linalg.svd(np.asarray(xs["nvfp4_1term"][i]), compute_uv=False).max())])
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="smaller matrices and K range")
  args = ap.parse_args(argv)
  t0 = time.time()
  mats = matrices(args.quick)
  orth = table_orthogonality(mats)
  ks = (64, 256, 1024, 4096) if args.quick else (64, 256, 1024, 4096, 16384)
  krows = table_k(ks)
  srows = table_steps(next(iter(mats.values())))

  print("\n### Newton–Schulz output singular values (Muon coefficients, 5 steps; CPU)\n")
  print("| matrix | operands | s_min | s_max | s_std | rel. dist. to fp32 |\n|---|---|---|---|---|---|")
  for name, p, lo, hi, sd, dist in orth:
    print(f"| {name} | {p} | {lo:.3f} | {hi:.4g} | {sd:.3g} | {dist:.3g} |")
  print("\n### One product C = A·B (64×K·K×64, Gaussian): relative error vs float64\n")
  names = list(krows[0][1])
  print("| K | " + " | ".join(names) + " |")
  print("|---" * (len(names) + 1) + "|")
  for k, errs in krows:
    print(f"| {k} | " + " | ".join(f"{errs[n]:.4f}" for n in names) + " |")
  print(f"\n### Distance to the fp32 iterate after each step ({next(iter(mats))})\n")
  print("| step | bf16 | nvfp4 (two-term) | one-term operands | one-term s_max |\n|---|---|---|---|---|")
  for i, r in enumerate(srows):
    print(f"| {i + 1} | {r[0]:.3g} | {r[1]:.3g} | {r[2]:.3g} | {r[3]:.3g} |")
  print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
  main()
