"""Fused softmax cross-entropy over rows of float32 logits: one Pallas (Triton) kernel per chunk.

``softmax_xent_rows(logits_CxV, tgt_C, w_C)`` returns, per row ``i``,

- ``lse_C[i]``: the max-stabilised ``logsumexp(logits[i])`` in float32,
- ``tgt_logit_C[i]``: ``logits[i, tgt[i]]``,
- ``dl_CxV[i]``: ``((exp(logits[i] - lse[i]) - onehot(tgt[i])) * w[i]).astype(dl_dtype)``, the
  cotangent of ``sum(w * (lse - tgt_logit))`` with respect to the logits,

where the XLA path (``fp4jax.loss``) makes separate passes over the (C, V) float32 array (row max,
sum of exp, cotangent). ``softmax_xent_rows_reference`` is the same in plain jnp.

Layout: each program takes ``BlockSizes.rows_per_program`` rows and walks V in tiles of ``tile_v`` columns,
twice: an online max / sum of exp (and the target logit) in a first loop, the cotangent in a second
(the second read of a program's rows mostly comes from L2). Any V works; the ragged last tile and
the ragged last program are masked. Everything lowers to Triton (power-of-two blocks, masked loads
and stores, no gathers or value slicing): tests/test_kernels_cross_entropy.py checks the CUDA
lowering on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax.kernels._common import check_positive, check_powers_of_two, store


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Launch settings of ``softmax_xent_rows`` (frozen and hashable: a static argument); None takes
  the default. The results are the same for every setting but for the order of float32 sums.

  Attributes:
    rows_per_program: rows per grid program, a power of two (default 1). C need not be a multiple:
      the last program masks its rows.
    num_warps: Triton warps per program, a power of two <= 32 (default 4).
    tile_v: columns per tile, a power of two (default 2048, at most V rounded up to a power of two).
    num_stages: Triton pipelining stages, a positive int (default: Triton's, 3 on CUDA).
  """

  rows_per_program: int | None = None
  num_warps: int | None = None
  tile_v: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    check_powers_of_two(self, lambda name: 1, maximum=lambda name: 32 if name == "num_warps" else None,
                        allow_none=True, exclude=("num_stages",))
    check_positive(self, "num_stages", allow_none=True)


def softmax_xent_rows_reference(logits_CxV, tgt_C, w_C, dl_dtype=jnp.bfloat16):
  """The jnp reference of ``softmax_xent_rows``: ``(lse_C, tgt_logit_C, dl_CxV)``.

  Targets outside ``[0, V)`` match no column (``tgt_logit`` 0, no one-hot), as in the kernels.
  """
  logits = logits_CxV.astype(jnp.float32)
  tgt_C = tgt_C.astype(jnp.int32)
  m_C = jnp.max(logits, axis=1)
  lse_C = m_C + jnp.log(jnp.sum(jnp.exp(logits - m_C[:, None]), axis=1))
  # The target logit as a gather, not a one-hot reduction over the row (one more pass over the
  # logits); this op is never differentiated, so no (C, V) scatter follows.
  valid_C = (tgt_C >= 0) & (tgt_C < logits.shape[1])
  picked_C = jnp.take_along_axis(logits, tgt_C[:, None], axis=1, mode="clip")[:, 0]
  tgt_logit_C = jnp.where(valid_C, picked_C, 0.0)
  hit_CxV = lax.broadcasted_iota(jnp.int32, logits.shape, 1) == tgt_C[:, None]
  onehot_CxV = jnp.where(hit_CxV, 1.0, 0.0)
  dl_CxV = (jnp.exp(logits - lse_C[:, None]) - onehot_CxV) * w_C.astype(jnp.float32)[:, None]
  return lse_C, tgt_logit_C, dl_CxV.astype(dl_dtype)


def _load_row_vectors(tgt_ref, w_ref, row_ok):
  if row_ok is None:
    return tgt_ref[...], w_ref[...]
  return plgpu.load(tgt_ref, mask=row_ok, other=0), plgpu.load(w_ref, mask=row_ok, other=0.0)


def _and(a, b):
  return b if a is None else a if b is None else a & b


