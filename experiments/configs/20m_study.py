"""20m_study: the loss-gap study's settings — the 20m model on the built-in mix corpus, 1500 steps.

The ``20m`` config (``20m.py``: 16.9M parameters, d=384, 6 blocks, BPE 8k) with the study's corpus,
length and evaluation, so that the study's command has no overrides. Command (every arm, or one per
command with ``--arms=NAME``; experiments/STUDY.md)::

  python -m experiments.study --config=experiments/configs/20m_study.py --workdir=runs/study \
      --arms=all

Hardware: one H200 (a few minutes per arm alone; two to four arms share it with ``--parallel``).
Tokens: 1500 steps x 64 x 512 = 49.2M per arm (1.89 epochs of mix's 26.1M-token train split); the
telemetry (per-module quantization error, per-projection energy shares) is logged at step 1 and every
``steps // 10`` = 150 steps (``telemetry_every`` left at 0: experiments.study's default, so the
recorded study's config stays this one), i.e. the start, 300 (the notebook's quarter point) and
1500, the end; each arm is evaluated on the first ``study.eval_tokens`` = 1,048,576 held-out
tokens (2,048 windows of 512).
Expected loss (measured on one H200, experiments/results/20m_h200: ``table.md`` and each arm's
``metrics.jsonl``): 9.09–9.11 at step 1; bf16 (seeds 0–2) held-out eval loss 2.4467–2.4518 (mean
2.4491, spread 0.21%) and in-loop ``eval_loss`` 2.801–2.805 at step 1500; fp4_linear 2.4838
(+1.42%), LoRA-SVD split once (the arm lorasvd_once) 2.4836 (+1.41%), the arm fp4_full_stack 2.5191 (+2.86%)
against the bf16 mean.
"""

import importlib

import ml_collections


def get_config(arg: str | None = None):
  c = importlib.import_module("experiments.configs.20m").get_config(arg)
  # The name stays the 20m model's: the recorded study (experiments/results/20m_h200/study.json)
  # has this config under it.
  c.data.corpus = "mix"
  c.steps = 1500
  # Read by experiments.study only (not a TrainConfig field): held-out tokens per arm.
  c.study = ml_collections.ConfigDict({"eval_tokens": 1_048_576})
  return c
