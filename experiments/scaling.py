r"""The scaling fit of the loss-gap study: a BF16 loss law L(N, D) and each NVFP4 recipe's efficiencies.

The law is the low-precision scaling law of Quartet (Castro et al., "Quartet: Native FP4 Training Can
Be Optimal for Large Language Models", arXiv:2505.14669; the fit of the authors' ``notebooks/plots.ipynb``
in github.com/IST-DASLab/Quartet)::

  L(N, D) = (A / (N · eff_N)^α + B / (D · eff_D)^β)^γ + E

N the parameters, D the training tokens. BF16 has ``eff_N = eff_D = 1`` and fits the six constants
(A, α, B, β, E, γ); a low-precision recipe keeps BF16's constants and fits its effective-parameter
efficiency ``eff_N`` (a recipe trains like a BF16 model of ``eff_N · N`` parameters) and its
effective-data efficiency ``eff_D`` (like BF16 on ``eff_D · D`` tokens). As Quartet's fit, each is a
least-squares fit of the residuals ``log L − log L̂`` under a Huber loss of threshold ``huber_delta``
(1e-4), over ``log A``, ``log B`` and ``log E`` for the scales, from several starting points (Quartet's
fit: α 0.579, β 0.539, γ 0.276, E 1.341 on C4; eff_N 0.645 for an MXFP4 forward pass, eff_D 0.893 for
an MXFP4 backward pass).

The points are the finished arms of one or more studies (``experiments.study``), read from the
``study.jsonl`` of a results folder and of its subfolders (``experiments/results/<name>`` or a folder
of those, one per grid point: ``experiments/configs/grid.py``): N is a row's ``params``, D its
``tokens``, L its held-out ``eval_loss``. The bf16 seeds (the reference arms) fit the law; the other
arms are grouped by their recipe (the table's ``recipe`` column: preset and changes), seeds and grid
points together. Confidence intervals are percentile intervals of a bootstrap that resamples the
seeds: at a point with several seeds of a recipe, its seeds are drawn with replacement; at a point with
one, its loss moves by a deviation of log L drawn from a pool of the seeds' deviations from their
point's mean (each scaled by √(n/(n−1))) and the fits' residuals (the law's and each recipe's, scaled
by √(n/(n−k)) for k fitted values), which holds the noise of training and the law's misfit. Every
replicate refits the law (from the fit's constants) and then each recipe's efficiencies.

  python -m experiments.study --fit --results=experiments/results/grid_h100 [--fit_fixed=gamma=0.276]
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

LAW_PARAMS = ("A", "alpha", "B", "beta", "E", "gamma")
TARGET_N, TARGET_D = 3e9, 64e9  # the method's model and tokens
METHOD_GAP_PCT = 1.47  # the method's NVFP4 gap at TARGET_N, TARGET_D
HUBER_DELTA = 1e-4  # Quartet's threshold on the residuals of log L
_LOG_SCALES = ("A", "B", "E")  # fitted as their logarithms
_BOUNDS = {"A": (-30.0, 60.0), "alpha": (1e-3, 3.0), "B": (-30.0, 60.0), "beta": (1e-3, 3.0),
           "E": (-10.0, 5.0), "gamma": (1e-2, 5.0)}
_STARTS = {"A": (0.0, 5.0, 10.0), "alpha": (0.3, 0.6), "B": (0.0, 5.0, 10.0), "beta": (0.3, 0.6),
           "E": (0.0, 0.5), "gamma": (0.3, 1.0)}
_EFF_BOUNDS = (-5.0, 3.0)  # log eff


@dataclasses.dataclass(frozen=True)
class Point:
  """One finished arm: its recipe, whether it is a bf16 reference seed, N, D, loss and seed."""

  recipe: str
  reference: bool
  n: float
  d: float
  loss: float
  seed: int = 0
  arm: str = ""
  epochs: float = math.nan


@dataclasses.dataclass(frozen=True)
class Law:
  """The constants of ``L(N, D) = (A/(N·eff_N)^α + B/(D·eff_D)^β)^γ + E``."""

  A: float
  alpha: float
  B: float
  beta: float
  E: float
  gamma: float

  def loss(self, n, d, eff_n=1.0, eff_d=1.0):
    """The law's loss at ``n`` parameters and ``d`` tokens (arrays broadcast)."""
    return law_loss(self.theta(), n, d, eff_n, eff_d)

  def theta(self) -> np.ndarray:
    """The fit's coordinates: log A, α, log B, β, log E, γ."""
    return np.array([math.log(v) if k in _LOG_SCALES else v
                     for k, v in zip(LAW_PARAMS, dataclasses.astuple(self), strict=True)])

  @classmethod
  def from_theta(cls, theta) -> Law:
    return cls(*(math.exp(t) if k in _LOG_SCALES else float(t) for k, t in zip(LAW_PARAMS, theta, strict=True)))


