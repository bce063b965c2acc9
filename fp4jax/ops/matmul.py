"""NVFP4 matmul ``x @ w`` with a ``custom_vjp``: NVIDIA's recipe for the three GEMMs of a linear layer.

With ``x: [..., K]`` flattened to ``x_MxK`` (M = tokens) and ``w_KxN``:

  forward  y_MxN  = Q(x; 1×16 along K) · Q(w; 16×16 tiles)
  dgrad    dx_MxK = Q(dy; 1×16 along N, stochastic) · Q(w)ᵀ        (the *same* packed Q(w) as the forward)
  wgrad    dw_KxN = Q(H·x; 1×16 along M)ᵀ · Q(H·dy; 1×16 along M, stochastic)

H is a 16-point random Hadamard transform on the token axis (it cancels in the product). With
``MatmulConfig.w.block=(1, 16)`` the weight is quantized in 1×16 blocks along K for the forward, and
the dgrad's operand is that forward weight dequantized and quantized again along N, its contraction:

  forward  y_MxN  = Q(x; 1×16 along K) · Q_K(w)                   Q_K: 1×16 blocks along K
  dgrad    dx_MxK = Q(dy; 1×16 along N, stochastic) · Q_N(deq(Q_K(w)))ᵀ

(``dgrad_weight``). The backward is then the straight-through estimate through two quantizers: dx
is the gradient of ``x·W̃`` with ``W̃ = deq(Q_N(deq(Q_K(w))))``, which differs from the forward's
weight ``deq(Q_K(w))`` by one re-quantization of already-quantized values (not by a second,
independent quantization of ``w``), and dw, as in the recipe, treats ``Q_K`` as the identity. Every GEMM
is ``fp4jax.nvfp4.gemm``: the packed operands decoded to bf16 (``e2m1 × e4m3`` is exact there), a
float32-accumulated dot, then both float32 global scales one at a time: an NVFP4 tensor-core GEMM
up to summation order. ``MatmulConfig`` says what is computed: which GEMMs are quantized and, for
each of the five operands, one ``fp4jax.quant.Operand`` (format, rounding, block, terms, scale_rule).

Which code computes it is a ``fp4jax.execution.MatmulExecution`` (``nvfp4_matmul``'s
``execution``), with the same bits: implementation ``"xla"`` quantizes with ``nvfp4.quantize`` and
decodes inside ``nvfp4.gemm``; ``"pallas"`` quantizes each operand once with the kernels of
``fp4jax.kernels.nvfp4_quantize`` (one custom call each, the Hadamard transform and the random bits
fused), which also write the decoded bf16 operand a GEMM reads at once, so the step's program stays
small and XLA compiles it quickly. Its ``gemm`` chooses how the GEMMs multiply: decoded bf16
operands on bf16 tensor cores (Hopper: exact emulation), or the packed operands through
``jax.nn.scaled_matmul`` (``nvfp4.scaled_matmul_gemm``) on GPUs with FP4 tensor cores (compute
capability 10.0 and up), picked by default from the device.

Residuals: the backward keeps the packed ``Q(w)`` and ``Q(H·x)`` (4.5 bits per element) in both
implementations and decodes them to bf16 in the backward (one elementwise pass), where a bf16
matmul keeps bf16 ``x`` and ``w``: the NVFP4 layer's saved activations are 0.28× the bf16 layer's.
Saving the decoded bf16 instead would save that pass but cost the bf16 layer's memory; the only
extra traffic of the packed choice is re-reading the packed bytes.

Three research variants, each a field of ``MatmulConfig`` that measures or removes one part of the
error:

- **BF16 operands** (``Operand(format="bf16")``, e.g. ``MatmulConfig.nvfp4(x=Operand(format="bf16"))``):
  the operand enters its GEMM unquantized in the compute dtype, so the GEMM is NVFP4 × BF16 (the
  NVFP4 operand decoded exactly to bf16, a float32-accumulated dot, its global scale). Switching
  operands one at a time attributes the recipe's error to each.
- **Two terms** (``Operand(terms=2)``): the operand is ``Q1 + Q2`` with ``Q1 = Q(a)`` and
  ``Q2 = Q(a − Q1)`` (``fp4jax.quant.quantize_terms``: each term its own scales, the residual from
  the materialized ``Q1`` so every backend gives the same bits), and its GEMM is the sum of every
  pair of terms' NVFP4 GEMMs (``fp4jax.quant.gemm_terms``: two, or four where both operands have
  two terms), with about 1/8 of one term's error at twice the GEMM cost. A two-term ``w`` stays two GEMMs:
  one GEMM on the pre-summed decoded terms is exact in neither precision (each decoded term
  ``e2m1 × e4m3 × global scale`` needs up to 30 significant bits; docs/DESIGN.md, "A two-term W is
  two GEMMs").
- **Split** (``MatmulConfig.split``, a ``Split``): ``x`` and/or ``dy`` become ``a = U·P + R``
  before their quantized GEMMs; only the residual ``R`` is quantized, and the low-rank part is
  multiplied in float32 (skinny GEMMs of rank r, the weight unquantized), so each GEMM stays exact
  up to the residual's quantization: ``x·w = Q(R_x)·Q(w) + U_x·(P_x·w)``,
  ``dy·wᵀ = Q(R_dy)·Q(w)ᵀ + U_dy·(P_dy·wᵀ)``,
  ``xᵀ·dy = Q(H·R_x)ᵀ·Q(H·R_dy) + P_xᵀ·(U_xᵀ·dy) + (R_xᵀ·U_dy)·P_dy``. ``"mean"`` takes out the
  mean over the tokens (rank 1: a channel offset); ``"subspace"`` the top-r token subspace, found
  each call by ``fp4jax.quant.range_finder`` from the call's key.

``nvfp4_matmul_reference`` / ``nvfp4_matmul_vjp_reference`` compute the same products from the same
quantized values in plain float32 (dequantize, then a HIGHEST-precision dot), so tests can separate
GEMM error from quantization error.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _platform, numerics, nvfp4
from fp4jax.execution import MatmulExecution
from fp4jax.kernels import nvfp4_quantize
from fp4jax.quant import Operand, gemm_terms, quantize_terms, range_finder

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST
_KERNEL_MAX_ELEMENTS = 2**31 - 1  # the quantizer kernels' 32-bit addressing
_XLA = MatmulExecution("xla", "decoded")  # the references' execution


OPERANDS = ("x", "w", "dy_dgrad", "x_wgrad", "dy_wgrad")  # the five quantized operands
_SPLIT_TENSORS = ("x", "dy")
_SPLIT_METHODS = ("mean", "subspace")
# The axis of each operand's 1×16 blocks (its contraction axis); w's 1×16 blocks run along K in the
# forward and, re-quantized (``dgrad_weight``: the pseudo-operand "w_dgrad"), along N in the dgrad.
_AXIS = {"x": -1, "w": 0, "w_dgrad": -1, "dy_dgrad": -1, "x_wgrad": 0, "dy_wgrad": 0}
_BLOCK_USE = {"x": "1×16 along K", "dy_dgrad": "1×16 along N", "x_wgrad": "1×16 along the tokens",
              "dy_wgrad": "1×16 along the tokens"}


def _int_at_least(where: str, value, low: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{where} must be an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Split:
  """A low-rank split ``a = U·P + R`` of ``x`` and/or ``dy`` before their quantized GEMMs (module
  docstring, "Split"): the residual ``R`` is quantized in every quantized GEMM that reads the
  tensor, the low-rank part ``U·P`` multiplied in float32.

  Attributes:
    tensors: the tensors split, distinct names of ``"x"`` and ``"dy"``; ``()``
      (the default): no split.
    method: ``"mean"`` (``U = 1``, ``P = μᵀ``: the mean over the tokens, a rank-1 split) or
      ``"subspace"`` (``U`` orthonormal M×r, ``P = Uᵀ·a``: the top-``rank`` subspace of the tokens,
      found afresh each call by a randomized range finder with ``power_iters`` power iterations,
      from the call's key).
    rank: r of ``"subspace"`` (at least 1; at most ``min(M, C)`` is used).
    power_iters: power iterations of ``"subspace"``.
  """

  tensors: tuple[str, ...] = ()
  method: str = "mean"
  rank: int = 16
  power_iters: int = 1

  def __post_init__(self):
    tensors = tuple(self.tensors) if isinstance(self.tensors, tuple | list) else None
    if (tensors is None or not all(t in _SPLIT_TENSORS for t in tensors)
        or len(set(tensors)) != len(tensors)):
      raise ValueError(f"MatmulConfig.split.tensors={self.tensors!r}: expected a tuple of distinct names "
                       f"of {_SPLIT_TENSORS}, or () for no split")
    object.__setattr__(self, "tensors", tensors)
    if self.method not in _SPLIT_METHODS:
      raise ValueError(f"MatmulConfig.split.method must be one of {_SPLIT_METHODS}, got {self.method!r}")
    _int_at_least("MatmulConfig.split.rank", self.rank, 1)
    _int_at_least("MatmulConfig.split.power_iters", self.power_iters, 0)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  """What ``nvfp4_matmul`` computes: which GEMMs run in NVFP4 and how each operand is quantized
  (hashable, static). Which code computes it is ``nvfp4_matmul``'s ``execution``, not a field.

  The defaults are NVIDIA's recipe (``MatmulConfig.nvfp4()``); ``MatmulConfig.bf16()`` turns every
  GEMM and the Hadamard transform off. Any field can be switched alone, e.g.
  ``MatmulConfig.nvfp4(hadamard=False, dy_dgrad=Operand())`` (the dgrad's ``dy`` rounded to
  nearest); on the command line ``--config.recipe.matmul.x.terms=2``.

  The five operands of the quantized GEMMs are named ``OPERANDS``: ``x`` and ``w`` (forward),
  ``dy_dgrad`` (and ``w``, the same ``Q(w)``: dgrad), ``x_wgrad`` and ``dy_wgrad`` (wgrad). Each is
  a ``fp4jax.quant.Operand`` whose block runs along the operand's contraction axis (1×16), except
  ``w``'s 16×16 tiles, the one layout that serves both of its GEMMs (``w`` also takes 1×16 blocks:
  along K, re-quantized along N for the dgrad).

  Attributes:
    fwd: quantize the forward GEMM ``x · w``.
    dgrad: quantize the dgrad GEMM ``dy · wᵀ``.
    wgrad: quantize the wgrad GEMM ``xᵀ · dy``.
    x: ``x`` in the forward (1×16 along K).
    w: ``w``: ``block=(16, 16)`` (the recipe): one quantized ``w`` serves forward and dgrad;
      ``block=(1, 16)``: 1×16 along K in the forward, and the dgrad's operand re-quantized from the
      dequantized forward weight in 1×16 blocks along N (module docstring; ``dgrad_weight``).
    dy_dgrad: ``dy`` in the dgrad (1×16 along N; stochastic rounding in the recipe).
    x_wgrad: ``H·x`` in the wgrad (1×16 along the tokens).
    dy_wgrad: ``H·dy`` in the wgrad (1×16 along the tokens; stochastic rounding in the recipe).
    hadamard: random Hadamard transform H on the token axis of both wgrad operands (also applied,
      in f32, when ``wgrad`` is False, where it only changes rounding).
    rounding_bits: the random bits of stochastic rounding, in every implementation alike:
      ``"counter"`` (the default: ``numerics.counter_bits``, one keyed integer hash per pair of
      elements, 8 bits per element, so each rounding probability is a multiple of 1/256, as on
      Blackwell's stochastic-rounding conversions; cheap in the quantizer kernels) or ``"random"``
      (``jax.random.bits`` of the operand's key: 22 bits per element, threefry2x32). The two are
      different random streams, not the same bits.
    split: the low-rank split of ``x`` and/or ``dy`` (``Split``); ``Split()`` splits nothing.
  """

  fwd: bool = True
  dgrad: bool = True
  wgrad: bool = True
  x: Operand = Operand()
  w: Operand = Operand(block=(16, 16))
  dy_dgrad: Operand = Operand(rounding="stochastic")
  x_wgrad: Operand = Operand()
  dy_wgrad: Operand = Operand(rounding="stochastic")
  hadamard: bool = True
  rounding_bits: str = "counter"
  split: Split = Split()

  def __post_init__(self):
    for name in ("fwd", "dgrad", "wgrad", "hadamard"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"MatmulConfig.{name} must be a bool, got {getattr(self, name)!r}")
    for op in OPERANDS:
      spec = getattr(self, op)
      if not isinstance(spec, Operand):
        raise ValueError(f"MatmulConfig.{op} must be a fp4jax.quant.Operand, got {type(spec).__name__}")
      if op != "w" and spec.quantized and spec.block != (1, 16):  # w takes both of Operand's blocks
        raise ValueError(f"MatmulConfig.{op}.block={spec.block}: the GEMMs contract {op} in "
                         f"{_BLOCK_USE[op]}; use block=(1, 16)")
    if self.rounding_bits not in numerics.BIT_SOURCES:
      raise ValueError(f"MatmulConfig.rounding_bits must be one of {numerics.BIT_SOURCES}, got "
                       f"{self.rounding_bits!r}")
    if not isinstance(self.split, Split):
      raise ValueError(f"MatmulConfig.split must be a Split, got {type(self.split).__name__}")

  @classmethod
  def nvfp4(cls, **overrides) -> MatmulConfig:
    """NVIDIA's NVFP4 recipe: all three GEMMs quantized, SR on gradients, Hadamard on the wgrad."""
    return cls(**overrides)

  @classmethod
  def bf16(cls, **overrides) -> MatmulConfig:
    """No quantization and no Hadamard: ``nvfp4_matmul`` is then exactly ``jnp.dot`` (value and grads)."""
    return cls(**{"fwd": False, "dgrad": False, "wgrad": False, "hadamard": False, **overrides})

  @property
  def quantized(self) -> bool:
    """True if any GEMM is quantized."""
    return self.fwd or self.dgrad or self.wgrad

  def splits(self, tensor: str) -> bool:
    """Whether ``tensor`` (``x`` or ``dy``) is split before a quantized GEMM that reads it."""
    reads = {"x": self.fwd or self.wgrad, "dy": self.dgrad or self.wgrad}[tensor]
    return reads and tensor in self.split.tensors

  def _quantizes(self, op: str) -> bool:
    gemm = {"x": self.fwd, "w": self.fwd or self.dgrad, "dy_dgrad": self.dgrad,
            "x_wgrad": self.wgrad, "dy_wgrad": self.wgrad}[op]
    return gemm and getattr(self, op).quantized

  @property
  def needs_key(self) -> bool:
    """True if the config draws random bits (stochastic rounding of a quantized operand, the
    Hadamard transform, or a subspace split)."""
    return (self.hadamard
            or any(self._quantizes(op) and getattr(self, op).stochastic for op in OPERANDS)
            or (self.split.method == "subspace" and any(map(self.splits, _SPLIT_TENSORS))))


# ----------------------------------------------------------------------------------------------
# Operand quantization, shared by the custom_vjp and the references (same keys -> same bits)


def _keys(key, config: MatmulConfig) -> dict:
  """One independent key per random choice; a fixed assignment so a config switch never moves bits."""
  names = ("x", "w", "dy_dgrad", "x_wgrad", "dy_wgrad", "hadamard")
  if not config.needs_key:
    return dict.fromkeys(names + ("split_x", "split_dy", "w_dgrad"))
  if key is None:
    raise ValueError(
        "nvfp4_matmul: this MatmulConfig uses randomness (stochastic rounding, the Hadamard "
        "transform or a subspace split) and needs `key` (a jax.random key); only a config without "
        "any accepts key=None")
  ks = jax.random.split(key, 6)
  keys = dict(zip(names, ks, strict=True))
  keys["split_x"], keys["split_dy"], keys["w_dgrad"] = (jax.random.fold_in(key, 0x5B17 + i) for i in range(3))
  return keys


def _q(x, rounding, key, config, **kw):
  """``nvfp4.quantize`` of one GEMM operand (``kw``: its layout and ``scale_rule``), with the kernels'
  random bits (``config.rounding_bits``) under stochastic rounding."""
  if rounding != "stochastic":
    return nvfp4.quantize(x, rounding=rounding, **kw)
  bits = numerics.stochastic_bits(key, x.shape, config.rounding_bits)  # the kernels' bits
  return nvfp4.quantize(x, rounding=rounding, bits=bits, **kw)


def wgrad_operand(a_MxC, keys):
  """``H·a`` (float32) along the token axis, with the Hadamard key; identity without a key."""
  a = a_MxC.astype(_F32)
  return a if keys["hadamard"] is None else nvfp4.hadamard(a, keys["hadamard"], axis=0)


def _term_key(key, term: int):
  return key if key is None or term == 0 else jax.random.fold_in(key, term)


def quantize_operand(a, op: str, keys, config: MatmulConfig, run: MatmulExecution | None = None, *,
                     dtype=None, decoded: bool = False):
  """Operand ``op`` (``OPERANDS``) of its quantized GEMM, as ``config`` prepares it from ``a``.

  ``a`` is the tensor the operand is made of (``x``, ``w`` or ``dy``, or a split's residual); the
  wgrad operands get the Hadamard transform here (``config.hadamard``).

  Args:
    a: the tensor.
    op: which operand (``OPERANDS``): its ``Operand`` and key; or ``"w_dgrad"``, the dgrad's
      re-quantization of a 1×16 ``w`` (``config.w``, 1×16 along N, a key of its own; ``a`` is then
      the dequantized forward weight: ``dgrad_weight``).
    keys: the call's keys (``_keys``).
    config: the ``MatmulConfig``.
    run: the resolved ``MatmulExecution`` (default: XLA).
    dtype: the dtype of an unquantized (``format="bf16"``) operand (default: ``a``'s).
    decoded: with the quantizer kernels, also write each term's decoded bf16 copy.

  Returns:
    A tuple of ``(NVFP4Tensor, decoded bf16 or None)`` terms (``Operand.terms`` of them), or, for
    an unquantized operand, the plain array in ``dtype``.
  """
  run = run or _XLA
  spec = config.w if op == "w_dgrad" else getattr(config, op)
  hadamard = config.hadamard and op in ("x_wgrad", "dy_wgrad")
  if not spec.quantized:
    return (wgrad_operand(a, keys) if hadamard else a).astype(dtype or a.dtype)
  how = {"block": spec.block, "scale_rule": spec.scale_rule}
  if spec.block == (1, 16):
    how["axis"] = _AXIS[op]
  kernels = run.implementation != "xla"
  if hadamard and (spec.terms > 1 or not kernels):
    a, hadamard = wgrad_operand(a, keys), False  # the kernels fuse H where the operand is one term

  def term(a, t):
    k = _term_key(keys[op], t)
    if kernels:
      return _kernel_quantize(a, spec.rounding, k, config, run, decoded=decoded,
                              hadamard_key=keys["hadamard"] if hadamard else None, **how)
    return _q(a, spec.rounding, k, config, **how), None

  return quantize_terms(a, spec.terms, term)


def dgrad_weight(qw, keys, config: MatmulConfig, run: MatmulExecution | None = None, *, dtype=None):
  """The dgrad's weight operand, from the forward's quantized ``w`` (``quantize_operand(w, "w", ...)``).

  With 16×16 tiles (the recipe) it is the forward's ``Q(w)`` itself. With ``config.w.block=(1, 16)``
  the forward's ``Q_K(w)`` (1×16 along K) cannot feed a GEMM that contracts N, so the dgrad's operand
  is ``Q_N(deq(Q_K(w)))``: the forward weight's values, dequantized to float32 (for a two-term
  ``w``, its terms' values summed in float32), quantized again in 1×16 blocks along N with
  ``config.w``'s rounding, terms and scale rule, its own amax and global scale (those of
  ``deq(Q_K(w))``, which differ from ``w``'s by at most the E4M3 rounding of the block scales) and
  a key of its own. The grids of the two block layouts differ, so the re-quantization moves most
  values (docs/DESIGN.md, "The linear recipe", has the sizes).

  Args:
    qw: the forward's ``w`` operand (its terms, or the plain array of an unquantized ``w``).
    keys: the call's keys (``_keys``).
    config: the ``MatmulConfig``.
    run: the resolved ``MatmulExecution`` (default: XLA).
    dtype: as ``quantize_operand``'s.

  Returns:
    ``qw`` (16×16 tiles, or an unquantized ``w``), else the terms of ``Q_N(deq(Q_K(w)))`` as
    ``quantize_operand`` returns them (packed: no decoded copy).
  """
  if _plain(qw) or config.w.block != (1, 16):
    return qw
  # Barriers: the GPU would fuse a term's decode into the sum (a fused multiply-add) or the sum into
  # the quantizer, and round differently from the CPU.
  terms = lax.optimization_barrier(tuple(t.dequantize(_F32) for t, _ in qw))
  deq = functools.reduce(jnp.add, terms)
  return quantize_operand(lax.optimization_barrier(deq), "w_dgrad", keys, config, run, dtype=dtype)


def _plain(operand) -> bool:
  return not isinstance(operand, tuple)


def _packed(operand):
  """An operand as the backward keeps it: the decoded bf16 copies dropped."""
  return operand if _plain(operand) else tuple((t, None) for t, _ in operand)


class _Split(NamedTuple):
  """``a = U·P + R`` (``MatmulConfig.split``): ``u`` M×r float32 (None: the ones column of
  ``"mean"``), ``p`` r×C float32, ``residual`` M×C in ``a``'s dtype."""

  u: jax.Array | None
  p: jax.Array
  residual: jax.Array


def _bdot(a, b, dims=((1,), (0,))) -> jax.Array:
  """The range finder's products: bf16 operands, float32 accumulation (the subspace need only be
  approximate; the split itself is exact for any U)."""
  return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (dims, ((), ())),
                         preferred_element_type=_F32)


def _split_tensor(a_MxC, tensor: str, keys, config: MatmulConfig) -> _Split | None:
  """``MatmulConfig.split`` of ``tensor`` (``x`` or ``dy``): None where it is not split."""
  if not config.splits(tensor):
    return None
  a32 = a_MxC.astype(_F32)
  if config.split.method == "mean":
    p = jnp.mean(a32, axis=0, keepdims=True)
    return _Split(None, p, (a32 - p).astype(a_MxC.dtype))
  m, c = a_MxC.shape
  u = range_finder(a_MxC, keys[f"split_{tensor}"], min(config.split.rank, m, c), config.split.power_iters,
                   dot=_bdot, dot_t=lambda a, b: _bdot(a, b, ((0,), (0,))), reorthonormalize=False)
  p = _ut_dot(u, a32)
  return _Split(u, p, (a32 - _u_dot(u, p)).astype(a_MxC.dtype))


def _u_dot(u, b_RxN, m=None) -> jax.Array:
  """``U·b`` (M×N) in float32: ``b``'s row broadcast over ``m`` tokens for the ones column of
  ``"mean"``."""
  if u is None:
    return jnp.broadcast_to(b_RxN, (m if m is not None else 1, b_RxN.shape[1]))
  return jnp.dot(u, b_RxN, precision=_HIGHEST)


def _ut_dot(u, a_MxC) -> jax.Array:
  """``Uᵀ·a`` (r×C) in float32: the column sums for the ones column of ``"mean"``."""
  a32 = a_MxC.astype(_F32)
  if u is None:
    return jnp.sum(a32, axis=0, keepdims=True)
  return lax.dot_general(u, a32, (((0,), (0,)), ((), ())), precision=_HIGHEST)


# ----------------------------------------------------------------------------------------------
# GEMMs


def _fdot(a, b, dims) -> jax.Array:
  """Unquantized GEMM in the operands' (common) dtype with f32 accumulation."""
  return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32)


