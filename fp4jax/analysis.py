"""Error studies of the NVFP4 numerics: measurements of what quantization moves, not training ops.

- ``ds_scale_error``: the error of attention's dS quantization for each second-level scale scope
  (``"tile"``, ``"matrix"``, ``"tensor"``), on one attention backward; ``fp4jax.telemetry`` measures
  dS with its ``"tile"`` scope.
- ``probs_error``: the error of attention's probabilities P from the quantized scores, on one
  attention forward (``fp4jax.telemetry`` measures it with the op's config and with q and k
  Hadamard-rotated).
- ``orthogonality_error``: the singular-value spread of a Newton–Schulz output
  (``fp4jax.optim.newton_schulz``), on the host.
- ``top_energy_share`` and ``mean_energy_share``: how much of a matrix's energy its top singular
  directions and its mean row hold (``fp4jax.telemetry`` measures each projection's W, x and dy).

Nothing in the training step calls these; ``fp4jax.ops`` and ``fp4jax.optim`` hold the ops and
transformations they measure.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax import nvfp4
from fp4jax.ops import attention

_F32 = jnp.float32


def _rel(err, ref):
  return jnp.linalg.norm(err) / jnp.linalg.norm(ref)


def _dot(spec, a, b):
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=_F32)


def _decoded_operand(x, config: attention.AttentionConfig, name: str, key):
  """``x`` as ``nvfp4_attention``'s products take it, in float32: ``deq(Q(x))`` (1×16 blocks along
  the head dim, the config's rounding) where ``config`` quantizes ``name``, else ``x``."""
  if not config.quantizes(name):
    return x.astype(_F32)
  rounding = getattr(config, name).rounding
  key = key if config.stochastic(name) else None
  return nvfp4.quantize(x, block=(1, nvfp4.BLOCK), axis=-1, rounding=rounding,
                        key=key).dequantize(_F32)


