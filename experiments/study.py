r"""The loss-gap study: BF16 against each NVFP4 module and the full stack, on one config.

  python -m experiments.study --config=experiments/configs/20m.py --workdir=runs/study \
      --arms=all|NAME,NAME [--config.steps=N ...] [--eval_tokens=N] [--collect=experiments/results/NAME]

``ARMS`` is the study: each arm is a recipe preset of ``fp4jax.recipe`` with recipe overrides, an
optional optimizer override (the Muon arms) and a seed; everything else is the config's, so the
arms share the data, the schedule and (at equal seed) the data order and the initialization. Every
arm trains with the launcher (``experiments.train.run``) in ``<workdir>/<arm>``: a finished arm is
reused, an interrupted one resumes. It logs the per-module quantization error every
``telemetry_every`` steps (``fp4jax.telemetry``; the config's value, or ``steps // 10`` when it is
0), and its final checkpoint is evaluated on the held-out split of the corpus
(``experiments.evaluate``; cached in ``<workdir>/<arm>/eval.json``).

After the arms of the command, every finished arm of the workdir goes into
``<workdir>/study.jsonl`` (one line per arm) and ``<workdir>/table.md``, printed too. The gap of an
arm is ``100 · (L − L̄) / L̄`` on the held-out loss, against the mean ``L̄`` of the bf16 seeds; the
spread of those seeds (min–max and standard deviation, in % of ``L̄``) is the noise floor.
``--collect=DIR`` copies the small logs (each arm's ``metrics.jsonl``, ``config.json`` and
``eval.json``, ``study.json``, ``study.jsonl``, ``table.md``) into ``DIR`` (e.g.
``experiments/results/<name>``, read by ``notebooks/loss_gap.ipynb``).

One arm per command (``--arms=fp4_linear``) fits a machine that limits the length of a command;
the table then grows with each. ``--parallel=N`` trains up to N arms at once, each in a process of
its own on the same device(s) (``<workdir>/logs/<arm>.log`` holds its output): for models small
enough that one arm leaves the GPU mostly idle. Arms trained that way share the device, so the
table marks their throughput (``tokens/s``, ``step ms``) with † (``shared_device`` in their row):
it is not the speed of their recipe. ``<workdir>/study.json`` records the study's config: a workdir of a
study with another config (model, data, steps, ...) is refused; a config field that the recorded
study lacks (a field added since, at its default) is not compared.

A study is a run too (``README.md``, Reliability): one study per workdir (``<workdir>/run.lock``); a
finished arm is reused only if its final checkpoint verifies and its run identity (what
``experiments.train`` checks on resume) is this command's, else the command refuses, naming the
fields (a corrupt final checkpoint trains again from the newest intact step). SIGTERM, SIGINT and
SIGHUP reach each arm in training once (``--parallel``: the arms run in sessions of their own, so a
terminal's Ctrl-C reaches the parent only, which forwards it); each arm saves its step and exits, the
command waits for them, says which arms stopped at which step, and exits with status 128 + the
signal; the same command resumes every arm. Each row states the step, corpus and size of its
evaluation (``eval_step``, ``eval_text``, ``eval_tokens``, ``eval_max_tokens``); a row evaluated
otherwise than this command asks (``comparable`` false) gets no gap and is not in the noise floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import evaluate as evaluate_lib
from experiments import train as launcher
from experiments.compare import BETWEEN_RUNS, run_summary
from fp4jax import data
from fp4jax.preemption import SIGNALS, StopSignals, TrainingInterrupted
from fp4jax.recipe import MODULES, PRESETS, Recipe
from fp4jax.train import NonFiniteLossError, OptimizerConfig
from fp4jax.workdir import RunLock

STUDY_FILE = "study.json"
ROWS_FILE = "study.jsonl"
TABLE_FILE = "table.md"
EVAL_FILE = "eval.json"
SHARED_FILE = "shared_device.json"  # {"parallel": N}: the arm trained beside others (--parallel)
ARM_LOGS = ("metrics.jsonl", "config.json", EVAL_FILE, SHARED_FILE)
# Set in the processes of --parallel: their arms train beside others.
_CHILD_ENV = "FP4JAX_STUDY_PARALLEL"
_PARENT_ENV = "FP4JAX_STUDY_PARENT"  # the parent's pid: an arm whose parent died stops itself
# Config fields that do not change what a run computes: a study may resume with others.
VOLATILE = ("progress", "tensorboard")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm of the study.

  Attributes:
    name: the arm's folder under the study's workdir and its row in the table.
    preset: the recipe preset (``fp4jax.recipe.PRESETS``); it sets the recipe's modules.
    recipe: recipe fields set after the preset. ``lora_resplit_every`` may be negative: ``-n``
      re-splits n times over the run (every ``steps // n`` steps).
    optimizer: ``OptimizerConfig`` fields set on the config's.
    seed: the run's seed (initialization, data order, rounding bits).
    group: ``bf16`` (the reference seeds), ``module``, ``muon``, ``linear`` (the linear layers'
      RHT and stochastic-rounding ablations), ``attention`` or ``lorasvd``.
    baseline: the arm an ablation is read against.
    what: what the arm measures.
  """

  name: str
  preset: str
  recipe: Mapping = dataclasses.field(default_factory=dict)
  optimizer: Mapping = dataclasses.field(default_factory=dict)
  seed: int = 0
  group: str = "module"
  baseline: str = "bf16_s0"
  what: str = ""


