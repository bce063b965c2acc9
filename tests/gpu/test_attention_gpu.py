"""The flash attention kernels on the GPU against the reference, and their quantized operands against the CPU.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_attention_gpu.py

- ``nvfp4_attention(implementation="pallas")`` (the kernels) equals ``implementation="xla"`` (the
  reference, run on the GPU too) within accumulation tolerance: O, dQ, dK, dV.
- The quantized operands are bit-equal to the CPU's: the decoded Q(q), Q(k) of the op, the dS
  rounding bits, and the in-kernel dS tile quantizer (PTX ``div.rn.f32``) against ``fake_quant_ds`` on
  the CPU.
- K smoothing and Four over Six: the packed Q(k − k̄) and Q(q) of the kernel path on the GPU equal the
  reference's on the CPU, bit for bit.
- The scores of the forward's tiles and the backward's tiles are bit-identical (the same dot on the
  same decoded q, k), so the backward's P recompute is the forward's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from fp4jax import nvfp4
from fp4jax.kernels import _common as C
from fp4jax.kernels import attention as A
from fp4jax.ops import attention as attn
from fp4jax.ops.attention import AttentionConfig, nvfp4_attention
from fp4jax.ops.attention import _fake_quant_ds as fake_quant_ds
from fp4jax.quant import BF16, Operand

pytestmark = pytest.mark.gpu


def _devices():
  gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
  assert gpu.platform == "gpu"
  return gpu, cpu


def _on(device, fn, *args):
  with jax.default_device(device):
    args = [jax.device_put(a, device) for a in args]
    return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def _inputs(b, t, h, hk, d, seed=0):
  rng = np.random.default_rng(seed)
  shapes = ((b, t, h, d), (b, t, hk, d), (b, t, hk, d), (b, t, h, d))
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)


def _bits_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
  return int(np.sum(a.view(view) != b.view(view)))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


_CONFIGS = {
    "bf16_ds": AttentionConfig.nvfp4(ds=BF16),
    "nvfp4": AttentionConfig.nvfp4(),
    # The pv_quantized ablation: V, P and dO in NVFP4 too (attention_pv, Q(P) in the dK/dV kernel).
    "pv_nvfp4": AttentionConfig.nvfp4(v=Operand(), p=Operand(), do=Operand(rounding="stochastic")),
    # V in NVFP4 with P and dO in bf16 (Q/K/V quantized once and reused).
    "v_nvfp4": AttentionConfig.nvfp4(v=Operand()),
    # K smoothing, Four over Six on q, k (MSE) and v (MAE): the XLA-side mean and the 4/6 quantizers.
    "k_smooth_4over6": AttentionConfig.nvfp4(k_smooth=True, q=Operand(scale_rule="4over6_mse"),
                                             k=Operand(scale_rule="4over6_mse"),
                                             v=Operand(scale_rule="4over6_mae")),
    # The finest second-level dS scales: 16×16 tiles, so 16×16 blocks in the backward's kernels.
    "ds_tile_16": AttentionConfig.nvfp4(ds_tile=(16, 16)),
    # q and k in BF16 with dS in NVFP4: the late phase of Recipe.bf16_fwd_attention.
    "qk_bf16": AttentionConfig.nvfp4(q=Operand(format="bf16"), k=Operand(format="bf16")),
    # q and k rotated along D (an XLA product before either path) with the method's options.
    "hadamard": AttentionConfig.nvfp4(hadamard=True, k_smooth=True, q=Operand(scale_rule="4over6_mse"),
                                      k=Operand(scale_rule="4over6_mse")),
}


@pytest.mark.parametrize("config", list(_CONFIGS))
@pytest.mark.parametrize("d,causal,hk", [(128, True, 4), (64, True, 2), (128, False, 1)])
def test_kernels_match_reference(config, d, causal, hk):
  gpu, _ = _devices()
  b, t, h = 2, 1024, 4
  q, k, v, do = _inputs(b, t, h, hk, d, seed=d + hk)
  cfg = _CONFIGS[config]
  key = jax.random.key(7)

  def run(impl, q, k, v, do):
    o, pull = jax.vjp(lambda q, k, v: nvfp4_attention(q, k, v, causal=causal, key=key, config=cfg,
                                                      implementation=impl), q, k, v)
    return (o, *pull(do))

  got = _on(gpu, functools.partial(run, "pallas"), q, k, v, do)
  want = _on(gpu, functools.partial(run, "xla"), q, k, v, do)
  # bf16 outputs: a few bf16 ulps from summation order; NVFP4 dS also moves a few E2M1 codes where
  # dS differs in its last bits, and an NVFP4 P (from the kernels' own log-sum-exp) likewise.
  nvfp4_tol = (1e-2, 5e-2, 5e-2, 1e-2)
  tol = {"bf16_ds": (1e-2, 1e-2, 1e-2, 1e-2), "pv_nvfp4": (2e-2, 5e-2, 5e-2, 2e-2)}.get(config, nvfp4_tol)
  for name, g, w, tl in zip(("o", "dq", "dk", "dv"), got, want, tol):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert _rel(g, w) < tl, (name, _rel(g, w))


def test_decoded_operands_equal_cpu():
  """The decoded Q(q) the kernels get (1x16 along D, one global scale) is the CPU's, bit for bit."""
  gpu, cpu = _devices()
  q, *_ = _inputs(2, 512, 4, 4, 128, seed=3)
  fn = lambda x: nvfp4.quantize(x, block=(1, 16)).dequantize(jnp.bfloat16)
  assert _bits_equal(_on(gpu, fn, q), _on(cpu, fn, q)) == 0