def law_loss(theta, n, d, eff_n=1.0, eff_d=1.0):
  """``(e^a/(N·eff_N)^α + e^b/(D·eff_D)^β)^γ + e^e`` at ``theta = (a, α, b, β, e, γ)``, in log space
  for the sum (no overflow of the power terms)."""
  a, alpha, b, beta, e, gamma = theta
  log_terms = np.logaddexp(a - alpha * np.log(np.asarray(n, float) * eff_n),
                           b - beta * np.log(np.asarray(d, float) * eff_d))
  return np.exp(gamma * log_terms) + np.exp(e)


def _law_and_grad(theta, n, d, eff_n=1.0, eff_d=1.0):
  """``law_loss`` and its derivatives by ``theta`` (one column per coordinate) and by ``log eff_N``,
  ``log eff_D`` (the last two columns)."""
  a, alpha, b, beta, e, gamma = theta
  log_n, log_d = np.log(np.asarray(n, float) * eff_n), np.log(np.asarray(d, float) * eff_d)
  u, v = a - alpha * log_n, b - beta * log_d
  s = np.logaddexp(u, v)
  power = np.exp(gamma * s)
  gu, gv = gamma * power * np.exp(u - s), gamma * power * np.exp(v - s)
  grad = np.stack([gu, -gu * log_n, gv, -gv * log_d, np.full_like(s, math.exp(e)), power * s,
                   -alpha * gu, -beta * gv], axis=-1)
  return power + math.exp(e), grad


def gap_pct(law: Law, eff_n: float, eff_d: float, n: float = TARGET_N, d: float = TARGET_D) -> float:
  """The recipe's loss over BF16's at ``n``, ``d``, in percent: ``100 · (L(N·eff_N, D·eff_D) / L(N, D) − 1)``."""
  return 100.0 * (float(law.loss(n, d, eff_n, eff_d)) / float(law.loss(n, d)) - 1.0)


def _distinct(points: Sequence[Point]) -> list[tuple[float, float]]:
  return sorted({(p.n, p.d) for p in points})


def _describe(nd: Sequence[tuple[float, float]]) -> str:
  return ", ".join(f"({n / 1e6:.2f}M, {d / 1e6:.0f}M)" for n, d in nd) or "none"