def _lora(name: str, what: str, **recipe) -> Arm:
  return Arm(name, "fp4_linear_lorasvd", recipe, group="lorasvd", baseline="fp4_linear_lorasvd",
             what=what)


def _attn(name: str, what: str, **recipe) -> Arm:
  return Arm(name, "fp4_full_stack", recipe, group="attention", baseline="fp4_full_stack",
             what=what)


def _gemm(name: str, what: str, seed: int = 0, **matmul) -> Arm:
  """An attribution arm: ``fp4_linear`` with only some GEMMs (or operands) in NVFP4, read against
  bf16 at the same seed."""
  return Arm(name, "fp4_linear", {"matmul": matmul}, seed=seed, group="attribution",
             baseline=f"bf16_s{seed}", what=what)


def _remedy(name: str, what: str, seed: int = 0, **matmul) -> Arm:
  """A linear-layer remedy: ``fp4_linear`` with one ``MatmulConfig`` change, read against
  ``fp4_linear`` at the same seed."""
  return Arm(name, "fp4_linear", {"matmul": matmul}, seed=seed, group="remedy",
             baseline="fp4_linear" if seed == 0 else f"fp4_linear_s{seed}", what=what)


_ONLY = {  # attribution arms: (what, MatmulConfig fields)
    "q_fwd": ("only the forward GEMM Q(x)·Q(W) in NVFP4", dict(dgrad=False, wgrad=False, hadamard=False)),
    "q_fwd_w": ("only Q(W) of the forward (x in BF16)", dict(dgrad=False, wgrad=False, hadamard=False,
                                                          bf16_operands="x")),
    "q_fwd_x": ("only Q(x) of the forward (W in BF16)", dict(dgrad=False, wgrad=False, hadamard=False,
                                                          bf16_operands="w")),
    "q_dgrad": ("only the dgrad GEMM Q(dy)·Q(W)ᵀ in NVFP4", dict(fwd=False, wgrad=False, hadamard=False)),
    "q_wgrad": ("only the wgrad GEMM Q(H·x)ᵀ·Q(H·dy) in NVFP4", dict(fwd=False, dgrad=False)),
}
_REMEDIES = {
    "split_mean": ("x and dy split as 1·μᵀ + R: the token mean in BF16, R in NVFP4",
                   dict(split="x,dy", split_method="mean")),
    "split_subspace": ("x and dy split as U·P + R: a rank-16 subspace per step in BF16, R in NVFP4",
                       dict(split="x,dy", split_method="subspace", split_rank=16)),
    "two_term_fwd": ("the forward's x and W as two NVFP4 terms Q1 + Q(a − Q1)", dict(two_term="x,w")),
    "two_term_x": ("the forward's x as two NVFP4 terms (W one term)", dict(two_term="x")),
    "two_term_w": ("the forward's W as two NVFP4 terms (x one term)", dict(two_term="w")),
    "two_term_bwd": ("the backward's dy (dgrad, wgrad) and H·x as two NVFP4 terms",
                     dict(two_term="dy_dgrad,x_wgrad,dy_wgrad")),
}


