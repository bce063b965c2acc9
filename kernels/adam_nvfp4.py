"""The AdamW update of NVFP4 moments in two Pallas Triton kernels.

``fp4jax.optim.scale_by_adam_nvfp4`` (``kernel="pallas"``) updates its NVFP4 leaves here, in two
kernels per leaf and one small XLA step for all of them:

1. ``stats``: decodes m and √v, computes the new moments and folds each program's max of |m| and of
   √v into the leaf's entries of one int32 buffer (atomic max of the bit patterns, which order
   non-negative floats as their values), spread over ``atomic_slots`` copies that XLA reduces.
2. XLA: each moment's ``S_enc`` and ``S_dec`` from those amaxes (``nvfp4.global_decode_scale``).
3. ``encode``: recomputes the new moments, writes the update ``u``, then per 16-element block the
   E4M3 scale, ``1 / (dscale * S_dec)`` and the E2M1 codes, over the old state in place
   (``input_output_aliases``: a jit that donates the state copies nothing).

Layout: a leaf of ``n`` elements is viewed as ``(n / 16, 8, 2)``. A program takes ``block_rows``
16-element blocks and works on the even and odd elements of each block as two (rows, 8) tiles, the
way packed codes hold them (even element in the low nibble), so codes are packed without shuffles;
the last program masks rows past the end. Leaves of one size and dtype share each kernel's launches,
``launch_group`` at a time: programs ``[j * n_prog, (j + 1) * n_prog)`` run leaf j (a ``pl.when``
branch per leaf). ``AdamKernelConfig`` holds these launch settings.

Bit-exactness: the kernels call the XLA path's functions (``fp4jax.numerics``): products rounded
before each sum (PTX ``mul.rn.f32`` on the GPU, ``numerics.rounded`` in interpret mode), the same
E4M3 and E2M1 rounding and counter hash, and the correctly rounded ``1 / x`` and ``sqrt`` as PTX
``div.rn.f32`` and ``sqrt.rn.f32`` (the CPU's IEEE division and ``numerics.sqrt_rn`` in interpret
mode). The stored state therefore equals the XLA path's bit for bit; ``u`` uses the backend's
float32 division, as the XLA path does, and may differ from it in the last bits. See
docs/DESIGN.md, "Kernels".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp4jax import numerics, nvfp4
from fp4jax.kernels._common import (division, div_rn, f8_bytes, four_over_six_scales, four_over_six_terms,
                                    key_words, load, max_all, mul_rn, pad_pow2, ref_words, sqrt_rn, store)
from fp4jax.kernels.nvfp4_quantize import _stack_last, _unstack_last
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor

_HALF = BLOCK // 2
_INT_HEAD = 8  # the int table: [runtime zero, pad...], then per leaf 2 key words (4 with dither: the
# step's, then those of the step that wrote the dithered state)
_F32_HEAD = 8  # the float table: [the 4 `numerics.bias_factors`, bound, pad...], then per leaf the
# old global scales of m and √v


@dataclasses.dataclass(frozen=True)
class AdamKernelConfig:
  """Launch settings of the two kernels (frozen and hashable: a static argument).

  Attributes:
    block_rows: 16-element blocks per program of ``encode`` (a power of two).
    num_warps: Triton warps per program of ``encode``.
    stats_block_rows: 16-element blocks per program of ``stats`` (a power of two).
    stats_num_warps: Triton warps per program of ``stats``.
    atomic_slots: copies of each max that ``stats`` folds into (program i into copy
      ``i % atomic_slots``, reduced by XLA afterwards), against atomics serialized on one address;
      1: one address per max.
    launch_group: leaves of one size that share a launch of each kernel; 1: a launch per leaf.
    evict_hints: L2 eviction hints in ``encode``: its loads evict first, the update's stores last
      (XLA's ``apply_updates`` reads the update next).
  """

  block_rows: int = 64
  num_warps: int = 4
  stats_block_rows: int = 128
  stats_num_warps: int = 4
  atomic_slots: int = 64
  launch_group: int = 4
  evict_hints: bool = True

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == "evict_hints":
        if not isinstance(v, bool):
          raise ValueError(f"AdamKernelConfig.evict_hints must be a bool, got {v!r}")
      elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"AdamKernelConfig.{f.name} must be a positive int, got {v!r}")
    for name in ("block_rows", "stats_block_rows"):
      rows = getattr(self, name)
      if rows & (rows - 1):
        raise ValueError(f"AdamKernelConfig.{name} must be a power of two, got {rows!r}")


@dataclasses.dataclass(frozen=True)
class AdamHyper:
  """The static part of one update: Adam's constants, the rounding of each moment (``"nearest"``,
  ``"stochastic"``, ``"dither"`` (``dithered_codes``, decoded by ``dithered_values``),
  ``"eden"`` (nearest codes, ``eden_scale_codes``), or for √v ``"preconditioner"``:
  ``e2m1_preconditioner_codes``) and its kind."""

  b1: float
  b2: float
  eps: float
  eps_root: float
  nesterov: bool
  clip_update: bool
  mu_rounding: str
  nu_rounding: str
  mu_kind: str = "nvfp4"
  nu_kind: str = "nvfp4"
  mu_scale_rule: str = "max"
  nu_scale_rule: str = "max"

  @property
  def dither(self) -> bool:
    """Whether a moment is dithered (the kernels then read the writing step's key words too)."""
    return "dither" in (self.mu_rounding, self.nu_rounding)

  @property
  def random(self) -> bool:
    """Whether a moment's encoding draws counter-hash bits."""
    return bool({"stochastic", "preconditioner", "dither", "eden"} & {self.mu_rounding, self.nu_rounding})

  def __post_init__(self):
    for name in ("mu_kind", "nu_kind"):
      if getattr(self, name) not in KINDS or (name == "mu_kind" and self.mu_kind == "centered"):
        raise ValueError(f"AdamHyper.{name} must be one of {KINDS} ('centered' for nu only), got "
                         f"{getattr(self, name)!r}")


# How a stored moment is held (``AdamHyper.mu_kind``, ``nu_kind``): NVFP4; float32 (m, or v as optax
# keeps it); NVFP4 of √v with its block means removed and a Hadamard rotation
# (``fp4jax.optim.state.CenteredNVFP4Tensor``; √v only).
KINDS = ("nvfp4", "fp32", "centered")
# Arrays per stored moment that ``encode`` reads and writes: codes, scales, global scale (, means).
_N_REFS = {"nvfp4": 3, "fp32": 1, "centered": 4}


def moment_kind(t) -> str:
  """The ``KINDS`` entry of a stored moment."""
  if not isinstance(t, NVFP4Tensor):
    return "fp32"
  return "centered" if hasattr(t, "mean") else "nvfp4"


# The scale of ``scaled_second_moment``: v of a gradient up to float32's largest, times 2^-160, is a
# normal float32, and every product by it is exact.
_V_SCALE_LOG2 = 80


def scaled_second_moment(s_old, g32, b2: float, zero, mul=None) -> jax.Array:
  """``(b2 s_old² + (1 - b2) g²) · 2^-160``: Adam's second moment computed at a scale where it cannot
  overflow (``numerics.rounded_ema``'s products, on ``s_old`` and ``g`` times ``2^-80``, exact).

  Where ``v`` itself overflows float32 (``|g|`` from about 1.8e19, or a stored √v that large) from
  finite ``s_old`` and ``g``, its root is ``sqrt(scaled) · 2^80`` (``overflow_root``): a finite √v,
  where ``sqrt(inf)`` would make the leaf's global scale, and with it the whole moment, NaN for good.
  The leaf's other elements are then too small for its block and global scales, are stored as 0 and
  recover as the large entry decays (the update's clip bounds them meanwhile).
  """
  k = jnp.float32(2.0**-_V_SCALE_LOG2)
  mul_ = mul or (lambda a, b: numerics.rounded(a * b, zero))
  s, g = s_old * k, g32 * k
  return numerics.rounded_ema(mul_(s, s), mul_(g, g), b2, zero, mul)


def overflow_root(v, scaled, sqrt):
  """The stored √v: ``sqrt(v)``, or where ``v`` overflowed from finite inputs (``v == inf`` and its
  ``scaled_second_moment`` finite) ``sqrt(scaled) · 2^80``. Returns (root, overflowed)."""
  overflowed = (v == jnp.inf) & (scaled < jnp.inf)
  # One root per element; the product by 1 leaves the others' bits alone.
  root = sqrt(jnp.where(overflowed, scaled, v)) * jnp.where(
      overflowed, jnp.float32(2.0**_V_SCALE_LOG2), jnp.float32(1.0))
  return root, overflowed


# The centered √v (``nu_kind="centered"``): per 16-element block, the mean of √v rounded to bfloat16
# is stored apart and subtracted, the rest rotated by ``fp4jax.nvfp4.hadamard`` (key 0) and stored in
# NVFP4; a decoded √v is floored at ``CENTERED_FLOOR`` times its block's mean.
CENTERED_FLOOR = 2.0**-4
# The signs s of nvfp4.hadamard_matrix(jax.random.key(0)) = diag(s)·H16/4, as constants of the kernels
# and of the XLA path (tests/test_optim_moments.py checks them against the matrix).
HADAMARD_SIGNS = (-1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0)


def _signs_last_axis(ndim: int) -> jax.Array:
  return jnp.asarray(HADAMARD_SIGNS, jnp.float32).reshape((1,) * (ndim - 1) + (BLOCK,))


def center_rotate(s):
  """One block's √v -> (the block mean in bfloat16, the rotated deviations ``nvfp4.hadamard(s - mean)``).

  ``s`` is a list of 16 equally shaped float32 arrays, element i of each block in ``s[i]`` (the
  kernels' layout; the deviations come back as such a list), or one array with the blocks on its
  last axis of 16 (the XLA path's; the deviations come back as one array). The sum runs in element
  order and is multiplied by the exact 1/16; the bfloat16 mean is what is subtracted, so its rounding
  costs nothing on decoding (rounded by ``numerics.bf16_rn``: XLA on the GPU would fold a cast to
  bfloat16 and back). The rotation is ``nvfp4.hadamard``'s butterfly (products by the signs,
  additions in its fixed order, the exact ×1/4), each result's subnormals flushed (as the quantizer
  flushes its input): the same bits in either layout, in the kernels and the XLA path.
  """
  ftz = numerics.flush_subnormals
  quarter = jnp.float32(0.25)
  if isinstance(s, (list, tuple)):
    s = [ftz(x) for x in s]
    m32 = numerics.bf16_rn(functools.reduce(jnp.add, s) * jnp.float32(1.0 / BLOCK))
    y = numerics.hadamard16_butterfly([ftz(x - m32) * jnp.float32(HADAMARD_SIGNS[i]) for i, x in enumerate(s)])
    return m32.astype(jnp.bfloat16), [ftz(x * quarter) for x in y]
  s = ftz(jnp.asarray(s, jnp.float32))
  m32 = numerics.bf16_rn(functools.reduce(jnp.add, [s[..., i] for i in range(BLOCK)]) * jnp.float32(1.0 / BLOCK))
  y = numerics.hadamard16_last_axis(ftz(s - m32[..., None]) * _signs_last_axis(s.ndim))
  return m32.astype(jnp.bfloat16), ftz(y * quarter)


def uncenter(y, mean):
  """The inverse of ``center_rotate``: the decoded rotated deviations (its list of 16 arrays or its
  array with the blocks on the last axis) and the bfloat16 block means -> √v in the same layout,
  floored at ``CENTERED_FLOOR · mean`` (never below 0, never far below the block's level: a
  reconstruction error cannot leave an entry at 0 or negative, which Adam would divide by)."""
  ftz = numerics.flush_subnormals
  m32 = mean.astype(jnp.float32)
  floor = m32 * jnp.float32(CENTERED_FLOOR)
  quarter = jnp.float32(0.25)
  if isinstance(y, (list, tuple)):
    d = [ftz(x * jnp.float32(HADAMARD_SIGNS[i]) * quarter)
         for i, x in enumerate(numerics.hadamard16_butterfly(list(y)))]
    return [jnp.maximum(ftz(m32 + x), floor) for x in d]
  d = ftz(numerics.hadamard16_last_axis(y) * _signs_last_axis(y.ndim) * quarter)
  return jnp.maximum(ftz(m32[..., None] + d), floor[..., None])


def e2m1_preconditioner_codes(x32, escale, dscale, s_dec, zero_block, bits, c2, eps, mul):
  """E2M1 codes of √v (``x32 >= 0``) by stochastic rounding in Adam's preconditioner space.

  Between the grid neighbours ``lo <= a <= hi`` of ``a = min(x32 · escale, 6)``, ``hi`` is chosen with
  probability ``P = (h(lo) - h(a)) / (h(lo) - h(hi))`` for ``h(q) = 1 / (q · k + eps)``, ``k = dscale ·
  S_dec · c2`` (the decoded √v per E2M1 unit times the update's ``1 / sqrt(bc2)``): the expected
  ``1 / (√v + eps)`` of the stored value is the exact one, where value-space rounding makes the
  expected √v exact. ``P = (a - lo) / (hi - lo) · (hi · k + eps) / (a · k + eps)``, at least the
  value-space probability; ``lo = 0`` is then chosen with probability about ``eps / (a · k)``. Decided
  without a division: ``u · (hi - lo) · (a · k + eps) < (a - lo) · (hi · k + eps)``, ``u`` the 8-bit
  uniform of ``numerics.lane_bits`` (``(byte + 1/2) / 256``), ``mul`` the rounded products (no FMA).

  Returns:
    int32 codes 0..7 (0 where ``zero_block``).
  """
  a = jnp.minimum(jnp.abs(x32 * escale), numerics.E2M1_MAX)
  lo = numerics.e2m1_stochastic_code(a, jnp.zeros_like(bits))  # no random bits: rounded down
  hi = jnp.minimum(lo + 1, 7)
  lo_v, hi_v = numerics.decode_e2m1(lo), numerics.decode_e2m1(hi)
  k = (dscale * s_dec) * c2
  u = (bits >> 8).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)
  up = (u * (hi_v - lo_v)) * (mul(a, k) + eps) < (a - lo_v) * (mul(hi_v, k) + eps)
  return jnp.where(zero_block, 0, jnp.where(up, hi, lo))


