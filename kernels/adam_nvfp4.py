"""The AdamW update of NVFP4 moments in two Pallas (Triton) kernels per leaf.

``fp4jax.optim.scale_by_adam_nvfp4`` updates a leaf by decoding its moments, running Adam's float32
arithmetic and re-encoding m and √v as NVFP4 (1×16 blocks along the last axis). Encoding needs each
new moment's tensor amax (or a bound of it) before any code is written, so the XLA program makes
several passes and, grouping leaves of one shape under ``vmap``, copies stacks of them. Here each
leaf takes two kernels, with one small XLA step for all leaves:

1. A first pass, by the ``amax`` rule:
   - ``"exact"`` (default), ``stats``: decodes m and √v, computes the new moments, and folds each
     program's max of |m| and of √v into the leaf's slots of one int32 buffer (atomic max; bit
     patterns of non-negative floats are ordered as their values).
   - ``"bound"``, ``gmax``: reads the gradient and the two moments' E4M3 scales only, and folds each
     program's max of |g| and of the scale bytes into the buffer the same way (E4M3 bytes of
     non-negative values are ordered too). XLA then forms ``_common.amax_bounds`` from them and the
     old global scales. On the H200 it was no faster than ``stats`` (benchmarks/RESULTS.md).
2. XLA, once for all leaves: ``S_enc`` and ``S_dec`` from those amaxes in Transformer Engine's order
   (``fp4jax.nvfp4.global_decode_scale``).
3. ``encode``: compute the new moments (the same code and bits as ``stats``), write the update
   ``u``, then per 16-element block the E4M3 scale and ``1 / (dscale * S_dec)`` once, and the E2M1
   codes, written over the old state in place (``input_output_aliases``: a jit that donates the
   state copies nothing).

Per parameter (float32 gradient) that is about 5.1 bytes read by ``stats`` (4.1 by ``gmax``), then
5.1 read and 5.1 written by ``encode``, where ``optax.adamw`` reads 12 and writes 12 (plus the weight
decay and ``apply_updates`` that both leave to XLA). On the H200 ``encode`` is bound by instruction
issue (the ALU pipe: integer, logic, compare and select instructions), not by memory; its code is
written for few instructions per element: one counter hash per pair of elements serves four roundings
(``_common.counter_bits``), stochastic rounding adds random bits to the float's pattern
(``nvfp4._e2m1_stochastic_code``), √v serves both the stored state and the update's denominator,
and codes are handled as 32-bit integers (benchmarks/RESULTS.md).

Bits: the kernels call the functions of the XLA path (``fp4jax.nvfp4``, ``fp4jax._fp32``,
``fp4jax.optim._common``): products rounded before each addition (no FMA contraction; PTX
``mul.rn.f32`` on the GPU, ``_common.rounded`` in interpret mode), the same E4M3
and E2M1 rounding, the same counter hash for the stochastic rounding bits. The two correctly rounded
operations that the XLA path builds from integers (``_fp32.div_rn`` for ``1 / (dscale * S_dec)``,
``_fp32.sqrt_rn`` for √v) are PTX's ``div.rn.f32`` and ``sqrt.rn.f32`` on the GPU (IEEE, the same
values), and in interpret mode the CPU's IEEE division and ``_fp32.sqrt_rn``. The stored state
therefore equals the XLA path's bit for bit (tests in interpret mode on the CPU;
``tests/gpu/check_optim.py`` on the H200). ``u`` uses the backend's float32 division like the XLA
path, so it may differ from it in the last bits.

Layout: a leaf of ``n`` elements is viewed as ``(n / 16, 8, 2)``; a program takes ``block_rows``
16-element blocks and works on the even and odd elements of each block as two (rows, 8) tiles: that
is how the packed codes hold them (even element in the low nibble), so codes are packed and unpacked
without shuffles. ``stats`` loads the gradient as one contiguous (rows, 8, 2) tile split in registers;
``encode`` reads the two halves with strided loads and stores ``u`` the same way (see ``_halves``;
``join_u``). The last program masks rows past the end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax import _fp32, nvfp4
from fp4jax.kernels._util import next_pow2, store
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor
from fp4jax.optim import _common

BLOCK_ROWS = 64  # default 16-element blocks per program of `encode`
NUM_WARPS = 4  # default Triton warps per program of `encode`
STATS_BLOCK_ROWS = 64
STATS_NUM_WARPS = 4
JOIN_U = False  # default `join_u` of `update_leaves`
# Copies of each max that the first pass's programs fold into (program i into copy i % ATOMIC_SLOTS),
# reduced by XLA afterwards. Atomics on one address are serialized, and the H200's first pass over
# the embedding (37,728 programs, 2-3 atomics each) took longer than reading its bytes
# (benchmarks/RESULTS.md, session 7). 1 (one address per max) is the configuration checked on the
# H200; more is an experiment (`benchmarks/optim_update.py --atomic-slots`), checked on the CPU only.
ATOMIC_SLOTS = 1
# Int32 entries between neighbouring copies (32: one 128-byte cache line per copy, so copies do not
# share an L2 line).
SLOT_STRIDE = 1
STATS_ROWS16 = True
STATS_CHUNK_ROWS = 64
_HALF = BLOCK // 2
_INT_HEAD = 8  # the int table: [runtime zero, pad...], then 2 key words per leaf
_F32_HEAD = 8  # the float table: [the 4 `_common.bias_factors`, bound, pad...], then per leaf the
# old global scales of m and √v


@dataclasses.dataclass(frozen=True)
class AdamHyper:
  """The static part of one update: Adam's constants and the rounding of each moment."""

  b1: float
  b2: float
  eps: float
  eps_root: float
  nesterov: bool
  clip_update: bool
  mu_rounding: str
  nu_rounding: str
  amax: str = "exact"  # the global scales' rule (scale_by_adam_nvfp4's `amax`)