def _kernel(x_ref, tgt_ref, w_ref, lse_ref, tl_ref, dl_ref, *, n_rows, n_cols, tile):
  r = x_ref.shape[0]
  row_ok = None
  if n_rows % r:
    row_ok = pl.program_id(0) * r + lax.broadcasted_iota(jnp.int32, (r,), 0) < n_rows
  tgt, w = _load_row_vectors(tgt_ref, w_ref, row_ok)
  n_full, tail = divmod(n_cols, tile)

  def tile_at(k, masked):
    """Columns and logits of tile k; ``masked``: the ragged last tile."""
    col = k * tile + lax.broadcasted_iota(jnp.int32, (r, tile), 1)
    mask = _and(col < n_cols if masked else None, None if row_ok is None else row_ok[:, None])
    x_view = x_ref.at[:, pl.ds(k * tile, tile)]
    x = x_view[...] if mask is None else plgpu.load(x_view, mask=mask, other=-jnp.inf)
    return col, x, mask

  def stats(k, carry, masked=False):
    m, s, t = carry
    col, x, _ = tile_at(k, masked)
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    # Online logsumexp: rescale the running sum to the new max (exp(-inf) = 0 on the first tile).
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
    return m_new, s, t + jnp.sum(jnp.where(col == tgt[:, None], x, 0.0), axis=1)

  carry = (jnp.full((r,), -jnp.inf, jnp.float32), jnp.zeros((r,), jnp.float32),
           jnp.zeros((r,), jnp.float32))
  carry = lax.fori_loop(0, n_full, stats, carry)
  if tail:  # peeled, so the full tiles' loads carry no column mask
    carry = stats(n_full, carry, masked=True)
  m, s, t = carry
  lse = m + jnp.log(s)
  store(lse_ref, lse, row_ok)
  store(tl_ref, t, row_ok)

  def write(k, masked=False):
    col, x, mask = tile_at(k, masked)
    dl = (jnp.exp(x - lse[:, None]) - jnp.where(col == tgt[:, None], 1.0, 0.0)) * w[:, None]
    store(dl_ref.at[:, pl.ds(k * tile, tile)], dl.astype(dl_ref.dtype), mask)

  def write_full(k, carry):
    write(k)
    return carry

  lax.fori_loop(0, n_full, write_full, 0)
  if tail:
    write(n_full, masked=True)


def _check(logits_CxV, tgt_C, w_C, dl_dtype):
  if logits_CxV.ndim != 2:
    raise ValueError(f"softmax_xent_rows: logits_CxV must be 2-D (C, V), got shape {logits_CxV.shape}")
  if logits_CxV.dtype != jnp.float32:
    raise ValueError(f"softmax_xent_rows: logits_CxV must be float32, got {logits_CxV.dtype}")
  c, v = logits_CxV.shape
  if c < 1 or v < 1:
    raise ValueError(f"softmax_xent_rows: logits_CxV shape {logits_CxV.shape} has an empty axis")
  if c * v >= 1 << 31:  # Triton addresses elements with int32 offsets
    raise ValueError(f"softmax_xent_rows: logits_CxV {logits_CxV.shape} has >= 2**31 elements; "
                     "split the rows")
  if tgt_C.shape != (c,) or not jnp.issubdtype(tgt_C.dtype, jnp.integer):
    raise ValueError(f"softmax_xent_rows: tgt_C must be integer of shape ({c},), got {tgt_C.dtype} "
                     f"{tgt_C.shape}")
  if w_C.shape != (c,) or not jnp.issubdtype(w_C.dtype, jnp.floating):
    raise ValueError(f"softmax_xent_rows: w_C must be floating of shape ({c},), got {w_C.dtype} "
                     f"{w_C.shape}")
  if not jnp.issubdtype(dl_dtype, jnp.floating):
    raise ValueError(f"softmax_xent_rows: dl_dtype must be a floating dtype, got {dl_dtype}")


