"""Decoder-only Transformer (Llama-style) in flax nnx, with per-projection precision from a recipe.

Pre-norm RMSNorm, rotary position embeddings, SwiGLU MLP, untied embedding and LM head, optional
QK-norm, grouped-query attention. The four projections of each block (qkv, o, gate_up, down: q/k/v
and gate/up are fused, as Transformer Engine does, so each is one larger GEMM) are
``fp4jax.layers.Dense`` layers whose matmul comes from ``Recipe.block_linear``; the embedding, the
LM head, the norms and the softmax stay high precision (float32 master weights,
``ModelConfig.dtype`` compute with float32 accumulation, float32 logits).

Parameters are named so that ``fp4jax.sharding`` can map them to PartitionSpecs::

  embed/embedding (V, D)             blocks/{i}/attn/{qkv,o}/<leaves>        final_norm/scale (D,)
  lm_head/kernel (D, V)              blocks/{i}/mlp/{gate_up,down}/<leaves>
  blocks/{i}/{attn_norm,mlp_norm}/scale, blocks/{i}/attn/{q_norm,k_norm}/scale (head_dim,)

With ``scan_layers``, ``blocks/{j}`` is the j-th run of consecutive same-precision blocks, its
leaves stacked on a leading axis (one ``lax.scan`` applies them).

Use it as an nnx module (``Transformer(cfg, recipe, rngs=nnx.Rngs(0))(tokens_BxT, key=key)``) or
functionally through ``nnx.split`` / ``nnx.merge`` (``fp4jax.train`` does the latter).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax import _platform, execution
from fp4jax.execution import Execution
from fp4jax.layers import Dense, MixedMatmul, NVFP4Matmul
from fp4jax.ops.attention import AttentionConfig, nvfp4_attention
from fp4jax.recipe import Recipe
from fp4jax.sharding import BATCH_AXES

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Transformer hyperparameters.

  Attributes:
    vocab_size: number of token ids; None only in an experiment whose data step sets it
      (``fp4jax.experiment.Experiment.with_data``): a model cannot be built without it.
    d_model: residual width D.
    n_layers: number of Transformer blocks L.
    n_heads: query heads N.
    n_kv_heads: key/value heads K (GQA; ``n_heads % n_kv_heads == 0``); None gives ``n_heads``.
    head_dim: per-head width H; None gives ``d_model // n_heads``.
    d_ff: SwiGLU hidden width F; None gives the multiple of 16 nearest ``8/3 * d_model``.

  A width given as None is set from the others when the config is made, so every width is read
  from its field (``cfg.head_dim``); ``dataclasses.replace`` copies the set widths, so give None
  again to derive one anew (e.g. ``replace(cfg, n_heads=8, head_dim=None)``).
    qk_norm: RMSNorm on queries and keys (per head) before RoPE.
    rope_theta: RoPE base.
    norm_eps: RMSNorm epsilon.
    dtype: compute dtype of activations and matmul operands ("bfloat16" or "float32").
    init_std: standard deviation of the projection and embedding initializers.
    scan_layers: apply each run of consecutive same-precision blocks with one ``lax.scan`` (one
      compiled block instead of L; the same initial values and forward/backward numerics as
      unrolled). The run's parameters are then stacked leaves (L_run, ...), a different parameter
      tree (checkpoints of the two do not restore into each other), and optimizer statistics kept
      per leaf cover the whole run: NVFP4 moments get one global scale per stacked leaf instead of
      one per block's leaf, and Muon, which orthogonalizes 2-D leaves, does not apply. Off by
      default so that a run's optimizer numerics are the per-block ones of the method.
    remat: rematerialize each block's activations in the backward pass (saves memory).
  """

  vocab_size: int | None
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int | None = None
  qk_norm: bool = True
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  dtype: str = "bfloat16"
  init_std: float = 0.02
  scan_layers: bool = False
  remat: bool = False

  def __post_init__(self):
    for f in ("vocab_size", "d_model", "n_layers", "n_heads"):
      if f == "vocab_size" and self.vocab_size is None:
        continue
      if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
        raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}: expected a positive int")
    derived = {"n_kv_heads": lambda: self.n_heads, "head_dim": lambda: self.d_model // self.n_heads,
               "d_ff": lambda: 16 * max(1, round(8 * self.d_model / 3 / 16))}
    for f, value in derived.items():
      if f == "head_dim" and self.head_dim is None and self.d_model % self.n_heads:
        raise ValueError(f"ModelConfig: d_model={self.d_model} is not divisible by "
                         f"n_heads={self.n_heads}; set head_dim")
      if getattr(self, f) is None:
        object.__setattr__(self, f, value())
      elif not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
        raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}: expected a positive int or None")
      if f == "n_kv_heads" and self.n_heads % self.n_kv_heads:
        raise ValueError(f"ModelConfig: n_heads={self.n_heads} is not a multiple of "
                         f"n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")
    if self.dtype not in ("bfloat16", "float32"):
      raise ValueError(f"ModelConfig.dtype={self.dtype!r}: expected 'bfloat16' or 'float32'")
    for f, low in (("rope_theta", 0.0), ("init_std", 0.0), ("norm_eps", None)):
      v = getattr(self, f)
      if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
          or (v <= low if low is not None else v < 0)):
        raise ValueError(f"ModelConfig.{f}={v!r}: expected a finite number "
                         + (f"> {low:g}" if low is not None else ">= 0"))

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def num_params(self, *, embedding: bool = True) -> int:
    """Number of parameters (dense projections; a LoRA-SVD branch is not counted)."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads)
    mlp = 3 * d * self.d_ff
    norms = 2 * d + (2 * h if self.qk_norm else 0)
    n = self.n_layers * (attn + mlp + norms) + d + d * self.vocab_size
    return n + (self.vocab_size * d if embedding else 0)

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (without the embedding gather) + 12·L·T·N·H (attention).

    The attention term counts the full T×T score matrix (PaLM's convention), not the causal half.
    """
    return 6 * self.num_params(embedding=False) + 12 * self.n_layers * seq_len * self.n_heads * \
        self.head_dim