@pytest.mark.parametrize("rule", ["max", "4over6_mse", "4over6_mae"])
def test_smoothed_four_over_six_operands_equal_cpu(rule):
  """The kernel path's packed Q(k − k̄) and Q(q) (the Pallas quantizer, each scale rule) on the GPU equal
  the reference's on the CPU bit for bit, given the same k − k̄; k̄ itself (an XLA mean, whose float32
  summation order the backends choose) agrees to float32 rounding."""
  gpu, cpu = _devices()
  q, k, *_ = _inputs(2, 512, 4, 2, 128, seed=4)
  mean = jnp.asarray(3.0 * np.random.default_rng(1).standard_normal((2, 1, 2, 128)), jnp.float32)
  k = (k.astype(jnp.float32) + mean).astype(jnp.bfloat16)
  config = AttentionConfig.nvfp4(k_smooth=True, q=Operand(scale_rule=rule), k=Operand(scale_rule=rule))
  keys = attn._keys(jax.random.key(0))
  smooth = lambda k: attn.smoothed_k(k, config)
  ks = _on(cpu, smooth, k)
  np.testing.assert_allclose(np.float32(_on(gpu, smooth, k)), np.float32(ks), rtol=2**-7, atol=1e-2)

  def packed(impl, q, ks):
    return [attn._operand(x, config, n, keys, impl=impl).dequantize(jnp.bfloat16)
            for x, n in ((q, "q"), (ks, "k"))]

  got = _on(gpu, functools.partial(packed, "pallas"), q, ks)
  want = _on(cpu, functools.partial(packed, "xla"), q, ks)
  assert [_bits_equal(g, w) for g, w in zip(got, want, strict=True)] == [0, 0]


def test_smoothed_k_is_quantized_as_stored_in_one_program():
  """On the GPU, Q(k − k̄) in the same jitted program as the smoothing equals Q of the stored bfloat16
  k − k̄ (a program of its own), bit for bit: XLA may not fold the rounding to bfloat16 between them
  (``numerics.bf16_rn``), or the amax, the scales and the codes of Q(k) change."""
  gpu, _ = _devices()
  _, k, *_ = _inputs(2, 512, 4, 2, 128, seed=5)
  config = AttentionConfig.nvfp4(k_smooth=True)
  keys = attn._keys(jax.random.key(0))
  quant = lambda x: attn._operand(x, config, "k", keys, impl="xla").dequantize(jnp.bfloat16)
  fused = _on(gpu, lambda k: quant(attn.smoothed_k(k, config)), k)
  stored = _on(gpu, quant, _on(gpu, lambda k: attn.smoothed_k(k, config), k))
  assert _bits_equal(fused, stored) == 0


