"""How one operand is quantized: ``Operand``, the spec every module's config holds per operand.

A matmul (``fp4jax.ops.matmul.MatmulConfig``), attention (``fp4jax.ops.attention.AttentionConfig``),
the optimizer's moments (``fp4jax.optim.AdamNvfp4Options``) and Newton–Schulz each hold one
``Operand`` for each tensor they quantize, so "how is this tensor quantized" is said one way
everywhere::

  Operand()                                   # NVFP4, 1×16 blocks, round-to-nearest, one term
  Operand(rounding="stochastic")              # the recipe's gradients
  Operand(block=(16, 16))                     # the recipe's weights: 16×16 tiles
  Operand(terms=2)                            # a ≈ Q1 + Q(a − Q1): about 1/8 of one term's error
  Operand(format="bf16")                      # not quantized: the op's compute dtype

The block's axes are the op's: a 1×16 block runs along the operand's contraction axis (the op
names it), a 16×16 tile spans both of a 2-D operand's axes. Each op accepts the layouts its GEMMs
can contract and raises a ``ValueError`` naming the operand otherwise.

The numerics of each field are those of ``fp4jax.nvfp4.quantize`` (Transformer Engine's order of
float32 operations): ``rounding`` is its ``rounding``, ``block`` its ``block``; ``scale_rule``
chooses each block's E4M3 scale (``"max"``: the block's amax maps to 6, the only rule today).
"""

from __future__ import annotations

import dataclasses

from fp4jax import nvfp4

FORMATS = ("nvfp4", "bf16")
BLOCKS = ((1, 16), (16, 16))
SCALE_RULES = ("max",)
TERMS = (1, 2)


@dataclasses.dataclass(frozen=True)
class Operand:
  """How one operand is quantized (frozen and hashable: a static argument of the ops).

  Attributes:
    format: ``"nvfp4"`` (4-bit E2M1 elements, an E4M3 scale per block, a float32 scale per tensor)
      or ``"bf16"``: the operand enters its GEMM unquantized, in the op's compute dtype; the other
      fields are then ignored.
    rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased; bits from the op's key).
    block: ``(1, 16)``: 16 consecutive elements along the op's contraction axis share a scale;
      ``(16, 16)``: a 16×16 tile does (one quantization then serves both orientations of a 2-D
      operand, as the recipe's weight does in the forward and the dgrad).
    terms: 1, or 2 for ``a ≈ Q1 + Q2`` with ``Q1 = Q(a)`` and ``Q2 = Q(a − Q1)`` (each term its own
      global and block scales, the operand's rounding with a key of its own); a GEMM of two-term
      operands is the sum of its terms' NVFP4 GEMMs.
    scale_rule: how a block's scale is chosen: ``"max"`` (the block's amax maps to E2M1's 6).
  """

  format: str = "nvfp4"
  rounding: str = "nearest"
  block: tuple[int, int] = (1, 16)
  terms: int = 1
  scale_rule: str = "max"

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ValueError(f"Operand.format must be one of {FORMATS}, got {self.format!r}")
    if self.rounding not in nvfp4.ROUNDINGS:
      raise ValueError(f"Operand.rounding must be one of {nvfp4.ROUNDINGS}, got {self.rounding!r}")
    try:
      block = tuple(int(b) for b in self.block)
    except (TypeError, ValueError):
      block = None
    if block not in BLOCKS:
      raise ValueError(f"Operand.block must be one of {BLOCKS}, got {self.block!r}")
    object.__setattr__(self, "block", block)
    if isinstance(self.terms, bool) or self.terms not in TERMS:
      raise ValueError(f"Operand.terms must be one of {TERMS}, got {self.terms!r}")
    if self.scale_rule not in SCALE_RULES:
      raise ValueError(f"Operand.scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")

  @property
  def quantized(self) -> bool:
    """True if the operand is NVFP4 (``format == "nvfp4"``)."""
    return self.format == "nvfp4"

  @property
  def stochastic(self) -> bool:
    """True if the operand is NVFP4 with stochastic rounding (it then needs random bits)."""
    return self.quantized and self.rounding == "stochastic"


BF16 = Operand(format="bf16")  # an operand left unquantized
