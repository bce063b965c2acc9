"""The shared start of every experiment config (not an experiment itself).

Each section is built from a library dataclass, so its fields and defaults are that dataclass's
(their docstrings say what each field means); an experiment file sets only what differs::

  recipe      fp4jax.recipe.Recipe           the preset named after ':' (default bf16); its op
                                             configs nested: recipe.matmul, .attention_op, .moments
  model       fp4jax.model.ModelConfig       vocab_size None: the data's vocabulary, rounded up to 128
  optimizer   fp4jax.train.OptimizerConfig
  execution   fp4jax.execution.Execution     which code runs each op (not part of the run's identity)
  (top level) fp4jax.train.TrainConfig       steps, batch_size, seq_len, ..., tensorboard
  data        the arguments of fp4jax.data.prepare (corpus, tokenizer, encoding, vocab_size, dir)

Every field can be set on the command line, e.g. ``--config.steps=20``,
``--config.model.scan_layers=True``, ``--config.recipe.bf16_last_blocks=2``,
``--config.recipe.matmul.hadamard=False``, ``--config.execution.attention=xla``,
``--config.tensorboard=False``. ``arg`` (the text after ``:`` in ``--config=<file>.py:<arg>``)
names the recipe preset: ``bf16``, ``fp4_linear``, ``fp4_linear_w1x16_4over6``,
``fp4_linear_w1x16_4over6_fwd_bf16_last10``, ``fp4_linear_lorasvd``,
``fp4_full_stack`` (``fp4jax.recipe.PRESETS``), or a preset of recipe and optimizer
(``EXPERIMENT_PRESETS``): ``fp4_full_stack_muon`` is ``fp4_full_stack`` trained with Muon.
"""

import dataclasses
import typing

import ml_collections
from ml_collections import config_dict

from fp4jax.execution import Execution
from fp4jax.model import ModelConfig
from fp4jax.recipe import get_recipe
from fp4jax.train import OptimizerConfig, TrainConfig


def _value_type(hint):
  """``int`` for ``int | None``; the hint itself otherwise."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return args[0] if args else hint


def dataclass_config(obj, **values) -> ml_collections.ConfigDict:
  """A ConfigDict with every field of the dataclass ``obj`` (a class or an instance).

  A field's value is ``values[name]``, else the instance's value, else the field's default. A
  None (or a required field without a value) becomes a placeholder of the field's type, so that
  the command line can still set it; a field holding a dataclass becomes a nested section.
  """
  cls = obj if isinstance(obj, type) else type(obj)
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    if f.name in values:
      v = values[f.name]
    elif not isinstance(obj, type):
      v = getattr(obj, f.name)
    else:
      v = None if f.default is dataclasses.MISSING else f.default
    if dataclasses.is_dataclass(v):
      v = dataclass_config(v)
    out[f.name] = config_dict.placeholder(_value_type(hints[f.name])) if v is None else v
  return ml_collections.ConfigDict(out)


# Presets that name more than a recipe: a recipe preset and the optimizer it trains with.
EXPERIMENT_PRESETS = {
    # The full stack with Muon: NVFP4 Newton-Schulz on the blocks' 2-D matrices, NVFP4 AdamW moments on
    # the embedding, the LM head and the vectors (the recipe's newton_schulz and optimizer_states).
    "fp4_full_stack_muon": ("fp4_full_stack", {"name": "muon"}),
}


def base(arg: str | None = None) -> ml_collections.ConfigDict:
  recipe, optimizer = EXPERIMENT_PRESETS.get(arg, (arg or "bf16", {}))
  c = dataclass_config(TrainConfig)
  c.name = "base"
  c.recipe = dataclass_config(get_recipe(recipe))
  c.model = dataclass_config(ModelConfig)
  c.optimizer = dataclass_config(OptimizerConfig, **optimizer)
  c.execution = dataclass_config(Execution)
  c.data = ml_collections.ConfigDict(dict(
      corpus="shakespeare",   # built-in corpus name or a folder of .txt files
      tokenizer="byte",       # byte | bpe | path of a tokenizer.json
      encoding="utf-8",       # of the .txt files of a folder corpus
      vocab_size=config_dict.placeholder(int),  # BPE vocabulary
      dir=config_dict.placeholder(str),         # None: the data root's default folder
  ))
  return c
