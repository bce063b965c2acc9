r"""Time from launch to the first train step, by phase, and the size of the program XLA compiles.

  python -m benchmarks.compile_time                            # 20m and 125m, bf16 vs fp4_linear
  python -m benchmarks.compile_time --runs=125m:bf16,125m:fp4_linear:xla,125m:fp4_linear:pallas --scan
  python -m benchmarks.compile_time --lower-for=cuda           # on the CPU: only trace and lower, for an H200
  python -m benchmarks.compile_time --tiny                     # CPU check of the script (tiny model)
  python -m benchmarks.compile_time --runs=20m:fp4_linear:pallas --compiler-option=xla_gpu_autotune_level=0
  python -m benchmarks.compile_time --runs=20m:bf16,20m:fp4_linear:pallas --compile-profile=40
  python -m benchmarks.compile_time --lower-for=cuda --triton-compile --runs=20m:fp4_linear:pallas
  python -m benchmarks.compile_time --runs=20m:fp4_linear:pallas --recipe-option=matmul.rounding_bits=random

A run is ``SIZE:RECIPE[:IMPL]``: a model size (``20m``, ``125m``: experiments/configs' models;
``tiny``), a recipe of ``fp4jax.recipe``, and the implementation of its NVFP4 GEMMs
(``fp4jax.execution.Execution.matmul``: ``auto``, ``xla``, ``pallas``, ``pallas_interpret``; default
``--matmul``; a kernel implementation with ``+xla_amax``, e.g. ``pallas+xla_amax``: the quantizer
kernels' first pass in XLA). Per run, on one device: the train state's initialization, then the train step of
``fp4jax.train.make_train_step``, jitted with the state's shardings, traced, lowered and compiled by
XLA under ``jax.set_mesh`` (each phase timed alone), the first step, and the median of ``--steps``
further steps; with the line counts of the StableHLO module and of the optimized HLO. "first step"
is the sum of the phases up to and including the first step's run. No persistent compilation cache
is used unless JAX's configuration sets one (the header says which).

``--compile-profile=N`` records XLA's compilation of each step with ``jax.profiler`` and prints the N
compiler events (XLA's own trace annotations: pass pipelines and passes, backend code generation,
autotuning, kernel compilation) that take the most time, summed over their occurrences. The times
are inclusive (a pipeline contains its passes), so a line's time is not additive with the others.

``--lower-for=cuda`` builds nothing on the device: the state is abstract and the step is traced and
lowered for an H200 (an abstract mesh), so the program sizes of the GPU implementations, the Pallas
kernels' included, can be compared on a CPU. Choices that ``"auto"`` resolves by the platform of the
default device (attention, the loss) keep the CPU's there.

``--triton-compile`` (with ``--lower-for=cuda``; needs the ``triton`` package, no GPU) takes the Triton
kernels out of the lowered step (the ``__gpu$xla.gpu.triton`` custom calls that Pallas emits: Triton
IR, warps, stages), keeps one of each distinct (IR, warps, stages), as XLA compiles each such kernel
once, and compiles each for sm_90 with the ``triton`` package on the CPU, one after another, with its
cache off, printing the seconds of each, longest first, and the instructions of its SASS (one
thread's program, disassembled by the package's ``nvdisasm``: the instruction budget of kernels that
are bound by instruction issue, as the quantizers are). A proxy: XLA compiles these kernels with the
Triton bundled in jaxlib, on the GPU machine's CPU, possibly several at a time. With
``MLIR_ENABLE_TIMING=1`` in the environment Triton also prints the time of each of its passes.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.timing import assignment
from benchmarks.train_step import recipe_of
from fp4jax import sharding as shd
from fp4jax.model import ModelConfig
from fp4jax.execution import KERNEL_IMPLEMENTATIONS as IMPLEMENTATIONS
from fp4jax.execution import Execution
from fp4jax.train import (
    OptimizerConfig,
    abstract_model,
    init_state,
    make_optimizer,
    make_schedule,
    make_train_step,
)

# experiments/configs' models (here so that the benchmark runs without ml_collections), and a tiny one.
SIZES = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=384),
    "20m": dict(d_model=384, n_layers=6, n_heads=6, vocab_size=8192),
    "125m": dict(d_model=768, n_layers=12, n_heads=12, vocab_size=32768),
}
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


def execution_of(impl: str) -> Execution:
  """The ``Execution`` of an ``IMPL`` of ``--runs``: the NVFP4 matmuls' ``implementation``, and with
  ``+xla_amax`` the quantizer kernels' first pass in XLA (``amax="xla"``: one Triton kernel per
  operand)."""
  impl, _, variant = impl.partition("+")
  return Execution(matmul=impl, amax="xla" if variant == "xla_amax" else "kernel")


def _lines(text: str | None) -> int:
  return text.count("\n") if text else 0


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def _setup(size, recipe_name, scan, execution, recipe_options=()):
  cfg = ModelConfig(**SIZES[size], scan_layers=scan)
  recipe = recipe_of(":".join([recipe_name, *recipe_options]))
  opt = OptimizerConfig(learning_rate=1e-3, warmup_steps=10)
  return cfg, recipe, make_optimizer(opt, recipe, 1000, execution=execution), make_schedule(opt, 1000)


def compile_events(trace_dir: str, top: int) -> list[tuple[str, float, int]]:
  """The ``top`` compiler events of a ``jax.profiler`` trace by total time: ``(name, ms, count)``,
  XLA's annotations only (JAX's Python frames, named ``$file:line``, left out); digits in a name are
  kept (pass names carry none, module names are the step's)."""
  from benchmarks.profile_step import read_trace
  events, _ = read_trace(trace_dir)
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith("$"):
      total[e["name"]] += e["dur"]
      count[e["name"]] += 1
  return [(name, us / 1e3, count[name]) for name, us in total.most_common(top)]


def _compile(lowered, args):
  """``lowered.compile`` with ``args.compiler_options``; under ``jax.profiler`` with
  ``--compile-profile``, whose events come back as ``compile_events``."""
  compile_ = lambda: lowered.compile(compiler_options=args.compiler_options or None)
  if not args.compile_profile:
    return compile_(), None
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      compiled = compile_()
    return compiled, compile_events(d, args.compile_profile)


def run_on_device(size, recipe_name, args, execution: Execution = Execution()) -> dict:
  """Every phase on the default device, as a training run does them."""
  cfg, recipe, tx, schedule = _setup(size, recipe_name, args.scan, execution, args.recipe_option)
  mesh = shd.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  (graphdef, state, shardings), t_init = _timed(
      lambda: jax.block_until_ready(init_state(cfg, recipe, tx, mesh, execution=execution)))
  bsh = NamedSharding(mesh, P(shd.BATCH_AXES, None))
  step = jax.jit(make_train_step(graphdef, tx, schedule, execution=execution),
                 in_shardings=(shardings, {"inputs": bsh, "targets": bsh}),
                 out_shardings=(shardings, shd.replicated(mesh)), donate_argnums=0)
  rng = np.random.default_rng(0)
  toks = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
  batch = {"inputs": jax.device_put(toks[:, :-1], bsh), "targets": jax.device_put(toks[:, 1:], bsh)}
  with jax.set_mesh(mesh):
    traced, t_trace = _timed(lambda: step.trace(state, batch))
    lowered, t_lower = _timed(traced.lower)
    (compiled, events), t_compile = _timed(lambda: _compile(lowered, args))
  (state, metrics), t_first = _timed(lambda: jax.block_until_ready(compiled(state, batch)))
  times = []
  for _ in range(args.steps):
    (state, metrics), t = _timed(lambda state=state: jax.block_until_ready(compiled(state, batch)))
    times.append(t)
  loss = float(metrics["loss"])
  return dict(init_s=t_init, trace_s=t_trace, lower_s=t_lower, compile_s=t_compile, first_step_s=t_first,
              to_first_step_s=t_init + t_trace + t_lower + t_compile + t_first,
              step_ms=1e3 * statistics.median(times) if times else math.nan,
              stablehlo_lines=_lines(lowered.as_text()), hlo_lines=_lines(compiled.as_text()),
              loss=loss, ok=math.isfinite(loss), **({"compile_events": events} if events else {}))


def lower_for(platform, size, recipe_name, args, execution: Execution = Execution()) -> dict:
  """Trace and lower the step for ``platform`` (an abstract H200 mesh), from an abstract state."""
  lowered, row = lower_step(platform, size, recipe_name, args, execution)
  if getattr(args, "triton_compile", False):
    kernels = compile_triton(triton_kernels(lowered))
    row.update(triton_kernels=len(kernels), triton_compile_s=sum(k["compile_s"] for k in kernels),
               kernel_compiles=kernels)
  return row


def lower_step(platform, size, recipe_name, args, execution: Execution = Execution()):
  """``(lowered step, row of phase times and program sizes)`` of ``lower_for``."""
  if platform != "cuda":
    raise ValueError(f"--lower-for: only 'cuda' (an H200) is known, got {platform!r}")
  cfg, recipe, tx, schedule = _setup(size, recipe_name, args.scan, execution, args.recipe_option)
  (graphdef, params), t_init = _timed(lambda: abstract_model(cfg, recipe, execution))
  rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
           "opt_state": jax.eval_shape(tx.init, params), "rng": rng}
  tokens = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
  mesh = AbstractMesh((1, 1, 1), shd.AXES, axis_types=(AxisType.Auto,) * 3, abstract_device=H200)
  step = jax.jit(make_train_step(graphdef, tx, schedule, execution=execution))
  with jax.sharding.use_abstract_mesh(mesh):
    traced, t_trace = _timed(lambda: step.trace(state, {"inputs": tokens, "targets": tokens}))
    lowered, t_lower = _timed(lambda: traced.lower(lowering_platforms=(platform,)))
  text = lowered.as_text()
  return lowered, dict(init_s=t_init, trace_s=t_trace, lower_s=t_lower, stablehlo_lines=_lines(text),
                      triton_calls=text.count("__gpu$xla.gpu.triton"), ok=True)


