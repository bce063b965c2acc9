"""grid: the scaling grid of the loss-gap study — three model sizes, two or three data sizes each, a config per point.

A point is a size letter and a number of tokens per parameter, named after ``:``
(``--config=experiments/configs/grid.py:m25``; ``POINT,PRESET`` sets the recipe preset for
``experiments.train``, e.g. ``grid.py:m25,fp4_linear``; the study sets each arm's):

  size  shape (d_model, blocks, heads; head 64)  parameters (``ModelConfig.num_params``, vocab 8192)  tokens/param
  s     256, 4, 4                                  7,359,232                                      10, 25, 50
  m     320, 5, 5                                 11,365,440                                      10, 25, 45
  l     384, 6, 6 (the ``20m`` shape)             16,914,048                                      10, 25

(``TOKENS_PER_PARAM``): ``s10 s25 s50 m10 m25 m45 l10 l25`` (``POINTS``). The steps are
``round(tokens_per_param · N / (64 · 512))``; every other setting is the ``20m`` config's (AdamW, learning
rate 2e-3, 200 warmup steps, cosine to 10%, 64 × 512 tokens per step) on the corpus ``data.corpus``
(default ``pycode_mix``: the code and documentation of the installed Python distributions and the
standard library with the ``mix`` prose; BPE 8k; a name like any ``--config.data.corpus``), evaluated on the first
1,048,576 held-out tokens of that corpus (``study.eval_tokens``) and as many of the ``mix`` prose's held-out
documents (``study.eval_also``: its table is ``table_mix.md``). Each point is a study of its own
(its own workdir), e.g.::

  python -m experiments.study --config=experiments/configs/grid.py:m25 --workdir=runs/grid/m25 \
      --notelemetry --config.data.dir=DATA --arms=bf16_s0,bf16_s1,bf16_s2,fp4_linear

and ``python -m experiments.study --fit --results=experiments/results/grid_h100`` fits the law over
every point's collected study (``experiments.scaling``).

Data: the study reads at most 4 epochs (``MAX_EPOCHS``) of the training split; the grid is planned for
``pycode_mix`` as prepared on the GPU machine, 135.9M training tokens (``TRAIN_TOKENS``; experiments/STUDY.md,
"Scaling grid"), where m45 reads 3.76 epochs, l25 3.11, s50 2.71 and the rest ≤ 2.1 (``plan_table``'s
epochs column marks a point over 4 with ✗). 50 tokens per parameter would read 4.2 epochs at m (568M
tokens) and 6.2 at l (846M): m has the largest round ratio within 4 instead, 45 (511M tokens), and l no
third data size. l's largest within 4 epochs, l30 (507M tokens), is left out: the full-stack and LoRA-SVD
arms would not fit a 10-minute command there (``plan_table``), and the fit does not need it (three sizes at
≥ 25 tokens per parameter and three data sizes at the middle one without it; eight points for the bf16
law's six constants; experiments/STUDY.md, "Scaling grid", has what l30 would add on synthetic losses).

Hardware: one H100 per arm (or several arms of the small points side by side). Predicted time per arm
(``python -m experiments.configs.grid`` prints the table, ``plan_table``; experiments/STUDY.md,
"Scaling grid"): the 20m step times measured on one H100 (experiments/results/20m_h100) scaled by
training FLOPs per token, plus 90 s of compile and evaluation; every recipe's arms, the slowest (the full
stack) included, fit a 10-minute command at every point (l25's full stack within a minute of it: 9.8
predicted).
Expected loss: not measured.
"""

import importlib
from collections.abc import Sequence

import ml_collections

from fp4jax.model import ModelConfig

TOKENS_PER_STEP = 64 * 512
SIZES = {  # d_model, n_layers, n_heads
    "s": (256, 4, 4),
    "m": (320, 5, 5),
    "l": (384, 6, 6),
}
# Tokens per parameter of each size's points (each ≤ MAX_EPOCHS of TRAIN_TOKENS: the module docstring).
TOKENS_PER_PARAM = {
    "s": (10, 25, 50),
    "m": (10, 25, 45),
    "l": (10, 25),
}
POINTS = tuple(f"{s}{r}" for s, ratios in TOKENS_PER_PARAM.items() for r in ratios)
VOCAB_SIZE = 8192
TRAIN_TOKENS = 135.9e6  # the training split of pycode_mix (BPE 8k) on the GPU machine: the grid's plan
MAX_EPOCHS = 4  # the study's limit on passes over the training split


