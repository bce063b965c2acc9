"""fp4jax.ops.nvfp4_matmul: GEMMs against the dequantized reference, the bf16 path, SR, reuse, errors,
and the quantizer-kernel implementation against the XLA one (bit for bit; CUDA lowering and size).

Compilation dominates on the 2-core CPU, so the checks share a few jitted functions of one shape
(M = K = N = 32, the token axis as [2, 16]): one for the NVIDIA recipe with its references, one
called over many keys for the all-stochastic config. The configs run the XLA implementation unless
a test names another.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import H200
from jax.sharding import AbstractMesh

from fp4jax import _platform, numerics, nvfp4
from fp4jax.execution import MatmulExecution
from fp4jax.ops import (
  MatmulConfig,
  nvfp4_matmul,
  nvfp4_matmul_reference,
  nvfp4_matmul_vjp_reference,
)
from fp4jax.ops import matmul
from fp4jax.ops.matmul import Split
from fp4jax.quant import Operand

M0, M1, K, N = 2, 16, 32, 32
NVFP4 = MatmulConfig.nvfp4()
# Every operand stochastically rounded: each GEMM is then unbiased for the *exact* product.
SR = Operand(rounding="stochastic")
ALL_SR = MatmulConfig.nvfp4(x=SR, w=Operand(rounding="stochastic", block=(16, 16)), x_wgrad=SR)
NEAREST_DY = dict(dy_dgrad=Operand(), dy_wgrad=Operand())  # the recipe without stochastic rounding
BF16 = Operand(format="bf16")
N_KEYS = 128


def _data(dtype=jnp.float32, seed=0):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (M0, M1, K), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (K, N), jnp.float32) * 0.2
  dy = jax.random.normal(kd, (M0, M1, N), jnp.float32).astype(dtype)
  return x, w, dy


def _vjp(x, w, dy, key, config, implementation="xla", gemm="auto", amax="kernel"):
  ex = MatmulExecution(implementation, gemm, amax)
  y, vjp = jax.vjp(lambda x, w: nvfp4_matmul(x, w, key=key, config=config, execution=ex), x, w)
  return (y, *vjp(dy))


_RUN = ("config", "implementation", "gemm", "amax")  # the static arguments of _vjp


@functools.partial(jax.jit, static_argnames="config")
def _with_refs(x, w, dy, key, config):
  """(op outputs, dequantized-reference outputs, op on x flattened to 2-D, f32 exact outputs)."""
  op = _vjp(x, w, dy, key, config)
  ref = (nvfp4_matmul_reference(x, w, key=key, config=config),
         *nvfp4_matmul_vjp_reference(x, w, dy, key=key, config=config))
  flat = _vjp(x.reshape(-1, K), w, dy.reshape(-1, N), key, config)
  exact = _vjp(x, w, dy, None, MatmulConfig.bf16())
  return op, ref, flat, exact


_jit_vjp = jax.jit(_vjp, static_argnames=_RUN)


def _over_keys(x, w, dy, keys, config):
  """Stacked outputs for each key (a Python loop: vmap's compile is 3x slower than the loop's run)."""
  outs = [_jit_vjp(x, w, dy, k, config=config) for k in keys]
  return tuple(jnp.stack(o) for o in zip(*outs))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bits_equal(a, b):
  return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_config_presets_validation_and_hashing():
  assert not MatmulConfig.bf16().quantized and not MatmulConfig.bf16().needs_key
  assert NVFP4.quantized and NVFP4.needs_key and NVFP4 == MatmulConfig()
  assert MatmulConfig.bf16(hadamard=True).needs_key  # Hadamard signs are random
  no_random = MatmulConfig.nvfp4(**NEAREST_DY, hadamard=False)
  assert no_random.quantized and not no_random.needs_key
  # A stochastic rounding of an operand whose GEMM is off draws no bits.
  assert not MatmulConfig.bf16(x=SR).needs_key
  assert hash(MatmulConfig.nvfp4(hadamard=False)) == hash(MatmulConfig(hadamard=False))
  with pytest.raises(ValueError, match="MatmulConfig.x must be a fp4jax.quant.Operand"):
    MatmulConfig(x="stochastic")
  with pytest.raises(ValueError, match="fwd must be a bool"):
    MatmulConfig(fwd=1)
  # Each operand's block is the one its GEMMs contract; w takes 16×16 tiles or 1×16 blocks.
  assert MatmulConfig(w=Operand()).w.block == (1, 16) and NVFP4.w.block == (16, 16)
  with pytest.raises(ValueError, match=r"MatmulConfig.dy_wgrad.block=\(16, 16\)"):
    MatmulConfig(dy_wgrad=Operand(block=(16, 16)))
  MatmulConfig(w=Operand(format="bf16"))  # an unquantized operand has no blocks
  x, w = jnp.ones((32, 32)), jnp.ones((32, 32))
  with pytest.raises(ValueError, match="MatmulExecution.implementation: implementation must be one of"):
    MatmulExecution("triton")
  with pytest.raises(ValueError, match="MatmulExecution.amax must be one of"):
    MatmulExecution(amax="fused")
  with pytest.raises(ValueError, match="MatmulExecution.gemm must be one of"):
    MatmulExecution(gemm="fp4")
  with pytest.raises(ValueError, match="execution must be a fp4jax.execution.MatmulExecution"):
    nvfp4_matmul(x, w, key=jax.random.key(0), config=NVFP4, execution="xla")
  with pytest.raises(TypeError):  # what runs an op is not part of what it computes
    MatmulConfig(implementation="xla")


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_bf16_config_equals_jnp_dot_and_its_gradient_exactly(x_dtype):
  x, w, dy = _data(x_dtype)
  dot = lambda x, w: jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

  @jax.jit
  def both(x, w, dy):
    y0, vjp0 = jax.vjp(dot, x, w)
    return _vjp(x, w, dy, None, MatmulConfig.bf16()), (y0, *vjp0(dy))

  got, want = both(x, w, dy)
  for g, r in zip(got, want):
    assert g.dtype == r.dtype and g.shape == r.shape
    assert _bits_equal(g, r)


@pytest.mark.slow
def test_gemms_match_dequantized_reference_tightly():
  """Same quantized operands in f32: only summation order and scale placement differ (≈ K·eps)."""
  x, w, dy = _data()
  op, ref, flat, _ = _with_refs(x, w, dy, jax.random.key(7), NVFP4)
  for name, o, r in zip(("y", "dx", "dw"), op, ref):
    assert o.shape == r.shape and o.dtype == r.dtype, name
    np.testing.assert_allclose(o, r, rtol=2e-6, atol=2e-6 * float(jnp.abs(r).max()), err_msg=name)
  # Leading dims are only a reshape of the token axis.
  for o, f in zip(op, flat):
    assert _bits_equal(o.reshape(f.shape), f)


@pytest.mark.slow
def test_error_against_bf16_is_within_documented_bound():
  """NVFP4 recipe vs the unquantized product: relative error 0.05–0.3 per GEMM output (Gaussian data).

  One NVFP4 operand has ≈ 0.1 relative RMS error; two operands (plus SR on dy) give ≈ 0.13–0.2.
  The lower bound proves quantization happened at all.
  """
  x, w, dy = _data()
  op, _, _, exact = _with_refs(x, w, dy, jax.random.key(7), NVFP4)
  for name, o, e in zip(("y", "dx", "dw"), op, exact):
    assert 0.05 < _rel(o, e) < 0.3, (name, _rel(o, e))


def test_same_key_same_bits_other_key_other_bits():
  x, w, dy = _data()
  a = _with_refs(x, w, dy, jax.random.key(7), NVFP4)[0]
  b = _with_refs(x, w, dy, jax.random.key(7), NVFP4)[0]
  c = _with_refs(x, w, dy, jax.random.key(8), NVFP4)[0]
  assert all(_bits_equal(u, v) for u, v in zip(a, b))
  assert _bits_equal(a[0], c[0])  # the forward is round-to-nearest: no randomness
  assert not _bits_equal(a[1], c[1]) and not _bits_equal(a[2], c[2])  # SR / Hadamard draw new bits


@pytest.mark.slow
def test_stochastic_rounding_makes_every_gemm_unbiased():
  """Mean over keys converges to the exact product at the 1/sqrt(n) rate; one draw is far off."""
  x, w, dy = _data()
  n = N_KEYS
  y, dx, dw = _over_keys(x, w, dy, jax.random.split(jax.random.key(3), n), ALL_SR)
  exact = _with_refs(x, w, dy, jax.random.key(0), NVFP4)[3]
  for name, s, e in zip(("y", "dx", "dw"), (y, dx, dw), exact):
    one = _rel(s[0], e)
    mean = _rel(s.mean(0), e)
    assert one > 0.05, name
    assert mean < 2.5 * one / np.sqrt(n), (name, one, mean)  # ≈ one/sqrt(n) if unbiased


@pytest.mark.parametrize("w_rounding", ["nearest", "stochastic"])
@pytest.mark.slow
def test_forward_and_dgrad_use_bit_identical_weight_values(w_rounding):
  """x = I and dy = I make y = Q(w)·s and dx = Q(w)ᵀ·s with the same scalar s: equal iff one Q(w)."""
  _, w, _ = _data()
  eye = jnp.eye(K, dtype=jnp.float32).reshape(M0, M1, K)
  if w_rounding == "nearest":
    y, dx, _ = _with_refs(eye, w, eye, jax.random.key(11), NVFP4)[0]
    y, dx = y[None], dx[None]
  else:  # every key draws another Q(w); forward and dgrad must follow it together
    y, dx, _ = _over_keys(eye, w, eye, jax.random.split(jax.random.key(11), 8), ALL_SR)
  y, dx = y.reshape(-1, K, N), dx.reshape(-1, K, N)
  assert _bits_equal(y, dx.transpose(0, 2, 1))
  if w_rounding == "nearest":
    deq = jax.jit(lambda w: nvfp4.quantize(w, block=(16, 16)).dequantize())(w)
    np.testing.assert_allclose(y[0], deq, rtol=1e-6)
  else:
    assert not _bits_equal(y[0], y[1])


def test_hadamard_cancels_in_the_unquantized_wgrad():
  x, w, dy = _data()
  cfg = MatmulConfig.bf16(hadamard=True)
  f = jax.jit(lambda x, w, dy, k: (_vjp(x, w, dy, k, cfg), _vjp(x, w, dy, None, MatmulConfig.bf16())))
  (y, dx, dw), (y0, dx0, dw0) = f(x, w, dy, jax.random.key(5))
  assert _bits_equal(y, y0) and _bits_equal(dx, dx0)
  np.testing.assert_allclose(dw, dw0, rtol=1e-5, atol=1e-5 * float(jnp.abs(dw0).max()))
  assert not _bits_equal(dw, dw0)  # H was applied (and only changed the f32 rounding)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_residuals_are_packed_nvfp4(implementation):
  """The backward keeps Q(w) and Q(H·x) packed (uint8 codes + e4m3 scales), no float copy of x or w."""
  x, w, _ = _data(jnp.bfloat16)
  vjp_fn = jax.eval_shape(lambda x, w: jax.vjp(
      lambda x, w: nvfp4_matmul(x, w, key=jax.random.key(0), config=NVFP4,
                                execution=MatmulExecution(implementation)),
      x, w)[1], x, w)
  leaves = [(tuple(l.shape), l.dtype) for l in jax.tree.leaves(vjp_fn)]
  assert ((K, N // 2), jnp.uint8) in leaves and ((M0 * M1 // 2, K), jnp.uint8) in leaves
  floats = [s for s, d in leaves if jnp.issubdtype(d, jnp.floating) and d != jnp.float8_e4m3fn]
  assert all(np.prod(s) <= 1 for s in floats), leaves  # only the two global scales


@pytest.mark.slow
def test_jit_equals_no_jit():
  x, w, dy = _data(jnp.bfloat16)
  key = jax.random.key(9)
  eager = _vjp(x, w, dy, key, NVFP4)
  jitted = _jit_vjp(x, w, dy, key, config=NVFP4)
  assert [a.dtype for a in eager] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
  for e, j in zip(eager, jitted):
    assert _bits_equal(e, j)


def test_odd_shapes_are_fine_where_nothing_is_quantized():
  x, w = jnp.ones((3, 10), jnp.float32), jnp.ones((10, 7), jnp.float32)
  y = nvfp4_matmul(x, w, config=MatmulConfig.bf16())
  np.testing.assert_array_equal(y, np.full((3, 7), 10.0))


@pytest.mark.parametrize("x_shape,w_shape,config,match", [
    ((32, 32), (16, 32), NVFP4, "disagree on K"),
    ((32, 32), (32, 32, 1), NVFP4, "w must be 2-D"),
    ((32, 24), (24, 32), NVFP4, r"K \(contraction of the forward\) = 24 is not a multiple of 16"),
    ((32, 32), (32, 40), NVFP4, r"N \(16x16 weight tiles\) = 40"),
    ((2, 12, 32), (32, 32), NVFP4, "M = tokens .* = 24 is not a multiple of 16"),
    ((24, 32), (32, 32), MatmulConfig.bf16(hadamard=True), "M = tokens"),
    ((24, 32), (32, 32), MatmulConfig.bf16(wgrad=True), "M = tokens"),
])
def test_bad_shapes_raise_clear_errors(x_shape, w_shape, config, match):
  with pytest.raises(ValueError, match=match):
    nvfp4_matmul(jnp.ones(x_shape), jnp.ones(w_shape), key=jax.random.key(0), config=config)


def test_bad_arguments_raise_clear_errors():
  x, w = jnp.ones((32, 32)), jnp.ones((32, 32))
  with pytest.raises(ValueError, match="needs `key`"):
    nvfp4_matmul(x, w, config=NVFP4)
  with pytest.raises(ValueError, match="needs `key`"):
    nvfp4_matmul_vjp_reference(x, w, x, config=NVFP4)
  with pytest.raises(ValueError, match="config must be a MatmulConfig"):
    nvfp4_matmul(x, w, config="nvfp4")
  with pytest.raises(ValueError, match="x must be a floating-point array"):
    nvfp4_matmul(jnp.ones((32, 32), jnp.int32), w, config=MatmulConfig.bf16())


# ----------------------------------------------------------------------------------------------
# The quantizer-kernel implementation


@functools.partial(jax.jit, static_argnames=("config", "gemm", "amax"))
def _both_implementations(x, w, dy, key, config, gemm="auto", amax="kernel"):
  """(the XLA implementation's y, dx, dw; the kernels' in interpret mode), one program."""
  return (_vjp(x, w, dy, key, config, "xla", gemm, amax),
          _vjp(x, w, dy, key, config, "pallas_interpret", gemm, amax))


TWO_TERM_AND_BF16 = MatmulConfig.nvfp4(x=Operand(terms=2), dy_dgrad=BF16,
                                      dy_wgrad=Operand(rounding="stochastic", terms=2))
# Four over Six on the forward operands: x 1×16 by absolute error, w 16×16 by squared error.
FOUR_OVER_SIX = MatmulConfig.nvfp4(x=Operand(scale_rule="4over6_mae"),
                                   w=Operand(block=(16, 16), scale_rule="4over6_mse"))
W_1X16 = MatmulConfig.nvfp4(w=Operand())  # w 1×16 along K (forward), re-quantized along N (dgrad)
KERNEL_CASES = [
    # Nearest x and w, stochastic dy, the Hadamard transform on the wgrad operands; x 3-D. The GEMMs
    # through jax.nn.scaled_matmul: the kernels then write no decoded operand (the other cases' GEMMs
    # read the decoded operands the kernels write).
    ("recipe, 3-D x, scaled_matmul GEMMs", NVFP4, (M0, M1, K), {"gemm": "scaled_matmul"}),
    # Every forward/dgrad rounding flipped, no Hadamard; x 2-D.
    ("flipped roundings, no Hadamard, 2-D x",
     MatmulConfig.nvfp4(x=SR, w=Operand(rounding="stochastic", block=(16, 16)), dy_dgrad=Operand(),
                        hadamard=False), (M0 * M1, K), {}),
    # Q(w) for the dgrad only (packed, no decoded forward operand); the Hadamard transform in f32.
    ("dgrad only", MatmulConfig.nvfp4(fwd=False, wgrad=False), (M0, M1, K), {}),
    # Stochastic rounding with counter-hash bits (x stochastic too), every implementation alike; the
    # quantizer kernels' first pass (the amax, whatever the rounding) as an XLA reduction (the other
    # cases take the kernels' own first pass).
    ("counter rounding bits, amax in XLA", MatmulConfig.nvfp4(rounding_bits="counter", x=SR),
     (M0, M1, K), {"amax": "xla"}),
    # Two-term operands (the kernels quantize each term; H applied before the first) and a BF16 one.
    ("two-term and bf16 operands", TWO_TERM_AND_BF16, (M0, M1, K), {}),
    # Four over Six on x and w (its own quantizer kernels; the dy operands stochastic, "max").
    ("four over six x and w", FOUR_OVER_SIX, (M0, M1, K), {}),
    # Four over Six on each term of a two-term x, on H·x (the transform fused into its kernels) and
    # on the dgrad's nearest dy.
    ("four over six, two-term x, wgrad and dgrad",
     MatmulConfig.nvfp4(x=Operand(terms=2, scale_rule="4over6_mse"), x_wgrad=Operand(scale_rule="4over6_mae"),
                        dy_dgrad=Operand(scale_rule="4over6_mae")), (M0 * M1, K), {}),
    # w in 1×16 blocks along K (the kernels' non-last-axis layout), re-quantized along N for the dgrad.
    ("w 1x16 along K, re-quantized along N", W_1X16, (M0, M1, K), {}),
    # x and dy split: the residuals quantized by the kernels.
    ("mean split", MatmulConfig.nvfp4(split=Split(("x", "dy"))), (M0, M1, K), {}),
    ("subspace split", MatmulConfig.nvfp4(split=Split(("x", "dy"), method="subspace", rank=4)),
     (M0 * M1, K), {}),
]


@pytest.mark.parametrize("name,config,x_shape,run", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
@pytest.mark.slow
def test_kernel_implementation_equals_xla_bit_for_bit(name, config, x_shape, run):
  """Forward, dgrad and wgrad of ``implementation="pallas_interpret"`` equal ``"xla"``'s bits: the
  kernels quantize to the same codes (same keys, same Hadamard order) and the GEMMs are the same."""
  x, w, dy = _data(jnp.bfloat16)
  x, dy = x.reshape(*x_shape[:-1], K), dy.reshape(*x_shape[:-1], N)
  xla, kernels = _both_implementations(x, w, dy, jax.random.key(7), config, **run)
  for out, a, b in zip(("y", "dx", "dw"), xla, kernels):
    assert a.shape == b.shape and a.dtype == b.dtype, out
    assert _bits_equal(a, b), (name, out)
  exact = _vjp(x, w, dy, None, MatmulConfig.bf16())
  for out, a, e, quantized in zip(("y", "dx", "dw"), kernels, exact, (config.fwd, config.dgrad, config.wgrad)):
    assert (_rel(a, e) > 0.05) == quantized, (name, out)  # quantized where the config says, only there


def test_auto_is_xla_on_the_cpu_and_kernel_choices_check_their_inputs():
  x, w = jnp.ones((32, 32)), jnp.ones((32, 32))
  auto = MatmulConfig.nvfp4()
  hlo = jax.jit(lambda x, w: nvfp4_matmul(x, w, key=jax.random.key(0), config=auto)).lower(x, w).as_text()
  assert "custom_call" not in hlo  # neither the kernels nor their interpret-mode loops
  pallas = functools.partial(nvfp4_matmul, config=MatmulConfig.nvfp4(rounding_bits="random"),
                             execution=MatmulExecution("pallas"))
  with pytest.raises(ValueError, match="threefry2x32 .*implementation='xla'"):  # jax.random's bits
    pallas(x, w, key=jax.random.key(0, impl="rbg"))
  big = jax.ShapeDtypeStruct((2**27, 16), jnp.bfloat16)  # 2**31 elements
  with pytest.raises(ValueError, match="fewer than 2\\*\\*31 elements"):
    jax.eval_shape(lambda x: pallas(x, jnp.ones((16, 16)), key=jax.random.key(0)), big)


@pytest.mark.slow
def test_auto_takes_the_kernels_on_one_cuda_device_only(monkeypatch):
  """``"auto"`` on a CUDA GPU: the kernels, unless the mesh has several devices (they would see
  gathered operands) or they would draw ``jax.random.bits`` of a key that is not threefry (their
  ``"random"`` bits are threefry's; the counter hash takes any key)."""
  monkeypatch.setattr(_platform, "default_platform", lambda: "cuda")
  two_h200s = AbstractMesh((2,), ("x",), abstract_device=H200.abstract_device)
  x, w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32, 32), jnp.float32)
  threefry, rbg = jax.random.key(0), jax.random.key(0, impl="rbg")
  for mesh, key, bits, kernels in ((H200, threefry, "counter", True), (two_h200s, threefry, "counter", False),
                                   (H200, rbg, "random", False), (H200, rbg, "counter", True),
                                   (H200, threefry, "random", True)):
    f = lambda x, w, key, bits=bits: nvfp4_matmul(x, w, key=key, config=MatmulConfig.nvfp4(rounding_bits=bits))
    with jax.sharding.use_abstract_mesh(mesh):
      hlo = jax.jit(f).trace(x, w, key).lower(lowering_platforms=("cuda",)).as_text()
    assert ("__gpu$xla.gpu.triton" in hlo) == kernels, (mesh, key, bits)


