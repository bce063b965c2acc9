"""The precision recipe: which parts of training run in NVFP4, as one frozen dataclass.

The four modules are pluggable and cumulative (docs/DESIGN.md, "The linear recipe")::

  linear            bf16 | nvfp4 | nvfp4_lorasvd   every projection of every block
  attention         bf16 | nvfp4                   the QKᵀ / dS products of attention (with tensor reuse)
  optimizer_states  fp32 | nvfp4                   AdamW moments
  newton_schulz     bf16 | nvfp4                   the Muon / ROOT orthogonalization matmuls

Embeddings, the LM head, norms and softmax always stay high precision. ``bf16_first_blocks`` and
``bf16_last_blocks`` keep the linear layers of the first/last k Transformer blocks in BF16 (NVIDIA
keeps ~15% of the linear layers, mostly the last blocks, in BF16).

``attention_pv``, ``attention_ds`` and ``attention_reuse`` are the attention ablations of the
loss-gap study (``fp4jax.ops.AttentionConfig``): the P·V / dO·Vᵀ / Pᵀ·dO operands (V, P, dO) in
NVFP4 instead of BF16, dS in BF16 instead of NVFP4, and a backward on the unquantized q, k instead
of the forward's Q(q), Q(k). Each is one flag, e.g. ``--config.recipe.attention_ds=bf16``. ``linear_hadamard`` and
``linear_grad_rounding`` are the linear layers' ablations (``fp4jax.ops.MatmulConfig``): the wgrad
without its random Hadamard transform, and the output gradient dy rounded to nearest instead of
stochastically (in the dgrad and the wgrad). ``linear_rounding_bits="counter"`` draws the stochastic
rounding's bits from a keyed hash instead of ``jax.random.bits`` (cheaper in the kernels).

Named presets: ``bf16``, ``fp4_linear``, ``fp4_linear_lorasvd``, ``fp4_full_stack``
(``get_recipe(name)``).
"""

from __future__ import annotations

import dataclasses

from fp4jax.numerics import BIT_SOURCES
from fp4jax.nvfp4 import ROUNDINGS
from fp4jax.ops.attention import AttentionConfig
from fp4jax.ops.matmul import MatmulConfig

LINEAR_CHOICES = ("bf16", "nvfp4", "nvfp4_lorasvd")
ATTENTION_CHOICES = ("bf16", "nvfp4")
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a Transformer block's projections
OPTIMIZER_STATE_CHOICES = ("fp32", "nvfp4")
NEWTON_SCHULZ_CHOICES = ("bf16", "nvfp4")
MODULES = ("linear", "attention", "optimizer_states", "newton_schulz")  # what a preset sets

