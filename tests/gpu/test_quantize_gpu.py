"""The NVFP4 quantizer kernels on the GPU equal nvfp4.quantize on the CPU, bit for bit.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_quantize_gpu.py

Each variant of ``fp4jax.kernels.nvfp4_quantize.quantize`` (layout, rounding, bit source, Hadamard
transform, decoded operand, the amax pass in XLA, the scale rule) runs on the GPU on 1024×2048 bfloat16
data, normal, heavy-tailed and half uniform (where Four over Six keeps the amax-to-4 scale), and on
normal 768×384 data, whose contiguous axis takes tiles that divide it (24 blocks in tiles of 8; 384 slab
columns in tiles of 128); its reference (``quantize_reference``: ``nvfp4.quantize``) runs jitted on the
CPU backend of the same process. ``nvfp4.quantize`` with a Four-over-Six rule is also checked on its own
(jitted on the GPU against the CPU).
"""

import jax
import ml_dtypes
import numpy as np
import pytest

from fp4jax import nvfp4
from fp4jax.kernels import nvfp4_quantize as kq

pytestmark = pytest.mark.gpu

KEY, HKEY = jax.random.key(11), jax.random.key(12)
VARIANTS = {
    "1x16 nearest": dict(),
    "1x16 stochastic": dict(rounding="stochastic", key=KEY),
    "1x16 stochastic counter": dict(rounding="stochastic", key=KEY, bit_source="counter"),
    "16x16 nearest": dict(block=(16, 16)),
    "16x16 stochastic": dict(block=(16, 16), rounding="stochastic", key=KEY),
    "axis0 nearest": dict(axis=0),
    "axis0 hadamard nearest": dict(axis=0, hadamard_key=HKEY),
    "axis0 hadamard stochastic": dict(axis=0, hadamard_key=HKEY, rounding="stochastic", key=KEY),
    "axis0 hadamard counter": dict(axis=0, hadamard_key=HKEY, rounding="stochastic", key=KEY,
                                   bit_source="counter"),
    "last hadamard nearest": dict(hadamard_key=HKEY),
    "last hadamard stochastic": dict(hadamard_key=HKEY, rounding="stochastic", key=KEY),
    "last hadamard counter": dict(hadamard_key=HKEY, rounding="stochastic", key=KEY,
                                  bit_source="counter"),
    # The first pass as an XLA reduction (amax="xla"), plain and through the Hadamard transform.
    "1x16 nearest, XLA amax": dict(amax="xla"),
    "axis0 hadamard stochastic, XLA amax": dict(axis=0, hadamard_key=HKEY, rounding="stochastic", key=KEY,
                                                amax="xla"),
    # Four over Six (scale_rule): each layout of its kernels, both error metrics.
    "1x16 4over6_mse": dict(scale_rule="4over6_mse"),
    "1x16 4over6_mae": dict(scale_rule="4over6_mae"),
    "16x16 4over6_mse": dict(block=(16, 16), scale_rule="4over6_mse"),
    "16x16 4over6_mae": dict(block=(16, 16), scale_rule="4over6_mae"),
    "axis0 4over6_mae": dict(axis=0, scale_rule="4over6_mae"),
    "axis0 hadamard 4over6_mse": dict(axis=0, hadamard_key=HKEY, scale_rule="4over6_mse"),
    "last hadamard 4over6_mae": dict(hadamard_key=HKEY, scale_rule="4over6_mae"),
    "1x16 4over6_mse, XLA amax": dict(scale_rule="4over6_mse", amax="xla"),
}


def _inputs():
  rng = np.random.default_rng(2026)
  shape = (1024, 2048)
  signs = rng.choice([-1.0, 1.0], shape)
  return {
      "normal": rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
      "heavy": (rng.lognormal(0, 3, shape) * signs).astype(ml_dtypes.bfloat16),
      "normal 768x384": rng.standard_normal((768, 384)).astype(ml_dtypes.bfloat16),
      # Uniform 16x16 tiles beside Gaussian ones: 4/6 keeps the amax-to-4 scale in many blocks and tiles.
      "uniform and normal": np.where((np.arange(1024) // 16 % 2 == 0)[:, None], rng.uniform(-1, 1, shape),
                                     rng.standard_normal(shape)).astype(ml_dtypes.bfloat16),
  }


def _mismatches(a, b) -> int:
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype.kind == "f" or a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
    a = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    b = b.view(a.dtype)
  return int(np.sum(a != b))


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("data", ["normal", "heavy", "normal 768x384", "uniform and normal"])
def test_gpu_kernel_equals_cpu_nvfp4(name, data):
  kw = VARIANTS[name]
  x = _inputs()[data]
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
  assert gpu.platform == "gpu"
  with jax.default_device(gpu):
    got = jax.jit(lambda a: kq.quantize(a, decoded=True, **kw))(jax.device_put(x, gpu))
  with jax.default_device(cpu):
    ref_kw = {k: v for k, v in kw.items() if k != "amax"}
    want = jax.jit(lambda a: kq.quantize_reference(a, decoded=True, **ref_kw))(jax.device_put(x, cpu))
  names = ("codes", "scales", "global_scale", "decoded")
  (gt, gd), (wt, wd) = got, want
  counts = {n: _mismatches(g, w) for n, g, w in zip(
      names, (gt.codes, gt.scales, gt.global_scale, gd), (wt.codes, wt.scales, wt.global_scale, wd))}
  print(f"{name} {data}: mismatches {counts}")
  assert not any(counts.values()), counts


@pytest.mark.parametrize("rule", ["4over6_mse", "4over6_mae"])
@pytest.mark.parametrize("block,axis", [((1, 16), -1), ((1, 16), 0), ((16, 16), -1)], ids=["1x16", "axis0", "16x16"])
def test_gpu_xla_4over6_equals_cpu(rule, block, axis):
  """``nvfp4.quantize(scale_rule=...)`` itself (the XLA path of the ops) jitted on the GPU equals the CPU:
  no product fused into the error sums, no reassociated sum, no subnormal kept."""
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
  assert gpu.platform == "gpu"
  f = jax.jit(lambda xs: {n: nvfp4.quantize(x, block=block, axis=axis, scale_rule=rule) for n, x in xs.items()})
  xs = _inputs()
  got = f(jax.device_put(xs, gpu))
  want = f(jax.device_put(xs, cpu))
  counts = {n: sum(_mismatches(g, w) for g, w in zip(jax.tree.leaves(got[n]), jax.tree.leaves(want[n])))
            for n in xs}
  print(f"nvfp4.quantize {rule} {block} axis {axis}: mismatches {counts}")
  assert not any(counts.values()), counts