def _cudnn_shapes_ok(cfg: ModelConfig) -> bool:
  return cfg.dtype == "bfloat16" and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128


_BF16_ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "xla")  # DotProductAttention's


def attention_impl(cfg: ModelConfig, implementation: str = "auto") -> str:
  """The ``implementation`` passed to ``jax.nn.dot_product_attention`` ("cudnn" or "xla").

  "auto" resolves at trace time: cuDNN when computations go to a CUDA GPU by default
  (``fp4jax._platform.default_platform``) and the shapes allow it, else XLA (CPU tests, a
  ``jax.default_device(cpu)`` scope, float32 models).
  """
  impl = _platform.resolve(implementation, "cudnn")
  return "xla" if implementation == "auto" and not _cudnn_shapes_ok(cfg) else impl


def projection_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """(in_features, out_features) of every projection role, for ``fp4jax.sharding``."""
  d, nh, kh, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
  return {"qkv": (d, nh + 2 * kh), "o": (nh, d), "gate_up": (d, 2 * f), "down": (f, d),
          "embedding": (cfg.vocab_size, d), "lm_head": (d, cfg.vocab_size)}


class Embed(nnx.Module):
  """Token embedding table (V, D), float32."""

  def __init__(self, vocab_size: int, d_model: int, *, std: float, rngs: nnx.Rngs):
    self.embedding = nnx.Param(std * jax.random.normal(rngs.params(), (vocab_size, d_model)))


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32, learned scale initialized at 1."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x):
    return _rms_norm(x, self.scale[...], self.eps)


# The elementwise parts of a block (norms, RoPE, SwiGLU gating) keep their (bf16) inputs for the
# backward instead of their float32 intermediates. Same values, half the saved bytes; it matters
# most under ``scan_layers``, where every residual is stacked over the blocks (XLA cannot recompute
# across the loop). RMSNorm has its own backward that also keeps the per-row 1/rms (4 bytes a row)
# instead of a second reduction pass over x.
def _rms_stats(x, eps):
  """float32 x and the per-row 1/rms."""
  x32 = x.astype(jnp.float32)
  return x32, jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _row(scale, ndim):
  return scale.reshape((1,) * (ndim - 1) + (-1,))


def _rms_norm_fwd(x, scale, eps):
  x32, rs = _rms_stats(x, eps)
  return (x32 * rs * _row(scale, x.ndim)).astype(x.dtype), (x, scale, rs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, eps: float):
  return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_bwd(eps, res, dy):
  # y = x̂ · scale with x̂ = x · r, r = (mean(x²) + eps)^-½:
  # dx = r · (g − x̂ · mean(g · x̂)) with g = dy · scale;  dscale = Σ_rows dy · x̂.
  del eps
  x, scale, rs = res
  xh = x.astype(jnp.float32) * rs
  dy32 = dy.astype(jnp.float32)
  g = dy32 * _row(scale, x.ndim)
  dx = rs * (g - xh * jnp.mean(g * xh, axis=-1, keepdims=True))
  dscale = jnp.sum((dy32 * xh).reshape(-1, x.shape[-1]), axis=0)
  return dx.astype(x.dtype), dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.checkpoint