def _tile_quantizer_kernel(w_ref, ds_ref, out_ref, *, rounding, bh):
  m, n = ds_ref.shape
  bits = None
  if rounding == "stochastic":
    k1, k2 = C.ref_words(w_ref)
    bits = A._tile_bits(k1, k2, bh, pl.program_id(0) * m, pl.program_id(1) * n, m, n)
  out_ref[...] = A._quantize_tile(ds_ref[...], bits, A.DS_TILE, rounding, "ptx")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_in_kernel_ds_quantizer_equals_cpu(rounding):
  gpu, cpu = _devices()
  rng = np.random.default_rng(5)
  t, s, bh = 512, 1024, 3
  x = rng.standard_normal((t, s)) * 10.0 ** rng.uniform(-6, 2, (t, s))
  x[:64, :64] = 0.0
  x[64:128, :64] *= 1e-37  # S_dec subnormal: div.rn.f32 keeps it, as numerics.div_rn does
  ds = jnp.asarray(x, jnp.float32)
  key = jax.random.key(9)
  words = C.key_words(key)
  spec = pl.BlockSpec((64, 64), lambda i, j: (i, j))
  kernel = pl.pallas_call(
      functools.partial(_tile_quantizer_kernel, rounding=rounding, bh=bh),
      out_shape=jax.ShapeDtypeStruct((t, s), jnp.bfloat16), grid=(t // 64, s // 64),
      in_specs=[pl.BlockSpec((2,), lambda i, j: (0,)), spec], out_specs=spec)
  got = _on(gpu, kernel, words, ds)

  def whole(ds):
    bits = None
    if rounding == "stochastic":
      bits = A.ds_rounding_bits(key, (1, bh + 1, t, s))[0, bh]
    return fake_quant_ds(ds, ds_tile=A.DS_TILE, rounding=rounding, bits=bits).astype(jnp.bfloat16)

  want = _on(cpu, whole, ds)
  on_gpu = _on(gpu, whole, ds)
  # XLA's CPU backend flushes subnormal operands of float arithmetic to zero: with S_dec subnormal
  # it decodes that tile to zeros where the GPU multiplies exactly. There the kernel must equal the
  # XLA quantizer on the GPU (and be nonzero: div.rn.f32 keeps the subnormal S_dec); everywhere else
  # both must equal the CPU bit for bit.
  sub = np.zeros((t, s), bool)
  sub[64:128, :64] = True
  assert _bits_equal(got[~sub], want[~sub]) == 0
  assert _bits_equal(on_gpu[~sub], want[~sub]) == 0
  assert _bits_equal(got[sub], on_gpu[sub]) == 0
  assert np.any(np.asarray(got[sub], np.float32) != 0)


def _scores_kernel(q_ref, k_ref, s_ref, *, sm_scale):
  s_ref[...] = A._scores(q_ref[...], k_ref[...], sm_scale)


@pytest.mark.parametrize("d", [64, 128])
def test_forward_and_backward_tiles_give_the_same_scores(d):
  """S tiles of the forward's blocks (128 x 64) and of the backward's (64 x 64): bit-identical."""
  gpu, _ = _devices()
  q, k, *_ = _inputs(1, 512, 1, 1, d, seed=d)
  q, k = q[0, :, 0], k[0, :, 0]

  def scores(bq, bk):
    return pl.pallas_call(
        functools.partial(_scores_kernel, sm_scale=d**-0.5),
        out_shape=jax.ShapeDtypeStruct((512, 512), jnp.float32), grid=(512 // bq, 512 // bk),
        in_specs=[pl.BlockSpec((bq, d), lambda i, j: (i, 0)), pl.BlockSpec((bk, d), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bq, bk), lambda i, j: (i, j)))

  fwd, bwd = _on(gpu, scores(128, 64), q, k), _on(gpu, scores(64, 64), q, k)
  assert _bits_equal(fwd, bwd) == 0


@pytest.mark.parametrize("ds_rounding", [None, "stochastic"])
def test_atomic_dq_equals_recompute(ds_rounding):
  """The one-kernel backward (dQ by float32 atomic adds) against the two-kernel one on the GPU: dK
  and dV bit-identical (the same tiles, the same order), dQ within float32 summation-order noise."""
  gpu, _ = _devices()
  q, k, v, do = _inputs(2, 1024, 8, 2, 128, seed=11)
  sm_scale = 128 ** -0.5
  key = jax.random.key(3)

  def bwd(accumulation, q, k, v, do):
    o, lse = A.attention_fwd(q, k, v, causal=True, sm_scale=sm_scale)
    return A.attention_bwd(q, k, v, o, lse, do, causal=True, sm_scale=sm_scale, ds_rounding=ds_rounding,
                           key=key, dq_accumulation=accumulation)

  atomic = _on(gpu, functools.partial(bwd, "atomic"), q, k, v, do)
  recompute = _on(gpu, functools.partial(bwd, "recompute"), q, k, v, do)
  assert _bits_equal(atomic[1], recompute[1]) == 0 and _bits_equal(atomic[2], recompute[2]) == 0
  assert np.all(np.isfinite(np.asarray(atomic[0], np.float32)))
  assert _rel(atomic[0], recompute[0]) < 1e-2, _rel(atomic[0], recompute[0])
