"""tiny: a 0.15M-parameter byte-level model (d=64, 2 blocks) on the built-in Shakespeare corpus.

The CPU smoke run and the README's main command. Commands (the recipe after ``:``, default bf16)::

  python -m experiments.train --config=experiments/configs/tiny.py:fp4_linear --workdir=runs/tiny
  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare

Hardware: CPU (2 cores) or any GPU. 200 steps x 8 x 64 = 102k tokens.
Expected time on 2 CPU cores (2026-11-30, session 4, tree b846d1c, corpus already cached): the
compare command took 58 s wall. bf16 runs 0.013 s/step and fp4_linear 0.069 s/step; the NVFP4 GEMMs
are emulated bit-exactly with integer arithmetic. The first run also downloads the corpus (time not
measured).
Expected loss: 5.97 at step 1 (ln 384 + init); eval 2.48–2.51 nats/byte at step 200 for bf16 over
seeds 0–2 (session 2). Seed-0 compare at b846d1c: bf16 eval 2.4951, fp4_linear 2.4983 (+0.13%);
train −0.34%, the last step's loss only. Earlier trees, whose bf16 gradients were rounded
differently (the cross-entropy's saved cotangent, then RMSNorm's backward and the q/k/v GEMMs):
+0.69% (c9b8572), +0.23% (session 2). At this scale these gaps are within the seed spread (~1.3%).
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
