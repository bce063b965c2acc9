"""350m: a ~370M-parameter model (d=1024, 24 blocks) on the built-in mix, BPE 32k.

Command::

  python -m experiments.train --config=experiments/configs/350m.py:bf16 --workdir=runs/350m-bf16 \
      --config.mesh_shape='(1,8,1)'

Hardware: 8 GPUs (FSDP over 8), or one H200 with ``--config.grad_accum=4``.
Tokens: 15000 steps x 256 x 1024 = 3.9B. Needs a corpus larger than the built-in mix
(``--config.data.corpus=<folder of .txt>``) to avoid many epochs.
Expected time and loss: not measured. The measured neighbour is the 20m study (``20m_study.py``:
the same mix corpus with BPE 8k, 49M tokens; experiments/results/20m_h200/table.md): bf16 held-out
eval loss 2.449, fp4_linear +1.42%, the LoRA-SVD full stack (the arm fp4_full_stack) +2.86%;
experiments/results/20m_h100: the preset fp4_full_stack +1.19%. A larger model on more tokens should land
below its loss (not directly comparable: a 32k vocabulary); the gaps are what to compare.
"""

from experiments.configs._base import base


def get_config(arg: str | None = None):
  c = base(arg)
  c.name = "350m"
  c.model.update(d_model=1024, n_layers=24, n_heads=16)
  c.data.update(corpus="mix", tokenizer="bpe", vocab_size=32768)
  c.optimizer.update(learning_rate=6e-4, warmup_steps=1000)
  c.steps = 15000
  c.batch_size = 256
  c.seq_len = 1024
  c.log_every = 20
  c.eval_every = 1000
  c.eval_batches = 16
  c.checkpoint_every = 1000
  return c
