r"""NVFP4 attention (``fp4jax.ops.attention``) against cuDNN and XLA bf16 attention, forward and forward+backward.

  python -m benchmarks.attention                     # GPU: B=8, H=16, D=128, T=2048 and 4096, causal
  python -m benchmarks.attention --seq 2048 --sweep  # GPU: T=2048 rows, then the kernels' launch sweep
  python -m benchmarks.attention --small [--sweep]   # CPU check of the script (interpret mode)

Rows, all in one run on the same inputs (bf16, layout [B, T, H, D]):

- ``nvfp4``: ``nvfp4_attention(..., config=AttentionConfig.nvfp4(), implementation="pallas")``: the
  quantization of q and k (the Pallas quantizer) and the flash kernels, dS quantized per 64x64
  tile, stochastic.
- ``kernels (bf16 dS)``, ``kernels (nvfp4 dS)``: ``fp4jax.kernels.attention`` alone on the bf16
  inputs, dS in bf16 or quantized as in ``nvfp4`` (stochastic, 64x64 tiles): the kernels' cost
  without (and with) the dS quantization, without the quantization of q and k. Each has an
  ``atomic dQ`` row: ``attention_bwd(..., dq_accumulation="atomic")``, one backward kernel that
  adds dQ with atomic adds instead of a second kernel that forms dS again.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)``, no mask
  array (cuDNN's flash path; the script checks that the compiled HLO calls cuDNN's fused attention).
- ``xla``: the same with ``implementation="xla"``.

Forward+backward is ``jax.vjp`` and its pullback applied to a fixed cotangent. Median of ``--iters``
runs after 3 warm-up runs. TF/s counts the causal FLOPs: half of ``4·B·H·T²·D`` forward, 2.5 times
that for the backward (forward+backward: 3.5 times). Prints one markdown table.

``--sweep`` then times the kernels alone at the first T, one launch setting at a time (block_q,
block_k, num_warps, num_stages from ``FWD_SWEEP`` and ``BWD_SWEEP``): ``attention_bwd`` with NVFP4
dS (stochastic) for both ``dq_accumulation`` values, then ``attention_fwd``; the defaults first.
Settings that fail to compile are reported and skipped; the sweep stops after ``--sweep-budget``
seconds. Prints a table of the fastest settings of each kernel against its default.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import time

import jax
import jax.numpy as jnp

from benchmarks.timing import environment_line, median_seconds, require_gpu
from fp4jax.kernels import attention as kernels
from fp4jax.ops.attention import AttentionConfig, nvfp4_attention


def causal_flops(b, h, t, d, backward: bool) -> float:
  fwd = 4.0 * b * h * t * t * d / 2
  return fwd * (3.5 if backward else 1.0)


def peers(interpret: bool, d: int):
  """name -> attention function (q, k, v, key) -> o."""
  impl = "pallas_interpret" if interpret else "pallas"
  fns = {
      "nvfp4": lambda q, k, v, key: nvfp4_attention(q, k, v, causal=True, key=key,
                                                    config=AttentionConfig.nvfp4(),
                                                    implementation=impl),
  }
  for ds_name, ds_rounding in (("bf16", None), ("nvfp4", "stochastic")):
    for suffix, dq in (("", "recompute"), (", atomic dQ", "atomic")):
      fns[f"kernels ({ds_name} dS{suffix})"] = _kernels_only(interpret, d, ds_rounding, dq)
  if not interpret:
    fns["cudnn"] = lambda q, k, v, key: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")
  fns["xla"] = lambda q, k, v, key: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla")
  return fns


def _kernels_only(interpret, d, ds_rounding=None, dq_accumulation="recompute"):
  scale = d**-0.5

  @jax.custom_vjp
  def attn(q, k, v, key):
    return kernels.attention_fwd(q, k, v, causal=True, sm_scale=scale, interpret=interpret)[0]

  def fwd(q, k, v, key):
    o, lse = kernels.attention_fwd(q, k, v, causal=True, sm_scale=scale, interpret=interpret)
    return o, (q, k, v, o, lse, key)

  def bwd(res, do):
    *res, key = res
    grads = kernels.attention_bwd(*res, do, causal=True, sm_scale=scale, ds_rounding=ds_rounding,
                                  key=key, dq_accumulation=dq_accumulation, interpret=interpret)
    return (*grads, None)

  attn.defvjp(fwd, bwd)
  return attn


def check_cudnn_flash(fn, args):
  """The compiled HLO of the cuDNN peer calls cuDNN's fused attention, with no mask operand."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
  fused = [t for t in targets if "cudnn" in t and "fmha" in t.lower()]
  if not fused:
    raise SystemExit(f"cuDNN peer: no fused attention call in the compiled HLO (targets {targets})")
  return fused


# Launch settings of the sweep (the product of the lists; fields of ``kernels.BlockSizes``): on the
# GPU, and on the CPU with --small.
FWD_SWEEP = dict(block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3))
BWD_SWEEP = dict(block_q=(64, 128), block_k=(64, 128), num_warps=(4, 8), num_stages=(1, 2))
SMALL_SWEEP = dict(block_q=(64,), block_k=(64, 128), num_warps=(4,), num_stages=(2,))