def triton_kernels(lowered) -> list[dict]:
  """The Triton kernels of a lowered program: one dict per distinct (IR text, warps, stages) of its
  ``__gpu$xla.gpu.triton`` custom calls, with ``name``, ``num_warps``, ``num_stages``, ``calls`` (how
  many custom calls share it), ``ir`` (the Triton IR as text) and ``ops`` (its operations)."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  configs = []

  def visit(op):
    op = op.operation
    if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == (
        "__gpu$xla.gpu.triton"):
      configs.append(op.attributes["mhlo.backend_config"])
    return ir.WalkResult.ADVANCE

  module = lowered.compiler_ir("stablehlo")
  with module.context:
    module.operation.walk(visit)
    calls = [(ir.StringAttr(c["name"]).value, ir.StringAttr(c["ir"]).value_bytes,
              ir.IntegerAttr(c["num_warps"]).value, ir.IntegerAttr(c["num_stages"]).value) for c in configs]
  ctx = jax_mlir.make_ir_context()
  tt_dialect.register_dialect(ctx)
  kernels = {}  # by (IR text without source locations, warps, stages): the bytecode's locations differ
  with ctx:
    for name, bytecode, warps, stages in calls:
      text = str(ir.Module.parse(bytecode))
      k = kernels.setdefault((text, warps, stages), dict(
          name=name, num_warps=warps, num_stages=stages, calls=0, ir=text,
          ops=sum(1 for line in text.splitlines() if " = " in line)))
      k["calls"] += 1
  return list(kernels.values())


def sass_instructions(sass: str) -> int:
  """The instructions of a kernel's SASS as Triton prints it (``CompiledKernel.asm["sass"]``: one
  line per instruction, after its control-code field ``--:-:0:-:1``): one thread's program."""
  return sum(1 for line in sass.splitlines() if re.match(r"^[^\s:]+(:[^\s:]+){3}:\d+\t", line))


