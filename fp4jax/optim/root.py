"""ROOT (Robust Orthogonalized Optimizer): Muon with shape-specific Newton–Schulz coefficients and
soft-thresholding of momentum outliers, in the same NVFP4 mode as ``muon_nvfp4``.

Per 2-D weight (He et al., 2025, and its reference code):

  M   = Nesterov momentum (optax's EMA form; Newton–Schulz is scale-invariant, so ROOT's
        un-normalized ``buf = mu * buf + g`` gives the same direction)
  eps = quantile(|M|, 0.9);  B = clip(M, -eps, eps)        (the soft-thresholded outliers M - B
                                                            are dropped)
  U   = NewtonSchulz(B) with coefficients for (min(m, n), max(m, n)), Muon's for other shapes
  W  <- W - lr * (0.2 * sqrt(max(m, n)) * U + wd * W)

Embeddings, the LM head and non-2-D leaves use ``adamw_nvfp4`` (betas 0.9/0.95), as in ROOT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import optax

from fp4jax.optim.adam import AdamNvfp4Options, adamw_nvfp4
from fp4jax.optim.muon import default_muon_mask, partitioned, scale_by_orthogonalized_momentum, \
    scale_by_shape
from fp4jax.optim.ns import MUON_COEFFS, NS_OPERAND
from fp4jax.quant import Operand

# (min dim, max dim) -> (a, b, c), from ROOT's reference code (fitted for a 2048-wide model).
ROOT_NS_COEFFS: dict[tuple[int, int], tuple[float, float, float]] = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}


def root_coeffs(shape, table: Mapping[tuple[int, int], Sequence[float]] | None = None,
                fallback: Sequence[float] = MUON_COEFFS) -> tuple[float, float, float]:
  """The Newton–Schulz coefficients ROOT uses for a matrix of ``shape``.

  Args:
    shape: ``(rows, cols)``.
    table: ``(min dim, max dim) -> (a, b, c)``; default ``ROOT_NS_COEFFS``.
    fallback: coefficients for shapes not in the table (Muon's).

  Returns:
    ``(a, b, c)`` as floats.
  """
  table = ROOT_NS_COEFFS if table is None else table
  key = (min(shape), max(shape))
  return tuple(float(c) for c in table.get(key, fallback))


def scale_by_root_nvfp4(
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-7,
    *,
    coeffs_table: Mapping[tuple[int, int], Sequence[float]] | None = None,
    outlier_quantile: float | None = 0.9,
    nesterov: bool = True,
    ns_operand: Operand | None = NS_OPERAND,
    mu_dtype=None,
) -> optax.GradientTransformation:
  """ROOT's scaling of 2-D leaves (no learning rate, no shape scale).

  Args:
    ns_steps: Newton–Schulz iterations.
    beta: momentum decay.
    eps: added to the Frobenius norm before Newton–Schulz (ROOT: 1e-7).
    coeffs_table: shape-specific coefficients (default ``ROOT_NS_COEFFS``; Muon's elsewhere).
    outlier_quantile: soft-thresholding level (ROOT: 0.9); None turns it off.
    nesterov: Nesterov momentum (ROOT: on).
    ns_operand: the Newton–Schulz operands (``fp4jax.quant.Operand``): ``Operand(terms=2)`` (two-term
      NVFP4, the default), ``Operand(format="bf16")`` or None (float32 products).
    mu_dtype: dtype of the momentum (default float32).

  Returns:
    An ``optax.GradientTransformation`` for 2-D leaves.

  Example:
    >>> tx = scale_by_root_nvfp4()
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> updates, state = tx.update(params, tx.init(params))

  References:
    He et al., ROOT: Robust Orthogonalized Optimizer for Neural Network Training, arXiv:2511.20626.
  """
  table = dict(ROOT_NS_COEFFS if coeffs_table is None else coeffs_table)
  return scale_by_orthogonalized_momentum(
      lambda shape: root_coeffs(shape, table), ns_steps, beta, eps, nesterov=nesterov,
      ns_operand=ns_operand, mu_dtype=mu_dtype, outlier_quantile=outlier_quantile)


def root(
    learning_rate: optax.ScalarOrSchedule,
    ns_steps: int = 5,
    beta: float = 0.95,
    weight_decay: float = 0.1,
    *,
    coeffs_table: Mapping[tuple[int, int], Sequence[float]] | None = None,
    outlier_quantile: float | None = 0.9,
    consistent_rms: float | None = 0.2,
    ns_operand: Operand | None = NS_OPERAND,
    quantize: bool = True,
    mu_dtype=None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_mask: Callable | Mapping | None = None,
    adam_options: AdamNvfp4Options = AdamNvfp4Options(),
    seed: int = 0,
    adam_implementation: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """ROOT for 2-D weights, ``adamw_nvfp4`` for embeddings, the LM head and non-2-D leaves.

  Args:
    learning_rate: float or schedule, shared by both sides unless ``adam_learning_rate``.
    ns_steps, beta, coeffs_table, outlier_quantile, ns_operand: see ``scale_by_root_nvfp4``.
    weight_decay: decoupled weight decay of both sides (ROOT: 0.1, times the learning rate).
    consistent_rms: ROOT's update scale ``consistent_rms * sqrt(max(m, n))`` (0.2); None gives
      Muon's ``sqrt(max(1, fan_out / fan_in))``.
    quantize: NVFP4 moments on the AdamW side.
    mu_dtype: dtype of the ROOT momentum (default float32).
    adam_b1, adam_b2, adam_eps: the AdamW side.
    adam_learning_rate: AdamW's learning rate; default ``learning_rate``.
    muon_mask: which leaves ROOT takes (see ``muon_nvfp4``); default ``default_muon_mask``.
    adam_options: ``options`` of the AdamW side (``AdamNvfp4Options``).
    seed: ``seed`` of the AdamW side's stochastic rounding.
    adam_implementation: ``implementation`` of the AdamW side (``scale_by_adam_nvfp4``: "auto", "pallas", "xla",
      "pallas_interpret").

  Returns:
    An ``optax.partition`` transformation. Every numeric argument can be injected
    (``optax.inject_hyperparams``), and it composes with ``optax.MultiSteps``, ``optax.chain`` and
    ``optax.masked``.

  Example:
    >>> tx = root(learning_rate=0.02)
    >>> params = {"embed": jnp.zeros((256, 64)), "w": jnp.zeros((64, 64))}
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    He et al., `ROOT: Robust Orthogonalized Optimizer for Neural Network Training
    <https://arxiv.org/abs/2511.20626>`_, 2025.
  """
  root_tx = optax.chain(
      scale_by_root_nvfp4(ns_steps, beta, coeffs_table=coeffs_table,
                          outlier_quantile=outlier_quantile, ns_operand=ns_operand,
                          mu_dtype=mu_dtype),
      scale_by_shape(consistent_rms),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  adam_tx = adamw_nvfp4(learning_rate if adam_learning_rate is None else adam_learning_rate,
                        adam_b1, adam_b2, adam_eps, weight_decay=weight_decay, quantize=quantize,
                        options=adam_options, seed=seed, implementation=adam_implementation)
  return partitioned(root_tx, adam_tx, default_muon_mask if muon_mask is None else muon_mask)
