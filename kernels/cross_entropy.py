"""Fused softmax cross-entropy over rows of float32 logits: one Pallas (Triton) kernel per chunk.

``softmax_xent_rows(logits_CxV, tgt_C, w_C)`` returns, per row ``i``,

- ``lse_C[i]``: the max-stabilised ``logsumexp(logits[i])`` in float32,
- ``tgt_logit_C[i]``: ``logits[i, tgt[i]]``,
- ``dl_CxV[i]``: ``((exp(logits[i] - lse[i]) - onehot(tgt[i])) * w[i]).astype(dl_dtype)``, the
  cotangent of ``sum(w * (lse - tgt_logit))`` with respect to the logits,

reading the logits once or twice and writing ``dl`` once, where the XLA path (``fp4jax.loss``) makes
separate passes over the (C, V) float32 array (row max, sum of exp, cotangent).
``softmax_xent_rows_reference`` is the same in plain jnp.

Two kernels: ``"row"`` holds whole rows (padded to a power of two, V_pad) in registers, for
V_pad <= 65536; ``"tiled"`` takes any V in tiles, with an online max / sum of exp in a first loop
and the cotangent in a second (so it reads the logits twice; the second read of a program's rows
may come from L2). On the H200 "tiled" (2048 columns, 4 warps) was the faster at V = 32768 and
50304 (benchmarks/cross_entropy.py; benchmarks/RESULTS.md), so "auto" takes it.

Everything inside the kernels lowers to Triton (power-of-two blocks, masked loads and stores for the
ragged column tail and row tail, no gathers or value slicing): see tests/test_kernels_cross_entropy.py
for the CPU-side CUDA lowering check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax.kernels._util import next_pow2, store

ROW_MAX_V_PAD = 65536  # the widest rows "row" is meant for (one row fills a register file)
_TRITON_MAX_NUMEL = 1 << 20  # Triton's limit on the elements of one block
_IMPLS = ("auto", "row", "tiled", "reference")


def _is_pow2(n) -> bool:
  return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def softmax_xent_rows_reference(logits_CxV, tgt_C, w_C, dl_dtype=jnp.bfloat16):
  """The jnp reference of ``softmax_xent_rows``: ``(lse_C, tgt_logit_C, dl_CxV)``.

  Targets outside ``[0, V)`` match no column (``tgt_logit`` 0, no one-hot), as in the kernels.
  """
  logits = logits_CxV.astype(jnp.float32)
  tgt_C = tgt_C.astype(jnp.int32)
  m_C = jnp.max(logits, axis=1)
  lse_C = m_C + jnp.log(jnp.sum(jnp.exp(logits - m_C[:, None]), axis=1))
  # The target logit as a gather, not a one-hot reduction over the row (a separate 3.8 ms pass per
  # 125m step on the H200); this op is never differentiated, so no (C, V) scatter follows.
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


def _row_kernel(x_ref, tgt_ref, w_ref, lse_ref, tl_ref, dl_ref, *, n_rows, n_cols):
  r, v_pad = x_ref.shape
  row_ok = None
  if n_rows % r:  # the last program's block hangs over the end: mask its rows (no padding copy)
    row_ok = pl.program_id(0) * r + lax.broadcasted_iota(jnp.int32, (r,), 0) < n_rows
  col = lax.broadcasted_iota(jnp.int32, (r, v_pad), 1)
  mask = _and(None if n_cols == v_pad else col < n_cols, None if row_ok is None else row_ok[:, None])
  # -inf in the padding: exp gives 0 there, and the max ignores it.
  x = x_ref[...] if mask is None else plgpu.load(x_ref, mask=mask, other=-jnp.inf)
  tgt, w = _load_row_vectors(tgt_ref, w_ref, row_ok)
  m = jnp.max(x, axis=1)
  lse = m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=1))
  hit = col == tgt[:, None]
  store(lse_ref, lse, row_ok)
  store(tl_ref, jnp.sum(jnp.where(hit, x, 0.0), axis=1), row_ok)
  # exp(x - lse) again rather than exp(x - m) / sum: the reference's formula, and the exp is cheap
  # next to the memory traffic.
  dl = (jnp.exp(x - lse[:, None]) - jnp.where(hit, 1.0, 0.0)) * w[:, None]
  store(dl_ref, dl.astype(dl_ref.dtype), mask)


def _tiled_kernel(x_ref, tgt_ref, w_ref, lse_ref, tl_ref, dl_ref, *, n_rows, n_cols, tile):
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


def _check_pow2(name, value, hi=None):
  if not _is_pow2(value) or (hi is not None and value > hi):
    bound = f" <= {hi}" if hi is not None else ""
    raise ValueError(f"softmax_xent_rows: {name}={value!r} must be a power of two{bound}")


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


def softmax_xent_rows(logits_CxV, tgt_C, w_C, dl_dtype=jnp.bfloat16, *, impl: str = "auto",
                      rows_per_program: int | None = None, num_warps: int | None = None,
                      tile_v: int | None = None, num_stages: int | None = None,
                      interpret: bool = False):
  """Row-wise logsumexp, target logit and weighted softmax-minus-onehot of float32 logits, fused.

  One pass over the logits instead of XLA's four: per row ``i``,
  ``lse[i] = logsumexp(logits[i])`` (max-stabilised, float32), ``tgt_logit[i] = logits[i, tgt[i]]``
  and ``dl[i] = ((exp(logits[i] - lse[i]) - onehot(tgt[i])) * w[i]).astype(dl_dtype)``. Rows with
  ``w == 0`` still get a valid ``lse`` (and ``dl`` 0). Targets outside ``[0, V)`` match no column.

  Not differentiable (``jax.grad`` / ``jax.jvp`` through it raise a ``TypeError``): it is made for the
  forward rule of a ``jax.custom_vjp`` (``fp4jax.loss``), where ``dl`` is the saved residual
  whose GEMMs form the backward.

  The kernels lower only for GPUs (Pallas Triton backend); on the CPU pass ``interpret=True``
  or ``impl="reference"``.

  Args:
    logits_CxV: float32 logits, (C, V).
    tgt_C: integer target ids, (C,).
    w_C: per-row weights (float), (C,); 0 for padding rows.
    dl_dtype: dtype of ``dl`` (bfloat16: the dtype of the LM-head GEMM operands).
    impl: ``"row"`` (whole rows of V_pad = next power of two >= V columns per program; needs
      rows_per_program · V_pad <= 2**20), ``"tiled"`` (any V, ``tile_v`` columns at a time, two
      reads of the logits), ``"auto"`` (``"tiled"``, the faster on the H200), or
      ``"reference"`` (``softmax_xent_rows_reference``, plain XLA).
    rows_per_program: rows per grid program, a power of two (default 1). C need not be a multiple:
      the last program masks its rows.
    num_warps: Triton warps per program, a power of two <= 32 (default: ``"row"`` about 64 logits
      per thread, 16 for V = 32768 and one row; ``"tiled"`` 4).
    tile_v: ``"tiled"`` only: columns per tile, a power of two (default 2048, at most V_pad).
    num_stages: Triton pipelining stages (default: Triton's, 3 on CUDA); matters for ``"tiled"``.
    interpret: run the kernel in Pallas interpret mode (CPU tests).

  Returns:
    ``(lse_C float32, tgt_logit_C float32, dl_CxV dl_dtype)``.
  """
  _check(logits_CxV, tgt_C, w_C, dl_dtype)
  if impl not in _IMPLS:
    raise ValueError(f"softmax_xent_rows: impl={impl!r}, expected one of {_IMPLS}")
  c, v = logits_CxV.shape
  v_pad = next_pow2(v)
  if impl == "auto":
    # Measured on the H200 (benchmarks/RESULTS.md): "tiled" beat "row" at V = 32768 (0.91 vs
    # 1.02 ms per 8192-row chunk at their best settings) and at V = 50304 (1.40 vs 1.67 ms).
    impl = "tiled"
  w_C = w_C.astype(jnp.float32)
  if impl == "reference":
    return _no_derivative(functools.partial(softmax_xent_rows_reference, dl_dtype=dl_dtype))(
        logits_CxV, tgt_C, w_C)

  r = 1 if rows_per_program is None else rows_per_program
  _check_pow2("rows_per_program", r)
  r = min(r, next_pow2(c))  # no programs wider than all rows
  if impl == "row":
    if r * v_pad > _TRITON_MAX_NUMEL:
      raise ValueError(f"softmax_xent_rows: impl='row' holds rows_per_program x V_pad = {r} x {v_pad} "
                       f"logits per program, over Triton's {_TRITON_MAX_NUMEL}; use fewer rows or "
                       "impl='tiled'")
    warps = int(np.clip(r * v_pad // 2048, 4, 32)) if num_warps is None else num_warps
    kernel = functools.partial(_row_kernel, n_rows=c, n_cols=v)
  else:
    tile = min(2048 if tile_v is None else tile_v, v_pad)
    _check_pow2("tile_v", tile)
    warps = 4 if num_warps is None else num_warps
    kernel = functools.partial(_tiled_kernel, n_rows=c, n_cols=v, tile=tile)
  _check_pow2("num_warps", warps, 32)
  if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
    raise ValueError(f"softmax_xent_rows: num_stages={num_stages!r} must be a positive int")
  # Out-of-range targets -> -1, so a target in the padding columns [V, V_pad) picks nothing.
  tgt_C = tgt_C.astype(jnp.int32)
  tgt_C = jnp.where((tgt_C >= 0) & (tgt_C < v), tgt_C, -1)

  # The (r, V_pad) block is never loaded whole by "tiled" (it slices tiles from the ref); its width
  # is a multiple of the tile so that interpret mode pads the array instead of clamping slices.
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
      name=f"softmax_xent_{impl}",
  )
  return _no_derivative(call)(logits_CxV, tgt_C, w_C)
