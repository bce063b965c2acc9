"""Independent numpy/ml_dtypes transcription of Transformer Engine's NVFP4 quantizer (docs/DESIGN.md,
"The NVFP4 format").

Plain IEEE float32 numpy arithmetic and ml_dtypes casts; nothing shared with fp4jax.
"""

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def quantize_ref(x, block=(1, 16), axis=-1):
  """Returns (codes uint8 0..15 shaped like x, dscale float32 per block, s_dec float32)."""
  x = np.asarray(x).astype(np.float32)
  if block == (16, 16):
    *lead, m, n = x.shape
    xb = x.reshape(*lead, m // 16, 16, n // 16, 16)
    bamax = np.abs(xb).max(axis=(-3, -1))
    expand = lambda s: np.repeat(np.repeat(s, 16, -2), 16, -1)
  else:
    axis = axis % x.ndim
    xm = np.moveaxis(x, axis, -1)
    bamax = np.moveaxis(np.abs(xm).reshape(*xm.shape[:-1], -1, 16).max(-1), -1, axis)
    expand = lambda s: np.repeat(s, 16, axis)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    amax = F32(np.abs(x).max()) if x.size else F32(0)
    s_enc = np.minimum(F32(2688.0) / amax, FLT_MAX).astype(F32)
    if amax == 0 or s_enc == 0:
      s_enc = F32(1.0)
    s_dec = F32(F32(1.0) / s_enc)
    m = F32(s_enc * F32(F32(1.0) / F32(6.0)))
    v = np.clip(np.minimum(bamax * m, FLT_MAX), -448, 448).astype(F32)
    dscale = v.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    escale = np.minimum(F32(1.0) / (dscale * s_dec), FLT_MAX).astype(F32)
    y = np.clip(x * expand(escale), -6, 6).astype(F32)
  q = y.astype(ml_dtypes.float4_e2m1fn)
  codes = q.view(np.uint8) & 0xF
  codes = np.where(y == 0, 0, codes)  # TE: an exact zero (incl. -0.0) is code 0
  codes = np.where(expand(dscale) == 0, 0, codes).astype(np.uint8)
  return codes, dscale, s_dec


def dequantize_ref(codes, dscale, s_dec, block=(1, 16), axis=-1):
  vals = (codes & 7).astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32)
  vals = np.where(codes & 8, -vals, vals).astype(F32)
  if block == (16, 16):
    s = np.repeat(np.repeat(dscale, 16, -2), 16, -1)
  else:
    s = np.repeat(dscale, 16, axis % codes.ndim)
  return (vals * s * s_dec).astype(F32)