# Jitted, so that the operands of one shape (every block's projection, in a model) share one traced
# and lowered quantizer: the step's program calls it, rather than repeating its kernels.
_quantize_kernels = jax.jit(nvfp4_quantize.quantize, static_argnames=(
    "block", "axis", "rounding", "bit_source", "decoded", "block_sizes", "amax", "scale_rule", "interpret"))


def _kernel_quantize(a, rounding, key, config, run, *, decoded, hadamard_key=None, **how):
  """``nvfp4_quantize.quantize`` of one GEMM operand: the tensor ``_q`` gives with the same key and
  ``config.rounding_bits``, and with ``decoded`` its bf16 ``scaled_elements`` (else None)."""
  out = _quantize_kernels(a, rounding=rounding, key=key if rounding == "stochastic" else None,
                          hadamard_key=hadamard_key, decoded=decoded, amax=run.amax,
                          bit_source=config.rounding_bits,
                          interpret=run.implementation == "pallas_interpret", **how)
  return out if decoded else (out, None)


def _gemm(a, b, dims, run, decoded=(None, None)) -> jax.Array:
  """One quantized GEMM of two ``NVFP4Tensor``s as ``run.gemm`` says: ``nvfp4.gemm`` (with the
  decoded bf16 operands the quantizer kernels wrote, where given) or ``nvfp4.scaled_matmul_gemm``."""
  if run.gemm == "scaled_matmul":
    return nvfp4.scaled_matmul_gemm(a, b, dims)
  return nvfp4.gemm(a, b, dims, decoded=decoded)