@pytest.mark.slow
def test_counter_rounding_bits(monkeypatch):
  """``rounding_bits="counter"``: each stochastic operand takes ``numerics.counter_bits`` of its key
  (a different stream from ``jax.random.bits``, unbiased), and on a CUDA GPU the kernels take any key
  kind, since no threefry bits are drawn."""
  x, w, dy = _data(jnp.bfloat16)
  key = jax.random.key(7)
  counter = MatmulConfig.nvfp4(rounding_bits="counter")
  keys = matmul._keys(key, counter)
  # Compiled, not op by op: the suite's time is XLA compiling programs, one per op when eager.
  want = jax.jit(lambda k: nvfp4.quantize(dy, rounding="stochastic", bits=numerics.counter_bits(k, dy.shape)))(
      keys["dy_dgrad"])
  dy_dgrad = jax.jit(lambda keys, config: matmul.quantize_operand(dy, "dy_dgrad", keys, config)[0][0],
                     static_argnums=1)
  got = dy_dgrad(keys, counter)
  assert _bits_equal(got.codes, want.codes) and _bits_equal(got.scales, want.scales)
  random = dy_dgrad(keys, dataclasses.replace(counter, rounding_bits="random"))
  assert not _bits_equal(got.codes, random.codes)
  # Unbiased: the mean over keys of the decoded operand approaches dy (as for the random bits).
  many = jax.jit(jax.vmap(lambda k: dy_dgrad(matmul._keys(k, counter), counter).dequantize(
      jnp.float32)))(jax.random.split(key, 256))
  err = jnp.abs(many.mean(0) - dy.astype(jnp.float32)).mean() / jnp.abs(dy.astype(jnp.float32)).mean()
  assert err < 0.02, err
  with pytest.raises(ValueError, match="rounding_bits must be one of"):
    MatmulConfig.nvfp4(rounding_bits="philox")
  monkeypatch.setattr(_platform, "default_platform", lambda: "cuda")
  xs, ws = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32, 32), jnp.float32)
  cfg = MatmulConfig.nvfp4(rounding_bits="counter")
  f = lambda x, w, key: nvfp4_matmul(x, w, key=key, config=cfg)
  rbg = jax.random.key(0, impl="rbg")
  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(f).trace(xs, ws, rbg).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in hlo


