"""1b: a ~0.96B-parameter model (d=2048, 18 blocks, GQA 16/8 heads of 128) for a GPU node.

Command (one host, 8 GPUs)::

  python -m experiments.train --config=experiments/configs/1b.py:fp4_linear --workdir=runs/1b \
      --config.mesh_shape='(1,8,1)' --config.data.corpus=/path/to/text

Hardware: 8 x H200 (FSDP 8); several hosts with ``--distributed`` (see experiments/train.py).
Tokens: 20000 steps x 512 x 2048 = 21B (~21 tokens/parameter).
Expected time and loss: not measured. The measured neighbour is the 20m study (``20m_study.py``:
the same mix corpus with BPE 8k, 49M tokens; experiments/results/20m_h200/table.md): bf16 held-out
eval loss 2.449, fp4_linear +1.42%, the LoRA-SVD full stack (the arm fp4_full_stack) +2.86%;
experiments/results/20m_h100: the preset fp4_full_stack +1.19%. A larger model on more tokens should land
below its loss (not directly comparable: a 32k vocabulary); the gaps are what to compare.
"""

from experiments.configs._base import base


def get_config(arg: str | None = None):
  c = base(arg)
  c.name = "1b"
  c.model.update(d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8)
  c.data.update(corpus="mix", tokenizer="bpe", vocab_size=32768)
  c.optimizer.update(learning_rate=4e-4, warmup_steps=2000)
  c.steps = 20000
  c.batch_size = 512
  c.seq_len = 2048
  c.grad_accum = 4
  c.log_every = 20
  c.eval_every = 2000
  c.eval_batches = 16
  c.checkpoint_every = 1000
  c.mesh_shape = (1, -1, 1)
  return c
