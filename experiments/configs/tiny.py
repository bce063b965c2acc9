"""tiny: a 0.15M-parameter byte-level model (d=64, 2 blocks) on the built-in Shakespeare corpus.

The CPU smoke run and the README's main command. Commands (the recipe after ``:``, default bf16)::

  python -m experiments.train --config=experiments/configs/tiny.py:fp4_linear --workdir=runs/tiny
  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare

Hardware: CPU (2 cores) or any GPU. 200 steps x 8 x 64 = 102k tokens.
Expected time on 2 busy CPU cores (2026-11-30): bf16 ~20 s (0.018 s/step), fp4_linear ~1.5-2 min
(0.43 s/step: the NVFP4 GEMMs are emulated bit-exactly with integer arithmetic, ~25x the bf16
step, plus ~45 s of compilation); the compare command took 3.4 min wall including the corpus
download.
Expected loss: 5.97 at step 1 (ln 384 + init), train ~2.44 and eval ~2.48 nats/byte at step 200
for both recipes (measured gap: train +0.05%, eval -0.12% — noise at this scale).
"""

from experiments.configs._base import base


def get_config(arg: str | None = None):
  c = base(arg)
  c.name = "tiny"
  c.model.update(d_model=64, n_layers=2, n_heads=4, dtype="bfloat16")
  c.optimizer.update(learning_rate=5e-3, warmup_steps=15)
  c.steps = 200
  c.batch_size = 8
  c.seq_len = 64
  c.log_every = 10
  c.eval_every = 50
  c.eval_batches = 8
  c.checkpoint_every = 50
  return c
