"""GPU check for fp4jax.ops.nvfp4_matmul and the dense layers: GPU-jit == CPU, quantization really ran.

For fixed inputs and keys, runs under jax.jit on the default backend (the H200) and on the CPU
backend in the same process, and compares:

1. every quantized GEMM operand (packed codes, e4m3 scales, global scale): bit for bit, except
   after the Hadamard transform, whose f32 sums may be ordered differently (then ≤ 0.1% of codes
   may flip at rounding ties, and H·x itself must agree to 1e-6);
2. forward, dgrad and wgrad of ``nvfp4_matmul`` (f32 inputs): within f32 accumulation tolerance, and
   far (> 1e-2) from the unquantized product, which proves the quantization was not folded away;
3. ``Fp4Dense`` and ``LoraSvdDense`` (bf16 activations, params built on the CPU): output and all
   parameter/input gradients within bf16 output tolerance.

On a CPU-only machine it compares CPU with CPU (checks the script itself). Exit code 1 on failure.

  python tests/gpu/check_matmul.py        (from the repository root, with PYTHONPATH=.)
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _check import CPU, DEV, on, rel, report
from fp4jax.layers import Fp4Dense, LoraSvdDense
from fp4jax.ops import MatmulConfig, matmul, nvfp4_matmul

# f32 GEMMs (the bf16-config rows with f32 inputs) at full f32 on the GPU too, not TF32, as in the tests.
jax.config.update("jax_default_matmul_precision", "highest")
M0, M1, K, N = 4, 128, 1024, 768
NVFP4 = MatmulConfig.nvfp4()


def bits_differ(a, b) -> int:
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype.itemsize > 1 or a.dtype != np.uint8:
    a, b = a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")
  return int(np.sum(a != b))


def inputs(dtype):
  rng = np.random.default_rng(2026)
  x = rng.standard_normal((M0, M1, K)) * rng.lognormal(0, 1, (1, 1, K))  # outlier channels
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  dy = rng.standard_normal((M0, M1, N)) * rng.lognormal(0, 1, (M0, M1, 1)) * 1e-3
  return x.astype(dtype), w.astype(np.float32), dy.astype(dtype)


def operand_rows(x, w, dy, key):
  """Quantized operands of the three GEMMs (what each GEMM multiplies), GPU vs CPU."""
  rows, ok = [], True

  def operands(x, w, dy, key, config):
    keys = matmul._keys(key, config)
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    return {"x (fwd, 1x16 along K)": matmul.quantize_x(x2, keys, config),
            "w (fwd+dgrad, 16x16)": matmul.quantize_w(w, keys, config),
            "dy (dgrad, 1x16 along N, SR)": matmul.quantize_dy_dgrad(dy2, keys, config),
            "H.x (wgrad, along tokens)": matmul.quantize_x_wgrad(x2, keys, config),
            "H.dy (wgrad, along tokens, SR)": matmul.quantize_dy_wgrad(dy2, keys, config),
            "H.x f32 (before quantization)": matmul.wgrad_operand(x2, keys)}

  for config, tag in ((NVFP4, ""), (MatmulConfig.nvfp4(hadamard=False), " [no Hadamard]")):
    f = lambda x, w, dy, key, config=config: operands(x, w, dy, key, config)  # noqa: E731
    g, c = on(DEV, f, x, w, dy, key), on(CPU, f, x, w, dy, key)
    for name in g:
      if tag and ("H." not in name or "f32" in name):
        continue
      if "f32" in name:
        r = rel(g[name], c[name])
        rows.append((name + tag, f"rel {r:.1e}", "≤ 1e-6"))
        ok &= r <= 1e-6
        continue
      n_bad = sum(bits_differ(u, v) for u, v in zip(jax.tree.leaves(g[name]), jax.tree.leaves(c[name])))
      n_codes = int(np.prod(g[name].codes.shape)) * 2
      hadamard = "H." in name and not tag
      limit = n_codes // 1000 if hadamard else 0
      rows.append((name + tag, f"{n_bad} of {n_codes} differ", f"≤ {limit}"))
      ok &= n_bad <= limit
  return rows, ok


def matmul_rows(x, w, dy, key):
  rows, ok = [], True

  def fwd_bwd(x, w, dy, key, config):
    y, vjp = jax.vjp(lambda x, w: nvfp4_matmul(x, w, key=key, config=config), x, w)
    return (y, *vjp(dy))

  for config, name in ((NVFP4, "nvfp4"), (MatmulConfig.nvfp4(hadamard=False), "nvfp4, no Hadamard"),
                       (MatmulConfig.bf16(), "bf16")):
    f = lambda x, w, dy, key, config=config: fwd_bwd(x, w, dy, key, config)  # noqa: E731
    g, c = on(DEV, f, x, w, dy, key), on(CPU, f, x, w, dy, key)
    unq = on(CPU, lambda x, w, dy: fwd_bwd(x, w, dy, None, MatmulConfig.bf16()), x, w, dy)
    for out, gv, cv, uv in zip(("y", "dx", "dw"), g, c, unq):
      r, r_unq = rel(gv, cv), rel(gv, uv)
      tol = 1e-4 if (out == "dw" and config.hadamard) else 1e-5
      quantized = {"y": config.fwd, "dx": config.dgrad, "dw": config.wgrad}[out]
      rows.append((f"{name}: {out}", f"rel {r:.1e} (bits differ: {bits_differ(gv, cv)})",
                   f"≤ {tol:.0e}; vs unquantized {r_unq:.3f}" + (" (> 1e-2)" if quantized else "")))
      ok &= r <= tol and (r_unq > 1e-2 if quantized else True)
  return rows, ok


def layer_rows(x, dy, key):
  rows, ok = [], True
  with jax.default_device(CPU):
    layers = {"Fp4Dense": Fp4Dense(K, N, config=NVFP4, rngs=nnx.Rngs(0), use_bias=True),
              "LoraSvdDense r=16": LoraSvdDense(K, N, rank=16, config=NVFP4, rngs=nnx.Rngs(0), svd="exact")}
  for name, layer in layers.items():
    graphdef, params = nnx.split(layer)

    def f(params, x, dy, key, graphdef=graphdef):
      y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x, key=key), params, x)
      dp, dx = vjp(dy)
      return {"y": y, "dx": dx, **{f"d{k}": v[...] for k, v in dp.items()}}

    g, c = on(DEV, f, params, x, dy, key), on(CPU, f, params, x, dy, key)
    for out in g:
      r = rel(g[out], c[out])
      rows.append((f"{name}: {out} {g[out].dtype}", f"rel {r:.1e}", "≤ 5e-3 (bf16 outputs)"))
      ok &= r <= 5e-3
  return rows, ok


def main() -> int:
  print(f"device: {DEV.device_kind} ({DEV.platform}) vs {CPU.device_kind}; jax {jax.__version__}")
  key = jax.random.key(7)
  x, w, dy = inputs(np.float32)
  rows, ok = operand_rows(x, w, dy, key)
  r, o = matmul_rows(x, w, dy, key)
  rows, ok = rows + r, ok and o
  xb, _, dyb = inputs(jnp.bfloat16)
  r, o = layer_rows(xb, dyb, key)
  rows, ok = rows + r, ok and o
  print(f"\nshapes: x [{M0}, {M1}, {K}], w [{K}, {N}]\n")
  return report(("check", "GPU vs CPU", "bound / note"), rows, ok)


if __name__ == "__main__":
  sys.exit(main())