def fit_law(points: Sequence[Point], fixed: Mapping[str, float] | None = None,
            huber_delta: float = HUBER_DELTA, starts: Sequence[np.ndarray] | None = None) -> Law:
  """Fits the BF16 law to ``points`` (their N, D and loss).

  Args:
    points: the BF16 arms; seeds at one (N, D) are separate observations.
    fixed: constants held at a value instead of fitted (``{"gamma": 0.276}``), by their names in
      ``LAW_PARAMS``.
    huber_delta: the Huber threshold on the residuals ``log L − log L̂``.
    starts: starting points in the fit's coordinates (``Law.theta``); default a grid of 144 (fewer
      with ``fixed``). The best of the local fits is the result.

  Returns:
    The fitted ``Law``.

  Raises:
    ValueError: an unknown name or a value that is not positive in ``fixed``, or fewer distinct
      (N, D) points than free constants plus one (the points are named, and what to add).
  """
  fixed = dict(fixed or {})
  unknown = sorted(set(fixed) - set(LAW_PARAMS))
  if unknown:
    raise ValueError(f"fixed: unknown constant(s) {unknown}; the law's are {', '.join(LAW_PARAMS)}")
  bad = [f"{k}={v!r}" for k, v in fixed.items() if not (isinstance(v, int | float) and math.isfinite(v) and v > 0)]
  if bad:
    raise ValueError(f"fixed: {', '.join(bad)}: every constant of the law is a positive finite number")
  free = [k for k in LAW_PARAMS if k not in fixed]
  nd = _distinct(points)
  ns, ds = {n for n, _ in nd}, {d for _, d in nd}
  missing = []
  if len(nd) < len(free) + 1:
    missing.append(f"{len(free) + 1} distinct (N, D) points for its {len(free)} free constant(s) "
                   f"({', '.join(free)}); it has {len(nd)}: {_describe(nd)}")
  if "alpha" in free and len(ns) < 2:
    missing.append("two model sizes N to fit alpha")
  if "beta" in free and len(ds) < 2:
    missing.append("two token counts D to fit beta")
  if missing:
    raise ValueError("the bf16 law needs " + "; and ".join(missing) + ". Run bf16 arms at more grid "
                     "points (experiments/configs/grid.py: " + ", ".join(_grid_points()) + "), or hold "
                     "constants fixed (--fit_fixed=gamma=0.276 or fixed={'gamma': 0.276}; Quartet's C4 fit: "
                     "alpha 0.579, beta 0.539, gamma 0.276).")
  n = np.array([p.n for p in points], float)
  d = np.array([p.d for p in points], float)
  log_l = np.log([p.loss for p in points])
  idx = [LAW_PARAMS.index(k) for k in free]
  base = np.zeros(len(LAW_PARAMS))
  for k, v in fixed.items():
    base[LAW_PARAMS.index(k)] = math.log(v) if k in _LOG_SCALES else v

  def full(x):
    theta = base.copy()
    theta[idx] = x
    return theta

  def residuals(x):
    return log_l - np.log(law_loss(full(x), n, d))

  def jac(x):
    loss, grad = _law_and_grad(full(x), n, d)
    return -grad[:, idx] / loss[:, None]

  if starts is None:
    grids = np.meshgrid(*(_STARTS[k] for k in free), indexing="ij")
    starts = [np.array(s) for s in zip(*(g.ravel() for g in grids), strict=True)]
  else:
    starts = [np.asarray(s, float)[idx] for s in starts]
  lo = np.array([_BOUNDS[k][0] for k in free])
  hi = np.array([_BOUNDS[k][1] for k in free])
  # Plain least squares from every start (it converges in few steps), then the Huber fit from the
  # best three of those.
  with np.errstate(all="ignore"):  # a start far off may overflow before it is dropped
    fits = [least_squares(residuals, x0, jac, method="lm", max_nfev=400) for x0 in starts]
  fits = sorted((r for r in fits if np.isfinite(r.cost)), key=lambda r: r.cost)[:3]
  best = min((least_squares(residuals, np.clip(r.x, lo + 1e-9, hi - 1e-9), jac, bounds=(lo, hi), loss="huber",
                            f_scale=huber_delta) for r in fits),
             key=lambda r: r.cost)
  return Law.from_theta(full(best.x))