def compile_triton(kernels: list[dict], capability: int = 90) -> list[dict]:
  """Compiles each kernel's Triton IR for ``sm_{capability}`` with the ``triton`` package (CPU only, a
  fresh cache), adding ``compile_s`` and ``sass`` (``sass_instructions``, or None where the package's
  ``nvdisasm`` cannot disassemble it) to each; raises ImportError without ``triton``."""
  if os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("--triton-compile compiles with Triton's compiler; unset TRITON_INTERPRET")
  import triton
  from triton.backends.compiler import GPUTarget

  target = GPUTarget("cuda", capability, 32)
  with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, TRITON_CACHE_DIR=d,
                                                              TRITON_ALWAYS_COMPILE="1"):
    for i, k in enumerate(kernels):
      path = os.path.join(d, f"{k['name']}_{i}.ttir")
      with open(path, "w") as f:
        f.write(k["ir"])
      t0 = time.perf_counter()
      compiled = triton.compile(path, target=target,
                                options=dict(num_warps=k["num_warps"], num_stages=k["num_stages"]))
      k["compile_s"] = time.perf_counter() - t0
      try:
        k["sass"] = sass_instructions(compiled.asm["sass"])
      except Exception:  # no nvdisasm: the compile time still counts
        k["sass"] = None
  return kernels