def supports(mu) -> bool:
  """Whether a stored moment can take the kernels: NVFP4, 1×16 blocks along the last axis."""
  return (_common.is_nvfp4(mu) and mu.block == (1, BLOCK) and mu.axis == len(mu.shape) - 1
          and mu.size < 2**31)


def _pad_pow2(x):
  x = x.reshape(-1)
  return jnp.pad(x, (0, next_pow2(x.size) - x.size))


# ----------------------------------------------------------------------------------------------
# The kernels


def _ptx(op, *args):
  """A correctly rounded float32 PTX instruction, elementwise (Triton's ``/`` and ``sqrt`` are not)."""
  args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), args[-1].shape) for a in args]
  operands = ", ".join(f"${i + 1}" for i in range(len(args)))
  return plgpu.elementwise_inline_asm(
      f"{op} $0, {operands};", args=args, constraints=",".join(["=f"] + ["f"] * len(args)),
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]


def _recip_rn(x, interpret):
  """IEEE ``1 / x``: PTX ``div.rn.f32`` on the GPU; the CPU's division (IEEE) in interpret mode, where
  ``_fp32.div_rn`` on vectors made XLA:CPU compile for minutes. Both equal ``_fp32.div_rn`` for the
  normal ``x`` they get (``1 / (dscale * S_dec)`` with a normal tensor amax)."""
  return jnp.float32(1.0) / x if interpret else _ptx("div.rn.f32", 1.0, x)


def _mul_rn(interpret):
  """The moments' products (``_common.rounded_ema``'s ``mul``): PTX ``mul.rn.f32`` on the GPU, which
  ptxas never fuses into an addition: one instruction, where ``rounded`` adds an integer operation
  per product on the ALU pipe that bounds ``encode``. None (``rounded``) in interpret mode."""
  return None if interpret else lambda a, b: _ptx("mul.rn.f32", a, b)


def _sqrt_rn(x, interpret):
  """IEEE ``sqrt``: PTX ``sqrt.rn.f32`` on the GPU (subnormals included), ``_fp32.sqrt_rn`` in
  interpret mode: the same bits."""
  return _fp32.sqrt_rn(x) if interpret else _ptx("sqrt.rn.f32", x)


def _rows_ok(nb, br, shape):
  """Rows of this program inside the leaf, or None when every program is full."""
  if nb % br == 0:
    return None
  return pl.program_id(0) * br + lax.broadcasted_iota(jnp.int32, shape, 0) < nb


