"""Next-token cross-entropy: from full logits, or chunked from the final hidden states and the LM head.

``chunked_cross_entropy`` is what ``fp4jax.train`` uses: it never materializes the (B, T, V) float32
logits (8 GiB for the 125m model at 64×1024 tokens), and its LM-head GEMMs go through
``fp4jax.ops.mixed_matmul``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax.ops.dense import mixed_matmul


def cross_entropy(logits_BxTxV, targets_BxT, mask_BxT=None):
  """Mean next-token cross-entropy in float32 (over tokens where ``mask`` is true)."""
  logits = logits_BxTxV.astype(jnp.float32)
  lse_BxT = jax.nn.logsumexp(logits, axis=-1)
  tgt_BxT = jnp.take_along_axis(logits, targets_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
  nll_BxT = lse_BxT - tgt_BxT
  if mask_BxT is None:
    return jnp.mean(nll_BxT)
  m = mask_BxT.astype(jnp.float32)
  return jnp.sum(nll_BxT * m) / jnp.maximum(jnp.sum(m), 1.0)


def chunked_cross_entropy(x_BxTxD, kernel_DxV, targets_BxT, *, chunk_tokens: int = 8192):
  """Mean next-token cross-entropy of ``x @ kernel`` without materializing (B, T, V) logits.

  Same loss as ``cross_entropy(Transformer.__call__ logits, targets)``: per chunk of
  ``chunk_tokens`` tokens, float32 logits (``mixed_matmul``: f32 accumulation), float32
  logsumexp and target logit; a ``lax.scan`` over chunks whose body is rematerialized, so the
  forward and backward hold one (chunk, V) float32 block instead of (B·T, V). The logits'
  cotangent enters the two backward GEMMs in ``x``'s dtype (``mixed_matmul``); the kernel's
  gradient is accumulated in float32 across chunks. Costs one extra LM-head forward matmul in
  the backward.

  Args:
    x_BxTxD: final hidden states (compute dtype).
    kernel_DxV: LM head kernel (float32 master weight; cast to ``x``'s dtype per chunk).
    targets_BxT: int target ids.
    chunk_tokens: tokens per chunk (B·T is padded up to a multiple; padded tokens have weight 0).

  Returns:
    float32 scalar.
  """
  if chunk_tokens < 1:
    raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
  if x_BxTxD.shape[:-1] != targets_BxT.shape or kernel_DxV.shape[0] != x_BxTxD.shape[-1]:
    raise ValueError(f"chunked_cross_entropy: shapes x {x_BxTxD.shape}, kernel "
                     f"{kernel_DxV.shape}, targets {targets_BxT.shape} do not match")
  d, v = kernel_DxV.shape
  x_NxD = x_BxTxD.reshape(-1, d)
  tgt_N = targets_BxT.reshape(-1).astype(jnp.int32)
  n = x_NxD.shape[0]
  c = min(chunk_tokens, n)
  pad = -n % c
  w_N = jnp.ones((n,), jnp.float32)
  if pad:
    x_NxD = jnp.pad(x_NxD, ((0, pad), (0, 0)))
    tgt_N, w_N = jnp.pad(tgt_N, (0, pad)), jnp.pad(w_N, (0, pad))
  k = (n + pad) // c

  @jax.checkpoint
  def chunk_nll(x_CxD, tgt_C):
    logits_CxV = mixed_matmul(x_CxD, kernel_DxV, x_CxD.dtype, jnp.float32)
    lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
    # A compare-and-select (fuses; no B·T×V scatter in the backward as take_along_axis has).
    hit_CxV = jnp.arange(v, dtype=jnp.int32)[None, :] == tgt_C[:, None]
    return lse_C - jnp.sum(jnp.where(hit_CxV, logits_CxV, 0.0), axis=-1)

  def body(total, xs):
    x_CxD, tgt_C, w_C = xs
    return total + jnp.sum(chunk_nll(x_CxD, tgt_C) * w_C), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (x_NxD.reshape(k, c, d), tgt_N.reshape(k, c), w_N.reshape(k, c)))
  return total / n
