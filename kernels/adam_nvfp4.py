"""The AdamW update of NVFP4 moments in two Pallas (Triton) kernels.

``fp4jax.optim.scale_by_adam_nvfp4`` updates a leaf by decoding its moments, running Adam's float32
arithmetic and re-encoding m and √v as NVFP4 (1×16 blocks along the last axis). Encoding needs each
new moment's tensor amax (or a bound of it) before any code is written, so the XLA program makes
several passes and, grouping leaves of one shape under ``vmap``, copies stacks of them. Here each
leaf takes two kernels, with one small XLA step for all leaves (leaves of one size share each
kernel's launches, ``LAUNCH_GROUP`` at a time, see below):

1. A first pass, by the ``amax`` rule:
   - ``"exact"`` (default), ``stats``: decodes m and √v, computes the new moments, and folds each
     program's max of |m| and of √v into the leaf's slots of one int32 buffer (atomic max; bit
     patterns of non-negative floats are ordered as their values), spread over ``ATOMIC_SLOTS``
     copies of each slot that XLA reduces afterwards.
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

Shared launches: the leaves of one size and dtype (a Transformer's layers) go to each kernel
``LAUNCH_GROUP`` at a time, in one grid whose programs ``[j * n_prog, (j + 1) * n_prog)`` run the
kernel's body on leaf j's operands (a ``pl.when`` branch per leaf; other leaves' block specs clamp to
a block they never touch). A launch cost ~3 us of ramp-up and tail on the H200 whatever its size, ~0.3
ms over the ~100 launches of a 124M GPT-2 update; sharing them four at a time took the update from
1.82 to 1.64 ms (benchmarks/RESULTS.md, session 8). With them, the first pass's atomics became a
cost: spreading them over 64 copies per max, 128-block ``stats`` programs and L2 eviction hints in
``encode`` took it to 1.56 ms, 1.44× ``optax.adamw`` (session 9). Larger groups were no faster
(XLA's apply of the updates got slower, likely because they leave L2 before it reads them) and
compile longer (a copy of the body per leaf).

Layout: a leaf of ``n`` elements is viewed as ``(n / 16, 8, 2)``; a program takes ``block_rows``
16-element blocks and works on the even and odd elements of each block as two (rows, 8) tiles: that
is how the packed codes hold them (even element in the low nibble), so codes are packed and unpacked
without shuffles. ``stats`` loads the gradient as one contiguous (rows, 8, 2) tile split in registers;
``encode`` reads the two halves with strided loads and stores ``u`` the same way (see ``_halves``; a
joined contiguous store of ``u`` measured the same on the H200, session 7). The last program masks
rows past the end.
"""

from __future__ import annotations

import contextlib
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
# The same for `stats`: with ATOMIC_SLOTS=64 on the H200, 128 blocks took it from 0.347 to 0.310 ms
# (32: 0.431, 256: 0.390; session 9).
STATS_BLOCK_ROWS = 128
STATS_NUM_WARPS = 4
# Copies of each max that the first pass's programs fold into (program i of a leaf into copy
# i % ATOMIC_SLOTS), reduced by XLA afterwards, against atomics serialized on one address. On the H200
# (124M GPT-2 tree) 64 copies took `stats` from 0.382 to 0.347 ms with shared launches (session 9;
# from 0.480 to 0.466 with a launch per leaf, session 8). 1: one address per max.
ATOMIC_SLOTS = 64
# Leaves of one size that share a launch of each kernel (see the module docstring); 1: a launch per
# leaf. On the H200 (124M GPT-2 tree, device busy per update, session 8's other settings): 1: 1.823
# ms, 2: 1.677, 3: 1.653, 4: 1.643-1.646, 12: 1.651, 24: 1.687 (and 124 s to compile); with eviction
# hints (session 9), 2: 1.668 against 4: 1.626.
LAUNCH_GROUP = 4
# L2 eviction hints in `encode`: its loads evict first, its update's stores last (XLA's apply reads
# the update next; in the profile each launch's apply fusions run right after it). On the H200 XLA's
# apply took 0.555 against 0.571 ms, the update 1.626 against 1.640 ms (session 9). 0: no hints.
EVICT_HINTS = 1
# The launch settings above, which benchmarks and GPU checks set per run (`parse_settings`).
SETTINGS = ("BLOCK_ROWS", "NUM_WARPS", "STATS_BLOCK_ROWS", "STATS_NUM_WARPS", "ATOMIC_SLOTS",
            "LAUNCH_GROUP", "EVICT_HINTS")
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


