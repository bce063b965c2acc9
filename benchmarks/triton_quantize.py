"""The native Triton peer of ``benchmarks.quantize``: NVFP4 quantization of a 2-D array, 1×16 blocks
along the last axis, nearest rounding, in two kernels written in ``triton.language`` and launched
through ``jax_triton.triton_call``, bit-exact with ``fp4jax.nvfp4.quantize(x, block=(1, 16))``.

The library's quantizer is the Pallas one (``fp4jax.kernels.nvfp4_quantize``: every layout and
rounding). This module writes its most common case directly in Triton so that one benchmark run
compares the two ways of writing the kernel on the same GPU (``benchmarks.quantize``, rows
``triton:``; the bit-mismatch column checks that both compute the same bytes). It is not part of the
library's API.

1. ``amax`` kernel: ``max|x|`` of ``BlockSizes.amax_elements`` consecutive elements per program, as a
   float32 bit pattern (int32): NaN and inf patterns lie above every finite one, so a non-finite
   element wins. XLA reduces the per-program maxima to one int32.
2. ``quantize`` kernel: a program takes a ``block_rows × block_k`` tile of ``x`` (rows contiguous in
   memory, so each thread loads 16 bytes at a time), forms ``S_enc`` and ``S_dec`` from the tensor's
   amax in Transformer Engine's order, reshapes the tile to ``(block_rows, block_k / 16, 16)`` for the
   per-block maxima and E4M3 scales, encodes every element to its E2M1 code, splits the codes into
   even and odd elements (``reshape(..., 2)`` and ``tl.split``) and writes the packed bytes (even
   element in the low nibble), the E4M3 scale bytes, the global decode scale and, optionally, the
   decoded operand ``code × E4M3 scale`` in bfloat16 (exact; ``NVFP4Tensor.scaled_elements``).

Numerics as ``fp4jax.numerics``: E4M3 and E2M1 are encoded with integer operations on float32 bit
patterns (no float8/float4 casts), float32 subnormal inputs are flushed to zero on their bit pattern,
and the three divisions (``2688 / amax``, ``1 / S_enc``, ``1 / (dscale · S_dec)``) are PTX
``div.rn.f32`` (``_div``: correctly rounded; Triton's ``/`` on float32 is not). The kernels are compiled with
floating-point contraction off (``enable_fp_fusion=False``).

Interpretation on the CPU: ``quantize(..., interpret=True)`` runs the same kernel functions in
Triton's interpreter (``triton.runtime.interpreter``) on host numpy arrays, with the CPU's IEEE float32
division in place of the PTX instruction (the interpreter cannot run inline assembly); it needs the
``triton`` package, imported with ``TRITON_INTERPRET=1`` in the environment, but no GPU, no torch and
no ``jax_triton``.

Optional dependencies: ``triton`` and ``jax_triton`` are imported on first use, so this module imports
without them; ``pip install 'fp4jax[triton]'`` installs ``jax-triton`` (which needs a CUDA build of
jaxlib and the ``triton`` package).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax import nvfp4
from fp4jax.kernels import nvfp4_quantize

BLOCK = nvfp4.BLOCK
EXTRA = "triton"  # the optional-dependency extra that installs jax-triton
_MISSING = ("benchmarks.triton_quantize needs the optional packages `triton` and `jax_triton` "
            f"(pip install 'fp4jax[{EXTRA}]', i.e. jax-triton==0.3.1 with triton 3.6 and a CUDA jaxlib)")

# Set by _import_triton(): the kernel functions below read `tl` from this module's globals when Triton
# compiles or interprets them.
triton = None
tl = None


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the two kernels (powers of two).

  ``block_rows × block_k`` elements per program of the quantize kernel (``block_k`` a multiple of 16;
  both are cut to the array's size rounded up to a power of two), ``amax_elements`` per program of
  the amax kernel, and Triton warps per program of each.
  """

  block_rows: int = 16
  block_k: int = 256
  num_warps: int = 4
  amax_elements: int = 16384
  amax_num_warps: int = 8

  def __post_init__(self):
    nvfp4_quantize.check_powers_of_two(self, lambda name: BLOCK if name in ("block_k", "amax_elements") else 1)


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# Kernels (triton.language; `tl` is bound by _import_triton before they are compiled or interpreted)


