"""20m: a ~17M-parameter model (d=384, 6 blocks) on the built-in Shakespeare corpus, BPE 8k.

Command::

  python -m experiments.train --config=experiments/configs/20m.py:bf16 --workdir=runs/20m-bf16
  python -m experiments.compare --config=experiments/configs/20m.py \
      --recipes=bf16,fp4_linear,fp4_linear_lorasvd --workdir=runs/compare-20m

Hardware: one GPU (H200: minutes). On CPU it runs, but slowly (about an hour per recipe).
Tokens: 2000 steps x 64 x 512 = 65M (the corpus has ~1.5M BPE tokens: ~40 epochs, so expect the
eval loss to turn up late; the comparison is relative).
Expected loss: not measured on this corpus. The measured neighbour is ``20m_study.py``, this model
on the built-in mix for 1500 steps (experiments/results/20m_h200/table.md): 9.09–9.11 at step 1 (the
same vocabulary), bf16 held-out eval loss 2.449 (seeds 0–2), fp4_linear +1.42%.
"""

from experiments.configs._base import base


def get_config(arg: str | None = None):
  c = base(arg)
  c.name = "20m"
  c.model.update(d_model=384, n_layers=6, n_heads=6)
  c.data.update(corpus="shakespeare", tokenizer="bpe", vocab_size=8192)
  c.optimizer.update(learning_rate=2e-3, warmup_steps=200)
  c.steps = 2000
  c.batch_size = 64
  c.seq_len = 512
  c.eval_every = 250
  c.eval_batches = 16
  c.checkpoint_every = 500
  return c