def parse_settings(text: str) -> dict[str, int]:
  """``"NAME=V[+NAME=V]"`` (names of ``SETTINGS``, integer values) as a dict; ValueError naming the
  bad item otherwise."""
  out = {}
  for item in text.split("+"):
    key, _, value = item.partition("=")
    if key not in SETTINGS or not value.isdigit():
      raise ValueError(f"{item!r} is not NAME=INT with NAME one of {SETTINGS}")
    out[key] = int(value)
  return out


@contextlib.contextmanager
def settings(**values):
  """Sets launch settings (``SETTINGS``) for the kernels traced inside the block, then restores them."""
  unknown = sorted(set(values) - set(SETTINGS))
  if unknown:
    raise ValueError(f"unknown kernel settings {unknown}; known: {SETTINGS}")
  old = {k: globals()[k] for k in values}
  globals().update(values)
  try:
    yield
  finally:
    globals().update(old)


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


def _rows_ok(nb, br, shape, pid):
  """Rows of program ``pid`` (of its leaf) inside the leaf, or None when every program is full."""
  if nb % br == 0:
    return None
  return pid * br + lax.broadcasted_iota(jnp.int32, shape, 0) < nb


def _each_leaf(n_prog, n_leaves, body):
  """Runs ``body(j, pid)`` for the leaf j whose programs contain this one (leaf j owns the programs
  ``[j * n_prog, (j + 1) * n_prog)``; ``pid`` counts from the first)."""
  pid = pl.program_id(0)
  if n_leaves == 1:
    return body(0, pid)
  j_of, pid_in = pid // n_prog, pid % n_prog
  for j in range(n_leaves):
    pl.when(j_of == j)(functools.partial(body, j, pid_in))


def _load(ref, ok, evict=None):
  """``ref``'s block, zeros where ``ok`` (if not None) is False; ``evict``: an L2 eviction hint."""
  if ok is None:
    return ref[...] if evict is None else plgpu.load(ref, eviction_policy=evict)
  if ref.dtype == jnp.float8_e4m3fn:  # Triton cannot cast an `other` to f8: zero the bytes after
    return lax.bitcast_convert_type(
        jnp.where(ok, _f8_bytes(plgpu.load(ref, mask=ok, eviction_policy=evict)), jnp.uint8(0)),
        jnp.float8_e4m3fn)
  return plgpu.load(ref, mask=ok, other=0, eviction_policy=evict)


def _halves(ref, ok2, ok3, split, evict=None):
  """The even and odd elements of each 16-element block row of ``ref`` (rows, 8, 2).

  ``split``: one contiguous load split in registers (Triton's ``split``; ``stats`` ran 13% faster on
  the H200), else two strided loads (``encode``, whose other tiles have a layout that made the split
  cost more than it saved: +33%)."""
  if split:
    return jnp.unstack(_load(ref, ok3, evict), axis=-1)
  return [_load(ref.at[:, :, jnp.int32(h)], ok2, evict) for h in range(2)]


def _f8_bytes(x):
  return lax.bitcast_convert_type(x, jnp.uint8)


