r"""NVFP4 GEMMs on the block projections of the 125m, 1b and 3b models and 8192³, against bf16 and
``jax.nn.scaled_dot_general``, in the same run.

  python -m benchmarks.gemm                      # GPU: M = 65536 tokens, every model's projections
  python -m benchmarks.gemm --m=16384 --models=3b --xla
  python -m benchmarks.gemm --small              # CPU smoke run (tiny shapes, kernels in interpret mode)

Forward table, one GEMM ``x_MxK · w_KxN`` with bf16 ``x`` and ``w``, bf16 output:

- ``bf16``: ``jnp.dot`` with float32 accumulation, cast to bf16 (the peer).
- ``nvfp4 GEMM``: the dot of the two decoded NVFP4 operands (bf16) with float32 accumulation and
  the two global scales, what ``nvfp4_matmul`` runs after quantizing (``precision=HIGHEST``, as
  ``nvfp4.gemm``; also with the default precision, which must not be faster for bf16 operands).
- ``nvfp4 fwd``: ``nvfp4_matmul``'s forward GEMM with the quantizer kernels
  (``implementation="pallas"``): Q(x; 1×16) and Q(w; 16×16), each with its decoded operand, then
  the GEMM above; with ``--xla`` also the XLA implementation.
- ``scaled_dot_general``: ``jax.nn.scaled_dot_general`` with the nvfp4 config (it quantizes both
  operands itself, without a tensor amax; on GPUs without FP4 tensor cores XLA decodes them).

Forward+backward table (``jax.vjp`` of the op, then its backward for a bf16 cotangent), with the
float32 master weight as in a model: ``mixed_matmul`` (bf16 operands, f32 accumulation) against
``nvfp4_matmul`` with NVIDIA's recipe (SR gradients, Hadamard wgrad) and ``scaled_dot_general``.

Each time is the median of ``--iters`` runs after warm-up; TFLOP/s counts ``2·M·K·N`` per GEMM
(three GEMMs forward+backward). The tables come last.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.timing import environment_line, median_seconds, require_gpu
from fp4jax.execution import MatmulExecution
from fp4jax.kernels import nvfp4_quantize as kq
from fp4jax.model import ModelConfig, projection_dims
from fp4jax.ops import MatmulConfig, mixed_matmul, nvfp4_matmul

# experiments/configs/{125m,1b,3b}.py's models (here so that the benchmark runs without ml_collections).
MODELS = {
    "125m": dict(d_model=768, n_layers=12, n_heads=12),
    "1b": dict(d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8),
    "3b": dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8),
}
ROLES = ("qkv", "o", "gate_up", "down")
_NN = (((1,), (0,)), ((), ()))


def shapes(models, m: int, cube: int) -> list[tuple[str, int, int, int]]:
  """``(name, M, K, N)`` of every block projection of ``models`` at ``M = m`` tokens, then ``cube³``."""
  out = []
  for model in models:
    dims = projection_dims(ModelConfig(vocab_size=32768, **MODELS[model]))
    out += [(f"{model} {role}", m, *dims[role]) for role in ROLES]
  if cube:
    out.append((f"{cube}³", cube, cube, cube))
  return out


def _vjp(f, x, w, dy):
  y, vjp = jax.vjp(f, x, w)
  return y, *vjp(dy)


def _sdg(x, w):
  configs = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
  return jax.nn.scaled_dot_general(x, w, _NN, preferred_element_type=jnp.bfloat16, configs=configs)


def forward_row(name, m, k, n, impls, time):
  key = jax.random.key(0)
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  interpret = impls[0] == "pallas_interpret"
  row = {"bf16": time(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                              .astype(jnp.bfloat16)), x, w)}

  (qx, dx), (qw, dw) = (kq.quantize(x, decoded=True, interpret=interpret),
                        kq.quantize(w, block=(16, 16), decoded=True, interpret=interpret))

  def gemm(a, b, sa, sb, precision):
    acc = lax.dot_general(a, b, _NN, precision=precision, preferred_element_type=jnp.float32)
    return ((acc * sa) * sb).astype(jnp.bfloat16)

  scales = (qx.global_scale, qw.global_scale)
  row["nvfp4 GEMM"] = time(jax.jit(functools.partial(gemm, precision=lax.Precision.HIGHEST)), dx, dw, *scales)
  row["nvfp4 GEMM, default precision"] = time(jax.jit(functools.partial(gemm, precision=None)), dx, dw, *scales)
  del qx, dx, qw, dw
  for impl in impls:
    # The forward GEMM alone: nothing quantized for a backward.
    config = MatmulConfig.nvfp4(dgrad=False, wgrad=False, hadamard=False)
    row[f"nvfp4 fwd ({impl})"] = time(jax.jit(functools.partial(nvfp4_matmul, config=config,
                                                                implementation=impl)), x, w)
  row["scaled_dot_general"] = time(jax.jit(_sdg), x, w)
  return row


def fwd_bwd_row(name, m, k, n, impls, time):
  kx, kw, kd = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5  # the float32 master weight
  dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
  row = {"bf16 (mixed_matmul)": time(jax.jit(functools.partial(_vjp, mixed_matmul)), x, w, dy)}
  key = jax.random.key(2)
  for impl in impls:
    f = jax.jit(lambda x, w, dy, key, impl=impl: _vjp(
        lambda x, w: nvfp4_matmul(x, w, key=key, config=MatmulConfig.nvfp4(),
                                  execution=MatmulExecution(impl)),
        x, w, dy))
    row[f"nvfp4 ({impl})"] = time(f, x, w, dy, key)
  row["scaled_dot_general"] = time(jax.jit(functools.partial(_vjp, _sdg)), x, w.astype(jnp.bfloat16), dy)
  return row


def _table(title, rows, base, ours, gemms):
  """Times in ms, then ``ours`` (the kernels' nvfp4 column) against ``base`` and scaled_dot_general."""
  cols = list(rows[0][1])
  lines = [f"\n{title} (ms; nvfp4 = {ours})\n",
           "| shape | M×K×N | " + " | ".join(cols) + f" | nvfp4 ÷ {base} | scaled_dot_general ÷ nvfp4 "
           "| nvfp4 TFLOP/s |",
           "|---|---|" + "---|" * (len(cols) + 3)]
  for (name, m, k, n), row in rows:
    flops = 2 * m * k * n * gemms
    lines.append(f"| {name} | {m}×{k}×{n} | " + " | ".join(f"{row[c] * 1e3:.3f}" for c in cols)
                 + f" | {row[ours] / row[base]:.2f} | {row['scaled_dot_general'] / row[ours]:.2f} | "
                 f"{flops / row[ours] / 1e12:.0f} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true", help="CPU smoke run: tiny shapes, interpret mode")
  ap.add_argument("--models", default="125m,1b,3b", help=f"comma-separated, of {', '.join(MODELS)}")
  ap.add_argument("--m", type=int, default=65536, help="tokens M = batch × sequence")
  ap.add_argument("--cube", type=int, default=8192, help="also an N³ GEMM (0: none)")
  ap.add_argument("--xla", action="store_true", help="also time nvfp4_matmul's XLA implementation")
  ap.add_argument("--iters", type=int, default=None)
  args = ap.parse_args(argv)
  require_gpu(ap, args.small, "--small")
  models = [s for s in args.models.split(",") if s]
  for model in models:
    if model not in MODELS:
      ap.error(f"--models: unknown model {model!r}; known: {', '.join(MODELS)}")
  on_gpu = jax.devices()[0].platform == "gpu"
  impls = ["pallas" if on_gpu else "pallas_interpret"] + (["xla"] if args.xla else [])
  iters = args.iters or (2 if args.small else 20)
  time = functools.partial(median_seconds, iters=iters, warmup=1 if args.small else 3)
  if args.small:
    todo = [("tiny qkv", 64, 64, 192), ("tiny down", 64, 176, 64)]
  else:
    todo = shapes(models, args.m, args.cube)

  fwd, both = [], []
  for shape in todo:
    fwd.append((shape, forward_row(*shape, impls, time)))
    both.append((shape, fwd_bwd_row(*shape, impls, time)))
    print(shape[0], "done", flush=True)

  print(environment_line())
  print(f"median of {iters} runs; bf16 x, bf16 w (forward), float32 master w (forward+backward)")
  print(_table("Forward GEMM", fwd, "bf16", f"nvfp4 fwd ({impls[0]})", 1))
  print(_table("Forward + backward, three GEMMs", both, "bf16 (mixed_matmul)", f"nvfp4 ({impls[0]})", 3))


if __name__ == "__main__":
  main()
