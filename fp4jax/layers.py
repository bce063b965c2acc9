"""The projection layer of fp4jax: one flax nnx ``Dense`` whose matmul is injected.

``Dense(in_features, out_features, matmul=..., rank=r)`` computes ``matmul(x, W) (+ (x·A)·B) (+ b)``,
as ``flax.nnx.Linear`` takes a ``dot_general``. The matmul is a small frozen callable
``matmul(x, kernel, *, key) -> y``:

- ``MixedMatmul``: BF16 (``fp4jax.ops.mixed_matmul``: operands in ``x``'s dtype, float32
  accumulation, a bf16 backward);
- ``NVFP4Matmul(config, execution)``: the three GEMMs per ``fp4jax.ops.MatmulConfig``
  (``nvfp4_matmul``; ``MatmulConfig.nvfp4()`` is NVIDIA's recipe), run by the code that
  ``execution`` names (``fp4jax.execution.MatmulExecution``).

``rank > 0`` adds the LoRA-SVD branch ``(x·A)·B`` in bf16, unquantized: A and B start from the top-r
SVD of the initial weight (``A = U√Σ``, ``B = √Σ Vᵀ``) and the kernel holds ``W_res = W − A·B``, so the
effective weight starts equal to W while the quantized residual has the dominant directions taken
out. ``resplit`` repeats the split on the current ``W_res + A·B`` (optionally with a randomized SVD,
and with the new factors rotated onto the old ones' columns: ``lora_svd_split``'s ``align_to``).

``fp4_dense`` and ``lora_svd_dense`` build the two NVFP4 layers; ``lora_svd_split`` and
``randomized_svd`` are the pure functions behind the split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from fp4jax.ops.mixed import mixed_matmul, mixed_matmul_split
from fp4jax.execution import MatmulExecution
from fp4jax.ops.matmul import MatmulConfig, nvfp4_matmul
from fp4jax.quant import range_finder

_HIGHEST = lax.Precision.HIGHEST
_SVD_METHODS = ("exact", "randomized", "auto")
# ``svd="auto"`` uses the randomized SVD above this min(K, N): an exact SVD is O(K N min(K, N)).
_AUTO_RANDOMIZED_MIN_DIM = 2048
# The rank whose error reduction per extra FLOP is best on trained-like spectra
# (benchmarks/lorasvd_error.py).
DEFAULT_LORA_RANK = 16
_NO_METADATA: Mapping[str, Any] = MappingProxyType({})

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


# ----------------------------------------------------------------------------------------------
# Pure functions: SVD split


def randomized_svd(w_KxN, rank: int, key, *, oversample: int = 8, power_iters: int = 2):
  """Top-``rank`` SVD of ``w`` by randomized range finding with power iterations (Halko et al. 2011):
  ``fp4jax.quant.range_finder`` in float32, each power iteration re-orthonormalized.

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
  hdot = lambda a, b: jnp.dot(a, b, precision=_HIGHEST)
  q_KxP = range_finder(w, key, min(rank + oversample, k, n), power_iters, dot=hdot,
                       dot_t=lambda a, b: hdot(a.T, b), reorthonormalize=True)
  ub_PxP, s_P, vt_PxN = jnp.linalg.svd(jnp.dot(q_KxP.T, w, precision=_HIGHEST), full_matrices=False)
  u_KxP = jnp.dot(q_KxP, ub_PxP, precision=_HIGHEST)
  return u_KxP[:, :rank], s_P[:rank], vt_PxN[:rank]


def _svd_method(method: str, shape) -> str:
  if method not in _SVD_METHODS:
    raise ValueError(f"svd method must be one of {_SVD_METHODS}, got {method!r}")
  if method == "auto":
    return "randomized" if min(shape) > _AUTO_RANDOMIZED_MIN_DIM else "exact"
  return method


