"""fp4jax.ops.attention: the bf16 config against jax.nn.dot_product_attention, the NVFP4 forward against
attention on the dequantized operands, tensor reuse (bit-identical P), dS rounding, GQA, ragged T,
config switches and errors.

Compilation dominates on the CPU: the checks share a few jitted functions of small shapes
(B = 1, T = 32, H = 4 query heads over Hk = 2 key/value heads, D = 64).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from conftest import H200
from jax.sharding import AbstractMesh
from nvfp4_np_reference import dequantize_ref, quantize_ref

from fp4jax import _platform, nvfp4, quant
from fp4jax.analysis import ds_scale_error
from fp4jax.ops import attention as attn
from fp4jax.ops.attention import (
    AttentionConfig,
    nvfp4_attention,
    nvfp4_attention_reference,
    nvfp4_attention_vjp_reference,
)
from fp4jax.ops.attention import _ds_bits as ds_bits
from fp4jax.ops.attention import _fake_quant_ds as fake_quant_ds
from fp4jax.quant import Operand

B, T, H, HK, D = 1, 32, 4, 2, 64
NVFP4 = AttentionConfig.nvfp4()
BF16 = AttentionConfig.bf16()
KEY = jax.random.key(7)
SMOOTH = AttentionConfig.nvfp4(k_smooth=True)
FOUR_OVER_SIX = AttentionConfig.nvfp4(q=Operand(scale_rule="4over6_mse"), k=Operand(scale_rule="4over6_mse"),
                                      v=Operand(scale_rule="4over6_mae"))


def _switched(config=NVFP4, **formats) -> AttentionConfig:
  """``config`` with the named operands' format switched (``v="nvfp4"``), each keeping its rounding."""
  return dataclasses.replace(config, **{n: dataclasses.replace(getattr(config, n), format=f)
                                        for n, f in formats.items()})


def _data(t=T, s=None, h=H, hk=HK, dtype=jnp.bfloat16, seed=0):
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  s = t if s is None else s
  q = jax.random.normal(kq, (B, t, h, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, s, hk, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, s, hk, D), jnp.float32).astype(dtype)
  do = jax.random.normal(kd, (B, t, h, D), jnp.float32).astype(dtype)
  return q, k, v, do


@functools.partial(jax.jit, static_argnames=("causal", "config"))
def _op(q, k, v, do, key, causal=True, config=NVFP4):
  """(o, dq, dk, dv) of nvfp4_attention (implementation="xla")."""
  f = lambda q, k, v: nvfp4_attention(q, k, v, causal=causal, key=key, config=config,
                                      implementation="xla")
  o, vjp = jax.vjp(f, q, k, v)
  return (o, *vjp(do))


@functools.partial(jax.jit, static_argnames=("causal",))
def _dpa(q, k, v, do, causal=True):
  """(o, dq, dk, dv) of jax.nn.dot_product_attention (XLA)."""
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                   implementation="xla")
  o, vjp = jax.vjp(f, q, k, v)
  return (o, *vjp(do))


_ref_fwd = jax.jit(nvfp4_attention_reference, static_argnames=("causal", "config", "return_stats"))
_ref_vjp = jax.jit(nvfp4_attention_vjp_reference,
                   static_argnames=("causal", "config", "return_intermediates"))


