"""One optimizer update of a GPT-2-small-sized (124M) pytree: adamw_nvfp4 vs optax.adamw, and
GPU == CPU equality of the NVFP4 state.

  python -m benchmarks.optim_update            # on the GPU (< 2 min)
  python -m benchmarks.optim_update --small    # CPU-sized smoke run
  python -m benchmarks.optim_update --muon     # also time muon_nvfp4 against optax.contrib.muon
  python -m benchmarks.optim_update --variants # the quantizer alone on every leaf (nearest / SR)
  python -m benchmarks.optim_update --skip-equality --busy --runs=optax.adamw,adamw_nvfp4 \
      --kernel-config=launch_group=1,atomic_slots=16+stats_block_rows=256
                                               # one adamw_nvfp4 row per AdamKernelConfig

Timing: ``params, state = step(params, state, grads)`` (``tx.update`` + ``optax.apply_updates``),
jitted with params and state donated, median of ``--iters`` runs after 3 warm-up runs, each ended
by ``block_until_ready`` (dispatch + device time), and ``--iters`` runs back to back with one block
at the end (dispatch overlapping the device, as in a training loop); with ``--busy`` also the
device's busy time per update from a profile (kernels only: no host dispatch, so it does not move
with the host's load as the wall-clock figures do); with ``--loop=N`` also the wall clock per update
of N updates inside one jitted ``fori_loop`` (one dispatch per N updates). Equality: three updates
of a smaller pytree with fixed gradients on the accelerator and on the CPU; NVFP4 codes, scales and
global scales compared bit for bit, updates to
1e-5 of their max; float32 leaves (optax's arithmetic, which XLA's GPU backend contracts into FMAs)
are reported, bound 1e-4. Exits 1 if a state differs beyond ``--max-mismatch`` of its codes or a
result is not finite. Prints markdown tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.profile_step import busy_by_prefix, busy_ms, kernel_sequence, read_trace, summarize
from benchmarks.timing import require_gpu
from fp4jax import nvfp4, optim
from fp4jax.optim import _common
from fp4jax.quant import Operand


NEAREST = optim.AdamNvfp4Options(mu=Operand(), nu=Operand())


class _QuantizeOnly(optax.GradientTransformation):
  """Not an optimizer: quantizes every gradient leaf as adamw_nvfp4 would (a timing component)."""

  def __new__(cls, rounding):
    def init(params):
      return optax.EmptyState()

    def update(updates, state, params=None):
      key = jax.random.key(0)
      def one(i, g):
        if not optim.stores_nvfp4(g.shape, optim.DEFAULT_MIN_SIZE):
          return g
        return _common.decode(_common.encode(g, rounding, jax.random.fold_in(key, i)))
      leaves, treedef = jax.tree.flatten(updates)
      return treedef.unflatten([one(i, g) for i, g in enumerate(leaves)]), state

    return super().__new__(cls, init, update)


def gpt2_shapes(d=768, layers=12, vocab=50257, ctx=1024, stacked=False):
  """GPT-2's parameter shapes: one subtree per block, or (``stacked``) every block parameter as one
  leaf with a leading layer axis, the layout of a model whose blocks run in a ``lax.scan``."""
  shapes = {"wte": (vocab, d), "wpe": (ctx, d), "ln_f": {"scale": (d,), "bias": (d,)}}
  block = {
      "ln_1": {"scale": (d,), "bias": (d,)}, "ln_2": {"scale": (d,), "bias": (d,)},
      "attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
               "c_proj": {"kernel": (d, d), "bias": (d,)}},
      "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
              "c_proj": {"kernel": (4 * d, d), "bias": (d,)}}}
  if stacked:
    shapes["h"] = jax.tree.map(lambda s: (layers, *s), block, is_leaf=lambda x: isinstance(x, tuple))
    return shapes
  for i in range(layers):
    shapes[f"h{i}"] = block
  return shapes


def make_tree(shapes, seed, scale_spread=3.0):
  """Normal values with a per-leaf scale in 10^[-spread, 0] (gradients of different layers)."""
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  out = [jnp.asarray(rng.standard_normal(s, np.float32) * 10.0 ** -rng.uniform(0, scale_spread))
         for s in leaves]
  return treedef.unflatten(out)


def _step(tx):
  """One update: ``tx.update`` + ``optax.apply_updates``, params and state in, params and state out."""
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def time_update(tx, params, grads, iters):
  step = _step(tx)
  params = jax.tree.map(jnp.copy, params)
  state = tx.init(params)
  fn = jax.jit(step, donate_argnums=(0, 1))
  t0 = time.perf_counter()
  params, state = jax.block_until_ready(fn(params, state, grads))
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(3 + iters):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(fn(params, state, grads))
    if i >= 3:
      times.append(time.perf_counter() - t0)
  # Back to back, one block at the end: the host dispatches ahead while the device runs (as in a
  # training loop), so this is max(dispatch, device) per update rather than their sum.
  t0 = time.perf_counter()
  for _ in range(iters):
    params, state = fn(params, state, grads)
  jax.block_until_ready((params, state))
  pipelined_ms = (time.perf_counter() - t0) / iters * 1e3
  finite = all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
  return statistics.median(times) * 1e3, pipelined_ms, compile_s, optim.state_nbytes(state), finite


def _is_q(x):
  return isinstance(x, nvfp4.NVFP4Tensor)


def run_on(device, tx, params, grads_list):
  # The default device picks the update's implementation (Pallas kernels on a GPU, XLA on the CPU).
  with jax.default_device(device):
    params, state = jax.device_put((params, tx.init(params)), device)
    step = jax.jit(tx.update)
    us = []
    for g in grads_list:
      u, state = step(jax.device_put(g, device), state, params)
      params = optax.apply_updates(params, u)
      us.append(u)
    return jax.device_get((us, state))


def equality(tx, params, grads_list, accel):
  """Compares the states and updates computed on ``accel`` and on the CPU."""
  (u_a, s_a), (u_c, s_c) = (run_on(d, tx, params, grads_list) for d in (accel, jax.devices("cpu")[0]))
  worst = {"codes": 0, "scales": 0, "global": 0, "fp32_state": 0.0, "updates": 0.0, "n_codes": 0}
  for a, c in zip(jax.tree.leaves(s_a, is_leaf=_is_q), jax.tree.leaves(s_c, is_leaf=_is_q)):
    if _is_q(a):
      worst["codes"] += int(np.sum(np.asarray(a.codes) != np.asarray(c.codes)))
      worst["n_codes"] += int(np.asarray(a.codes).size)
      sa, sc = (np.asarray(t.scales).view(np.uint8) for t in (a, c))
      worst["scales"] += int(np.sum(sa != sc))
      worst["global"] += int(np.asarray(a.global_scale).view(np.uint32) != np.asarray(c.global_scale).view(np.uint32))
    else:
      a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
      worst["fp32_state"] = max(worst["fp32_state"], float(np.max(np.abs(a - c) / (np.abs(c) + 1e-30)))
                                if a.size and a.dtype.kind == "f" else 0.0)
  for a, c in zip(jax.tree.leaves(u_a), jax.tree.leaves(u_c)):
    scale = float(np.max(np.abs(c))) + 1e-30
    worst["updates"] = max(worst["updates"], float(np.max(np.abs(np.asarray(a) - np.asarray(c)))) / scale)
  return worst


def time_in_loop(tx, params, grads, n, reps=5):
  """Wall-clock milliseconds per update with ``n`` updates in one jitted ``fori_loop`` (params and
  state carried, donated; median of ``reps`` calls after a compiling one): one dispatch per ``n``
  updates, so the host's per-call cost, which the other wall-clock figures include, is amortized."""
  step = _step(tx)

  def many(params, state, grads):
    return jax.lax.fori_loop(0, n, lambda _, carry: step(*carry, grads), (params, state))

  params = jax.tree.map(jnp.copy, params)
  state = tx.init(params)
  fn = jax.jit(many, donate_argnums=(0, 1))
  params, state = jax.block_until_ready(fn(params, state, grads))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(fn(params, state, grads))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) / n * 1e3


