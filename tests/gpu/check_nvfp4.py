"""GPU check for fp4jax.nvfp4 (DESIGN.md §5.1): quantization must really happen under jax.jit.

Runs the quantizer, fake_quant and a jitted fake_quant(x) @ fake_quant(w) on the default backend
(the H200) and compares with the CPU backend in the same process, bit for bit. On a CPU-only machine
it compares CPU with CPU (checks the script). Exit code 1 on any mismatch. All inputs of one layout
and rounding are quantized in one jitted program (12 compiles per device instead of 96).

  python tests/gpu/check_nvfp4.py
"""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from _check import CPU, DEV, on, report
from fp4jax import nvfp4



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


def same_bits(a, b):
  """Number of elements whose bits differ; NaNs count as equal to NaNs (payloads vary by backend)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    if (na != nb).any():
      return int(np.sum(na != nb))
    a, b = np.where(na, 0, a).astype(a.dtype), np.where(nb, 0, b).astype(b.dtype)
  if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16 or a.dtype == ml_dtypes.float8_e4m3fn:
    a = a.view(np.uint8 if a.itemsize == 1 else np.uint16 if a.itemsize == 2 else np.uint32)
    b = b.view(a.dtype)
  return int(np.sum(a != b))


def main():
  print(f"device: {DEV.device_kind} ({DEV.platform}); jax {jax.__version__}")
  rows, failed = [], False
  key = jax.random.key(11)
  layouts = [((1, 16), -1), ((1, 16), 0), ((16, 16), -1)]
  xs = inputs()
  for block, axis in layouts:
    for rounding in ("nearest", "stochastic"):
      # One program per layout and rounding for all inputs (quantize and fake_quant of each): the
      # compiles, not the arithmetic, are what take time here.
      def f(xs, block=block, axis=axis, rounding=rounding):
        kw = dict(block=block, axis=axis, rounding=rounding, key=key)
        return {n: (nvfp4.quantize(x, **kw), nvfp4.fake_quant(x, **kw)) for n, x in xs.items()}

      g, c = on(DEV, f, xs), on(CPU, f, xs)
      for name in xs:
        (qg, fg), (qc, fc) = g[name], c[name]
        mism = sum(same_bits(u, v) for u, v in zip(jax.tree.leaves(qg), jax.tree.leaves(qc)))
        fmism = same_bits(fg, fc)
        rows.append((f"quantize {name} {block} ax{axis} {rounding}", mism, fmism))
        print(*rows[-1], sep=" | ", flush=True)  # progress, in case the run is cut short
        failed |= mism > 0 or fmism > 0

  # Fused with a matmul. Exact variant: 2688 in x[0, 0] and w[0, 0] pins S_enc = S_dec = 1; every
  # other block is E2M1 grid values times 2^k, with 6·2^k in it (so dscale = 2^k), plus up to 5%
  # noise that nearest rounding removes. All products and partial sums of out[1:, 1:] are then
  # exact in f32, so any summation order gives the same bits; the noise proves quantization ran.
  rng = np.random.default_rng(5)

  def grid_operand(rows, k_dim):
    k = rng.integers(-2, 3, (rows, k_dim // 16, 1)).astype(np.float32)
    v = rng.choice(nvfp4.E2M1_VALUES, (rows, k_dim // 16, 16)) * rng.choice([-1.0, 1.0], (rows, k_dim // 16, 16))
    v = v * (1.0 + 0.05 * rng.uniform(-1, 1, v.shape))
    v[..., 0] = 6.0
    v = (v * 2.0**k).reshape(rows, k_dim).astype(np.float32)
    v[0, :16] = 0.0
    v[0, 0] = 2688.0
    return v

  x, w = grid_operand(512, 256), grid_operand(768, 256)
  mm = lambda x, w: jnp.dot(nvfp4.fake_quant(x), nvfp4.fake_quant(w).T,  # noqa: E731
                            precision=jax.lax.Precision.HIGHEST)
  g, c = on(DEV, mm, x, w), on(CPU, mm, x, w)
  mism = same_bits(g[1:, 1:], c[1:, 1:])
  unq = (x @ w.T)[1:, 1:]
  rel_unq = float(np.linalg.norm(g[1:, 1:] - unq) / np.linalg.norm(unq))
  rows.append(("jit fake_quant(x) @ fake_quant(w).T (exact sums)", mism, f"rel. diff to unquantized {rel_unq:.3f}"))
  failed |= mism > 0 or rel_unq < 1e-2

  # General bf16 data: summation order may differ; quantization must still be there.
  xb = rng.standard_normal((1024, 2048)).astype(ml_dtypes.bfloat16)
  wb = rng.standard_normal((2048, 512)).astype(ml_dtypes.bfloat16)
  mmb = lambda x, w: jnp.dot(nvfp4.fake_quant(x), nvfp4.fake_quant(w, block=(16, 16)),  # noqa: E731
                             preferred_element_type=jnp.float32)
  g, c = on(DEV, mmb, xb, wb), on(CPU, mmb, xb, wb)
  rel = float(np.linalg.norm(g - c) / np.linalg.norm(c))
  unq = on(CPU, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), xb, wb)
  rel_unq = float(np.linalg.norm(g - unq) / np.linalg.norm(unq))
  rows.append(("jit bf16 fake_quant matmul 1024x2048x512", f"rel {rel:.1e}", f"rel. diff to unquantized {rel_unq:.3f}"))
  failed |= rel > 1e-5 or rel_unq < 1e-2

  # The trap itself, for the record: a float-cast fake-quant (what NOT to write).
  naive = lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32)  # noqa: E731
  xs = rng.standard_normal((1024, 1024)).astype(np.float32)
  folded = same_bits(on(DEV, naive, xs), xs) == 0
  rows.append(("trap: jit x.astype(f8).astype(f32) returns x unchanged", "yes" if folded else "no", "(info)"))

  return report(("check", "mismatching bits/elements", "fake_quant mismatches / note"), rows,
                not failed)


if __name__ == "__main__":
  sys.exit(main())
