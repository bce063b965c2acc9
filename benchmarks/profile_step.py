r"""Where the time of one train step goes: a device-side profile of ``benchmarks.train_step``'s step.

  python -m benchmarks.profile_step --recipe=bf16                 # GPU: 125m, batch 64 x 1024
  python -m benchmarks.profile_step --tiny                        # CPU check of the script
  python -m benchmarks.profile_step --recipe=bf16 --trace=$OUT/prof   # keep the trace (Perfetto/TensorBoard)

Compiles the step, runs warm-up steps, then records ``--steps`` steps with ``jax.profiler`` and
reads the trace it writes (``*.trace.json.gz``). Prints, per device timeline (XLA ops, streams),
the busy time per step, then the ops that take the most time grouped by kind (GEMM, cuDNN
attention, fusions, copies, reductions, ...) and the top individual ops. Device timings only; the
step's wall time is printed beside them for the host/launch gap.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax

from benchmarks.timing import require_gpu
from benchmarks.train_step import batches, execution_of, model_config
from fp4jax import sharding as shd
from fp4jax.recipe import get_recipe
from fp4jax.train import OptimizerConfig, init_state, jit_steps, make_optimizer, make_schedule

KINDS = (  # first match wins; patterns on the lower-cased op/kernel name
    ("NVFP4 quantizer kernels", r"^nvfp4_(quantize|amax)"),
    ("attention kernels (Pallas)", r"^nvfp4_attention"),
    ("attention (cuDNN)", r"cudnn|fmha|flash"),
    ("GEMM", r"gemm|cublas|matmul|dot|sm90_xmma|nvjet|cutlass"),
    ("copy / transpose", r"copy|transpose|memcpy|memset"),
    ("reduction", r"reduce|scatter|sort"),
    ("fusion (elementwise)", r"fusion|loop|elementwise|convert|multiply|add"),
)


def kind_of(name: str) -> str:
  low = name.lower()
  for kind, pat in KINDS:
    if re.search(pat, low):
      return kind
  return "other"


def read_trace(trace_dir: str) -> tuple[list[dict], dict]:
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
  with gzip.open(files[-1]) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
      names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
  return events, names


def _device_lines(events, names):
  device_pids = {pid for (pid, tid), n in names.items() if tid is None and "device" in n.lower()
                 and "cpu" not in n.lower()}
  if not device_pids:  # CPU runs: the host's XLA threads stand in for a device
    device_pids = {pid for (pid, tid), n in names.items() if tid is None}
  lines = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device_pids:
      lines[(e["pid"], e.get("tid"))].append(e)
  return lines


def _op_line(lines, names):
  """The op-level timeline: XLA Ops where the profiler has one, else the busiest timeline."""
  pick = [k for k in lines if "xla ops" in str(names.get(k, "")).lower()]
  return pick[0] if pick else max(lines, key=lambda k: sum(e["dur"] for e in lines[k]))


def busy_ms(events, names, steps: int) -> float:
  """Milliseconds per step during which the op timeline runs a kernel (device time, no host)."""
  lines = _device_lines(events, names)
  return sum(e["dur"] for e in lines[_op_line(lines, names)]) / 1e3 / steps


def busy_by_prefix(events, names, steps: int, prefixes) -> dict:
  """Busy milliseconds per step of the op timeline's kernels, summed per name prefix of ``prefixes``
  (the first that matches); the rest under ``"xla"``."""
  lines = _device_lines(events, names)
  out = collections.Counter()
  for e in lines[_op_line(lines, names)]:
    out[next((p for p in prefixes if e["name"].startswith(p)), "xla")] += e["dur"] / 1e3 / steps
  return dict(out)


def kernel_sequence(events, names, steps: int) -> list[tuple[str, float, float]]:
  """The op timeline's kernels of the last of ``steps`` steps, in start order: (name, start us from the
  step's first kernel, duration us)."""
  lines = _device_lines(events, names)
  evs = sorted(lines[_op_line(lines, names)], key=lambda e: e["ts"])
  last = evs[len(evs) - len(evs) // steps:]
  return [(e["name"], e["ts"] - last[0]["ts"], e["dur"]) for e in last]


def summarize(events, names, steps: int, top: int, hlo: dict | None = None) -> None:
  lines = _device_lines(events, names)
  print("\n| timeline | events | busy ms / step |\n|---|---:|---:|")
  for key, evs in sorted(lines.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
    label = f"{names.get((key[0], None), key[0])} / {names.get(key, key[1])}"
    print(f"| {label[:80]} | {len(evs)} | {sum(e['dur'] for e in evs) / 1e3 / steps:.2f} |")
  key = _op_line(lines, names)
  evs = lines[key]
  total = sum(e["dur"] for e in evs)
  by_kind, by_name = collections.Counter(), collections.Counter()
  count, args_of = collections.Counter(), {}
  for e in evs:
    by_kind[kind_of(e["name"])] += e["dur"]
    by_name[e["name"]] += e["dur"]
    count[e["name"]] += 1
    args_of.setdefault(e["name"], e.get("args") or {})
  span = max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)
  print(f"\nop timeline: {names.get((key[0], None))} / {names.get(key)}; {total / 1e3 / steps:.2f} ms "
        f"busy per step; first kernel start to last kernel end {span / 1e3 / steps:.2f} ms per step, "
        f"{len(evs) / steps:.0f} kernels per step")
  print("\n| kind | ms / step | share |\n|---|---:|---:|")
  for kind, us in by_kind.most_common():
    print(f"| {kind} | {us / 1e3 / steps:.2f} | {100 * us / total:.1f}% |")
  print(f"\n| top {top} ops | calls / step | ms / step | share | HLO |\n|---|---:|---:|---:|---|")
  for name, us in by_name.most_common(top):
    a = args_of[name]
    op = a.get("hlo_op") or a.get("long_name") or ""
    what = op
    if hlo:  # kernel `loop_add_fusion_37` is instruction `loop_add_fusion.37`
      for cand in (op.lstrip("%"), name, re.sub(r"_(\d+)$", r".\1", name)):
        if cand in hlo:
          what = hlo[cand]
          break
    print(f"| {name[:90]} | {count[name] / steps:.0f} | {us / 1e3 / steps:.3f} | "
          f"{100 * us / total:.1f}% | {str(what)[:160]} |")


def read_hlo(dump_dir: str) -> dict:
  """Instruction name -> its line (shape and operands), from XLA's optimized-HLO text dumps."""
  out = {}
  for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
    with open(path) as f:
      for line in f:
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (.*)", line)
        if m:
          out.setdefault(m.group(1), m.group(2).strip())
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--recipe", default="bf16")
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--seq", type=int, default=None)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--scan", action="store_true")
  p.add_argument("--remat", action="store_true")
  p.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"))
  p.add_argument("--cross-entropy", default="auto", choices=("auto", "pallas", "xla"))
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--trace", default=None, help="keep the trace in this directory")
  p.add_argument("--dump", default=None,
                 help="dump the optimized HLO here and show each top op's instruction")
  args = p.parse_args(argv)
  require_gpu(p, args.tiny, "--tiny")
  if args.dump:  # before the backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
                               " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*")
  args.batch = args.batch or (8 if args.tiny else 64)
  args.seq = args.seq or (64 if args.tiny else 1024)
  args.data = None
  cfg = model_config(args.tiny, None, args.remat, args.scan)
  mesh = shd.make_mesh((1, -1, 1))
  recipe = get_recipe(args.recipe)
  opt = OptimizerConfig(learning_rate=1e-3, warmup_steps=10)
  execution = execution_of(args)
  tx = make_optimizer(opt, recipe, 1000, execution=execution)
  graphdef, state, shardings = init_state(cfg, recipe, tx, mesh, execution=execution)
  step, _ = jit_steps(graphdef, tx, make_schedule(opt, 1000), shardings, mesh, execution=execution)
  data = batches(args, cfg.vocab_size, mesh, 2)
  for i in range(1 + args.warmup):
    state, m = step(state, data[i % 2])
  jax.block_until_ready(m)
  trace_dir = args.trace or tempfile.mkdtemp(prefix="fp4jax_prof_")
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir):
    for i in range(args.steps):
      state, m = step(state, data[i % 2])
    jax.block_until_ready(m)
  wall = (time.perf_counter() - t0) / args.steps
  print(f"{args.recipe}: {jax.devices()[0].device_kind}, batch {args.batch} x {args.seq}, "
        f"{'scan' if args.scan else 'unrolled'}; wall {wall * 1e3:.1f} ms/step under the profiler; "
        f"loss {float(m['loss']):.4f}")
  events, names = read_trace(trace_dir)
  summarize(events, names, args.steps, args.top, read_hlo(args.dump) if args.dump else None)
  return 0


if __name__ == "__main__":
  sys.exit(main())