def _lowered_vjp(config, implementation="xla"):
  """The StableHLO text of ``nvfp4_matmul``'s forward and backward, lowered for an H200."""
  x = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 384), jnp.float32)
  dy = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
  key = jax.random.key(0)
  with jax.sharding.use_abstract_mesh(H200):
    lowered = _jit_vjp.trace(x, w, dy, key, config=config, implementation=implementation)
    hlo = lowered.lower(lowering_platforms=("cuda",)).as_text()
  return hlo


def _lines_without(hlo: str, prefix: str) -> int:
  """The lines of StableHLO text ``hlo`` outside its functions whose names start with ``prefix``."""
  blocks = re.split(r"(?m)^(?=  func\.func )", hlo)
  named = lambda b: re.match(rf"  func\.func (?:private |public )?@{re.escape(prefix)}", b)
  return sum(len(b.splitlines()) for b in blocks if not named(b))


@pytest.mark.slow
def test_kernel_implementation_lowers_for_h200_to_a_small_program(triton_modules):
  """The forward and backward with ``implementation="pallas"`` lower to CUDA with two Triton kernels
  per quantized operand (amax, quantize: five operands), in a program several times smaller than the
  XLA implementation's integer quantizer graphs, which XLA compiles slowly. (Both draw the stochastic
  rounding bits with the same ``threefry2x32`` functions, left out of the comparison.)"""
  kernels = _lowered_vjp(NVFP4, "pallas")
  assert kernels.count("__gpu$xla.gpu.triton") == 10 and len(triton_modules) == 10
  assert sum("@nvfp4_quantize" in m for m in triton_modules) == 5
  xla = _lowered_vjp(NVFP4)
  assert "__gpu$xla.gpu.triton" not in xla and "@threefry2x32" in kernels and "@threefry2x32" in xla
  ours = _lines_without(kernels, "threefry2x32"), _lines_without(xla, "threefry2x32")
  assert ours[0] * 5 < ours[1], ours


