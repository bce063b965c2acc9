"""fp4jax.ops.nvfp4_matmul and the NVFP4 dense layers under jax.jit on the GPU equal the CPU.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu -s tests/gpu/test_matmul_gpu.py

For fixed inputs and keys, on the GPU and on the CPU backend of the same process:

1. every quantized GEMM operand (packed codes, E4M3 scales, global scale) bit for bit, except after
   the Hadamard transform, whose float32 sums may be ordered differently (then at most 0.1% of
   codes may flip at rounding ties, and H·x itself agrees to 1e-6);
2. forward, dgrad and wgrad of ``nvfp4_matmul`` (float32 inputs) within float32 accumulation
   tolerance, and far (> 1e-2) from the unquantized product: the quantization was not folded away;
3. ``Fp4Dense`` and ``LoraSvdDense`` (bf16 activations, params built on the CPU): output and every
   parameter and input gradient within bf16 output tolerance.

float32 GEMMs run at full precision on the GPU too (tests/conftest.py sets "highest"), not TF32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check import bits_differ, devices, on, rel, table
from flax import nnx

from fp4jax.layers import Fp4Dense, LoraSvdDense
from fp4jax.ops import MatmulConfig, matmul, nvfp4_matmul

pytestmark = pytest.mark.gpu

M0, M1, K, N = 4, 128, 1024, 768
NVFP4 = MatmulConfig.nvfp4()
KEY_SEED = 7


def inputs(dtype):
  rng = np.random.default_rng(2026)
  x = rng.standard_normal((M0, M1, K)) * rng.lognormal(0, 1, (1, 1, K))  # outlier channels
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  dy = rng.standard_normal((M0, M1, N)) * rng.lognormal(0, 1, (M0, M1, 1)) * 1e-3
  return x.astype(dtype), w.astype(np.float32), dy.astype(dtype)


def operand_rows(dev, cpu):
  """The quantized operands of the three GEMMs (what each GEMM multiplies), GPU vs CPU."""
  x, w, dy = inputs(np.float32)
  key = jax.random.key(KEY_SEED)
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
    g, c = on(dev, f, x, w, dy, key), on(cpu, f, x, w, dy, key)
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
      limit = n_codes // 1000 if ("H." in name and not tag) else 0
      rows.append((name + tag, f"{n_bad} of {n_codes} differ", f"≤ {limit}"))
      ok &= n_bad <= limit
  return rows, ok


def matmul_rows(dev, cpu):
  x, w, dy = inputs(np.float32)
  key = jax.random.key(KEY_SEED)
  rows, ok = [], True

  def fwd_bwd(x, w, dy, key, config):
    y, vjp = jax.vjp(lambda x, w: nvfp4_matmul(x, w, key=key, config=config), x, w)
    return (y, *vjp(dy))

  unq = on(cpu, lambda x, w, dy: fwd_bwd(x, w, dy, None, MatmulConfig.bf16()), x, w, dy)
  for config, name in ((NVFP4, "nvfp4"), (MatmulConfig.nvfp4(hadamard=False), "nvfp4, no Hadamard"),
                       (MatmulConfig.bf16(), "bf16")):
    f = lambda x, w, dy, key, config=config: fwd_bwd(x, w, dy, key, config)  # noqa: E731
    g, c = on(dev, f, x, w, dy, key), on(cpu, f, x, w, dy, key)
    for out, gv, cv, uv in zip(("y", "dx", "dw"), g, c, unq):
      r, r_unq = rel(gv, cv), rel(gv, uv)
      tol = 1e-4 if (out == "dw" and config.hadamard) else 1e-5
      quantized = {"y": config.fwd, "dx": config.dgrad, "dw": config.wgrad}[out]
      rows.append((f"{name}: {out}", f"rel {r:.1e} (bits differ: {bits_differ(gv, cv)})",
                   f"≤ {tol:.0e}; vs unquantized {r_unq:.3f}" + (" (> 1e-2)" if quantized else "")))
      ok &= r <= tol and (r_unq > 1e-2 if quantized else True)
  return rows, ok


def layer_rows(dev, cpu):
  x, _, dy = inputs(jnp.bfloat16)
  key = jax.random.key(KEY_SEED)
  rows, ok = [], True
  with jax.default_device(cpu):
    layers = {"Fp4Dense": Fp4Dense(K, N, config=NVFP4, rngs=nnx.Rngs(0), use_bias=True),
              "LoraSvdDense r=16": LoraSvdDense(K, N, rank=16, config=NVFP4, rngs=nnx.Rngs(0), svd="exact")}
  for name, layer in layers.items():
    graphdef, params = nnx.split(layer)

    def f(params, x, dy, key, graphdef=graphdef):
      y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x, key=key), params, x)
      dp, dx = vjp(dy)
      return {"y": y, "dx": dx, **{f"d{k}": v[...] for k, v in dp.items()}}

    g, c = on(dev, f, params, x, dy, key), on(cpu, f, params, x, dy, key)
    for out in g:
      r = rel(g[out], c[out])
      rows.append((f"{name}: {out} {g[out].dtype}", f"rel {r:.1e}", "≤ 5e-3 (bf16 outputs)"))
      ok &= r <= 5e-3
  return rows, ok


@pytest.mark.parametrize("rows_of", [operand_rows, matmul_rows, layer_rows],
                         ids=["operands", "matmul", "layers"])
def test_gpu_equals_cpu(rows_of):
  rows, ok = rows_of(*devices())
  text = table(("check", "GPU vs CPU", "bound / note"), rows)
  assert ok, text
