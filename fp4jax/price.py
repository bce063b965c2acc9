"""The price of a recipe: its linear layers' GEMM time on FP4 tensor cores, in BF16-GEMM units.

Each block projection ``y = x·W`` (``W``: K×N) runs three GEMMs of K·N multiply-adds per token: the
forward ``x·W``, the dgrad ``dy·Wᵀ`` and the wgrad ``xᵀ·dy``. On a GPU with FP4 tensor cores an NVFP4
GEMM runs at ``NVFP4_SPEEDUP`` times the BF16 rate (Blackwell B200/GB200: 4×; arXiv:2509.25149,
Table 1), so one GEMM of a projection costs, in units of the same GEMM in BF16 (``gemm_price``)::

  both operands NVFP4                              terms(a) · terms(b) / 4   (one NVFP4 GEMM per pair
                                                                              of terms; 1/4 for one each)
  an operand in BF16, or the GEMM not quantized    1
  a projection of a BF16 block (or linear="bf16")  1

and on top of its three GEMMs a projection pays, at the BF16 rate (``projection_price``):

- a LoRA-SVD branch of rank r: ``x·A``, ``(x·A)·B`` and their backward, r·(K + N) multiply-adds per
  token and GEMM, i.e. ``r·(K + N) / (K·N)`` per GEMM;
- a low-rank split of ``x`` or ``dy`` (``MatmulConfig.split``, width C = K or N, rank r: 1 for
  ``"mean"``): forming it, ``P = Uᵀ·a`` and ``a − U·P``, 2·r·C per token, plus for ``"subspace"``
  the range finder, ``(1 + 2·power_iters)·r·C`` and ``(1 + power_iters)·r²`` for its QRs; and the
  low-rank terms each quantized GEMM that reads it adds: r·N (``x``: forward and wgrad) or r·K
  (``dy``: dgrad and wgrad) per token. Products of the step's size alone (``P·W``) are not counted.

The recipe's price (``price``) weights each projection's by its FLOPs (K·N) over every projection
of every block, and a schedule (``Recipe.bf16_fwd_last``) by its steps: the late phase's price
(``Recipe.bf16_forward``) over the last steps. BF16 is 1; NVIDIA's recipe (``fp4_linear``) 1/4.
Quantization, the Hadamard transform and other elementwise passes are memory-bound, not GEMM
time, and are not counted; nor are the embedding, the LM head and attention (outside the recipe's
linear layers).
"""

from __future__ import annotations

from fp4jax.model import ModelConfig, projection_dims
from fp4jax.ops.matmul import MatmulConfig
from fp4jax.recipe import PROJECTIONS, Recipe

NVFP4_SPEEDUP = 4  # NVFP4 GEMM rate / BF16 GEMM rate on FP4 tensor cores (B200, GB200)
GEMMS = {"fwd": ("x", "w"), "dgrad": ("dy_dgrad", "w"), "wgrad": ("x_wgrad", "dy_wgrad")}  # operands


def gemm_price(config: MatmulConfig, gemm: str) -> float:
  """One GEMM of an NVFP4 projection, in units of the same GEMM in BF16.

  Args:
    config: the projection's ``MatmulConfig``.
    gemm: ``"fwd"``, ``"dgrad"`` or ``"wgrad"``.

  Returns:
    ``terms(a) · terms(b) / NVFP4_SPEEDUP`` where the GEMM is quantized with both operands NVFP4,
    else 1.
  """
  if gemm not in GEMMS:
    raise ValueError(f"unknown GEMM {gemm!r}: expected one of {tuple(GEMMS)}")
  a, b = (getattr(config, op) for op in GEMMS[gemm])
  if not getattr(config, gemm) or not (a.quantized and b.quantized):
    return 1.0
  return a.terms * b.terms / NVFP4_SPEEDUP


def _split_macs(config: MatmulConfig, k: int, n: int) -> float:
  """Multiply-adds per token of the low-rank splits of ``x`` and ``dy`` (module docstring)."""
  s, total = config.split, 0.0
  for tensor, width, other, gemms in (("x", k, n, ("fwd", "wgrad")), ("dy", n, k, ("dgrad", "wgrad"))):
    if not config.splits(tensor):
      continue
    r = 1 if s.method == "mean" else min(s.rank, width)
    total += 2 * r * width
    if s.method == "subspace":
      total += (1 + 2 * s.power_iters) * r * width + (1 + s.power_iters) * r * r
    total += sum(r * other for g in gemms if getattr(config, g))
  return total


def projection_price(config: MatmulConfig | None, k: int, n: int, lora_rank: int = 0) -> float:
  """A K×N projection's three GEMMs (and its LoRA branch and splits), in units of the same three
  GEMMs in BF16.

  Args:
    config: the projection's ``MatmulConfig``; None for a BF16 projection (price 1).
    k, n: the projection's input and output widths.
    lora_rank: rank of its BF16 LoRA-SVD branch (0: none).

  Returns:
    The mean of ``gemm_price`` over the three GEMMs, plus the branch's ``r·(K + N) / (K·N)`` and the
    splits' multiply-adds over ``3·K·N``.
  """
  if config is None:
    return 1.0
  gemms = sum(gemm_price(config, g) for g in GEMMS) / 3
  return gemms + lora_rank * (k + n) / (k * n) + _split_macs(config, k, n) / (3 * k * n)


def _phase_price(recipe: Recipe, cfg: ModelConfig) -> float:
  dims, total, weight = projection_dims(cfg), 0.0, 0
  for block in range(cfg.n_layers):
    precision = recipe.block_linear(block, cfg.n_layers)
    for role in PROJECTIONS:
      k, n = dims[role]
      rank = recipe.lora_rank if precision == "nvfp4_lorasvd" and recipe.lora_on(role) else 0
      config = None if precision == "bf16" else recipe.projection_matmul(role)
      total += k * n * projection_price(config, k, n, rank)
      weight += k * n
  return total / weight


def price(recipe: Recipe, cfg: ModelConfig, steps: int | None = None) -> float:
  """The recipe's linear-layer GEMM time on FP4 tensor cores, in units of the same GEMMs in BF16.

  Args:
    recipe: the precision recipe.
    cfg: the model (its projections' widths and its number of blocks).
    steps: the run's length: a ``bf16_fwd_last`` schedule is averaged over its steps
      (``Recipe.bf16_fwd_from``); None weights the late phase by ``bf16_fwd_last`` itself.

  Returns:
    The FLOP-weighted mean of ``projection_price`` over every projection of every block, averaged
    over the run's steps: 1.0 for BF16, 0.25 for NVIDIA's recipe.
  """
  late = recipe.bf16_forward()
  share = recipe.bf16_fwd_last if steps is None else 1 - recipe.bf16_fwd_from(steps) / steps
  early = _phase_price(recipe, cfg)
  if late == recipe or share == 0:
    return early
  return (1 - share) * early + share * _phase_price(late, cfg)