ARMS: tuple[Arm, ...] = (
    *(Arm(f"bf16_s{s}", "bf16", seed=s, group="bf16", baseline="",
          what=f"the reference, seed {s}: the seeds' spread is the noise floor") for s in range(3)),
    Arm("fp4_linear", "fp4_linear", what="every block projection in NVFP4 (NVIDIA's recipe: 1x16 "
        "activations and gradients, 16x16 weight tiles, SR on gradients, Hadamard on the wgrad)"),
    Arm("fp4_linear_lorasvd", "fp4_linear_lorasvd", baseline="fp4_linear",
        what="the same with the BF16 low-rank branch (LoRA-SVD, rank 16, split once at init)"),
    Arm("lorasvd_states", "fp4_linear_lorasvd", {"optimizer_states": "nvfp4"},
        baseline="fp4_linear_lorasvd", what="LoRA-SVD linear layers + AdamW moments in NVFP4"),
    Arm("fp4_full_stack", "fp4_full_stack", baseline="lorasvd_states",
        what="LoRA-SVD linear + NVFP4 AdamW states + NVFP4 attention (QK^T and dS, tensor reuse)"),
    Arm("muon_bf16", "bf16", optimizer={"name": "muon"}, group="muon", baseline="bf16_s0",
        what="Muon (AdamW on embedding, head, vectors) with BF16 Newton-Schulz operands"),
    Arm("muon_nvfp4", "bf16", {"newton_schulz": "nvfp4"}, {"name": "muon"}, group="muon",
        baseline="muon_bf16", what="Muon with NVFP4 Newton-Schulz operands (fp32 accumulation)"),
    _attn("pv_quantized", "V, P, dO in NVFP4 too: P.V, dO.V^T, P^T.dO quantized, not protected",
          attention_op={"v": "nvfp4", "p": "nvfp4", "do": "nvfp4"}),
    _attn("ds_bf16", "dS in BF16: dQ = dS.K and dK = dS^T.Q unquantized", attention_op={"ds": "bf16"}),
    _attn("no_reuse", "the backward on the unquantized q, k instead of the forward's Q(q), Q(k)",
          attention_op={"reuse": False}),
    Arm("no_rht", "fp4_linear", {"matmul": {"hadamard": False}}, group="linear", baseline="fp4_linear",
        what="fp4_linear without the random Hadamard transform of the wgrad operands"),
    Arm("sr_off", "fp4_linear", {"matmul": {"dy_dgrad_rounding": "nearest",
                                         "dy_wgrad_rounding": "nearest"}}, group="linear",
        baseline="fp4_linear", what="fp4_linear with dy rounded to nearest, not stochastically "
        "(dgrad and wgrad)"),
    _lora("lorasvd_resplit10", "re-split the branch 10 times over the run (top-r SVD of the "
          "trained weight)", lora_resplit_every=-10),
    _lora("lorasvd_rank4", "rank 4 instead of 16", lora_rank=4),
    _lora("lorasvd_rank32", "rank 32 instead of 16", lora_rank=32),
    _lora("lorasvd_lr0", "the branch frozen at its init split (learning rate x0)",
          lora_lr_scale=0.0),
    _lora("lorasvd_lr4", "the branch's learning rate x4", lora_lr_scale=4.0),
    _lora("lorasvd_attn", "the branch on the attention projections only (qkv, o)",
          lora_projections="qkv,o"),
    _lora("lorasvd_mlp", "the branch on the MLP projections only (gate_up, down)",
          lora_projections="gate_up,down"),
    Arm("fp4_linear_s1", "fp4_linear", seed=1, baseline="bf16_s1", what="fp4_linear, seed 1"),
    *(_gemm(name + (f"_s{s}" if s else ""), what + (f", seed {s}" if s else ""), s, **fields)
      for s in (0, 1) for name, (what, fields) in _ONLY.items()),
    *(_remedy(name + (f"_s{s}" if s else ""), what + (f", seed {s}" if s else ""), s, **fields)
      for s in (0, 1) for name, (what, fields) in _REMEDIES.items()),
)
ARM_NAMES = tuple(a.name for a in ARMS)
_BY_NAME = {a.name: a for a in ARMS}


def select_arms(spec: str | Sequence[str]) -> list[Arm]:
  """The arms of ``--arms``: ``all`` or names separated by commas, in the order of ``ARMS``.

  Raises:
    ValueError: an unknown or repeated name, or none.
  """
  names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
  if names == ["all"]:
    return list(ARMS)
  unknown = [n for n in names if n not in _BY_NAME]
  if unknown or not names or len(set(names)) != len(names):
    what = f"unknown arm(s) {unknown}" if unknown else "give distinct arm names"
    raise ValueError(f"--arms={','.join(names)}: {what}; the arms are all, or some of: "
                     f"{', '.join(ARM_NAMES)}")
  return [a for a in ARMS if a.name in names]