def _div_impl(a, b, INTERPRET: tl.constexpr):
  """``a / b`` correctly rounded: PTX ``div.rn.f32`` on the GPU, the host's IEEE division in the
  interpreter (which cannot run inline assembly). Bound as ``_div`` (a Triton function) by
  ``_import_triton``."""
  if INTERPRET:
    q = a / b
  else:
    q = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                  is_pure=True, pack=1)
  return q


_div = None  # triton.jit(_div_impl), set by _import_triton: the kernels call it


def _amax_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK_N: tl.constexpr):
  """``out[pid] = max |x|`` over elements ``[pid * BLOCK_N, (pid + 1) * BLOCK_N)`` as an f32 bit pattern."""
  pid = tl.program_id(0)
  offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
  if N % BLOCK_N == 0:
    x = tl.load(x_ptr + offs)
  else:
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
  bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
  tl.store(out_ptr + pid, tl.max(bits, axis=0))


def _quantize_kernel(amax_ptr, x_ptr, codes_ptr, scales_ptr, g_ptr, dec_ptr,
                     ROWS: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                     DECODED: tl.constexpr, INTERPRET: tl.constexpr):
  """Codes, scale bytes, global scale (and decoded operand) of one ``BR × BK`` tile of ``x`` (ROWS, K)."""
  NB: tl.constexpr = BK // 16  # blocks per tile row
  pid_r = tl.program_id(0)
  pid_k = tl.program_id(1)
  rows = pid_r * BR + tl.arange(0, BR)
  cols = pid_k * BK + tl.arange(0, BK)
  offs = rows[:, None] * K + cols[None, :]
  EVEN: tl.constexpr = (ROWS % BR == 0) and (K % BK == 0)
  if EVEN:
    x = tl.load(x_ptr + offs).to(tl.float32)
  else:
    ok = (rows[:, None] < ROWS) & (cols[None, :] < K)
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)

  # Subnormals flushed on the bit pattern (fp4jax.numerics.flush_subnormals).
  abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
  tiny = abits < 0x00800000
  x = tl.where(tiny, 0.0, x)
  abits = tl.where(tiny, 0, abits)
  # Per-block max|x| as a bit pattern (the order of non-negative floats).
  block_amax = tl.max(tl.reshape(abits, (BR, NB, 16)), axis=2).to(tl.float32, bitcast=True)

  # The tensor's S_enc / 6, S_dec and finiteness from its max|x| (nvfp4.global_decode_scale), as (1, 1).
  a_bits = tl.load(amax_ptr + tl.zeros((1, 1), tl.int32))
  a_bits = tl.where(a_bits < 0x00800000, 0, a_bits)
  finite = a_bits <= 0x7F7FFFFF  # FLT_MAX; NaN and inf patterns lie above
  amax = tl.where(finite, a_bits, 0).to(tl.float32, bitcast=True)
  num = tl.zeros((1, 1), tl.float32) + 2688.0
  s_enc = _div(num, amax, INTERPRET)
  s_enc = tl.minimum(s_enc, 3.4028234663852886e+38)
  s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
  one = tl.zeros((1, 1), tl.float32) + 1.0
  s_dec = _div(one, s_enc, INTERPRET)
  s_dec = tl.where(finite, s_dec, tl.full((1, 1), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True))
  m = s_enc * 0.1666666716337204  # fp32(1/6), numerics.INV6
  tl.store(g_ptr + tl.zeros((1, 1), tl.int32), s_dec, mask=(pid_r == 0) & (pid_k == 0))

  # E4M3 block scales: round_to_e4m3(clip(min(block_amax * m, FLT_MAX), 0, 448)) (numerics).
  block_amax = tl.where(finite, block_amax, 0.0)
  v = tl.minimum(tl.maximum(tl.minimum(block_amax * m, 3.4028234663852886e+38), 0.0), 448.0)
  b = v.to(tl.int32, bitcast=True)
  e = ((b >> 23) & 0xFF) - 127
  lsb = (b >> 20) & 1
  normal = (((b + (1 << 19) - 1 + lsb) >> 20) << 20).to(tl.float32, bitcast=True)
  t = v * 512.0
  k = tl.minimum(t, 512.0).to(tl.int32)
  frac = t - k.to(tl.float32)
  sub_k = k + ((frac > 0.5) | ((frac == 0.5) & ((k & 1) == 1))).to(tl.int32)
  dscale = tl.where(e >= -6, normal, sub_k.to(tl.float32) * 0.001953125)
  nb = dscale.to(tl.int32, bitcast=True)
  normal_code = ((((nb >> 23) & 0xFF) - 120) << 3) | ((nb >> 20) & 7)
  dcode = tl.where(dscale >= 0.015625, normal_code, sub_k)
  # escale = min(1 / (dscale * S_dec), FLT_MAX); blocks with dscale 0 (or a non-finite tensor) are zero.
  den = dscale * s_dec
  one_b = tl.zeros((BR, NB), tl.float32) + 1.0
  escale = _div(one_b, den, INTERPRET)
  escale = tl.minimum(escale, 3.4028234663852886e+38)
  zero_block = (dscale == 0.0) | (a_bits > 0x7F7FFFFF)

  # E2M1 codes, to nearest with ties to even (numerics.e2m1_codes), sign in bit 3 for x < 0.
  x3 = tl.reshape(x, (BR, NB, 16))
  a = tl.minimum(tl.abs(x3 * escale[:, :, None]), 6.0)
  mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
         + (a > 5.0).to(tl.int32))
  code = mag | tl.where(x3 < 0.0, 8, 0)
  code = tl.where(zero_block[:, :, None], 0, code)

  # Two codes per byte, the even element in the low nibble.
  even, odd = tl.split(tl.reshape(code, (BR, BK // 2, 2)))
  packed = (even | (odd << 4)).to(tl.uint8)
  pcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
  scols = pid_k * NB + tl.arange(0, NB)
  p_offs = rows[:, None] * (K // 2) + pcols[None, :]
  s_offs = rows[:, None] * (K // 16) + scols[None, :]
  if EVEN:
    tl.store(codes_ptr + p_offs, packed)
    tl.store(scales_ptr + s_offs, dcode.to(tl.uint8))
  else:
    tl.store(codes_ptr + p_offs, packed, mask=(rows[:, None] < ROWS) & (pcols[None, :] < K // 2))
    tl.store(scales_ptr + s_offs, dcode.to(tl.uint8), mask=(rows[:, None] < ROWS) & (scols[None, :] < K // 16))

  if DECODED:
    # decode_e2m1: magnitude code k >= 2 is the f32 pattern (k << 22) + bits(0.5), k = 1 is 0.5; then x dscale.
    kk = code & 7
    mag_bits = tl.where(kk >= 2, (kk << 22) + 0x3F000000, kk * 0x3F000000)
    elem = (mag_bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    dec = tl.reshape(elem * dscale[:, :, None], (BR, BK)).to(tl.bfloat16)
    if EVEN:
      tl.store(dec_ptr + offs, dec)
    else:
      tl.store(dec_ptr + offs, dec, mask=(rows[:, None] < ROWS) & (cols[None, :] < K))


# ----------------------------------------------------------------------------------------------
# Loading


def _import_triton():
  """Binds ``triton`` and ``triton.language`` into this module; ImportError naming the extra if absent."""
  global triton, tl, _div
  if tl is None:
    try:
      import triton as _triton
      import triton.language as _tl
    except ImportError as e:
      raise ImportError(_MISSING) from e
    triton, tl = _triton, _tl
    _div = triton.jit(_div_impl)
  return triton


@functools.cache
def _jitted():
  """The two kernels as ``triton.JITFunction``s (for jax_triton)."""
  _import_triton()
  if type(tl.max).__name__ == "InterpretedFunction":
    raise RuntimeError("triton was imported with TRITON_INTERPRET=1 (its interpreter): the GPU path "
                       "needs a process without it; use quantize(..., interpret=True) there")
  from triton.runtime.jit import JITFunction
  return JITFunction(_amax_kernel), JITFunction(_quantize_kernel)


def _jax_triton():
  try:
    import jax_triton
  except ImportError as e:
    raise ImportError(f"{_MISSING}: {e}") from e
  return jax_triton


def available() -> tuple[bool, str]:
  """``(True, "")`` when the GPU path can run here (triton and jax_triton import), else ``(False, why)``."""
  try:
    _import_triton()
    _jax_triton()
  except ImportError as e:
    return False, str(e)
  return True, ""


def compile_asm(rows: int, k: int, *, decoded: bool = False, block_sizes: BlockSizes = BlockSizes(),
                capability: int = 90, dtype: str = "bf16") -> dict[str, dict[str, str | bytes]]:
  """Compiles both kernels for a CUDA target without a GPU (Triton's compiler and the ptxas it ships),
  specialized as ``quantize`` launches them (16-byte aligned pointers, shapes as constants,
  contraction off), for inspecting the code on a machine without one.

  Returns:
    ``{"amax": asm, "quantize": asm}``, each Triton's ``asm`` dict (``"ttgir"``, ``"ptx"``, ``"cubin"``...).
  """
  _import_triton()
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  from triton.runtime.jit import JITFunction

  target = GPUTarget("cuda", capability, 32)

  def build(fn, pointers, consts, num_warps):
    sig = {**pointers, **{name: "constexpr" for name in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    src = ASTSource(fn=JITFunction(fn), signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, enable_fp_fusion=False)).asm

  n = rows * k
  br, bk = _tiles(rows, k, block_sizes)
  x = "*" + dtype
  return {
      "amax": build(_amax_kernel, {"x_ptr": x, "out_ptr": "*i32"},
                    {"N": n, "BLOCK_N": min(block_sizes.amax_elements, _next_pow2(n))}, block_sizes.amax_num_warps),
      "quantize": build(_quantize_kernel, {"amax_ptr": "*i32", "x_ptr": x, "codes_ptr": "*u8",
                                           "scales_ptr": "*u8", "g_ptr": "*fp32", "dec_ptr": "*bf16"},
                        {"ROWS": rows, "K": k, "BR": br, "BK": bk, "DECODED": bool(decoded), "INTERPRET": False},
                        block_sizes.num_warps),
  }


# ----------------------------------------------------------------------------------------------
# Driver


def _tiles(rows: int, k: int, bs: BlockSizes) -> tuple[int, int]:
  bk = max(BLOCK, min(bs.block_k, _next_pow2(k)))
  br = min(bs.block_rows, _next_pow2(rows))
  return br, bk


def _check(x):
  if x.ndim != 2:
    raise ValueError(f"triton_quantize.quantize takes a 2-D array (rows, K), got shape {x.shape}")
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise ValueError(f"triton_quantize.quantize takes bfloat16, float16 or float32, got {x.dtype}")
  if x.shape[1] % BLOCK:
    raise ValueError(f"1x16 blocks along the last axis: K = {x.shape[1]} is not a multiple of 16")
  if x.size >= 2**31:
    raise ValueError(f"quantize: {x.size} elements; the kernels address at most 2**31 - 1")


def _tensor(x, codes, scales, g):
  return nvfp4.NVFP4Tensor(
      codes=codes, scales=lax.bitcast_convert_type(scales, jnp.float8_e4m3fn),
      global_scale=g.reshape(()), shape=tuple(x.shape), block=(1, BLOCK), axis=1, dtype=x.dtype)


def quantize(x, *, decoded: bool = False, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
  """``nvfp4.quantize(x, block=(1, 16))`` of a 2-D ``(rows, K)`` array in two Triton kernels, bit for bit.

  Args:
    x: bfloat16 (float16 and float32 work too) array ``(rows, K)``, ``K % 16 == 0``, fewer than 2**31
      elements.
    decoded: also return ``NVFP4Tensor.scaled_elements(bfloat16)`` (codes × E4M3 scales, exact; the
      global scale is not applied), written by the quantize kernel.
    block_sizes: the kernels' tiling (``BlockSizes``).
    interpret: run the kernels in Triton's interpreter on the CPU (needs concrete ``x``, not traced;
      needs ``triton`` only).

  Returns:
    An ``NVFP4Tensor`` (codes ``(rows, K/2)`` uint8, scales ``(rows, K/16)`` float8_e4m3fn, float32
    global scale); with ``decoded``, ``(tensor, decoded)``.

  Raises:
    ImportError: ``triton`` or ``jax_triton`` (GPU path) is not installed; the message names the
      ``triton`` extra.
    ValueError: not 2-D, K not a multiple of 16, another dtype, or 2**31 elements or more.
  """
  x = lax.stop_gradient(jnp.asarray(x))
  _check(x)
  rows, k = x.shape
  if x.size == 0:
    t = nvfp4.quantize(x, block=(1, BLOCK))
    return (t, t.scaled_elements(jnp.bfloat16)) if decoded else t
  if interpret:
    return _quantize_interpreted(x, decoded, block_sizes)
  jt = _jax_triton()
  amax_k, quant_k = _jitted()
  n = x.size
  bn = min(block_sizes.amax_elements, _next_pow2(n))
  n_prog = -(-n // bn)
  partial = jt.triton_call(
      x.reshape(-1), kernel=amax_k, out_shape=jax.ShapeDtypeStruct((n_prog,), jnp.int32), grid=(n_prog,),
      num_warps=block_sizes.amax_num_warps, enable_fp_fusion=False, name="nvfp4_amax_triton",
      N=n, BLOCK_N=bn)
  amax = jnp.max(partial).reshape(1)
  br, bk = _tiles(rows, k, block_sizes)
  out_shape = [jax.ShapeDtypeStruct((rows, k // 2), jnp.uint8),
               jax.ShapeDtypeStruct((rows, k // BLOCK), jnp.uint8),
               jax.ShapeDtypeStruct((1,), jnp.float32),
               jax.ShapeDtypeStruct((rows, k) if decoded else (1,), jnp.bfloat16)]
  codes, scales, g, dec = jt.triton_call(
      amax, x, kernel=quant_k, out_shape=out_shape, grid=(-(-rows // br), -(-k // bk)),
      num_warps=block_sizes.num_warps, enable_fp_fusion=False, name="nvfp4_quantize_triton",
      ROWS=rows, K=k, BR=br, BK=bk, DECODED=bool(decoded), INTERPRET=False)
  t = _tensor(x, codes, scales, g)
  return (t, dec) if decoded else t


# ----------------------------------------------------------------------------------------------
# Triton's interpreter on host arrays


class _HostArray:
  """A numpy array as the interpreter takes a tensor argument: its address and Triton dtype."""

  def __init__(self, a: np.ndarray, dtype):
    self.a = a
    self.dtype = dtype

  def data_ptr(self) -> int:
    return self.a.ctypes.data


def _run_interpreted(fn, grid, *args, **constexprs):
  """``fn[grid](*args, **constexprs)`` in Triton's interpreter, arguments already in host memory (the
  interpreter's own launcher copies torch tensors to and from the host)."""
  _import_triton()
  from triton.runtime import interpreter as ti

  class HostGridExecutor(ti.GridExecutor):
    def _init_args_hst(self, args_dev, kwargs):
      return args_dev, kwargs

    def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
      pass

  f = ti.InterpretedFunction(fn)
  HostGridExecutor(f.rewrite(), f.arg_names, grid)(*args, **constexprs)


def _quantize_interpreted(x, decoded, bs: BlockSizes):
  _import_triton()
  if type(tl.max).__name__ != "InterpretedFunction":
    raise RuntimeError("interpret=True runs Triton's interpreter, which needs TRITON_INTERPRET=1 in the "
                       "environment before `triton` is first imported (its own library functions are "
                       "built for the interpreter then)")
  rows, k = x.shape
  xh = np.ascontiguousarray(np.asarray(x))
  xt = {jnp.dtype(jnp.bfloat16): tl.bfloat16, jnp.dtype(jnp.float16): tl.float16,
        jnp.dtype(jnp.float32): tl.float32}[jnp.dtype(x.dtype)]
  n = x.size
  bn = min(bs.amax_elements, _next_pow2(n))
  partial = np.zeros((-(-n // bn),), np.int32)
  _run_interpreted(_amax_kernel, (partial.size,), _HostArray(xh.reshape(-1), xt), _HostArray(partial, tl.int32),
                   N=n, BLOCK_N=bn)
  amax = np.array([partial.max()], np.int32)
  br, bk = _tiles(rows, k, bs)
  codes = np.zeros((rows, k // 2), np.uint8)
  scales = np.zeros((rows, k // BLOCK), np.uint8)
  g = np.zeros((1,), np.float32)
  dec = np.zeros((rows, k) if decoded else (1,), jnp.bfloat16)
  with np.errstate(divide="ignore"):  # 1 / 0 for all-zero blocks, as on the GPU (then clamped)
    _run_interpreted(
        _quantize_kernel, (-(-rows // br), -(-k // bk)), _HostArray(amax, tl.int32), _HostArray(xh, xt),
        _HostArray(codes, tl.uint8), _HostArray(scales, tl.uint8), _HostArray(g, tl.float32),
        _HostArray(dec, tl.bfloat16), ROWS=rows, K=k, BR=br, BK=bk, DECODED=bool(decoded), INTERPRET=True)
  t = _tensor(x, jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(g))
  return (t, jnp.asarray(dec)) if decoded else t