def profile(tx, params, grads, name, steps=5, report=True, top=30, sequence=False):
  """Device-side profile of ``steps`` updates (benchmarks/profile_step.py's trace summary, printed
  when ``report``; with ``sequence``, the last update's kernels in order). Returns the device's busy
  milliseconds per update."""
  import tempfile

  step = _step(tx)
  params = jax.tree.map(jnp.copy, params)  # donated below; the caller's params stay valid
  state = tx.init(params)
  fn = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    params, state = fn(params, state, grads)
  jax.block_until_ready(params)
  trace_dir = tempfile.mkdtemp(prefix="fp4jax_optim_prof_")
  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      params, state = fn(params, state, grads)
    jax.block_until_ready(params)
  trace = read_trace(trace_dir)
  if report:
    print(f"profile of {name}: {steps} updates")
    summarize(*trace, steps, top)
  if sequence:
    print(f"kernels of {name}'s last update, in order: start us, duration us, name")
    for kernel, start, dur in kernel_sequence(*trace, steps):
      print(f"  {start:8.1f} {dur:7.1f}  {kernel}")
  return busy_ms(*trace, steps), busy_by_prefix(*trace, steps, KERNEL_GROUPS)


# Kernel name prefixes of the split of device time printed with --busy; the rest is "xla".
KERNEL_GROUPS = ("adam_nvfp4_stats", "adam_nvfp4_encode")