def lora_svd_split(w_KxN, rank: int, *, method: str = "exact", key=None, lora_dtype=jnp.bfloat16,
                   oversample: int = 8, power_iters: int = 2, align_to=None):
  """Splits ``W`` into a rank-r product ``A·B`` and a residual: ``W = W_res + A·B`` to fp32 rounding.

  Args:
    w_KxN: the weight.
    rank: ``0 <= rank <= min(K, N)``.
    method: ``"exact"`` (``jnp.linalg.svd``), ``"randomized"`` (``randomized_svd``, needs ``key``) or
      ``"auto"`` (randomized when ``min(K, N) > 2048``).
    key: random key for the randomized SVD.
    lora_dtype: A and B are rounded to this dtype (the branch's compute dtype) *before* the residual
      is formed, so the product the layer computes is exactly the one taken out of W.
    oversample, power_iters: randomized SVD settings.
    align_to: an earlier ``A`` (K×r) to align the new factors with: ``A = U√Σ·R`` and
      ``B = Rᵀ·√Σ Vᵀ`` with the orthogonal r×r ``R`` closest to mapping the new factor onto the old
      (orthogonal Procrustes: ``R = P·Qᵀ`` from the SVD ``P·S·Qᵀ`` of ``(U√Σ)ᵀ·A_old``). The product
      ``A·B`` and the balance ``AᵀA = BBᵀ`` are those of the unaligned split (up to rounding); the
      factors' columns follow the old ones' order and signs, which an SVD leaves arbitrary.

  Returns:
    ``(a_KxR, b_RxN, w_res_KxN)`` in float32, with ``A = U√Σ`` and ``B = √Σ Vᵀ`` (balanced:
    ``AᵀA ≈ BBᵀ ≈ Σ``; rotated by ``R`` with ``align_to``) and ``W_res = W − A·B``.
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
  a_KxR, b_RxN = u * root_s[None, :], root_s[:, None] * vt
  if align_to is not None:
    p, _, qt = jnp.linalg.svd(jnp.dot(a_KxR.T, jnp.asarray(align_to, jnp.float32), precision=_HIGHEST))
    r_RxR = jnp.dot(p, qt, precision=_HIGHEST)
    a_KxR, b_RxN = jnp.dot(a_KxR, r_RxR, precision=_HIGHEST), jnp.dot(r_RxR.T, b_RxN, precision=_HIGHEST)
  a_KxR = a_KxR.astype(lora_dtype).astype(jnp.float32)
  b_RxN = b_RxN.astype(lora_dtype).astype(jnp.float32)
  w_res = w - jnp.dot(a_KxR, b_RxN, precision=_HIGHEST)
  return a_KxR, b_RxN, w_res


# ----------------------------------------------------------------------------------------------
# Matmuls


@dataclasses.dataclass(frozen=True)
class MixedMatmul:
  """The BF16 matmul: ``fp4jax.ops.mixed_matmul`` with operands in ``x``'s dtype, float32
  accumulation and a backward in ``x``'s dtype.

  Attributes:
    out_dtype: dtype of the result (default ``x``'s; ``jnp.float32`` for logits).
  """

  out_dtype: Any = None
  needs_key = False

  def __call__(self, x, kernel, *, key=None):
    del key  # deterministic
    return mixed_matmul(x, kernel, x.dtype, self.out_dtype)

  def split(self, x, kernels: Sequence[jax.Array], *, key=None) -> tuple[jax.Array, ...]:
    """``tuple(self(x, k) for k in kernels)`` as separate GEMMs (``mixed_matmul_split``): the same
    forward bits as the columns of one GEMM over the concatenated kernels."""
    del key
    if self.out_dtype not in (None, x.dtype):
      raise ValueError(f"MixedMatmul.split: out_dtype={self.out_dtype} must be x's dtype {x.dtype}")
    return mixed_matmul_split(x, tuple(kernels), x.dtype)


@dataclasses.dataclass(frozen=True)
class NVFP4Matmul:
  """The NVFP4 matmul: ``fp4jax.ops.nvfp4_matmul`` with ``config`` (NVIDIA's recipe by default).

  Attributes:
    config: which GEMMs are quantized and how each operand is quantized (the numerics).
    execution: which code runs it (``fp4jax.execution.MatmulExecution``; the same bits).
  """

  config: MatmulConfig = MatmulConfig.nvfp4()
  execution: MatmulExecution = MatmulExecution()

  def __post_init__(self):
    if not isinstance(self.config, MatmulConfig):
      raise ValueError(f"NVFP4Matmul: config must be a MatmulConfig, got {type(self.config).__name__}")
    if not isinstance(self.execution, MatmulExecution):
      raise ValueError(f"NVFP4Matmul: execution must be a MatmulExecution, got {type(self.execution).__name__}")

  @property
  def needs_key(self) -> bool:
    return self.config.needs_key

  def __call__(self, x, kernel, *, key=None):
    return nvfp4_matmul(x, kernel, key=key, config=self.config, execution=self.execution)


# ----------------------------------------------------------------------------------------------
# The layer


def _init(init, key, shape, dtype):
  """Runs an initializer; unwraps ``nnx.with_partitioning`` metadata into (value, metadata)."""
  v = init(key, shape, dtype)
  if isinstance(v, nnx.VariableMetadata):
    return v.raw_value, dict(v.metadata)
  return v, {}


def _add_bias(y, b_N):
  # Added in float32, so its gradient is a float32 sum over tokens (a bf16 reduction over many
  # tokens loses precision).
  b = b_N.astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
  return (y.astype(jnp.float32) + b).astype(y.dtype)


def _last(_, value):
  """``sow``'s reduction that keeps the last value recorded."""
  return value


def _param(value, metadata: Mapping[str, Any]):
  return nnx.Param(value, **dict(metadata))


class Dense(nnx.Module):
  """``y = matmul(x, kernel) (+ (x·A)·B) (+ bias)``: a linear layer with an injected matmul.

  Parameters: ``kernel`` (K, N) (``W_res`` when ``rank > 0``), ``lora_a`` (K, r) and ``lora_b``
  (r, N) when ``rank > 0``, ``bias`` (N,) when ``use_bias``.

  Args:
    in_features, out_features: K and N; multiples of 16 where the matmul quantizes.
    rngs: ``nnx.Rngs`` for the initializers.
    matmul: ``MixedMatmul()`` (BF16, the default), ``NVFP4Matmul(config)``, or any callable
      ``matmul(x, kernel, *, key) -> y``; one with a ``split(x, kernels, *, key)`` method serves
      ``Dense.split`` with separate GEMMs.
    rank: r of the bf16 LoRA-SVD branch, ``0 <= r <= min(K, N)``; 0: none.
    param_dtype: master weight dtype (float32; bfloat16 by option).
    kernel_init, bias_init: initializers (``nnx.with_partitioning`` wrappers are fine).
    use_bias: add a bias (in float32, after the GEMM).
    dtype: compute dtype; ``x`` is cast to it (default: keep ``x``'s dtype).
    lora_dtype: compute dtype of the low-rank branch (A, B are rounded to it at every split).
    lora_param_dtype: storage dtype of A and B (default ``param_dtype``: float32 masters cast to
      ``lora_dtype`` for each use; bfloat16 trains them in bf16).
    svd: ``"exact"``, ``"randomized"`` or ``"auto"`` (randomized where ``min(K, N) > 2048``).
    svd_oversample, svd_power_iters: randomized SVD settings.
    kernel_metadata, lora_a_metadata, lora_b_metadata, bias_metadata: extra ``nnx.Param``
      metadata (e.g. ``out_sharding``).
    probe: record the matmul's operands under ``nnx.capture`` (``fp4jax.telemetry``): its input as
      the ``nnx.Intermediate`` ``x`` and its output through the ``nnx.Perturbation`` ``y`` (whose
      gradient is the output's cotangent); ``split`` then takes one GEMM. False (the default)
      leaves the layer's computation as it is.
  """

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               matmul: Callable = MixedMatmul(), rank: int = 0, param_dtype=jnp.float32,
               kernel_init=default_kernel_init, use_bias: bool = False,
               bias_init=default_bias_init, dtype=None, lora_dtype=jnp.bfloat16,
               lora_param_dtype=None, svd: str = "auto", svd_oversample: int = 8,
               svd_power_iters: int = 2, kernel_metadata: Mapping[str, Any] = _NO_METADATA,
               lora_a_metadata: Mapping[str, Any] = _NO_METADATA,
               lora_b_metadata: Mapping[str, Any] = _NO_METADATA,
               bias_metadata: Mapping[str, Any] = _NO_METADATA, probe: bool = False):
    if not callable(matmul):
      raise ValueError(f"Dense: matmul must be callable, got {type(matmul).__name__}")
    if not isinstance(rank, int) or not 0 <= rank <= min(in_features, out_features):
      raise ValueError(f"Dense: rank must be in [0, min(in_features, out_features)] = "
                       f"[0, {min(in_features, out_features)}], got {rank}")
    _svd_method(svd, (in_features, out_features))
    self.in_features, self.out_features, self.rank = in_features, out_features, rank
    self.matmul, self.dtype, self.param_dtype = matmul, dtype, param_dtype
    self.lora_dtype, self.svd = lora_dtype, svd
    self.svd_oversample, self.svd_power_iters = svd_oversample, svd_power_iters
    self.probe = probe
    shape = (in_features, out_features)
    self.lora_a = self.lora_b = nnx.data(None)
    if rank:
      w, meta = _init(kernel_init, rngs.params(), shape, jnp.float32)
      a, b, w = self._split(w, rngs.params())
      lora_param_dtype = param_dtype if lora_param_dtype is None else lora_param_dtype
      self.lora_a = _param(a.astype(lora_param_dtype), lora_a_metadata)
      self.lora_b = _param(b.astype(lora_param_dtype), lora_b_metadata)
      w = w.astype(param_dtype)
    else:
      w, meta = _init(kernel_init, rngs.params(), shape, param_dtype)
    self.kernel = _param(w, {**meta, **kernel_metadata})
    self.bias = nnx.data(None)
    if use_bias:
      b, meta = _init(bias_init, rngs.params(), (out_features,), param_dtype)
      self.bias = _param(b, {**meta, **bias_metadata})

  def _split(self, w, key, method=None, align_to=None):
    return lora_svd_split(w, self.rank, method=method or self.svd, key=key, lora_dtype=self.lora_dtype,
                          oversample=self.svd_oversample, power_iters=self.svd_power_iters, align_to=align_to)

  def _cast(self, x):
    return x if self.dtype is None else x.astype(self.dtype)

  def __call__(self, x_BxTxK, *, key=None):
    """Applies the layer. ``key``: fresh per step; None only if the matmul draws no random bits."""
    x = self._cast(x_BxTxK)
    if self.probe:
      self.sow(nnx.Intermediate, "x", x, reduce_fn=_last)
    y = self.matmul(x, self.kernel[...], key=key)
    if self.probe:
      y = self.perturb("y", y)
    if self.rank:
      ld = self.lora_dtype
      xa = mixed_matmul(x, self.lora_a[...], ld)
      y = y + mixed_matmul(xa, self.lora_b[...], ld).astype(y.dtype)
    if self.bias is not None:
      y = _add_bias(y, self.bias[...])
    return y

  def split(self, x_BxTxK, columns: Sequence[Callable[[jax.Array], jax.Array]], *,
            key=None) -> tuple[jax.Array, ...]:
    """``tuple(c(self(x)) for c in columns)``: groups of output columns.

    Each ``c`` takes an array's columns from its last axis (e.g. a reshape and a slice), so it
    applies to the kernel as well as to the output. Where the matmul has a ``split`` and the layer
    no low-rank branch, bias or probe, each group is its own GEMM on ``c(kernel)``: the same forward
    bits, without strided copies of the fused output. Otherwise (an NVFP4 matmul quantizes the whole
    kernel with one global scale) it is one GEMM whose output is sliced.
    """
    split = getattr(self.matmul, "split", None)
    if split is None or self.rank or self.bias is not None or self.probe:
      y = self(x_BxTxK, key=key)
      return tuple(c(y) for c in columns)
    kernel = self.kernel[...]
    return split(self._cast(x_BxTxK), tuple(c(kernel) for c in columns), key=key)

  def effective_kernel(self) -> jax.Array:
    """``W_res + A·B`` in float32 (the weight the layer represents; ``kernel`` when rank is 0)."""
    w = self.kernel[...].astype(jnp.float32)
    if not self.rank:
      return w
    return w + jnp.dot(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32),
                       precision=_HIGHEST)

  def resplit(self, key=None, *, method: str | None = None, aligned: bool = False) -> None:
    """Re-splits the effective weight: new ``A, B`` from its top-r SVD, ``W_res = W_eff − A·B``.

    ``W_eff`` is preserved to fp32 rounding (float32 params). The gradient of ``kernel`` is the
    loss's gradient in ``W_eff`` before and after, so its optimizer moments stay meaningful; those
    of ``lora_a`` and ``lora_b`` refer to the old factors' columns, which a new SVD may reorder,
    flip or rotate (``aligned`` keeps them; ``fp4jax.loop.make_lora_resplit`` says what a run
    does with them).

    Args:
      key: random key; needed when the SVD method is (or ``"auto"`` resolves to) randomized.
      method: the SVD (``lora_svd_split``'s ``method``); None: the layer's ``svd``.
      aligned: rotate the new factors onto the current ``A`` (``lora_svd_split``'s ``align_to``).
    """
    if not self.rank:
      raise ValueError("Dense.resplit: the layer has no low-rank branch (rank=0)")
    align_to = self.lora_a[...].astype(jnp.float32) if aligned else None
    a, b, w_res = self._split(self.effective_kernel(), key, method, align_to)
    self.kernel[...] = w_res.astype(self.kernel[...].dtype)
    self.lora_a[...] = a.astype(self.lora_a[...].dtype)
    self.lora_b[...] = b.astype(self.lora_b[...].dtype)


