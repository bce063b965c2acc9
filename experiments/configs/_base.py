"""Shared defaults of the experiment configs (not an experiment itself).

Every field of an experiment config, with its meaning; each experiment file starts from
``base()`` and sets what differs. ``arg`` (the text after ``:`` in ``--config=<file>.py:<arg>``)
names the recipe: ``bf16`` (default), ``fp4_linear``, ``fp4_linear_lorasvd``, ``fp4_full_stack``.
"""

import ml_collections
from ml_collections import config_dict


def base(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = "base"
  # Precision recipe: a preset name, plus the fields that may be overridden on top of it.
  c.recipe = arg or "bf16"
  c.bf16_first_blocks = 0
  c.bf16_last_blocks = 0
  c.lora_rank = 16
  c.lora_resplit_every = 0     # fp4_linear_lorasvd: re-split every k steps (0: once, at init)
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=config_dict.placeholder(int),  # None: the data's vocabulary rounded up to 128
      d_model=128, n_layers=2, n_heads=4,
      n_kv_heads=config_dict.placeholder(int),  # None: n_heads (no GQA)
      head_dim=config_dict.placeholder(int),    # None: d_model // n_heads
      d_ff=config_dict.placeholder(int),        # None: ~8/3 d_model, a multiple of 16
      qk_norm=True, rope_theta=10000.0, dtype="bfloat16", init_std=0.02,
      scan_layers=False,  # one lax.scan per run of same-precision blocks (see ModelConfig)
      remat=False,       # rematerialize block activations in the backward (less memory)
      attention="auto",  # auto | cudnn | xla (auto: cuDNN flash attention on a GPU)
      cross_entropy="auto"))  # auto | pallas | xla (auto: the fused Pallas loss kernel on a GPU)
  c.data = ml_collections.ConfigDict(dict(
      corpus="shakespeare",   # built-in corpus name or a folder of .txt files
      tokenizer="byte",       # byte | bpe | path of a tokenizer.json
      vocab_size=config_dict.placeholder(int),  # BPE vocabulary
      dir=config_dict.placeholder(str),         # None: the data root's default folder
  ))
  c.optimizer = ml_collections.ConfigDict(dict(
      name="adamw", learning_rate=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
      grad_clip=1.0, schedule="cosine", warmup_steps=100, decay_fraction=0.2, min_lr_ratio=0.1))
  c.steps = 1000
  c.batch_size = 32            # global, examples per update
  c.seq_len = 256
  c.grad_accum = 1
  c.seed = 0
  c.log_every = 10
  c.eval_every = 200           # 0: only at the end
  c.eval_batches = 8
  c.checkpoint_every = 500     # 0: only at the end
  c.keep_checkpoints = 3
  c.mesh_shape = (1, -1, 1)    # (data, fsdp, tensor); -1 takes the remaining devices
  c.progress = True
  return c