def sweep(q, k, v, do, key, *, interpret, iters, budget_s, show=6):
  """Time the kernels alone per launch setting (None: the kernel's default) and print the table."""
  scale = q.shape[-1]**-0.5
  o, lse = jax.jit(functools.partial(kernels.attention_fwd, causal=True, sm_scale=scale,
                                     interpret=interpret))(q, k, v)
  grids = (SMALL_SWEEP, SMALL_SWEEP) if interpret else (BWD_SWEEP, FWD_SWEEP)
  jobs = []  # (kernel, settings, jitted fn, args); bwd interleaves both dQ schemes per setting
  for settings in [dict.fromkeys(BWD_SWEEP)] + _settings(grids[0]):
    for dq in kernels.DQ_ACCUMULATIONS:
      fn = functools.partial(_bwd, ds_rounding="stochastic", dq_accumulation=dq, interpret=interpret,
                             block_sizes=kernels.BlockSizes(**settings))
      jobs.append((f"bwd nvfp4 dS, {dq} dQ", settings, jax.jit(fn), (q, k, v, o, lse, do, key)))
  for settings in [dict.fromkeys(FWD_SWEEP)] + _settings(grids[1]):
    fn = functools.partial(kernels.attention_fwd, causal=True, sm_scale=scale, interpret=interpret,
                           block_sizes=kernels.BlockSizes(**settings))
    jobs.append(("fwd", settings, jax.jit(fn), (q, k, v)))
  results, start = [], time.perf_counter()
  for i, (name, settings, fn, args) in enumerate(jobs):
    if time.perf_counter() - start > budget_s:
      print(f"sweep: budget of {budget_s:.0f} s spent, {len(jobs) - i} settings not timed")
      break
    label = ", ".join(f"{a}={b}" for a, b in settings.items()) if any(settings.values()) else "default"
    try:
      t = median_seconds(fn, *args, iters=iters)
    except Exception as e:  # a setting the compiler refuses (shared memory, registers): report it
      print(f"sweep {name} [{label}]: failed: {type(e).__name__}: {str(e)[:200]!r}", flush=True)
      continue
    results.append((name, settings, t))
    print(f"sweep {name} [{label}]: {t * 1e3:.3f} ms", flush=True)

  print("\n| kernel | block_q | block_k | warps | stages | ms | / default |")
  print("|---|---|---|---|---|---|---|")
  for name in dict.fromkeys(r[0] for r in results):
    rows = [r for r in results if r[0] == name]
    default = next((t for n, st, t in rows if not any(st.values())), None)
    fastest = sorted(rows, key=lambda r: r[2])[:show]
    fastest += [r for r in rows if not any(r[1].values()) and r not in fastest]  # the default, always
    for _, st, t in fastest:
      cells = " | ".join("default" if st[a] is None else str(st[a])
                         for a in ("block_q", "block_k", "num_warps", "num_stages"))
      ratio = f"{t / default:.2f}" if default else "-"
      print(f"| {name} | {cells} | {t * 1e3:.3f} | {ratio} |")


def _bwd(q, k, v, o, lse, do, key, **kwargs):
  return kernels.attention_bwd(q, k, v, o, lse, do, causal=True, sm_scale=q.shape[-1]**-0.5, key=key,
                               **kwargs)


def _settings(grid):
  return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="CPU check: tiny shapes, interpret mode")
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument("--seq", type=int, nargs="*", default=None, help="sequence lengths T")
  parser.add_argument("--sweep", action="store_true",
                      help="then time the kernels' launch settings at the first T")
  parser.add_argument("--sweep-budget", type=float, default=360.0,
                      help="seconds after which the sweep stops (default 360)")
  parser.add_argument("--no-rows", action="store_true", help="skip the rows (with --sweep)")
  args = parser.parse_args(argv)
  require_gpu(parser, args.small, "--small")
  if args.small:
    b, h, d, seqs, iters = 1, 2, 64, args.seq or [128], args.iters or 2
  else:
    b, h, d, seqs, iters = 8, 16, 128, args.seq or [2048, 4096], args.iters or 20
  print(environment_line())
  fns = {} if args.no_rows else peers(args.small, d)
  rows = []
  for t in seqs if fns else []:
    q, k, v, do, step_key = _inputs(b, t, h, d)
    for name, fn in fns.items():
      if name == "cudnn":
        print(f"T={t} cudnn calls: {check_cudnn_flash(functools.partial(fn, key=None), (q, k, v))}")
      fwd = jax.jit(fn)

      @jax.jit
      def fwd_bwd(q, k, v, key, do, fn=fn):
        o, pull = jax.vjp(lambda q, k, v: fn(q, k, v, key), q, k, v)
        return o, pull(do)

      times = (median_seconds(fwd, q, k, v, step_key, iters=iters),
               median_seconds(fwd_bwd, q, k, v, step_key, do, iters=iters))
      rows.append((t, name, times))
      print(f"T={t} {name}: fwd {times[0] * 1e3:.3f} ms, fwd+bwd {times[1] * 1e3:.3f} ms", flush=True)

  if rows:
    print(f"\nB={b}, H={h}, D={d}, causal, bf16 inputs; median of {iters}\n")
    print("| T | attention | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | fwd+bwd / cudnn |")
    print("|---|---|---|---|---|---|---|")
  for t, name, (tf, tfb) in rows:
    cudnn = [x for tt, n, x in rows if tt == t and n == "cudnn"]
    ratio = f"{tfb / cudnn[0][1]:.2f}" if cudnn else "-"
    print(f"| {t} | {name} | {tf * 1e3:.3f} | {causal_flops(b, h, t, d, False) / tf / 1e12:.1f} | "
          f"{tfb * 1e3:.3f} | {causal_flops(b, h, t, d, True) / tfb / 1e12:.1f} | {ratio} |")

  if args.sweep:
    print(f"\nsweep: B={b}, H={h}, D={d}, T={seqs[0]}, causal; median of {iters}", flush=True)
    q, k, v, do, step_key = _inputs(b, seqs[0], h, d)
    sweep(q, k, v, do, step_key, interpret=args.small, iters=iters, budget_s=args.sweep_budget)


def _inputs(b, t, h, d):
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys[:4])
  return q, k, v, do, keys[4]


if __name__ == "__main__":
  main()