def _parse(spec: str, default_impl: str):
  parts = spec.split(":")
  if len(parts) not in (2, 3) or parts[0] not in SIZES:
    raise ValueError(f"--runs: {spec!r} is not SIZE:RECIPE[:IMPL] with SIZE one of {', '.join(SIZES)}")
  impl = parts[2] if len(parts) == 3 else default_impl
  base, plus, variant = impl.partition("+")
  if base not in IMPLEMENTATIONS or (plus and (variant != "xla_amax" or base == "xla")):
    raise ValueError(f"--runs: {spec!r}: IMPL must be one of {IMPLEMENTATIONS}, or a kernel one with "
                     "+xla_amax")
  return parts[0], parts[1], impl


COLUMNS = [("init_s", "init s", "{:.2f}"), ("trace_s", "trace s", "{:.2f}"), ("lower_s", "lower s", "{:.2f}"),
           ("compile_s", "XLA compile s", "{:.2f}"), ("first_step_s", "first step s", "{:.2f}"),
           ("to_first_step_s", "launch to first step s", "{:.1f}"), ("step_ms", "step ms", "{:.2f}"),
           ("stablehlo_lines", "StableHLO lines", "{:,}"), ("hlo_lines", "HLO lines", "{:,}"),
           ("triton_calls", "Triton calls", "{}"), ("triton_kernels", "distinct Triton kernels", "{}"),
           ("triton_compile_s", "Triton compile s (sm_90, CPU, serial)", "{:.1f}")]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default=None, help="SIZE:RECIPE[:IMPL],... (default 20m and 125m, bf16 and "
                 "fp4_linear; --tiny: the tiny model)")
  p.add_argument("--matmul", default="auto", choices=IMPLEMENTATIONS,
                 help="the NVFP4 GEMMs' implementation of runs that name none")
  p.add_argument("--batch", type=int, default=None, help="batch (default 16; --tiny 2)")
  p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; --tiny 32)")
  p.add_argument("--steps", type=int, default=None, help="timed steps after the first (default 10; --tiny 2)")
  p.add_argument("--scan", action="store_true", help="lax.scan over the blocks (not unrolled)")
  p.add_argument("--lower-for", default=None, help="'cuda': only trace and lower, for an H200")
  p.add_argument("--tiny", action="store_true", help="CPU check of the script: tiny model and shapes")
  p.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                 help="an XLA option for the step's compilation (repeatable), e.g. "
                 "xla_gpu_autotune_level=0 or xla_gpu_enable_triton_gemm=false")
  p.add_argument("--recipe-option", action="append", default=[], metavar="FIELD=VALUE",
                 help="a recipe field set in every run (repeatable; benchmarks.train_step's FIELD=VALUE), e.g. "
                 "matmul.rounding_bits=random")
  p.add_argument("--triton-compile", action="store_true",
                 help="with --lower-for=cuda: compile each distinct Triton kernel of the step for sm_90 "
                 "with the triton package (CPU) and print its compile time")
  p.add_argument("--compile-profile", type=int, default=0, metavar="N",
                 help="profile XLA's compilation of each step and print its N longest compiler events "
                 "(the XLA compile time then includes the profiler's overhead)")
  args = p.parse_args(argv)
  if args.triton_compile and not args.lower_for:
    p.error("--triton-compile needs --lower-for=cuda (it compiles the kernels of the lowered step)")
  try:
    args.compiler_options = dict(assignment(o, "--compiler-option") for o in args.compiler_option)
  except ValueError as e:
    p.error(str(e))
  args.batch = args.batch or (2 if args.tiny else 16)
  args.seq = args.seq or (32 if args.tiny else 1024)
  args.steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
  sizes = ("tiny",) if args.tiny else ("20m", "125m")
  runs = args.runs or ",".join(f"{s}:{r}" for s in sizes for r in ("bf16", "fp4_linear"))
  try:
    specs = [_parse(s, args.matmul) for s in runs.split(",") if s]
    for _, recipe, _ in specs:
      recipe_of(":".join([recipe, *args.recipe_option]))
  except ValueError as e:
    p.error(str(e))

  dev = jax.devices()[0]
  where = f"lowered for {args.lower_for} (H200)" if args.lower_for else f"{dev.device_kind} ({dev.platform})"
  print(f"{where}; jax {jax.__version__}; batch {args.batch} x seq {args.seq}; scan {args.scan}; "
        f"persistent compilation cache: {jax.config.jax_compilation_cache_dir or 'none'}; XLA options: "
        f"{args.compiler_options or 'defaults'}; recipe options: {args.recipe_option or 'none'}", flush=True)
  rows = []
  for size, recipe, impl in specs:
    name = f"{size}:{recipe}:{impl}"
    try:
      if args.lower_for:
        row = lower_for(args.lower_for, size, recipe, args, execution_of(impl))
      else:
        row = run_on_device(size, recipe, args, execution_of(impl))
    except Exception as e:  # report and go on with the other runs
      print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
      row = {"ok": False}
    events = row.pop("compile_events", None)
    kernels = row.pop("kernel_compiles", None)
    rows.append((name, row))
    print(json.dumps({"run": name, **row}), flush=True)
    if kernels:
      print(f"\n{name}: Triton kernels compiled for sm_90 on the CPU, longest first\n\n"
            "| kernel | warps | stages | custom calls | Triton IR ops | SASS instructions | compile s |\n"
            "|---|---:|---:|---:|---:|---:|---:|")
      for k in sorted(kernels, key=lambda k: -k["compile_s"]):
        sass = "—" if k["sass"] is None else f"{k['sass']:,}"
        print(f"| {k['name']} | {k['num_warps']} | {k['num_stages']} | {k['calls']} | {k['ops']:,} | "
              f"{sass} | {k['compile_s']:.2f} |")
      print(flush=True)
    if events:
      print(f"\n{name}: XLA compile events, inclusive ms (summed over occurrences)\n\n| event | ms | count |"
            "\n|---|---:|---:|")
      for ev, ms, n in events:
        print(f"| {ev[:100]} | {ms:.1f} | {n} |")
      print(flush=True)

  cols = [c for c in COLUMNS if any(c[0] in r for _, r in rows)]
  print("\n| run | " + " | ".join(c[1] for c in cols) + " |\n|---|" + "---:|" * len(cols))
  for name, r in rows:
    cells = [fmt.format(r[k]) if k in r else "–" for k, _, fmt in cols]
    print(f"| {name} | " + " | ".join(cells) + " |" + ("" if r["ok"] else " failed"))
  return 0 if all(r["ok"] for _, r in rows) else 1


if __name__ == "__main__":
  raise SystemExit(main())