def _moments(hp, zero, f_ref, leaf, gs, mc_ref, ms_ref, vc_ref, vs_ref, ok1, ok2, interpret,
             evict=None):
  """Per half h of the gradient's halves ``gs``: (g, m, v) in float32, (rows, 8) each
  (``_common.adam_moments``)."""
  # Codes widened once: 32-bit integer arithmetic from here (bytes cost the GPU byte permutes).
  mcode, vcode = (_load(r, ok2, evict).astype(jnp.int32) for r in (mc_ref, vc_ref))
  mscale = _fp32.e4m3_to_f32(_f8_bytes(_load(ms_ref, ok1, evict)))[:, None]
  vscale = _fp32.e4m3_to_f32(_f8_bytes(_load(vs_ref, ok1, evict)))[:, None]
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


def _stats_kernel(i_ref, f_ref, a_in, *refs, hp: AdamHyper, nb: int, n_prog: int,
                  leaves: tuple[int, ...], interpret: bool):
  del a_in  # the same buffer as a_ref (aliased)
  *per_leaf, a_ref = refs
  _each_leaf(n_prog, len(leaves), lambda j, pid: _stats_leaf(
      i_ref, f_ref, *per_leaf[5 * j:5 * j + 5], a_ref, hp=hp, nb=nb, leaf=leaves[j], pid=pid,
      interpret=interpret))


def _stats_leaf(i_ref, f_ref, g_ref, mc_ref, ms_ref, vc_ref, vs_ref, a_ref, *, hp: AdamHyper,
                nb: int, leaf: int, pid, interpret: bool):
  br = g_ref.shape[0]
  ok1, ok2, ok3 = (_rows_ok(nb, br, s, pid) for s in ((br,), (br, _HALF), (br, _HALF, 2)))
  abs_m, abs_v = [], []
  for _, m, v in _moments(hp, i_ref[0], f_ref, leaf, _halves(g_ref, ok2, ok3, split=True), mc_ref,
                          ms_ref, vc_ref, vs_ref, ok1, ok2, interpret):
    # The encoder's amax (nvfp4.quantize): subnormals flushed, NaN counted as inf. Rows past the end
    # loaded as zeros, which leave the max alone.
    am = _fp32.flush_subnormals(m)
    abs_m.append(jnp.where(jnp.isnan(am), jnp.inf, jnp.abs(am)))
    abs_v.append(jnp.where(jnp.isnan(v), jnp.inf, jnp.abs(v)))
  # The halves maxed elementwise first: one cross-warp reduction (shared memory and barriers, which
  # stalled the kernel) per moment and program.
  amax_m = _max2d(jnp.maximum(*abs_m))
  amax_v = _max2d(jnp.maximum(*abs_v))
  # max(sqrt_rn(v)) = sqrt_rn(max(v)): sqrt_rn is monotone, and its results are never subnormal.
  amax_s = _sqrt_rn(jnp.full((1,), amax_v, jnp.float32), interpret)
  # Into the leaf's two entries of the amax buffer: the int32 max of the bit patterns is the
  # float max for values >= 0 (+inf included), and the buffer starts at 0.
  # Scalar values: for a (1,)-shaped int32 value the atomic's Triton lowering takes its float path.
  for j, amax in enumerate((amax_m, jnp.max(amax_s))):
    plgpu.atomic_max(a_ref, _slot(2 * leaf + j, pid), lax.bitcast_convert_type(amax, jnp.int32))


def _slot(k, pid):
  """Program ``pid``'s entry of the first pass's buffer for max number ``k`` (``ATOMIC_SLOTS``
  copies)."""
  if ATOMIC_SLOTS == 1:
    return jnp.int32(k)
  return jnp.int32(k * ATOMIC_SLOTS) + pid % ATOMIC_SLOTS


def _slot_max(buf, n):
  """The first ``n`` maxes of a first-pass buffer: each the max of its ``ATOMIC_SLOTS`` copies."""
  if ATOMIC_SLOTS == 1:
    return buf[:n]
  return jnp.max(buf[:n * ATOMIC_SLOTS].reshape(n, ATOMIC_SLOTS), axis=1)


