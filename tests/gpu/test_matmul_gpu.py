"""fp4jax.ops.nvfp4_matmul and the NVFP4 dense layers under jax.jit on the GPU equal the CPU.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu -s tests/gpu/test_matmul_gpu.py

For fixed inputs and keys, on the GPU and on the CPU backend of the same process:

1. every quantized GEMM operand (packed codes, E4M3 scales, global scale) bit for bit, the Hadamard
   transform's float32 H·x included (``nvfp4.hadamard`` adds in one fixed order), from the XLA
   implementation on the GPU and, from the quantizer kernels (``implementation="pallas"``), on the
   GPU against the XLA implementation on the CPU (NVIDIA's recipe, without the Hadamard transform,
   with counter bits, x and w under Four over Six, and w in 1×16 blocks under Four over Six: its
   forward Q_K(w) and the dgrad's Q_N(deq(Q_K(w))));
2. forward, dgrad and wgrad of ``nvfp4_matmul`` (float32 inputs) with either implementation on the
   GPU, against the XLA implementation on the CPU, within float32 accumulation tolerance (the same
   operands; only the GEMM's summation order may differ), and far (> 1e-2) from the unquantized
   product: the quantization was not folded away; for NVIDIA's recipe and for the two-term, BF16,
   Four-over-Six, 1×16-weight and split operands (a subspace split within 1e-2: its QR rounds per backend);
3. ``fp4_dense`` and ``lora_svd_dense`` (bf16 activations, params built on the CPU, the default
   ``implementation="auto"``: the kernels on the GPU, XLA on the CPU): output and every parameter
   and input gradient within bf16 output tolerance.

float32 GEMMs run at full precision on the GPU too (tests/conftest.py sets "highest"), not TF32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check import bits_differ, devices, on, rel, table
from flax import nnx

from fp4jax.execution import MatmulExecution
from fp4jax.layers import fp4_dense, lora_svd_dense
from fp4jax.ops import MatmulConfig, matmul, nvfp4_matmul
from fp4jax.ops.matmul import Split
from fp4jax.quant import BF16, Operand

pytestmark = pytest.mark.gpu

M0, M1, K, N = 4, 128, 1024, 768
NVFP4 = MatmulConfig.nvfp4()
# Four over Six on the forward operands (x by absolute error, w by squared error).
FOUR_OVER_SIX = MatmulConfig.nvfp4(x=Operand(scale_rule="4over6_mae"),
                                   w=Operand(block=(16, 16), scale_rule="4over6_mse"))
# w in 1×16 blocks along K, the dgrad's weight re-quantized along N; with Four over Six on x and w.
W_1X16 = MatmulConfig.nvfp4(w=Operand())
W_1X16_46 = MatmulConfig.nvfp4(x=Operand(scale_rule="4over6_mse"), w=Operand(scale_rule="4over6_mse"))
KEY_SEED = 7


def inputs(dtype):
  rng = np.random.default_rng(2026)
  x = rng.standard_normal((M0, M1, K)) * rng.lognormal(0, 1, (1, 1, K))  # outlier channels
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  dy = rng.standard_normal((M0, M1, N)) * rng.lognormal(0, 1, (M0, M1, 1)) * 1e-3
  return x.astype(dtype), w.astype(np.float32), dy.astype(dtype)


def _operands(x, w, dy, key, config, implementation):
  """The quantized operands of the three GEMMs (what each GEMM multiplies), by ``implementation``
  (``"xla"`` or ``"pallas"``), and the XLA implementation's float32 H·x."""
  keys = matmul._keys(key, config)
  x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
  run = MatmulExecution(implementation, "decoded")
  q = lambda a, op: matmul.quantize_operand(a, op, keys, config, run)[0][0]
  w_name = "w (fwd+dgrad, 16x16)" if config.w.block == (16, 16) else "w (fwd, 1x16 along K)"
  ops = {"x (fwd, 1x16 along K)": q(x2, "x"),
         w_name: q(w, "w"),
         "dy (dgrad, 1x16 along N, SR)": q(dy2, "dy_dgrad"),
         "H.x (wgrad, along tokens)": q(x2, "x_wgrad"),
         "H.dy (wgrad, along tokens, SR)": q(dy2, "dy_wgrad")}
  if config.w.block == (1, 16):  # the dgrad's weight: Q_N(deq(Q_K(w)))
    qw = matmul.quantize_operand(w, "w", keys, config, run)
    ops["w (dgrad, 1x16 along N, from deq Q_K(w))"] = matmul.dgrad_weight(qw, keys, config, run)[0][0]
  if implementation == "xla" and config.hadamard:
    ops["H.x f32 (before quantization)"] = matmul.wgrad_operand(x2, keys)
  return ops


