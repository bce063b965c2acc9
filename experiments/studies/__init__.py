"""Studies as data: each arm is a preset, a few config changes, a seed and the arm it is read against.

``Arm.apply`` turns the study's experiment (``fp4jax.experiment.Experiment``) into the arm's; the
table of a study prints the arm's ``changes`` exactly as written. ``loss_gap.ARMS`` is the loss-gap
study of ``experiments.study``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fp4jax.experiment import Experiment, TrainConfig
from fp4jax.recipe import PRESETS, preset_changes

_TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
_SECTIONS = frozenset(("name", "model", "recipe", "optimizer", "execution", "data"))
# A negative value of this key is a number of re-splits over the run: -n sets ``steps // n``.
RESPLIT_KEY = "recipe.lora_resplit_every"


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm of a study.

  Attributes:
    name: the arm's folder under the study's workdir and its row in the table.
    preset: the recipe preset (``fp4jax.recipe.PRESETS``); it sets the recipe's modules
      (``linear``, ``attention``, ``optimizer_states``, ``newton_schulz``) and any other field the
      preset sets apart from the default (``fp4jax.recipe.preset_changes``), and keeps the config's
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

  def apply(self, exp: Experiment) -> Experiment:
    """The arm's experiment: ``exp`` with the preset's modules, ``changes`` and ``seed``.

    Args:
      exp: the study's experiment (``fp4jax.experiment.Experiment``).

    Returns:
      A new experiment (``Experiment.with_changes``; ``exp`` is unchanged). A change of a float
      field may be written as an int, and a list stands for a tuple, as ``--config.<key>`` allows.

    Raises:
      ValueError: an unknown preset, a key that is not a field of the config, or a value of
        another type than the field's.
    """
    if self.preset not in PRESETS:
      raise ValueError(f"arm {self.name}: preset {self.preset!r} is not one of {sorted(PRESETS)}")
    changes = {f"recipe.{k}": v for k, v in preset_changes(self.preset).items()}
    for key, value in self.changes.items():
      path = experiment_path(key)
      try:
        current = _field(exp, path or "")
      except AttributeError:
        raise ValueError(f"arm {self.name}: changes key {key!r} is not a field of the config "
                         "(write it as --config.<key> would be written)") from None
      if key == RESPLIT_KEY and value < 0:
        value = max(1, exp.train.steps // -value)
      changes[path] = _typed_like(current, value, f"arm {self.name}: changes {key}={value!r}")
    changes["train.seed"] = self.seed
    try:
      return exp.with_changes(changes)
    except ValueError as e:
      raise ValueError(f"arm {self.name}: {e}") from None

  def recipe_text(self) -> str:
    """The preset and the changes as the table prints them: ``fp4_linear, recipe.matmul.x=y``."""
    return ", ".join([self.preset, *(f"{k}={_text(v)}" for k, v in self.changes.items())])


def _text(v) -> str:
  return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)


def experiment_path(key: str) -> str | None:
  """The ``Experiment`` field of a config key: a section's key is the same path
  (``recipe.matmul.hadamard``), a top-level field of the run is under ``train`` (``seed`` ->
  ``train.seed``), ``name`` is the experiment's name; None for a key of no section (``study.*``)."""
  head = key.split(".", 1)[0]
  if head in _TRAIN_FIELDS:
    return f"train.{key}"
  return key if head in _SECTIONS else None


def _field(exp: Experiment, path: str):
  """The value at a dotted path of ``exp`` (``AttributeError``: no such field)."""
  node = exp
  for part in path.split("."):
    if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
      raise AttributeError(path)
    node = getattr(node, part)
  return node


def _typed_like(current, value, where: str):
  """``value`` for a field that holds ``current``: an int for a float field becomes a float, a list
  for a tuple field a tuple; another type is an error (a field that holds None takes any value)."""
  if current is None or value is None:
    return value
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(current, tuple) and isinstance(value, list):
    return tuple(value)
  if type(value) is not type(current):
    raise ValueError(f"{where}: expected a value of type {type(current).__name__}, as the field "
                     f"holds {current!r}")
  return value