def _gmax_kernel(a_in, *refs, nb: int, n_prog: int, leaves: tuple[int, ...]):
  """``amax="bound"``'s pass: the program's max of |g| (``_common.max_abs``: the integer max of the
  magnitudes' bit patterns) and of m's and √v's E4M3 scale bytes, atomically maxed into the leaf's
  slots 0, 1, 2 of the int32 buffer (which starts at 0)."""
  del a_in  # the same buffer as a_ref (aliased)
  *per_leaf, a_ref = refs
  _each_leaf(n_prog, len(leaves), lambda j, pid: _gmax_leaf(
      *per_leaf[3 * j:3 * j + 3], a_ref, nb=nb, leaf=leaves[j], pid=pid))


def _gmax_leaf(g_ref, ms_ref, vs_ref, a_ref, *, nb: int, leaf: int, pid):
  br = g_ref.shape[0]
  ok1, ok2, ok3 = (_rows_ok(nb, br, s, pid) for s in ((br,), (br, _HALF), (br, _HALF, 2)))
  halves = [lax.bitcast_convert_type(h.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
            for h in _halves(g_ref, ok2, ok3, split=True)]
  maxes = [_max2d(jnp.maximum(*halves))]
  for r in (ms_ref, vs_ref):
    maxes.append(jnp.max(_f8_bytes(_load(r, ok1)).astype(jnp.int32)))
  for j, x in enumerate(maxes):
    plgpu.atomic_max(a_ref, _slot(4 * leaf + j, pid), x)


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


def _encode_kernel(i_ref, f_ref, t_ref, *refs, hp: AdamHyper, nb: int, n_prog: int,
                   leaves: tuple[int, ...], interpret: bool):
  n = len(leaves)
  ins, outs = refs[:7 * n], refs[7 * n:]
  _each_leaf(n_prog, n, lambda j, pid: _encode_leaf(
      i_ref, f_ref, t_ref, *ins[7 * j:7 * j + 7], *outs[7 * j:7 * j + 7], hp=hp, nb=nb,
      leaf=leaves[j], pid=pid, interpret=interpret))


def _encode_leaf(i_ref, f_ref, t_ref, g_ref, mc_ref, ms_ref, mg_ref, vc_ref, vs_ref, vg_ref,
                 u_out, mc_out, ms_out, mg_out, vc_out, vs_out, vg_out, *, hp: AdamHyper, nb: int,
                 leaf: int, pid, interpret: bool):
  br = g_ref.shape[0]
  ok1, ok2 = (_rows_ok(nb, br, s, pid) for s in ((br,), (br, _HALF)))
  zero = i_ref[0]
  factors, bound = tuple(f_ref[k] for k in range(4)), f_ref[4]
  del mg_ref, vg_ref  # the old global scales' buffers, aliased to mg_out and vg_out; read from f_ref
  # EVICT_HINTS: the inputs are read for the last time, the update is read next (by XLA's apply).
  evict_in, evict_u = ("evict_first", "evict_last") if EVICT_HINTS else (None, None)
  halves = _moments(hp, zero, f_ref, leaf, _halves(g_ref, ok2, None, split=False, evict=evict_in),
                    mc_ref, ms_ref, vc_ref, vs_ref, ok1, ok2, interpret, evict_in)
  roots = [_sqrt_rn(v, interpret) for _, _, v in halves]  # √v: stored, and the update's root
  us = [_common.adam_direction(m, v, s, g, factors, hp.b1, hp.eps, hp.eps_root, hp.nesterov,
                               bound if hp.clip_update else None).astype(u_out.dtype)
        for (g, m, v), s in zip(halves, roots)]
  for h, u in enumerate(us):
    store(u_out.at[:, :, jnp.int32(h)], u, ok2, evict_u)
  pair_hash = None
  if "stochastic" in (hp.mu_rounding, hp.nu_rounding):
    # _common.counter_bits: one hash per (block row, column), i.e. per pair of neighbouring
    # elements, whose four bytes round m's and √v's even and odd elements.
    row0 = (pid * br).astype(jnp.uint32)
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
                  interpret: bool = False):
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

  us, mus_new, nus_new = [None] * len(grads), [None] * len(grads), [None] * len(grads)
  for group, nb, br, n_prog, shared in _launches(grads, block_rows):
    codes, scales = (jax.ShapeDtypeStruct((nb, _HALF), jnp.uint8),
                     jax.ShapeDtypeStruct((nb,), jnp.float8_e4m3fn))
    one = jax.ShapeDtypeStruct((1,), jnp.float32)
    operands, in_specs, out_specs, out_shape = [], [], [], []
    for j, i in enumerate(group):
      _, g2, state = _views(grads[i], mus[i], nus[i])
      operands += [g2, *state]
      in_specs += [_spec_of(x, br, j, shared) for x in (g2, *state)]
      out_specs += [_spec_of(x, br, j, shared) for x in (g2, *(codes, scales, one) * 2)]
      out_shape += [jax.ShapeDtypeStruct(g2.shape, grads[i].dtype)] + [codes, scales, one] * 2
    outs = pl.pallas_call(
        functools.partial(_encode_kernel, hp=hp, nb=nb, n_prog=n_prog, leaves=tuple(group),
                          interpret=interpret),
        grid=(n_prog * len(group),),
        in_specs=[_whole(ints), _whole(floats), _whole(table)] + in_specs,
        out_specs=out_specs, out_shape=out_shape,
        # The new state overwrites the old in place (each program reads its own blocks before
        # writing them; the old global scales come from `floats`), so a jit that donates the state
        # copies nothing.
        input_output_aliases={3 + 7 * j + 1 + k: 7 * j + 1 + k
                              for j in range(len(group)) for k in range(6)},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="adam_nvfp4_encode",
    )(ints, floats, table, *operands)
    for j, i in enumerate(group):
      u2, mc, ms, mg, vc, vs, vg = outs[7 * j:7 * j + 7]
      us[i] = u2.reshape(grads[i].shape)
      mus_new[i] = _rebuild(mus[i], mc, ms, mg)
      nus_new[i] = _rebuild(nus[i], vc, vs, vg)
  return us, mus_new, nus_new