def num_params(size: str, vocab_size: int = VOCAB_SIZE) -> int:
  """Parameters of the size's model (the model code's count, embedding and head included)."""
  d, n_layers, n_heads = SIZES[size]
  return ModelConfig(vocab_size=-(-vocab_size // 128) * 128, d_model=d, n_layers=n_layers,
                     n_heads=n_heads).num_params()


def parse_point(arg: str | None) -> tuple[str, int, str | None]:
  """``(size, tokens_per_param, preset)`` of ``POINT`` or ``POINT,PRESET``.

  Raises:
    ValueError: no point, or one not in ``POINTS``.
  """
  point, _, preset = (arg or "").partition(",")
  if point not in POINTS:
    raise ValueError(f"grid.py:{arg or ''}: name a grid point after ':' (grid.py:m25 or grid.py:m25,"
                     f"fp4_linear); the points are {', '.join(POINTS)}")
  return point[0], int(point[1:]), preset or None


def get_config(arg: str | None = None):
  size, ratio, preset = parse_point(arg)
  c = importlib.import_module("experiments.configs.20m").get_config(preset)
  d, n_layers, n_heads = SIZES[size]
  c.name = f"grid_{size}{ratio}"
  c.model.update(d_model=d, n_layers=n_layers, n_heads=n_heads)
  c.data.update(corpus="pycode_mix", tokenizer="bpe", vocab_size=VOCAB_SIZE)
  c.steps = round(ratio * num_params(size, c.data.vocab_size) / (c.batch_size * c.seq_len))
  c.log_every = 50
  c.eval_every = 2000
  c.checkpoint_every = 2000
  # Read by experiments.study only (not TrainConfig fields).
  c.study = ml_collections.ConfigDict({"eval_tokens": 1_048_576, "eval_also": "mix"})
  return c


# Step times of the 20m model (64 × 512 tokens) on one H100, alone on the device: the first logged steps
# of experiments/results/20m_h100 (bf16_s0, bf16_s2: 12.6–12.9 ms; fp4_linear: 27.4 ms; w1x16_4over6_s1,
# trained alone: 30.7 ms). The LoRA-SVD and full-stack steps have no H100 measurement alone: their ratio to
# fp4_linear in the first logged steps of experiments/results/20m_h200 (31.9 and 36.2 against 28.1 ms;
# the full stack there: LoRA-SVD linear layers, NVFP4 moments and attention) times the H100's fp4_linear;
# a recipe on the 1x16/Four-over-Six forward (fp4_linear_lorasvd, the preset fp4_full_stack) adds
# w1x16_4over6's 3.3 ms over fp4_linear (for fp4_full_stack, which has no LoRA-SVD branch, an upper bound).
STEP_MS_20M_H100 = {
    "bf16": 12.8,
    "fp4_linear": 27.4,
    "fp4_linear_w1x16_4over6": 30.7,
    "fp4_linear_lorasvd": 27.4 * 31.9 / 28.1 + 30.7 - 27.4,  # on the method's baseline (1x16, Four-over-Six)
    "fp4_full_stack": 27.4 * 36.2 / 28.1 + 30.7 - 27.4,
}
OVERHEAD_S = 90.0  # launch, compile (~60 s for the NVFP4 steps), evaluation and checkpoints
CALL_LIMIT_MIN = 10.0  # one device command
TIGHT_MIN = 9.0  # above it, less than a minute of margin in a command


def predicted_minutes(cfg, recipe: str, reference=None) -> float:
  """An arm's predicted minutes on one H100: ``OVERHEAD_S`` plus ``steps`` × the 20m step of ``recipe``
  (``STEP_MS_20M_H100``) scaled by training FLOPs per token and tokens per step (``reference``: the 20m
  config, by default ``experiments/configs/20m.py``). The FLOPs scale assumes the 20m model's utilization:
  a smaller model's is lower, so this is a lower bound for it."""
  ref = reference or importlib.import_module("experiments.configs.20m").get_config()

  def flops(c):
    m = ModelConfig(vocab_size=c.data.vocab_size, d_model=c.model.d_model, n_layers=c.model.n_layers,
                    n_heads=c.model.n_heads)
    return m.flops_per_token(c.seq_len) * c.batch_size * c.seq_len

  step_s = STEP_MS_20M_H100[recipe] / 1e3 * flops(cfg) / flops(ref)
  return (OVERHEAD_S + cfg.steps * step_s) / 60


def epochs(cfg, train_tokens: float = TRAIN_TOKENS) -> float:
  """Passes of a point's config over a training split of ``train_tokens`` (default ``TRAIN_TOKENS``)."""
  return cfg.steps * cfg.batch_size * cfg.seq_len / train_tokens


def plan_table(recipes: Sequence[str] = tuple(STEP_MS_20M_H100), train_tokens: float = TRAIN_TOKENS) -> str:
  """The grid with each point's epochs of ``train_tokens`` and predicted H100 minutes per recipe
  (``predicted_minutes``)."""
  head = (f"| point | params | tokens | tokens/param | steps | corpus for ≤ {MAX_EPOCHS} epochs | "
          f"epochs of {train_tokens / 1e6:.1f}M | " + " | ".join(f"{r} min" for r in recipes) + " |")
  lines = [head, "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(recipes)]
  for point in POINTS:
    c = get_config(point)
    n = num_params(point[0], c.data.vocab_size)
    tokens = c.steps * c.batch_size * c.seq_len
    e = epochs(c, train_tokens)
    cells = []
    for r in recipes:
      m = predicted_minutes(c, r)
      cells.append(f"{m:.1f}" + (" ✗" if m > CALL_LIMIT_MIN else " !" if m > TIGHT_MIN else ""))
    lines.append(f"| {point} | {n:,} | {tokens / 1e6:.0f}M | {tokens / n:.1f} | {c.steps:,} | "
                 f"{tokens / MAX_EPOCHS / 1e6:.0f}M | {e:.2f}{' ✗' if e > MAX_EPOCHS else ''} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(plan_table())
  print(f"\nEpochs: of the {TRAIN_TOKENS / 1e6:.1f}M training tokens of pycode_mix (TRAIN_TOKENS); ✗: over "
        f"{MAX_EPOCHS}.\nMinutes: ✗: over {CALL_LIMIT_MIN:g} minutes (one command); !: over {TIGHT_MIN:g}.\n"
        f"Minutes = {OVERHEAD_S:g} s + steps × the 20m H100 step (STEP_MS_20M_H100) scaled by FLOPs per step.")