@dataclasses.dataclass(frozen=True)
class Recipe:
  """Precision of each expensive part of training.

  Attributes:
    linear: precision of the Transformer block projections (q, k, v, o, gate, up, down).
    attention: precision of the attention score products.
    optimizer_states: storage format of the AdamW moments.
    newton_schulz: precision of the Newton–Schulz matmuls (Muon / ROOT only).
    bf16_first_blocks: number of leading blocks whose projections stay BF16.
    bf16_last_blocks: number of trailing blocks whose projections stay BF16.
    lora_rank: rank of the BF16 low-rank branch when ``linear == "nvfp4_lorasvd"``.
    lora_resplit_every: re-split every LoRA-SVD projection (new top-r SVD of ``W_res + A·B``) every
      this many steps; 0 splits once at init (Metis). Adam moments are kept across a re-split.
    lora_lr_scale: the low-rank branch's learning rate (``lora_a``, ``lora_b``) as a multiple of
      the run's: their updates are scaled by it after the optimizer (weight decay included, as a
      learning rate scales it). 1.0 leaves the optimizer as it is; 0.0 freezes the branch.
    lora_projections: which block projections carry the branch: ``"all"`` or some of
      ``PROJECTIONS`` separated by commas (e.g. ``"gate_up,down"``: the MLP only); the others stay
      plain NVFP4.
    attention_pv: with ``attention="nvfp4"``, the operands V, P and dO of P·V, dO·Vᵀ and Pᵀ·dO:
      ``"bf16"`` (the method: the sensitive branches protected) or ``"nvfp4"`` (ablation).
    attention_ds: with ``attention="nvfp4"``, dS in dQ = dS·K and dK = dSᵀ·Q: ``"nvfp4"`` (the
      method, stochastic rounding) or ``"bf16"`` (ablation).
    attention_reuse: with ``attention="nvfp4"``, the backward reuses the forward's packed Q(q),
      Q(k) (True, the method) or uses the unquantized q and k (False, ablation: drop-in QAT).
    linear_hadamard: the NVFP4 projections' wgrad operands get the 16-point random Hadamard
      transform over tokens (True, NVIDIA's recipe) or not (False, ablation).
    linear_grad_rounding: rounding of the output gradient dy of the NVFP4 projections in the dgrad
      and the wgrad: ``"stochastic"`` (NVIDIA's recipe, unbiased) or ``"nearest"`` (ablation).
    linear_rounding_bits: the random bits of the NVFP4 projections' stochastic rounding
      (``MatmulConfig.rounding_bits``): ``"random"`` (``jax.random.bits``) or ``"counter"`` (a keyed
      hash, 8 bits per element; cheaper in the quantizer kernels, a different random stream).
  """

  linear: str = "bf16"
  attention: str = "bf16"
  optimizer_states: str = "fp32"
  newton_schulz: str = "bf16"
  bf16_first_blocks: int = 0
  bf16_last_blocks: int = 0
  lora_rank: int = 16
  lora_resplit_every: int = 0
  lora_lr_scale: float = 1.0
  lora_projections: str = "all"
  attention_pv: str = "bf16"
  attention_ds: str = "nvfp4"
  attention_reuse: bool = True
  linear_hadamard: bool = True
  linear_grad_rounding: str = "stochastic"
  linear_rounding_bits: str = "random"

  def __post_init__(self):
    for field, choices in (("linear", LINEAR_CHOICES), ("attention", ATTENTION_CHOICES),
                           ("optimizer_states", OPTIMIZER_STATE_CHOICES),
                           ("newton_schulz", NEWTON_SCHULZ_CHOICES)):
      value = getattr(self, field)
      if value not in choices:
        raise ValueError(f"Recipe.{field}={value!r}: expected one of {choices}")
    for field in ("bf16_first_blocks", "bf16_last_blocks", "lora_rank", "lora_resplit_every"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"Recipe.{field}={value!r}: expected a non-negative int")
    if (isinstance(self.lora_lr_scale, bool) or not isinstance(self.lora_lr_scale, int | float)
        or not 0 <= self.lora_lr_scale < float("inf")):
      raise ValueError(f"Recipe.lora_lr_scale={self.lora_lr_scale!r}: expected a finite number >= 0")
    for field in ("attention_pv", "attention_ds"):
      if getattr(self, field) not in ATTENTION_CHOICES:
        raise ValueError(f"Recipe.{field}={getattr(self, field)!r}: expected one of {ATTENTION_CHOICES}")
    for field in ("attention_reuse", "linear_hadamard"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"Recipe.{field}={getattr(self, field)!r}: expected a bool")
    if self.linear_grad_rounding not in ROUNDINGS:
      raise ValueError(f"Recipe.linear_grad_rounding={self.linear_grad_rounding!r}: expected one of "
                       f"{ROUNDINGS}")
    roles = self.lora_projections.split(",") if isinstance(self.lora_projections, str) else [None]
    if self.lora_projections != "all" and (not all(r in PROJECTIONS for r in roles)
                                           or len(set(roles)) != len(roles)):
      raise ValueError(f"Recipe.lora_projections={self.lora_projections!r}: expected 'all' or distinct "
                       f"names of {PROJECTIONS} separated by commas")
    if self.linear_rounding_bits not in BIT_SOURCES:
      raise ValueError(f"Recipe.linear_rounding_bits={self.linear_rounding_bits!r}: expected one of "
                       f"{BIT_SOURCES}")
    if self.linear == "nvfp4_lorasvd" and self.lora_rank < 1:
      raise ValueError("Recipe.lora_rank must be >= 1 when linear='nvfp4_lorasvd'")

  def lora_on(self, projection: str) -> bool:
    """Whether the block projection ``projection`` (one of ``PROJECTIONS``) carries the LoRA-SVD
    branch when the linear precision is ``nvfp4_lorasvd`` (``lora_projections``)."""
    if projection not in PROJECTIONS:
      raise ValueError(f"unknown projection {projection!r}: expected one of {PROJECTIONS}")
    return self.lora_projections == "all" or projection in self.lora_projections.split(",")

  def block_linear(self, block: int, n_blocks: int) -> str:
    """The linear precision of Transformer block ``block`` (0-based) in a model of ``n_blocks``.

    Args:
      block: index of the block.
      n_blocks: number of blocks in the model.

    Returns:
      ``"bf16"`` for an exempt block, else ``self.linear``.
    """
    if not 0 <= block < n_blocks:
      raise ValueError(f"block {block} out of range for a model of {n_blocks} blocks")
    if block < self.bf16_first_blocks or block >= n_blocks - self.bf16_last_blocks:
      return "bf16"
    return self.linear

  def attention_config(self):
    """The ``fp4jax.ops.AttentionConfig`` of ``attention="nvfp4"`` (None for BF16 attention):
    ``AttentionConfig.nvfp4()`` with the ablation fields applied."""
    if self.attention == "bf16":
      return None
    pv = self.attention_pv
    return AttentionConfig.nvfp4(v=pv, p=pv, do=pv, ds=self.attention_ds, reuse=self.attention_reuse)

  def matmul_config(self) -> MatmulConfig:
    """The ``fp4jax.ops.MatmulConfig`` of the NVFP4 block projections: NVIDIA's recipe
    (``MatmulConfig.nvfp4()``) with the linear ablation fields applied."""
    r = self.linear_grad_rounding
    return MatmulConfig.nvfp4(hadamard=self.linear_hadamard, dy_dgrad_rounding=r, dy_wgrad_rounding=r,
                              rounding_bits=self.linear_rounding_bits)

  def replace(self, **changes) -> Recipe:
    """A copy with ``changes`` applied (validated)."""
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


PRESETS: dict[str, Recipe] = {
    "bf16": Recipe(),
    "fp4_linear": Recipe(linear="nvfp4"),
    "fp4_linear_lorasvd": Recipe(linear="nvfp4_lorasvd"),
    "fp4_full_stack": Recipe(linear="nvfp4_lorasvd", attention="nvfp4", optimizer_states="nvfp4",
                             newton_schulz="nvfp4"),
}


def get_recipe(name: str, **overrides) -> Recipe:
  """A named preset, optionally with fields overridden.

  Args:
    name: one of ``PRESETS`` (``bf16``, ``fp4_linear``, ``fp4_linear_lorasvd``,
      ``fp4_full_stack``).
    **overrides: fields to change, e.g. ``bf16_last_blocks=2``.

  Returns:
    The ``Recipe``.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown recipe {name!r}: expected one of {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