def _mixed_gemm(t, d, plain, dims, t_first: bool) -> jax.Array:
  """NVFP4 × unquantized: ``t``'s elements decoded to bf16 (exact), a float32-accumulated dot with
  the plain operand (in its dtype, at least bf16), then ``t``'s global scale."""
  dtype = jnp.promote_types(jnp.bfloat16, plain.dtype)
  d = (t.scaled_elements(jnp.bfloat16) if d is None else d).astype(dtype)
  a, b = (d, plain.astype(dtype)) if t_first else (plain.astype(dtype), d)
  acc = lax.dot_general(a, b, (dims, ((), ())), precision=_HIGHEST, preferred_element_type=_F32)
  return acc * t.global_scale


def _gemm_operands(a, b, dims, run: MatmulExecution | None = None) -> jax.Array:
  """The float32 product of two operands of ``quantize_operand``: the sum of every pair of terms'
  GEMMs (``fp4jax.quant.gemm_terms`` of ``nvfp4.gemm``; NVFP4 × BF16 where one operand is plain; a
  plain GEMM where both are)."""
  run = run or _XLA
  if _plain(a) and _plain(b):
    return _fdot(a, b.astype(a.dtype), dims)

  def pair(term_a, term_b):
    (ta, da), (tb, db) = term_a, term_b
    if ta is not None and tb is not None:
      return _gemm(ta, tb, dims, run, (da, db))
    return _mixed_gemm(ta, da, db, dims, True) if tb is None else _mixed_gemm(tb, db, da, dims, False)

  return gemm_terms(((None, a),) if _plain(a) else a, ((None, b),) if _plain(b) else b, pair)