def _load(ref, ok):
  if ok is None:
    return ref[...]
  if ref.dtype == jnp.float8_e4m3fn:  # Triton cannot cast an `other` to f8: zero the bytes after
    return lax.bitcast_convert_type(
        jnp.where(ok, _f8_bytes(plgpu.load(ref, mask=ok)), jnp.uint8(0)), jnp.float8_e4m3fn)
  return plgpu.load(ref, mask=ok, other=0)


def _halves(ref, ok2, ok3, split):
  """The even and odd elements of each 16-element block row of ``ref`` (rows, 8, 2).

  ``split``: one contiguous load split in registers (Triton's ``split``; ``stats`` ran 13% faster on
  the H200), else two strided loads (``encode``, whose other tiles have a layout that made the split
  cost more than it saved: +33%)."""
  if split:
    return jnp.unstack(_load(ref, ok3), axis=-1)
  return [_load(ref.at[:, :, jnp.int32(h)], ok2) for h in range(2)]


def _f8_bytes(x):
  return lax.bitcast_convert_type(x, jnp.uint8)


def _moments(hp, zero, f_ref, leaf, gs, mc_ref, ms_ref, vc_ref, vs_ref, ok1, ok2, interpret):
  """Per half h of the gradient's halves ``gs``: (g, m, v) in float32, (rows, 8) each
  (``_common.adam_moments``). With one ``gs`` of (rows, 16), the whole rows: (g, m, v) of (rows,
  16)."""
  # Codes widened once: 32-bit integer arithmetic from here (bytes cost the GPU byte permutes).
  mcode, vcode = (_load(r, ok2).astype(jnp.int32) for r in (mc_ref, vc_ref))
  if len(gs) == 1:  # each byte's two nibbles side by side: element order
    mcode, vcode = (jnp.stack([c, c >> 4], axis=-1).reshape(c.shape[0], BLOCK)
                    for c in (mcode, vcode))
  mscale = _fp32.e4m3_to_f32(_f8_bytes(_load(ms_ref, ok1)))[:, None]
  vscale = _fp32.e4m3_to_f32(_f8_bytes(_load(vs_ref, ok1)))[:, None]
  mg, vg = f_ref[_F32_HEAD + 2 * leaf], f_ref[_F32_HEAD + 2 * leaf + 1]
  out = []
  for h, g in enumerate(gs):
    shift = 4 * h
    g = g.astype(jnp.float32)
    # NVFP4Tensor.dequantize's products, in its order.
    m_old = (nvfp4._decode_e2m1((mcode >> shift) & 0xF) * mscale) * mg
    s_old = (nvfp4._decode_e2m1((vcode >> shift) & 0xF) * vscale) * vg
    v_old = s_old * s_old  # the "sqrt" transform's from_stored
    m, v = _common.adam_moments(m_old, v_old, g, hp.b1, hp.b2, zero, _mul_rn(interpret))
    out.append((g, m, v))
  return out


def _max2d(x):
  # One axis at a time: a full reduction failed to lower to Triton (a 2-D sharding on the scalar).
  return jnp.max(jnp.max(x, axis=1), axis=0)