def operand_rows(dev, cpu):
  """Every operand bit for bit: XLA on the GPU and the kernels on the GPU, each against the CPU."""
  x, w, dy = inputs(np.float32)
  key = jax.random.key(KEY_SEED)
  rows, ok = [], True
  for base, tag in ((NVFP4, ""), (MatmulConfig.nvfp4(hadamard=False), " [no Hadamard]"),
                    (MatmulConfig.nvfp4(rounding_bits="counter"), " [counter bits]"),
                    (FOUR_OVER_SIX, " [4/6]"), (W_1X16_46, " [w 1x16, 4/6]")):
    want = on(cpu, lambda *a, c=base: _operands(*a, c, "xla"), x, w, dy, key)
    for impl in ("xla", "pallas"):
      got = on(dev, lambda *a, c=base, i=impl: _operands(*a, c, i), x, w, dy, key)
      for name in got:
        if tag == " [no Hadamard]" and "H." not in name:
          continue
        if tag in (" [4/6]", " [w 1x16, 4/6]") and name[:2] not in ("x ", "w "):
          continue  # the rule (and the 1x16 w) is on x and w only
        n_bad = sum(bits_differ(u, v) for u, v in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])))
        n = int(np.prod(got[name].shape)) if "f32" in name else int(np.prod(got[name].codes.shape)) * 2
        rows.append((f"{name}{tag}, {impl} on the GPU", f"{n_bad} of {n} differ", "0"))
        ok &= n_bad == 0
  return rows, ok


def matmul_rows(dev, cpu):
  x, w, dy = inputs(np.float32)
  key = jax.random.key(KEY_SEED)
  rows, ok = [], True

  def fwd_bwd(x, w, dy, key, config, implementation="xla"):
    y, vjp = jax.vjp(lambda x, w: nvfp4_matmul(x, w, key=key, config=config,
                                               execution=MatmulExecution(implementation)), x, w)
    return (y, *vjp(dy))

  unq = on(cpu, lambda x, w, dy: fwd_bwd(x, w, dy, None, MatmulConfig.bf16()), x, w, dy)
  for base, name in ((NVFP4, "nvfp4"), (MatmulConfig.nvfp4(hadamard=False), "nvfp4, no Hadamard"),
                     (MatmulConfig.bf16(), "bf16"),
                     (MatmulConfig.nvfp4(x=Operand(terms=2), w=Operand(block=(16, 16), terms=2),
                                         dy_wgrad=Operand(rounding="stochastic", terms=2)), "two-term x, w, H.dy"),
                     (MatmulConfig.nvfp4(x=BF16, dy_dgrad=BF16), "bf16 x and dy (dgrad)"),
                     (FOUR_OVER_SIX, "4/6 x (mae) and w (mse)"),
                     (W_1X16, "w 1x16 along K, dgrad re-quantized along N"),
                     (W_1X16_46, "w 1x16, 4/6 (mse) x and w"),
                     (MatmulConfig.nvfp4(split=Split(("x", "dy"))), "mean split of x and dy"),
                     (MatmulConfig.nvfp4(split=Split(("x", "dy"), method="subspace")), "rank-16 subspace split")):
    config = base
    c = on(cpu, lambda x, w, dy, key: fwd_bwd(x, w, dy, key, config), x, w, dy, key)
    for impl in ("xla", "pallas"):
      g = on(dev, lambda x, w, dy, key, i=impl: fwd_bwd(x, w, dy, key, config, i), x, w, dy, key)
      for out, gv, cv, uv in zip(("y", "dx", "dw"), g, c, unq):
        r, r_unq = rel(gv, cv), rel(gv, uv)
        tol = 1e-4 if (out == "dw" and config.hadamard) else 1e-5
        if config.split.method == "subspace" and config.split.tensors:
          # The range finder's QR rounds differently on the two backends, so a few residual
          # elements round to the neighbouring code: a rounding-level difference, not a drift.
          tol = 1e-2
        quantized = {"y": config.fwd, "dx": config.dgrad, "dw": config.wgrad}[out]
        rows.append((f"{name}, {impl} on the GPU: {out}", f"rel {r:.1e} (bits differ: {bits_differ(gv, cv)})",
                     f"≤ {tol:.0e}; vs unquantized {r_unq:.3f}" + (" (> 1e-2)" if quantized else "")))
        ok &= r <= tol and (r_unq > 1e-2 if quantized else True)
  return rows, ok


def layer_rows(dev, cpu):
  x, _, dy = inputs(jnp.bfloat16)
  key = jax.random.key(KEY_SEED)
  rows, ok = [], True
  with jax.default_device(cpu):
    layers = {"fp4_dense": fp4_dense(K, N, config=NVFP4, rngs=nnx.Rngs(0), use_bias=True),
              "lora_svd_dense r=16": lora_svd_dense(K, N, rank=16, config=NVFP4, rngs=nnx.Rngs(0), svd="exact")}
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