# Subtractive dither (rounding ``"dither"``) in the E2M1 index domain, where the grid is uniform: the
# odd, piecewise linear map ``e2m1_index`` sends the E2M1 values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} to the
# integers ±{0, ..., 7} (slope 2 below 2, 1 up to 4, 1/2 up to 6). An element's index ``e2m1_index(x ·
# escale)`` plus ``u`` (``dither_uniform``: from the element's counter-hash byte of the step that writes
# it) is rounded to the nearest integer, clipped to ±7: that integer is the element's code. Decoding
# subtracts the same ``u``, regenerated from that step's key, and maps back (``dithered_values``):
# the error in index units is uniform on (-1/2, 1/2) whatever the value, so in value units it is
# half the local grid step either way and has mean 0 except within half a step of 2 and 4, where
# the slope changes (bias at most 1/8 of an E2M1 unit, at 4).


def dither_uniform(bits) -> jax.Array:
  """``u`` in (-1/2, 1/2) (float32, a multiple of 1/256 plus 1/512, mean 0 over the byte) from
  rounding bits in ``numerics.lane_bits``' layout: ``bits >> 23`` is ``2 · byte + 1``, ``u = (2 · byte + 1 -
  256) / 512``."""
  return ((bits >> 23).astype(jnp.int32) - 256).astype(jnp.float32) * jnp.float32(1.0 / 512)


