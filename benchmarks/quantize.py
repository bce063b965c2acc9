"""Throughput of the pure-JAX NVFP4 quantizer against a plain device copy, in the same run.

  python benchmarks/quantize.py            # H200: 16384x16384 bf16
  python benchmarks/quantize.py --small    # CPU smoke run (1024x1024, Pallas in interpret mode)

Bytes counted for quantize: 2 B read (bf16) + 0.5 B codes + 1/16 B scales written = 2.5625 B/element
(the global amax pass re-reads the input; that second read is not counted, as in DESIGN.md §4).
Copy bandwidth: the faster of an f32 elementwise pass in XLA and a Pallas (Triton) copy kernel,
bytes read + bytes written.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.timing import environment_line, median_seconds
from fp4jax import nvfp4


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def pallas_copy(x, *, interpret=False, bm=64, bn=1024):
  m, n = x.shape
  bm, bn = min(bm, m), min(bn, n)
  spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
  return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(m // bm, n // bn), in_specs=[spec], out_specs=spec,
                        interpret=interpret)(x)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true")
  args = ap.parse_args()
  n = 1024 if args.small else 16384
  iters = 3 if args.small else 20
  key = jax.random.key(0)
  x = jax.random.normal(key, (n, n), jnp.float32).astype(jnp.bfloat16)
  x32 = x.astype(jnp.float32)
  interpret = jax.devices()[0].platform == "cpu"

  rows = []
  t = median_seconds(jax.jit(lambda a: a + 1.0), x32, iters=iters)
  copy_f32 = 8 * n * n / t
  rows.append(("f32 elementwise copy (XLA)", t, copy_f32))
  pc = jax.jit(functools.partial(pallas_copy, interpret=interpret))
  assert bool(jnp.all(pc(x) == x))
  t = median_seconds(pc, x, iters=iters)
  copy_pl = 4 * n * n / t
  rows.append(("bf16 copy (Pallas kernel)", t, copy_pl))
  copy_bw = max(copy_f32, copy_pl)

  q_bytes = 2.5625 * n * n
  qn = jax.jit(nvfp4.quantize)
  t_q = median_seconds(qn, x, iters=iters)
  rows.append(("quantize 1x16 nearest", t_q, q_bytes / t_q))
  qt = jax.jit(functools.partial(nvfp4.quantize, block=(16, 16)))
  t = median_seconds(qt, x, iters=iters)
  rows.append(("quantize 16x16 nearest", t, (2.5 + 1 / 256) * n * n / t))
  qs = jax.jit(lambda a, k: nvfp4.quantize(a, rounding="stochastic", key=k))
  t = median_seconds(qs, x, key, iters=iters)
  rows.append(("quantize 1x16 stochastic", t, q_bytes / t))
  fq = jax.jit(nvfp4.fake_quant)
  t = median_seconds(fq, x, iters=iters)
  rows.append(("fake_quant (bf16 in/out)", t, 4 * n * n / t))

  print(environment_line())
  print(f"tensor {n}x{n} bfloat16; copy bandwidth = {copy_bw / 1e9:.0f} GB/s (faster of the two copies)\n")
  print("| op | time (ms) | GB/s | fraction of copy bandwidth |\n|---|---|---|---|")
  for name, t, bw in rows:
    print(f"| {name} | {t * 1e3:.3f} | {bw / 1e9:.0f} | {bw / copy_bw:.2f} |")


if __name__ == "__main__":
  main()