@pytest.mark.slow
def test_w_1x16_kernels_lower_for_h200_with_the_dgrad_requantization(triton_modules):
  """With w in 1×16 blocks the kernel implementation quantizes six operands (the dgrad's weight
  re-quantized along N besides the five): two Triton kernels each."""
  hlo = _lowered_vjp(W_1X16, "pallas")
  assert hlo.count("__gpu$xla.gpu.triton") == 12 and len(triton_modules) == 12
  assert sum("@nvfp4_quantize" in m for m in triton_modules) == 6


# ----------------------------------------------------------------------------------------------
# GEMMs through jax.nn.scaled_matmul (FP4 tensor cores; on the CPU, its dequantize-then-dot lowering)


@pytest.mark.parametrize("block,axis,k_axis", [((1, 16), 1, 1), ((1, 16), 0, 0), ((16, 16), 1, 1),
                                               ((16, 16), 1, 0)])
@pytest.mark.slow
def test_scaled_matmul_operand_layout(block, axis, k_axis):
  """``elements * repeat(scales, 16)`` along K is the tensor's ``scaled_elements`` with K last, exactly:
  the float4 bitcast of the codes, and a 16×16 tile's scale repeated over its rows."""
  x = jax.random.normal(jax.random.key(3), (48, 64)) * 3.0
  t = nvfp4.quantize(x, block=block, axis=axis)
  elements, scales = nvfp4.scaled_matmul_operand(t, k_axis)
  assert elements.dtype == jnp.float4_e2m1fn and scales.dtype == jnp.float8_e4m3fn
  rows, k = (48, 64) if k_axis == 1 else (64, 48)
  assert elements.shape == (rows, k) and scales.shape == (rows, k // 16)
  got = elements.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), 16, axis=1)
  want = t.scaled_elements(jnp.float32)
  np.testing.assert_array_equal(got, want if k_axis == 1 else want.T)
  with pytest.raises(ValueError, match="blocks along the contraction"):
    nvfp4.scaled_matmul_operand(nvfp4.quantize(x, axis=1 - k_axis), k_axis) if block == (1, 16) else (
        nvfp4.scaled_matmul_operand(nvfp4.quantize(x, axis=0), 1))