def e2m1_index(a) -> jax.Array:
  """E2M1 units -> index units: ``2|a|`` below 2, ``|a| + 2`` below 4, ``|a| / 2 + 4`` above, with
  ``a``'s sign (the codes' magnitudes 0..7 at the grid values)."""
  m = jnp.abs(a)
  f = jnp.where(m < 2.0, m * 2.0, jnp.where(m < 4.0, m + 2.0, m * 0.5 + 4.0))
  return jnp.where(a < 0, -f, f)


def dithered_codes(x32, escale, zero_block, bits, mul):
  """E2M1 codes of subtractive dither: ``t = e2m1_index(x32 · escale) + dither_uniform(bits)``, the
  code's magnitude ``min(round(|t|), 7)`` (halves up), its sign bit where ``t < 0``; 0 where
  ``zero_block``. ``mul``: the rounded product. Returns int32 codes 0..15."""
  t = e2m1_index(mul(x32, escale)) + dither_uniform(bits)
  k = jnp.minimum((jnp.abs(t) + 0.5).astype(jnp.int32), 7)
  return jnp.where(zero_block, 0, k | jnp.where(t < 0, 8, 0))


def dithered_values(code, bits) -> jax.Array:
  """The E2M1-unit values of dithered codes (int32 0..15) with the writing step's ``bits``: ``y = ±k -
  dither_uniform(bits)`` (exact), mapped back by the inverse of ``e2m1_index`` (exact: ``y / 2``,
  ``|y| - 2``, ``2 (|y| - 4)``)."""
  c = code.astype(jnp.int32)
  k = (c & 7).astype(jnp.float32)
  y = jnp.where((c & 8) != 0, -k, k) - dither_uniform(bits)
  m = jnp.abs(y)
  v = jnp.where(m < 4.0, m * 0.5, jnp.where(m < 6.0, m - 2.0, (m - 4.0) * 2.0))
  return jnp.where(y < 0, -v, v)


def e4m3_stochastic_code(y, bits16):
  """E4M3 byte (int32) of ``y`` in [0, 448], stochastically rounded: the neighbour above with
  probability ``(y - lo) / (hi - lo)``, decided by ``(bits16 + 1/2) · 2^-16 · (hi - lo) < y - lo``
  (``bits16`` uint32 in [0, 2^16)). Every operand is exact (a power-of-two step, a Sterbenz
  difference), so the choice is the same on every backend."""
  value, code = numerics.round_to_e4m3(y)
  code = code.astype(jnp.int32)
  lo = jnp.where(value > y, code - 1, code)
  hi = jnp.minimum(lo + 1, 126)  # 126: 448, the largest finite E4M3
  lo_v, hi_v = numerics.e4m3_to_f32(lo), numerics.e4m3_to_f32(hi)
  u = (bits16.astype(jnp.int32).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-16)
  return jnp.where(u * (hi_v - lo_v) < y - lo_v, hi, lo)


def eden_bits16(bits_even, bits_odd) -> jax.Array:
  """A block's 16 scale-rounding bits: the counter-hash bytes of its elements 0 and 1 (``lane_bits``
  layout), which EDEN's nearest-rounded codes leave unused."""
  return (bits_even >> 24) | ((bits_odd >> 24) << 8)


