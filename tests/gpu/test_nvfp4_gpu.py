"""fp4jax.nvfp4 under jax.jit on the GPU equals the CPU bit for bit: quantization really happens.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu -s tests/gpu/test_nvfp4_gpu.py

XLA on the GPU folds float conversion pairs and its division is not correctly rounded
(docs/DESIGN.md, "Bit-exactness on the GPU"): the quantizer, ``fake_quant`` and a jitted
``fake_quant(x) @ fake_quant(w)`` run on the GPU and on the CPU backend of the same process.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _check import bits_differ, devices, on, rel, table

from fp4jax import nvfp4

pytestmark = pytest.mark.gpu

LAYOUTS = [((1, 16), -1), ((1, 16), 0), ((16, 16), -1)]


def inputs():
  rng = np.random.default_rng(2026)
  shape = (512, 1024)
  signs = rng.choice([-1.0, 1.0], shape)
  nan = rng.standard_normal(shape)
  nan[7, 100] = np.nan
  boundary = np.tile(np.linspace(-12, 12, 1024), (512, 1))
  boundary[::2] += 1e-3
  return {
      "normal_f32": rng.standard_normal(shape).astype(np.float32),
      "normal_bf16": rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
      "t2_bf16": rng.standard_t(2, shape).astype(ml_dtypes.bfloat16),
      "lognormal_bf16": (rng.lognormal(0, 3, shape) * signs).astype(ml_dtypes.bfloat16),
      "boundary_f32": boundary.astype(np.float32),
      "tiny_f32": (rng.standard_normal(shape) * 1e-28).astype(np.float32),
      "f16": rng.standard_normal(shape).astype(np.float16),
      "nan_f32": nan.astype(np.float32),
  }


def quantize_rows(dev, cpu, block, axis, rounding):
  """Per input: mismatching bits of ``quantize`` (codes, scales, global scale) and of ``fake_quant``.
  All inputs of one layout and rounding go through one jitted program."""
  key = jax.random.key(11)

  def f(xs):
    kw = dict(block=block, axis=axis, rounding=rounding, key=key)
    return {n: (nvfp4.quantize(x, **kw), nvfp4.fake_quant(x, **kw)) for n, x in xs.items()}

  xs = inputs()
  g, c = on(dev, f, xs), on(cpu, f, xs)
  rows = []
  for name in xs:
    (qg, fg), (qc, fc) = g[name], c[name]
    mism = sum(bits_differ(u, v) for u, v in zip(jax.tree.leaves(qg), jax.tree.leaves(qc)))
    rows.append((f"quantize {name} {block} ax{axis} {rounding}", mism, bits_differ(fg, fc)))
  return rows, all(r[1] == 0 and r[2] == 0 for r in rows)


def grid_operand(rng, rows, k_dim):
  """E2M1 grid values times 2^k per 16-block (with 6·2^k in it, so dscale = 2^k) plus up to 5% noise
  that nearest rounding removes; ``x[0, 0] = 2688`` pins S_enc = S_dec = 1."""
  k = rng.integers(-2, 3, (rows, k_dim // 16, 1)).astype(np.float32)
  v = rng.choice(nvfp4.E2M1_VALUES, (rows, k_dim // 16, 16)) * rng.choice([-1.0, 1.0], (rows, k_dim // 16, 16))
  v = v * (1.0 + 0.05 * rng.uniform(-1, 1, v.shape))
  v[..., 0] = 6.0
  v = (v * 2.0**k).reshape(rows, k_dim).astype(np.float32)
  v[0, :16] = 0.0
  v[0, 0] = 2688.0
  return v


def matmul_rows(dev, cpu):
  """Fused with a matmul: exact sums (any summation order gives the same bits) and general bf16."""
  rng = np.random.default_rng(5)
  x, w = grid_operand(rng, 512, 256), grid_operand(rng, 768, 256)
  mm = lambda x, w: jnp.dot(nvfp4.fake_quant(x), nvfp4.fake_quant(w).T,
                            precision=jax.lax.Precision.HIGHEST)
  g, c = on(dev, mm, x, w), on(cpu, mm, x, w)
  mism = bits_differ(g[1:, 1:], c[1:, 1:])
  rel_unq = rel(g[1:, 1:], (x @ w.T)[1:, 1:])
  rows = [("jit fake_quant(x) @ fake_quant(w).T (exact sums)", mism,
           f"rel. diff to unquantized {rel_unq:.3f} (> 1e-2)")]
  ok = mism == 0 and rel_unq >= 1e-2

  xb = rng.standard_normal((1024, 2048)).astype(ml_dtypes.bfloat16)
  wb = rng.standard_normal((2048, 512)).astype(ml_dtypes.bfloat16)
  mmb = lambda x, w: jnp.dot(nvfp4.fake_quant(x), nvfp4.fake_quant(w, block=(16, 16)),
                             preferred_element_type=jnp.float32)
  g, c = on(dev, mmb, xb, wb), on(cpu, mmb, xb, wb)
  r = rel(g, c)
  unq = on(cpu, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), xb, wb)
  rel_unq = rel(g, unq)
  rows.append(("jit bf16 fake_quant matmul 1024x2048x512", f"rel {r:.1e} (≤ 1e-5)",
               f"rel. diff to unquantized {rel_unq:.3f} (> 1e-2)"))
  return rows, ok and r <= 1e-5 and rel_unq >= 1e-2


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("block,axis", LAYOUTS)
def test_quantize_and_fake_quant_equal_the_cpu(block, axis, rounding):
  rows, ok = quantize_rows(*devices(), block, axis, rounding)
  text = table(("check", "mismatching bits", "fake_quant mismatches"), rows)
  assert ok, text


def test_fake_quant_matmul_is_quantized_and_equals_the_cpu():
  rows, ok = matmul_rows(*devices())
  text = table(("check", "mismatching bits / GPU vs CPU", "note"), rows)
  assert ok, text