@pytest.mark.parametrize("implementation,config", [("xla", NVFP4), ("pallas_interpret", NVFP4), ("xla", W_1X16)],
                         ids=["xla", "pallas_interpret", "xla, w 1x16"])
@pytest.mark.slow
def test_scaled_matmul_gemms_equal_decoded_gemms(implementation, config):
  """``gemm="scaled_matmul"`` gives the decoded GEMMs' forward, dgrad and wgrad up to float32
  summation order (on the CPU, ``jax.nn.scaled_matmul`` dequantizes and dots in float32); a 1×16
  ``w`` feeds it blocked along K in the forward and along N in the dgrad."""
  x, w, dy = _data(jnp.float32)
  key = jax.random.key(5)
  run = functools.partial(_jit_vjp, x, w, dy, key, config=config, implementation=implementation)
  for name, a, b in zip(("y", "dx", "dw"), run(gemm="scaled_matmul"), run(gemm="decoded")):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))), err_msg=name)


def _count_primitives(jaxpr, names) -> dict:
  """How many equations of each primitive in ``names`` a closed jaxpr holds, sub-jaxprs included
  (printed jaxprs show a jitted sub-jaxpr once however often it is called)."""
  counts = dict.fromkeys(names, 0)

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name in counts:
        counts[eqn.primitive.name] += 1
      for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          if hasattr(sub, "eqns"):
            walk(sub)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)

  walk(jaxpr.jaxpr)
  return counts


def test_gemm_auto_takes_scaled_matmul_on_fp4_tensor_cores_only(monkeypatch):
  """``gemm="auto"`` is ``scaled_matmul`` where ``_platform.fp4_tensor_cores()`` (a CUDA GPU of
  compute capability >= 10): the forward, dgrad and wgrad are three ``jax.nn.scaled_matmul`` calls
  next to the quantizer kernels, and lower to cuDNN's block-scaled GEMM custom call; on an H200
  (9.0) the GEMMs stay decoded."""
  monkeypatch.setattr(_platform, "default_platform", lambda: "cuda")
  x, w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32, 32), jnp.float32)
  dy, key = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.random.key(0)
  names = ("scaled_matmul_wrapper", "pallas_call")
  for fp4_cores in (True, False):
    monkeypatch.setattr(_platform, "fp4_tensor_cores", lambda v=fp4_cores: v)
    with jax.sharding.use_abstract_mesh(H200):
      jaxpr = jax.make_jaxpr(functools.partial(_vjp, config=NVFP4, implementation="auto"))(x, w, dy, key)
    counts = _count_primitives(jaxpr, names)
    assert counts["scaled_matmul_wrapper"] == (3 if fp4_cores else 0), counts
    assert counts["pallas_call"] >= 5, counts  # the quantizer kernels, either way
  # The CUDA lowering (XLA's quantizers: the Pallas kernels need an abstract H200 to lower on the CPU,
  # and scaled_matmul's custom partitioning cannot lower under an abstract mesh).
  hlo = _jit_vjp.trace(x, w, dy, key, config=NVFP4, gemm="scaled_matmul").lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__op$block_scaled_dot" in hlo  # (GEMMs of one shape share one lowered function)