def _stats_kernel(i_ref, f_ref, a_in, g_ref, mc_ref, ms_ref, vc_ref, vs_ref, a_ref, *,
                  hp: AdamHyper, nb: int, leaf: int, chunk: int, interpret: bool):
  del a_in  # the same buffer as a_ref (aliased)
  br = g_ref.shape[0]

  def abs_moments(rows, ok1, ok2, ok3):
    """|m| and v of the new moments on ``rows`` of this program's blocks: the elementwise max of the
    halves, or the (rows, 16) tiles."""
    ref = lambda r: r if rows is None else r.at[rows]  # noqa: E731
    g = ref(g_ref)
    gs = [_load(g, ok3)] if len(g.shape) == 2 else _halves(g, ok2, ok3, split=True)
    abs_m, abs_v = [], []
    for _, m, v in _moments(hp, i_ref[0], f_ref, leaf, gs, ref(mc_ref), ref(ms_ref), ref(vc_ref),
                            ref(vs_ref), ok1, ok2, interpret):
      # The encoder's amax (nvfp4.quantize): subnormals flushed, NaN counted as inf. Rows past the
      # end loaded as zeros, which leave the max alone.
      am = _fp32.flush_subnormals(m)
      abs_m.append(jnp.where(jnp.isnan(am), jnp.inf, jnp.abs(am)))
      abs_v.append(jnp.where(jnp.isnan(v), jnp.inf, jnp.abs(v)))
    return functools.reduce(jnp.maximum, abs_m), functools.reduce(jnp.maximum, abs_v)

  g_shape = (g_ref.shape[1:])
  if chunk >= br:
    am, av = abs_moments(None, *(_rows_ok(nb, br, (br, *s)) for s in ((), (_HALF,), g_shape)))
  else:
    # Chunks of `chunk` rows, the maxes carried elementwise: one cross-warp reduction per program.
    first_row = pl.program_id(0) * br  # (outside the loop: interpret mode needs it there)

    def body(k, carry):
      row0 = first_row + k * chunk
      oks = [None if nb % br == 0 else
             row0 + lax.broadcasted_iota(jnp.int32, (chunk, *s), 0) < nb
             for s in ((), (_HALF,), g_shape)]
      am, av = abs_moments(pl.ds(k * chunk, chunk), *oks)
      return jnp.maximum(carry[0], am), jnp.maximum(carry[1], av)
    zeros = jnp.zeros((chunk, *g_shape[:1]), jnp.float32)
    am, av = lax.fori_loop(0, br // chunk, body, (zeros, zeros))
  # One cross-warp reduction (shared memory and barriers, which stalled the kernel) per moment and
  # program.
  amax_m, amax_v = _max2d(am), _max2d(av)
  # max(sqrt_rn(v)) = sqrt_rn(max(v)): sqrt_rn is monotone, and its results are never subnormal.
  amax_s = _sqrt_rn(jnp.full((1,), amax_v, jnp.float32), interpret)
  # Into the leaf's two entries of the amax buffer: the int32 max of the bit patterns is the
  # float max for values >= 0 (+inf included), and the buffer starts at 0.
  # Scalar values: for a (1,)-shaped int32 value the atomic's Triton lowering takes its float path.
  for j, amax in enumerate((amax_m, jnp.max(amax_s))):
    plgpu.atomic_max(a_ref, _slot(2 * leaf + j), lax.bitcast_convert_type(amax, jnp.int32))


def _slot(k):
  """This program's entry of the first pass's buffer for max number ``k`` (``ATOMIC_SLOTS`` copies)."""
  if ATOMIC_SLOTS == 1:
    return jnp.int32(k * SLOT_STRIDE)
  return (jnp.int32(k * ATOMIC_SLOTS) + pl.program_id(0) % ATOMIC_SLOTS) * SLOT_STRIDE


def _slot_max(buf, n):
  """The first ``n`` maxes of a first-pass buffer: each the max of its ``ATOMIC_SLOTS`` copies."""
  copies = buf[:n * ATOMIC_SLOTS * SLOT_STRIDE].reshape(n, ATOMIC_SLOTS, SLOT_STRIDE)[:, :, 0]
  return copies[:, 0] if ATOMIC_SLOTS == 1 else jnp.max(copies, axis=1)


def _gmax_kernel(g_ref, ms_ref, vs_ref, a_in, a_ref, *, nb: int, leaf: int):
  """``amax="bound"``'s pass: the program's max of |g| (``_common.max_abs``: the integer max of the
  magnitudes' bit patterns) and of m's and √v's E4M3 scale bytes, atomically maxed into the leaf's
  slots 0, 1, 2 of the int32 buffer (which starts at 0)."""
  del a_in  # the same buffer as a_ref (aliased)
  br = g_ref.shape[0]
  ok1, ok2, ok3 = (_rows_ok(nb, br, s) for s in ((br,), (br, _HALF), (br, _HALF, 2)))
  halves = [lax.bitcast_convert_type(h.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
            for h in _halves(g_ref, ok2, ok3, split=True)]
  maxes = [_max2d(jnp.maximum(*halves))]
  for r in (ms_ref, vs_ref):
    maxes.append(jnp.max(_f8_bytes(_load(r, ok1)).astype(jnp.int32)))
  for j, x in enumerate(maxes):
    plgpu.atomic_max(a_ref, _slot(4 * leaf + j), x)


def _encode_halves(xs, mconst, s_dec, finite, rounding, bits, interpret):
  """NVFP4 codes of one moment given as its two (rows, 8) halves: ``nvfp4.quantize``'s steps with the
  tensor's ``S_enc / 6`` (``mconst``) and ``S_dec`` known; ``bits``: each half's rounding bits (or
  None for nearest rounding). Returns (packed, scale codes)."""
  xs = [_fp32.flush_subnormals(x) for x in xs]
  # No NaN test (quantize maps NaN to inf here): a NaN makes the tensor non-finite, and then every
  # block is zeroed below whatever its max.
  block_amax = jnp.maximum(jnp.max(jnp.abs(xs[0]), axis=1), jnp.max(jnp.abs(xs[1]), axis=1))
  block_amax = jnp.where(finite, block_amax, 0.0)
  dscale, dcode = nvfp4._scale_codes(block_amax, mconst)
  # quantize's table entry for this block's scale byte: 1 / (e4m3(code) * S_dec).
  escale = jnp.minimum(_recip_rn(_fp32.e4m3_to_f32(dcode) * s_dec, interpret),
                       _fp32.F32_MAX)[:, None]
  zero_block = ((dscale == 0) | ~finite)[:, None]
  codes = [nvfp4._element_codes(x, escale, zero_block, rounding, b, jnp.int32)
           for x, b in zip(xs, bits or (None, None))]
  return (codes[0] | (codes[1] << 4)).astype(jnp.uint8), dcode


def _encode_kernel(i_ref, f_ref, t_ref, g_ref, mc_ref, ms_ref, mg_ref, vc_ref, vs_ref, vg_ref,
                   u_out, mc_out, ms_out, mg_out, vc_out, vs_out, vg_out, *, hp: AdamHyper, nb: int,
                   leaf: int, join_u: bool, interpret: bool):
  br = g_ref.shape[0]
  ok1, ok2, ok3 = (_rows_ok(nb, br, s) for s in ((br,), (br, _HALF), (br, _HALF, 2)))
  zero = i_ref[0]
  factors, bound = tuple(f_ref[k] for k in range(4)), f_ref[4]
  del mg_ref, vg_ref  # the old global scales' buffers, aliased to mg_out and vg_out; read from f_ref
  halves = _moments(hp, zero, f_ref, leaf, _halves(g_ref, ok2, None, split=False), mc_ref, ms_ref,
                    vc_ref, vs_ref, ok1, ok2, interpret)
  roots = [_sqrt_rn(v, interpret) for _, _, v in halves]  # √v: stored, and the update's root
  us = [_common.adam_direction(m, v, s, g, factors, hp.b1, hp.eps, hp.eps_root, hp.nesterov,
                               bound if hp.clip_update else None).astype(u_out.dtype)
        for (g, m, v), s in zip(halves, roots)]
  if join_u:
    store(u_out, jnp.stack(us, axis=-1), ok3)
  else:
    for h, u in enumerate(us):
      store(u_out.at[:, :, jnp.int32(h)], u, ok2)
  pair_hash = None
  if "stochastic" in (hp.mu_rounding, hp.nu_rounding):
    # _common.counter_bits: one hash per (block row, column), i.e. per pair of neighbouring
    # elements, whose four bytes round m's and √v's even and odd elements.
    row0 = (pl.program_id(0) * br).astype(jnp.uint32)
    pairs = ((lax.broadcasted_iota(jnp.uint32, (br, _HALF), 0) + row0) * _HALF
             + lax.broadcasted_iota(jnp.uint32, (br, _HALF), 1))
    k = _INT_HEAD + 2 * leaf
    pair_hash = _common.counter_hash(pairs, lax.bitcast_convert_type(i_ref[k], jnp.uint32),
                                     lax.bitcast_convert_type(i_ref[k + 1], jnp.uint32))
  outs = ((mc_out, ms_out, mg_out), (vc_out, vs_out, vg_out))
  for j, (rounding, (c_out, s_out, g_out)) in enumerate(
      zip((hp.mu_rounding, hp.nu_rounding), outs)):
    t = 4 * (2 * leaf + j)  # [S_enc / 6, S_dec, finite, pad] of this moment
    mconst, s_dec, finite = t_ref[t], t_ref[t + 1], t_ref[t + 2] > 0
    bits = None
    if rounding == "stochastic":
      bits = [_common.lane_bits(pair_hash, 2 * j + h) for h in range(2)]
    xs = [m for _, m, _ in halves] if j == 0 else roots
    packed, dcode = _encode_halves(xs, mconst, s_dec, finite, rounding, bits, interpret)
    store(c_out, packed, ok2)
    store(s_out, lax.bitcast_convert_type(dcode, jnp.float8_e4m3fn), ok1)
    g_out[...] = jnp.full((1,), s_dec, jnp.float32)  # every program writes the same value


# ----------------------------------------------------------------------------------------------
# The update of a list of leaves


def _key_words(key, leaf_ids):
  """Per leaf, the ``counter_words`` of its key (int32, (L, 2)), as the XLA path keys the leaf
  (``fold_in(key, leaf)``; m and √v are its lanes 0 and 1)."""
  def words(i):
    return jnp.stack(_common.counter_words(jax.random.fold_in(key, i)))
  w = jax.vmap(words)(jnp.asarray(leaf_ids, jnp.uint32))
  return lax.bitcast_convert_type(w, jnp.int32)


def update_leaves(grads, mus, nus, leaf_ids, key, hp: AdamHyper, bias_factors, bound, zero,
                  *, block_rows: int | None = None, num_warps: int | None = None,
                  stats_block_rows: int | None = None, stats_num_warps: int | None = None,
                  join_u: bool | None = None, interpret: bool = False):
  """The kernels' AdamW update of NVFP4 leaves (``supports(mu)`` true for each).

  Args:
    grads: gradient leaves (float32 or bfloat16).
    mus, nus: their stored m and √v (``NVFP4Tensor``, 1×16 blocks along the last axis).
    leaf_ids: each leaf's index in the tree, which keys its rounding bits as in the XLA path.
    key: the step's key (``_common.step_key``), or None for nearest rounding of both moments.
    hp: constants and roundings.
    bias_factors: ``_common.bias_factors`` of the step (``_common.adam_direction``).
    bound: the update clip bound (float32 scalar), or None (``hp.clip_update`` False).
    zero: ``_common.runtime_zero`` of the step count (``_common.adam_moments``).
    block_rows: 16-element blocks per program of ``encode``, a power of two (default
      ``BLOCK_ROWS``).
    num_warps: Triton warps per program of ``encode`` (default ``NUM_WARPS``).
    stats_block_rows, stats_num_warps: the same for ``stats`` (defaults ``STATS_BLOCK_ROWS``,
      ``STATS_NUM_WARPS``).
    join_u: ``encode`` joins the update's two halves in registers for one contiguous store, instead
      of two strided stores (default ``JOIN_U``).
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    Lists ``(u, mu_new, nu_new)``: updates in the gradients' dtypes and the new stored moments.
  """
  if not grads:
    return [], [], []
  block_rows = BLOCK_ROWS if block_rows is None else block_rows
  num_warps = NUM_WARPS if num_warps is None else num_warps
  stats_rows = STATS_BLOCK_ROWS if stats_block_rows is None else stats_block_rows
  stats_warps = STATS_NUM_WARPS if stats_num_warps is None else stats_num_warps
  join_u = JOIN_U if join_u is None else join_u
  for name, rows in (("block_rows", block_rows), ("stats_block_rows", stats_rows)):
    if rows < 1 or rows & (rows - 1):
      raise ValueError(f"{name} must be a power of two, got {rows!r}")
  ints = [jnp.broadcast_to(zero, (1,)), jnp.zeros((_INT_HEAD - 1,), jnp.int32)]
  if key is not None:
    ints.append(_key_words(key, leaf_ids).reshape(-1))
  ints = _pad_pow2(jnp.concatenate(ints))
  floats = jnp.stack([*bias_factors, jnp.float32(0) if bound is None else bound]
                     ).astype(jnp.float32)
  old_scales = jnp.stack([t.global_scale.astype(jnp.float32) for pair in zip(mus, nus)
                          for t in pair])
  floats = _pad_pow2(jnp.concatenate([floats, jnp.zeros((_F32_HEAD - 5,), jnp.float32),
                                      old_scales]))

  if hp.amax == "bound":
    amax = _bound_amaxes(grads, mus, nus, old_scales, hp, zero, stats_rows, stats_warps, interpret)
  else:
    amax = _exact_amaxes(grads, mus, nus, hp, ints, floats, stats_rows, stats_warps, interpret)
  # S_enc and S_dec of all leaves at once, as nvfp4.quantize computes them.
  finite = amax <= _fp32.F32_MAX
  s_enc, s_dec = nvfp4.global_decode_scale(jnp.where(finite, amax, 0.0))
  s_dec = jnp.where(finite, s_dec, jnp.nan)
  table = jnp.stack([s_enc * jnp.float32(nvfp4._INV6), s_dec, finite.astype(jnp.float32),
                     jnp.zeros_like(s_enc)], axis=-1)  # (L, 2, 4)
  table = _pad_pow2(table)

  us, mus_new, nus_new = [], [], []
  for i, (g, mu, nu) in enumerate(zip(grads, mus, nus)):
    nb, g2, state = _views(g, mu, nu)
    br = min(block_rows, next_pow2(nb))
    n_prog = pl.cdiv(nb, br)
    codes, scales = (jax.ShapeDtypeStruct((nb, _HALF), jnp.uint8),
                     jax.ShapeDtypeStruct((nb,), jnp.float8_e4m3fn))
    one = jax.ShapeDtypeStruct((1,), jnp.float32)
    u2, mc, ms, mg, vc, vs, vg = pl.pallas_call(
        functools.partial(_encode_kernel, hp=hp, nb=nb, leaf=i, join_u=join_u,
                          interpret=interpret),
        grid=(n_prog,),
        in_specs=[_whole(ints), _whole(floats), _whole(table), _spec(g2.shape, br)]
        + [_spec_of(x, br) for x in state],
        out_specs=[_spec(g2.shape, br)]
        + [_spec(codes.shape, br), _spec(scales.shape, br), _SCALAR] * 2,
        out_shape=[jax.ShapeDtypeStruct(g2.shape, g.dtype)] + [codes, scales, one] * 2,
        # The new state overwrites the old in place (each program reads its own blocks before
        # writing them; the old global scales come from `floats`), so a jit that donates the state
        # copies nothing.
        input_output_aliases={4 + k: 1 + k for k in range(6)},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="adam_nvfp4_encode",
    )(ints, floats, table, g2, *state)
    us.append(u2.reshape(g.shape))
    mus_new.append(_rebuild(mu, mc, ms, mg))
    nus_new.append(_rebuild(nu, vc, vs, vg))
  return us, mus_new, nus_new


def _exact_amaxes(grads, mus, nus, hp, ints, floats, rows, warps, interpret):
  """(L, 2) float32: each leaf's amax of the new m and √v, from the ``stats`` kernels."""
  # As float32 bit patterns, maxed in by the stats programs. One buffer for all leaves, so the
  # stats kernels run one after the other (one buffer per leaf, which lets them overlap, measured
  # slower on the H200: benchmarks/RESULTS.md).
  amax_bits = jnp.zeros((next_pow2(2 * len(grads) * ATOMIC_SLOTS * SLOT_STRIDE),), jnp.int32)
  for i, (g, mu, nu) in enumerate(zip(grads, mus, nus)):
    nb, g2, state = _views(g, mu, nu)
    if STATS_ROWS16:
      g2 = g2.reshape(nb, BLOCK)
    br = min(rows, next_pow2(nb))
    amax_bits = pl.pallas_call(
        functools.partial(_stats_kernel, hp=hp, nb=nb, leaf=i, chunk=min(STATS_CHUNK_ROWS, br),
                          interpret=interpret),
        grid=(pl.cdiv(nb, br),),
        in_specs=[_whole(ints), _whole(floats), _whole(amax_bits), _spec(g2.shape, br)]
        + [_spec_of(x, br) for k, x in enumerate(state) if k % 3 != 2],
        out_specs=_whole(amax_bits),
        out_shape=jax.ShapeDtypeStruct(amax_bits.shape, jnp.int32),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=warps), interpret=interpret,
        name="adam_nvfp4_stats",
    )(ints, floats, amax_bits, g2, *(x for k, x in enumerate(state) if k % 3 != 2))
  return lax.bitcast_convert_type(_slot_max(amax_bits, 2 * len(grads)), jnp.float32).reshape(-1, 2)


def _bound_amaxes(grads, mus, nus, old_scales, hp, zero, rows, warps, interpret):
  """(L, 2) float32: each leaf's ``_common.amax_bounds`` of m and √v, from the ``gmax`` kernels and
  the old global scales ``old_scales`` ((2L,): m, √v per leaf): the XLA path's values
  (``_common.largest_stored``, ``max_abs``)."""
  maxes = jnp.zeros((next_pow2(4 * len(grads) * ATOMIC_SLOTS * SLOT_STRIDE),), jnp.int32)
  for i, (g, mu, nu) in enumerate(zip(grads, mus, nus)):
    nb, g2, _ = _views(g, mu, nu)
    br = min(rows, next_pow2(nb))
    scales = [t.scales.reshape(nb) for t in (mu, nu)]
    maxes = pl.pallas_call(
        functools.partial(_gmax_kernel, nb=nb, leaf=i),
        grid=(pl.cdiv(nb, br),),
        in_specs=[_spec(g2.shape, br), _spec((nb,), br), _spec((nb,), br), _whole(maxes)],
        out_specs=_whole(maxes),
        out_shape=jax.ShapeDtypeStruct(maxes.shape, jnp.int32),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=warps), interpret=interpret,
        name="adam_nvfp4_gmax",
    )(g2, *scales, maxes)
  maxes = _slot_max(maxes, 4 * len(grads)).reshape(-1, 4)
  g_max = lax.bitcast_convert_type(maxes[:, 0], jnp.float32)
  old = old_scales.reshape(-1, 2)
  m_max, s_max = (_common.largest_from_scale(maxes[:, 1 + j], old[:, j]) for j in range(2))
  m_amax, v_amax = _common.amax_bounds(g_max, m_max, s_max * s_max, hp.b1, hp.b2, zero)
  return jnp.stack([m_amax, _fp32.sqrt_rn(v_amax)], axis=-1)