def eden_scale_codes(n2, ip, dscale, dcode, zero_block, bits16, mul, division):
  """EDEN's calibrated block scales: ``c = ‖a‖² / ⟨a, q⟩`` per block (``n2``, ``ip``: its sums in
  E2M1 units, ``a = x · escale`` and ``q`` the nearest E2M1 values; 1 where ``ip`` is not positive),
  ``y = min(c · dscale, 448)`` stochastically rounded to E4M3 (``e4m3_stochastic_code``) so that
  the expected decoded scale is ``c · dscale``; ``dcode`` kept where ``zero_block``. ``division``: the
  correctly rounded quotient ``(a, b) -> a / b``. Returns int32 E4M3 bytes."""
  c = jnp.where(ip > 0, division(n2, jnp.where(ip > 0, ip, 1.0)), 1.0)
  y = jnp.minimum(mul(c, dscale), numerics.E4M3_MAX)
  return jnp.where(zero_block, dcode.astype(jnp.int32), e4m3_stochastic_code(y, bits16))


def supports(mu) -> bool:
  """Whether a stored moment can take the kernels: NVFP4, 1×16 blocks along the last axis."""
  return (isinstance(mu, NVFP4Tensor) and mu.block == (1, BLOCK) and mu.axis == len(mu.shape) - 1
          and mu.size < 2**31)


def supports_leaf(mu, nu) -> bool:
  """Whether a leaf's two stored moments can take the kernels: each ``supports``, or one of them a
  float32 array of the other's shape."""
  ok = [supports(t) for t in (mu, nu)]
  if all(ok):
    return True
  if not any(ok):
    return False
  q, f = (mu, nu) if ok[0] else (nu, mu)
  return not isinstance(f, NVFP4Tensor) and f.dtype == jnp.float32 and tuple(f.shape) == q.shape


# ----------------------------------------------------------------------------------------------
# The kernels


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


def _halves(ref, ok2, ok3, split, evict=None):
  """The even and odd elements of each 16-element block row of ``ref`` (rows, 8, 2).

  ``split``: one contiguous load split in registers (Triton's ``split``; ``stats``), else two
  strided loads (``encode``, whose other tiles have a layout that makes the split cost more than it
  saves)."""
  if split:
    return jnp.unstack(load(ref, ok3, evict), axis=-1)
  return [load(ref.at[:, :, jnp.int32(h)], ok2, evict) for h in range(2)]


def _columns(halves) -> list:
  """The 16 elements of each block row as 16 (rows,) arrays, from its two (rows, 8) halves."""
  even, odd = (_unstack_last(h) for h in halves)
  return [x for pair in zip(even, odd) for x in pair]


def _from_columns(cols) -> list:
  """The inverse of ``_columns``."""
  return [_stack_last(cols[h::2]) for h in range(2)]


def _decoded(kind, refs, gscale, ok, split, evict, dither_bits=None):
  """A stored moment as two (rows, 8) float32 halves (``refs``: its codes, scales (, means), or its
  float32 array); NVFP4 decoded with ``NVFP4Tensor.dequantize``'s products, in its order;
  ``dither_bits``: each half's bits of the step that wrote a dithered moment, whose codes decode by
  ``dithered_values`` (``optim._common.decode_dithered``)."""
  ok1, ok2, ok3 = ok
  if kind == "fp32":
    return _halves(refs[0], ok2, ok3, split, evict)
  # Codes widened once: 32-bit integer arithmetic from here (bytes cost the GPU byte permutes).
  code = load(refs[0], ok2, evict).astype(jnp.int32)
  scale = numerics.e4m3_to_f32(f8_bytes(load(refs[1], ok1, evict)))[:, None]
  if dither_bits is None:
    q = [numerics.decode_e2m1((code >> 4 * h) & 0xF) for h in range(2)]
  else:
    q = [dithered_values((code >> 4 * h) & 0xF, b) for h, b in enumerate(dither_bits)]
  out = [(x * scale) * gscale for x in q]
  if kind == "centered":
    out = _from_columns(uncenter(_columns(out), load(refs[2], ok1, evict)))
  return out


def _pair_hash(i_ref, at, pid, br):
  """``numerics.counter_bits``' hash of each (block row, column) of program ``pid``, i.e. of each pair of
  neighbouring elements, keyed by the words at ``i_ref[at:at + 2]``: (br, 8) uint32."""
  row0 = (pid * br).astype(jnp.uint32)
  pairs = ((lax.broadcasted_iota(jnp.uint32, (br, _HALF), 0) + row0) * _HALF
           + lax.broadcasted_iota(jnp.uint32, (br, _HALF), 1))
  return numerics.counter_hash(pairs, *ref_words(i_ref, at))


def _key_at(hp, leaf, previous=False):
  """Where a leaf's key words sit in the int table (``_INT_HEAD``): the step's, or (``previous``) those
  of the step that wrote its dithered moments."""
  return _INT_HEAD + (4 if hp.dither else 2) * leaf + (2 if previous else 0)


def _moments(hp, zero, f_ref, leaf, gs, m_refs, v_refs, ok, interpret, evict=None, split=False,
             prev_hash=None):
  """Per half h of the gradient's halves ``gs``: (g, m, v, the scaled v) in float32, (rows, 8) each
  (``numerics.adam_moments``, ``scaled_second_moment``; the scaled v None for a float32 v);
  ``prev_hash``: the writing step's ``_pair_hash``, for dithered moments (m lane 0, √v lane 1)."""
  mg, vg = f_ref[_F32_HEAD + 2 * leaf], f_ref[_F32_HEAD + 2 * leaf + 1]
  dbits = lambda j: ([numerics.lane_bits(prev_hash, 2 * j + h) for h in range(2)]
                     if (hp.mu_rounding, hp.nu_rounding)[j] == "dither" else None)
  m_olds = _decoded(hp.mu_kind, m_refs, mg, ok, split, evict, dbits(0))
  v_stored = _decoded(hp.nu_kind, v_refs, vg, ok, split, evict, dbits(1))
  out = []
  for g, m_old, stored in zip(gs, m_olds, v_stored):
    g = g.astype(jnp.float32)
    v_old = stored if hp.nu_kind == "fp32" else stored * stored  # v from the stored √v
    m, v = numerics.adam_moments(m_old, v_old, g, hp.b1, hp.b2, zero, mul_rn(interpret))
    scaled = None if hp.nu_kind == "fp32" else scaled_second_moment(stored, g, hp.b2, zero,
                                                                     mul_rn(interpret))
    out.append((g, m, v, scaled))
  return out