def test_fp4_tensor_cores_reads_the_compute_capability(monkeypatch):
  class Client:
    platform_version = "cuda 12090"

  class Device:
    platform, client = "gpu", Client()

    def __init__(self, cc):
      self.compute_capability = cc

  assert not _platform.fp4_tensor_cores()  # the CPU
  for cc, fp4_cores in (("9.0", False), ("10.0", True), ("12.0", True), ("8.9", False)):
    monkeypatch.setattr(_platform, "_default_device", lambda cc=cc: Device(cc))
    assert _platform.fp4_tensor_cores() == fp4_cores, cc


# ----------------------------------------------------------------------------------------------
# Attribution (BF16 operands) and remedies (two-term operands, low-rank splits of x and dy)

ALL_BF16 = dict.fromkeys(matmul.OPERANDS, BF16)
ALL_TWO_TERM = {op: dataclasses.replace(getattr(NVFP4, op), terms=2) for op in matmul.OPERANDS}
MEAN_SPLIT = MatmulConfig.nvfp4(split=Split(("x", "dy")))
SUBSPACE_SPLIT = MatmulConfig.nvfp4(split=Split(("x", "dy"), method="subspace", rank=4))


def _structured(seed=0):
  """x and dy whose tokens share a large mean (x) or a rank-2 part (dy) over Gaussian noise."""
  kx, kw, kd, ku, kv = jax.random.split(jax.random.key(seed), 5)
  mu = 6.0 * jax.random.normal(kx, (1, K))
  x = mu + jax.random.normal(kw, (M0 * M1, K))
  u, v = jax.random.normal(ku, (M0 * M1, 2)), jax.random.normal(kv, (2, N))
  dy = 4.0 * u @ v + jax.random.normal(kd, (M0 * M1, N))
  w = jax.random.normal(jax.random.fold_in(kw, 1), (K, N)) * 0.2
  return x, w, dy


def test_new_config_fields_are_validated_and_need_keys_where_they_draw_bits():
  with pytest.raises(ValueError, match=r"split.tensors=\('w',\)"):
    Split(("w",))
  with pytest.raises(ValueError, match=r"split.tensors=\('x', 'x'\)"):
    Split(("x", "x"))
  with pytest.raises(ValueError, match="split.tensors='x'"):  # no comma strings
    Split("x")
  with pytest.raises(ValueError, match="split.method must be one of"):
    Split(method="svd")
  with pytest.raises(ValueError, match="split.rank must be an int >= 1"):
    Split(rank=0)
  with pytest.raises(ValueError, match="MatmulConfig.split must be a Split"):
    MatmulConfig(split=("x",))
  assert Split(["x"]).tensors == ("x",) and hash(Split(["x"])) == hash(Split(("x",)))
  deterministic = dict(**NEAREST_DY, hadamard=False)
  assert not MatmulConfig.nvfp4(split=Split(("x", "dy")), **deterministic).needs_key  # the mean draws nothing
  assert MatmulConfig.nvfp4(split=Split(("x",), method="subspace"), **deterministic).needs_key
  # A split of a tensor that no quantized GEMM reads is no split.
  assert not MatmulConfig.nvfp4(fwd=False, wgrad=False, split=Split(("x",))).splits("x")
  # BF16 operands draw no bits: a forward with only Q(w) nearest needs no key.
  assert not MatmulConfig.nvfp4(dy_dgrad=BF16, dy_wgrad=BF16, hadamard=False).needs_key


@functools.partial(jax.jit, static_argnames="config")
def _op_and_exact(x, w, dy, key, config):
  return _vjp(x, w, dy, key, config), _vjp(x, w, dy, None, MatmulConfig.bf16())


def test_bf16_operands_make_an_nvfp4_times_bf16_gemm():
  """A BF16 ``x`` in the forward: ``y = x · Q(w)`` (Q(w) decoded exactly), and with every
  operand in BF16 (no Hadamard) the three GEMMs are the unquantized products."""
  x, w, dy = _data()
  cfg = MatmulConfig.nvfp4(x=BF16, hadamard=False)
  (y, _, _), _ = _op_and_exact(x, w, dy, jax.random.key(1), cfg)
  qw = nvfp4.quantize(w, block=(16, 16)).dequantize(jnp.float32)
  want = jnp.dot(x.reshape(-1, K), qw, precision="highest").reshape(y.shape)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  none = MatmulConfig.nvfp4(**ALL_BF16, hadamard=False)
  got, exact = _op_and_exact(x, w, dy, jax.random.key(1), none)
  for name, g, e in zip(("y", "dx", "dw"), got, exact):
    assert _rel(g, e) < 1e-5, (name, _rel(g, e))


@pytest.mark.slow
def test_two_term_operands_cut_the_gemm_error_several_fold():
  """``Q1 + Q(a − Q1)`` on every operand: each GEMM's error against the exact product is below a
  quarter of the one-term recipe's (≈ 1/8 of it per operand)."""
  x, w, dy = _data()
  key = jax.random.key(3)
  one, exact = _op_and_exact(x, w, dy, key, NVFP4)
  two, _ = _op_and_exact(x, w, dy, key, MatmulConfig.nvfp4(**ALL_TWO_TERM))
  for name, a, b, e in zip(("y", "dx", "dw"), one, two, exact):
    assert _rel(b, e) < 0.25 * _rel(a, e), (name, _rel(a, e), _rel(b, e))
  # A two-term operand is the sum of its terms' GEMMs: term 1 alone is the one-term operand's.
  keys = matmul._keys(key, NVFP4)
  terms = matmul.quantize_operand(x.reshape(-1, K), "x", keys, MatmulConfig.nvfp4(x=Operand(terms=2)))
  q1 = matmul.quantize_operand(x.reshape(-1, K), "x", keys, NVFP4)
  assert len(terms) == 2 and len(q1) == 1
  assert _bits_equal(terms[0][0].codes, q1[0][0].codes)


