"""LoRA-SVD and recipe errors: how much NVFP4 error each choice leaves, measured (no timing).

  python -m benchmarks.lorasvd_error                 # prints markdown tables; CPU: ~14 min of CPU time
  python -m benchmarks.lorasvd_error --out benchmarks/lorasvd_error.md

Table 1, weight error. ``‖deq(Q(W_res)) + A·B − W‖ / ‖W‖`` (16×16 tiles, round-to-nearest) for
ranks 0 (= direct ``‖deq(Q(W)) − W‖ / ‖W‖``), 8, 16, 32, 64, 128, with the exact SVD and the
randomized one (oversample 8, 2 power iterations), on matrices of four kinds:

- ``random init``: N(0, 1/K) entries, the spectrum of an untrained layer (Marchenko–Pastur);
- ``spiked``: that bulk plus 16 directions at 1.5–12× the bulk edge (BBP outliers, as trained LLM
  weights show; the largest carry most of the norm);
- ``power law a``: random singular vectors, ``σ_i ∝ i^-a`` (heavy-tailed spectrum), a = 0.5 and 1.

Table 2, a layer's GEMM outputs against the same layer in BF16: relative error of the output y,
the input gradient dx and the weight gradient dW of the NVFP4 path (``W`` for ``fp4_dense``,
``W_res`` for ``lora_svd_dense``; dA and dB are not listed: the bf16 branch gives them exactly as the
reference does). "8-key mean" is the error of the mean over 8 keys: what stays is bias (the error of
Q(w) for dx; round-to-nearest for dW), what goes is the per-key noise of SR and of the Hadamard signs.
Inputs: x with per-channel scales (log-normal, σ=1), dy with per-token scales (log-normal, σ=1),
W the ``spiked`` matrix.
"""

import argparse
import datetime

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp4jax import nvfp4
from fp4jax.layers import fp4_dense, lora_svd_dense, lora_svd_split
from fp4jax.ops import MatmulConfig
from fp4jax.quant import Operand

RANKS = (0, 8, 16, 32, 64, 128)


def _orthogonal(rng, n, k):
  q, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return q


def matrices(k, n, seed=0):
  rng = np.random.default_rng(seed)
  bulk = rng.standard_normal((k, n)) / np.sqrt(k)
  edge = 1.0 + np.sqrt(n / k)
  spikes = edge * np.geomspace(12.0, 1.5, 16)
  spiked = bulk + (_orthogonal(rng, k, 16) * spikes) @ _orthogonal(rng, n, 16).T
  r = min(k, n)
  u, v = _orthogonal(rng, k, r), _orthogonal(rng, n, r)
  out = {"random init": bulk, "spiked": spiked}
  for a in (0.5, 1.0):
    s = np.arange(1, r + 1, dtype=np.float64) ** -a
    out[f"power law a={a:g}"] = (u * s) @ v.T
  return {name: jnp.asarray(w, jnp.float32) for name, w in out.items()}


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


_deq16 = jax.jit(lambda w: nvfp4.quantize(w, block=(16, 16)).dequantize())