def _split_refs(refs, kinds, per_kind):
  """A leaf's moment refs, in order, cut into one list per moment of ``kinds``."""
  out, k = [], 0
  for kind in kinds:
    out.append(refs[k:k + per_kind[kind]])
    k += per_kind[kind]
  return out


_STATS_REFS = {"nvfp4": 2, "fp32": 1, "centered": 3}  # a moment's refs in ``stats``: no global scale


def _stats_kernel(i_ref, f_ref, a_in, *refs, hp: AdamHyper, nb: int, n_prog: int,
                  leaves: tuple[int, ...], slots: int, interpret: bool):
  del a_in  # the same buffer as a_ref (aliased)
  *per_leaf, a_ref = refs
  n = 1 + _STATS_REFS[hp.mu_kind] + _STATS_REFS[hp.nu_kind]
  _each_leaf(n_prog, len(leaves), lambda j, pid: _stats_leaf(
      i_ref, f_ref, per_leaf[n * j], per_leaf[n * j + 1:n * j + n], a_ref, hp=hp, nb=nb,
      leaf=leaves[j], pid=pid, slots=slots, interpret=interpret))


def _inf_nan(x):
  """``|x|`` with NaN counted as inf (the encoder's amax: XLA's CPU max does not propagate NaN)."""
  return jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))


def _stats_leaf(i_ref, f_ref, g_ref, moment_refs, a_ref, *, hp: AdamHyper, nb: int, leaf: int, pid,
                slots: int, interpret: bool):
  br = g_ref.shape[0]
  ok = tuple(_rows_ok(nb, br, s, pid) for s in ((br,), (br, _HALF), (br, _HALF, 2)))
  m_refs, v_refs = _split_refs(moment_refs, (hp.mu_kind, hp.nu_kind), _STATS_REFS)
  prev_hash = _pair_hash(i_ref, _key_at(hp, leaf, True), pid, br) if hp.dither else None
  halves = _moments(hp, i_ref[0], f_ref, leaf, _halves(g_ref, ok[1], ok[2], split=True), m_refs,
                    v_refs, ok, interpret, split=True, prev_hash=prev_hash)
  amaxes = {}
  if hp.mu_kind != "fp32":
    # The encoder's amax (nvfp4.quantize): subnormals flushed, NaN counted as inf. Rows past the end
    # loaded as zeros, which leave the max alone. The halves maxed elementwise first: one cross-warp
    # reduction (shared memory and barriers) per moment and program.
    abs_m = [_inf_nan(numerics.flush_subnormals(m)) for _, m, _, _ in halves]
    amaxes[0] = max_all(jnp.maximum(*abs_m))  # one axis at a time: a full reduction fails to lower
  if hp.nu_kind == "nvfp4":
    abs_v, abs_scaled = [], []
    for _, _, v, scaled in halves:
      overflowed = (v == jnp.inf) & (scaled < jnp.inf)  # overflow_root's root: from `scaled`
      abs_v.append(jnp.where(jnp.isnan(v), jnp.inf, jnp.where(overflowed, 0.0, jnp.abs(v))))
      abs_scaled.append(jnp.where(overflowed, scaled, 0.0))
    amax_v = max_all(jnp.maximum(*abs_v))
    amax_scaled = max_all(jnp.maximum(*abs_scaled))
    # max(sqrt_rn(v)) = sqrt_rn(max(v)): sqrt_rn is monotone, and its results are never subnormal;
    # the same for the overflowed entries' roots, sqrt_rn(scaled) * 2^80.
    root = lambda x: sqrt_rn(jnp.full((1,), x, jnp.float32), interpret)
    amaxes[1] = jnp.max(jnp.maximum(root(amax_v),
                                    root(amax_scaled) * jnp.float32(2.0**_V_SCALE_LOG2)))
  elif hp.nu_kind == "centered":
    # The stored values are the rotated deviations: each element's root, then center_rotate.
    roots = [overflow_root(v, scaled, lambda x: sqrt_rn(x, interpret))[0] for _, _, v, scaled in halves]
    ys = _from_columns(center_rotate(_columns(roots))[1])
    amaxes[1] = max_all(jnp.maximum(*(_inf_nan(y) for y in ys)))
  # Into the leaf's two entries of the amax buffer: the int32 max of the bit patterns is the
  # float max for values >= 0 (+inf included), and the buffer starts at 0.
  # Scalar values: for a (1,)-shaped int32 value the atomic's Triton lowering takes its float path.
  for j, amax in amaxes.items():
    plgpu.atomic_max(a_ref, _slot(2 * leaf + j, pid, slots), lax.bitcast_convert_type(amax, jnp.int32))


def _slot(k, pid, slots):
  """Program ``pid``'s entry of the ``stats`` buffer for max number ``k`` (``slots`` copies)."""
  if slots == 1:
    return jnp.int32(k)
  return jnp.int32(k * slots) + pid % slots


def _slot_max(buf, n, slots):
  """The first ``n`` maxes of a ``stats`` buffer: each the max of its ``slots`` copies."""
  if slots == 1:
    return buf[:n]
  return jnp.max(buf[:n * slots].reshape(n, slots), axis=1)


