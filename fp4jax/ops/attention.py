"""NVFP4 attention with a ``custom_vjp``: QKᵀ and the backward's dS products in NVFP4, with tensor reuse.

Layout: q ``[B, T, H, D]``, k and v ``[B, S, Hk, D]``, ``H % Hk == 0`` (query head ``h`` reads key/value
head ``h // (H // Hk)``), D a multiple of 16 (64 or 128 for the flash kernels). With ``Q(·)`` NVFP4
quantization (``fp4jax.nvfp4``) and
``deq(·)`` its ``dequantize`` to the inputs' dtype (exact in float32; in bf16 one rounding of the
float32 product of codes and scales, the operands the flash kernels take), the default
``AttentionConfig.nvfp4()`` computes::

  forward   S  = deq(Q(q))·deq(Q(k))ᵀ / √D             1×16 blocks along D, one global scale per tensor
            L  = logsumexp_rows(S)  (f32);  P = exp(S − L);  O = P·V
  backward  P  recomputed from the same packed Q(q), Q(k) and L (bit-identical to the forward's)
            dV = Pᵀ·dO;  dP = dO·Vᵀ;  δ = rowsum(dO∘O);  dS = P∘(dP − δ) / √D
            dQ = deq(Q(dS))·deq(Q(k));  dK = deq(Q(dS))ᵀ·deq(Q(q))

dS is quantized in 16×16 blocks of each ``[T, S]`` matrix (one packed dS serves both products) with
stochastic rounding, and its second-level (float32) scale is set per ``ds_tile`` of that matrix
(``_fake_quant_ds``). Every product takes operands in the inputs' dtype with float32 accumulation; the
softmax is float32. ``AttentionConfig`` holds one ``fp4jax.quant.Operand`` for each operand of the seven
products: NVFP4 or the plain input, its rounding and (q, k, v) its block scale rule (Four over Six).
With ``k_smooth``, k's mean over the keys is subtracted before Q(k) (K smoothing: exact under the
softmax, and the packed Q(k − k̄) serves forward and backward). With ``hadamard``, q and k are
rotated along D by the same orthonormal Hadamard matrix before anything else (``rotated``; exact in
``q·kᵀ``). Gradients reach q, k, v straight through their quantizers (k̄ held constant) and back
through the rotation.

``nvfp4_attention_reference`` / ``nvfp4_attention_vjp_reference`` are the same numerics in plain jnp
with S, P and dS materialized; they are the op's ``implementation="xla"``. ``"pallas"`` runs the flash
kernels of ``fp4jax.kernels.attention`` on the same decoded operands. See docs/DESIGN.md, "Attention".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _platform, execution, numerics, nvfp4
from fp4jax.kernels import attention as attention_kernels
from fp4jax.kernels import nvfp4_quantize
from fp4jax.quant import Operand

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST
# The operands, in the order of their random keys: fixed, so that a config switch never moves
# another operand's bits.
OPERANDS = ("q", "k", "v", "p", "do", "ds")
_BLOCKS = {**dict.fromkeys(OPERANDS, (1, nvfp4.BLOCK)), "ds": (nvfp4.BLOCK, nvfp4.BLOCK)}
_HEAD_DIMS = (64, 128)  # the flash kernels' head dims; the XLA path takes any multiple of 16
_SCALE_SCOPES = ("tile", "matrix", "tensor")
# The operands quantized by one quantizer call over the whole tensor (``_operand``), which takes any
# ``scale_rule``; P's and dS's quantizers run inside the flash kernels and scale each block by its amax.
_SCALE_RULE_OPERANDS = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How ``nvfp4_attention`` quantizes each operand of its seven products: one ``Operand`` each.

  Frozen and hashable (a static argument). ``AttentionConfig.nvfp4()`` is the method's default;
  ``AttentionConfig.bf16()`` quantizes nothing and equals ``jax.nn.dot_product_attention``. Any
  operand can be switched alone, e.g. ``AttentionConfig.nvfp4(v=Operand())`` (V in NVFP4, nearest)
  or ``dataclasses.replace(config, ds=dataclasses.replace(config.ds, format="bf16"))``; on the
  experiments' command line ``--config.recipe.attention_op.v.format=nvfp4``. An operand in
  ``"bf16"`` keeps the rounding and block it takes when switched to ``"nvfp4"``.

  Each ``Operand`` (``fp4jax.quant``) is ``format`` ``"nvfp4"`` or ``"bf16"`` (the plain input), its
  ``rounding`` and, for q, k and v, its ``scale_rule``; the blocks are fixed per operand (as below)
  and one term each: a quantized operand with another ``block``, ``terms=2``, or a ``scale_rule``
  other than ``"max"`` on P, dO or dS is a ``ValueError``.

  Attributes:
    q: q in ``S = Q·Kᵀ`` and ``dK = dSᵀ·Q``: 1×16 blocks along D; the same packed Q(q) serves
      forward and backward (see ``reuse``). Default: NVFP4, nearest. ``scale_rule`` may be Four over
      Six (``"4over6_mse"`` or ``"4over6_mae"``, nearest rounding): each block takes the E4M3 scale
      that maps its amax to 6 or to 4, whichever decodes with the smaller squared (absolute) error;
      the kernels' path gives the same bits (``fp4jax.kernels.nvfp4_quantize``).
    k: k in ``S = Q·Kᵀ`` and ``dQ = dS·K``, as ``q`` (after ``k_smooth``). Default: NVFP4, nearest.
    v: v in ``O = P·V`` and ``dP = dO·Vᵀ``: one Q(v), 1×16 blocks along D, used forward and
      backward; ``scale_rule`` as ``q``'s. Default: bf16 (nearest when switched to NVFP4). V in
      NVFP4 with P and dO in bf16 is Q/K/V quantized once and reused, the products through P and dO
      in the input dtype.
    p: P in ``O = P·V`` and ``dV = Pᵀ·dO``: one Q(P), 1×16 blocks along the keys with the fixed
      global scale of ``amax = 1`` (``P <= 1``). Then δ uses ``O = P·V`` with the unquantized P (a
      second P·V in the forward), so that ``rowsum(dS) = 0`` as for the exact gradient. Default:
      bf16 (nearest when switched to NVFP4).
    do: dO in ``dP = dO·Vᵀ``, ``dV = Pᵀ·dO`` and δ: one Q(dO), 1×16 blocks along D. Default: bf16
      (stochastic when switched to NVFP4).
    ds: dS in ``dQ = dS·K`` and ``dK = dSᵀ·Q``: 16×16 blocks, one float32 scale per ``ds_tile``.
      Default: NVFP4, stochastic.
    reuse: tensor reuse (the method): the backward recomputes S and forms dQ = dS·K and dK = dSᵀ·Q
      from the forward's packed Q(q), Q(k), so it differentiates the function the forward computed.
      False is the ablation without it (drop-in quantization-aware training, which Attn-QAT found
      unstable): the backward uses the unquantized q and k, kept as residuals, so its recomputed P
      is the softmax of the unquantized scores, not the forward's.
    ds_tile: ``(rows, cols)`` of the dS tiles that each get their own second-level scale; powers of
      two >= 16 (the flash kernels' blocks hold whole tiles, so a finer tile is also a smaller
      kernel block). dS keeps ``scale_rule="max"``: Four over Six takes nearest rounding only, and dS
      is rounded stochastically.
    k_smooth: K smoothing (SageAttention): per batch and key/value head, subtract k's mean over the
      keys, ``k̄ = mean_s k[b, s, h, :]`` (float32, then k's dtype), before Q(k): ``S = Q(q)·Q(k −
      k̄)ᵀ``. Exact under the softmax: ``q·(k − k̄)ᵀ`` differs from ``q·kᵀ`` by ``q·k̄``, one constant
      per query row, with or without the causal mask, so only the quantization error changes
      (keys share a large per-channel mean that otherwise sets the blocks' scales). The backward's
      recomputed scores use the same smoothed packed Q(k − k̄) (without ``reuse``, the unquantized
      ``k − k̄``). The gradient is ``dK = deq(Q(dS))ᵀ·deq(Q(q))`` as without smoothing: k̄ is held
      constant (``stop_gradient``). Its exact term, ``−mean_s dK``, is zero, since each row of the
      exact dS sums to zero; with a quantized dS the rows' sums are rounding noise, which this
      drops. Under the causal mask k̄ includes later keys, which reach an earlier query's scores
      through the rounding of Q(k − k̄) only (as they already do through the global scale's amax),
      never through a gradient. Default: False.
    hadamard: rotate q and k along D by the orthonormal Sylvester Hadamard matrix ``H_D``
      (``H_D·H_Dᵀ = I``; D a power of two) before they are smoothed and quantized, where q or k is
      quantized: ``(q·H_D)·(k·H_D)ᵀ = q·kᵀ``, so the function is unchanged (up to the rounding of the
      rotated operands to their dtype) while a few channels of large magnitude, which set their
      blocks' scales, are spread over all D (FlashAttention-3's incoherent processing). An XLA
      product before the op; its gradient rotates dQ and dK back (``·H_Dᵀ``). Default: False.
  """

  q: Operand = Operand()
  k: Operand = Operand()
  v: Operand = Operand(format="bf16")
  p: Operand = Operand(format="bf16")
  do: Operand = Operand(format="bf16", rounding="stochastic")
  ds: Operand = Operand(rounding="stochastic", block=(nvfp4.BLOCK, nvfp4.BLOCK))
  reuse: bool = True
  ds_tile: tuple[int, int] = (64, 64)
  k_smooth: bool = False
  hadamard: bool = False

  def __post_init__(self):
    for name in OPERANDS:
      op = getattr(self, name)
      if not isinstance(op, Operand):
        raise ValueError(f"AttentionConfig.{name} must be an fp4jax.quant.Operand, got {op!r}; e.g. "
                         f"Operand(format='nvfp4') or Operand(format='bf16')")
      if not op.quantized:
        continue
      block = _BLOCKS[name]
      if op.block != block:
        raise ValueError(f"AttentionConfig.{name}.block must be {block} (the blocks the attention "
                         f"products take), got {op.block}")
      if op.terms != 1:
        raise ValueError(f"AttentionConfig.{name}.terms must be 1 (attention quantizes each operand as "
                         f"one NVFP4 term), got {op.terms}")
      if op.scale_rule != "max" and name not in _SCALE_RULE_OPERANDS:
        raise ValueError(f"AttentionConfig.{name}.scale_rule must be 'max' (its quantizer runs inside the "
                         f"attention kernels and scales each block by its amax; q, k and v take Four "
                         f"over Six), got {op.scale_rule!r}")
    for flag in ("reuse", "k_smooth", "hadamard"):
      if not isinstance(getattr(self, flag), bool):
        raise ValueError(f"AttentionConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
    tile = _check_tile(self.ds_tile, "AttentionConfig.ds_tile")
    if any(n & (n - 1) for n in tile):  # the flash kernels' blocks are whole tiles
      raise ValueError(f"AttentionConfig.ds_tile must be powers of two >= 16, got {self.ds_tile!r}")
    object.__setattr__(self, "ds_tile", tile)

  @classmethod
  def nvfp4(cls, **overrides) -> AttentionConfig:
    """The method: q, k (nearest) and dS (stochastic) in NVFP4; V, P and dO in the input dtype."""
    return cls(**overrides)

  @classmethod
  def bf16(cls, **overrides) -> AttentionConfig:
    """Nothing quantized: ``nvfp4_attention`` is then ``jax.nn.dot_product_attention`` (to rounding)."""
    method = cls()
    plain = {name: dataclasses.replace(getattr(method, name), format="bf16") for name in OPERANDS}
    return cls(**{**plain, **overrides})

  def quantizes(self, operand: str) -> bool:
    """True if ``operand`` (one of ``OPERANDS``) is quantized to NVFP4."""
    return getattr(self, operand).quantized

  def stochastic(self, operand: str) -> bool:
    """True if ``operand`` is quantized with stochastic rounding."""
    return getattr(self, operand).stochastic

  @property
  def rotates(self) -> bool:
    """True if q and k are rotated (``hadamard``, with q or k quantized)."""
    return self.hadamard and (self.quantizes("q") or self.quantizes("k"))

  @property
  def needs_key(self) -> bool:
    """True if some quantized operand is stochastically rounded (then ``key`` is required)."""
    return any(self.stochastic(name) for name in OPERANDS)


def _check_tile(tile, what) -> tuple[int, int]:
  try:
    rows, cols = (int(t) for t in tile)
  except (TypeError, ValueError):
    raise ValueError(f"{what} must be (rows, cols), got {tile!r}") from None
  if rows <= 0 or cols <= 0 or rows % nvfp4.BLOCK or cols % nvfp4.BLOCK:
    raise ValueError(f"{what} must be positive multiples of 16, got {tile!r}")
  return rows, cols


# ----------------------------------------------------------------------------------------------
# Random bits and operand quantization (shared by the custom_vjp and the references)


def _keys(key, config: AttentionConfig | None = None) -> dict:
  """One key per random choice (None without ``key``); with ``config``, ``key`` must be given if it needs one."""
  if key is None:
    if config is not None and config.needs_key:
      raise ValueError(
          "nvfp4_attention: this AttentionConfig rounds an operand stochastically and needs `key` (a "
          "jax.random key); only a config without stochastic rounding accepts key=None")
    return dict.fromkeys(OPERANDS)
  return dict(zip(OPERANDS, jax.random.split(key, len(OPERANDS)), strict=True))


def _ds_bits(key, shape) -> jax.Array:
  """uint32 stochastic-rounding bits for a dS array ``[B, H, T, S]``.

  Element ``(b, h, row, col)`` takes the bits of ``fp4jax.kernels.attention.ds_rounding_bits``: a
  counter hash of (key, b, h, row, col) alone, so the flash kernels, which draw them tile by tile,
  and this reference round every element alike.
  """
  b, h, t, s = shape
  return attention_kernels.ds_rounding_bits(key, (b, h, t, s + -s % 4))[..., :s]


def _quantize(x, config, name, key, impl="xla", **kw) -> nvfp4.NVFP4Tensor:
  """``nvfp4.quantize`` of one operand; on the kernel paths the same bits from one Pallas quantizer
  call over the whole tensor (``fp4jax.kernels.nvfp4_quantize``)."""
  stochastic = config.stochastic(name)
  op = getattr(config, name)
  kw.update(rounding=op.rounding, key=key if stochastic else None, scale_rule=op.scale_rule)
  if impl in ("pallas", "pallas_interpret"):
    return nvfp4_quantize.quantize(x, interpret=impl == "pallas_interpret", **kw)
  return nvfp4.quantize(x, **kw)


def _operand(x, config, name, keys, impl="xla"):
  """``x`` quantized (1×16 along the last axis, D) when ``config`` says so, else ``x`` itself."""
  if not config.quantizes(name):
    return x
  return _quantize(x, config, name, keys[name], impl, block=getattr(config, name).block, axis=-1)


def smoothed_k(k, config):
  """``k − k̄`` in k's dtype with ``k̄`` k's float32 mean over the keys per (batch, head), held constant
  (``AttentionConfig.k_smooth``); ``k`` itself without smoothing.

  A bfloat16 ``k − k̄`` is rounded by ``numerics.bf16_rn``: under ``jax.jit`` on the GPU, XLA folds the
  cast to bfloat16 and the quantizer's cast back to float32, and would quantize the unrounded
  difference (another amax, so other scales) where the kernels and the CPU quantize the rounded one.
  """
  if not config.k_smooth:
    return k
  k32 = k.astype(_F32)
  d = k32 - lax.stop_gradient(jnp.mean(k32, axis=1, keepdims=True))
  return (numerics.bf16_rn(d) if k.dtype == jnp.bfloat16 else d).astype(k.dtype)


def _sylvester(d: int) -> jax.Array:
  """The Sylvester Hadamard matrix of order ``d`` (a power of two) with entries ±1, float32:
  ``[[H', H'], [H', −H']]`` from ``[[1]]``; symmetric, ``H·Hᵀ = d·I``."""
  if d < 1 or d & (d - 1):
    raise ValueError(f"a Hadamard matrix of order {d}: the order must be a power of two")
  h = jnp.ones((1, 1), _F32)
  while h.shape[0] < d:
    h = jnp.block([[h, h], [h, -h]])
  return h


def _rotate(x32, d: int) -> jax.Array:
  """``x32·H_D`` in float32, ``H_D = _sylvester(d)/√d`` (orthonormal, symmetric): the ±1 products
  summed (exact where the partial sums fit float32's mantissa, as for bfloat16 inputs of similar
  magnitudes, so in any order), then one multiplication by ``1/√d``."""
  return _dot("...d,de->...e", x32, _sylvester(d)) * _F32(d ** -0.5)


def rotated(x, config):
  """``x·H_D`` along the last axis in x's dtype (``AttentionConfig.hadamard``, where q or k is
  quantized: ``config.rotates``); ``x`` itself otherwise. The product is float32 (``_rotate``); a
  bfloat16 result is rounded by ``numerics.bf16_rn`` (see ``smoothed_k``)."""
  if not config.rotates:
    return x
  r = _rotate(x.astype(_F32), x.shape[-1])
  return (numerics.bf16_rn(r) if x.dtype == jnp.bfloat16 else r).astype(x.dtype)


def quantized_inputs(q, k, config):
  """``(q, k)`` as the op quantizes them: rotated (``rotated``) and k smoothed (``smoothed_k``) as
  ``config`` says; attention with ``hadamard`` and ``k_smooth`` off on these is the op's."""
  return rotated(q, config), smoothed_k(rotated(k, config), config)


def _decoded(x, dtype):
  """An operand as the product sees it: ``deq(Q(x))`` in ``dtype``, or the plain input."""
  return x.dequantize(dtype) if isinstance(x, nvfp4.NVFP4Tensor) else x.astype(dtype)


def _pad_to(x, multiples):
  """Zero-pads the last ``len(multiples)`` axes of ``x`` up to multiples of ``multiples``."""
  pad = [(0, 0)] * (x.ndim - len(multiples))
  pad += [(0, -n % m) for n, m in zip(x.shape[x.ndim - len(multiples):], multiples, strict=True)]
  return jnp.pad(x, pad)


def _crop(x, shape):
  return x[tuple(slice(0, n) for n in shape)]


def _probs_operand(p, config, keys, dtype):
  """P as the operand of ``P·V`` and ``Pᵀ·dO``: cast to ``dtype``, or ``deq(Q(P))`` with 1×16 blocks
  along the keys (zero-padded to a multiple of 16) and the global scale of ``amax = 1``. P is
  ``[B, Hk, G, T, S]``; stochastic rounding takes element (b, h, row, col)'s bits from ``_ds_bits``
  (``h = kv_head · G + g``), as the flash kernels draw them tile by tile."""
  if not config.quantizes("p"):
    return p.astype(dtype)
  padded = _pad_to(p, (nvfp4.BLOCK,))
  # One extra row holding a 1 sets the tensor's amax to 1 (P <= 1) and changes no block of P.
  one = jnp.zeros((*padded.shape[:-2], 1, padded.shape[-1]), padded.dtype).at[..., 0].set(1.0)
  bits = None
  if config.stochastic("p"):
    b, hk, g, t, s = padded.shape
    bits = _ds_bits(keys["p"], (b, hk * g, t, s)).reshape(padded.shape)
    bits = jnp.concatenate([bits, jnp.zeros(one.shape, jnp.uint32)], axis=-2)
  qp = nvfp4.quantize(jnp.concatenate([padded, one], axis=-2), block=(1, nvfp4.BLOCK), axis=-1,
                      rounding=config.p.rounding, bits=bits)
  return _crop(qp.dequantize(dtype), p.shape)


def _fake_quant_ds(ds, *, scope: str = "tile", ds_tile=(64, 64), rounding: str = "stochastic",
                   bits=None) -> jax.Array:
  """``deq(Q(dS))`` in float32 for dS ``[..., T, S]``: 16×16 blocks with the second-level scale of ``scope``.

  Two-level NVFP4 quantization (``nvfp4.quantize(·, block=(16, 16))``, Transformer Engine's order)
  of each part of dS that ``scope`` names, as a tensor of its own::

    "tile"    each ds_tile of each [T, S] matrix: amax_tile, S_enc = 2688 / amax_tile (the method;
              a flash backward holds the tile, so its amax costs nothing)
    "matrix"  each [T, S] matrix (one (batch, head)): the exact two-level quantization per matrix
    "tensor"  the whole array: the exact two-level quantization with one global scale

  T and S are zero-padded to whole tiles (zeros change no amax and quantize to 0) and cropped back.

  Args:
    ds: float array ``[..., T, S]``.
    scope: ``"tile"``, ``"matrix"`` or ``"tensor"``.
    ds_tile: ``(rows, cols)``, multiples of 16, for ``scope="tile"``.
    rounding: ``"nearest"`` or ``"stochastic"``.
    bits: uint32 rounding bits shaped like ``ds`` (``_ds_bits``), for stochastic rounding.

  Returns:
    float32 array shaped like ``ds``.
  """
  if scope not in _SCALE_SCOPES:
    raise ValueError(f"_fake_quant_ds: scope must be one of {_SCALE_SCOPES}, got {scope!r}")
  if rounding not in nvfp4.ROUNDINGS:
    raise ValueError(f"_fake_quant_ds: rounding must be one of {nvfp4.ROUNDINGS}, got {rounding!r}")
  ds = jnp.asarray(ds, _F32)
  if ds.ndim < 2:
    raise ValueError(f"_fake_quant_ds: ds must be [..., T, S], got shape {ds.shape}")
  if (rounding == "stochastic") != (bits is not None):
    raise ValueError("_fake_quant_ds: give `bits` exactly when rounding='stochastic'")
  *lead, t, s = ds.shape
  blk = (nvfp4.BLOCK, nvfp4.BLOCK)
  if scope == "tile":
    rows, cols = _check_tile(ds_tile, "_fake_quant_ds: ds_tile")
  else:
    rows, cols = t + -t % nvfp4.BLOCK, s + -s % nvfp4.BLOCK
  x = _pad_to(ds, (rows, cols))
  b = None if bits is None else _pad_to(bits, (rows, cols))
  if scope == "tensor":
    return _crop(nvfp4.quantize(x, block=blk, rounding=rounding, bits=b).dequantize(_F32), ds.shape)

  def tiles(a):  # [..., nr*rows, nc*cols] -> [N, rows, cols]
    a = a.reshape(*lead, a.shape[-2] // rows, rows, a.shape[-1] // cols, cols)
    return jnp.swapaxes(a, -3, -2).reshape(-1, rows, cols)

  def fq(args):
    tile, tile_bits = args
    return nvfp4.quantize(tile, block=blk, rounding=rounding, bits=tile_bits).dequantize(_F32)

  # A loop over the tiles: vmap of the quantizer (per-tile division tables, batched lookups) takes
  # XLA's CPU compiler minutes, the loop's body a second.
  y = lax.map(fq, (tiles(x), None if b is None else tiles(b)))
  y = y.reshape(*lead, x.shape[-2] // rows, x.shape[-1] // cols, rows, cols)
  return _crop(jnp.swapaxes(y, -3, -2).reshape(x.shape), ds.shape)


# ----------------------------------------------------------------------------------------------
# The reference computation (materializes S, P, dS)


class _Residuals(NamedTuple):
  """What the backward keeps: packed NVFP4 operands (or the plain inputs where not quantized).

  Attributes:
    q, k: ``NVFP4Tensor`` (packed Q(q), Q(k)) or the inputs (not quantized, or ``reuse=False``).
    v: packed Q(v) or v.
    o: ``[B, T, H, D]`` the output ``P·V`` that δ uses (with the unquantized P when P is quantized).
    lse: ``[B, H, T]`` float32 log-sum-exp of the scores.
    key: the op's key (None without stochastic rounding).
  """

  q: Any
  k: Any
  v: Any
  o: jax.Array
  lse: jax.Array
  key: Any


def _dot(spec, a, b, precision=_HIGHEST):
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=_F32)


def _grouped(q_BxTxHxD, n_kv):
  b, t, h, d = q_BxTxHxD.shape
  return q_BxTxHxD.reshape(b, t, n_kv, h // n_kv, d)


def _scores(qd, kd, causal):
  """Masked scores ``[B, Hk, G, T, S]`` (f32, -inf where masked) of decoded q ``[B, T, Hk, G, D]``, k."""
  t, s, d = qd.shape[1], kd.shape[1], qd.shape[-1]
  scores = _dot("btkgd,bskd->bkgts", qd, kd) * _F32(1.0 / math.sqrt(d))
  if causal:
    visible = lax.broadcasted_iota(jnp.int32, (t, s), 1) <= lax.broadcasted_iota(jnp.int32, (t, s), 0)
    scores = jnp.where(visible[None, None, None], scores, -jnp.inf)
  return scores


def _probs(scores, lse):
  """``P = exp(S − L)``: the one formula of both the forward and the backward's recompute."""
  return jnp.exp(scores - lse[..., None])


def _forward(q, k, v, keys, causal, config):
  """The reference forward: ``(o, residuals without key, P)``; o and residual o in q's dtype."""
  dtype, n_kv = q.dtype, k.shape[2]
  k = smoothed_k(k, config)
  qt, kt, vt = (_operand(x, config, name, keys) for x, name in ((q, "q"), (k, "k"), (v, "v")))
  qd, kd, vd = _grouped(_decoded(qt, dtype), n_kv), _decoded(kt, dtype), _decoded(vt, dtype)
  scores = _scores(qd, kd, causal)
  m = jnp.max(scores, axis=-1)
  lse = m + jnp.log(jnp.sum(jnp.exp(scores - m[..., None]), axis=-1))
  p = _probs(scores, lse)
  o = _dot("bkgts,bskd->btkgd", _probs_operand(p, config, keys, dtype), vd).reshape(q.shape)
  o_delta = o
  if config.quantizes("p"):
    o_delta = _dot("bkgts,bskd->btkgd", p.astype(dtype), vd).reshape(q.shape)
  lse = lse.reshape(q.shape[0], q.shape[2], q.shape[1])
  if not config.reuse:
    qt, kt = q, k
  return o.astype(dtype), _Residuals(qt, kt, vt, o_delta.astype(dtype), lse, None), p


def _bwd_operands(res: _Residuals):
  """The decoded q, k, v of the backward: the forward's packed tensors (the unquantized q and k
  without reuse)."""
  dtype = res.o.dtype
  return _decoded(res.q, dtype), _decoded(res.k, dtype), _decoded(res.v, dtype)


def _backward(res: _Residuals, do, keys, causal, config):
  """The reference backward: ``(dq, dk, dv)`` in f32 and the intermediates ``{"p", "ds"}``."""
  qd, kd, vd = _bwd_operands(res)
  b, t, h, d = qd.shape
  n_kv = kd.shape[2]
  qd = _grouped(qd, n_kv)
  scores = _scores(qd, kd, causal)
  p = _probs(scores, res.lse.reshape(b, n_kv, h // n_kv, t))
  dod = _grouped(_decoded(_operand(do.astype(qd.dtype), config, "do", keys), qd.dtype), n_kv)
  o = _grouped(res.o, n_kv)
  delta = jnp.einsum("btkgd,btkgd->bkgt", dod.astype(_F32), o.astype(_F32), precision=_HIGHEST)
  dp = _dot("btkgd,bskd->bkgts", dod, vd)
  ds = (p * (dp - delta[..., None])) * _F32(1.0 / math.sqrt(d))
  dv = _dot("bkgts,btkgd->bskd", _probs_operand(p, config, keys, qd.dtype), dod)
  if config.quantizes("ds"):
    bits = None
    if config.stochastic("ds"):
      bits = _ds_bits(keys["ds"], (b, h, t, kd.shape[1])).reshape(ds.shape)
    ds_op = _fake_quant_ds(ds, ds_tile=config.ds_tile, rounding=config.ds.rounding, bits=bits)
  else:
    ds_op = ds
  ds_op = ds_op.astype(qd.dtype)
  dq = _dot("bkgts,bskd->btkgd", ds_op, kd).reshape(b, t, h, d)
  dk = _dot("bkgts,btkgd->bskd", ds_op, qd)
  return (dq, dk, dv), {"p": p.reshape(b, h, t, -1), "ds": ds.reshape(b, h, t, -1)}


# ----------------------------------------------------------------------------------------------
# The custom_vjp


def _attention_fwd(q, k, v, key, causal, config, impl):
  keys = _keys(key, config)
  if impl == "xla":
    o, res, _ = _forward(q, k, v, keys, causal, config)
    return o, res._replace(key=key)
  dtype = q.dtype
  k = smoothed_k(k, config)
  qt, kt, vt = (_operand(x, config, name, keys, impl=impl) for x, name in ((q, "q"), (k, "k"), (v, "v")))
  qd, kd, vd = _decoded(qt, dtype), _decoded(kt, dtype), _decoded(vt, dtype)
  sm_scale, interpret = 1.0 / math.sqrt(q.shape[-1]), impl == "pallas_interpret"
  o, lse = attention_kernels.attention_fwd(qd, kd, vd, causal=causal, sm_scale=sm_scale,
                                           interpret=interpret)
  o_delta = o  # δ takes the output with the unquantized P
  if config.quantizes("p"):
    o = attention_kernels.attention_pv(qd, kd, vd, lse, causal=causal, sm_scale=sm_scale,
                                       p_rounding=config.p.rounding, key=keys["p"],
                                       interpret=interpret)
  if not config.reuse:
    qt, kt = q, k
  return o, _Residuals(qt, kt, vt, o_delta, lse, key)


def _attention_bwd(causal, config, impl, res: _Residuals, do):
  keys = _keys(res.key, config)
  dtypes = tuple(x.dtype for x in (res.q, res.k, res.v))
  if impl == "xla":
    (dq, dk, dv), _ = _backward(res, do, keys, causal, config)
  else:
    qd, kd, vd = _bwd_operands(res)
    dod = _decoded(_operand(do.astype(qd.dtype), config, "do", keys, impl=impl), qd.dtype)
    dq, dk, dv = attention_kernels.attention_bwd(
        qd, kd, vd, res.o, res.lse, dod, causal=causal, sm_scale=1.0 / math.sqrt(qd.shape[-1]),
        ds_rounding=config.ds.rounding if config.quantizes("ds") else None, key=keys["ds"],
        ds_tile=config.ds_tile, p_rounding=config.p.rounding if config.quantizes("p") else None,
        p_key=keys["p"], interpret=impl == "pallas_interpret")
  return (*(g.astype(dt) for g, dt in zip((dq, dk, dv), dtypes, strict=True)), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, key, causal, config, impl):
  return _attention_fwd(q, k, v, key, causal, config, impl)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------------
# Public API


def _check(q, k, v, key, causal, config) -> None:
  if not isinstance(config, AttentionConfig):
    raise ValueError(f"nvfp4_attention: config must be an AttentionConfig, got {type(config).__name__}")
  if not isinstance(causal, bool):
    raise ValueError(f"nvfp4_attention: causal must be a bool, got {causal!r}")
  shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
  if not (q.ndim == k.ndim == v.ndim == 4):
    raise ValueError(f"nvfp4_attention: q, k, v must be 4-D, q [B, T, H, D] and k, v [B, S, Hk, D]; "
                     f"got {shapes}")
  if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"nvfp4_attention: q, k, v must share one floating-point dtype, got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  (b, t, h, d), (bk, s, hk, dk) = q.shape, k.shape
  if k.shape != v.shape:
    raise ValueError(f"nvfp4_attention: k and v must have the same shape; got {shapes}")
  if b != bk:
    raise ValueError(f"nvfp4_attention: q and k have different batch sizes; got {shapes}")
  if d != dk:
    raise ValueError(f"nvfp4_attention: q and k have different head dims; got {shapes}")
  if d == 0 or d % nvfp4.BLOCK:
    raise ValueError(f"nvfp4_attention: head dim D = {d} is not a positive multiple of {nvfp4.BLOCK} "
                     f"(the NVFP4 blocks run along D); got {shapes}")
  if hk == 0 or h % hk:
    raise ValueError(f"nvfp4_attention: the {h} query heads are not a multiple of the {hk} key/value "
                     f"heads; got {shapes}")
  if t == 0 or s == 0:
    raise ValueError(f"nvfp4_attention: empty sequence; got {shapes}")
  if causal and t != s:
    raise ValueError(f"nvfp4_attention: causal attention needs as many keys as queries (T == S); got "
                     f"{shapes}")
  if config.rotates and d & (d - 1):
    raise ValueError(f"nvfp4_attention: AttentionConfig.hadamard rotates q and k along D by a Hadamard "
                     f"matrix, whose order is a power of two; D = {d} is not (set hadamard=False); got "
                     f"{shapes}")
  if config.needs_key and key is None:
    _keys(None, config)  # raises the key error


def nvfp4_attention(q, k, v, *, causal: bool = True, key=None,
                    config: AttentionConfig = AttentionConfig(), implementation: str = "auto"
                    ) -> jax.Array:
  """Scaled dot-product attention with NVFP4 operands where ``config`` says so (differentiable).

  With ``deq(Q(·))`` the quantize-dequantize of the operands that ``config`` quantizes (the identity
  for the others), per batch and query head::

    S = deq(Q(q))·deq(Q(k))ᵀ / √D,   P = softmax(S) (causal mask: key j visible to query i iff j <= i),
    O = deq(Q(P))·deq(Q(v))

  The backward recomputes P from the same packed Q(q), Q(k) and the saved log-sum-exp, and forms
  ``dQ = deq(Q(dS))·deq(Q(k))`` and ``dK = deq(Q(dS))ᵀ·deq(Q(q))`` with dS quantized per
  ``config.ds_tile`` (see the module docstring); q, k, v get those gradients
  straight through their quantizers. With ``config.k_smooth``, k is ``k − mean_s(k)`` (per batch and
  head) wherever it appears above, and with ``config.hadamard`` q and k are ``q·H_D`` and ``k·H_D``
  (``rotated``): the same function, other quantization errors.

  Args:
    q: ``[B, T, H, D]`` queries (bf16 in a model; any float dtype shared with k and v).
    k: ``[B, S, Hk, D]`` keys, ``H % Hk == 0`` (grouped-query attention).
    v: ``[B, S, Hk, D]`` values.
    causal: causal mask (needs ``T == S``); False attends to every key.
    key: a ``jax.random`` key for stochastic rounding (the default config rounds dS stochastically);
      None only when ``config.needs_key`` is False. Same key, same bits; use a fresh key per step.
    config: an ``AttentionConfig``: ``.nvfp4()`` (the default) or ``.bf16()``.
    implementation: which code computes it (``fp4jax.execution``): ``"xla"`` (the jnp reference,
      ``nvfp4_attention_reference``), ``"pallas"`` (the
      flash kernels of ``fp4jax.kernels.attention``, CUDA), ``"pallas_interpret"`` (the kernels in
      interpret mode, for tests) or ``"auto"``: ``"pallas"`` when computations go to a CUDA GPU, the
      mesh in context has one device and D is in {64, 128}, else ``"xla"``. With a quantized P the
      kernels add a second pass over the keys for ``deq(Q(P))·V`` (``attention_pv``).

  Returns:
    ``[B, T, H, D]`` in q's dtype; gradients in the dtypes of q, k and v.

  Raises:
    ValueError: inputs that are not 4-D or disagree (batch, head dim, k vs v), D not a multiple of
      16 (or, for the kernels, not in {64, 128}),
      H not a multiple of Hk, causal with T != S, a missing key, or an unknown implementation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp4jax.ops.attention import AttentionConfig, nvfp4_attention
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, 32, 4, 64), jnp.bfloat16) for i in range(3))
    >>> nvfp4_attention(q, k, v, key=jax.random.key(0), config=AttentionConfig.nvfp4()).shape
    (1, 32, 4, 64)

  References:
    Zhang et al., *Attn-QAT: 4-bit attention with quantization-aware training*, arXiv:2603.00040
      (recomputed scores from the same quantized Q, K; δ from the unquantized P).
    Zhang et al., *SageBwd: trainable low-bit attention*, arXiv:2603.02170 (dS as the main error
      source of a low-bit backward).
    Dao, *FlashAttention-2: faster attention with better parallelism and work partitioning*, 2023
      (the backward's δ = rowsum(dO∘O) and the recompute from the log-sum-exp).
    NVIDIA, *Pretraining large language models with NVFP4*, arXiv:2509.25149 (the format, 16×16
      blocks, stochastic rounding of gradients).
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  _check(q, k, v, key, causal, config)
  impl = execution.check("nvfp4_attention", implementation)
  head_dim = q.shape[-1]
  if impl == "auto":
    impl = (_platform.resolve(impl, "pallas", "xla", whole_arrays=True) if head_dim in _HEAD_DIMS
            else "xla")
  elif impl != "xla" and head_dim not in _HEAD_DIMS:
    raise ValueError(f"nvfp4_attention: implementation={impl!r} takes head dims {_HEAD_DIMS}, got "
                     f"D = {head_dim}; use implementation='xla'")
  return _attention(rotated(q, config), rotated(k, config), v, key, causal, config, impl)


def nvfp4_attention_reference(q, k, v, *, causal: bool = True, key=None,
                              config: AttentionConfig = AttentionConfig(), return_stats: bool = False):
  """The forward of ``nvfp4_attention`` in plain jnp, with the ``[T, S]`` matrices materialized.

  Args:
    q, k, v, causal, key, config: as ``nvfp4_attention`` (same key, same quantized operands).
    return_stats: also return ``P`` (``[B, H, T, S]`` float32) and the log-sum-exp ``[B, H, T]``.

  Returns:
    ``o`` (``[B, T, H, D]``, q's dtype), or ``(o, p, lse)`` with ``return_stats``. No custom gradient:
    see ``nvfp4_attention_vjp_reference``.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  _check(q, k, v, key, causal, config)
  o, res, p = _forward(rotated(q, config), rotated(k, config), v, _keys(key, config), causal, config)
  if not return_stats:
    return o
  b, t, h, _ = q.shape
  return o, p.reshape(b, h, t, -1), res.lse


def nvfp4_attention_vjp_reference(q, k, v, do, *, causal: bool = True, key=None,
                                  config: AttentionConfig = AttentionConfig(),
                                  return_intermediates: bool = False):
  """The backward of ``nvfp4_attention`` for cotangent ``do``, in plain jnp (S, P, dS materialized).

  Runs the reference forward for its residuals (the packed operands and the log-sum-exp), then the
  backward from them alone, as the op does.

  Args:
    q, k, v, causal, key, config: as ``nvfp4_attention``.
    do: ``[B, T, H, D]`` the cotangent of the output.
    return_intermediates: also return ``{"p": P, "ds": dS}``, both ``[B, H, T, S]`` float32: the
      backward's recomputed P and the unquantized dS (``1/√D`` folded in) before its quantization.

  Returns:
    ``(dq, dk, dv)`` in the dtypes of q, k, v (with ``config.hadamard``, dQ and dK rotated back:
    ``·H_Dᵀ``, the rotation's own gradient); with ``return_intermediates``, ``((dq, dk, dv), dict)``.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  _check(q, k, v, key, causal, config)
  keys = _keys(key, config)
  _, res, _ = _forward(rotated(q, config), rotated(k, config), v, keys, causal, config)
  grads, intermediates = _backward(res, jnp.asarray(do), keys, causal, config)
  if config.rotates:  # as the op's autodiff: dQ, dK in q's dtype, rotated back in float32 (H symmetric)
    d = q.shape[-1]
    grads = (*(_dot("...d,de->...e", g.astype(x.dtype).astype(_F32) * _F32(d ** -0.5), _sylvester(d))
               for g, x in ((grads[0], q), (grads[1], k))), grads[2])
  grads = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
  return (grads, intermediates) if return_intermediates else grads