def fp4_dense(in_features: int, out_features: int, *, config: MatmulConfig, rngs: nnx.Rngs,
              **kwargs) -> Dense:
  """``Dense`` whose GEMMs (forward, dgrad, wgrad) follow ``config`` through ``nvfp4_matmul``.

  Args:
    in_features, out_features: K and N; multiples of 16 where ``config`` quantizes.
    config: ``MatmulConfig`` (``MatmulConfig.nvfp4()`` for NVIDIA's recipe, ``.bf16()`` for none).
    rngs: ``nnx.Rngs`` for the initializers.
    **kwargs: the other arguments of ``Dense`` (``param_dtype``, ``kernel_init``, ``use_bias``,
      ``dtype``, metadata, ...).

  Returns:
    ``Dense(in_features, out_features, matmul=NVFP4Matmul(config), ...)``.
  """
  return Dense(in_features, out_features, matmul=NVFP4Matmul(config), rngs=rngs, **kwargs)


def lora_svd_dense(in_features: int, out_features: int, *, rank: int = DEFAULT_LORA_RANK,
                   config: MatmulConfig, rngs: nnx.Rngs, **kwargs) -> Dense:
  """``x @ W_res + (x @ A) @ B (+ bias)``: NVFP4 residual GEMMs per ``config`` plus a bf16 rank-r
  branch split from the initial weight's SVD (see the module docstring).

  Args:
    in_features, out_features: K and N.
    rank: r, ``1 <= r <= min(K, N)``.
    config: ``MatmulConfig`` of the residual's GEMMs.
    rngs: ``nnx.Rngs`` for the initializers and the randomized SVD.
    **kwargs: the other arguments of ``Dense`` (``lora_dtype``, ``lora_param_dtype``, ``svd``, ...).

  Returns:
    ``Dense(in_features, out_features, matmul=NVFP4Matmul(config), rank=rank, ...)``.
  """
  if not isinstance(rank, int) or not 1 <= rank <= min(in_features, out_features):
    raise ValueError(f"lora_svd_dense: rank must be in [1, min(in_features, out_features)] = "
                     f"[1, {min(in_features, out_features)}], got {rank}")
  return Dense(in_features, out_features, matmul=NVFP4Matmul(config), rank=rank, rngs=rngs,
               **kwargs)