def _encode_halves(xs, mconst, s_dec, finite, rounding, bits, interpret, precond=None, four_six=None):
  """NVFP4 codes of one moment given as its two (rows, 8) halves: ``nvfp4.quantize``'s steps with the
  tensor's ``S_enc / 6`` (``mconst``) and ``S_dec`` known; ``bits``: each half's rounding bits (or
  None for nearest rounding); ``precond``: ``(c2, eps, mul)`` of ``e2m1_preconditioner_codes`` for
  ``rounding="preconditioner"``; ``four_six``: ``(scale_rule, S_enc, zero)`` for Four over Six
  (``_four_over_six_halves``). Returns (packed, scale codes)."""
  xs = [numerics.flush_subnormals(x) for x in xs]
  if four_six is not None:
    return _four_over_six_halves(xs, s_dec, finite, *four_six, interpret)
  # No NaN test (quantize maps NaN to inf here): a NaN makes the tensor non-finite, and then every
  # block is zeroed below whatever its max.
  block_amax = jnp.maximum(jnp.max(jnp.abs(xs[0]), axis=1), jnp.max(jnp.abs(xs[1]), axis=1))
  block_amax = jnp.where(finite, block_amax, 0.0)
  dscale, dcode = numerics.e4m3_block_scales(block_amax, mconst)
  # quantize's table entry for this block's scale byte: 1 / (e4m3(code) * S_dec).
  escale = jnp.minimum(div_rn(1.0, numerics.e4m3_to_f32(dcode) * s_dec, division(interpret)),
                       numerics.F32_MAX)[:, None]
  zero_block = ((dscale == 0) | ~finite)[:, None]
  if rounding == "preconditioner":
    codes = [e2m1_preconditioner_codes(x, escale, dscale[:, None], s_dec, zero_block, b, *precond)
             for x, b in zip(xs, bits)]
  elif rounding == "dither":
    codes = [dithered_codes(x, escale, zero_block, b, precond[2]) for x, b in zip(xs, bits)]
  elif rounding == "eden":
    mul = precond[2]
    codes = [numerics.e2m1_codes(x, escale, zero_block, "nearest", None, jnp.int32) for x in xs]
    a = [mul(x, escale) for x in xs]
    total = lambda ys: functools.reduce(jnp.add, _columns(ys))  # element order
    n2 = total([mul(y, y) for y in a])
    ip = total([mul(y, numerics.decode_e2m1(c)) for y, c in zip(a, codes)])
    bits16 = eden_bits16(*_columns(bits)[:2])  # the block's elements 0 and 1
    dcode = eden_scale_codes(n2, ip, dscale, dcode, zero_block[:, 0], bits16, mul,
                             lambda a, b: div_rn(a, b, division(interpret))).astype(dcode.dtype)
  else:
    codes = [numerics.e2m1_codes(x, escale, zero_block, rounding, b, jnp.int32)
             for x, b in zip(xs, bits or (None, None))]
  return (codes[0] | (codes[1] << 4)).astype(jnp.uint8), dcode


def _unfused_mul(interpret: bool, zero):
  """Products rounded on their own, never fused into an addition: PTX ``mul.rn.f32`` in the GPU
  kernels (``mul_rn``), ``numerics.rounded`` with the runtime ``zero`` in interpret mode."""
  return mul_rn(interpret) or (lambda a, b: numerics.rounded(a * b, zero))


def _four_over_six_halves(xs, s_dec, finite, scale_rule, s_enc, zero, interpret):
  """``nvfp4.quantize(scale_rule=...)`` on a moment's two (rows, 8) halves (nearest rounding; ``S_enc``,
  ``S_dec`` the tensor's under the E4M3 bound 256): both candidate scales per block, each one's codes
  and error terms summed in element order (``nvfp4._block_error``), amax to 4 where its error is
  strictly lower. Returns (packed, scale codes)."""
  block_amax = jnp.maximum(jnp.max(jnp.abs(xs[0]), axis=1), jnp.max(jnp.abs(xs[1]), axis=1))
  mul = _unfused_mul(interpret, zero)
  ftz = numerics.flush_subnormals
  scaled = [ftz(mul(x, s_enc)) for x in xs]
  cands = []
  for dscale, dcode, escale, zero_block in four_over_six_scales(block_amax, s_enc, s_dec, finite,
                                                                interpret):
    codes = [numerics.e2m1_codes(x, escale[:, None], zero_block[:, None], "nearest", None, jnp.int32)
             for x in xs]
    terms = [four_over_six_terms(c, dscale[:, None], sx, scale_rule, mul) for c, sx in zip(codes, scaled)]
    err = functools.reduce(jnp.add, _columns(terms))
    cands.append((dcode, codes, err))
  (b4, c4, e4), (b6, c6, e6) = cands
  map4 = e4 < e6
  codes = [jnp.where(map4[:, None], a, b) for a, b in zip(c4, c6)]
  return (codes[0] | (codes[1] << 4)).astype(jnp.uint8), jnp.where(map4, b4, b6)


def _encode_kernel(i_ref, f_ref, t_ref, *refs, hp: AdamHyper, nb: int, n_prog: int,
                   leaves: tuple[int, ...], evict_hints: bool, interpret: bool):
  n, k = len(leaves), 1 + _N_REFS[hp.mu_kind] + _N_REFS[hp.nu_kind]
  ins, outs = refs[:k * n], refs[k * n:]
  _each_leaf(n_prog, n, lambda j, pid: _encode_leaf(
      i_ref, f_ref, t_ref, ins[k * j:k * j + k], outs[k * j:k * j + k], hp=hp, nb=nb,
      leaf=leaves[j], pid=pid, evict_hints=evict_hints, interpret=interpret))


def _read_refs(kind, refs):
  """A moment's ``encode`` refs without its global scale (read from the float table instead)."""
  return refs if kind == "fp32" else refs[:2] + refs[3:]


