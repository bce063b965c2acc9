"""benchmarks.triton_quantize: the native Triton quantizer equals nvfp4.quantize(block=(1, 16))
bit for bit in Triton's interpreter on the CPU, compiles for sm_90 (div.rn.f32, 128-bit loads, no
float8/float4 conversions), and without triton/jax_triton the module imports and its GPU path raises
an ImportError naming the extra.

The interpreter and compile tests need the ``triton`` package (``pip install triton==3.6.0``; no torch,
no GPU) and are skipped without it. Triton's interpreter needs ``TRITON_INTERPRET=1`` before ``triton``
is first imported: set here when this module is collected before anything imports triton (and not
in a GPU test run).
"""

import os
import sys

# Not in a GPU test run (FP4JAX_GPU_TESTS=1), whose Triton kernels must compile in the same process.
if "triton" not in sys.modules and os.environ.get("FP4JAX_GPU_TESTS") != "1":
  os.environ.setdefault("TRITON_INTERPRET", "1")

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp4jax import nvfp4
from benchmarks import triton_quantize as kt
from conftest import run_with_triton_compiler

# Several programs per axis with ragged edges (40 = 2.5 x 16 rows, 96 = 1.5 x 64 columns; 3840 elements
# = 3.75 amax programs), and one tile per program with no masks.
RAGGED = kt.BlockSizes(block_rows=16, block_k=64, amax_elements=1024)
EVEN = kt.BlockSizes(block_rows=8, block_k=128, amax_elements=2048)


def _bits(a):
  a = np.asarray(a)
  if a.dtype.kind == "f" or a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
  return a


def _mismatches(got, want) -> dict:
  """Differing elements of each output, by bit pattern; NaN equals NaN (the global scale)."""
  (gt, gd), (wt, wd) = got, want
  out = {}
  for name, g, w in (("codes", gt.codes, wt.codes), ("scales", gt.scales, wt.scales),
                     ("global_scale", gt.global_scale, wt.global_scale), ("decoded", gd, wd)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    out[name] = int(np.sum(gn != wn) + np.sum((_bits(g) != _bits(w)) & ~gn & ~wn))
  return out


def _inputs(shape):
  rng = np.random.default_rng(2026)
  signs = rng.choice([-1.0, 1.0], shape)
  normal = rng.standard_normal(shape)
  subnormal = normal.copy()
  subnormal.flat[::7] = 3e-39 * signs.flat[::7]  # bf16 subnormals among normal values: flushed to 0
  nan, inf = normal.copy(), normal.copy()
  nan[1, 3] = np.nan
  inf[-1, -1] = -np.inf
  # Magnitudes on the E2M1 rounding midpoints (0.25, 0.75, ..., 5) of blocks whose max is 6.
  mid = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
  ties = np.resize(mid, shape) * np.exp2(rng.integers(-4, 4, (shape[0], 1)))
  blocks = normal.copy()
  blocks[:, :16] = 0.0  # all-zero blocks (scale 0)
  blocks[2] = 2e-5 * normal[2]  # blocks far below the tensor's amax (E4M3 subnormal scales)
  return {
      "normal": normal, "heavy": rng.lognormal(0, 3, shape) * signs, "zero": np.zeros(shape),
      "subnormal": subnormal, "nan": nan, "inf": inf, "ties": ties, "blocks": blocks,
  }


def _run(x, sizes):
  try:
    return kt.quantize(x, decoded=True, block_sizes=sizes, interpret=True)
  except RuntimeError as e:  # triton imported before TRITON_INTERPRET was set
    pytest.skip(str(e))


@pytest.mark.parametrize("data", ["normal", "heavy", "zero", "subnormal", "nan", "inf", "ties", "blocks"])
@pytest.mark.parametrize("shape,sizes,dtype", [((40, 96), RAGGED, ml_dtypes.bfloat16),
                                               ((32, 256), EVEN, ml_dtypes.bfloat16),
                                               ((40, 96), RAGGED, np.float32)],
                         ids=["ragged-bf16", "even-bf16", "ragged-f32"])
@pytest.mark.slow
def test_interpret_equals_nvfp4_quantize(data, shape, sizes, dtype):
  pytest.importorskip("triton")
  x = jnp.asarray(_inputs(shape)[data].astype(dtype))
  got = _run(x, sizes)
  t = nvfp4.quantize(x, block=(1, 16))
  want = (t, t.scaled_elements(jnp.bfloat16))
  counts = _mismatches(got, want)
  assert not any(counts.values()), counts
  assert got[0].shape == t.shape and got[0].dtype == t.dtype and got[0].axis == t.axis


@pytest.mark.slow
def test_interpret_without_decoded():
  pytest.importorskip("triton")
  x = jnp.asarray(_inputs((40, 96))["heavy"].astype(ml_dtypes.bfloat16))
  try:
    got = kt.quantize(x, block_sizes=RAGGED, interpret=True)
  except RuntimeError as e:
    pytest.skip(str(e))
  want = nvfp4.quantize(x, block=(1, 16))
  assert isinstance(got, nvfp4.NVFP4Tensor)
  assert not any(_mismatches((got, 0), (want, 0)).values())


@pytest.mark.slow
def test_compiles_for_sm90():
  """Both kernels compile for sm_90 (in a fresh process: the interpreter's process cannot compile)."""
  pytest.importorskip("triton")
  run_with_triton_compiler("""
      import re
      from benchmarks import triton_quantize as kt
      for dec in (False, True):
        asm = kt.compile_asm(16384, 16384, decoded=dec)
        ptx = asm["quantize"]["ptx"]
        assert "div.rn.f32" in ptx and "ld.global.v4" in ptx, "quantize"
        assert "ld.global.v4" in asm["amax"]["ptx"], "amax"
        assert not re.search(r"cvt[.\\w]*(e4m3|e2m1)", ptx), "fp8/fp4 conversion"
      print("ok")
  """)


def test_gpu_path_without_jax_triton_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax_triton", None)  # import jax_triton raises ImportError
  ok, why = kt.available()
  assert not ok and "fp4jax[triton]" in why
  with pytest.raises(ImportError, match=r"fp4jax\[triton\]"):
    kt.quantize(jnp.ones((16, 32), jnp.bfloat16))


def test_checks_its_arguments():
  with pytest.raises(ValueError, match="2-D"):
    kt.quantize(jnp.ones((2, 16, 32), jnp.bfloat16))
  with pytest.raises(ValueError, match="multiple of 16"):
    kt.quantize(jnp.ones((16, 24), jnp.bfloat16))
  with pytest.raises(ValueError, match="power of two"):
    kt.BlockSizes(block_k=48)


def test_kernel_constants():
  """The float32 constants written as literals in the kernel are numerics' (fp32(1/6), FLT_MAX)."""
  import inspect

  from fp4jax import numerics
  src = inspect.getsource(kt._quantize_kernel)
  assert repr(numerics.INV6) in src and repr(numerics.F32_MAX) in src