def _no_derivative(fn):
  """``fn`` with a JVP rule that raises a clear error (``pallas_call`` has none, and its own
  error, "Linearization failed", does not say where the derivative should come from)."""
  f = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    raise TypeError(
        "softmax_xent_rows is not differentiable: it computes the cross-entropy's cotangent dl "
        "itself and is meant for the forward rule of a jax.custom_vjp (fp4jax.loss), whose backward "
        "uses dl. Differentiate softmax_xent_rows_reference instead.")

  f.defjvp(jvp)
  return f


def softmax_xent_rows(logits_CxV, tgt_C, w_C, dl_dtype=jnp.bfloat16, *,
                      block_sizes: BlockSizes | None = None, interpret: bool = False):
  """Row-wise logsumexp, target logit and weighted softmax-minus-onehot of float32 logits, fused.

  One kernel instead of XLA's separate passes: per row ``i``,
  ``lse[i] = logsumexp(logits[i])`` (max-stabilised, float32), ``tgt_logit[i] = logits[i, tgt[i]]``
  and ``dl[i] = ((exp(logits[i] - lse[i]) - onehot(tgt[i])) * w[i]).astype(dl_dtype)``. Rows with
  ``w == 0`` still get a valid ``lse`` (and ``dl`` 0). Targets outside ``[0, V)`` match no column.

  Not differentiable (``jax.grad`` / ``jax.jvp`` through it raise a ``TypeError``): it is made for the
  forward rule of a ``jax.custom_vjp`` (``fp4jax.loss``), where ``dl`` is the saved residual
  whose GEMMs form the backward.

  The kernels lower only for GPUs (Pallas Triton backend); on the CPU pass ``interpret=True``, or
  call the reference.

  Reference: ``softmax_xent_rows_reference`` (plain jnp, same arguments and results).

  Args:
    logits_CxV: float32 logits, (C, V).
    tgt_C: integer target ids, (C,).
    w_C: per-row weights (float), (C,); 0 for padding rows.
    dl_dtype: dtype of ``dl`` (bfloat16: the dtype of the LM-head GEMM operands).
    block_sizes: launch settings (``BlockSizes``; None: every default).
    interpret: run the kernel in Pallas interpret mode (CPU tests).

  Returns:
    ``(lse_C float32, tgt_logit_C float32, dl_CxV dl_dtype)``.
  """
  _check(logits_CxV, tgt_C, w_C, dl_dtype)
  if block_sizes is None:
    block_sizes = BlockSizes()
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError("softmax_xent_rows: block_sizes must be a cross_entropy.BlockSizes or None, got "
                     f"{type(block_sizes).__name__}")
  c, v = logits_CxV.shape
  v_pad = pl.next_power_of_2(v)
  w_C = w_C.astype(jnp.float32)

  bs = block_sizes
  r = 1 if bs.rows_per_program is None else bs.rows_per_program
  r = min(r, pl.next_power_of_2(c))  # no programs wider than all rows
  tile = min(2048 if bs.tile_v is None else bs.tile_v, v_pad)
  warps = 4 if bs.num_warps is None else bs.num_warps
  num_stages = bs.num_stages
  kernel = functools.partial(_kernel, n_rows=c, n_cols=v, tile=tile)
  # Out-of-range targets -> -1, so a target in the padding columns [V, V_pad) picks nothing.
  tgt_C = tgt_C.astype(jnp.int32)
  tgt_C = jnp.where((tgt_C >= 0) & (tgt_C < v), tgt_C, -1)

  # The (r, V_pad) block is never loaded whole (the kernel slices tiles from the ref); its width is a
  # multiple of the tile so that interpret mode pads the array instead of clamping slices.
  rows = pl.BlockSpec((r,), lambda i: (i,))
  block = pl.BlockSpec((r, v_pad), lambda i: (i, 0))
  call = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((c,), jnp.float32), jax.ShapeDtypeStruct((c,), jnp.float32),
                 jax.ShapeDtypeStruct((c, v), dl_dtype)),
      grid=(pl.cdiv(c, r),),
      in_specs=[block, rows, rows],
      out_specs=(rows, rows, block),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=num_stages),
      interpret=interpret,
      name="softmax_xent",
  )
  return _no_derivative(call)(logits_CxV, tgt_C, w_C)