def _encode_leaf(i_ref, f_ref, t_ref, ins, outs, *, hp: AdamHyper, nb: int, leaf: int, pid,
                 evict_hints: bool, interpret: bool):
  g_ref, u_out = ins[0], outs[0]
  kinds = (hp.mu_kind, hp.nu_kind)
  in_refs = _split_refs(ins[1:], kinds, _N_REFS)
  out_refs = _split_refs(outs[1:], kinds, _N_REFS)
  br = g_ref.shape[0]
  ok = tuple(_rows_ok(nb, br, s, pid) for s in ((br,), (br, _HALF), (br, _HALF, 2)))
  zero = i_ref[0]
  factors, bound = tuple(f_ref[k] for k in range(4)), f_ref[4]
  # The old global scales' buffers are aliased to the outputs; their values come from f_ref.
  # The inputs are read for the last time, the update is read next (by XLA's apply).
  evict_in, evict_u = ("evict_first", "evict_last") if evict_hints else (None, None)
  prev_hash = _pair_hash(i_ref, _key_at(hp, leaf, True), pid, br) if hp.dither else None
  halves = _moments(hp, zero, f_ref, leaf, _halves(g_ref, ok[1], None, split=False, evict=evict_in),
                    *(_read_refs(kind, r) for kind, r in zip(kinds, in_refs)), ok, interpret,
                    evict_in, prev_hash=prev_hash)
  # √v: stored, and the update's root
  if hp.nu_kind == "fp32":
    roots = [sqrt_rn(v, interpret) for _, _, v, _ in halves]
  else:
    roots = [overflow_root(v, scaled, lambda x: sqrt_rn(x, interpret))[0]
             for _, _, v, scaled in halves]
  us = [numerics.adam_direction(m, v, s, g, factors, hp.b1, hp.eps, hp.eps_root, hp.nesterov,
                               bound if hp.clip_update else None).astype(u_out.dtype)
        for (g, m, v, _), s in zip(halves, roots)]
  for h, u in enumerate(us):
    store(u_out.at[:, :, jnp.int32(h)], u, ok[1], evict_u)
  pair_hash = None
  if hp.random:
    # numerics.counter_bits: one hash per (block row, column), i.e. per pair of neighbouring
    # elements, whose four bytes round m's and √v's even and odd elements.
    pair_hash = _pair_hash(i_ref, _key_at(hp, leaf), pid, br)
  values = ([m for _, m, _, _ in halves],
            [v for _, _, v, _ in halves] if hp.nu_kind == "fp32" else roots)
  for j, (kind, rounding, xs, refs) in enumerate(
      zip(kinds, (hp.mu_rounding, hp.nu_rounding), values, out_refs)):
    if kind == "fp32":
      for h, x in enumerate(xs):
        store(refs[0].at[:, :, jnp.int32(h)], x, ok[1])
      continue
    c_out, s_out, g_out = refs[:3]
    if kind == "centered":
      mean, ys = center_rotate(_columns(xs))
      xs = _from_columns(ys)
      store(refs[3], mean, ok[0])
    t = 4 * (2 * leaf + j)  # [S_enc / 6, S_dec, finite, S_enc] of this moment
    mconst, s_dec, finite = t_ref[t], t_ref[t + 1], t_ref[t + 2] > 0
    bits = None
    if rounding in ("stochastic", "preconditioner", "dither", "eden"):
      bits = [numerics.lane_bits(pair_hash, 2 * j + h) for h in range(2)]
    precond = (factors[2], hp.eps, _unfused_mul(interpret, zero))
    rule = (hp.mu_scale_rule, hp.nu_scale_rule)[j]
    four_six = None if rule == "max" else (rule, t_ref[t + 3], zero)
    packed, dcode = _encode_halves(xs, mconst, s_dec, finite, rounding, bits, interpret, precond, four_six)
    store(c_out, packed, ok[1])
    store(s_out, lax.bitcast_convert_type(dcode, jnp.float8_e4m3fn), ok[0])
    g_out[...] = jnp.full((1,), s_dec, jnp.float32)  # every program writes the same value


# ----------------------------------------------------------------------------------------------
# The update of a list of leaves


def _leaf_key_words(key, leaf_ids):
  """Per leaf, the ``counter_words`` of its key (int32, (L, 2)), as the XLA path keys the leaf
  (``fold_in(key, leaf)``; m and √v are its lanes 0 and 1)."""
  return jax.vmap(lambda i: key_words(jax.random.fold_in(key, i)))(jnp.asarray(leaf_ids, jnp.uint32))


def update_leaves(grads, mus, nus, leaf_ids, key, hp: AdamHyper, bias_factors, bound, zero,
                  *, prev_key=None, block_sizes: AdamKernelConfig = AdamKernelConfig(),
                  interpret: bool = False):
  """The kernels' AdamW update of NVFP4 leaves (``supports_leaf`` true for each, its moments of the
  kinds ``hp.mu_kind`` and ``hp.nu_kind``).

  Reference: the XLA path of ``fp4jax.optim.scale_by_adam_nvfp4`` (``implementation="xla"``), built on
  ``numerics.adam_moments`` and ``numerics.adam_direction``: the same state bits.

  Args:
    grads: gradient leaves (float32 or bfloat16).
    mus, nus: their stored m and √v (``NVFP4Tensor``, 1×16 blocks along the last axis; a float32 m,
      a float32 v, or a ``CenteredNVFP4Tensor`` √v where ``hp`` says so).
    leaf_ids: each leaf's index in the tree, which keys its rounding bits as in the XLA path.
    key: the step's key, or None for nearest rounding of both moments.
    prev_key: the key of the step that wrote dithered moments (``AdamHyper`` rounding ``"dither"``),
      whose offsets decoding subtracts; else unused.
    hp: constants, roundings and kinds.
    bias_factors: ``numerics.bias_factors`` of the step (``numerics.adam_direction``).
    bound: the update clip bound (float32 scalar), or None (``hp.clip_update`` False).
    zero: ``numerics.runtime_zero`` of the step count (``numerics.adam_moments``).
    block_sizes: the launch settings.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    Lists ``(u, mu_new, nu_new)``: updates in the gradients' dtypes and the new stored moments.
  """
  if not isinstance(block_sizes, AdamKernelConfig):
    raise ValueError(f"block_sizes must be an AdamKernelConfig, got {type(block_sizes).__name__}")
  for t, kind in [(t, hp.mu_kind) for t in mus] + [(t, hp.nu_kind) for t in nus]:
    if moment_kind(t) != kind:
      raise ValueError(f"update_leaves: a stored moment of kind {moment_kind(t)!r} where AdamHyper "
                       f"says {kind!r}")
  config = block_sizes
  if not grads:
    return [], [], []
  ints = [jnp.broadcast_to(zero, (1,)), jnp.zeros((_INT_HEAD - 1,), jnp.int32)]
  if hp.dither and (key is None or prev_key is None):
    raise ValueError("update_leaves: dithered moments need the step's key and prev_key (the key of the "
                     "step that wrote them)")
  if key is not None:
    words = _leaf_key_words(key, leaf_ids)
    if hp.dither:
      words = jnp.concatenate([words, _leaf_key_words(prev_key, leaf_ids)], axis=1)
    ints.append(words.reshape(-1))
  ints = pad_pow2(jnp.concatenate(ints))
  floats = jnp.stack([*bias_factors, jnp.float32(0) if bound is None else bound]
                     ).astype(jnp.float32)
  old_scales = jnp.stack([t.global_scale.astype(jnp.float32) if isinstance(t, NVFP4Tensor)
                          else jnp.float32(1.0) for pair in zip(mus, nus) for t in pair])
  floats = pad_pow2(jnp.concatenate([floats, jnp.zeros((_F32_HEAD - 5,), jnp.float32),
                                      old_scales]))

  amax = _amaxes(grads, mus, nus, hp, ints, floats, config, interpret)
  # S_enc and S_dec of all leaves at once, as nvfp4.quantize computes them.
  finite = amax <= numerics.F32_MAX
  bounds = [numerics.E4M3_MAX if r == "max" else nvfp4.E4M3_MAX_4OVER6
            for r in (hp.mu_scale_rule, hp.nu_scale_rule)]
  s_enc, s_dec = (jnp.stack(x, axis=-1) for x in zip(*(
      nvfp4.global_decode_scale(jnp.where(finite[:, j], amax[:, j], 0.0), bounds[j]) for j in range(2))))
  s_dec = jnp.where(finite, s_dec, jnp.nan)
  # [S_enc / 6, S_dec, finite, S_enc] per leaf and moment (S_enc itself for Four over Six)
  table = jnp.stack([s_enc * jnp.float32(numerics.INV6), s_dec, finite.astype(jnp.float32), s_enc],
                    axis=-1)  # (L, 2, 4)
  table = pad_pow2(table)

  us, mus_new, nus_new = [None] * len(grads), [None] * len(grads), [None] * len(grads)
  k = 1 + _N_REFS[hp.mu_kind] + _N_REFS[hp.nu_kind]
  for group, nb, br, n_prog, shared in _launches(grads, config.block_rows, config.launch_group):
    operands, in_specs, out_specs, out_shape = [], [], [], []
    for j, i in enumerate(group):
      _, g2, state = _views(grads[i], mus[i], nus[i])
      operands += [g2, *state]
      in_specs += [_spec_of(x, br, j, shared) for x in (g2, *state)]
      out_specs += [_spec_of(x, br, j, shared) for x in (g2, *state)]
      out_shape += [jax.ShapeDtypeStruct(g2.shape, grads[i].dtype)]
      out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state]
    outs = pl.pallas_call(
        functools.partial(_encode_kernel, hp=hp, nb=nb, n_prog=n_prog, leaves=tuple(group),
                          evict_hints=config.evict_hints, interpret=interpret),
        grid=(n_prog * len(group),),
        in_specs=[_whole(ints), _whole(floats), _whole(table)] + in_specs,
        out_specs=out_specs, out_shape=out_shape,
        # The new state overwrites the old in place (each program reads its own blocks before
        # writing them; the old global scales come from `floats`), so a jit that donates the state
        # copies nothing.
        input_output_aliases={3 + k * j + 1 + r: k * j + 1 + r
                              for j in range(len(group)) for r in range(k - 1)},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps), interpret=interpret,
        name="adam_nvfp4_encode",
    )(ints, floats, table, *operands)
    for j, i in enumerate(group):
      leaf_outs = outs[k * j:k * j + k]
      us[i] = leaf_outs[0].reshape(grads[i].shape)
      m_outs, v_outs = _split_refs(leaf_outs[1:], (hp.mu_kind, hp.nu_kind), _N_REFS)
      mus_new[i] = _rebuild(mus[i], m_outs)
      nus_new[i] = _rebuild(nus[i], v_outs)
  return us, mus_new, nus_new


