"""tiny: a 0.4M-parameter byte-level model on the built-in Shakespeare corpus — the CPU smoke run.

Command (one recipe; ``:fp4_linear`` etc. picks another)::

  python -m experiments.train --config=experiments/configs/tiny.py --workdir=runs/tiny
  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare

Hardware: CPU (2 cores) or any GPU. Expected time on 2 CPU cores: bf16 about 1 minute, fp4_linear a
few minutes (the NVFP4 GEMMs are emulated with integer-exact jnp code on CPU; compile dominates).
Expected loss: from ln(257) = 5.55 down to about 2.5 nats/byte (train) after 300 steps; the
bf16 vs fp4_linear gap is within a few percent at this scale (noise-dominated).
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
