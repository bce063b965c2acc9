"""Next-token cross-entropy: from full logits, or chunked from the final hidden states and the LM head.

``chunked_cross_entropy`` is what ``fp4jax.train`` uses: it never materializes the (B, T, V) float32
logits (4 bytes × tokens × V), and its LM-head GEMMs take operands in the hidden states' dtype with
float32 accumulation (``fp4jax.ops.mixed_matmul``'s convention).

Memory trade: by default each chunk's forward also forms the logits' cotangent softmax − onehot in
``x``'s dtype and saves it for the backward, so the backward is just the two GEMMs (no recomputed
logits GEMM, no pass over float32 logits). That residual is 2 bytes × tokens × V for bf16.
``recompute=True`` saves nothing per chunk and recomputes the logits in the backward instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _platform, execution
from fp4jax.kernels.cross_entropy import softmax_xent_rows, softmax_xent_rows_reference
from fp4jax.ops.mixed import mixed_matmul


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


def _logits_nll(x_CxD, kernel_DxV, tgt_C):
  """Per-token nll from float32 logits (operands in ``x``'s dtype, f32 accumulation).

  Differentiable without a (C, V) scatter: the target logit is a compare-and-select sum (the
  backward of ``take_along_axis`` would scatter into a zeroed (C, V) buffer)."""
  logits_CxV = mixed_matmul(x_CxD, kernel_DxV, x_CxD.dtype, jnp.float32)
  lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
  hit_CxV = jnp.arange(kernel_DxV.shape[1], dtype=jnp.int32)[None, :] == tgt_C[:, None]
  return lse_C - jnp.sum(jnp.where(hit_CxV, logits_CxV, 0.0), axis=-1)


def _nll_sum_plain(x_CxD, kernel_DxV, tgt_C, w_C, impl="xla"):
  """``sum(w · nll)`` of one chunk (float32). (``impl`` picks the forward rule's pass only.)"""
  del impl
  return jnp.sum(_logits_nll(x_CxD, kernel_DxV, tgt_C) * w_C)


# The default: its backward needs no logits recomputation (the fwd rule saves the cotangent).
_nll_sum = jax.custom_vjp(_nll_sum_plain, nondiff_argnums=(4,))
# recompute=True: ``mixed_matmul``'s autodiff, rematerialized; saves only the inputs.
_nll_sum_recompute = jax.checkpoint(_nll_sum_plain)


def _nll_sum_fwd(x_CxD, kernel_DxV, tgt_C, w_C, impl):
  logits_CxV = mixed_matmul(x_CxD, kernel_DxV, x_CxD.dtype, jnp.float32)
  # d(sum w·nll)/dlogits, formed in the same pass over the float32 logits as the loss and kept in
  # x's dtype: the backward GEMMs take it as is (bf16 operands), and no f32 (C, V) array is saved.
  if impl in ("pallas", "pallas_interpret"):
    lse_C, tgt_logit_C, dl_CxV = softmax_xent_rows(logits_CxV, tgt_C, w_C, x_CxD.dtype,
                                                   interpret=impl == "pallas_interpret")
  else:
    lse_C, tgt_logit_C, dl_CxV = softmax_xent_rows_reference(logits_CxV, tgt_C, w_C, x_CxD.dtype)
  return jnp.sum((lse_C - tgt_logit_C) * w_C), (x_CxD, kernel_DxV.astype(x_CxD.dtype), dl_CxV, w_C)


def _nll_sum_bwd(impl, res, g):
  del impl
  x_CxD, kc_DxV, dl_CxV, w_C = res
  # g (1/n for the mean) scales the f32 GEMM outputs: for n a power of two this is bitwise the same
  # as rounding g·dl to bf16 before the GEMM.
  dx = lax.dot_general(dl_CxV, kc_DxV, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  dk = lax.dot_general(x_CxD, dl_CxV, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  # The kernel is the float32 master weight: its cotangent stays f32 (summed over chunks in f32).
  return (dx * g).astype(x_CxD.dtype), dk * g, None, jnp.zeros_like(w_C)


_nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)


def chunked_cross_entropy(x_BxTxD, kernel_DxV, targets_BxT, *, chunk_tokens: int = 8192,
                          recompute: bool = False, implementation: str = "auto"):
  """Mean next-token cross-entropy of ``x @ kernel`` without materializing (B, T, V) logits.

  Same loss as ``cross_entropy(Transformer.__call__ logits, targets)``, over chunks of
  ``chunk_tokens`` tokens, each with float32 logits (operands in ``x``'s dtype, f32
  accumulation), float32 logsumexp and target logit, so no (B·T, V) float32 array is formed. The
  default path unrolls the chunks (each saved cotangent is its own buffer); ``recompute=True``
  runs them in a ``lax.scan``, one chunk's logits alive at a time. The backward's two GEMMs take
  the logits' cotangent in ``x``'s dtype; the kernel's gradient is float32, summed in float32
  across chunks.

  Memory: by default the forward saves each chunk's logits cotangent (softmax − onehot, in
  ``x``'s dtype) for the backward: 2 bytes × B·T × V for bf16 ``x``. ``recompute=True`` saves
  nothing per chunk (only the inputs) but recomputes the logits GEMM, the logsumexp and the
  cotangent in the backward.

  Args:
    x_BxTxD: final hidden states (compute dtype).
    kernel_DxV: LM head kernel (float32 master weight; cast to ``x``'s dtype for the GEMMs).
    targets_BxT: int target ids.
    chunk_tokens: tokens per chunk (B·T is padded up to a multiple; padded tokens have weight 0).
    recompute: recompute the logits in the backward instead of saving the (B·T, V) cotangent.
    implementation: which code makes the default path's forward pass over each chunk's float32
      logits (logsumexp, target logit, cotangent; ``fp4jax.execution``): ``"pallas"`` (one fused
      kernel, ``fp4jax.kernels.cross_entropy``), ``"xla"`` (its jnp reference,
      ``softmax_xent_rows_reference``), ``"pallas_interpret"`` (CPU tests) or ``"auto"`` (the kernel
      when computations go to a CUDA GPU, else XLA). Same values up to summation order.

  Returns:
    float32 scalar.
  """
  if chunk_tokens < 1:
    raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
  impl = _platform.resolve(execution.check("chunked_cross_entropy", implementation), "pallas")
  if x_BxTxD.shape[:-1] != targets_BxT.shape or kernel_DxV.shape[0] != x_BxTxD.shape[-1]:
    raise ValueError(f"chunked_cross_entropy: shapes x {x_BxTxD.shape}, kernel "
                     f"{kernel_DxV.shape}, targets {targets_BxT.shape} do not match")
  d = kernel_DxV.shape[0]
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
  if recompute:
    # A loop: one chunk's logits live at a time in the forward and in the backward.
    def body(total, xs):
      x_CxD, tgt_C, w_C = xs
      return total + _nll_sum_recompute(x_CxD, kernel_DxV, tgt_C, w_C), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (x_NxD.reshape(k, c, d), tgt_N.reshape(k, c), w_N.reshape(k, c)))
    return total / n
  # Unrolled: each chunk's saved cotangent is its own buffer. Under a scan the residuals would be one
  # stacked (k, C, V) array, which XLA zero-fills and then writes chunk by chunk (two extra passes
  # over the largest buffer of the step).
  total = jnp.zeros((), jnp.float32)
  for i in range(k):
    sl = slice(i * c, (i + 1) * c)
    total = total + _nll_sum(x_NxD[sl], kernel_DxV, tgt_N[sl], w_N[sl], impl)
  return total / n