_NN = ((1,), (0,))  # x_MxK · w_KxN
_NT = ((1,), (1,))  # dy_MxN · w_KxNᵀ
_TN = ((0,), (0,))  # x_MxKᵀ · dy_MxN


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _matmul(x_MxK, w_KxN, key, config, run, x_dtype, w_dtype):
  return _matmul_fwd(x_MxK, w_KxN, key, config, run, x_dtype, w_dtype)[0]


def _matmul_fwd(x_MxK, w_KxN, key, config, run, x_dtype, w_dtype):
  """The forward GEMM, and the backward's residuals: the packed ``Q(w)`` (or ``w``), the packed
  wgrad operand ``Q(H·x)`` (or ``x``), the split of ``x`` where there is one, and ``x`` (or its
  split's residual) in high precision where the wgrad needs it for a split ``dy``."""
  keys = _keys(key, config)
  decoded = run.gemm == "decoded" and run.implementation != "xla"
  sx = _split_tensor(x_MxK, "x", keys, config)
  x_q = x_MxK if sx is None else sx.residual
  qw = None
  if config.fwd or config.dgrad:
    qw = quantize_operand(w_KxN, "w", keys, config, run, dtype=x_dtype, decoded=config.fwd and decoded)
  if config.fwd:
    qx = quantize_operand(x_q, "x", keys, config, run, dtype=x_dtype, decoded=decoded)
    y = _gemm_operands(qx, qw, _NN, run)
    if sx is not None:
      y = y + _u_dot(sx.u, jnp.dot(sx.p, w_KxN.astype(_F32), precision=_HIGHEST), x_MxK.shape[0])
  else:
    y = _fdot(x_MxK, w_KxN.astype(x_dtype), _NN)
  w_res = _packed(dgrad_weight(qw, keys, config, run, dtype=x_dtype)) if config.dgrad else w_KxN
  x_res = x_MxK
  if config.wgrad:
    x_res = _packed(quantize_operand(x_q, "x_wgrad", keys, config, run, dtype=x_dtype))
  x_hp = x_q if config.wgrad and config.splits("dy") else None
  w_hp = w_KxN if config.dgrad and config.splits("dy") else None
  return y.astype(x_dtype), (w_res, x_res, sx, x_hp, w_hp, keys)