def _swiglu(gu_BxTxFx2):
  return jax.nn.silu(gu_BxTxFx2[..., 0]) * gu_BxTxFx2[..., 1]


def _projection(in_features: int, out_features: int, precision: str, recipe: Recipe,
               cfg: ModelConfig, std: float, rngs: nnx.Rngs, role: str,
               execution: Execution, probe: bool = False) -> Dense:
  """One block projection in the given precision (``bf16``, ``nvfp4`` or ``nvfp4_lorasvd``).

  Args:
    in_features: input width.
    out_features: output width.
    precision: from ``Recipe.block_linear``.
    recipe: the recipe (the projection's matmul config, the LoRA rank).
    cfg: the model config (compute dtype).
    std: initializer standard deviation.
    rngs: parameter RNGs.
    role: the projection's name in its block (``qkv``, ``o``, ``gate_up``, ``down``): with
      ``nvfp4_lorasvd``, ``recipe.lora_on(role)`` says whether it carries the branch.
    execution: which code runs the NVFP4 matmul (``execution.matmul_execution``).
    probe: ``Dense``'s probe (``fp4jax.telemetry``).

  Returns:
    A ``fp4jax.layers.Dense`` called as ``layer(x, key=k)``, whose matmul is ``MixedMatmul`` (bf16),
    ``NVFP4Matmul(recipe.projection_matmul(role))`` (nvfp4: NVIDIA's recipe unless the recipe's
    ``matmul``, or for the down-projection its ``down_x``, changes it), or the latter with a bf16
    rank-``recipe.lora_rank`` branch split from the initial weight's SVD (nvfp4_lorasvd, on the
    projections of ``recipe.lora_projections``).
  """
  matmul = (MixedMatmul() if precision == "bf16"
            else NVFP4Matmul(recipe.projection_matmul(role), execution.matmul_execution))
  rank = recipe.lora_rank if precision == "nvfp4_lorasvd" and recipe.lora_on(role) else 0
  return Dense(in_features, out_features, matmul=matmul, rank=rank, rngs=rngs,
               kernel_init=nnx.initializers.normal(std), dtype=cfg.compute_dtype, probe=probe)


def _split_key(key, n: int) -> tuple:
  """``n`` keys from ``key``, or n Nones (a model without random bits)."""
  return (None,) * n if key is None else tuple(jax.random.split(key, n))


