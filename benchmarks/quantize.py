"""NVFP4 quantization: the Pallas kernels (fp4jax.kernels.nvfp4_quantize) and the native Triton kernel
(benchmarks.triton_quantize, through jax_triton; GPU only, and only where jax_triton
imports) against the jitted nvfp4.quantize and a device copy, in the same run.

  python -m benchmarks.quantize                 # GPU: 16384x16384 bf16
  python -m benchmarks.quantize --sweep         # also the kernels' tilings (SWEEP x SWEEP_ROWS)
  python -m benchmarks.quantize --small         # CPU smoke run (256x256, kernels in interpret mode)
  python -m benchmarks.quantize --shape=65536,768   # another (M, K) bf16 tensor: a model's activation

Each kernel row's last column counts the elements of its output (codes, scale bytes, global scale and
the decoded operand where it writes one) whose bits differ from nvfp4.quantize of the same tensor
(``quantize_reference``: with the same random bits and Hadamard transform), computed by XLA on the
same device (nvfp4.quantize is the same bits on the GPU as on the CPU: tests/gpu/test_nvfp4_gpu.py).
Any number but 0 is a wrong kernel.

Bytes counted for a quantize: 2 B read (bf16) + 0.5 B codes + 1/16 B scales written per element
(+ 2 B with the decoded bf16 operand); the amax pass's second read of the input is not counted.
Copy bandwidth: the faster of an f32 elementwise pass in XLA and a Pallas (Triton) copy kernel, bytes
read + bytes written.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.timing import environment_line, median_seconds, require_gpu
from fp4jax import nvfp4
from fp4jax.kernels import nvfp4_quantize as kq
from benchmarks import triton_quantize as kt


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def pallas_copy(x, *, interpret=False, bm=64, bn=1024):
  """A bf16 copy in (bm, bn) tiles, each the largest power of two up to ``bm``/``bn`` that divides
  its axis."""
  m, n = x.shape
  bm, bn = min(bm, m & -m), min(bn, n & -n)
  spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
  return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(m // bm, n // bn), in_specs=[spec], out_specs=spec,
                        interpret=interpret)(x)


KERNEL_ROWS = [
    # (name, arguments of kq.quantize; "hadamard" stands for a hadamard_key)
    ("1x16 nearest", dict()),
    ("1x16 nearest + decoded", dict(decoded=True)),
    ("16x16 nearest", dict(block=(16, 16))),
    ("16x16 nearest + decoded", dict(block=(16, 16), decoded=True)),
    ("1x16 stochastic (jax.random bits)", dict(rounding="stochastic")),
    ("1x16 stochastic (counter hash)", dict(rounding="stochastic", bit_source="counter")),
    ("1x16 stochastic (counter) + decoded", dict(rounding="stochastic", bit_source="counter",
                                                 decoded=True)),
    ("axis 0, Hadamard, nearest", dict(axis=0, hadamard=True)),
    ("axis 0, Hadamard, nearest + decoded", dict(axis=0, hadamard=True, decoded=True)),
    ("axis 0, Hadamard, stochastic (jax.random bits)", dict(axis=0, hadamard=True, rounding="stochastic")),
    ("axis 0, Hadamard, stochastic (counter) + decoded", dict(axis=0, hadamard=True, rounding="stochastic",
                                                             bit_source="counter", decoded=True)),
    # The first pass as an XLA reduction instead of a kernel (kq.quantize(amax="xla")).
    ("1x16 nearest + decoded, amax in XLA", dict(decoded=True, amax="xla")),
    ("16x16 nearest, amax in XLA", dict(block=(16, 16), amax="xla")),
    ("axis 0, Hadamard, stochastic (counter) + decoded, amax in XLA",
     dict(axis=0, hadamard=True, rounding="stochastic", bit_source="counter", decoded=True, amax="xla")),
    # Four over Six (scale_rule): two candidates' codes and block errors per block.
    ("1x16 nearest, 4over6_mae", dict(scale_rule="4over6_mae")),
    ("1x16 nearest, 4over6_mse + decoded", dict(scale_rule="4over6_mse", decoded=True)),
    ("1x16 nearest, 4over6_mae + decoded, amax in XLA", dict(scale_rule="4over6_mae", decoded=True, amax="xla")),
    ("16x16 nearest, 4over6_mse + decoded", dict(block=(16, 16), scale_rule="4over6_mse", decoded=True)),
    ("axis 0, Hadamard, nearest, 4over6_mae + decoded", dict(axis=0, hadamard=True, scale_rule="4over6_mae",
                                                           decoded=True)),
]
# --sweep: each tiling on the rows below (quantize_elements, num_warps, amax_elements, amax_num_warps;
# the first is BlockSizes' default).
SWEEP = [kq.BlockSizes(quantize_elements=q, num_warps=w, amax_elements=a, amax_num_warps=aw)
         for q, w, a, aw in ((4096, 4, 16384, 8), (2048, 4, 16384, 8), (4096, 8, 16384, 8),
                             (8192, 4, 16384, 8), (8192, 8, 16384, 8), (16384, 8, 16384, 8),
                             (4096, 4, 32768, 8), (4096, 4, 65536, 16))]
SWEEP_ROWS = [
    ("1x16 nearest", dict()),
    ("1x16 nearest + decoded", dict(decoded=True)),
    ("1x16 stochastic (counter hash)", dict(rounding="stochastic", bit_source="counter")),
    ("1x16 nearest, amax in XLA", dict(amax="xla")),
]


TRITON_ROWS = [("1x16 nearest", False), ("1x16 nearest + decoded", True)]
TRITON_SWEEP = [kt.BlockSizes(block_rows=r, block_k=k, num_warps=w)
                for r, k, w in ((16, 256, 4), (8, 512, 4), (32, 256, 4), (32, 256, 8), (16, 1024, 8),
                                (64, 128, 4), (8, 1024, 4))]


def _reference_fn(kw):
  """nvfp4.quantize (kq.quantize_reference) of a kernel row's arguments, with the decoded operand."""
  kw = {k: v for k, v in kw.items() if k not in ("amax", "decoded")}
  hadamard = kw.pop("hadamard", False)
  stochastic = kw.get("rounding") == "stochastic"

  def f(x, key, hkey):
    return kq.quantize_reference(x, key=key if stochastic else None, hadamard_key=hkey if hadamard else None,
                                 decoded=True, **kw)
  return jax.jit(f)