def telemetry_every(cfg) -> int:
  """The config's ``telemetry_every``, or ``steps // 10`` (at least 1) when it is 0."""
  return cfg.telemetry_every or max(1, cfg.steps // 10)


def arm_config(cfg, arm: Arm, telemetry: bool = True):
  """The config of ``arm``: ``cfg`` with the preset's modules, the arm's recipe and optimizer
  fields, its seed and the study's telemetry (``telemetry_every(cfg)``; off without
  ``telemetry``); checked (``ValueError``) like the launcher's."""
  recipe_fields = {f.name for f in dataclasses.fields(Recipe)}
  opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
  if arm.preset not in PRESETS or set(arm.recipe) - recipe_fields or set(arm.optimizer) - opt_fields:
    raise ValueError(f"arm {arm.name}: unknown preset or field (preset {arm.preset!r}, recipe "
                     f"{dict(arm.recipe)}, optimizer {dict(arm.optimizer)})")
  c = cfg.copy_and_resolve_references()
  preset = PRESETS[arm.preset]
  recipe = {**{k: getattr(preset, k) for k in MODULES}, **arm.recipe}
  if recipe.get("lora_resplit_every", 0) < 0:
    recipe["lora_resplit_every"] = max(1, c.steps // -recipe["lora_resplit_every"])
  c.recipe.update(recipe)
  c.optimizer.update(dict(arm.optimizer))
  c.seed = arm.seed
  c.telemetry_every = telemetry_every(c) if telemetry else 0
  launcher.from_config(c, vocab_size=c.model.vocab_size or 256)
  return c


def _plain(v):
  """A config value as JSON-able plain data (a nested section as a dict)."""
  return v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v


def _flat(d: Mapping, prefix: str = "") -> dict:
  """``{"matmul": {"hadamard": False}}`` as ``{"matmul.hadamard": False}``."""
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
  return out


def _identity(cfg) -> dict:
  c = cfg.to_dict()
  for k in VOLATILE:
    c.pop(k, None)
  return c


def check_workdir(cfg, workdir: Path) -> None:
  """Records the study's config in ``<workdir>/study.json``, or checks it against the recorded one
  (a field absent from the recorded config is not compared: the recorded study predates it).

  Raises:
    ValueError: the workdir holds a study of another config (the differing fields are named).
  """
  path = workdir / STUDY_FILE
  mine = _identity(cfg)
  if not path.is_file():
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": mine}, indent=1) + "\n")
    return
  theirs = json.loads(path.read_text())["config"]
  diffs = sorted(_diff_keys(theirs, mine))
  if diffs:
    shown = "; ".join(f"{k}: study {a!r}, this command {b!r}" for k, a, b in diffs[:6])
    raise ValueError(f"{workdir} holds a study of another config ({shown}{' ...' * (len(diffs) > 6)})"
                     f": use another --workdir, or the study's settings ({path})")


def _diff_keys(a, b, prefix=""):
  """``(path, a, b)`` of the leaves of ``a`` that differ in ``b``."""
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    for k in sorted(a):
      yield from _diff_keys(a[k], b.get(k, "<absent>"), f"{prefix}{k}.")
  elif (list(a) if isinstance(a, list | tuple) else a) != (list(b) if isinstance(b, list | tuple)
                                                          else b):
    yield prefix[:-1], a, b


def is_finished(workdir: Path, steps: int) -> bool:
  return (workdir / "checkpoints" / str(steps)).is_dir()


def evaluate_arm(workdir: Path, corpus: str, steps: int, max_tokens: int | None,
                 batch_size: int | None) -> dict:
  """Held-out loss of a finished arm (``experiments.evaluate``), cached in ``eval.json`` for its
  step and settings. ``step`` is the step evaluated: the newest intact checkpoint's, which is not
  ``steps`` if the final checkpoint turned out corrupt (it is moved aside, and the next run of the
  study trains the arm again from there)."""
  path = workdir / EVAL_FILE
  key = {"text": corpus, "max_tokens": max_tokens}
  if path.is_file():
    cached = json.loads(path.read_text())
    if cached.get("step") == steps and all(cached.get(k) == v for k, v in key.items()):
      return cached
  r = evaluate_lib.evaluate(workdir, corpus, "validation", max_tokens, batch_size)
  r.update(key)
  if r["step"] != steps:
    print(f"{workdir.name}: evaluated at step {r['step']}, not {steps}: the final checkpoint is "
          "not intact; the row says so and is not compared", flush=True)
  tmp = path.with_name(EVAL_FILE + ".tmp")
  tmp.write_text(json.dumps(r, indent=1) + "\n")
  os.replace(tmp, path)
  return r


def run_arm(cfg, arm: Arm, workdir: Path, eval_tokens: int | None = None,
            eval_batch_size: int | None = None, telemetry: bool = True) -> str:
  """Trains (or reuses, or resumes) one arm and evaluates it; returns its status ("trained",
  "reused" or "diverged")."""
  c = arm_config(cfg, arm, telemetry)
  run_dir = workdir / arm.name
  status = "reused"
  if not launcher.finished_run(c, run_dir):
    status = "trained"
    (run_dir / EVAL_FILE).unlink(missing_ok=True)  # of an earlier checkpoint
    if not os.environ.get(_CHILD_ENV):  # trained alone: its throughput is its own
      (run_dir / SHARED_FILE).unlink(missing_ok=True)
    try:
      launcher.run(c, run_dir)
    except NonFiniteLossError as e:
      print(f"{arm.name}: {e}", flush=True)
      (run_dir / "diverged.json").write_text(json.dumps({"error": str(e)}) + "\n")
      return "diverged"
  (run_dir / "diverged.json").unlink(missing_ok=True)
  evaluate_arm(run_dir, c.data.corpus, c.steps, eval_tokens, eval_batch_size)
  return status


def arm_row(cfg, arm: Arm, workdir: Path, eval_tokens: int | None = None) -> dict | None:
  """The study's row of one arm (None if it has not run): losses, tokens, throughput, epochs, and
  its evaluation's step, corpus and size; ``comparable`` if that evaluation is the one this study
  asks for (step ``steps``, the config's corpus, at most ``eval_tokens`` tokens)."""
  run_dir = workdir / arm.name
  c = arm_config(cfg, arm)
  diverged = (run_dir / "diverged.json").is_file()
  if not diverged and not (run_dir / EVAL_FILE).is_file():
    return None
  s = run_summary(run_dir)
  run = json.loads((run_dir / "config.json").read_text())
  meta = data.read_meta(run["data_dir"])
  tokens = c.steps * c.batch_size * c.seq_len
  ev = {} if diverged else json.loads((run_dir / EVAL_FILE).read_text())
  step_time = s.get("step_time_s", math.nan)
  shared = run_dir / SHARED_FILE
  parallel = json.loads(shared.read_text())["parallel"] if shared.is_file() else 1
  overrides = {k: _plain(c.recipe[k]) for k in arm.recipe}  # lora_resplit_every resolved
  recipe = {**{k: c.recipe[k] for k in MODULES}, **overrides}
  comparable = (not diverged and ev.get("step") == c.steps and ev.get("text") == c.data.corpus
                and ev.get("max_tokens") == eval_tokens)
  return {"arm": arm.name, "status": "diverged" if diverged else "ok", "group": arm.group,
          "baseline": arm.baseline, "preset": arm.preset, "overrides": overrides, "recipe": recipe,
          "optimizer": c.optimizer.name, "seed": arm.seed,
          "eval_loss": ev.get("loss", math.nan), "eval_tokens": ev.get("tokens", 0),
          "eval_step": ev.get("step"), "eval_text": ev.get("text"),
          "eval_max_tokens": ev.get("max_tokens"), "comparable": comparable,
          "train_loss": s.get("train_loss", math.nan), "step": s.get("step", 0),
          "tokens": tokens, "params": run["num_params"],
          "tokens_per_s": c.batch_size * c.seq_len / step_time if step_time > 0 else math.nan,
          "epochs": tokens / meta.splits["train"]["num_tokens"], "step_time_s": step_time,
          "shared_device": parallel, "platform": run.get("platform"), "devices": run.get("devices")}


def add_gaps(rows: list[dict]) -> dict:
  """Adds ``gap_pct`` (eval loss against the bf16 seed mean) and ``baseline_gap_pct`` (against the
  row's ``baseline`` arm, NaN without one) to every row; returns the noise floor ``{"n", "mean",
  "min", "max", "std", "spread_pct", "std_pct"}`` of the bf16 seeds (``spread_pct``: (max − min) /
  mean in %; ``std``: sample standard deviation, 0 for one seed). Rows whose ``comparable`` is
  false (evaluated at another step, size or corpus) get NaN gaps and are not in the floor."""
  ok = [r for r in rows if r.get("comparable", True)]
  losses = {r["arm"]: r["eval_loss"] for r in ok}
  for r in rows:
    base = losses.get(r.get("baseline"), math.nan)
    mine = r["eval_loss"] if r.get("comparable", True) else math.nan
    r["baseline_gap_pct"] = 100 * (mine - base) / base
  ref = [r["eval_loss"] for r in ok
         if r["group"] == "bf16" and r["status"] == "ok" and math.isfinite(r["eval_loss"])]
  if not ref:
    for r in rows:
      r["gap_pct"] = math.nan
    return {"n": 0}
  mean = sum(ref) / len(ref)
  std = statistics.stdev(ref) if len(ref) > 1 else 0.0
  for r in rows:
    r["gap_pct"] = 100 * (r["eval_loss"] - mean) / mean if r.get("comparable", True) else math.nan
  return {"n": len(ref), "mean": mean, "min": min(ref), "max": max(ref), "std": std,
          "spread_pct": 100 * (max(ref) - min(ref)) / mean, "std_pct": 100 * std / mean}


def _fmt(x: float, spec: str) -> str:
  return format(x, spec) if isinstance(x, int | float) and math.isfinite(x) else "–"


def _baseline(r: dict) -> str:
  gap = r.get("baseline_gap_pct", math.nan)
  return f"{gap:+.2f} ({r['baseline']})" if math.isfinite(gap) else "–"


def table(rows: list[dict], floor: dict, title: str = "") -> str:
  """The Markdown table of the study: one line per arm and the bf16 seeds' noise floor."""
  lines = [title, ""] if title else []
  if floor.get("n"):
    lines.append(f"bf16 reference: mean eval loss {floor['mean']:.4f} over {floor['n']} seed(s), "
                 f"min–max {floor['min']:.4f}–{floor['max']:.4f} (spread {floor['spread_pct']:.2f}% "
                 f"of the mean, std {floor['std_pct']:.2f}%): gaps inside that spread are noise.")
  else:
    lines.append("no bf16 seed has finished: no gaps yet.")
  lines += ["", "| arm | recipe | seed | eval loss | eval step | eval tokens | gap % | vs baseline % "
            "| train loss | tokens | params | tokens/s | epochs | step ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    mods = [r["preset"]] + [f"{k}={v}" for k, v in _flat(r["overrides"]).items()]
    if r["optimizer"] != "adamw":
      mods.append(f"optimizer={r['optimizer']}")
    eval_loss = "diverged" if r["status"] == "diverged" else _fmt(r["eval_loss"], ".4f")
    mark = " †" if r.get("shared_device", 1) > 1 else ""
    other = r["status"] != "diverged" and not r.get("comparable", True)
    gap = "not compared ‡" if other else _fmt(r["gap_pct"], "+.2f")
    ev_step = "–" if r.get("eval_step") is None else str(r["eval_step"])
    ev_tokens = f"{r['eval_tokens']:,}" if r.get("eval_tokens") else "–"
    lines.append(f"| {r['arm']} | {', '.join(mods)} | {r['seed']} | {eval_loss} | {ev_step} | "
                 f"{ev_tokens} | {gap} | {_baseline(r)} | {_fmt(r['train_loss'], '.4f')} | "
                 f"{r['tokens']:,} | {r['params']:,} | {_fmt(r['tokens_per_s'], ',.0f')}{mark} | "
                 f"{_fmt(r['epochs'], '.3g')} | {_fmt(1000 * r['step_time_s'], '.0f')}{mark} |")
  if any(r["status"] != "diverged" and not r.get("comparable", True) for r in rows):
    lines += ["", "‡ evaluated at another step, on another corpus or number of tokens than this "
              "study's evaluation: not compared (run the study with `--arms=` that arm and this "
              "command's `--eval_tokens` to evaluate it again)."]
  shared = sorted({r["shared_device"] for r in rows if r.get("shared_device", 1) > 1})
  if shared:
    lines += ["", f"† trained with up to {shared[-1]} arms at once on the same device(s) "
              "(`--parallel`): the throughput of a shared device, not of the recipe."]
  return "\n".join(lines)


def write_results(cfg, workdir: Path, eval_tokens: int | None = None) -> tuple[list[dict], str]:
  """Writes ``study.jsonl`` and ``table.md`` from every finished arm of ``workdir``; rows
  evaluated on other than ``eval_tokens`` held-out tokens (at most; None: the whole split) are not
  compared."""
  rows = [r for a in ARMS if (r := arm_row(cfg, a, workdir, eval_tokens)) is not None]
  floor = add_gaps(rows)
  with open(workdir / ROWS_FILE, "w") as f:
    for r in rows:
      f.write(json.dumps({**r, "noise_floor": floor}) + "\n")
  platform = rows[0]["platform"] if rows else "?"
  title = (f"Loss-gap study: config {cfg.name}, {cfg.steps} steps x {cfg.batch_size} x "
           f"{cfg.seq_len} tokens, corpus {cfg.data.corpus}, on {platform}; eval loss on the "
           "held-out split.")
  text = table(rows, floor, title)
  (workdir / TABLE_FILE).write_text(text + "\n")
  return rows, text


def collect(workdir: Path, dest: Path) -> list[Path]:
  """Copies the study's small logs into ``dest`` (replacing its arm folders); returns the files."""
  dest.mkdir(parents=True, exist_ok=True)
  out = []
  for name in (STUDY_FILE, ROWS_FILE, TABLE_FILE):
    if (workdir / name).is_file():
      out.append(Path(shutil.copy2(workdir / name, dest / name)))
  for arm in ARM_NAMES:
    src = workdir / arm
    if not (src / "metrics.jsonl").is_file():
      continue
    shutil.rmtree(dest / arm, ignore_errors=True)
    (dest / arm).mkdir()
    out += [Path(shutil.copy2(src / f, dest / arm / f)) for f in ARM_LOGS if (src / f).is_file()]
  return out


def child_command(argv: Sequence[str], arm: str) -> list[str]:
  """The command line of one arm's process under ``--parallel``: this command's flags (``argv``,
  without the program name) with ``--arms=arm`` and without ``--arms``, ``--parallel`` and
  ``--collect`` (the parent collects once all have finished)."""
  out, skip_value = [], False
  for a in argv:
    if skip_value:
      skip_value = False
      continue
    if a.split("=", 1)[0] in ("--arms", "--parallel", "--collect"):
      skip_value = "=" not in a
      continue
    out.append(a)
  return [sys.executable, "-m", "experiments.study", *out, f"--arms={arm}"]


class _Forward:
  """The parent's handling of SIGTERM / SIGINT / SIGHUP under ``--parallel``: a signal is recorded
  (Python handler) and the loop forwards each one to every running arm once."""

  def __enter__(self) -> _Forward:
    self.received: list[int] = []
    self._active = threading.current_thread() is threading.main_thread()
    if self._active:
      self._old = {s: signal.signal(s, lambda signum, _: self.received.append(signum))
                   for s in SIGNALS}
      self._old_fd = signal.set_wakeup_fd(-1)  # an enclosing StopSignals must not exit now
    return self

  def __exit__(self, *exc) -> None:
    if self._active:
      signal.set_wakeup_fd(self._old_fd)
      for s, h in self._old.items():
        signal.signal(s, h)


def _watch_parent() -> None:
  """In an arm's process under ``--parallel``: a parent that died (SIGKILL) leaves no orphan; the
  arm stops as on SIGTERM (saving its step)."""
  parent = int(os.environ.get(_PARENT_ENV, "0"))

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
  if parent:
    threading.Thread(target=watch, name="fp4jax-study-parent", daemon=True).start()


def _stop_line(log: Path) -> str:
  """The arm's own line about its stop (``stopped by ...``), or its last line."""
  lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
  return next((x for x in reversed(lines) if x.startswith("stopped by")), lines[-1])


def run_parallel(cfg, workdir: Path, arms: Sequence[Arm], parallel: int,
                 argv: Sequence[str]) -> list[str]:
  """Runs each arm as ``python -m experiments.study --arms=ARM`` (``child_command``), up to
  ``parallel`` processes at once, each in a session of its own and appending to
  ``<workdir>/logs/<arm>.log``; prints when each starts and ends. An arm that is not finished yet
  gets ``shared_device.json`` (its throughput is that of a shared device). The processes do not
  preallocate device memory and each may take up to ``0.9 / parallel`` of it
  (``XLA_PYTHON_CLIENT_PREALLOCATE`` false, ``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set).

  A SIGTERM, SIGINT or SIGHUP is forwarded once to every running arm (each saves its step and
  exits), no further arm starts, and once all have exited ``TrainingInterrupted`` names where each
  stopped. Returns the names of the arms whose process failed."""
  logs = workdir / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  repo = str(Path(__file__).resolve().parents[1])
  env = {**os.environ, _CHILD_ENV: str(parallel), _PARENT_ENV: str(os.getpid()),
         "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  # Each process's allocator may grow to this share of the device, so together they fit on it.
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
  pending, running, failed, done = list(arms), {}, [], 0
  finished, stopped = [], {}
  with _Forward() as fwd:
    try:
      while pending or running:
        while pending and len(running) < parallel and not fwd.received:
          arm = pending.pop(0)
          run_dir = workdir / arm.name
          if not is_finished(run_dir, cfg.steps):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / SHARED_FILE).write_text(json.dumps({"parallel": parallel}) + "\n")
          log = open(logs / f"{arm.name}.log", "a")  # closed when its process ends
          log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(child_command(argv, arm.name))}\n")
          log.flush()
          proc = subprocess.Popen(child_command(argv, arm.name), stdout=log,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
          running[arm.name] = [proc, log, time.perf_counter(), 0]
          print(f"=== arm {arm.name}: started ({len(running)} running, {done}/{len(arms)} done), "
                f"log {logs / (arm.name + '.log')} — {arm.what}", flush=True)
        time.sleep(0.2)
        for entry in running.values():  # each signal reaches each running arm once
          for signum in fwd.received[entry[3]:]:
            if entry[0].poll() is None:
              entry[0].send_signal(signum)
          entry[3] = len(fwd.received)
        for name, (proc, log, t0, _) in list(running.items()):
          if proc.poll() is None:
            continue
          log.close()
          del running[name]
          done += 1
          rc = proc.returncode
          if fwd.received and rc in [128 + s for s in SIGNALS] + [-s for s in SIGNALS]:
            stopped[name] = _stop_line(logs / f"{name}.log")
            print(f"=== arm {name}: {stopped[name]}", flush=True)
          elif rc:
            failed.append(name)
            tail = (logs / f"{name}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
            print(f"=== arm {name}: FAILED (exit {rc}) in "
                  f"{time.perf_counter() - t0:.0f} s: {tail[0]}", flush=True)
          else:
            finished.append(name)
            ev_path = workdir / name / EVAL_FILE  # absent for a diverged arm
            ev = json.loads(ev_path.read_text()) if ev_path.is_file() else {}
            print(f"=== arm {name}: done in {time.perf_counter() - t0:.0f} s, eval loss "
                  f"{ev.get('loss', math.nan):.4f} ({done}/{len(arms)})", flush=True)
    finally:  # an error in the parent: its arms stop as on SIGTERM (each saves its step)
      for proc, _, _, _ in running.values():
        if proc.poll() is None:
          proc.terminate()
      for proc, log, _, _ in running.values():
        proc.wait()
        log.close()
  if fwd.received:
    signum = fwd.received[0]
    parts = [f"stopped by {signal.Signals(signum).name}: "
             + "; ".join(f"arm {n}: {line}" for n, line in stopped.items())]
    if finished:
      parts.append(f"finished: {', '.join(finished)}")
    if failed:
      parts.append(f"failed: {', '.join(failed)} (see {logs})")
    if pending:
      parts.append(f"not started: {', '.join(a.name for a in pending)}")
    raise TrainingInterrupted("; ".join(parts) + "; the same command resumes every arm", signum,
                              -1, str(workdir))
  return failed


def study(cfg, workdir: str | Path, arms: str | Sequence[str], eval_tokens: int | None = None,
          eval_batch_size: int | None = None, collect_to: str | Path | None = None,
          telemetry: bool = True, parallel: int = 1, argv: Sequence[str] = ()) -> list[dict]:
  """Runs the selected arms, then writes (and optionally collects) the study's rows and table.

  Args:
    eval_tokens: held-out tokens per arm's evaluation (default: the config's ``study.eval_tokens``,
      else the whole validation split).
    parallel: with more than 1, the arms train up to that many at a time, each in a process of its
      own (``run_parallel``) started with this command's flags ``argv`` (the program's command line
      without its name).

  Returns:
    The rows of ``study.jsonl`` (every finished arm of the workdir).

  Raises:
    experiments.train.RunsFailedError: after the table, if an arm's process failed under
      ``parallel``.
  """
  workdir = Path(workdir)
  if eval_tokens is None:  # the config's study.eval_tokens, if it sets one
    eval_tokens = cfg.get("study", {}).get("eval_tokens")
  selected = select_arms(arms)
  if parallel < 1:
    raise ValueError(f"--parallel={parallel}: give 1 or more arms at a time")
  for arm in selected:  # every arm's config is checked before any trains
    arm_config(cfg, arm)
  child = bool(os.environ.get(_CHILD_ENV))  # an arm of --parallel: the parent holds the lock
  workdir.mkdir(parents=True, exist_ok=True)
  lock = RunLock(workdir, "study")
  with lock if not child else contextlib.nullcontext(), StopSignals(
      lambda t: print(t, flush=True), BETWEEN_RUNS, lambda: lock.release(force=True)):
    for note in lock.notes:
      print(note, flush=True)
    check_workdir(cfg, workdir)
    if not child:  # every finished arm to reuse is checked before any trains
      for arm in selected:
        launcher.finished_run(arm_config(cfg, arm, telemetry), workdir / arm.name)
    failed = []
    if parallel > 1 and len(selected) > 1:
      failed = run_parallel(cfg, workdir, selected, parallel, argv)
    else:
      for i, arm in enumerate(selected, 1):
        print(f"=== arm {arm.name} ({i}/{len(selected)}): {workdir / arm.name} — {arm.what}",
              flush=True)
        t0 = time.perf_counter()
        try:
          status = run_arm(cfg, arm, workdir, eval_tokens, eval_batch_size, telemetry)
        except TrainingInterrupted as e:
          if child:
            raise
          raise launcher.stopped_among(e, "arm", arm.name, [a.name for a in selected[:i - 1]],
                                       [a.name for a in selected[i:]]) from None
        ev = json.loads((workdir / arm.name / EVAL_FILE).read_text()) if status != "diverged" else {}
        print(f"=== arm {arm.name}: {status} in {time.perf_counter() - t0:.0f} s, eval loss "
              f"{ev.get('loss', math.nan):.4f}", flush=True)
    rows, text = write_results(cfg, workdir, eval_tokens)
  print("\n" + text, flush=True)
  if collect_to is not None:
    files = collect(workdir, Path(collect_to))
    print(f"\ncollected {len(files)} files into {collect_to}", flush=True)
  if failed:
    raise launcher.RunsFailedError(f"arm(s) {', '.join(failed)} failed; their output is in "
                          f"{workdir / 'logs'}/<arm>.log")
  return rows


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
  flags.DEFINE_string("workdir", None, "the study's folder: one run folder per arm")
  flags.DEFINE_string("arms", None, f"all, or some of: {','.join(ARM_NAMES)}")
  flags.DEFINE_integer("eval_tokens", None, "evaluate at most this many held-out tokens")
  flags.DEFINE_integer("eval_batch_size", None, "evaluation batch (default: the run's)")
  flags.DEFINE_string("collect", None, "copy the small logs into this folder")
  flags.DEFINE_bool("telemetry", True, "log the per-module quantization error (--notelemetry: off)")
  flags.DEFINE_integer("parallel", 1, "train up to this many arms at once, one process each")
  flags.DEFINE_bool("verbose", False, "print the traceback of errors (also FP4JAX_VERBOSE=1)")
  launcher.define_cache_flag()


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint operation at INFO
  fl = flags.FLAGS
  launcher.check_command_line(argv, "python -m experiments.study --config=experiments/configs/"
                              "tiny.py --workdir=runs/study --arms=all", "config", "workdir",
                              "arms")
  launcher.enable_compilation_cache(fl.compilation_cache)
  _watch_parent()
  launcher.report_errors(lambda: study(fl.config, fl.workdir, fl.arms, fl.eval_tokens,
                                       fl.eval_batch_size, fl.collect, fl.telemetry, fl.parallel,
                                       sys.argv[1:]), fl.verbose)


if __name__ == "__main__":
  define_flags()
  app.run(main)