def _fold_key(key, i):
  return None if key is None else jax.random.fold_in(key, i)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def rope(x_BxTxNxH, positions_T, theta: float):
  """Rotary position embedding (rotate-half form), computed in float32.

  ``out = x · cos + rotate_half(x) · sin`` with ``rotate_half(x) = [-x2, x1]``: the output is one
  elementwise expression (the concatenate is on the small input side), which XLA fuses with the
  QK-norm; concatenating the two output halves cost a separate copy per q and k on the GPU.
  """
  h = x_BxTxNxH.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  ang_TxH2 = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
  ang_TxH = jnp.concatenate([ang_TxH2, ang_TxH2], axis=-1)
  sin, cos = jnp.sin(ang_TxH)[None, :, None, :], jnp.cos(ang_TxH)[None, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  x_rot = jnp.concatenate([-x[..., h // 2:], x[..., : h // 2]], axis=-1)
  return (x * cos + x_rot * sin).astype(x_BxTxNxH.dtype)


@dataclasses.dataclass(frozen=True)
class DotProductAttention:
  """Causal ``jax.nn.dot_product_attention`` on cuDNN or XLA, per ``attention_impl``.

  The attention op of BF16 attention: ``op(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *, key)`` -> (B, T, N, H)
  in q's dtype (deterministic: ``key`` is unused).

  Attributes:
    cfg: the model config (dtype and head_dim decide whether cuDNN takes the shapes).
    implementation: "auto" (cuDNN flash attention when computations go to a CUDA GPU and the shapes
      allow it: bfloat16 compute, head_dim a multiple of 8 up to 128; else XLA, which materializes
      float32 B×N×T×T scores), "cudnn" or "xla".
  """

  cfg: ModelConfig
  implementation: str = "auto"

  def __post_init__(self):
    execution.check("BF16 attention", self.implementation, _BF16_ATTENTION_IMPLEMENTATIONS)
    if self.implementation == "cudnn" and not _cudnn_shapes_ok(self.cfg):
      raise ValueError(f"BF16 attention: implementation='cudnn' needs dtype bfloat16 and head_dim a "
                       f"multiple of 8 up to 128 (got dtype={self.cfg.dtype}, "
                       f"head_dim={self.cfg.head_dim})")

  def __call__(self, q, k, v, *, key=None):
    del key
    return _attention(q, k, v, attention_impl(self.cfg, self.implementation),
                      fallback=self.implementation == "auto")


@dataclasses.dataclass(frozen=True)
class NVFP4Attention:
  """Causal ``fp4jax.ops.nvfp4_attention`` with ``config``: the attention op of ``attention="nvfp4"``.

  ``op(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *, key)`` -> (B, T, N, H) in q's dtype; ``key`` draws the
  stochastic rounding of dS (a fresh key per step and block, as the projections take).

  Attributes:
    config: what the products compute (``AttentionConfig``).
    implementation: which code computes them (``nvfp4_attention``'s ``implementation``).
  """

  config: AttentionConfig
  implementation: str = "auto"

  def __call__(self, q, k, v, *, key=None):
    return nvfp4_attention(q, k, v, causal=True, key=key, config=self.config,
                           implementation=self.implementation)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with RoPE and optional QK-norm.

  Args:
    cfg: model hyperparameters.
    recipe: the precision recipe.
    precision: the projections' precision (``Recipe.block_linear``).
    rngs: parameter RNGs.
    attention_op: ``op(q, k, v, *, key)`` computing causal attention from RoPE'd heads (default:
      ``NVFP4Attention(recipe.attention_op)`` for NVFP4 attention, else
      ``DotProductAttention(cfg)``, each with ``execution.attention``).
    execution: which code runs the projections and the attention (``fp4jax.execution``).
    probe: record the attention op's operands under ``nnx.capture`` (``fp4jax.telemetry``): q, k
      and v as ``nnx.Intermediate``s and its output through the ``nnx.Perturbation`` ``out``; the
      projections get ``Dense``'s probe. False (the default) leaves the computation as it is.
  """

  def __init__(self, cfg: ModelConfig, recipe: Recipe, precision: str, rngs: nnx.Rngs,
               attention_op: Callable | None, execution: Execution, probe: bool = False):
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.qkv = _projection(d, (n + 2 * k) * h, precision, recipe, cfg, cfg.init_std, rngs, "qkv",
                          execution, probe)
    self.o = _projection(n * h, d, precision, recipe, cfg, out_std, rngs, "o", execution, probe)
    self.probe = probe
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps)
      self.k_norm = RMSNorm(h, cfg.norm_eps)
    self.cfg = cfg
    if attention_op is None:
      attention_op = (DotProductAttention(cfg, execution.attention) if recipe.attention == "bf16"
                      else NVFP4Attention(recipe.attention_op, _nvfp4_attention_impl(execution)))
    self.attention_op = attention_op

  def __call__(self, x_BxTxD, key):
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    k_qkv, k_o = _split_key(key, 2)
    q, k, v = self._qkv(x_BxTxD, k_qkv)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    pos_T = jnp.arange(t)
    q, k = rope(q, pos_T, cfg.rope_theta), rope(k, pos_T, cfg.rope_theta)
    if self.probe:
      for name, value in (("q", q), ("k", k), ("v", v)):
        self.sow(nnx.Intermediate, name, value, reduce_fn=lambda _, x: x)
    o_BxTxNxH = self.attention_op(q, k, v, key=_fold_key(key, 2))
    if self.probe:
      o_BxTxNxH = self.perturb("out", o_BxTxNxH)
    return self.o(o_BxTxNxH.reshape(b, t, cfg.n_heads * cfg.head_dim), key=k_o)

  def _qkv(self, x_BxTxD, key):
    """q (B, T, N, H), k and v (B, T, K, H) from the one qkv projection.

    Its columns are grouped per KV head, ``[q_1 .. q_g, k, v]`` for each group, so a
    tensor-parallel split of the fused output keeps whole groups local (query head i attends with
    KV head i // g). ``Dense.split`` takes q, k and v as separate GEMMs where that keeps the
    numerics (bf16), else slices the fused GEMM's output.
    """
    b, t, _ = x_BxTxD.shape
    n, kv, h = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
    g = n // kv

    def columns(slot, width):
      def take(a):
        lead = a.shape[:-1]
        return a.reshape(*lead, kv, g + 2, h)[..., slot, :].reshape(*lead, width)
      return take

    q, k, v = self.qkv.split(x_BxTxD, (columns(slice(0, g), n * h), columns(g, kv * h),
                                       columns(g + 1, kv * h)), key=key)
    return q.reshape(b, t, n, h), k.reshape(b, t, kv, h), v.reshape(b, t, kv, h)


def _attention(q, k, v, impl: str, fallback: bool):
  """Causal ``jax.nn.dot_product_attention``; with ``fallback``, XLA if cuDNN refuses at trace
  time (e.g. an old cuDNN), with a warning."""
  try:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  except (RuntimeError, ValueError, NotImplementedError) as e:
    if impl != "cudnn" or not fallback:
      raise
    warnings.warn(f"cuDNN attention unavailable ({type(e).__name__}: {e}); using XLA attention, "
                  "which materializes B×N×T×T scores")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _nvfp4_attention_impl(execution: Execution) -> str:
  """``execution.attention`` for NVFP4 attention ("cudnn" runs BF16 attention only)."""
  if execution.attention == "cudnn":
    raise ValueError("Execution.attention='cudnn' runs BF16 attention only; NVFP4 attention "
                     "(recipe attention='nvfp4') takes 'auto', 'xla', 'pallas' or 'pallas_interpret'")
  return execution.attention


class Mlp(nnx.Module):
  """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one (D, 2F) projection."""

  def __init__(self, cfg: ModelConfig, recipe: Recipe, precision: str, rngs: nnx.Rngs,
               execution: Execution, probe: bool = False):
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.gate_up = _projection(cfg.d_model, 2 * cfg.d_ff, precision, recipe, cfg, cfg.init_std,
                              rngs, "gate_up", execution, probe)
    self.down = _projection(cfg.d_ff, cfg.d_model, precision, recipe, cfg, out_std, rngs, "down",
                           execution, probe)

  def __call__(self, x_BxTxD, key):
    k_gu, k_down = _split_key(key, 2)
    # Columns interleaved (gate_j, up_j), so a tensor-parallel split keeps the pairs local.
    gu_BxTxFx2 = self.gate_up(x_BxTxD, key=k_gu).reshape(*x_BxTxD.shape[:-1], -1, 2)
    h_BxTxF = _swiglu(gu_BxTxFx2)
    return self.down(h_BxTxF, key=k_down)


def _constrain_batch(x):
  """Pins the leading (batch) axis of an activation to the mesh's batch axes, if a mesh is set.

  Without it, GSPMD may shard activations along a weight's FSDP axis and then replicate them
  ("involuntary full rematerialization"). A no-op outside ``jax.set_mesh`` (e.g. on one device).
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in BATCH_AXES if not mesh.empty and a in mesh.axis_names)
  if not axes:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes))


class Block(nnx.Module):
  """Pre-norm Transformer block."""

  def __init__(self, cfg: ModelConfig, recipe: Recipe, precision: str, rngs: nnx.Rngs,
               attention_op: Callable | None, execution: Execution, probe: bool = False):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, recipe, precision, rngs, attention_op, execution, probe)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = Mlp(cfg, recipe, precision, rngs, execution, probe)

  def __call__(self, x_BxTxD, key):
    k_attn, k_mlp = _split_key(key, 2)
    x_BxTxD = _constrain_batch(x_BxTxD + self.attn(self.attn_norm(x_BxTxD), k_attn))
    return _constrain_batch(x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD), k_mlp))