def _launches(grads, max_rows):
  """The launches of a kernel: per launch, its leaves (indices; the leaves of one size and dtype, in
  runs of at most ``LAUNCH_GROUP``), their 16-element blocks ``nb``, blocks per program ``br`` (at most
  ``max_rows``), programs per leaf, and the ``n_prog`` of ``_spec`` (None for a leaf alone: plain
  block specs)."""
  by_kind = {}
  for i, g in enumerate(grads):
    by_kind.setdefault((g.size, jnp.dtype(g.dtype)), []).append(i)
  for idx in by_kind.values():
    for k in range(0, len(idx), LAUNCH_GROUP):
      group = idx[k:k + LAUNCH_GROUP]
      nb = grads[group[0]].size // BLOCK
      br = min(max_rows, next_pow2(nb))
      n_prog = pl.cdiv(nb, br)
      yield group, nb, br, n_prog, (n_prog if len(group) > 1 else None)


def _exact_amaxes(grads, mus, nus, hp, ints, floats, rows, warps, interpret):
  """(L, 2) float32: each leaf's amax of the new m and √v, from the ``stats`` kernels."""
  # As float32 bit patterns, maxed in by the stats programs. One buffer for all leaves, so the
  # stats kernels run one after the other (one buffer per leaf, which lets them overlap, measured
  # slower on the H200: benchmarks/RESULTS.md).
  amax_bits = jnp.zeros((next_pow2(2 * len(grads) * ATOMIC_SLOTS),), jnp.int32)
  for group, nb, br, n_prog, shared in _launches(grads, rows):
    operands = []
    for i in group:
      _, g2, state = _views(grads[i], mus[i], nus[i])
      operands += [g2, *(x for k, x in enumerate(state) if k % 3 != 2)]
    amax_bits = pl.pallas_call(
        functools.partial(_stats_kernel, hp=hp, nb=nb, n_prog=n_prog, leaves=tuple(group),
                          interpret=interpret),
        grid=(n_prog * len(group),),
        in_specs=[_whole(ints), _whole(floats), _whole(amax_bits)]
        + [_spec_of(x, br, k // 5, shared) for k, x in enumerate(operands)],
        out_specs=_whole(amax_bits),
        out_shape=jax.ShapeDtypeStruct(amax_bits.shape, jnp.int32),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=warps), interpret=interpret,
        name="adam_nvfp4_stats",
    )(ints, floats, amax_bits, *operands)
  return lax.bitcast_convert_type(_slot_max(amax_bits, 2 * len(grads)), jnp.float32).reshape(-1, 2)


def _bound_amaxes(grads, mus, nus, old_scales, hp, zero, rows, warps, interpret):
  """(L, 2) float32: each leaf's ``_common.amax_bounds`` of m and √v, from the ``gmax`` kernels and
  the old global scales ``old_scales`` ((2L,): m, √v per leaf): the XLA path's values
  (``_common.largest_stored``, ``max_abs``)."""
  maxes = jnp.zeros((next_pow2(4 * len(grads) * ATOMIC_SLOTS),), jnp.int32)
  for group, nb, br, n_prog, shared in _launches(grads, rows):
    operands = []
    for i in group:
      _, g2, _ = _views(grads[i], mus[i], nus[i])
      operands += [g2, mus[i].scales.reshape(nb), nus[i].scales.reshape(nb)]
    maxes = pl.pallas_call(
        functools.partial(_gmax_kernel, nb=nb, n_prog=n_prog, leaves=tuple(group)),
        grid=(n_prog * len(group),),
        in_specs=[_whole(maxes)] + [_spec(x.shape, br, k // 3, shared) for k, x in enumerate(operands)],
        out_specs=_whole(maxes),
        out_shape=jax.ShapeDtypeStruct(maxes.shape, jnp.int32),
        input_output_aliases={0: 0},
        compiler_params=plgpu.CompilerParams(num_warps=warps), interpret=interpret,
        name="adam_nvfp4_gmax",
    )(maxes, *operands)
  maxes = _slot_max(maxes, 4 * len(grads)).reshape(-1, 4)
  g_max = lax.bitcast_convert_type(maxes[:, 0], jnp.float32)
  old = old_scales.reshape(-1, 2)
  m_max, s_max = (_common.largest_from_scale(maxes[:, 1 + j], old[:, j]) for j in range(2))
  m_amax, v_amax = _common.amax_bounds(g_max, m_max, s_max * s_max, hp.b1, hp.b2, zero)
  return jnp.stack([m_amax, _fp32.sqrt_rn(v_amax)], axis=-1)


def _spec(shape, br, j=0, n_prog=None):
  """Blocks of ``br`` rows of an array of ``shape``. Program i takes block i; with ``n_prog``, the
  array is leaf ``j`` of a shared launch and program i takes block ``i - j * n_prog`` (clamped into
  the array: the other leaves' programs do not touch it)."""
  def block(i):
    return i if n_prog is None else jnp.clip(i - j * n_prog, 0, n_prog - 1)
  return pl.BlockSpec((br, *shape[1:]), lambda i: (block(i),) + (0,) * (len(shape) - 1))


def _whole(x):
  """All of a 1-D ``x`` in every program."""
  return pl.BlockSpec(x.shape, lambda i: (0,))


_SCALAR = pl.BlockSpec((1,), lambda i: (0,))


def _spec_of(x, br, j=0, n_prog=None):
  return _spec(x.shape, br, j, n_prog) if x.shape != (1,) else _SCALAR


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