@jax.jit
def _mismatches(got, want):
  """Elements whose bits differ between a kernel's (tensor[, decoded]) and the reference's; NaN == NaN."""
  gt, gd = got if isinstance(got, tuple) else (got, None)
  wt, wd = want
  pairs = [(gt.codes, wt.codes), (lax.bitcast_convert_type(gt.scales, jnp.uint8),
                                  lax.bitcast_convert_type(wt.scales, jnp.uint8))]
  if gd is not None:
    pairs.append((lax.bitcast_convert_type(gd, jnp.uint16), lax.bitcast_convert_type(wd, jnp.uint16)))
  n = sum(jnp.sum(a != b) for a, b in pairs)
  g, w = gt.global_scale, wt.global_scale
  same = (lax.bitcast_convert_type(g, jnp.uint32) == lax.bitcast_convert_type(w, jnp.uint32)) | (
      jnp.isnan(g) & jnp.isnan(w))
  return n + jnp.sum(~same)


def _kernel_fn(kw, interpret, block_sizes=kq.BlockSizes()):
  kw = dict(kw)
  hadamard = kw.pop("hadamard", False)
  stochastic = kw.get("rounding") == "stochastic"

  def f(x, key, hkey):
    return kq.quantize(x, key=key if stochastic else None, hadamard_key=hkey if hadamard else None,
                       block_sizes=block_sizes, interpret=interpret, **kw)
  return jax.jit(f)