class Transformer(nnx.Module):
  """Decoder-only language model: tokens (B, T) -> float32 logits (B, T, V).

  Args:
    cfg: model hyperparameters.
    recipe: precision recipe (``Recipe.block_linear`` gives each block's projections).
    rngs: parameter RNGs.
    execution: which code runs each op (``fp4jax.execution.Execution``; the numerics are the
      recipe's whatever it says).
    attention_op: the attention op of every block (default: ``NVFP4Attention`` when the recipe's
      attention is NVFP4, else ``DotProductAttention(cfg)``; see ``Attention``).
    probe: every block's attention op and projections record their operands under
      ``nnx.capture`` (``Attention``, ``fp4jax.layers.Dense``): the model of ``fp4jax.telemetry``,
      unrolled (``scan_layers=False``). False (the default): no recording, no cost.
  """

  def __init__(self, cfg: ModelConfig, recipe: Recipe, *, rngs: nnx.Rngs,
               execution: Execution = Execution(), attention_op: Callable | None = None,
               probe: bool = False):
    if cfg.vocab_size is None:
      raise ValueError("ModelConfig.vocab_size is None: set it, or let the data step set it "
                       "(fp4jax.experiment.Experiment.with_data)")
    self.cfg, self.recipe = cfg, recipe
    precisions = [recipe.block_linear(i, cfg.n_layers) for i in range(cfg.n_layers)]
    self.needs_key = any(p != "bf16" for p in precisions) or recipe.attention != "bf16"
    self.segments = _runs(precisions)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs)
    blocks = [Block(cfg, recipe, p, rngs, attention_op, execution, probe) for p in precisions]
    if cfg.scan_layers:  # stacked once here (the same initial values as unrolled)
      blocks = [_stack(blocks[start:stop]) for start, stop in self.segments]
    self.blocks = nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.lm_head = Dense(cfg.d_model, cfg.vocab_size, matmul=MixedMatmul(out_dtype=jnp.float32),
                         kernel_init=nnx.initializers.normal(cfg.init_std),
                         dtype=cfg.compute_dtype, rngs=rngs)

  def __call__(self, tokens_BxT, *, key=None):
    """Logits for next-token prediction.

    Args:
      tokens_BxT: int token ids.
      key: PRNG key for the stochastic rounding and Hadamard signs of the NVFP4 projections (a
        fresh one per step); may be None only when every projection is BF16.

    Returns:
      float32 logits (B, T, V).
    """
    return self.lm_head(self.features(tokens_BxT, key=key))

  def features(self, tokens_BxT, *, key=None):
    """The final-normed hidden states (B, T, D) in the compute dtype, before the LM head.

    Args:
      tokens_BxT: int token ids.
      key: as in ``__call__``.

    Returns:
      (B, T, D) array; ``fp4jax.loss.chunked_cross_entropy`` takes it with ``lm_head.kernel``.
    """
    if key is None and self.needs_key:
      raise ValueError(f"Transformer: the recipe's NVFP4 projections (linear={self.recipe.linear!r}) "
                       "draw random bits: pass key=, a fresh key per step")
    cfg = self.cfg
    x_BxTxD = jnp.take(self.embed.embedding[...], tokens_BxT, axis=0).astype(cfg.compute_dtype)
    x_BxTxD = _constrain_batch(x_BxTxD)
    if cfg.scan_layers:
      for (start, stop), stack in zip(self.segments, self.blocks, strict=True):
        x_BxTxD = _scan_blocks(stack, x_BxTxD, key, start, stop - start, cfg.remat)
    else:
      for i, block in enumerate(self.blocks):
        x_BxTxD = _apply_block(block, x_BxTxD, _fold_key(key, i), cfg.remat)
    return self.final_norm(x_BxTxD)