def weight_table(shapes):
  lines = ["| matrix | K×N | SVD | " + " | ".join(f"r={r}" for r in RANKS) + " |",
           "|---|---|---|" + "---|" * len(RANKS)]
  for k, n in shapes:
    for name, w in matrices(k, n).items():
      for method in ("exact", "randomized"):
        errs = []
        for r in RANKS:
          a, b, w_res = lora_svd_split(w, r, method=method, key=jax.random.key(r))
          errs.append(_rel(_deq16(w_res) + jnp.dot(a, b, precision="highest"), w))
        lines.append(f"| {name} | {k}×{n} | {method} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
  overhead = ", ".join(f"r={r}: {r * (k + n) / (k * n):.1%}" for r in RANKS[1:] for k, n in shapes[:1])
  lines.append(f"\nExtra parameters and FLOPs of the bf16 branch, r(K+N)/(KN), at {shapes[0][0]}×"
               f"{shapes[0][1]}: {overhead}.")
  return "\n".join(lines)


RECIPES = {
    "bf16 (reference)": MatmulConfig.bf16(),
    "nvfp4 (NVIDIA recipe)": MatmulConfig.nvfp4(),
    "nvfp4, no Hadamard": MatmulConfig.nvfp4(hadamard=False),
    "nvfp4, no SR (nearest)": MatmulConfig.nvfp4(dy_dgrad=Operand(), dy_wgrad=Operand()),
    "nvfp4, no SR, no Hadamard": MatmulConfig.nvfp4(dy_dgrad=Operand(), dy_wgrad=Operand(), hadamard=False),
    "nvfp4 forward only": MatmulConfig.nvfp4(dgrad=False, wgrad=False, hadamard=False),
}


def _layer_grads(layer, x, dy, keys):
  """[{y, dx, dW}] for each key (one compile per layer)."""
  graphdef, params = nnx.split(layer)

  @jax.jit
  def run(params, x, dy, key):
    y, vjp = jax.vjp(lambda params, x: nnx.merge(graphdef, params)(x, key=key), params, x)
    dparams, dx = vjp(dy)
    return {"y": y, "dx": dx, "dW": dparams["kernel"][...]}

  return [run(params, x, dy, key) for key in keys]


def recipe_table(m, k, n, ranks=(0, 16, 32), n_keys=8):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((m, k)) * rng.lognormal(0, 1, (1, k))
  dy = rng.standard_normal((m, n)) * rng.lognormal(0, 1, (m, 1)) * 1e-3
  x, dy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
  w = matrices(k, n)["spiked"]
  lines = ["| layer | recipe | y | dx | dW | dx, 8-key mean | dW, 8-key mean |", "|---|---|---|---|---|---|---|"]
  for r in ranks:
    def make(config, r=r):
      init = lambda key, shape, dtype: w.astype(dtype)
      if r == 0:
        return fp4_dense(k, n, config=config, rngs=nnx.Rngs(0), kernel_init=init)
      return lora_svd_dense(k, n, rank=r, config=config, rngs=nnx.Rngs(0), kernel_init=init, svd="exact")
    (ref,) = _layer_grads(make(MatmulConfig.bf16()), x, dy, [None])
    for name, config in RECIPES.items():
      if name.startswith("bf16"):
        continue
      runs = _layer_grads(make(config), x, dy, [jax.random.key(i) for i in range(n_keys)])
      mean = lambda c: _rel(jnp.mean(jnp.stack([q[c].astype(jnp.float32) for q in runs]), 0), ref[c])
      label = "fp4_dense" if r == 0 else f"lora_svd_dense r={r}"
      errs = " | ".join(f"{_rel(runs[0][c], ref[c]):.4f}" for c in ("y", "dx", "dW"))
      lines.append(f"| {label} | {name} | {errs} | {mean('dx'):.4f} | {mean('dW'):.4f} |")
  return "\n".join(lines)


def _header():
  title = __doc__.split("\n", 1)[0]
  body = __doc__[__doc__.index("Table 1"):].strip()
  return (f"# {title}\n\nWritten by `python -m benchmarks.lorasvd_error --out benchmarks/lorasvd_error.md` "
          f"on {datetime.date.today()}.\n\n{body}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", help="also write the tables (markdown) to this file")
  ap.add_argument("--small", action="store_true", help="smaller shapes (smoke run)")
  args = ap.parse_args()
  shapes = [(256, 256)] if args.small else [(1024, 1024), (1024, 4096)]
  m, k, n = (256, 128, 128) if args.small else (2048, 1024, 1024)
  dev = jax.devices()[0]
  text = "\n\n".join([
      f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}",
      "### Relative NVFP4 error of the effective weight, ‖deq(Q(W_res)) + A·B − W‖/‖W‖ (r=0: direct)",
      weight_table(shapes),
      f"### Layer output and gradients vs the same layer in BF16 (x {m}×{k} bf16, W {k}×{n} spiked; "
      "first key, and the mean over 8 keys)",
      recipe_table(m, k, n),
  ])
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(_header() + "\n\n" + text + "\n")


if __name__ == "__main__":
  main()
