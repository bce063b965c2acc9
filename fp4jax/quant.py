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
float32 operations): ``rounding`` is its ``rounding``, ``block`` its ``block``, ``scale_rule`` its
``scale_rule`` (each block's E4M3 scale: ``"max"`` maps the block's amax to 6; Four over Six,
``"4over6_mse"`` / ``"4over6_mae"``, keeps whichever of 6 and 4 gives the lower squared / absolute
error, with round-to-nearest only).

The mechanisms that operand specs share live here once:

- ``quantize_terms``: the terms of an operand, ``Q1 = Q(a)`` and, with ``terms=2``,
  ``Q2 = Q(a − Q1)`` from the *materialized* ``Q1`` (so the GPU computes the residual as the CPU
  does); the caller's quantizer makes each term (``nvfp4.quantize`` or the quantizer kernels).
- ``gemm_terms``: the float32 sum of the GEMMs of every pair of terms, in a fixed order (optionally
  only the leading pairs, as Newton–Schulz takes them).
- ``range_finder``: the randomized range finder (Halko et al. 2011) behind the low-rank split of a
  matmul operand (``fp4jax.ops.matmul.Split``) and the LoRA-SVD of a weight
  (``fp4jax.layers.randomized_svd``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import nvfp4

FORMATS = ("nvfp4", "bf16")
_BLOCKS = ((1, 16), (16, 16))
SCALE_RULES = nvfp4.SCALE_RULES
_TERMS = (1, 2)


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
    scale_rule: how a block's scale is chosen (``nvfp4.quantize``'s ``scale_rule``): ``"max"`` (the
      block's amax maps to E2M1's 6), ``"4over6_mse"`` or ``"4over6_mae"`` (Four over Six: the amax
      maps to 6 or to 4, whichever gives the lower squared / absolute block error; with
      ``rounding="nearest"`` only). Every term of a two-term operand takes the rule.
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
    if block not in _BLOCKS:
      raise ValueError(f"Operand.block must be one of {_BLOCKS}, got {self.block!r}")
    object.__setattr__(self, "block", block)
    if isinstance(self.terms, bool) or self.terms not in _TERMS:
      raise ValueError(f"Operand.terms must be one of {_TERMS}, got {self.terms!r}")
    if self.scale_rule not in SCALE_RULES:
      raise ValueError(f"Operand.scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")
    if self.scale_rule != "max" and self.rounding != "nearest":
      raise ValueError(f"Operand.scale_rule={self.scale_rule!r} requires Operand.rounding='nearest' (a scale "
                       f"chosen by the rounded block's error would bias stochastic rounding), got "
                       f"rounding={self.rounding!r}; use scale_rule='max' for stochastic rounding")

  @property
  def quantized(self) -> bool:
    """True if the operand is NVFP4 (``format == "nvfp4"``)."""
    return self.format == "nvfp4"

  @property
  def stochastic(self) -> bool:
    """True if the operand is NVFP4 with stochastic rounding (it then needs random bits)."""
    return self.quantized and self.rounding == "stochastic"


BF16 = Operand(format="bf16")  # an operand left unquantized


def quantize_terms(a, terms: int, quantize: Callable[[jax.Array, int], Any]) -> tuple:
  """The ``terms`` NVFP4 terms of ``a``: ``Q1 = quantize(a, 0)``, then ``Q2 = quantize(a − Q1, 1)``.

  Args:
    a: the operand (any float dtype; the residual is formed in float32).
    terms: 1 or 2 (``Operand.terms``).
    quantize: makes term ``t`` of its argument: an ``NVFP4Tensor``, or a tuple whose first item is
      one (e.g. the tensor and its decoded copy).

  Returns:
    A tuple of ``terms`` results of ``quantize``.
  """
  out = []
  for term in range(terms):
    out.append(quantize(a, term))
    if term + 1 < terms:
      q = out[-1] if isinstance(out[-1], nvfp4.NVFP4Tensor) else out[-1][0]
      # The residual from the materialized Q1: fused into the subtraction, the GPU backend computes
      # a − e·s·g with a fused multiply-add (one rounding, not two) and the second term's codes
      # would differ from the CPU's.
      a = a.astype(jnp.float32) - lax.optimization_barrier(q.dequantize(jnp.float32))
  return tuple(out)


def gemm_terms(a_terms: Sequence, b_terms: Sequence, gemm: Callable[[Any, Any], jax.Array], *,
               order: int | None = None) -> jax.Array:
  """The float32 product of two operands given as terms: ``Σ gemm(a_i, b_j)``.

  Args:
    a_terms, b_terms: the terms of each operand (``quantize_terms``' results, or one plain array).
    gemm: the product of one pair of terms.
    order: keep only the pairs with ``i + j < order`` (``order=2``: ``Q1·P1 + Q1·P2 + Q2·P1``,
      the ``Q2·P2`` term being below the others' error); None: every pair.

  Returns:
    The sum, accumulated in the order ``(0, 0), (0, 1), …, (1, 0), …``.
  """
  out = None
  for i, ta in enumerate(a_terms):
    for j, tb in enumerate(b_terms):
      if order is not None and i + j >= order:
        continue
      y = gemm(ta, tb)
      out = y if out is None else out + y
  return out


def range_finder(a_MxC, key, width: int, power_iters: int, *, dot: Callable, dot_t: Callable,
                 reorthonormalize: bool) -> jax.Array:
  """An orthonormal M×``width`` basis of the dominant column space of ``a`` (randomized range
  finding with power iterations, Halko et al. 2011).

  ``Q = qr(a·Ω)`` for a Gaussian ``Ω`` (C×``width``, float32, from ``key``), then ``power_iters``
  times ``Q = qr(a·(aᵀ·Q))``, with ``aᵀ·Q`` itself orthonormalized where ``reorthonormalize``.

  Args:
    a_MxC: the matrix.
    key: random key of ``Ω``.
    width: columns of the basis (at most ``min(M, C)``).
    power_iters: power iterations.
    dot, dot_t: ``dot(a, b) = a·b`` and ``dot_t(a, b) = aᵀ·b`` in the caller's precision.
    reorthonormalize: orthonormalize ``aᵀ·Q`` too (the stable form; costs one more QR).

  Returns:
    ``Q``: M×``width`` float32 with orthonormal columns.
  """
  orthonormal = lambda y: jnp.linalg.qr(y)[0]
  omega = jax.random.normal(key, (a_MxC.shape[1], width), jnp.float32)
  q = orthonormal(dot(a_MxC, omega))
  for _ in range(power_iters):
    z = dot_t(a_MxC, q)
    q = orthonormal(dot(a_MxC, orthonormal(z) if reorthonormalize else z))
  return q