def _runs(precisions: list[str]) -> tuple[tuple[int, int], ...]:
  """Runs ``[start, stop)`` of consecutive blocks with the same projection precision."""
  runs, start = [], 0
  for i in range(1, len(precisions) + 1):
    if i == len(precisions) or precisions[i] != precisions[start]:
      runs.append((start, i))
      start = i
  return tuple(runs)


def _stack(blocks: list[Block]) -> Block:
  """One ``Block`` whose leaves are those of ``blocks`` stacked on a leading axis."""
  graphdef, _ = nnx.split(blocks[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.split(b)[1] for b in blocks))
  return nnx.merge(graphdef, stacked)


def _apply_block(block: Block, x_BxTxD, key, remat: bool):
  if not remat:
    return block(x_BxTxD, key)
  graphdef, state = nnx.split(block)
  apply = jax.checkpoint(lambda x, k, st: nnx.merge(graphdef, st)(x, k))
  return apply(x_BxTxD, key, state)


def _scan_blocks(stack: Block, x_BxTxD, key, start: int, n: int, remat: bool):
  """Applies the ``n`` blocks stacked in ``stack`` (blocks ``start ..``) with one ``lax.scan``."""
  graphdef, state = nnx.split(stack)

  def body(x, inputs):
    st, i = inputs
    return nnx.merge(graphdef, st)(x, _fold_key(key, i)), None

  if remat:
    body = jax.checkpoint(body)
  x_BxTxD, _ = jax.lax.scan(body, x_BxTxD, (state, start + jnp.arange(n)))
  return x_BxTxD
