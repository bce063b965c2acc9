"""NVFP4 quantization: the Pallas kernels (fp4jax.kernels.nvfp4_quantize) against the jitted
nvfp4.quantize and a device copy, in the same run.

  python -m benchmarks.quantize                 # GPU: 16384x16384 bf16
  python -m benchmarks.quantize --sweep         # also the kernels' tilings (SWEEP x SWEEP_ROWS)
  python -m benchmarks.quantize --small         # CPU smoke run (256x256, kernels in interpret mode)

Bytes counted for a quantize: 2 B read (bf16) + 0.5 B codes + 1/16 B scales written per element
(+ 2 B with the decoded bf16 operand); the amax pass's second read of the input is not counted.
Copy bandwidth: the faster of an f32 elementwise pass in XLA and a Pallas (Triton) copy kernel, bytes
read + bytes written.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.timing import environment_line, median_seconds
from fp4jax import nvfp4
from fp4jax.kernels import nvfp4_quantize as kq


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def pallas_copy(x, *, interpret=False, bm=64, bn=1024):
  m, n = x.shape
  bm, bn = min(bm, m), min(bn, n)
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


def _kernel_fn(kw, interpret, block_sizes=kq.BlockSizes()):
  kw = dict(kw)
  hadamard = kw.pop("hadamard", False)
  stochastic = kw.get("rounding") == "stochastic"

  def f(x, key, hkey):
    return kq.quantize(x, key=key if stochastic else None, hadamard_key=hkey if hadamard else None,
                       block_sizes=block_sizes, interpret=interpret, **kw)
  return jax.jit(f)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true", help="CPU smoke run: 256x256, interpret mode")
  ap.add_argument("--sweep", action="store_true", help="also time the kernels' tilings (SWEEP x SWEEP_ROWS)")
  ap.add_argument("--iters", type=int, default=None)
  args = ap.parse_args()
  n = 256 if args.small else 16384
  iters = args.iters or (2 if args.small else 30)
  key, hkey = jax.random.key(0), jax.random.key(1)
  x = jax.random.normal(key, (n, n), jnp.float32).astype(jnp.bfloat16)
  x32 = x.astype(jnp.float32)
  interpret = jax.devices()[0].platform == "cpu"
  time = functools.partial(median_seconds, iters=iters, warmup=1 if args.small else 3)

  rows = []
  t = time(jax.jit(lambda a: a + 1.0), x32)
  copy_f32 = 8 * n * n / t
  rows.append(("copy: f32 elementwise (XLA)", t, copy_f32))
  pc = jax.jit(functools.partial(pallas_copy, interpret=interpret))
  t = time(pc, x)
  copy_pl = 4 * n * n / t
  rows.append(("copy: bf16 (Pallas kernel)", t, copy_pl))
  copy_bw = max(copy_f32, copy_pl)
  t = time(jax.jit(kq.amax_bits), x)
  rows.append(("amax alone: one XLA reduction (read only)", t, 2 * n * n / t))

  q_bytes = (2 + 0.5 + 1 / 16) * n * n
  for name, fn, extra in (
      ("nvfp4.quantize 1x16 nearest", lambda a, k: nvfp4.quantize(a), 0),
      ("nvfp4.quantize 16x16 nearest", lambda a, k: nvfp4.quantize(a, block=(16, 16)), 0),
      ("nvfp4.quantize 1x16 stochastic", lambda a, k: nvfp4.quantize(a, rounding="stochastic", key=k), 0),
  ):
    t = time(jax.jit(fn), x, key)
    rows.append((f"XLA: {name}", t, (q_bytes + extra) / t))

  for name, kw in KERNEL_ROWS:
    t = time(_kernel_fn(kw, interpret), x, key, hkey)
    rows.append((f"kernel: {name}", t, (q_bytes + (2 * n * n if kw.get("decoded") else 0)) / t))

  if args.sweep:
    for name, kw in SWEEP_ROWS:
      for bs in SWEEP:
        if kw.get("amax") == "xla" and bs.amax_elements != SWEEP[0].amax_elements:
          continue  # the amax tiling does not apply
        t = time(_kernel_fn(kw, interpret, bs), x, key, hkey)
        tiling = (f"q={bs.quantize_elements}/{bs.num_warps}w amax={bs.amax_elements}/"
                  f"{bs.amax_num_warps}w")
        rows.append((f"kernel sweep {name} {tiling}", t,
                     (q_bytes + (2 * n * n if kw.get("decoded") else 0)) / t))

  print(environment_line())
  print(f"tensor {n}x{n} bfloat16; copy bandwidth = {copy_bw / 1e9:.0f} GB/s (faster of the two copies); "
        f"median of {iters}\n")
  print("| op | time (ms) | GB/s | fraction of copy bandwidth |\n|---|---|---|---|")
  for name, t, bw in rows:
    print(f"| {name} | {t * 1e3:.3f} | {bw / 1e9:.0f} | {bw / copy_bw:.2f} |")


if __name__ == "__main__":
  main()
