"""Flax NNX layers on top of the NVFP4 ops.

Dense layers (this section is self-contained):

- ``Fp4Dense``: ``y = x @ W (+ b)`` with the three GEMMs in NVFP4 (``fp4jax.ops.nvfp4_matmul``);
  master weight in float32 (or bf16 by option).
- ``LoraSvdDense``: ``y = x @ W_res + (x @ A) @ B (+ b)`` with ``W_res`` through ``nvfp4_matmul`` and
  the rank-r branch in bf16, unquantized. A and B start from the top-r SVD of the initial weight
  (``A = U√Σ``, ``B = √Σ Vᵀ``) and ``W_res = W − A·B``, so the effective weight starts equal to W while
  the quantized residual has the dominant directions taken out. ``resplit`` repeats the split on the
  current ``W_res + A·B`` (call it every k steps from the training loop if wanted).
- ``lora_svd_split`` and ``randomized_svd``: the pure functions behind it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from fp4jax.ops.dense import mixed_matmul
from fp4jax.ops.matmul import MatmulConfig, nvfp4_matmul

_HIGHEST = lax.Precision.HIGHEST
_SVD_METHODS = ("exact", "randomized", "auto")
# ``svd="auto"`` uses the randomized SVD above this min(K, N): an exact SVD is O(K N min(K, N)).
AUTO_RANDOMIZED_MIN_DIM = 2048
# Chosen by measurement (benchmarks/lorasvd_error.md): on trained-like spectra r=16 removes 27-83% of
# the weight's NVFP4 error at <=3% extra FLOPs for d >= 1024; r=32 gains 3-30% more for twice the cost.
DEFAULT_LORA_RANK = 16

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


# ----------------------------------------------------------------------------------------------
# Pure functions: SVD split


def randomized_svd(w_KxN, rank: int, key, *, oversample: int = 8, power_iters: int = 2):
  """Top-``rank`` SVD of ``w`` by randomized range finding with power iterations (Halko et al. 2011).

  Args:
    w_KxN: matrix (computed in float32).
    rank: number of singular triplets, ``0 <= rank <= min(K, N)``.
    key: random key for the Gaussian test matrix.
    oversample: extra sketch columns (accuracy of the top ``rank`` directions).
    power_iters: subspace iterations, each re-orthonormalized (sharpens a slowly decaying spectrum).

  Returns:
    ``(u_KxR, s_R, vt_RxN)``, singular values descending.
  """
  w = jnp.asarray(w_KxN, jnp.float32)
  k, n = w.shape
  p = min(rank + oversample, k, n)
  omega_NxP = jax.random.normal(key, (n, p), jnp.float32)
  q_KxP, _ = jnp.linalg.qr(jnp.dot(w, omega_NxP, precision=_HIGHEST))
  for _ in range(power_iters):
    z_NxP, _ = jnp.linalg.qr(jnp.dot(w.T, q_KxP, precision=_HIGHEST))
    q_KxP, _ = jnp.linalg.qr(jnp.dot(w, z_NxP, precision=_HIGHEST))
  ub_PxP, s_P, vt_PxN = jnp.linalg.svd(jnp.dot(q_KxP.T, w, precision=_HIGHEST), full_matrices=False)
  u_KxP = jnp.dot(q_KxP, ub_PxP, precision=_HIGHEST)
  return u_KxP[:, :rank], s_P[:rank], vt_PxN[:rank]


def _svd_method(method: str, shape) -> str:
  if method not in _SVD_METHODS:
    raise ValueError(f"svd method must be one of {_SVD_METHODS}, got {method!r}")
  if method == "auto":
    return "randomized" if min(shape) > AUTO_RANDOMIZED_MIN_DIM else "exact"
  return method


def lora_svd_split(w_KxN, rank: int, *, method: str = "exact", key=None, lora_dtype=jnp.bfloat16,
                   oversample: int = 8, power_iters: int = 2):
  """Splits ``W`` into a rank-r product ``A·B`` and a residual: ``W = W_res + A·B`` to fp32 rounding.

  Args:
    w_KxN: the weight.
    rank: ``0 <= rank <= min(K, N)``.
    method: ``"exact"`` (``jnp.linalg.svd``), ``"randomized"`` (``randomized_svd``, needs ``key``) or
      ``"auto"`` (randomized when ``min(K, N) > AUTO_RANDOMIZED_MIN_DIM``).
    key: random key for the randomized SVD.
    lora_dtype: A and B are rounded to this dtype (the branch's compute dtype) *before* the residual
      is formed, so the product the layer computes is exactly the one taken out of W.
    oversample, power_iters: randomized SVD settings.

  Returns:
    ``(a_KxR, b_RxN, w_res_KxN)`` in float32, with ``A = U√Σ`` and ``B = √Σ Vᵀ`` (balanced:
    ``AᵀA ≈ BBᵀ ≈ Σ``) and ``W_res = W − A·B``.
  """
  w = jnp.asarray(w_KxN, jnp.float32)
  if w.ndim != 2:
    raise ValueError(f"lora_svd_split: w must be 2-D, got shape {w.shape}")
  if not 0 <= rank <= min(w.shape):
    raise ValueError(f"lora_svd_split: rank must be in [0, min(K, N)] = [0, {min(w.shape)}], got {rank}")
  method = _svd_method(method, w.shape)
  if method == "randomized":
    if key is None:
      raise ValueError("lora_svd_split: method='randomized' needs a `key`")
    u, s, vt = randomized_svd(w, rank, key, oversample=oversample, power_iters=power_iters)
  else:
    u, s, vt = jnp.linalg.svd(w, full_matrices=False)
    u, s, vt = u[:, :rank], s[:rank], vt[:rank]
  root_s = jnp.sqrt(s)
  a_KxR = (u * root_s[None, :]).astype(lora_dtype).astype(jnp.float32)
  b_RxN = (root_s[:, None] * vt).astype(lora_dtype).astype(jnp.float32)
  w_res = w - jnp.dot(a_KxR, b_RxN, precision=_HIGHEST)
  return a_KxR, b_RxN, w_res


# ----------------------------------------------------------------------------------------------
# Modules


def _init(init, key, shape, dtype):
  """Runs an initializer; unwraps ``nnx.with_partitioning`` metadata into (value, metadata)."""
  v = init(key, shape, dtype)
  if isinstance(v, nnx.VariableMetadata):
    return v.raw_value, dict(v.metadata)
  return v, {}


def _add_bias(y, b_N):
  # Added in f32: its gradient is then a float32 sum over tokens. A bf16 add would make it a bf16
  # reduction, which the H200 accumulated with 1.7e-2 relative error over 512 tokens.
  b = b_N.astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
  return (y.astype(jnp.float32) + b).astype(y.dtype)


def _param(value, metadata: Mapping[str, Any]):
  return nnx.Param(value, **dict(metadata))


class Fp4Dense(nnx.Module):
  """Dense layer ``x @ kernel (+ bias)`` with NVFP4 GEMMs (forward, dgrad, wgrad) per ``config``.

  Args:
    in_features, out_features: K and N; multiples of 16 where ``config`` quantizes.
    config: ``MatmulConfig`` (``MatmulConfig.nvfp4()`` for NVIDIA's recipe, ``.bf16()`` for none).
    rngs: ``nnx.Rngs`` for the initializers.
    param_dtype: master weight dtype (float32; bfloat16 by option).
    kernel_init, bias_init: initializers (``nnx.with_partitioning`` wrappers are fine).
    use_bias: add a bias (in the compute dtype, after the GEMM).
    dtype: compute dtype; ``x`` is cast to it (default: keep ``x``'s dtype).
    kernel_metadata, bias_metadata: extra ``nnx.Param`` metadata (e.g. ``out_sharding``).
  """

  def __init__(self, in_features: int, out_features: int, *, config: MatmulConfig, rngs: nnx.Rngs,
               param_dtype=jnp.float32, kernel_init=default_kernel_init, use_bias: bool = False,
               bias_init=default_bias_init, dtype=None,
               kernel_metadata: Mapping[str, Any] = {}, bias_metadata: Mapping[str, Any] = {}):
    if not isinstance(config, MatmulConfig):
      raise ValueError(f"Fp4Dense: config must be a MatmulConfig, got {type(config).__name__}")
    self.in_features, self.out_features = in_features, out_features
    self.config, self.dtype, self.param_dtype = config, dtype, param_dtype
    w, meta = _init(kernel_init, rngs.params(), (in_features, out_features), param_dtype)
    self.kernel = _param(w, {**meta, **kernel_metadata})
    self.bias = nnx.data(None)
    if use_bias:
      b, meta = _init(bias_init, rngs.params(), (out_features,), param_dtype)
      self.bias = _param(b, {**meta, **bias_metadata})

  def __call__(self, x_BxTxK, *, key=None):
    """Applies the layer. ``key``: fresh per step; None only if ``config.needs_key`` is False."""
    x = x_BxTxK if self.dtype is None else x_BxTxK.astype(self.dtype)
    y = nvfp4_matmul(x, self.kernel[...], key=key, config=self.config)
    if self.bias is not None:
      y = _add_bias(y, self.bias[...])
    return y


class LoraSvdDense(nnx.Module):
  """``x @ W_res + (x @ A) @ B (+ bias)``: NVFP4 residual GEMMs plus a bf16 low-rank branch.

  ``W_res`` (param ``kernel``) goes through ``nvfp4_matmul`` with ``config``; ``A`` (``lora_a``,
  ``[K, r]``) and ``B`` (``lora_b``, ``[r, N]``) are trainable, stored in ``lora_param_dtype`` and
  used in ``lora_dtype`` (bf16), unquantized. At init, ``A = U√Σ``, ``B = √Σ Vᵀ`` from the top-r SVD of the
  initial weight and ``W_res = W − A·B``: the effective weight ``W_res + A·B`` equals the initial
  weight to fp32 rounding.

  Args:
    in_features, out_features: K and N.
    rank: r, ``1 <= r <= min(K, N)``.
    config, rngs, param_dtype, kernel_init, use_bias, bias_init, dtype: as ``Fp4Dense``.
    lora_dtype: compute dtype of the low-rank branch (A, B are rounded to it at every split).
    lora_param_dtype: storage dtype of A and B (default: ``param_dtype``, i.e. float32 masters
      updated by the optimizer and cast to ``lora_dtype`` for each use; pass bfloat16 to train
      them in bf16).
    svd: ``"exact"``, ``"randomized"`` or ``"auto"`` (randomized above ``AUTO_RANDOMIZED_MIN_DIM``).
    svd_oversample, svd_power_iters: randomized SVD settings.
    kernel_metadata, lora_a_metadata, lora_b_metadata, bias_metadata: extra ``nnx.Param`` metadata.
  """

  def __init__(self, in_features: int, out_features: int, *, rank: int = DEFAULT_LORA_RANK,
               config: MatmulConfig, rngs: nnx.Rngs, param_dtype=jnp.float32,
               kernel_init=default_kernel_init, use_bias: bool = False,
               bias_init=default_bias_init, dtype=None, lora_dtype=jnp.bfloat16, lora_param_dtype=None,
               svd: str = "auto", svd_oversample: int = 8, svd_power_iters: int = 2,
               kernel_metadata: Mapping[str, Any] = {}, lora_a_metadata: Mapping[str, Any] = {},
               lora_b_metadata: Mapping[str, Any] = {}, bias_metadata: Mapping[str, Any] = {}):
    if not isinstance(config, MatmulConfig):
      raise ValueError(f"LoraSvdDense: config must be a MatmulConfig, got {type(config).__name__}")
    if not 1 <= rank <= min(in_features, out_features):
      raise ValueError(f"LoraSvdDense: rank must be in [1, min(in_features, out_features)] = "
                       f"[1, {min(in_features, out_features)}], got {rank}")
    _svd_method(svd, (in_features, out_features))
    self.in_features, self.out_features, self.rank = in_features, out_features, rank
    self.config, self.dtype, self.param_dtype, self.lora_dtype = config, dtype, param_dtype, lora_dtype
    self.svd, self.svd_oversample, self.svd_power_iters = svd, svd_oversample, svd_power_iters
    w, meta = _init(kernel_init, rngs.params(), (in_features, out_features), jnp.float32)
    a, b, w_res = self._split(w, rngs.params())
    self.kernel = _param(w_res.astype(param_dtype), {**meta, **kernel_metadata})
    lora_param_dtype = param_dtype if lora_param_dtype is None else lora_param_dtype
    self.lora_a = _param(a.astype(lora_param_dtype), lora_a_metadata)
    self.lora_b = _param(b.astype(lora_param_dtype), lora_b_metadata)
    self.bias = nnx.data(None)
    if use_bias:
      bias, meta = _init(bias_init, rngs.params(), (out_features,), param_dtype)
      self.bias = _param(bias, {**meta, **bias_metadata})

  def _split(self, w, key):
    return lora_svd_split(w, self.rank, method=self.svd, key=key, lora_dtype=self.lora_dtype,
                          oversample=self.svd_oversample, power_iters=self.svd_power_iters)

  def effective_kernel(self) -> jax.Array:
    """``W_res + A·B`` in float32 (the weight the layer represents)."""
    ab = jnp.dot(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32), precision=_HIGHEST)
    return self.kernel[...].astype(jnp.float32) + ab

  def resplit(self, key=None) -> None:
    """Re-splits the effective weight: new ``A, B`` from its top-r SVD, ``W_res = W_eff − A·B``.

    ``W_eff`` is preserved to fp32 rounding (float32 params). Optimizer moments of ``kernel``,
    ``lora_a`` and ``lora_b`` refer to the old split afterwards: reset them, or accept stale moments.

    Args:
      key: random key; needed when the SVD method is (or ``"auto"`` resolves to) randomized.
    """
    a, b, w_res = self._split(self.effective_kernel(), key)
    self.kernel[...] = w_res.astype(self.kernel[...].dtype)
    self.lora_a[...] = a.astype(self.lora_a[...].dtype)
    self.lora_b[...] = b.astype(self.lora_b[...].dtype)

  def __call__(self, x_BxTxK, *, key=None):
    """Applies the layer. ``key``: fresh per step; None only if ``config.needs_key`` is False."""
    x = x_BxTxK if self.dtype is None else x_BxTxK.astype(self.dtype)
    y = nvfp4_matmul(x, self.kernel[...], key=key, config=self.config)
    ld = self.lora_dtype
    xa = mixed_matmul(x, self.lora_a[...], ld)
    y = y + mixed_matmul(xa, self.lora_b[...], ld).astype(y.dtype)
    if self.bias is not None:
      y = _add_bias(y, self.bias[...])
    return y