def parse_kernel_config(text: str) -> optim.AdamKernelConfig:
  """``"NAME=V[+NAME=V]"`` (``AdamKernelConfig`` field names; evict_hints 0 or 1) as the default
  config with those fields replaced; ValueError naming the bad item otherwise."""
  names = [f.name for f in dataclasses.fields(optim.AdamKernelConfig)]
  changes = {}
  for item in text.split("+"):
    name, _, value = item.partition("=")
    if name not in names or not value.isdigit():
      raise ValueError(f"{item!r} is not NAME=INT with NAME one of {names}")
    changes[name] = bool(int(value)) if name == "evict_hints" else int(value)
  return dataclasses.replace(optim.AdamKernelConfig(), **changes)


def _print_timings(rows, n, accel, stacked=False):
  base, base_piped, base_busy = rows[0][1], rows[0][2], rows[0][6]
  layout = "block leaves stacked over layers" if stacked else "one leaf per block parameter"
  print(f"\n### Optimizer update, {n / 1e6:.1f}M-parameter GPT-2-small pytree ({layout}), "
        f"{accel.device_kind}\n")
  busy_head = " device busy ms | vs optax.adamw |" if base_busy is not None else ""
  print("| optimizer | median ms (blocking) | vs optax.adamw | back-to-back ms | vs optax.adamw |"
        f"{busy_head} compile s | state B/param | finite |")
  print("|---|---|---|---|---|" + ("---|---|" if busy_head else "") + "---|---|---|")
  for name, ms, piped, comp, nbytes, finite, busy in rows:
    busy_cols = f" {busy:.3f} | {busy / base_busy:.2f}x |" if busy_head else ""
    print(f"| {name} | {ms:.3f} | {ms / base:.2f}x | {piped:.3f} | {piped / base_piped:.2f}x |"
          f"{busy_cols} {comp:.1f} | {nbytes / n:.3f} | {finite} |")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="CPU-sized pytree")
  ap.add_argument("--stacked", action="store_true",
                  help="block parameters stacked over layers (a scanned model's 26 leaves, not 150)")
  ap.add_argument("--muon", action="store_true", help="also time muon_nvfp4 vs optax.contrib.muon")
  ap.add_argument("--variants", action="store_true", help="diagnostic rows (see the docstring)")
  ap.add_argument("--profile", default=None, metavar="NAME",
                  help="only profile these optimizers' updates (comma-separated row names), print top ops")
  ap.add_argument("--top", type=int, default=30, help="ops listed by --profile")
  ap.add_argument("--runs", default=None, metavar="NAMES",
                  help="comma-separated names of the rows to time (default: all that the flags add)")
  ap.add_argument("--kernel-config", default=None, metavar="NAME=V[+NAME=V],...",
                  help="also time adamw_nvfp4 with these AdamKernelConfig fields replaced (one row per "
                       "comma-separated set), e.g. launch_group=1,stats_num_warps=8+atomic_slots=16")
  ap.add_argument("--busy", action="store_true",
                  help="also profile each row: the device's busy time per update (no host time)")
  ap.add_argument("--sequence", action="store_true",
                  help="with --busy: print each row's kernels of one update in the order they ran")
  ap.add_argument("--loop", type=int, default=0, metavar="N",
                  help="also time each row with N updates inside one jitted fori_loop (wall clock per "
                       "update, the host's per-call cost amortized)")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--skip-equality", action="store_true",
                  help="timings only (tests/gpu/test_optim_gpu.py checks GPU == CPU too)")
  ap.add_argument("--max-mismatch", type=float, default=1e-5,
                  help="largest tolerated share of NVFP4 codes differing GPU vs CPU")
  args = ap.parse_args(argv)
  require_gpu(ap, args.small, "--small")
  shapes = gpt2_shapes(128, 2, 1024, 128, args.stacked) if args.small else gpt2_shapes(stacked=args.stacked)
  iters = min(args.iters, 5) if args.small else args.iters
  params, grads = make_tree(shapes, 0, 0.0), make_tree(shapes, 1)
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  accel = jax.devices()[0]
  print(f"device: {accel.device_kind} ({accel.platform}), params: {n / 1e6:.1f}M", flush=True)

  runs = {"optax.adamw": optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1),
          "adamw_nvfp4": optim.adamw_nvfp4(1e-3),
          "adamw_nvfp4 (nearest rounding)": optim.adamw_nvfp4(1e-3, options=NEAREST),
          "adamw_nvfp4 (xla)": optim.adamw_nvfp4(1e-3, implementation="xla")}
  if args.muon:
    dims = lambda p: jax.tree.map(
        lambda m: optax.contrib.MuonDimensionNumbers() if m else None, optim.default_muon_mask(p))
    runs["optax.contrib.muon"] = optax.contrib.muon(0.02, adam_b2=0.95, muon_weight_dimension_numbers=dims)
    runs["muon_nvfp4"] = optim.muon_nvfp4(0.02, muon_mask=optim.default_muon_mask)
  if args.variants:
    runs["quantizer only: every grad leaf, nearest"] = _QuantizeOnly("nearest")
    runs["quantizer only: every grad leaf, stochastic"] = _QuantizeOnly("stochastic")
  if args.runs:
    wanted = args.runs.split(",")
    unknown = [w for w in wanted if w not in runs]
    if unknown:
      ap.error(f"--runs: unknown {unknown}; known: {sorted(runs)}")
    runs = {w: runs[w] for w in wanted}
  if args.profile:
    for name in args.profile.split(","):
      profile(runs[name], params, grads, name, top=args.top)
    return 0
  kernel = "pallas" if accel.platform == "gpu" else "pallas_interpret"  # (a CPU smoke run)
  for text in (args.kernel_config.split(",") if args.kernel_config else []):
    try:
      config = parse_kernel_config(text)
    except ValueError as e:
      ap.error(f"--kernel-config: {e}")
    runs[f"adamw_nvfp4 ({text})"] = optim.adamw_nvfp4(1e-3, implementation=kernel, block_sizes=config)
  rows, splits, loops, ok = [], {}, {}, True
  for name, tx in runs.items():
    ms, piped, comp, nbytes, finite = time_update(tx, params, grads, iters)
    busy = None
    if args.busy:
      busy, splits[name] = profile(tx, params, grads, name, report=False, sequence=args.sequence)
    if args.loop:
      loops[name] = time_in_loop(tx, params, grads, args.loop)
      print(f"  {name}: {loops[name]:.3f} ms per update, {args.loop} updates in one jit", flush=True)
    ok &= finite
    rows.append((name, ms, piped, comp, nbytes, finite, busy))
    print(f"  {name}: {ms:.3f} ms, back to back {piped:.3f} ms (compile {comp:.1f} s), "
          f"{nbytes / n:.3f} B/param, finite={finite}"
          + (f", device busy {busy:.3f} ms" if busy is not None else ""), flush=True)
  if splits:
    groups = (*KERNEL_GROUPS, "xla")
    print("\n| optimizer | " + " | ".join(f"{g} ms" for g in groups) + " |")
    print("|---|" + "---:|" * len(groups))
    for name, split in splits.items():
      print(f"| {name} | " + " | ".join(f"{split.get(g, 0.0):.3f}" for g in groups) + " |")

  if loops:
    base = next(iter(loops.values()))
    print(f"\n| optimizer | ms per update, {args.loop} in one jitted loop (wall clock) | vs {next(iter(loops))} |")
    print("|---|---:|---:|")
    for name, ms in loops.items():
      print(f"| {name} | {ms:.3f} | {ms / base:.2f}x |")

  if args.skip_equality:
    return _print_timings(rows, n, accel, args.stacked) or (0 if ok else 1)
  eq_shapes = gpt2_shapes(256, 2, 4096, 256)
  eq_params = make_tree(eq_shapes, 2, 0.0)
  grads_list = [make_tree(eq_shapes, 10 + i) for i in range(3)]
  eq_rows = []
  for name, tx in (("adamw_nvfp4", optim.adamw_nvfp4(1e-3)),
                   ("adamw_nvfp4 (nearest)", optim.adamw_nvfp4(1e-3, options=NEAREST))):
    w = equality(tx, eq_params, grads_list, accel)
    passed = (w["codes"] <= args.max_mismatch * w["n_codes"] and w["global"] == 0
              and w["fp32_state"] <= 1e-4 and w["updates"] <= 1e-5)
    ok &= passed
    eq_rows.append((name, w, passed))

  _print_timings(rows, n, accel, args.stacked)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(eq_params))
  print(f"\n### {accel.platform} vs CPU, 3 updates of a {n_params / 1e6:.1f}M pytree\n")
  print("| optimizer | codes differing | scales differing | global scales differing | "
        "fp32 state max rel diff | update max diff (rel. to max) | pass |")
  print("|---|---|---|---|---|---|---|")
  for name, w, passed in eq_rows:
    print(f"| {name} | {w['codes']} / {w['n_codes']} | {w['scales']} | {w['global']} | "
          f"{w['fp32_state']:.2e} | {w['updates']:.2e} | {passed} |")
  if accel.platform == "cpu":
    print("\n(accelerator is the CPU: the equality check compares the CPU with itself)")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