def fit_efficiency(points: Sequence[Point], law: Law, huber_delta: float = HUBER_DELTA,
                   recipe: str = "the recipe") -> tuple[float, float]:
  """Fits ``(eff_N, eff_D)`` of one recipe's ``points`` with the BF16 ``law``'s constants fixed.

  Raises:
    ValueError: fewer than 3 distinct (N, D) points (two efficiencies and one degree of freedom).
  """
  nd = _distinct(points)
  if len(nd) < 3:
    raise ValueError(f"{recipe}: eff_N and eff_D need arms at 3 or more distinct (N, D) points; it has "
                     f"{len(nd)}: {_describe(nd)}. Run it at more grid points (experiments/configs/grid.py).")
  n = np.array([p.n for p in points], float)
  d = np.array([p.d for p in points], float)
  log_l = np.log([p.loss for p in points])
  theta = law.theta()

  def residuals(x):
    return log_l - np.log(law_loss(theta, n, d, math.exp(x[0]), math.exp(x[1])))

  def jac(x):
    loss, grad = _law_and_grad(theta, n, d, math.exp(x[0]), math.exp(x[1]))
    return -grad[:, 6:] / loss[:, None]

  with np.errstate(all="ignore"):
    x0 = least_squares(residuals, np.zeros(2), jac, method="lm").x  # plain least squares, then Huber
  x0 = np.clip(x0, _EFF_BOUNDS[0] + 1e-9, _EFF_BOUNDS[1] - 1e-9)
  best = least_squares(residuals, x0, jac, bounds=_EFF_BOUNDS, loss="huber", f_scale=huber_delta)
  return math.exp(best.x[0]), math.exp(best.x[1])


@dataclasses.dataclass(frozen=True)
class RecipeFit:
  """A recipe's efficiencies, its predicted gap at the method's scale, and their intervals."""

  recipe: str
  arms: int
  points: int
  eff_n: float
  eff_d: float
  gap_pct: float
  eff_n_ci: tuple[float, float] = (math.nan, math.nan)
  eff_d_ci: tuple[float, float] = (math.nan, math.nan)
  gap_pct_ci: tuple[float, float] = (math.nan, math.nan)
  error: str | None = None  # why it was not fitted


@dataclasses.dataclass(frozen=True)
class Fit:
  """The BF16 law, each recipe's fit, and the bootstrap's intervals of the law's constants."""

  law: Law
  fixed: tuple[str, ...]
  bf16_arms: int
  bf16_points: int
  rms_log_residual: float
  recipes: tuple[RecipeFit, ...]
  law_ci: dict = dataclasses.field(default_factory=dict)
  replicates: int = 0
  level: float = 0.95


def _by_recipe(points: Sequence[Point]) -> dict[str, list[Point]]:
  out: dict[str, list[Point]] = {}
  for p in points:
    if not p.reference:
      out.setdefault(p.recipe, []).append(p)
  return out


def _noise_pool(points: Sequence[Point], law: Law, recipes: Mapping[str, RecipeFit], n_free: int) -> np.ndarray:
  """Deviations of log L to draw a single seed's noise from (see the module's docstring)."""
  groups: dict[tuple, list[float]] = {}
  for p in points:
    groups.setdefault((p.reference, p.recipe, p.n, p.d), []).append(math.log(p.loss))
  pool = [(v - np.mean(g)) * math.sqrt(len(g) / (len(g) - 1)) for g in groups.values() if len(g) > 1 for v in g]
  fits = [(True, "", (1.0, 1.0), n_free)] + [(False, k, (r.eff_n, r.eff_d), 2) for k, r in recipes.items()
                                             if r.error is None]
  for reference, recipe, (en, ed), k in fits:
    pts = [p for p in points if p.reference == reference and (reference or p.recipe == recipe)]
    res = np.log([p.loss for p in pts]) - np.log(law.loss([p.n for p in pts], [p.d for p in pts], en, ed))
    pool += list(res * math.sqrt(len(pts) / max(1, len(pts) - k)))
  return np.array(pool)


def _resample(points: Sequence[Point], pool: np.ndarray, rng: np.random.Generator) -> list[Point]:
  groups: dict[tuple, list[Point]] = {}
  for p in points:
    groups.setdefault((p.reference, p.recipe, p.n, p.d), []).append(p)
  out = []
  for g in groups.values():
    if len(g) > 1:
      out += [g[i] for i in rng.integers(0, len(g), len(g))]
    else:
      out.append(dataclasses.replace(g[0], loss=g[0].loss * math.exp(pool[rng.integers(0, len(pool))])))
  return out


