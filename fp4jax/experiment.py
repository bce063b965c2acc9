"""One training run, typed: model, precision recipe, optimizer, length and bookkeeping, how it
executes, and its data.

``Experiment`` is built once where a config enters (``Experiment.from_config`` for a config of
``experiments/configs``, or directly from the dataclasses) and is what ``fp4jax.loop.train``
takes. The model's vocabulary may stay None until the data is prepared: the data step returns the
completed experiment (``Experiment.with_data``). A variant of a run is a function from experiment
to experiment (``Experiment.with_changes({"optimizer.learning_rate": 1e-3})``).

What a run *is* (its identity, compared when it resumes) is ``fp4jax.workdir.identity``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from fp4jax.execution import Execution
from fp4jax.model import ModelConfig
from fp4jax.optim.factory import OptimizerConfig
from fp4jax.recipe import Recipe, upgrade_config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Length, batch, loss and bookkeeping of a run.

  Attributes:
    steps: number of updates.
    batch_size: global batch size (examples per update, over all hosts).
    seq_len: tokens per example.
    grad_accum: micro-batches per update.
    seed: parameter init / step RNG seed.
    log_every: write metrics every this many steps (also at the first step of a run, at eval
      steps and at the last step).
    eval_every: evaluate on the held-out split every this many steps (0: only at the end).
    eval_batches: batches per evaluation.
    checkpoint_every: save every this many steps (0: only at the end); saves are async.
    keep_checkpoints: checkpoints kept.
    mesh_shape: (data, fsdp, tensor) sizes; -1 fills with the remaining devices.
    progress: a live progress bar when stdout is a terminal; elsewhere (a log file, a cluster
      job) one line per logged step.
    tensorboard: TensorBoard event files under ``<workdir>/tb`` (needs tensorboardX).
    telemetry_every: at step 1 and every this many steps, before the step, log each module's NVFP4
      quantization error and each projection's energy shares on the step's state and batch
      (``fp4jax.telemetry``; ``telemetry/...`` metrics and ``telemetry_time_s``, its cost): the
      start, every N steps, and the end where N divides ``steps``. 0: off.
  """

  steps: int
  batch_size: int
  seq_len: int
  grad_accum: int = 1
  seed: int = 0
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 8
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  mesh_shape: tuple[int, int, int] = (1, -1, 1)
  progress: bool = True
  tensorboard: bool = True
  telemetry_every: int = 0

  def __post_init__(self):
    for f in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches",
              "keep_checkpoints"):
      if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
        raise ValueError(f"TrainConfig.{f}={getattr(self, f)!r}: expected a positive int")
    if self.batch_size % self.grad_accum:
      raise ValueError(f"TrainConfig: batch_size={self.batch_size} is not divisible by "
                       f"grad_accum={self.grad_accum}")
    if self.eval_every < 0 or self.checkpoint_every < 0:
      raise ValueError("TrainConfig: eval_every and checkpoint_every must be >= 0")
    if not isinstance(self.telemetry_every, int) or self.telemetry_every < 0:
      raise ValueError(f"TrainConfig.telemetry_every={self.telemetry_every!r}: expected an int "
                       ">= 0 (0: off)")
    shape = tuple(self.mesh_shape) if isinstance(self.mesh_shape, (tuple, list)) else ()
    if (len(shape) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or (d < 1 and d != -1)
                               for d in shape) or shape.count(-1) > 1):
      raise ValueError(f"TrainConfig.mesh_shape={self.mesh_shape!r}: expected 3 sizes (data, fsdp, "
                       "tensor), each >= 1, one of them may be -1 (the remaining devices)")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """The training data: the arguments of ``fp4jax.data.prepare``.

  Attributes:
    corpus: a built-in corpus name or a folder of .txt files.
    tokenizer: "byte", "bpe" or the path of a tokenizer.json.
    encoding: of the .txt files of a folder corpus.
    vocab_size: the BPE vocabulary to train (None: the tokenizer's own).
    dir: the folder of the token shards (None: the data root's default folder); the data step
      sets the folder it prepared.
  """

  corpus: str = "shakespeare"
  tokenizer: str = "byte"
  encoding: str = "utf-8"
  vocab_size: int | None = None
  dir: str | None = None


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One training run.

  Attributes:
    model: the Transformer; ``vocab_size`` None until the data step sets it (``with_data``).
    recipe: the precision recipe.
    optimizer: optimizer and learning-rate schedule.
    train: length, batch, loss and bookkeeping.
    execution: which code runs each op (not part of the run's identity).
    data: the training data to prepare.
    data_info: what the data step found (``{"corpus", "tokenizer", "vocab_size"}``, JSON-able),
      part of the run's identity; None before the data step or for data of no description.
    name: the experiment's name, for messages.
  """

  model: ModelConfig
  recipe: Recipe
  optimizer: OptimizerConfig
  train: TrainConfig
  execution: Execution = dataclasses.field(default_factory=Execution)
  data: DataSpec = dataclasses.field(default_factory=DataSpec)
  data_info: Mapping | None = None
  name: str = "experiment"

  @classmethod
  def from_config(cls, cfg) -> Experiment:
    """The experiment of a config of ``experiments/configs`` (a ConfigDict or a nested mapping).

    Sections ``model``, ``recipe``, ``optimizer``, ``execution`` and ``data`` become
    ``ModelConfig``, ``Recipe``, ``OptimizerConfig``, ``Execution`` and ``DataSpec``; the top-level
    fields other than ``name``, ``data`` and ``study`` (the study launcher's settings) a
    ``TrainConfig``. ``model.vocab_size`` may be None (set by ``with_data``).

    Raises:
      ValueError: a key that no dataclass has, or an invalid value (the field is named).

    A recipe saved in an earlier layout (the op configs' flat fields; ``lora_resplit_moments`` and
    ``lora_resplit_svd`` in the ``optimizer`` section) is read through ``fp4jax.recipe.upgrade_config``.
    """
    c = upgrade_config(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)  # an old config.json too
    name = c.pop("name", "experiment")
    c.pop("study", None)
    recipe = _typed(Recipe, c.pop("recipe"), "config.recipe")
    optimizer = _typed(OptimizerConfig, c.pop("optimizer"), "config.optimizer")
    execution = _typed(Execution, c.pop("execution", None) or {}, "config.execution")
    data = _typed(DataSpec, c.pop("data", None) or {}, "config.data")
    model = _typed(ModelConfig, c.pop("model"), "config.model")
    return cls(model=model, recipe=recipe, optimizer=optimizer, train=_typed(TrainConfig, c, "config"),
               execution=execution, data=data, name=name)

  def to_config(self) -> dict:
    """The experiment as nested plain data in the layout of ``from_config``'s input (JSON-able)."""
    out = {"name": self.name, **dataclasses.asdict(self.train)}
    for k in ("recipe", "model", "optimizer", "execution", "data"):
      out[k] = dataclasses.asdict(getattr(self, k))
    return out

  def with_data(self, data_dir: str, info: Mapping) -> Experiment:
    """The experiment completed by the data step.

    Args:
      data_dir: the folder of the prepared token shards.
      info: ``{"corpus", "tokenizer", "vocab_size"}`` of the prepared data (``vocab_size``: the
        tokenizer's, EOS included).

    Returns:
      The experiment with ``data.dir = data_dir``, ``data_info = info`` and, where
      ``model.vocab_size`` is None, the data's vocabulary rounded up to a multiple of 128.
    """
    model = self.model
    if model.vocab_size is None:
      model = dataclasses.replace(model, vocab_size=-(-int(info["vocab_size"]) // 128) * 128)
    return dataclasses.replace(self, model=model, data=dataclasses.replace(self.data, dir=str(data_dir)),
                               data_info=dict(info))

  def with_changes(self, changes: Mapping[str, Any]) -> Experiment:
    """The experiment with dotted fields replaced, e.g. ``{"recipe.matmul.hadamard": False,
    "train.seed": 1}``; each nested dataclass is rebuilt (and so validated again).

    Raises:
      ValueError: a path that names no field (the fields at that level are listed).
    """
    out = self
    for path, value in changes.items():
      out = _replace(out, path.split("."), value, path)
    return out


def _replace(obj, keys: list[str], value, path: str):
  if not dataclasses.is_dataclass(obj):
    raise ValueError(f"{path}: {keys[0]!r} is inside a value of type {type(obj).__name__}, which "
                     "has no fields")
  names = [f.name for f in dataclasses.fields(obj)]
  if keys[0] not in names:
    raise ValueError(f"{path}: {type(obj).__name__} has no field {keys[0]!r}; its fields are "
                     f"{names}")
  if len(keys) > 1:
    value = _replace(getattr(obj, keys[0]), keys[1:], value, path)
  return dataclasses.replace(obj, **{keys[0]: value})


def _typed(cls, values: Mapping, where: str):
  """``cls(**values)`` for a config dataclass, nested dataclass fields included (a section of the
  config, e.g. ``recipe.matmul``); a key that is not one of its fields is an error."""
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(f"{where}: unknown key(s) {unknown}; the fields of {cls.__name__} are "
                     f"{sorted(names)}")
  hints = typing.get_type_hints(cls)

  def value(k, v):
    section = _dataclass_of(hints[k])
    if section is not None and isinstance(v, Mapping):
      return _typed(section, v, f"{where}.{k}")
    return tuple(v) if isinstance(v, list) else v
  return cls(**{k: value(k, v) for k, v in values.items()})


def _dataclass_of(hint) -> type | None:
  """The dataclass a field holds (``X`` for a hint ``X`` or ``X | None``), or None."""
  for h in (hint, *typing.get_args(hint)):
    if isinstance(h, type) and dataclasses.is_dataclass(h):
      return h
  return None
