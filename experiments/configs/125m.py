"""125m: a ~135M-parameter model (d=768, 12 blocks, GPT-2-small shape) on the built-in mix, BPE 32k.

Command::

  python -m experiments.train --config=experiments/configs/125m.py:bf16 --workdir=runs/125m-bf16

Hardware: one H200; 8 GPUs with ``--config.mesh_shape='(1,8,1)'``.
Tokens: 10000 steps x 128 x 1024 = 1.3B (~10 tokens/parameter). The built-in ``mix`` corpus has
~40M tokens, so this is ~30 epochs: point ``--config.data.corpus`` at a larger text folder for a
compute-optimal run.
Expected time: 115.4 ms per 64×1024-token bf16 step on one H200 (MFU 44.4%;
``python -m benchmarks.train_step``, benchmarks/logs/train_step_unrolled_64x1024.txt), so ~40 min
for the 10000 steps of 128×1024 tokens.
Expected loss: not measured. The measured neighbour is the 20m study (``20m_study.py``: the same
mix corpus with BPE 8k, 49M tokens; experiments/results/20m_h200/table.md): bf16 held-out eval loss
2.449, fp4_linear +1.42%, the LoRA-SVD full stack (the arm fp4_full_stack) +2.86%; experiments/results/20m_h100:
the preset fp4_full_stack +1.19%. A larger model on more tokens should land below its
loss (not directly comparable: a 32k vocabulary); the gaps are what to compare.
"""

from experiments.configs._base import base


def get_config(arg: str | None = None):
  c = base(arg)
  c.name = "125m"
  c.model.update(d_model=768, n_layers=12, n_heads=12)
  c.data.update(corpus="mix", tokenizer="bpe", vocab_size=32768)
  c.optimizer.update(learning_rate=1e-3, warmup_steps=500)
  c.steps = 10000
  c.batch_size = 128
  c.seq_len = 1024
  c.log_every = 20
  c.eval_every = 1000
  c.eval_batches = 16
  c.checkpoint_every = 1000
  return c