def ds_scale_error(q, k, v, do, *, causal: bool = True, key=None,
                   config: attention.AttentionConfig = attention.AttentionConfig()
                   ) -> dict[str, dict[str, jax.Array]]:
  """The error of dS's NVFP4 quantization for each second-level scale scope, on one attention backward.

  Materializes the backward's dS (``nvfp4_attention_vjp_reference``) and quantizes it in 16×16
  blocks for each second-level scale scope (``"tile"``: one scale per ``config.ds_tile``, the op's;
  ``"matrix"`` and ``"tensor"``: the exact two-level quantization per ``[T, S]`` matrix and of the
  whole dS), with the op's rounding bits::

    ds_rel  = ‖Q(dS) − dS‖ / ‖dS‖          ds_snr_db = −20·log10(ds_rel)
    dq_rel  = ‖Q(dS)·K − dS·K‖ / ‖dS·K‖    dk_rel    = the same for dSᵀ·Q      (f32 products)
    vs_matrix = ‖Q_scope(dS) − Q_matrix(dS)‖ / ‖dS‖

  Args:
    q, k, v, do, causal, key, config: as ``fp4jax.ops.nvfp4_attention_vjp_reference``
      (``config.ds.rounding`` sets the rounding; ``config.ds.format`` need not be ``"nvfp4"``).

  Returns:
    ``{scope: {"ds_rel", "ds_snr_db", "dq_rel", "dk_rel", "vs_matrix"}}`` of float32 scalars.
  """
  config = dataclasses.replace(config, ds=dataclasses.replace(config.ds, format="bf16"))
  (_, _, _), inter = attention.nvfp4_attention_vjp_reference(
      q, k, v, do, causal=causal, key=key, config=config, return_intermediates=True)
  ds = inter["ds"]
  stochastic = config.ds.rounding == "stochastic"
  if stochastic and key is None:
    raise ValueError("ds_scale_error: stochastic config.ds.rounding needs `key`")
  # The op's keys: one per operand, split in ``OPERANDS`` order.
  keys = dict.fromkeys(attention.OPERANDS) if key is None else dict(
      zip(attention.OPERANDS, jax.random.split(key, len(attention.OPERANDS)), strict=True))
  bits = attention._ds_bits(keys["ds"], ds.shape) if stochastic else None
  # dK per query head (before GQA's sum over a group): the error of each head's contribution. The
  # products take q and k as the op quantizes them (rotated, smoothed: quantized_inputs).
  q_in, k_in = attention.quantized_inputs(q, k, config)
  kd = jnp.repeat(_decoded_operand(k_in, config, "k", keys["k"]), q.shape[2] // k.shape[2], axis=2)
  qd = _decoded_operand(q_in, config, "q", keys["q"])
  dq = _dot("bhts,bshd->bthd", ds, kd)
  dk = _dot("bhts,bthd->bshd", ds, qd)
  quantized = {scope: attention._fake_quant_ds(ds, scope=scope, ds_tile=config.ds_tile,
                                               rounding=config.ds.rounding, bits=bits)
               for scope in attention._SCALE_SCOPES}
  out = {}
  for scope, dsq in quantized.items():
    ds_rel = _rel(dsq - ds, ds)
    out[scope] = {
        "ds_rel": ds_rel,
        "ds_snr_db": -20.0 * jnp.log10(ds_rel),
        "dq_rel": _rel(_dot("bhts,bshd->bthd", dsq, kd) - dq, dq),
        "dk_rel": _rel(_dot("bhts,bthd->bshd", dsq, qd) - dk, dk),
        "vs_matrix": _rel(dsq - quantized["matrix"], ds),
    }
  return out


def probs_error(q, k, v, configs, *, causal: bool = True, key=None) -> jax.Array:
  """``‖P̂ − P‖ / ‖P‖`` for each config of ``configs``: the forward's probabilities from its quantized
  q and k (``nvfp4_attention_reference``: rotated, smoothed and quantized as the op does) against
  those of the unquantized scores (computed once), over every ``[B, H, T, S]`` entry (masked entries
  are 0 in both).

  Args:
    q, k, v, causal, key: as ``fp4jax.ops.nvfp4_attention_reference`` (only q's and k's
      quantization changes P).
    configs: a sequence of ``AttentionConfig``.

  Returns:
    float32 ``[len(configs)]``.
  """
  _, p_exact, _ = attention.nvfp4_attention_reference(q, k, v, causal=causal,
                                                      config=attention.AttentionConfig.bf16(),
                                                      return_stats=True)
  errs = []
  for config in configs:
    _, p, _ = attention.nvfp4_attention_reference(q, k, v, causal=causal, key=key, config=config,
                                                  return_stats=True)
    errs.append(_rel(p - p_exact, p_exact))
  return jnp.stack(errs)


def orthogonality_error(x_MxN) -> dict[str, float]:
  """Singular-value spread of an NS output: min, max, std, and max |σ - 1| (float64 SVD on host)."""
  s = np.linalg.svd(np.asarray(x_MxN, np.float64), compute_uv=False)
  return {"s_min": float(s.min()), "s_max": float(s.max()), "s_std": float(s.std()),
          "max_dev": float(np.abs(s - 1.0).max())}


def _gram_eigenvalues(a_MxN) -> jax.Array:
  """The squared singular values of a 2-D array, ascending: the eigenvalues (clipped at 0) of the
  smaller of its Gram matrices ``AᵀA`` (N×N) and ``AAᵀ`` (M×M), in float32."""
  a = jnp.asarray(a_MxN, _F32)
  if a.ndim != 2:
    raise ValueError(f"expected a 2-D array, got shape {a.shape}")
  spec = "mk,ml->kl" if a.shape[0] >= a.shape[1] else "km,lm->kl"
  return jnp.maximum(jnp.linalg.eigvalsh(_dot(spec, a, a)), 0.0)


def top_energy_share(a_MxN, k: int = 16) -> jax.Array:
  """The share of a matrix's energy in its top ``k`` singular directions.

  ``Σ_{i≤k} σᵢ² / Σ σᵢ² = ‖A_k‖² / ‖A‖²`` (``A_k`` the best rank-k approximation): 1 for a matrix
  of rank ≤ k, about ``k / min(M, N)`` and a little more for a Gaussian one (a 384×1152 Gaussian:
  ≈ 0.10 at k = 16). The singular values come from the eigenvalues of the smaller Gram matrix in
  float32 (``min(M, N)``² memory and one eigendecomposition of that size); an ``eigvalsh`` of
  float32 resolves eigenvalues to ~1e-7 of the largest, so the share is exact to ~1e-6.

  Args:
    a_MxN: a 2-D array of any float dtype.
    k: the number of directions (≥ 1; all of them when ``k ≥ min(M, N)``).

  Returns:
    A float32 scalar in [0, 1]; 0 for a zero matrix.
  """
  if k < 1:
    raise ValueError(f"top_energy_share: k={k}, expected k >= 1")
  s2 = _gram_eigenvalues(a_MxN)
  total = jnp.sum(s2)
  return jnp.where(total > 0, jnp.sum(s2[-k:]) / jnp.where(total > 0, total, 1.0), 0.0)


def mean_energy_share(a_TxD) -> jax.Array:
  """The share of a matrix's energy in its mean row: ``T·‖μ‖² / ‖A‖²``, ``μ = mean_t A[t, :]``.

  The energy of ``1·μᵀ``, the rank-1 part that removing the mean (``A = 1·μᵀ + R``, with
  ``‖A‖² = T·‖μ‖² + ‖R‖²``) takes out: 1 for identical rows, ~1/T for zero-mean noise. For
  activations and gradients (tokens × features) it is the token mean's share; for a weight
  (K × N, ``fp4jax.layers.Dense``'s kernel) the mean is over the K rows, the input dim. It is at most
  ``top_energy_share(a, 1)`` (the mean row's direction is one candidate for the top one).

  Args:
    a_TxD: a 2-D array of any float dtype; the mean is over axis 0.

  Returns:
    A float32 scalar in [0, 1]; 0 for a zero matrix.
  """
  a = jnp.asarray(a_TxD, _F32)
  if a.ndim != 2:
    raise ValueError(f"expected a 2-D array, got shape {a.shape}")
  total = jnp.sum(jnp.square(a))
  mean = a.shape[0] * jnp.sum(jnp.square(jnp.mean(a, axis=0)))
  return jnp.where(total > 0, mean / jnp.where(total > 0, total, 1.0), 0.0)
