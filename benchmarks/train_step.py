r"""Train-step throughput of the 125m model: bf16 vs fp4_linear (tokens/s, MFU, step-time ratio).

  python -m benchmarks.train_step                       # GPU: 125m, seq 1024, batch 64, synthetic
  python -m benchmarks.train_step --tiny                # CPU check of the script (seconds)
  python -m benchmarks.train_step --data=<data dir>     # real tokens from `fp4jax.data prepare`
  python -m benchmarks.train_step --batch=32 --seq=2048 --recipes=bf16 --remat --scan
  python -m benchmarks.train_step --recipes=bf16 --attention=xla   # XLA attention (B×N×T×T scores)
  python -m benchmarks.train_step --recipes=bf16,fp4_linear,fp4_linear:matmul.rounding_bits=random

A recipe is a preset of ``fp4jax.recipe`` with optional ``:FIELD=VALUE`` overrides of its fields
(a nested op config's as ``matmul.hadamard=false``, an operand's as ``matmul.x.terms=2``). Recipes
are separated by commas, or by semicolons where a value holds a comma
(``--recipes="fp4_linear;fp4_linear:matmul.x.terms=2:matmul.w.terms=2"``).

The model is ``experiments/configs/125m.py``'s (d=768, 12 blocks, vocab 32768; a test keeps
``MODEL_125M`` equal to it; ``--tiny``: d=64, 2 blocks). Each recipe's full jitted train step
(forward, backward, AdamW update, donated state)
runs ``--warmup`` untimed steps after compilation, then ``--steps`` timed steps on batches
already on the device. A recipe whose forward GEMMs turn BF16 for the last fraction f of a run
(``bf16_fwd_last``, e.g. ``fp4_linear_w1x16_4over6_fwd_bf16_last10``) is timed in both phases and
reported as the run's mean step, (1 − f)·NVFP4-forward step + f·BF16-forward step (each phase's time in
its row's ``phases``). MFU = (6·N + 12·L·T·D_attn)·tokens/s / (peak · devices), N without the
embedding table, peak the dense bf16 figure of ``fp4jax.metrics.PEAK_FLOPS`` (H200: 989 TFLOP/s);
no MFU on CPU. The step is compiled ahead of time (``lower`` then ``compile``, each timed) and its
peak memory is XLA's plan for the compiled step on one device (``memory_analysis()``: arguments +
outputs − donated aliases + temporaries; the train state, the batch, the saved activations and the
step's scratch). Prints one table last; exits non-zero if a recipe fails or its loss is not finite.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax
import numpy as np

from benchmarks.timing import assignment, require_gpu
from fp4jax import data as data_lib
from fp4jax import sharding as shd
from fp4jax.metrics import peak_flops
from fp4jax.execution import Execution
from fp4jax.model import ModelConfig, attention_impl
from fp4jax.recipe import get_recipe
from fp4jax.train import OptimizerConfig, init_state, jit_steps, make_optimizer, make_schedule

# The 125m experiment's model (experiments/configs/125m.py, vocab from its BPE-32k data), here so
# that the benchmark runs without ml_collections.
MODEL_125M = dict(vocab_size=32768, d_model=768, n_layers=12, n_heads=12)


def model_config(tiny: bool, vocab_size: int | None = None, remat: bool = False,
                 scan: bool = False) -> ModelConfig:
  if tiny:
    return ModelConfig(vocab_size=vocab_size or 384, d_model=64, n_layers=2, n_heads=4,
                       remat=remat, scan_layers=scan)
  return ModelConfig(**{**MODEL_125M, "vocab_size": vocab_size or MODEL_125M["vocab_size"]},
                     remat=remat, scan_layers=scan)


def execution_of(args) -> Execution:
  """The ``Execution`` of ``--attention`` and ``--cross-entropy``."""
  return Execution(attention=args.attention, cross_entropy=args.cross_entropy)


def batches(args, vocab_size: int, mesh, n: int) -> list[dict]:
  if args.data:
    it = data_lib.make_iterator(args.data, "train", args.seq, args.batch, seed=0)
    host = [next(it) for _ in range(n)]
  else:
    rng = np.random.default_rng(0)
    host = []
    for _ in range(n):
      toks = rng.integers(0, vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
      host.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
  return [data_lib.to_global_batch(b, mesh) for b in host]


def recipe_list(recipes: str) -> list[str]:
  """``--recipes``: split at semicolons where there is one (a value may hold commas), else at commas."""
  return [r for r in recipes.split(";" if ";" in recipes else ",") if r]


def recipe_of(spec: str):
  """``PRESET[:FIELD=VALUE...]`` -> the ``Recipe`` (values read as bool, int or float where they
  read as one, else str); ``SECTION.FIELD`` sets a field of a nested op config (``matmul``,
  ``attention_op``, ``moments``), ``SECTION.FIELD.SUBFIELD`` one of its nested dataclasses (e.g.
  ``matmul.x.terms=2``)."""
  name, *pairs = spec.split(":")
  overrides = {}
  for pair in pairs:
    field, value = assignment(pair, f"recipe {spec!r}", "FIELD=VALUE")
    *path, last = field.split(".")
    nested = overrides
    for part in path:
      nested = nested.setdefault(part, {})
    nested[last] = value
  try:
    return get_recipe(name, **overrides)
  except TypeError as e:  # an unknown field
    raise ValueError(f"recipe {spec!r}: {e}") from None


def phases(recipe) -> list[tuple[str, float, object]]:
  """The steps a run of ``recipe`` computes, as ``(label, fraction of the run's steps, Recipe)``: one
  phase, or with ``bf16_fwd_last = f`` the NVFP4-forward steps (1 − f) and the BF16-forward ones (f,
  ``Recipe.bf16_forward``), whose step times the benchmark averages with these weights."""
  late = recipe.bf16_forward()
  f = recipe.bf16_fwd_last
  if not f or late == recipe:
    return [("", 1.0, recipe)]
  return [("NVFP4 forward", 1.0 - f, recipe), ("BF16 forward", f, late)]


def bench(name: str, cfg: ModelConfig, args, mesh, data: list[dict]) -> dict:
  """``name``'s step (``recipe_of``) timed; a recipe with a BF16-forward tail times each phase
  (``phases``) and reports the run's mean step (weighted by the phases' fractions), the slowest
  compile, and each phase's step time under ``"phases"``."""
  rows = [dict(_bench_recipe(recipe, cfg, args, mesh, data), fraction=w, phase=label)
          for label, w, recipe in phases(recipe_of(name))]
  if len(rows) == 1:
    return {"recipe": name, **{k: v for k, v in rows[0].items() if k not in ("fraction", "phase")}}
  step_ms = sum(r["fraction"] * r["step_ms"] for r in rows)
  tokens = args.batch * args.seq
  mfu = (None if any(r["mfu"] is None for r in rows) else
         sum(r["fraction"] * r["step_ms"] * r["mfu"] for r in rows) / step_ms)
  most = lambda k: max((r[k] for r in rows if r[k] is not None), default=None)
  return {"recipe": name, "step_ms": step_ms, "tokens_per_s": tokens / (step_ms / 1e3), "mfu": mfu,
          "lower_s": most("lower_s"), "compile_s": most("compile_s"), "first_step_s": most("first_step_s"),
          "peak_gib": most("peak_gib"), "temp_gib": most("temp_gib"), "loss0": rows[0]["loss0"],
          "loss": rows[-1]["loss"], "ok": all(r["ok"] for r in rows),
          "phases": {r["phase"]: {"fraction": r["fraction"], "step_ms": r["step_ms"]} for r in rows}}