def _launches(grads, max_rows, launch_group):
  """The launches of a kernel: per launch, its leaves (indices; the leaves of one size and dtype, in
  runs of at most ``launch_group``), their 16-element blocks ``nb``, blocks per program ``br`` (at
  most ``max_rows``), programs per leaf, and the ``n_prog`` of ``_spec`` (None for a leaf alone:
  plain block specs)."""
  by_kind = {}
  for i, g in enumerate(grads):
    by_kind.setdefault((g.size, jnp.dtype(g.dtype)), []).append(i)
  for idx in by_kind.values():
    for k in range(0, len(idx), launch_group):
      group = idx[k:k + launch_group]
      nb = grads[group[0]].size // BLOCK
      br = min(max_rows, pl.next_power_of_2(nb))
      n_prog = pl.cdiv(nb, br)
      yield group, nb, br, n_prog, (n_prog if len(group) > 1 else None)


def _amaxes(grads, mus, nus, hp, ints, floats, config, interpret):
  """(L, 2) float32: each leaf's amax of the new stored m and √v (0 for a float32 moment), from the
  ``stats`` kernels."""
  # As float32 bit patterns, maxed in by the stats programs. One buffer for all leaves: the stats
  # kernels run one after the other.
  slots = config.atomic_slots
  amax_bits = jnp.zeros((pl.next_power_of_2(2 * len(grads) * slots),), jnp.int32)
  kinds = (hp.mu_kind, hp.nu_kind)
  n = 1 + _STATS_REFS[hp.mu_kind] + _STATS_REFS[hp.nu_kind]
  for group, nb, br, n_prog, shared in _launches(grads, config.stats_block_rows,
                                                 config.launch_group):
    operands = []
    for i in group:
      _, g2, state = _views(grads[i], mus[i], nus[i])
      operands += [g2, *(x for kind, refs in zip(kinds, _split_refs(state, kinds, _N_REFS))
                         for x in _read_refs(kind, refs))]
    amax_bits = pl.pallas_call(
        functools.partial(_stats_kernel, hp=hp, nb=nb, n_prog=n_prog, leaves=tuple(group),
                          slots=slots, interpret=interpret),
        grid=(n_prog * len(group),),
        in_specs=[_whole(ints), _whole(floats), _whole(amax_bits)]
        + [_spec_of(x, br, k // n, shared) for k, x in enumerate(operands)],
        out_specs=_whole(amax_bits),
        out_shape=jax.ShapeDtypeStruct(amax_bits.shape, jnp.int32),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.stats_num_warps),
        interpret=interpret, name="adam_nvfp4_stats",
    )(ints, floats, amax_bits, *operands)
  return lax.bitcast_convert_type(_slot_max(amax_bits, 2 * len(grads), slots),
                                  jnp.float32).reshape(-1, 2)


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
  (nb, 8), scales (nb,), global scale (1,) and, centered, means (nb,); or its float32 array
  (nb, 8, 2)."""
  nb = g.size // BLOCK
  state = []
  for t in (mu, nu):
    if not isinstance(t, NVFP4Tensor):
      state.append(t.reshape(nb, _HALF, 2))
      continue
    state += [t.codes.reshape(nb, _HALF), t.scales.reshape(nb), t.global_scale.reshape(1)]
    if moment_kind(t) == "centered":
      state.append(t.mean.reshape(nb))
  return nb, g.reshape(nb, _HALF, 2), state


def _rebuild(t, outs):
  """The new stored moment of the same kind as ``t`` from the kernel's outputs."""
  if not isinstance(t, NVFP4Tensor):
    return outs[0].reshape(t.shape)
  codes, scales, global_scale = outs[:3]
  extra = {"mean": outs[3].reshape(t.mean.shape)} if moment_kind(t) == "centered" else {}
  return dataclasses.replace(t, codes=codes.reshape(t.codes.shape),
                             scales=scales.reshape(t.scales.shape),
                             global_scale=global_scale.reshape(()), **extra)