def _f32(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def _close(a, b, rtol):
  """Max error relative to the reference's max magnitude (bf16 outputs: rounding of large entries)."""
  a, b = _f32(a), _f32(b)
  err = np.abs(a - b).max() / np.abs(b).max()
  assert err <= rtol, f"relative max error {err:.3g} > {rtol}"


def _rel(a, b):
  a, b = _f32(a), _f32(b)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@jax.jit
def _deq(x):
  return nvfp4.quantize(x, block=(1, 16), axis=-1).dequantize(x.dtype)


# ----------------------------------------------------------------------------------------------
# Config


def test_config_defaults_and_validation():
  """The method: q, k nearest and dS stochastic in 16×16 blocks; V, P, dO unquantized, and when
  switched to NVFP4 rounded as before (V, P nearest, dO stochastic)."""
  nearest, sr = Operand(), Operand(rounding="stochastic")
  assert (NVFP4.q, NVFP4.k, NVFP4.ds) == (nearest, nearest, Operand(rounding="stochastic", block=(16, 16)))
  assert [n for n in attn.OPERANDS if NVFP4.quantizes(n)] == ["q", "k", "ds"]
  assert [n for n in attn.OPERANDS if NVFP4.stochastic(n)] == ["ds"] and NVFP4.needs_key and NVFP4.reuse
  pv = _switched(v="nvfp4", p="nvfp4", do="nvfp4")
  assert (pv.v, pv.p, pv.do) == (nearest, nearest, sr) and pv.stochastic("do")
  assert not any(BF16.quantizes(n) for n in attn.OPERANDS) and not BF16.needs_key
  assert _switched(BF16, **dict.fromkeys(attn.OPERANDS, "nvfp4")) == pv  # bf16() keeps the roundings
  assert not AttentionConfig.nvfp4(ds=quant.BF16).quantizes("ds")  # a bf16 operand's block is moot
  assert AttentionConfig.nvfp4(ds_tile=[32, 128]).ds_tile == (32, 128)
  assert hash(AttentionConfig.nvfp4(v=Operand())) == hash(AttentionConfig(v=Operand()))
  assert not NVFP4.k_smooth and all(getattr(NVFP4, n).scale_rule == "max" for n in attn.OPERANDS)
  assert AttentionConfig.nvfp4(k=Operand(scale_rule="4over6_mae"), k_smooth=True).k.scale_rule == "4over6_mae"
  for bad, match in ((dict(q="nvfp4"), "AttentionConfig.q must be an fp4jax.quant.Operand"),
                     (dict(v=Operand(terms=2)), "AttentionConfig.v.terms must be 1"),
                     (dict(ds=Operand()), r"AttentionConfig.ds.block must be \(16, 16\)"),
                     (dict(k=Operand(block=(16, 16))), r"AttentionConfig.k.block must be \(1, 16\)"),
                     (dict(p=Operand(scale_rule="4over6_mse")), "AttentionConfig.p.scale_rule must be 'max'"),
                     (dict(ds=Operand(block=(16, 16), scale_rule="4over6_mae")),
                      "AttentionConfig.ds.scale_rule must be 'max'"),
                     (dict(k_smooth=1), "AttentionConfig.k_smooth must be a bool"),
                     (dict(hadamard="yes"), "AttentionConfig.hadamard must be a bool"),
                     (dict(reuse=1), "reuse"), (dict(ds_tile=(64, 40)), "multiples of 16"),
                     (dict(ds_tile=(48, 64)), "powers of two"), (dict(ds_tile=64), "rows, cols")):
    with pytest.raises(ValueError, match=match):
      AttentionConfig.nvfp4(**bad)


# ----------------------------------------------------------------------------------------------
# The bf16 config is jax.nn.dot_product_attention; the NVFP4 forward is attention on deq(Q(q)), deq(Q(k))


def test_bf16_config_equals_dot_product_attention():
  q, k, v, do = _data()
  ours, theirs = _op(q, k, v, do, None, config=BF16), _dpa(q, k, v, do)
  for a, b in zip(ours, theirs, strict=True):
    assert a.dtype == b.dtype == jnp.bfloat16
    _close(a, b, 1e-2)


def test_bf16_config_equals_dot_product_attention_full_with_more_keys():
  q, k, v, do = _data(t=32, s=48)
  ours, theirs = _op(q, k, v, do, None, causal=False, config=BF16), _dpa(q, k, v, do, causal=False)
  for a, b in zip(ours, theirs, strict=True):
    assert a.shape == b.shape
    _close(a, b, 1e-2)


@pytest.mark.slow
def test_nvfp4_forward_is_attention_on_dequantized_q_k():
  q, k, v, do = _data()
  o = _op(q, k, v, do, KEY)[0]
  _close(o, _dpa(_deq(q), _deq(k), v, do)[0], 1e-2)
  assert _rel(o, _dpa(q, k, v, do)[0]) > 0.02  # quantization is real


def test_gradients_are_straight_through_the_quantizers():
  """With dS unquantized, the custom_vjp equals autodiff of attention on fake_quant(q), fake_quant(k)
  (f32 inputs: only summation order differs)."""
  q, k, v, do = _data(dtype=jnp.float32)
  config = _switched(ds="bf16")
  ours = _op(q, k, v, do, KEY, config=config)
  theirs = _dpa(_deq(q), _deq(k), v, do)  # _deq: forward values of nvfp4.fake_quant
  for a, b in zip(ours, theirs, strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_finite_differences_f32():
  q, k, v, _ = _data(t=16, h=2, hk=1, dtype=jnp.float32, seed=3)
  f = lambda q, k, v: nvfp4_attention(q, k, v, config=BF16, implementation="xla")
  jax.test_util.check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-2)


# ----------------------------------------------------------------------------------------------
# Tensor reuse


def test_forward_and_recomputed_probs_bit_identical():
  """The backward's P, recomputed from the packed Q(q), Q(k) and L, equals the forward's bit for bit
  (separately compiled); the vjp reference is the op's backward."""
  q, k, v, do = _data()
  _, p_fwd, lse = _ref_fwd(q, k, v, key=KEY, config=NVFP4, return_stats=True)
  grads, inter = _ref_vjp(q, k, v, do, key=KEY, config=NVFP4, return_intermediates=True)
  assert p_fwd.shape == (B, H, T, T) and lse.shape == (B, H, T)
  np.testing.assert_array_equal(p_fwd, inter["p"])
  np.testing.assert_allclose(p_fwd.sum(-1), 1.0, rtol=1e-5)
  for a, b in zip(_op(q, k, v, do, KEY)[1:], grads, strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(_f32(a), _f32(b))


def test_residuals_are_packed():
  q, k, v, _ = _data()
  fwd = lambda config: jax.eval_shape(
      lambda q, k, v: attn._attention_fwd(q, k, v, KEY, True, config, "xla")[1], q, k, v)
  res = fwd(NVFP4)
  assert isinstance(res.q, nvfp4.NVFP4Tensor) and isinstance(res.k, nvfp4.NVFP4Tensor)
  assert res.q.codes.dtype == jnp.uint8 and res.q.codes.shape == (B, T, H, D // 2)
  assert res.v.dtype == jnp.bfloat16 and res.lse.shape == (B, H, T) and res.lse.dtype == jnp.float32
  res = fwd(AttentionConfig.nvfp4(v=Operand(), reuse=False))
  assert res.q.shape == q.shape and res.q.dtype == q.dtype and isinstance(res.v, nvfp4.NVFP4Tensor)


@pytest.mark.slow
def test_reuse_off():
  """Without reuse the forward is the same, and the backward recomputes P from the unquantized q, k
  with the forward's log-sum-exp (a high-precision backward behind an FP4 forward): P is then not
  the forward's (its rows no longer sum to 1), and the gradients move."""
  q, k, v, do = _data()
  off_config = dataclasses.replace(NVFP4, reuse=False)
  on, off = _op(q, k, v, do, KEY), _op(q, k, v, do, KEY, config=off_config)
  np.testing.assert_array_equal(_f32(on[0]), _f32(off[0]))  # same forward
  assert 0 < _rel(off[1], on[1]) < 0.5 and np.isfinite(_f32(off[1])).all()
  _, p_fwd, lse = _ref_fwd(q, k, v, key=KEY, config=NVFP4, return_stats=True)
  _, inter = _ref_vjp(q, k, v, do, key=KEY, config=off_config, return_intermediates=True)
  scores = jnp.einsum("bthd,bshd->bhts", _f32(q), _f32(jnp.repeat(k, H // HK, axis=2)),
                      precision=jax.lax.Precision.HIGHEST) / np.sqrt(D)
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
  np.testing.assert_allclose(inter["p"], jnp.exp(scores - lse[..., None]), rtol=1e-4, atol=1e-6)
  assert not np.allclose(inter["p"], p_fwd) and not np.allclose(np.sum(inter["p"], -1), 1.0, rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# dS quantization


def test_ds_stochastic_rounding_is_unbiased():
  q, k, v, do = _data()
  ds = _ref_vjp(q, k, v, do, key=KEY, config=NVFP4, return_intermediates=True)[1]["ds"]
  n = 64
  draw = jax.jit(lambda key: fake_quant_ds(ds, ds_tile=(16, 16), bits=ds_bits(key, ds.shape)))
  draws = jnp.stack([draw(key) for key in jax.random.split(jax.random.key(1), n)])
  single, mean = _rel(draws[0], ds), _rel(draws.mean(0), ds)
  assert single > 0.1
  assert mean < 2.0 * single / np.sqrt(n)  # the error of the mean falls as 1/sqrt(n): no bias


def test_p_stochastic_rounding_is_unbiased():
  """Q(P) with stochastic rounding (bits from ``ds_bits`` per element): the mean of 64 draws is
  1/sqrt(64) as far from P as one draw, so no bias; nearest is deterministic."""
  q, k, v, do = _data()
  _, p, _ = _ref_fwd(q, k, v, key=KEY, return_stats=True)
  p = p.reshape(B, HK, H // HK, T, T)
  sr = AttentionConfig.nvfp4(p=Operand(rounding="stochastic"))
  draw = jax.jit(lambda key: attn._probs_operand(p, sr, {"p": key}, jnp.float32))
  n = 64
  draws = jnp.stack([draw(key) for key in jax.random.split(jax.random.key(2), n)])
  single, mean = _rel(draws[0], p), _rel(draws.mean(0), p)
  assert single > 0.05
  assert mean < 2.0 * single / np.sqrt(n)


def test_ds_stochastic_rounding_unbiased_through_dq():
  q, k, v, do = _data()
  exact = _op(q, k, v, do, KEY, config=_switched(ds="bf16"))
  draws = [_op(q, k, v, do, key)[1:] for key in jax.random.split(jax.random.key(2), 32)]
  for i in range(3):  # dq, dk, dv
    mean = jnp.stack([_f32(d[i]) for d in draws]).mean(0)
    if i == 2:  # dV does not see dS
      np.testing.assert_array_equal(_f32(draws[0][i]), _f32(exact[3]))
    else:
      assert _rel(mean, exact[i + 1]) < 0.45 * _rel(draws[0][i], exact[i + 1])


def test_ds_nearest_quantized_per_tile_in_dq_dk():
  """dQ = deq(Q(dS))·deq(Q(k)) and dK = deq(Q(dS))ᵀ·deq(Q(q)), dS quantized per ds_tile."""
  q, k, v, do = _data()
  config = AttentionConfig.nvfp4(ds=Operand(block=(16, 16)), ds_tile=(32, 16))
  (dq, dk, _), inter = _ref_vjp(q, k, v, do, config=config, return_intermediates=True)
  ds = jax.jit(functools.partial(fake_quant_ds, ds_tile=(32, 16), rounding="nearest"))(inter["ds"])
  ds = ds.astype(jnp.bfloat16)
  kd = jnp.repeat(_deq(k), H // HK, axis=2)
  ref_dq = jnp.einsum("bhts,bshd->bthd", ds, kd, preferred_element_type=jnp.float32)
  ref_dk = jnp.einsum("bhts,bthd->bshd", ds, _deq(q), preferred_element_type=jnp.float32)
  ref_dk = ref_dk.reshape(B, T, HK, H // HK, D).sum(3)
  _close(dq, ref_dq, 1e-2)
  _close(dk, ref_dk, 1e-2)


def _np_fake_quant(x):
  return dequantize_ref(*quantize_ref(np.asarray(x), block=(16, 16)), block=(16, 16))


def test_fake_quant_ds_scopes():
  """Each scope quantizes its parts as tensors of their own (checked against the numpy transcription
  of Transformer Engine's quantizer); ragged T and S are zero-padded to whole tiles."""
  ds = jax.random.normal(jax.random.key(0), (2, 2, 48, 80)) * jnp.exp(
      2 * jax.random.normal(jax.random.key(1), (2, 2, 48, 80)))
  fq = jax.jit(fake_quant_ds, static_argnames=("scope", "ds_tile", "rounding"))
  whole = fq(ds, scope="tensor", rounding="nearest")
  np.testing.assert_array_equal(whole, _np_fake_quant(ds))
  np.testing.assert_array_equal(fq(ds, scope="matrix", rounding="nearest")[1, 0], _np_fake_quant(ds[1, 0]))
  tile = fq(ds, ds_tile=(32, 32), rounding="nearest")  # 48 x 80 in 32 x 32 tiles
  for b, h, rows, cols in ((1, 0, slice(32, 48), slice(64, 80)), (0, 1, slice(0, 32), slice(32, 64))):
    np.testing.assert_array_equal(tile[b, h, rows, cols], _np_fake_quant(ds[b, h, rows, cols]))
  assert _rel(tile, ds) < _rel(whole, ds)  # finer second-level scales: less error
  with pytest.raises(ValueError, match="scope"):
    fake_quant_ds(ds, scope="row", rounding="nearest")
  with pytest.raises(ValueError, match="bits"):
    fake_quant_ds(ds)


@pytest.mark.slow
def test_ds_scale_error():
  q, k, v, do = _data(t=64, h=2, hk=2)
  config = AttentionConfig.nvfp4(ds_tile=(32, 32))
  err = jax.jit(functools.partial(ds_scale_error, config=config))(q, k, v, do, key=KEY)
  assert set(err) == {"tile", "matrix", "tensor"}
  assert float(err["matrix"]["vs_matrix"]) == 0.0
  for scope, e in err.items():
    assert 0.05 < float(e["ds_rel"]) < 0.4, scope
    np.testing.assert_allclose(e["ds_snr_db"], -20 * np.log10(float(e["ds_rel"])), rtol=1e-5)
    assert 0.05 < float(e["dq_rel"]) < 0.4 and 0.05 < float(e["dk_rel"]) < 0.4, scope
  assert float(err["tile"]["ds_rel"]) <= 1.05 * float(err["matrix"]["ds_rel"])


# ----------------------------------------------------------------------------------------------
# GQA, ragged T, config switches


@pytest.mark.slow
def test_gqa_equals_repeated_kv_heads():
  q, k, v, do = _data(dtype=jnp.float32)
  rep = lambda x: jnp.repeat(x, H // HK, axis=2)
  o, dq, dk, dv = _op(q, k, v, do, KEY)
  o_r, dq_r, dk_r, dv_r = _op(q, rep(k), rep(v), do, KEY)
  np.testing.assert_allclose(o, o_r, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dq, dq_r, rtol=1e-5, atol=1e-5)
  group_sum = lambda x: x.reshape(B, T, HK, H // HK, D).sum(3)
  np.testing.assert_allclose(dk, group_sum(dk_r), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dv, group_sum(dv_r), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ragged_t_equals_zero_padded_problem():
  """T not a multiple of 16 (nor of a ds tile) gives the first T rows of the problem padded with zero
  tokens and a zero cotangent: zeros change no amax, and the rounding bits depend on position only."""
  t = 20
  q, k, v, do = _data(t=t, dtype=jnp.float32)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, T - t), (0, 0), (0, 0)))
  ragged = _op(q, k, v, do, KEY)
  padded = _op(pad(q), pad(k), pad(v), pad(do), KEY)
  for a, b in zip(ragged, padded, strict=True):
    np.testing.assert_allclose(a, b[:, :t], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_config_switches_each_operand():
  q, k, v, do = _data()
  base = _op(q, k, v, do, KEY)
  fwd = lambda **kw: _ref_fwd(q, k, v, key=KEY, config=_switched(**kw))
  with_v = fwd(v="nvfp4")
  _close(with_v, _dpa(_deq(q), _deq(k), _deq(v), do)[0], 1e-2)
  assert _rel(with_v, base[0]) > 0.02
  _close(fwd(q="bf16", k="bf16"), _dpa(q, k, v, do)[0], 1e-2)
  assert _rel(fwd(p="nvfp4"), base[0]) > 0.02
  with_do = _op(q, k, v, do, KEY, config=_switched(do="nvfp4"))
  np.testing.assert_array_equal(_f32(with_do[0]), _f32(base[0]))
  assert all(_rel(a, b) > 0.02 for a, b in zip(with_do[1:], base[1:], strict=True))


def test_quantized_p():
  """P quantized in P·V and Pᵀ·dO; δ = rowsum(dO∘(P·V)) with the unquantized P, so each row of dS
  sums to 0 as for the exact gradient."""
  q, k, v, do = _data()
  grads, inter = _ref_vjp(q, k, v, do, key=KEY, return_intermediates=True,
                          config=_switched(p="nvfp4"))
  ds = inter["ds"]
  assert float(jnp.abs(ds.sum(-1)).max()) < 1e-2 * float(jnp.abs(ds).sum(-1).max())
  assert _rel(grads[2], _op(q, k, v, do, KEY)[3]) > 0.02  # dV = Q(P)ᵀ·dO


def test_auto_is_xla_on_cpu():
  q, k, v, _ = _data()
  jaxpr = lambda impl: str(jax.make_jaxpr(
      lambda q, k, v: nvfp4_attention(q, k, v, key=KEY, implementation=impl))(q, k, v))
  assert jaxpr("auto") == jaxpr("xla") != jaxpr("pallas_interpret")


def test_auto_takes_the_kernels_on_one_cuda_device_only(monkeypatch):
  """``"auto"`` on a CUDA GPU: the flash kernels, unless the mesh has several devices (the kernels
  take whole arrays; XLA would gather them around every call) or D is not a kernel head dim."""
  monkeypatch.setattr(_platform, "default_platform", lambda: "cuda")
  two_h200s = AbstractMesh((2,), ("x",), abstract_device=H200.abstract_device)
  for mesh, d, kernels in ((H200, 64, True), (two_h200s, 64, False), (H200, 32, False)):
    q = jax.ShapeDtypeStruct((1, 64, 2, d), jnp.bfloat16)
    f = lambda q, k, v: nvfp4_attention(q, k, v, key=KEY)
    with jax.sharding.use_abstract_mesh(mesh):
      hlo = jax.jit(f).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert ("__gpu$xla.gpu.triton" in hlo) == kernels, (mesh, d)


_PV = _switched(v="nvfp4", p="nvfp4", do="nvfp4")


@pytest.mark.parametrize("config", [
    NVFP4, NVFP4.nvfp4(reuse=False), _PV, dataclasses.replace(_PV, p=Operand(rounding="stochastic")),
    AttentionConfig.nvfp4(v=Operand()), dataclasses.replace(FOUR_OVER_SIX, k_smooth=True),
    AttentionConfig.nvfp4(ds_tile=(16, 16)), AttentionConfig.nvfp4(hadamard=True), _switched(q="bf16", k="bf16"),
], ids=["reuse", "no reuse", "V P dO nvfp4", "V P dO nvfp4, P stochastic", "V nvfp4",
        "K smoothing, 4/6 q k v", "dS tile 16", "Hadamard q k", "q k bf16, dS nvfp4"])
@pytest.mark.slow
def test_pallas_interpret_runs_the_kernels_on_the_same_operands(config):
  """The op's kernel path (interpret mode) against its XLA path: O to bf16 rounding and dV exact; dQ
  and dK within the dS code flips that the kernels' own O and L (other summation order) cause, far
  below the error other rounding bits would give (~0.3: twice the variance of the ~20% noise). The
  same without tensor reuse (the backward on the unquantized q, k), and with V, P and dO quantized
  too (P by the kernels' second pass, ``attention_pv``, and inside the dK/dV kernel)."""
  q, k, v, do = _data(h=2, hk=1)

  @functools.partial(jax.jit, static_argnums=0)
  def run(impl, q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: nvfp4_attention(q, k, v, key=KEY, config=config, implementation=impl),
                     q, k, v)
    return (o, *vjp(do))

  ours, ref = run("pallas_interpret", q, k, v, do), run("xla", q, k, v, do)
  _close(ours[0], ref[0], 1e-2)
  np.testing.assert_array_equal(_f32(ours[3]), _f32(ref[3]))
  assert _rel(ours[1], ref[1]) < 0.08 and _rel(ours[2], ref[2]) < 0.08


# ----------------------------------------------------------------------------------------------
# K smoothing, Four over Six on q, k, v


def _shifted_keys(k, scale=3.0, seed=1):
  """k plus a channel mean per (batch, head) of ``scale`` standard deviations, as real keys have."""
  mu = scale * jax.random.normal(jax.random.key(seed), (k.shape[0], 1, *k.shape[2:]), jnp.float32)
  return (k.astype(jnp.float32) + mu).astype(k.dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_k_smooth_is_exact_without_quantization(causal):
  """Subtracting k̄ moves each row of scores by q·k̄, which the softmax drops (under the causal mask
  too): in float32 with nothing quantized, O and the gradients are dot_product_attention's; with q
  alone quantized, the op's without smoothing (dK too: the rows of an unquantized dS sum to 0)."""
  q, k, v, do = _data(dtype=jnp.float32)
  k = _shifted_keys(k)
  for got, want in zip(_op(q, k, v, do, None, causal=causal, config=AttentionConfig.bf16(k_smooth=True)),
                       _dpa(q, k, v, do, causal=causal), strict=True):
    _close(got, want, 1e-5)
  q_only = _switched(BF16, q="nvfp4")
  smooth = dataclasses.replace(q_only, k_smooth=True)
  for got, want in zip(_op(q, k, v, do, None, causal=causal, config=smooth),
                       _op(q, k, v, do, None, causal=causal, config=q_only), strict=True):
    _close(got, want, 1e-5)


def test_k_smooth_keeps_later_keys_out_of_the_gradient():
  """Causality by gradient leakage: with K smoothing (k̄ takes every key) and NVFP4 q, k and dS, a
  cotangent on the first 16 queries gives exactly zero gradient to the later keys and values."""
  q, k, v, do = _data()
  do = do.at[:, 16:].set(0)
  _, _, dk, dv = _op(q, _shifted_keys(k), v, do, KEY, config=SMOOTH)
  assert not np.any(_f32(dk)[:, 16:]) and not np.any(_f32(dv)[:, 16:])
  assert np.all(np.any(_f32(dk)[:, :16] != 0, axis=-1))


@pytest.mark.slow
def test_k_smooth_quantizes_the_smoothed_keys():
  """NVFP4 with K smoothing: the forward is attention on deq(Q(q)), deq(Q(k − k̄)); the backward's P is
  the forward's bit for bit; on keys with a large channel mean, O and the gradients come closer to
  exact attention than without smoothing. Without reuse the backward recomputes P from the
  unquantized k − k̄ (the forward's log-sum-exp belongs to the smoothed scores)."""
  q, k, v, do = _data()
  k = _shifted_keys(k)
  k32 = k.astype(jnp.float32)
  ks = (k32 - k32.mean(axis=1, keepdims=True)).astype(k.dtype)
  _, p_fwd, _ = _ref_fwd(q, k, v, key=KEY, config=SMOOTH, return_stats=True)
  _close(_ref_fwd(q, k, v, key=KEY, config=SMOOTH), _dpa(_deq(q), _deq(ks), v, do)[0], 1e-2)
  _, inter = _ref_vjp(q, k, v, do, key=KEY, config=SMOOTH, return_intermediates=True)
  np.testing.assert_array_equal(p_fwd, inter["p"])
  exact, plain, smooth = _dpa(q, k, v, do), _op(q, k, v, do, KEY), _op(q, k, v, do, KEY, config=SMOOTH)
  # dK's error is mostly dS's rounding noise (measured: O 0.24 -> 0.10, dQ 0.82 -> 0.26, dK 0.35 -> 0.26).
  for name, p, s, e, gain in zip(("o", "dq", "dk", "dv"), plain, smooth, exact, (0.5, 0.5, 0.8, 0.5), strict=True):
    assert _rel(s, e) < gain * _rel(p, e), (name, _rel(s, e), _rel(p, e))
  no_reuse = _op(q, k, v, do, KEY, config=dataclasses.replace(SMOOTH, reuse=False))
  np.testing.assert_array_equal(_f32(no_reuse[0]), _f32(smooth[0]))
  assert all(_rel(g, e) < 0.5 for g, e in zip(no_reuse[1:], exact[1:], strict=True))


def test_four_over_six_on_q_k_v():
  """q, k (MSE) and v (MAE) with Four-over-Six block scales: the forward is attention on those decoded
  operands."""
  q, k, v, do = _data()
  deq46 = lambda x, rule: nvfp4.quantize(x, scale_rule=rule).dequantize(x.dtype)
  decoded = jax.jit(lambda q, k, v: (deq46(q, "4over6_mse"), deq46(k, "4over6_mse"), deq46(v, "4over6_mae")))
  got = _ref_fwd(q, k, v, key=KEY, config=FOUR_OVER_SIX)
  _close(got, _dpa(*decoded(q, k, v), do)[0], 1e-2)
  assert _rel(got, _dpa(_deq(q), _deq(k), _deq(v), do)[0]) > 1e-3  # not the amax rule's


@pytest.mark.slow
def test_kernel_quantizer_packs_smoothed_four_over_six_operands_as_the_reference():
  """The kernels' quantizer (interpret mode) packs q, k (Four over Six, MSE), v (MAE) and the smoothed
  keys bit for bit as the reference does."""
  q, k, v, _ = _data()
  smooth = dataclasses.replace(FOUR_OVER_SIX, k_smooth=True)

  @functools.partial(jax.jit, static_argnums=0)
  def packed(impl, q, k, v):
    keys = attn._keys(KEY)
    ks = attn.smoothed_k(_shifted_keys(k), smooth)
    return [attn._operand(x, smooth, n, keys, impl=impl) for x, n in ((q, "q"), (k, "k"), (v, "v"), (ks, "k"))]

  for a, b in zip(jax.tree.leaves(packed("pallas_interpret", q, k, v)), jax.tree.leaves(packed("xla", q, k, v)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_path_lowers_with_k_smooth_four_over_six_and_fine_ds_tiles():
  """The op's kernel path with K smoothing, Four over Six on q, k (MSE) and v (MAE) and 32×32 dS
  tiles lowers for an abstract H200: the quantizer kernels of both rules and the flash kernels."""
  config = dataclasses.replace(FOUR_OVER_SIX, k_smooth=True, ds_tile=(32, 32))
  x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

  def grads(q, k, v):
    f = lambda q, k, v: nvfp4_attention(q, k, v, key=KEY, config=config, implementation="pallas")
    return jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

  with jax.sharding.use_abstract_mesh(H200):
    hlo = jax.jit(grads).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  for name in ("nvfp4_quantize_pairs_4over6_mse", "nvfp4_quantize_pairs_4over6_mae", "nvfp4_attention_fwd",
               "nvfp4_attention_dkdv", "nvfp4_attention_dq"):
    assert name in hlo, name
  assert not re.search(r"nvfp4_quantize_pairs(?!_4over6)", hlo)  # no amax-scaled quantizer


# ----------------------------------------------------------------------------------------------
# The Hadamard rotation of q and k


def _outlier_channels(x, channels=(3, 17, 40, 41), scale=8.0):
  """x with a few channels of D scaled up, as the queries and keys of trained models have."""
  return x.at[..., list(channels)].multiply(scale)


@pytest.mark.slow
def test_hadamard_rotation_is_exact_and_spreads_outlier_channels():
  """``hadamard``: ``(q·H)·(k·H)ᵀ = q·kᵀ`` (H orthonormal, symmetric), so without quantization of
  q and k nothing is rotated and the op is the plain one; with outlier channels the quantized
  attention's output and gradients are closer to exact attention than without the rotation, and on
  plain Gaussian data no further; the op's gradient is the reference VJP's, rotated back."""
  h = attn._sylvester(D) / 8.0  # H_D, D = 64
  np.testing.assert_array_equal(_f32(h), _f32(h.T))
  np.testing.assert_allclose(_f32(h @ h.T), np.eye(D), atol=1e-6)
  q, k, v, do = _data(dtype=jnp.float32)
  rot = AttentionConfig.nvfp4(hadamard=True)
  qr, kr = attn.rotated(q, rot), attn.rotated(k, rot)
  np.testing.assert_allclose(_f32(jnp.einsum("btd,bsd->bts", qr[:, :, 0], kr[:, :, 0])),
                             _f32(jnp.einsum("btd,bsd->bts", q[:, :, 0], k[:, :, 0])), rtol=1e-4, atol=1e-4)
  assert not AttentionConfig.bf16(hadamard=True).rotates and not AttentionConfig.nvfp4().rotates
  plain = AttentionConfig.bf16(ds=NVFP4.ds)  # q and k unquantized: no rotation, same bits
  for got, want in zip(_op(q, k, v, do, KEY, config=dataclasses.replace(plain, hadamard=True)),
                       _op(q, k, v, do, KEY, config=plain), strict=True):
    np.testing.assert_array_equal(_f32(got), _f32(want))
  q, k, v, do = _data()
  exact = _dpa(q, k, v, do)
  for data, better in (((_outlier_channels(q), _outlier_channels(k)), True), ((q, k), False)):
    errors = {}
    for hadamard in (False, True):
      config = dataclasses.replace(FOUR_OVER_SIX, k_smooth=True, hadamard=hadamard)
      got = _op(*data, v, do, KEY, config=config)
      want = _dpa(*data, v, do) if better else exact
      errors[hadamard] = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    if better:  # O and dV through P; dQ, dK through the scores (dS noise beside them)
      assert all(r < 0.85 * p for r, p in zip(errors[True], errors[False], strict=True)), errors
    else:
      assert all(r < 1.1 * p for r, p in zip(errors[True], errors[False], strict=True)), errors
  config = dataclasses.replace(FOUR_OVER_SIX, k_smooth=True, hadamard=True)
  for got, want in zip(_op(q, k, v, do, KEY, config=config)[1:],
                       _ref_vjp(q, k, v, do, key=KEY, config=config), strict=True):
    np.testing.assert_array_equal(_f32(got), _f32(want))
  # quantized_inputs is what the op quantizes: the op on them without rotation and smoothing is the op.
  q_in, k_in = attn.quantized_inputs(q, k, config)
  bare = dataclasses.replace(config, hadamard=False, k_smooth=False)
  np.testing.assert_array_equal(_f32(_ref_fwd(q, k, v, key=KEY, config=config)),
                                _f32(_ref_fwd(q_in, k_in, v, key=KEY, config=bare)))
  with pytest.raises(ValueError, match="hadamard .* power of two; D = 48"):
    x = jnp.zeros((1, 16, 1, 48), jnp.bfloat16)
    nvfp4_attention(x, x, x, key=KEY, config=config, implementation="xla")


# ----------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("shapes, kwargs, match", [
    (((B, T, H * D), (B, T, HK, D), (B, T, HK, D)), {}, "4-D"),
    (((B, T, H, 24), (B, T, HK, 24), (B, T, HK, 24)), {}, "head dim D = 24"),
    (((B, T, H, 32), (B, T, HK, 32), (B, T, HK, 32)), dict(implementation="pallas"), "head dims"),
    (((B, T, 3, D), (B, T, 2, D), (B, T, 2, D)), {}, "not a multiple"),
    (((B, T, H, D), (2, T, HK, D), (2, T, HK, D)), {}, "batch"),
    (((B, T, H, D), (B, T, HK, D), (B, 16, HK, D)), {}, "same shape"),
    (((B, T, H, D), (B, 48, HK, D), (B, 48, HK, D)), {}, "T == S"),
    (((B, T, H, D), (B, T, HK, D), (B, T, HK, D)), dict(key=None), "needs `key`"),
    (((B, T, H, D), (B, T, HK, D), (B, T, HK, D)), dict(implementation="cudnn"), "implementation"),
    (((B, T, H, D), (B, T, HK, D), (B, T, HK, D)), dict(config="nvfp4"), "AttentionConfig"),
])
def test_bad_inputs(shapes, kwargs, match):
  q, k, v = (jnp.zeros(s, jnp.bfloat16) for s in shapes)
  with pytest.raises(ValueError, match=match):
    nvfp4_attention(q, k, v, **{"key": KEY, **kwargs})


@pytest.mark.slow
def test_head_dim_16_on_the_xla_path():
  """The XLA path takes any head dim that is a multiple of 16 (a tiny model's D = 16): the forward
  equals bf16 attention on the decoded operands, as at D = 64."""
  q, k, v = (jax.random.normal(jax.random.key(i), (B, T, H, 16), jnp.float32) for i in range(3))
  k, v = k[:, :, :HK], v[:, :, :HK]
  out = nvfp4_attention(q, k, v, key=KEY, config=AttentionConfig.nvfp4(), implementation="auto")
  qd = nvfp4.dequantize(nvfp4.quantize(q))
  kd = nvfp4.dequantize(nvfp4.quantize(k))
  ref = jax.nn.dot_product_attention(qd, kd, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_dtype_mismatch():
  q, k, v, _ = _data()
  with pytest.raises(ValueError, match="dtype"):
    nvfp4_attention(q.astype(jnp.float32), k, v, key=KEY)


# ----------------------------------------------------------------------------------------------
# In a model


@pytest.mark.slow
def test_jit_grad_through_a_tiny_attention_block():
  c = H * D // 4
  kx, kw, ko = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (B, T, c), jnp.float32)
  params = {"qkv": jax.random.normal(kw, (c, (H + 2 * HK) * D)) * c**-0.5,
            "out": jax.random.normal(ko, (H * D, c)) * (H * D) ** -0.5}

  def loss(params, key):
    qkv = (x @ params["qkv"]).astype(jnp.bfloat16)
    q, k, v = jnp.split(qkv, [H * D, (H + HK) * D], axis=-1)
    o = nvfp4_attention(q.reshape(B, T, H, D), k.reshape(B, T, HK, D), v.reshape(B, T, HK, D), key=key)
    y = o.reshape(B, T, H * D).astype(jnp.float32) @ params["out"]
    return jnp.mean((y - x) ** 2)

  step = jax.jit(jax.value_and_grad(loss))
  losses = []
  for key in jax.random.split(jax.random.key(1), 4):
    value, grads = step(params, key)
    assert all(np.isfinite(_f32(g)).all() and float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    losses.append(float(value))
  assert losses[-1] < losses[0]