def shape_arg(text: str) -> tuple[int, int]:
  """``"M,K"`` as ``(M, K)``: positive multiples of 16 (every layout of the kernels applies)."""
  try:
    m, k = (int(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--shape takes M,K (two integers), got {text!r}") from None
  if m <= 0 or k <= 0 or m % 16 or k % 16:
    raise argparse.ArgumentTypeError(f"--shape: M and K must be positive multiples of 16, got {m},{k}")
  return m, k


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true", help="CPU smoke run: 256x256, interpret mode")
  ap.add_argument("--shape", type=shape_arg, default=None,
                  help="M,K of the bf16 tensor (default 16384,16384; 256,256 with --small)")
  ap.add_argument("--sweep", action="store_true", help="also time the kernels' tilings (SWEEP x SWEEP_ROWS)")
  ap.add_argument("--iters", type=int, default=None)
  args = ap.parse_args(argv)
  require_gpu(ap, args.small, "--small")
  m, k = args.shape or ((256, 256) if args.small else (16384, 16384))
  size = m * k
  iters = args.iters or (2 if args.small else 30)
  key, hkey = jax.random.key(0), jax.random.key(1)
  x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
  x32 = x.astype(jnp.float32)
  interpret = jax.devices()[0].platform == "cpu"
  time = functools.partial(median_seconds, iters=iters, warmup=1 if args.small else 3)

  rows = []
  t = time(jax.jit(lambda a: a + 1.0), x32)
  copy_f32 = 8 * size / t
  rows.append(("copy: f32 elementwise (XLA)", t, copy_f32))
  pc = jax.jit(functools.partial(pallas_copy, interpret=interpret))
  t = time(pc, x)
  copy_pl = 4 * size / t
  rows.append(("copy: bf16 (Pallas kernel)", t, copy_pl))
  copy_bw = max(copy_f32, copy_pl)
  t = time(jax.jit(kq.amax_bits), x)
  rows.append(("amax alone: one XLA reduction (read only)", t, 2 * size / t))

  q_bytes = (2 + 0.5 + 1 / 16) * size
  for name, fn, extra in (
      ("nvfp4.quantize 1x16 nearest", lambda a, k: nvfp4.quantize(a), 0),
      ("nvfp4.quantize 16x16 nearest", lambda a, k: nvfp4.quantize(a, block=(16, 16)), 0),
      ("nvfp4.quantize 1x16 stochastic", lambda a, k: nvfp4.quantize(a, rounding="stochastic", key=k), 0),
      ("nvfp4.quantize 1x16 nearest, 4over6_mae", lambda a, k: nvfp4.quantize(a, scale_rule="4over6_mae"), 0),
  ):
    t = time(jax.jit(fn), x, key)
    rows.append((f"XLA: {name}", t, (q_bytes + extra) / t))

  for name, kw in KERNEL_ROWS:
    fn = _kernel_fn(kw, interpret)
    t = time(fn, x, key, hkey)
    bad = int(_mismatches(fn(x, key, hkey), _reference_fn(kw)(x, key, hkey)))
    rows.append((f"kernel: {name}", t, (q_bytes + (2 * size if kw.get("decoded") else 0)) / t, bad))

  if args.sweep:
    for name, kw in SWEEP_ROWS:
      for bs in SWEEP:
        if kw.get("amax") == "xla" and bs.amax_elements != SWEEP[0].amax_elements:
          continue  # the amax tiling does not apply
        fn = _kernel_fn(kw, interpret, bs)
        t = time(fn, x, key, hkey)
        bad = int(_mismatches(fn(x, key, hkey), _reference_fn(kw)(x, key, hkey)))
        tiling = (f"q={bs.quantize_elements}/{bs.num_warps}w amax={bs.amax_elements}/"
                  f"{bs.amax_num_warps}w")
        rows.append((f"kernel sweep {name} {tiling}", t,
                     (q_bytes + (2 * size if kw.get("decoded") else 0)) / t, bad))

  # The native Triton kernel (jax_triton): 1x16 nearest along the last axis, on the GPU.
  triton_ok, why = kt.available()
  if interpret:
    triton_note = "native Triton kernel (benchmarks.triton_quantize): not run (CPU run; it runs on the GPU only)"
  elif not triton_ok:
    triton_note = f"native Triton kernel (benchmarks.triton_quantize): not run: {why}"
  else:
    triton_note = "native Triton kernel (benchmarks.triton_quantize): rows 'triton:'"
    variants = [(name, dec, kt.BlockSizes()) for name, dec in TRITON_ROWS]
    if args.sweep:
      variants += [(f"sweep 1x16 nearest {bs}", False, bs) for bs in TRITON_SWEEP]
    for name, dec, bs in variants:
      fn = jax.jit(functools.partial(kt.quantize, decoded=dec, block_sizes=bs))
      t = time(fn, x)
      bad = int(_mismatches(fn(x), _reference_fn({})(x, key, hkey)))
      rows.append((f"triton: {name}", t, (q_bytes + (2 * size if dec else 0)) / t, bad))

  print(environment_line())
  print(f"tensor {m}x{k} bfloat16; copy bandwidth = {copy_bw / 1e9:.0f} GB/s (faster of the two copies); "
        f"median of {iters}\n")
  print(triton_note + "\n")
  print("| op | time (ms) | GB/s | fraction of copy bandwidth | elements ≠ nvfp4.quantize |\n|---|---|---|---|---|")
  for name, t, bw, *bad in rows:
    check = "—" if not bad else (str(bad[0]) if bad[0] == 0 else f"**{bad[0]} MISMATCHED**")
    print(f"| {name} | {t * 1e3:.3f} | {bw / 1e9:.0f} | {bw / copy_bw:.2f} | {check} |")
  mismatched = [r[0] for r in rows if len(r) > 3 and r[3]]
  if mismatched:
    print(f"\nBIT MISMATCH against nvfp4.quantize: {', '.join(mismatched)}")
    raise SystemExit(1)


if __name__ == "__main__":
  main()
