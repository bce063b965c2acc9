r"""NVFP4 attention (``fp4jax.ops.attention``) against cuDNN and XLA bf16 attention, forward and forward+backward.

  python -m benchmarks.attention            # GPU: B=8, H=16, D=128, T=2048 and 4096, causal
  python -m benchmarks.attention --small    # CPU check of the script (interpret mode, seconds)

Rows, all in one run on the same inputs (bf16, layout [B, T, H, D]):

- ``nvfp4``: ``nvfp4_attention(..., config=AttentionConfig.nvfp4(), implementation="pallas")``: the
  quantization of q and k (the Pallas quantizer) and the flash kernels, dS quantized per 64x64
  tile, stochastic.
- ``kernels (bf16 dS)``: ``fp4jax.kernels.attention`` alone on the bf16 inputs, dS in bf16: the
  kernels' cost without quantization.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)``, no mask
  array (cuDNN's flash path; the script checks that the compiled HLO calls cuDNN's fused attention).
- ``xla``: the same with ``implementation="xla"``.

Forward+backward is ``jax.vjp`` and its pullback applied to a fixed cotangent. Median of ``--iters``
runs after 3 warm-up runs. TF/s counts the causal FLOPs: half of ``4·B·H·T²·D`` forward, 2.5 times
that for the backward (forward+backward: 3.5 times). Prints one markdown table last.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp

from benchmarks.timing import environment_line, median_seconds
from fp4jax.kernels import attention as kernels
from fp4jax.ops.attention import AttentionConfig, nvfp4_attention


def causal_flops(b, h, t, d, backward: bool) -> float:
  fwd = 4.0 * b * h * t * t * d / 2
  return fwd * (3.5 if backward else 1.0)


def peers(interpret: bool, d: int):
  """name -> attention function (q, k, v) -> o."""
  impl = "pallas_interpret" if interpret else "pallas"
  fns = {
      "nvfp4": lambda q, k, v, key: nvfp4_attention(q, k, v, causal=True, key=key,
                                                    config=AttentionConfig.nvfp4(),
                                                    implementation=impl),
      "kernels (bf16 dS)": _kernels_only(interpret, d),
  }
  if not interpret:
    fns["cudnn"] = lambda q, k, v, key: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")
  fns["xla"] = lambda q, k, v, key: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla")
  return fns


def _kernels_only(interpret, d):
  scale = d**-0.5

  @jax.custom_vjp
  def attn(q, k, v):
    return kernels.attention_fwd(q, k, v, causal=True, sm_scale=scale, interpret=interpret)[0]

  def fwd(q, k, v):
    o, lse = kernels.attention_fwd(q, k, v, causal=True, sm_scale=scale, interpret=interpret)
    return o, (q, k, v, o, lse)

  def bwd(res, do):
    return kernels.attention_bwd(*res, do, causal=True, sm_scale=scale, interpret=interpret)

  attn.defvjp(fwd, bwd)
  return lambda q, k, v, key: attn(q, k, v)


def check_cudnn_flash(fn, args):
  """The compiled HLO of the cuDNN peer calls cuDNN's fused attention, with no mask operand."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
  fused = [t for t in targets if "cudnn" in t and "fmha" in t.lower()]
  if not fused:
    raise SystemExit(f"cuDNN peer: no fused attention call in the compiled HLO (targets {targets})")
  return fused


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="CPU check: tiny shapes, interpret mode")
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument("--seq", type=int, nargs="*", default=None, help="sequence lengths T")
  args = parser.parse_args(argv)
  if args.small:
    b, h, d, seqs, iters = 1, 2, 64, args.seq or [128], args.iters or 2
  else:
    b, h, d, seqs, iters = 8, 16, 128, args.seq or [2048, 4096], args.iters or 20
  print(environment_line())
  fns = peers(args.small, d)
  rows = []
  for t in seqs:
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in keys[:4])
    step_key = keys[4]
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

  print(f"\nB={b}, H={h}, D={d}, causal, bf16 inputs; median of {iters}\n")
  print("| T | attention | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | fwd+bwd / cudnn |")
  print("|---|---|---|---|---|---|---|")
  for t, name, (tf, tfb) in rows:
    cudnn = [x for tt, n, x in rows if tt == t and n == "cudnn"]
    ratio = f"{tfb / cudnn[0][1]:.2f}" if cudnn else "-"
    print(f"| {t} | {name} | {tf * 1e3:.3f} | {causal_flops(b, h, t, d, False) / tf / 1e12:.1f} | "
          f"{tfb * 1e3:.3f} | {causal_flops(b, h, t, d, True) / tfb / 1e12:.1f} | {ratio} |")


if __name__ == "__main__":
  main()