def _spec(shape, br):
  """Blocks of ``br`` rows of an array of ``shape``, program i taking block i."""
  if len(shape) == 1:
    return pl.BlockSpec((br,), lambda i: (i,))
  return pl.BlockSpec((br, *shape[1:]), lambda i: (i,) + (0,) * (len(shape) - 1))


def _whole(x):
  """All of a 1-D ``x`` in every program."""
  return pl.BlockSpec(x.shape, lambda i: (0,))


_SCALAR = pl.BlockSpec((1,), lambda i: (0,))


def _spec_of(x, br):
  return _spec(x.shape, br) if x.shape != (1,) else _SCALAR


def _views(g, mu, nu):
  """A leaf as the kernels see it: blocks ``nb``, the gradient (nb, 8, 2), and per moment its codes
  (nb, 8), scales (nb,) and global scale (1,)."""
  nb = g.size // BLOCK
  state = []
  for t in (mu, nu):
    state += [t.codes.reshape(nb, _HALF), t.scales.reshape(nb), t.global_scale.reshape(1)]
  return nb, g.reshape(nb, _HALF, 2), state


def _rebuild(t: NVFP4Tensor, codes, scales, global_scale) -> NVFP4Tensor:
  return NVFP4Tensor(codes=codes.reshape(t.codes.shape),
                     scales=scales.reshape(t.scales.shape),
                     global_scale=global_scale.reshape(()), shape=t.shape, block=t.block,
                     axis=t.axis, dtype=t.dtype)

