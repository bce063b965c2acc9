"""Studies as data: each arm is a preset, a few config changes, a seed and the arm it is read against.

``Arm.apply`` turns the study's config into the arm's; the table of a study prints the arm's
``changes`` exactly as written. ``loss_gap.ARMS`` is the loss-gap study of ``experiments.study``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fp4jax.recipe import MODULES, PRESETS

# A negative value of this key is a number of re-splits over the run: -n sets ``steps // n``.
RESPLIT_KEY = "recipe.lora_resplit_every"


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm of a study.

  Attributes:
    name: the arm's folder under the study's workdir and its row in the table.
    preset: the recipe preset (``fp4jax.recipe.PRESETS``); it sets the recipe's modules
      (``linear``, ``attention``, ``optimizer_states``, ``newton_schulz``) and keeps the config's
      other recipe fields.
    changes: config fields set after the preset, as dotted keys from the config's root, i.e. what
      the command line sets with ``--config.<key>=<value>`` (``{"recipe.matmul.hadamard": False}``,
      ``{"optimizer.name": "muon"}``). ``recipe.lora_resplit_every`` may be negative: ``-n``
      re-splits n times over the run (every ``steps // n`` steps).
    seed: the run's seed (initialization, data order, rounding bits).
    baseline: the arm this one changes one thing of, read against at the same seed; None for the
      reference arms (the study's gaps are against their mean, their spread is its noise floor).
    what: one line: what the arm measures.
    group: the section of the study the arm belongs to (``bf16``, ``module``, ``muon``,
      ``attention``, ``linear``, ``lorasvd``, ``attribution``, ``remedy``).
  """

  name: str
  preset: str
  changes: Mapping[str, object] = dataclasses.field(default_factory=dict)
  seed: int = 0
  baseline: str | None = None
  what: str = ""
  group: str = "module"

  def apply(self, cfg):
    """The arm's config: a copy of ``cfg`` with the preset's modules, ``changes`` and ``seed``.

    Raises:
      ValueError: an unknown preset, a key that is not a field of the config, or a value of
        another type than the field's.
    """
    if self.preset not in PRESETS:
      raise ValueError(f"arm {self.name}: preset {self.preset!r} is not one of {sorted(PRESETS)}")
    c = cfg.copy_and_resolve_references()
    preset = PRESETS[self.preset]
    c.recipe.update({k: getattr(preset, k) for k in MODULES})
    for key, value in self.changes.items():
      *path, leaf = key.split(".")
      node = c
      for part in path:
        node = node.get(part) if hasattr(node, "get") else None
      if node is None or not hasattr(node, "get") or leaf not in node:
        raise ValueError(f"arm {self.name}: changes key {key!r} is not a field of the config "
                         "(write it as --config.<key> would be written)")
      if key == RESPLIT_KEY and value < 0:
        value = max(1, c.steps // -value)
      try:
        node[leaf] = value
      except TypeError as e:
        raise ValueError(f"arm {self.name}: changes {key}={value!r}: {e}") from None
    c.seed = self.seed
    return c

  def recipe_text(self) -> str:
    """The preset and the changes as the table prints them: ``fp4_linear, recipe.matmul.x=y``."""
    return ", ".join([self.preset, *(f"{k}={_text(v)}" for k, v in self.changes.items())])


def _text(v) -> str:
  return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)