def test_two_term_operand_and_its_gemm_are_the_terms_quantized_and_multiplied_in_order():
  """A two-term operand is ``Q1 = Q(a)`` and ``Q2 = Q(a − Q1)`` from the materialized ``Q1`` (its
  second term with the key folded by 1), and the GEMM of two of them is the sum of the four term
  GEMMs in the order ``(1, 1), (1, 2), (2, 1), (2, 2)``: bit for bit."""
  x, w, _ = _data()
  x2 = x.reshape(-1, K)
  cfg = MatmulConfig.nvfp4(x=Operand(terms=2), w=Operand(rounding="stochastic", block=(16, 16), terms=2))
  keys = matmul._keys(jax.random.key(6), cfg)
  tx, tw = (matmul.quantize_operand(a, op, keys, cfg) for a, op in ((x2, "x"), (w, "w")))
  x1 = nvfp4.quantize(x2, axis=-1)
  xs = (x1, nvfp4.quantize(x2 - x1.dequantize(jnp.float32), axis=-1))
  bits = lambda k, a: numerics.stochastic_bits(k, a.shape, cfg.rounding_bits)
  w1 = nvfp4.quantize(w, block=(16, 16), rounding="stochastic", bits=bits(keys["w"], w))
  r = w - w1.dequantize(jnp.float32)
  ws = (w1, nvfp4.quantize(r, block=(16, 16), rounding="stochastic", bits=bits(jax.random.fold_in(keys["w"], 1), r)))
  for got, want in zip((*tx, *tw), (*xs, *ws), strict=True):
    assert got[1] is None
    assert all(_bits_equal(np.atleast_1d(g), np.atleast_1d(e))
               for g, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want), strict=True))
  gemm = lambda a, b: nvfp4.gemm(a, b, ((1,), (0,)))
  want = gemm(xs[0], ws[0]) + gemm(xs[0], ws[1]) + gemm(xs[1], ws[0]) + gemm(xs[1], ws[1])
  assert _bits_equal(matmul._gemm_operands(tx, tw, ((1,), (0,))), want)


@pytest.mark.parametrize("config", [MEAN_SPLIT, SUBSPACE_SPLIT], ids=["mean", "subspace"])
def test_a_split_is_exact_algebra_when_nothing_is_quantized(config):
  """With every operand in BF16 the split changes nothing but rounding: y, dx and dw equal the
  unquantized products (the low-rank terms carry bf16 operands: ≤ 1% where U·P is most of x)."""
  x, w, dy = _structured()
  cfg = dataclasses.replace(config, **ALL_BF16, hadamard=False)
  got, exact = _op_and_exact(x, w, dy, jax.random.key(2), cfg)
  for name, g, e in zip(("y", "dx", "dw"), got, exact):
    assert _rel(g, e) < 1e-2, (name, _rel(g, e))


@pytest.mark.slow
@pytest.mark.parametrize("config", [MEAN_SPLIT, SUBSPACE_SPLIT], ids=["mean", "subspace"])
def test_a_split_removes_the_error_of_what_it_takes_out(config):
  """On tensors with a large token mean (x) and a rank-2 part (dy), the split's GEMMs carry only
  the residual's quantization error: forward, dgrad and wgrad errors fall well below the unsplit
  recipe's (the mean split removes x's mean; the subspace split both structures)."""
  x, w, dy = _structured()
  key = jax.random.key(4)
  base, exact = _op_and_exact(x, w, dy, key, NVFP4)
  split, _ = _op_and_exact(x, w, dy, key, config)
  errs = {n: (_rel(b, e), _rel(s, e)) for n, b, s, e in zip(("y", "dx", "dw"), base, split, exact)}
  assert errs["y"][1] < 0.5 * errs["y"][0], errs  # x's mean is in both splits
  if config.split.method == "subspace":
    assert errs["dx"][1] < 0.5 * errs["dx"][0], errs  # dy's rank-2 part
  for name, (b, s) in errs.items():
    assert s < 1.05 * b, (name, errs)


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    TWO_TERM_AND_BF16, MEAN_SPLIT, SUBSPACE_SPLIT, FOUR_OVER_SIX],
    ids=["two-term and bf16 operands", "mean split", "subspace split", "four over six x and w"])
def test_new_configs_match_their_dequantized_reference(config):
  x, w, dy = _structured()
  x, dy = x.reshape(M0, M1, K), dy.reshape(M0, M1, N)
  op, ref, flat, _ = _with_refs(x, w, dy, jax.random.key(7), config)
  for name, o, r in zip(("y", "dx", "dw"), op, ref):
    assert o.shape == r.shape and o.dtype == r.dtype, name
    np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * float(jnp.abs(r).max()), err_msg=name)
  for o, f in zip(op, flat):
    assert _bits_equal(o.reshape(f.shape), f)