def _bench_recipe(recipe, cfg: ModelConfig, args, mesh, data: list[dict]) -> dict:
  opt = OptimizerConfig(learning_rate=1e-3, warmup_steps=10)
  execution = execution_of(args)
  tx = make_optimizer(opt, recipe, 1000, execution=execution)
  graphdef, state, shardings = init_state(cfg, recipe, tx, mesh, execution=execution)
  jitted, _ = jit_steps(graphdef, tx, make_schedule(opt, 1000), shardings, mesh,
                        execution=execution)
  c0 = time.perf_counter()
  lowered = jitted.lower(state, data[0])
  c1 = time.perf_counter()
  step = lowered.compile()
  c2 = time.perf_counter()
  state, m = step(state, data[0])
  loss0 = float(m["loss"])
  first_s = time.perf_counter() - c2
  mem = step.memory_analysis()
  peak = None
  if mem is not None:
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)
  for i in range(args.warmup):
    state, m = step(state, data[(i + 1) % len(data)])
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for i in range(args.steps):
    state, m = step(state, data[i % len(data)])
  loss = float(m["loss"])  # waits for the last step
  dt = (time.perf_counter() - t0) / args.steps
  tokens = args.batch * args.seq
  flops = peak_flops(mesh.devices.flat[0])
  mfu = cfg.flops_per_token(args.seq) * tokens / dt / (flops * mesh.devices.size) if flops else None
  return {"step_ms": dt * 1e3, "tokens_per_s": tokens / dt, "mfu": mfu,
          "lower_s": c1 - c0, "compile_s": c2 - c1, "first_step_s": first_s,
          "peak_gib": None if peak is None else peak / 2**30,
          "temp_gib": None if mem is None else mem.temp_size_in_bytes / 2**30,
          "loss0": loss0, "loss": loss, "ok": math.isfinite(loss) and math.isfinite(loss0)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tiny", action="store_true", help="tiny model and shapes (CPU check)")
  p.add_argument("--recipes", default="bf16,fp4_linear")
  p.add_argument("--batch", type=int, default=None, help="global batch (default 64; tiny 8)")
  p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; tiny 64)")
  p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny 3)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--data", default=None, help="data dir from `python -m fp4jax.data prepare`")
  p.add_argument("--remat", action="store_true", help="rematerialize blocks (less memory)")
  p.add_argument("--scan", action="store_true", help="lax.scan over the blocks (not unrolled)")
  p.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes")
  p.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"),
                 help="attention kernel (auto: cuDNN on a GPU when the shapes allow)")
  p.add_argument("--cross-entropy", default="auto", choices=("auto", "pallas", "xla"),
                 help="the loss's pass over the logits (auto: the Pallas kernel on a GPU)")
  args = p.parse_args(argv)
  require_gpu(p, args.tiny, "--tiny")
  args.batch = args.batch or (8 if args.tiny else 64)
  args.seq = args.seq or (64 if args.tiny else 1024)
  args.steps = args.steps or (3 if args.tiny else 10)
  vocab = None
  if args.data:
    vocab = -(-data_lib.read_meta(args.data).vocab_size // 128) * 128
  cfg = model_config(args.tiny, vocab, args.remat, args.scan)
  mesh = shd.make_mesh(tuple(int(s) for s in args.mesh.split(",")))
  dev = mesh.devices.flat[0]
  print(f"device: {mesh.devices.size} x {dev.device_kind} ({dev.platform}); model d={cfg.d_model} "
        f"L={cfg.n_layers} V={cfg.vocab_size} N={cfg.num_params() / 1e6:.1f}M; attention "
        f"{attention_impl(cfg, args.attention)}; cross-entropy {args.cross_entropy}; batch {args.batch}"
        f" x seq {args.seq}; {'data ' + args.data if args.data else 'synthetic tokens'}",
        flush=True)
  data = batches(args, cfg.vocab_size, mesh, max(2, min(args.steps, 4)))
  rows = []
  for name in recipe_list(args.recipes):
    try:
      rows.append(bench(name, cfg, args, mesh, data))
    except Exception as e:  # report and go on with the other recipes
      print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
      rows.append({"recipe": name, "ok": False})
    print(rows[-1], flush=True)
  ref = rows[0].get("step_ms")
  ref_peak = rows[0].get("peak_gib")
  print(f"\n| recipe | step ms | tokens/s | MFU | step time / {rows[0]['recipe']} | lower s | compile s "
        f"| peak GiB (XLA plan) | peak / {rows[0]['recipe']} | temporaries GiB |"
        "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  gib = lambda v: "–" if v is None else f"{v:.2f}"
  for r in rows:
    if "step_ms" not in r:
      print(f"| {r['recipe']} | failed | | | | | | | | |")
      continue
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "–"
    ratio = f"{r['step_ms'] / ref:.2f}" if ref else "–"
    peak_ratio = f"{r['peak_gib'] / ref_peak:.2f}" if ref_peak and r["peak_gib"] else "–"
    print(f"| {r['recipe']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | {ratio} | "
          f"{r['lower_s']:.1f} | {r['compile_s']:.1f} | {gib(r['peak_gib'])} | {peak_ratio} | "
          f"{gib(r['temp_gib'])} |")
  return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
