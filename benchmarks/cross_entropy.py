r"""Fused cross-entropy rows (``fp4jax.kernels.cross_entropy``) against XLA, on one chunk of logits.

  python -m benchmarks.cross_entropy                  # GPU: C=8192 rows, V=32768 (the 125m chunk)
  python -m benchmarks.cross_entropy --vocab=50304    # GPT-2's padded vocabulary
  python -m benchmarks.cross_entropy --tiny           # CPU check of the script (interpret mode, seconds)

Times ``(lse, tgt_logit, dl) = f(logits, tgt, w)`` for float32 logits (normal, std 4), bf16 ``dl``:
the XLA path (``softmax_xent_rows_reference`` jitted: the peer) and the kernel over a few (rows per
program, tile width, warps), the default first. Median of ``--iters`` runs after 3 warm-up runs,
each ended by ``block_until_ready``. GB/s counts 4 B/element read and 2 B/element written (the
kernel reads the logits twice; the second read is not counted). "floor" is
``logits.astype(bf16)`` in XLA: the same bytes with no arithmetic (a reference point, not a bound).

Each kernel is checked against the XLA path, on the device: max |Δlse|, max |Δtgt_logit|, the dl
elements that differ and the largest difference in bf16 ulps (magnitudes below 2**-120 taken as 0).
Exits 1 if a kernel differs beyond 1e-5 relative in lse, at all in tgt_logit, or by more than 1 ulp
in dl, or if the default configuration fails to compile. Prints one markdown table last.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.timing import environment_line, median_seconds, require_gpu
from fp4jax.kernels.cross_entropy import BlockSizes, softmax_xent_rows, softmax_xent_rows_reference


def bf16_ulp_distance(a, b):
  """|a - b| in bf16 ulps, counting across zero; magnitudes below 2**-120 are taken as zero
  (subnormal exp results may be flushed before the weight scales them)."""
  def ordered(x):
    x = x.astype(jnp.float32)
    x = jnp.where(jnp.abs(x) < 2.0**-120, 0.0, x).astype(jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
    return jnp.where(bits & 0x8000, -(bits & 0x7FFF), bits)
  return jnp.abs(ordered(a) - ordered(b))


@jax.jit
def _differences(out, ref):
  """On the device (no 0.5 GB host copies): max |d lse|, max |d tgt_logit|, dl ulp statistics."""
  (lse, tl, dl), (lse_r, tl_r, dl_r) = out, ref
  ulps = bf16_ulp_distance(dl, dl_r)
  return dict(d_lse=jnp.max(jnp.abs(lse - lse_r)), lse_scale=jnp.max(jnp.abs(lse_r)),
              d_tl=jnp.max(jnp.abs(tl - tl_r)), n_diff=jnp.count_nonzero(ulps), max_ulp=jnp.max(ulps),
              finite=jnp.all(jnp.isfinite(lse)))


def configs(tiny):
  """(rows_per_program, num_warps, tile_v) of ``BlockSizes``; the first is the default."""
  if tiny:
    return [(None, None, None), (2, 4, 256)]
  return [(None, None, None)] + [(1, 8, 2048), (1, 8, 8192), (1, 16, 8192), (2, 8, 4096),
                                 (4, 8, 2048)]


def check(out, ref):
  d = {k: v.item() for k, v in _differences(out, ref).items()}
  ok = (d["d_lse"] <= 1e-5 * max(1.0, d["lse_scale"]) and d["d_tl"] == 0.0 and d["max_ulp"] <= 1
        and d["finite"])
  return dict(d_lse=d["d_lse"], d_tl=d["d_tl"], n_diff=d["n_diff"], max_ulp=d["max_ulp"], ok=bool(ok))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=8192, help="C, the rows (tokens) of one chunk")
  ap.add_argument("--vocab", type=int, default=32768, help="V")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--tiny", action="store_true", help="C=64, V=1000 in interpret mode (CPU)")
  args = ap.parse_args(argv)
  require_gpu(ap, args.tiny, "--tiny")
  c, v = (64, 1000) if args.tiny else (args.rows, args.vocab)
  iters = 3 if args.tiny else args.iters
  interpret = args.tiny or jax.default_backend() == "cpu"
  print(environment_line(), flush=True)
  print(f"C={c} V={v}, interpret={interpret}", flush=True)

  k1, k2 = jax.random.split(jax.random.key(0))
  logits = jax.random.normal(k1, (c, v), jnp.float32) * 4.0
  tgt = jax.random.randint(k2, (c,), 0, v, jnp.int32).at[0].set(0).at[1].set(v - 1)
  w = jnp.ones((c,), jnp.float32).at[-(c // 20 + 1):].set(0.0)  # a padded tail, as in loss.py
  gbytes = c * v * 6 / 1e9

  xla = jax.jit(softmax_xent_rows_reference)
  ref = jax.block_until_ready(xla(logits, tgt, w))
  t_xla = median_seconds(xla, logits, tgt, w, iters=iters)
  t_floor = median_seconds(jax.jit(lambda x: x.astype(jnp.bfloat16)), logits, iters=iters)
  rows = [("XLA (reference, jitted)", t_xla, None), ("floor: logits.astype(bf16)", t_floor, None)]
  failed = []
  for r, nw, tile in configs(args.tiny):
    name = f"kernel R={r or 'def'} warps={nw or 'def'} tile={tile or 'def'}"
    block_sizes = BlockSizes(rows_per_program=r, num_warps=nw, tile_v=tile)
    fn = jax.jit(functools.partial(softmax_xent_rows, block_sizes=block_sizes, interpret=interpret))
    try:
      out = jax.block_until_ready(fn(logits, tgt, w))
    except Exception as e:  # a sweep point the compiler refuses: report it, keep going
      print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      rows.append((name, None, dict(error=type(e).__name__)))
      if r is None:
        failed.append(name)
      continue
    res = check(out, ref)
    del out
    t = median_seconds(fn, logits, tgt, w, iters=iters)
    print(f"  {name}: {t * 1e3:.3f} ms, {res}", flush=True)
    rows.append((name, t, res))
    if not res["ok"]:
      failed.append(name)

  print(f"\n### Cross-entropy rows, C={c} V={v} f32 logits -> bf16 dl, {jax.devices()[0].device_kind}"
        f"{' (interpret mode)' if interpret else ''}\n")
  print("| path | ms | GB/s (6 B/elt) | vs XLA | max abs d lse | max abs d tgt_logit | dl differing "
        "| max ulp | ok |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, t, res in rows:
    if t is None:
      print(f"| {name} | failed ({res['error']}) | | | | | | | no |")
      continue
    cols = f"| {name} | {t * 1e3:.3f} | {gbytes / t:.4g} | {t / t_xla:.2f}x |"
    if res is None:
      print(cols + " | | | | |")
    else:
      print(cols + f" {res['d_lse']:.2e} | {res['d_tl']:.1e} | {res['n_diff']} / {c * v} | {res['max_ulp']} "
                   f"| {'yes' if res['ok'] else 'NO'} |")
  if failed:
    print(f"\nFAILED: {', '.join(failed)}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