def fit(points: Sequence[Point], fixed: Mapping[str, float] | None = None, bootstrap: int = 200,
        seed: int = 0, huber_delta: float = HUBER_DELTA, level: float = 0.95) -> Fit:
  """The BF16 law and every recipe's efficiencies, with bootstrap intervals.

  Args:
    points: the arms (``load_points``): the bf16 reference seeds and the other recipes' arms.
    fixed: law constants held fixed (``fit_law``).
    bootstrap: replicates (0: no intervals).
    seed: the bootstrap's random seed.
    level: the intervals' coverage (percentile intervals).

  Returns:
    A ``Fit``; a recipe with too few points has its ``error`` set instead of efficiencies.

  Raises:
    ValueError: no bf16 reference arm, or too few for the law (``fit_law``).
  """
  ref = [p for p in points if p.reference]
  if not ref:
    raise ValueError("no bf16 reference arms (the bf16 seeds, rows with reference true) among the points: "
                     "the law is fitted to them; run bf16_s0 at every grid point")
  fixed = dict(fixed or {})
  law = fit_law(ref, fixed, huber_delta)
  res = np.log([p.loss for p in ref]) - np.log(law.loss([p.n for p in ref], [p.d for p in ref]))
  recipes = {}
  for name, pts in _by_recipe(points).items():
    try:
      en, ed = fit_efficiency(pts, law, huber_delta, name)
      recipes[name] = RecipeFit(name, len(pts), len(_distinct(pts)), en, ed, gap_pct(law, en, ed))
    except ValueError as e:
      recipes[name] = RecipeFit(name, len(pts), len(_distinct(pts)), math.nan, math.nan, math.nan, error=str(e))
  law_ci = {}
  if bootstrap > 0:
    pool = _noise_pool(points, law, recipes, len(LAW_PARAMS) - len(fixed))
    rng = np.random.default_rng(seed)
    laws, effs = [], {k: [] for k, r in recipes.items() if r.error is None}
    starts = [law.theta()]
    for _ in range(bootstrap):
      sample = _resample(points, pool, rng)
      b_law = fit_law([p for p in sample if p.reference], fixed, huber_delta, starts=starts)
      laws.append(b_law)
      by = _by_recipe(sample)
      for k in effs:
        en, ed = fit_efficiency(by[k], b_law, huber_delta, k)
        effs[k].append((en, ed, gap_pct(b_law, en, ed)))
    q = (50 * (1 - level), 50 * (1 + level))

    def ci(values):
      lo, hi = np.percentile(values, q)
      return float(lo), float(hi)

    law_ci = {k: ci([getattr(x, k) for x in laws]) for k in LAW_PARAMS if k not in fixed}
    for k, v in effs.items():
      a = np.array(v)
      recipes[k] = dataclasses.replace(recipes[k], eff_n_ci=ci(a[:, 0]), eff_d_ci=ci(a[:, 1]),
                                       gap_pct_ci=ci(a[:, 2]))
  return Fit(law, tuple(sorted(fixed)), len(ref), len(_distinct(ref)), float(np.sqrt(np.mean(res ** 2))),
             tuple(recipes.values()), law_ci, bootstrap, level)


def load_points(results: str | Path) -> tuple[list[Point], list[str]]:
  """The finished arms of every ``study.jsonl`` in ``results`` and its subfolders.

  Returns:
    The points (rows with a finite held-out loss, evaluated as their study asked: ``comparable``)
    and one note per row left out (diverged, not comparable).

  Raises:
    ValueError: no ``study.jsonl`` there, or rows evaluated on different texts (one law per text).
  """
  root = Path(results)
  files = sorted([root / "study.jsonl"] if (root / "study.jsonl").is_file() else root.glob("*/study.jsonl"))
  if not files:
    raise ValueError(f"--results={results}: no study.jsonl in it or in its subfolders (a folder that "
                     "experiments.study --collect wrote, or a folder of such folders, one per grid point)")
  points, notes, texts = [], [], set()
  for f in files:
    for line in f.read_text().splitlines():
      r = json.loads(line)
      where = f"{f.parent.name}/{r['arm']}"
      loss = r.get("eval_loss", math.nan)
      if r.get("status") != "ok" or not math.isfinite(loss) or not r.get("comparable", True):
        notes.append(f"{where}: left out ({r.get('status')}, eval loss {loss}, comparable "
                     f"{r.get('comparable')})")
        continue
      texts.add(r.get("eval_text"))
      points.append(Point(r["recipe"], bool(r["reference"]), float(r["params"]), float(r["tokens"]),
                          float(loss), int(r.get("seed", 0)), where, float(r.get("epochs", math.nan))))
  if len(texts) > 1:
    raise ValueError(f"--results={results}: arms evaluated on different texts {sorted(map(str, texts))}; "
                     "fit one text at a time (a results folder per evaluated text)")
  return points, notes