def _matmul_bwd(config, run, x_dtype, w_dtype, res, dy_MxN):
  w_res, x_res, sx, x_hp, w_hp, keys = res
  decoded = run.gemm == "decoded" and run.implementation != "xla"
  m = dy_MxN.shape[0]
  sd = _split_tensor(dy_MxN, "dy", keys, config)
  dy_q = dy_MxN if sd is None else sd.residual
  if config.dgrad:
    qdy = quantize_operand(dy_q, "dy_dgrad", keys, config, run, dtype=x_dtype, decoded=decoded)
    dx = _gemm_operands(qdy, w_res, _NT, run)
    if sd is not None:
      dx = dx + _u_dot(sd.u, jnp.dot(sd.p, w_hp.astype(_F32).T, precision=_HIGHEST), m)
  else:
    dx = _fdot(dy_MxN, w_res.astype(x_dtype), _NT)
  if config.wgrad:
    qdy = quantize_operand(dy_q, "dy_wgrad", keys, config, run, dtype=x_dtype, decoded=decoded)
    dw = _gemm_operands(x_res, qdy, _TN, run)
    if sx is not None:  # P_xᵀ·(U_xᵀ·dy)
      dw = dw + jnp.dot(sx.p.T, _ut_dot(sx.u, dy_MxN), precision=_HIGHEST)
    if sd is not None:  # (R_xᵀ·U_dy)·P_dy
      dw = dw + jnp.dot(_ut_dot(sd.u, x_hp).T, sd.p, precision=_HIGHEST)
  elif config.hadamard:
    dw = lax.dot_general(wgrad_operand(x_res, keys), wgrad_operand(dy_MxN, keys), (_TN, ((), ())),
                         precision=_HIGHEST, preferred_element_type=_F32)
  else:
    dw = _fdot(x_res, dy_MxN, _TN).astype(x_dtype)  # as jax.vjp of jnp.dot with w cast to x's dtype
  return dx.astype(x_dtype), dw.astype(w_dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ----------------------------------------------------------------------------------------------
# Public API


def _check(x, w, key, config) -> None:
  if not isinstance(config, MatmulConfig):
    raise ValueError(f"nvfp4_matmul: config must be a MatmulConfig, got {type(config).__name__}")
  for name, a in (("x", x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"nvfp4_matmul: {name} must be a floating-point array, got dtype {a.dtype}")
  if w.ndim != 2:
    raise ValueError(f"nvfp4_matmul: w must be 2-D [K, N], got shape {w.shape}")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"nvfp4_matmul: x [..., K] and w [K, N] disagree on K: x {x.shape}, w {w.shape}")
  k, n = w.shape
  m = x.size // k if k else 0
  need = []
  if config.fwd or config.dgrad:
    tiles = "16x16 weight tiles" if config.w.block == (16, 16) else "the dgrad's 1x16 weight blocks"
    need += [("K (contraction of the forward)", k), (f"N ({tiles})", n)]
  if config.wgrad or config.hadamard:
    need.append(("M = tokens (all leading dims of x; contraction of the wgrad)", m))
  for what, size in need:
    if size % nvfp4.BLOCK:
      raise ValueError(
          f"nvfp4_matmul: {what} = {size} is not a multiple of 16 (x {x.shape}, w {w.shape}); pad it, or "
          "switch the GEMM that needs it to bf16 in the MatmulConfig")
  if config.needs_key and key is None:
    _keys(None, config)  # raises the key error


def _resolve(config: MatmulConfig, ex: MatmulExecution, sizes, key) -> MatmulExecution:
  """The ``MatmulExecution`` of one call, with nothing left ``"auto"``: the kernels on a CUDA GPU
  when they take these operands (an explicit kernel choice that cannot take them raises), and
  ``scaled_matmul`` GEMMs on a GPU with FP4 tensor cores."""
  if not isinstance(ex, MatmulExecution):
    raise ValueError(f"nvfp4_matmul: execution must be a fp4jax.execution.MatmulExecution, got "
                     f"{type(ex).__name__}")
  impl, gemm = ex.implementation, ex.gemm
  if gemm == "auto":
    gemm = "scaled_matmul" if _platform.fp4_tensor_cores() else "decoded"
  if impl == "xla":
    return MatmulExecution("xla", gemm, ex.amax)
  too_large = max(sizes) > _KERNEL_MAX_ELEMENTS
  # The kernels reproduce jax.random.bits of threefry2x32 keys (JAX's default) only.
  other_key = (config.needs_key and config.rounding_bits == "random"
               and not nvfp4_quantize.threefry_key(key))
  if impl == "auto":
    impl = "xla" if too_large or other_key else _platform.resolve(impl, "pallas", "xla",
                                                                   whole_arrays=True)
  elif too_large:
    raise ValueError(f"nvfp4_matmul: MatmulExecution.implementation={impl!r} quantizes operands of "
                     f"fewer than 2**31 elements; got {max(sizes)}: use implementation='xla'")
  elif other_key:
    raise ValueError(f"nvfp4_matmul: MatmulExecution.implementation={impl!r} draws jax.random.bits of "
                     "threefry2x32 keys (JAX's default, with jax_threefry_partitionable); got a key of "
                     f"{jax.random.key_impl(key)}: use implementation='xla'")
  return MatmulExecution(impl, gemm, ex.amax)


def nvfp4_matmul(x, w, *, key=None, config: MatmulConfig,
                 execution: MatmulExecution = MatmulExecution()) -> jax.Array:
  """``x @ w`` with the forward, dgrad and wgrad GEMMs in NVFP4 as ``config`` says (differentiable).

  Args:
    x: ``[..., K]`` activations (any float dtype; bf16 in a model). All leading axes are the
      token axis ``M`` of the wgrad.
    w: ``[K, N]`` weight; quantized from its own dtype (an f32 master weight is quantized directly).
    key: a ``jax.random`` key for stochastic rounding and the Hadamard signs; may be None only when
      ``config.needs_key`` is False. Same key, same bits; use a fresh key per step.
    config: a ``MatmulConfig`` (``MatmulConfig.nvfp4()`` is NVIDIA's recipe, ``.bf16()`` plain).
    execution: which code runs it, with the same bits (``fp4jax.execution.MatmulExecution``):
      its ``implementation`` ``"xla"`` (``nvfp4.quantize``), ``"pallas"`` (the quantizer kernels of
      ``fp4jax.kernels.nvfp4_quantize``, CUDA), ``"pallas_interpret"`` (those kernels in interpret
      mode, for CPU tests), or ``"auto"``: ``"pallas"`` when computations go to a CUDA GPU
      (``fp4jax._platform.resolve``), the mesh in context (``jax.set_mesh``) has one device, and
      the kernels take the operands (fewer than 2**31 elements each, threefry keys), else
      ``"xla"``. Its ``gemm``, how each quantized GEMM multiplies, with the same result up to
      float32 summation order: ``"decoded"`` (the operands decoded exactly to bf16, a bf16
      tensor-core GEMM with float32 accumulation: ``nvfp4.gemm``; Hopper and every other device),
      ``"scaled_matmul"`` (the packed operands as float4_e2m1fn elements and float8_e4m3fn scales
      into ``jax.nn.scaled_matmul``: ``nvfp4.scaled_matmul_gemm``, cuDNN's block-scaled GEMM on FP4
      tensor cores), or ``"auto"``: ``"scaled_matmul"`` on a CUDA GPU of compute capability 10.0 or
      more (``fp4jax._platform.fp4_tensor_cores``), else ``"decoded"``. Its ``amax``: with the
      quantizer kernels, how their first pass forms each operand's ``max|x|`` (the same bits either
      way: ``nvfp4_quantize.quantize(amax=...)``).

  Returns:
    ``[..., N]`` in ``x``'s dtype (f32 accumulation). Gradients come back in ``x``'s and ``w``'s
    dtypes. With every GEMM unquantized and no Hadamard, value and gradients equal those of
    ``jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)``.

  Raises:
    ValueError: shapes that disagree, K/N/M not a multiple of 16 where a GEMM needs it (M only for
      the wgrad), non-float inputs, a missing key, an ``execution`` that is not a
      ``MatmulExecution``, or a kernel implementation that cannot take the operands (2**31 elements
      or more, a key that is not threefry2x32).
  """
  x, w = jnp.asarray(x), jnp.asarray(w)
  _check(x, w, key, config)
  x_MxK = x.reshape(-1, w.shape[0])
  run = _resolve(config, execution, (x.size, w.size, x_MxK.shape[0] * w.shape[1]), key)
  y = _matmul(x_MxK, w, key, config, run, x.dtype, w.dtype)
  return y.reshape(*x.shape[:-1], w.shape[1])


def _reference_product(a, b, dims) -> jax.Array:
  """``_gemm_operands`` from dequantized operands: one HIGHEST-precision float32 dot per term pair."""
  deq = lambda o: [o.astype(_F32)] if _plain(o) else [t.dequantize(_F32) for t, _ in o]
  return gemm_terms(deq(a), deq(b), lambda ta, tb: lax.dot_general(ta, tb, (dims, ((), ())), precision=_HIGHEST))


def nvfp4_matmul_reference(x, w, *, key=None, config: MatmulConfig) -> jax.Array:
  """Forward reference: the same quantized operands dequantized to f32, one HIGHEST-precision f32
  dot per pair of terms (and a split's low-rank part in float32).

  Args/Returns as ``nvfp4_matmul`` (no custom gradient: use ``nvfp4_matmul_vjp_reference``).
  """
  x, w = jnp.asarray(x), jnp.asarray(w)
  _check(x, w, key, config)
  keys = _keys(key, config)
  x_MxK = x.reshape(-1, w.shape[0])
  if config.fwd:
    sx = _split_tensor(x_MxK, "x", keys, config)
    x_q = x_MxK if sx is None else sx.residual
    y = _reference_product(quantize_operand(x_q, "x", keys, config, dtype=x.dtype),
                           quantize_operand(w, "w", keys, config, dtype=x.dtype), _NN)
    if sx is not None:
      y = y + _u_dot(sx.u, jnp.dot(sx.p, w.astype(_F32), precision=_HIGHEST), x_MxK.shape[0])
  else:
    y = _fdot(x_MxK, w.astype(x.dtype), _NN)
  return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[1])


