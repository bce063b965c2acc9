"""tiny: a 0.15M-parameter byte-level model (d=64, 2 blocks) on the built-in Shakespeare corpus.

The CPU smoke run and the README's main command. Commands (the recipe after ``:``, default bf16)::

  python -m experiments.train --config=experiments/configs/tiny.py:fp4_linear --workdir=runs/tiny
  python -m experiments.compare --config=experiments/configs/tiny.py --recipes=bf16,fp4_linear \
      --workdir=runs/compare

Hardware: CPU (2 cores) or any GPU. 200 steps x 8 x 64 = 102k tokens. The in-loop evaluation takes
``eval_batches`` = 8 batches (4,096 held-out bytes): a progress signal only. The compare command
evaluates each recipe's final checkpoint on the whole held-out split (467,456 bytes, 7,304 windows;
``experiments.evaluate``), with the standard error of each loss and gap, and takes a few minutes on
2 CPU cores once the corpus is cached, most of it the NVFP4 recipe's evaluation.
Expected loss (measured on 2 CPU cores, experiments/results/tiny_cpu: each arm's ``metrics.jsonl``
and ``table.md``): 5.95–5.97 at step 1 (ln 384 + init); in-loop ``eval_loss`` 2.48–2.52 nats/byte
at step 200 for bf16 over seeds 0–2 (fp4_linear, seed 0: 2.506 against bf16's 2.495); on the first
65,536 held-out bytes, bf16 2.397–2.443 (spread 1.90%) and fp4_linear 2.438, inside that spread.
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