def _tensors_equal(got, want) -> bool:
  return all(_bits_equal(np.atleast_1d(g), np.atleast_1d(e))
             for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def test_scale_rule_reaches_each_term_of_the_operand():
  """``Operand.scale_rule`` is ``nvfp4.quantize``'s: the operand's tensors (each term of a two-term
  one) are ``nvfp4.quantize(..., scale_rule=...)``'s, and they differ from the ``"max"`` rule's."""
  x, w, _ = _data()
  x2 = x.reshape(-1, K)
  cfg = MatmulConfig.nvfp4(x=Operand(terms=2, scale_rule="4over6_mae"),
                           w=Operand(block=(16, 16), scale_rule="4over6_mse"))
  keys = matmul._keys(jax.random.key(6), cfg)
  tx, tw = (matmul.quantize_operand(a, op, keys, cfg) for a, op in ((x2, "x"), (w, "w")))
  x1 = nvfp4.quantize(x2, axis=-1, scale_rule="4over6_mae")
  xs = (x1, nvfp4.quantize(x2 - x1.dequantize(jnp.float32), axis=-1, scale_rule="4over6_mae"))
  ws = (nvfp4.quantize(w, block=(16, 16), scale_rule="4over6_mse"),)
  for got, want in zip((*tx, *tw), (*xs, *ws), strict=True):
    assert got[1] is None and _tensors_equal(got[0], want)
  # Not the "max" rule's tensors (global scale from 256), and some of x's blocks keep the
  # amax-to-4 candidate (their largest element is 4).
  for got, a, block in ((tx[0][0], x2, (1, 16)), (tw[0][0], w, (16, 16))):
    assert not _tensors_equal(got, nvfp4.quantize(a, block=block, axis=-1)), block
  at_four = lambda t: int(jnp.sum(jnp.abs(t.elements()).reshape(-1, 16).max(axis=1) == 4))
  assert at_four(tx[0][0]) > at_four(nvfp4.quantize(x2, axis=-1))
  # The op's forward is the GEMM of those operands.
  y = nvfp4_matmul(x2, w, key=jax.random.key(6), config=cfg)
  gemm = lambda a, b: nvfp4.gemm(a, b, ((1,), (0,)))
  assert _bits_equal(y, (gemm(xs[0], ws[0]) + gemm(xs[1], ws[0])).astype(y.dtype))


def test_scale_rule_is_validated_where_operands_are_specified():
  from fp4jax.ops.attention import AttentionConfig
  from fp4jax.optim import AdamNvfp4Options
  from fp4jax.optim.ns import check_operand
  with pytest.raises(ValueError, match="Operand.scale_rule must be one of"):
    Operand(scale_rule="4over6")
  with pytest.raises(ValueError, match=r"Operand.scale_rule='4over6_mse' requires Operand.rounding='nearest'"):
    Operand(rounding="stochastic", scale_rule="4over6_mse")
  assert Operand(scale_rule="4over6_mae") != Operand()  # a static argument: part of the hash
  MatmulConfig.nvfp4(dy_dgrad=Operand(scale_rule="4over6_mse"), x_wgrad=Operand(scale_rule="4over6_mae"))
  AttentionConfig.nvfp4(q=Operand(scale_rule="4over6_mse"))  # q, k and v take Four over Six
  with pytest.raises(ValueError, match="AttentionConfig.p.scale_rule must be 'max'"):
    AttentionConfig.nvfp4(p=Operand(scale_rule="4over6_mse"))
  AttentionConfig.nvfp4(v=Operand(format="bf16", scale_rule="4over6_mse"))  # unquantized: no rule
  AdamNvfp4Options(mu=Operand(scale_rule="4over6_mae"))  # a nearest-rounded moment takes Four over Six
  with pytest.raises(ValueError, match="ns.scale_rule must be 'max'"):
    check_operand("ns", Operand(terms=2, scale_rule="4over6_mae"))


# ----------------------------------------------------------------------------------------------
# w in 1×16 blocks: Q_K(w) in the forward, Q_N(deq(Q_K(w))) in the dgrad


@pytest.mark.parametrize("scale_rule", ["max", "4over6_mse"])
def test_w_1x16_forward_is_q_k_and_dgrad_is_q_n_of_its_dequantized_values(scale_rule):
  """y and dx of ``w.block=(1, 16)`` are the GEMMs of operands built here from ``nvfp4.quantize``
  alone: ``Q_K(w)`` in the forward, ``Q_N(deq(Q_K(w)))`` in the dgrad (bit for bit); the dgrad's
  weight is neither the forward's nor an independent ``Q_N(w)``, and nearer the forward's."""
  x, w, dy = _data()
  x, dy = x.reshape(-1, K), dy.reshape(-1, N)
  config = MatmulConfig.nvfp4(w=Operand(scale_rule=scale_rule), **NEAREST_DY, hadamard=False)

  @jax.jit
  def both(x, w, dy):
    got = _vjp(x, w, dy, None, config)
    q_k = nvfp4.quantize(w, axis=0, scale_rule=scale_rule)
    q_n = nvfp4.quantize(q_k.dequantize(jnp.float32), axis=1, scale_rule=scale_rule)
    y = nvfp4.gemm(nvfp4.quantize(x), q_k).astype(x.dtype)
    dx = nvfp4.gemm(nvfp4.quantize(dy), q_n, ((1,), (1,))).astype(x.dtype)
    keys = matmul._keys(None, config)
    op = matmul.dgrad_weight(matmul.quantize_operand(w, "w", keys, config), keys, config)[0][0]
    independent = nvfp4.quantize(w, axis=1, scale_rule=scale_rule).dequantize()
    return got, (y, dx), (op, q_n), (q_k.dequantize(), q_n.dequantize(), independent)

  (y, dx, _), (y_want, dx_want), (op, q_n), (fwd_w, dgrad_w, independent) = both(x, w, dy)
  assert _bits_equal(y, y_want) and _bits_equal(dx, dx_want)
  assert _tensors_equal(op, q_n)
  assert op.block == (1, 16) and op.axis == 1
  # The dgrad's weight moves from the forward's, but less than an independent Q_N(w) (about 9% and
  # 13% relative on a Gaussian weight).
  assert 0.02 < _rel(dgrad_w, fwd_w) < 0.85 * _rel(independent, fwd_w), (_rel(dgrad_w, fwd_w), _rel(independent, fwd_w))


@pytest.mark.slow
def test_w_1x16_matches_its_dequantized_reference_and_differs_from_16x16_tiles():
  """A two-term, stochastically rounded ``w`` in 1×16 blocks: every GEMM equals the f32 reference from the same
  operands (the reference builds the dgrad's weight the same way), and the forward differs from the
  16×16 recipe's."""
  x, w, dy = _data()
  key = jax.random.key(3)
  op, ref, _, _ = _with_refs(x, w, dy, key, MatmulConfig.nvfp4(w=Operand(rounding="stochastic", terms=2)))
  for name, a, r in zip(("y", "dx", "dw"), op, ref):
    np.testing.assert_allclose(a, r, rtol=2e-6, atol=2e-6 * float(jnp.abs(r).max()), err_msg=name)
  tiles = _with_refs(x, w, dy, key, NVFP4)[0]
  assert not _bits_equal(op[0], tiles[0])


def test_a_two_term_w_pre_summed_into_one_gemm_would_change_bits():
  """Why a two-term ``w`` stays two GEMMs (module docstring): the decoded terms' float32 sum mostly
  does not fit bf16, and one float32-operand GEMM on it differs from the two GEMMs' bits."""
  x, w, _ = _data()
  config = MatmulConfig.nvfp4(w=Operand(block=(16, 16), terms=2), hadamard=False, **NEAREST_DY)

  @jax.jit
  def both(x, w):
    keys = matmul._keys(None, config)
    qx, qw = (matmul.quantize_operand(a, op, keys, config) for a, op in ((x, "x"), (w, "w")))
    summed = qw[0][0].dequantize(jnp.float32) + qw[1][0].dequantize(jnp.float32)
    one = jnp.dot(qx[0][0].scaled_elements(jnp.float32), summed, precision=jax.lax.Precision.HIGHEST)
    return matmul._gemm_operands(qx, qw, matmul._NN), one * qx[0][0].global_scale, summed

  two, one, summed = both(x.reshape(-1, K), w)
  assert float(jnp.mean(summed.astype(jnp.bfloat16).astype(jnp.float32) == summed)) < 0.2
  assert not _bits_equal(one, two) and _rel(one, two) < 1e-6