def nvfp4_matmul_vjp_reference(x, w, dy, *, key=None, config: MatmulConfig):
  """Backward reference ``(dx, dw)`` for cotangent ``dy``, from dequantized operands in f32.

  Uses the same keys as ``nvfp4_matmul``, hence the same quantized values (and the same
  forward-quantized ``Q(w)`` in the dgrad); a split's low-rank terms in float32.

  Returns:
    ``dx`` like ``x``, ``dw`` like ``w``.
  """
  x, w, dy = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)
  _check(x, w, key, config)
  keys = _keys(key, config)
  x_MxK, dy_MxN = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1]).astype(x.dtype)
  m = x_MxK.shape[0]
  sx, sd = _split_tensor(x_MxK, "x", keys, config), _split_tensor(dy_MxN, "dy", keys, config)
  x_q = x_MxK if sx is None else sx.residual
  dy_q = dy_MxN if sd is None else sd.residual
  f32 = lambda a: a.astype(_F32)
  if config.dgrad:
    qw = quantize_operand(w, "w", keys, config, dtype=x.dtype)
    dx = _reference_product(quantize_operand(dy_q, "dy_dgrad", keys, config, dtype=x.dtype),
                            dgrad_weight(qw, keys, config, dtype=x.dtype), _NT)
    if sd is not None:
      dx = dx + _u_dot(sd.u, jnp.dot(sd.p, f32(w).T, precision=_HIGHEST), m)
  else:
    dx = _fdot(dy_MxN, w.astype(x.dtype), _NT)
  if config.wgrad:
    dw = _reference_product(quantize_operand(x_q, "x_wgrad", keys, config, dtype=x.dtype),
                            quantize_operand(dy_q, "dy_wgrad", keys, config, dtype=x.dtype), _TN)
    if sx is not None:
      dw = dw + jnp.dot(sx.p.T, _ut_dot(sx.u, dy_MxN), precision=_HIGHEST)
    if sd is not None:
      dw = dw + jnp.dot(_ut_dot(sd.u, x_q).T, sd.p, precision=_HIGHEST)
  elif config.hadamard:
    dw = jnp.dot(wgrad_operand(x_MxK, keys).T, wgrad_operand(dy_MxN, keys), precision=_HIGHEST)
  else:
    dw = _fdot(x_MxK, dy_MxN, _TN).astype(x.dtype)
  return dx.astype(x.dtype).reshape(x.shape), dw.astype(w.dtype)