def _ci(v: tuple[float, float], fmt: str) -> str:
  return "" if not all(map(math.isfinite, v)) else f" [{v[0]:{fmt}}, {v[1]:{fmt}}]"


def fit_table(f: Fit, points: Sequence[Point], title: str = "") -> str:
  """The fit as Markdown: the law's constants, the points, and one row per recipe."""
  law = f.law
  pct = f"{100 * f.level:g}%" if f.replicates else ""
  lines = [title] if title else []
  consts = ", ".join(f"{k} {getattr(law, k):.4g}" + (" (fixed)" if k in f.fixed else
                                                     _ci(f.law_ci.get(k, (math.nan, math.nan)), ".4g"))
                     for k in LAW_PARAMS)
  lines += [f"Law L(N, D) = (A/(N·eff_N)^alpha + B/(D·eff_D)^beta)^gamma + E (Quartet, arXiv:2505.14669), "
            f"fitted to {f.bf16_arms} bf16 arm(s) at {f.bf16_points} (N, D) point(s): {consts}; "
            f"rms residual of log L {f.rms_log_residual:.2e}.",
            f"Intervals: {pct} percentile, {f.replicates} bootstrap replicates (seeds resampled; a single "
            "seed's noise drawn from the seeds' deviations and the fits' residuals)." if f.replicates
            else "No bootstrap (intervals not computed).", ""]
  repeated = sorted({p.arm for p in points if p.epochs > 4})
  if repeated:
    lines += [f"More than 4 epochs of the training split: {', '.join(repeated)}.", ""]
  lines += ["| N | D | tokens/param | epochs | recipe | seeds | mean eval loss | law's loss | gap to bf16 law % |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
  fits = {r.recipe: r for r in f.recipes}
  groups: dict[tuple, list[Point]] = {}
  for p in points:
    groups.setdefault((p.n, p.d, not p.reference, p.recipe), []).append(p)
  for (n, d, _, recipe), g in sorted(groups.items()):
    mean = float(np.mean([p.loss for p in g]))
    ref_loss = float(law.loss(n, d))
    r = fits.get(recipe)
    pred = ref_loss if g[0].reference else (float(law.loss(n, d, r.eff_n, r.eff_d)) if r and r.error is None
                                            else math.nan)
    lines.append(f"| {n / 1e6:.2f}M | {d / 1e6:.0f}M | {d / n:.1f} | {g[0].epochs:.2f} | "
                 f"{'bf16 (reference)' if g[0].reference else recipe} | {len(g)} | {mean:.4f} | {pred:.4f} | "
                 f"{100 * (mean / ref_loss - 1):+.2f} |")
  lines += ["", f"| recipe | arms | points | eff_N {pct} | eff_D {pct} | gap at {TARGET_N / 1e9:g}B / "
            f"{TARGET_D / 1e9:g}B tokens % {pct} | the method's % |", "|---|---:|---:|---|---|---|---:|"]
  for r in f.recipes:
    if r.error:
      lines.append(f"| {r.recipe} | {r.arms} | {r.points} | – | – | not fitted: {r.error} | {METHOD_GAP_PCT} |")
      continue
    lines.append(f"| {r.recipe} | {r.arms} | {r.points} | {r.eff_n:.3f}{_ci(r.eff_n_ci, '.3f')} | "
                 f"{r.eff_d:.3f}{_ci(r.eff_d_ci, '.3f')} | {r.gap_pct:+.2f}{_ci(r.gap_pct_ci, '+.2f')} | "
                 f"{METHOD_GAP_PCT} |")
  return "\n".join(lines)


def parse_fixed(text: str | None) -> dict[str, float]:
  """``"gamma=0.276,alpha=0.58"`` as ``{"gamma": 0.276, "alpha": 0.58}``.

  Raises:
    ValueError: an item that is not NAME=NUMBER with NAME in ``LAW_PARAMS``.
  """
  out = {}
  for item in filter(None, (s.strip() for s in (text or "").split(","))):
    name, sep, value = item.partition("=")
    try:
      if not sep or name not in LAW_PARAMS:
        raise ValueError
      out[name] = float(value)
    except ValueError:
      raise ValueError(f"--fit_fixed: {item!r} is not NAME=NUMBER with NAME one of {', '.join(LAW_PARAMS)} "
                       "(e.g. --fit_fixed=gamma=0.276)") from None
  return out


def run_fit(results: str | Path, fixed: str | Mapping[str, float] | None = None, bootstrap: int = 200,
            seed: int = 0) -> str:
  """Loads ``results``, fits, and returns the table (``python -m experiments.study --fit``)."""
  points, notes = load_points(results)
  f = fit(points, parse_fixed(fixed) if isinstance(fixed, str | None) else fixed, bootstrap, seed)
  title = f"Scaling fit of {results}: {len(points)} arm(s)" + "".join(f"\n- {n}" for n in notes)
  return fit_table(f, points, title)


def plot_fit(f: Fit, points: Sequence[Point], ratio: int | None = None, size: float | None = None):
  """Loss against N at ``ratio`` tokens per parameter, and against D at ``size`` parameters: each
  recipe's arms (seeds averaged) and its fitted curve.

  Args:
    ratio: default the ratio with the most (recipe, N) pairs, the nearest to 25 of a tie.
    size: default the N with the most (recipe, D) pairs, the middle one of a tie.

  Returns:
    The matplotlib figure (two axes).
  """
  import matplotlib.pyplot as plt

  def pairs(key):
    out: dict[float, set] = {}
    for p in points:
      k, other = key(p)
      out.setdefault(k, set()).add((p.reference, p.recipe, other))
    top = max(map(len, out.values()))
    return sorted(k for k, v in out.items() if len(v) == top)

  if ratio is None:
    ratio = min(pairs(lambda p: (round(p.d / p.n), p.n)), key=lambda r: abs(math.log(r / 25)))
  if size is None:
    tied = pairs(lambda p: (p.n, p.d))
    size = tied[len(tied) // 2]
  effs = {r.recipe: (r.eff_n, r.eff_d) for r in f.recipes if r.error is None}
  recipes = [("bf16", True, (1.0, 1.0))] + [(k, False, e) for k, e in effs.items()]
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
  for i, (name, reference, (en, ed)) in enumerate(recipes):
    color = "0.3" if reference else f"C{i}"
    mine = [p for p in points if p.reference == reference and (reference or p.recipe == name)]
    for axis, on, x_of, curve in (
        (ax, [p for p in mine if round(p.d / p.n) == ratio], lambda p: p.n,
         lambda x: f.law.loss(x, ratio * x, en, ed)),
        (bx, [p for p in mine if p.n == size], lambda p: p.d, lambda x: f.law.loss(size, x, en, ed))):
      if not on:
        continue
      xs = sorted({x_of(p) for p in on})
      means = [np.mean([p.loss for p in on if x_of(p) == x]) for x in xs]
      grid = np.geomspace(xs[0] / 1.2, xs[-1] * 1.2, 50)
      axis.plot(xs, means, "o", color=color)
      label = "bf16" if reference else f"{name}: eff_N {en:.2f}, eff_D {ed:.2f}"
      axis.plot(grid, curve(grid), "-" if reference else "--", color=color, label=label)
  ax.set(xscale="log", xlabel="parameters N", ylabel="held-out loss", title=f"D = {ratio} · N")
  bx.set(xscale="log", xlabel="tokens D", title=f"N = {size / 1e6:.2f}M")
  ax.legend(fontsize=7)
  return fig


def _grid_points() -> tuple[str, ...]:
  return importlib.import_module("experiments.configs.grid").POINTS
