"""The native Triton quantizer (benchmarks.triton_quantize, through jax_triton) on the GPU
equals nvfp4.quantize(block=(1, 16)) on the CPU, bit for bit.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_quantize_triton_gpu.py

Needs jax_triton (``pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl`` beside triton 3.6);
skipped without it. Shapes: one with whole tiles and one with ragged edges on both axes; tilings: the
default and the benchmark's sweep; data: normal, heavy-tailed, with rounding ties, with a NaN.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp4jax import nvfp4
from benchmarks import triton_quantize as kt

pytestmark = pytest.mark.gpu

TILINGS = {
    "default": kt.BlockSizes(),
    "8x512": kt.BlockSizes(block_rows=8, block_k=512),
    "32x256 w8": kt.BlockSizes(block_rows=32, block_k=256, num_warps=8),
    "16x1024 w8": kt.BlockSizes(block_rows=16, block_k=1024, num_warps=8),
    "64x128, amax 4096": kt.BlockSizes(block_rows=64, block_k=128, amax_elements=4096, amax_num_warps=4),
}
SHAPES = {"1024x2048": (1024, 2048), "1000x2064": (1000, 2064)}


def _inputs(shape):
  rng = np.random.default_rng(2026)
  signs = rng.choice([-1.0, 1.0], shape)
  normal = rng.standard_normal(shape)
  nan = normal.copy()
  nan[7, 33] = np.nan
  mid = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
  ties = np.resize(mid, shape) * np.exp2(rng.integers(-4, 4, (shape[0], 1)))
  return {"normal": normal, "heavy": rng.lognormal(0, 3, shape) * signs, "ties": ties, "nan": nan}


def _mismatches(a, b) -> int:
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype.kind == "f" or a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    a = np.where(na, 0, a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]))
    b = np.where(nb, 0, b.view(a.dtype))
    return int(np.sum(a != b) + np.sum(na != nb))
  return int(np.sum(a != b))


@pytest.fixture(scope="module", autouse=True)
def _needs_jax_triton():
  ok, why = kt.available()
  if not ok:
    pytest.skip(why)


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("data", ["normal", "heavy", "ties", "nan"])
def test_triton_kernel_equals_cpu_nvfp4(tiling, shape, data):
  x = _inputs(SHAPES[shape])[data].astype(ml_dtypes.bfloat16)
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
  assert gpu.platform == "gpu"
  with jax.default_device(gpu):
    got = jax.jit(lambda a: kt.quantize(a, decoded=True, block_sizes=TILINGS[tiling]))(jax.device_put(x, gpu))
    got_plain = jax.jit(lambda a: kt.quantize(a, block_sizes=TILINGS[tiling]))(jax.device_put(x, gpu))
  with jax.default_device(cpu):
    def ref(a):
      t = nvfp4.quantize(a, block=(1, 16))
      return t, t.scaled_elements(jnp.bfloat16)
    want = jax.jit(ref)(jax.device_put(x, cpu))
  (gt, gd), (wt, wd) = got, want
  counts = {n: _mismatches(g, w) for n, g, w in zip(
      ("codes", "scales", "global_scale", "decoded", "codes (no decoded)", "scales (no decoded)"),
      (gt.codes, gt.scales, gt.global_scale, gd, got_plain.codes, got_plain.scales),
      (wt.codes, wt.scales, wt.global_scale, wd, wt.codes, wt.scales))}
  print(f"{tiling} {shape} {data}: mismatches {counts}")
  assert not any(counts.values()), counts
