"""fp4jax.model and fp4jax.sharding: shapes, causality, GQA, precision placement, sharding table."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from fp4jax import _platform, layers
from fp4jax import sharding as shd
from fp4jax.execution import Execution
from fp4jax.layers import MixedMatmul, NVFP4Matmul
from fp4jax.loss import chunked_cross_entropy, cross_entropy
from fp4jax.model import NVFP4Attention, ModelConfig, Transformer, attention_impl, projection_dims, rope
from fp4jax.ops.attention import AttentionConfig
from fp4jax.ops import MatmulConfig, mixed_matmul
from fp4jax.recipe import Recipe, get_recipe
from fp4jax.quant import Operand

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  dtype="float32")


def _model(cfg=CFG, recipe=None, seed=0, execution=Execution()):
  return Transformer(cfg, recipe or get_recipe("bf16"), rngs=nnx.Rngs(seed), execution=execution)


@pytest.mark.slow
def test_logits_shape_dtype_and_param_count():
  m = _model()
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, CFG.vocab_size)
  logits = m(tokens)
  assert logits.shape == (2, 32, CFG.vocab_size) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert n == CFG.num_params()
  assert CFG.num_params(embedding=False) == n - CFG.vocab_size * CFG.d_model


@pytest.mark.slow
def test_initial_loss_is_near_log_vocab():
  m = _model()
  tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, CFG.vocab_size)
  loss = cross_entropy(m(tokens), tokens)
  assert abs(float(loss) - np.log(CFG.vocab_size)) < 0.1


def test_causal_no_gradient_from_the_future():
  m = _model()
  graphdef, state = nnx.split(m)
  tokens = jax.random.randint(jax.random.key(2), (1, 32), 0, CFG.vocab_size)
  emb = m.embed.embedding[...]

  def out_at(x_TxD, t):  # logits at position t as a function of the input embeddings
    model = nnx.merge(graphdef, state)
    model.embed.embedding = nnx.Param(emb)
    x = x_TxD[None]
    for block in model.blocks:
      x = block(x, None)
    return model.final_norm(x)[0, t].sum()

  x_TxD = jnp.take(emb, tokens[0], axis=0)
  g = jax.jit(jax.grad(out_at), static_argnums=1)(x_TxD, 10)
  norms = np.asarray(jnp.abs(g).sum(-1))
  assert (norms[11:] == 0).all() and (norms[:11] > 0).all()


def test_gqa_matches_repeated_kv_heads():
  # GQA with K=2 heads == multi-head attention whose K/V heads are each repeated N/K times.
  b, t, n, k, h = 2, 16, 4, 2, 16
  q, kk, v = (jax.random.normal(jax.random.key(i), (b, t, hh, h)) for i, hh in
              enumerate((n, k, k)))
  gqa = jax.nn.dot_product_attention(q, kk, v, is_causal=True)
  mha = jax.nn.dot_product_attention(q, jnp.repeat(kk, n // k, axis=2),
                                     jnp.repeat(v, n // k, axis=2), is_causal=True)
  np.testing.assert_allclose(gqa, mha, atol=1e-5)
  assert _model().blocks[0].attn.qkv.kernel.shape == (64, (4 + 2 * 2) * 16)


def test_rope_is_a_rotation_and_relative():
  x = jax.random.normal(jax.random.key(3), (1, 8, 2, 16))
  y = rope(x, jnp.arange(8), 10000.0)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  # <rope(q, i), rope(k, j)> depends on i - j only.
  q, k = x[:, :1], x[:, 1:2]
  dot = lambda i, j: float(jnp.sum(rope(q, jnp.array([i]), 1e4) * rope(k, jnp.array([j]), 1e4)))
  assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4)


def test_rope_is_the_rotate_half_formula():
  """The fused form equals the textbook halves ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (float32,
  bit for bit on the CPU), so checkpoints and loss curves from before carry over."""
  x = jax.random.normal(jax.random.key(4), (2, 8, 3, 16)).astype(jnp.bfloat16)
  pos = jnp.arange(8)
  ang = pos.astype(jnp.float32)[:, None] * (1e4 ** (-jnp.arange(0, 16, 2, dtype=jnp.float32) / 16))[None, :]
  sin, cos = jnp.sin(ang)[None, :, None, :], jnp.cos(ang)[None, :, None, :]
  x1, x2 = x[..., :8].astype(jnp.float32), x[..., 8:].astype(jnp.float32)
  want = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  np.testing.assert_array_equal(np.asarray(rope(x, pos, 1e4), np.float32),
                                np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_custom_backward_matches_autodiff(dtype):
  """RMSNorm's hand-written backward (saves x and 1/rms) against autodiff of the same forward."""
  from fp4jax.model import _rms_norm

  def plain(x, scale):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale[None, None, :]).astype(x.dtype)

  k1, k2, k3 = jax.random.split(jax.random.key(9), 3)
  x = (3.0 * jax.random.normal(k1, (2, 5, 64))).astype(dtype)
  scale = 1.0 + 0.1 * jax.random.normal(k2, (64,))
  dy = jax.random.normal(k3, (2, 5, 64)).astype(dtype)
  y0, vjp0 = jax.vjp(plain, x, scale)
  y1, vjp1 = jax.vjp(lambda x, s: _rms_norm(x, s, 1e-6), x, scale)
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  (dx0, ds0), (dx1, ds1) = vjp0(dy), vjp1(dy)
  assert dx1.dtype == dtype and ds1.dtype == jnp.float32
  tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5
  amax = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(dx1, np.float32), np.asarray(dx0, np.float32), rtol=0,
                             atol=tol * amax(dx0))
  np.testing.assert_allclose(ds1, ds0, rtol=0, atol=1e-5 * amax(ds0))


def test_qk_norm_option():
  with_norm = _model()
  without = _model(ModelConfig(**{**CFG.__dict__, "qk_norm": False}))
  assert hasattr(with_norm.blocks[0].attn, "q_norm") and not hasattr(without.blocks[0].attn, "q_norm")
  assert without(jnp.zeros((1, 16), jnp.int32)).shape == (1, 16, 64)


def test_recipe_places_precision_per_block():
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4)
  m = _model(cfg, Recipe(linear="nvfp4", bf16_first_blocks=1, bf16_last_blocks=1))
  kinds = [type(block.mlp.down.matmul) for block in m.blocks]
  assert kinds == [MixedMatmul, NVFP4Matmul, NVFP4Matmul, MixedMatmul]
  assert m.blocks[1].attn.qkv.matmul == NVFP4Matmul(MatmulConfig.nvfp4())
  assert m.blocks[2].attn.o.matmul.config.quantized and m.blocks[2].attn.o.rank == 0
  assert m.lm_head.matmul == MixedMatmul(out_dtype=jnp.float32)  # LM head stays high precision
  lora = _model(cfg, Recipe(linear="nvfp4_lorasvd", lora_rank=8, bf16_last_blocks=1))
  gu, down = lora.blocks[0].mlp.gate_up, lora.blocks[3].mlp.down
  assert isinstance(gu.matmul, NVFP4Matmul) and gu.rank == 8
  assert isinstance(down.matmul, MixedMatmul) and down.rank == 0 and down.lora_a is None
  assert gu.lora_a.shape == (64, 8) and gu.lora_b.shape == (8, 2 * cfg.d_ff)
  # lora_projections: the branch on the named projections only; the others stay plain NVFP4.
  mlp_only = _model(cfg, Recipe(linear="nvfp4_lorasvd", lora_rank=8, lora_projections="gate_up,down"))
  for b in mlp_only.blocks:
    assert b.mlp.gate_up.rank == b.mlp.down.rank == 8
    assert b.attn.qkv.rank == b.attn.o.rank == 0 and b.attn.qkv.lora_a is None
    assert isinstance(b.attn.qkv.matmul, NVFP4Matmul)
  # The linear ablations reach every NVFP4 projection.
  want = MatmulConfig.nvfp4(hadamard=False, dy_dgrad=Operand(), dy_wgrad=Operand())
  ablated = _model(cfg, Recipe(linear="nvfp4", matmul=want))
  assert all(b.attn.qkv.matmul.config == want and b.mlp.down.matmul.config == want for b in ablated.blocks)


def test_quantized_model_requires_a_key():
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, dtype="float32")
  tokens = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="pass key="):
    _model(cfg, get_recipe("fp4_linear"))(tokens)
  exempt = _model(cfg, get_recipe("fp4_linear", bf16_first_blocks=1, bf16_last_blocks=1))
  assert not exempt.needs_key and exempt(tokens).shape == (1, 16, 64)


@pytest.mark.slow
def test_nvfp4_forward_is_close_to_bf16_with_same_weights():
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, dtype="float32")
  ref, fp4 = _model(cfg), _model(cfg, get_recipe("fp4_linear"))
  nnx.update(fp4, nnx.state(ref, nnx.Param))
  tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, 64)
  g, p = nnx.split(fp4)
  a = ref(tokens)
  b = jax.jit(lambda p, t, k: nnx.merge(g, p)(t, key=k))(p, tokens, jax.random.key(5))
  rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
  assert 0 < rel < 0.2  # quantized (not bit-equal) but close


@pytest.mark.slow
def test_attention_nvfp4_runs_the_nvfp4_op_with_its_ablations():
  """recipe attention='nvfp4': every block's attention op is nvfp4_attention with the recipe's
  AttentionConfig; the model needs a key, trains (finite gradients) and differs from bf16 attention."""
  recipe = Recipe(attention="nvfp4", attention_op=AttentionConfig.nvfp4(ds=Operand(format="bf16"), reuse=False))
  m = _model(recipe=recipe)
  assert m.needs_key
  op = m.blocks[0].attn.attention_op
  assert isinstance(op, NVFP4Attention)
  assert op.config == AttentionConfig.nvfp4(ds=Operand(format="bf16"), reuse=False)
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, CFG.vocab_size)
  with pytest.raises(ValueError, match="key"):
    m(tokens)
  g, p = nnx.split(m)

  def loss(p, key):
    return jnp.mean(nnx.merge(g, p)(tokens, key=key) ** 2)

  value, grads = jax.jit(jax.value_and_grad(loss))(p, jax.random.key(1))
  assert np.isfinite(float(value))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))
  bf16 = _model()
  assert not np.allclose(np.asarray(bf16(tokens)), np.asarray(m(tokens, key=jax.random.key(1))))


@pytest.mark.parametrize("kw,match", [
    (dict(n_heads=3, n_kv_heads=2), "not a multiple of n_kv_heads"),
    (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
    (dict(d_model=0), "d_model"),
    (dict(dtype="float16"), "dtype"),
    (dict(head_dim=15), "must be even"),
    (dict(d_ff=0), "d_ff"),
    (dict(n_kv_heads=1.5), "n_kv_heads"),
])
def test_model_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**{**dict(vocab_size=64, d_model=64, n_layers=1, n_heads=4), **kw})


def test_model_config_widths_are_fields():
  """A width left None is derived once, when the config is made: every width is read from its
  field; ``dataclasses.replace`` keeps the derived values unless given None again."""
  cfg = ModelConfig(vocab_size=64, d_model=384, n_layers=1, n_heads=6)
  assert (cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (6, 64, 1024)
  assert ModelConfig(vocab_size=64, d_model=384, n_layers=1, n_heads=6, head_dim=32, d_ff=512,
                     n_kv_heads=2).head_dim == 32
  wider = dataclasses.replace(cfg, n_heads=3, n_kv_heads=None, head_dim=None)
  assert (wider.n_kv_heads, wider.head_dim, wider.d_ff) == (3, 128, 1024)
  assert not hasattr(cfg, "hdim") and not hasattr(cfg, "attention")


def test_sharding_table():
  mesh = shd.make_mesh((2, 2, 2))
  params = nnx.to_pure_dict(nnx.state(_model(), nnx.Param))
  sh = shd.param_shardings(params, mesh, projection_dims(CFG))
  b0, b1 = sh["blocks"][0], sh["blocks"][1]
  assert b0["attn"]["qkv"]["kernel"].spec == P("fsdp", "tensor")
  assert b0["attn"]["o"]["kernel"].spec == P("tensor", "fsdp")
  assert b1["mlp"]["gate_up"]["kernel"].spec == P("fsdp", "tensor")
  assert b1["mlp"]["down"]["kernel"].spec == P("tensor", "fsdp")
  assert sh["embed"]["embedding"].spec == P("tensor", "fsdp")
  assert sh["lm_head"]["kernel"].spec == P("fsdp", "tensor")
  assert b0["attn_norm"]["scale"].spec == P()
  # scan_layers: leaves stacked on a leading (unsharded) axis.
  scanned = _model(ModelConfig(**{**CFG.__dict__, "scan_layers": True}))
  sh = shd.param_shardings(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), mesh,
                           projection_dims(CFG))
  assert sh["blocks"][0]["attn"]["qkv"]["kernel"].spec == P(None, "fsdp", "tensor")
  assert sh["blocks"][0]["attn_norm"]["scale"].spec == P()
  # Low-rank factors of a projection shard only their full-size dimension.
  path = (jax.tree_util.DictKey("blocks"), jax.tree_util.DictKey(0), jax.tree_util.DictKey("mlp"),
          jax.tree_util.DictKey("down"), jax.tree_util.DictKey("lora_a"))
  dims = projection_dims(CFG)
  assert shd.param_spec(path, (CFG.d_ff, 16), dims["down"], mesh) == P("tensor", None)
  assert shd.param_spec(path, (16, 64), dims["down"], mesh) == P(None, "fsdp")
  assert shd.param_spec(path, (3, 16, 64), dims["down"], mesh) == P(None, None, "fsdp")
  # A dimension that does not divide stays unsharded.
  assert shd.param_spec(path[:-1] + (jax.tree_util.DictKey("kernel"),), (5, 64), None,
                        mesh) == P(None, "fsdp")


def test_make_mesh_errors_and_fill():
  assert shd.make_mesh((1, -1, 2)).shape == {"data": 1, "fsdp": 4, "tensor": 2}
  assert shd.make_mesh((1, 1, 1)).devices.size == 1
  with pytest.raises(ValueError, match="needs 16 devices"):
    shd.make_mesh((2, 4, 2))
  with pytest.raises(ValueError, match="3 sizes"):
    shd.make_mesh((2, 4))
  with pytest.raises(ValueError, match="does not divide"):
    shd.make_mesh((3, -1, 1))


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.slow
def test_scan_layers_equals_unrolled(remat):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, dtype="float32")
  unrolled = ModelConfig(**{**cfg.__dict__, "scan_layers": False})
  scanned = ModelConfig(**{**cfg.__dict__, "scan_layers": True, "remat": remat})
  m1, m2 = _model(unrolled), _model(scanned)
  assert m2.segments == ((0, 3),) and len(m2.blocks) == 1
  tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 64)
  graphdef1, p1 = nnx.split(m1)
  graphdef2, p2 = nnx.split(m2)
  # The scanned model is created with the unrolled one's initial values, stacked.
  stack = lambda d: {0: jax.tree.map(lambda *xs: jnp.stack(xs), *d["blocks"].values())}
  d1, d2 = nnx.to_pure_dict(p1), nnx.to_pure_dict(p2)
  jax.tree.map(np.testing.assert_array_equal, {**d1, "blocks": stack(d1)}, d2)
  loss = lambda g, p: cross_entropy(nnx.merge(g, p)(tokens), tokens)
  vg = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
  l1, g1 = vg(graphdef1, p1)
  l2, g2 = vg(graphdef2, p2)
  assert float(l1) == pytest.approx(float(l2), rel=1e-6)
  g1, g2 = nnx.to_pure_dict(g1), nnx.to_pure_dict(g2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               {**g1, "blocks": stack(g1)}, g2)


def test_segments_follow_exempt_blocks():
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=5, n_heads=2)
  m = _model(cfg, Recipe(linear="nvfp4", bf16_first_blocks=1, bf16_last_blocks=2))
  assert m.segments == ((0, 1), (1, 3), (3, 5))
  scanned = _model(ModelConfig(**{**cfg.__dict__, "scan_layers": True}),
                   Recipe(linear="nvfp4", bf16_first_blocks=1, bf16_last_blocks=2))
  assert [b.mlp.down.kernel.shape[0] for b in scanned.blocks] == [1, 2, 2]


@pytest.mark.slow
def test_lorasvd_model_shards_low_rank_factors_and_runs():
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, dtype="float32")
  m = _model(cfg, Recipe(linear="nvfp4_lorasvd", lora_rank=4))
  g, p = nnx.split(m)
  params = nnx.to_pure_dict(p)
  sh = shd.param_shardings(params, shd.make_mesh((1, 4, 2)), projection_dims(cfg))
  gu = sh["blocks"][0]["mlp"]["gate_up"]
  assert (gu["kernel"].spec, gu["lora_a"].spec, gu["lora_b"].spec) == (
      P("fsdp", "tensor"), P("fsdp", None), P(None, "tensor"))
  tokens = jax.random.randint(jax.random.key(7), (1, 16), 0, 64)
  logits = jax.jit(lambda p, t, k: nnx.merge(g, p)(t, key=k))(p, tokens, jax.random.key(0))
  assert logits.shape == (1, 16, 64) and np.isfinite(np.asarray(logits)).all()


def _ce_inputs(dtype=jnp.bfloat16, v=50):
  k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(k1, (3, 32, 16)).astype(dtype)
  w = 0.3 * jax.random.normal(k2, (16, v))
  return x, w, jax.random.randint(k3, (3, 32), 0, v)


@pytest.mark.parametrize("chunk", [96, 40, 7, 10_000])  # exact, padded, tiny, one chunk
def test_chunked_cross_entropy_recompute_matches_full_logits(chunk):
  x, w, t = _ce_inputs()
  # The model's full-logits path: the same LM-head GEMM (mixed_matmul, bf16 backward).
  full = lambda x, w: cross_entropy(mixed_matmul(x, w, x.dtype, jnp.float32), t)
  chunked = lambda x, w: chunked_cross_entropy(
      x, w, t, chunk_tokens=chunk, recompute=True)
  l0, (dx0, dw0) = jax.value_and_grad(full, (0, 1))(x, w)
  l1, (dx1, dw1) = jax.value_and_grad(chunked, (0, 1))(x, w)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(dx1, np.float32), np.asarray(dx0, np.float32))
  # dW: float32 outputs summed per chunk vs one product: summation order only.
  np.testing.assert_allclose(dw1, dw0, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(dw0))))
  # Against a float32 cotangent (plain jnp.dot's autodiff): within the bf16 rounding of dlogits.
  plain = lambda x, w: cross_entropy(
      jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32), t)
  dx2, dw2 = jax.grad(plain, (0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(dx1, np.float32), np.asarray(dx2, np.float32), rtol=0,
                             atol=2 ** -6 * float(jnp.max(jnp.abs(dx2.astype(jnp.float32)))))
  np.testing.assert_allclose(dw1, dw2, rtol=0, atol=2 ** -7 * float(jnp.max(jnp.abs(dw2))))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("chunk", [96, 40, 7])  # exact, padded, tiny
def test_chunked_cross_entropy_matches_float32_reference(chunk, dtype):
  """The default (custom_vjp, saved bf16 dlogits) against float32 autodiff of the full logits
  from the same rounded operands; and against ``recompute=True``."""
  x, w, t = _ce_inputs(dtype)

  def ref(x, w):  # everything in float32, from the operands as the GEMMs see them
    f32 = lambda a: a.astype(dtype).astype(jnp.float32)
    return cross_entropy(jnp.dot(f32(x), f32(w), precision=jax.lax.Precision.HIGHEST), t)

  l0, (dx0, dw0) = jax.value_and_grad(ref, (0, 1))(x, w)
  f = lambda x, w, rc=False: chunked_cross_entropy(
      x, w, t, chunk_tokens=chunk, recompute=rc)
  l1, (dx1, dw1) = jax.value_and_grad(f, (0, 1))(x, w)
  assert dx1.dtype == dtype and dw1.dtype == jnp.float32 and l1.dtype == jnp.float32
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  # bf16: dlogits and dx are rounded to bf16 (2^-9 relative each); float32: summation order only.
  tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5
  amax = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(dx1, np.float32), np.asarray(dx0, np.float32), rtol=0,
                             atol=2 * tol * amax(dx0))
  np.testing.assert_allclose(dw1, dw0, rtol=0, atol=tol * amax(dw0))
  # recompute=True: the same loss, gradients within bf16 rounding of each other; jit agrees.
  l2, (dx2, dw2) = jax.value_and_grad(lambda x, w: f(x, w, True), (0, 1))(x, w)
  np.testing.assert_allclose(l2, l1, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dx2, np.float32), np.asarray(dx1, np.float32), rtol=0,
                             atol=tol * amax(dx1))
  np.testing.assert_allclose(dw2, dw1, rtol=0, atol=tol * amax(dw1))
  l3, (dx3, dw3) = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
  np.testing.assert_allclose(l3, l1, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dx3, np.float32), np.asarray(dx1, np.float32), rtol=0,
                             atol=tol * amax(dx1))
  np.testing.assert_allclose(dw3, dw1, rtol=0, atol=1e-6 * amax(dw1))


def test_chunked_cross_entropy_saved_residuals():
  """What the backward keeps (the leaves of ``jax.vjp``'s closure): by default one bf16 (C, V)
  dlogits per chunk (no stacked (chunks, C, V) array), no float32 (C, V) logits, the kernel in
  bf16 (not a stack of per-chunk casts); with ``recompute=True`` nothing of size C·V."""
  x, w, t = _ce_inputs(v=64)  # 96 tokens, chunks of C=40 (3, padded), D=16 < C
  res = lambda rc: [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(jax.vjp(
      lambda x, w: chunked_cross_entropy(x, w, t, chunk_tokens=40, recompute=rc), x, w)[1])]
  saved = res(False)
  assert saved.count(((40, 64), jnp.bfloat16)) == 3 and ((16, 64), jnp.bfloat16) in saved, saved
  assert not [s for s in saved if s[1] == jnp.float32 and np.prod(s[0]) >= 40 * 64], saved
  assert not [s for s in saved if len(s[0]) > 2], saved
  assert not [s for s in res(True) if np.prod(s[0]) >= 40 * 64], res(True)


@pytest.mark.parametrize("chunk", [96, 40])  # exact, padded (weight-0 rows)
def test_chunked_cross_entropy_pallas_rows_match_xla(chunk):
  """The fused loss kernel (interpret mode) in the forward rule: the same loss and gradients as
  the XLA passes, up to summation order and a bf16 ulp of the saved cotangent."""
  x, w, t = _ce_inputs(v=300)  # V not a power of two: the kernel masks its padding columns
  f = lambda x, w, impl: chunked_cross_entropy(x, w, t, chunk_tokens=chunk, implementation=impl)
  l0, (dx0, dw0) = jax.value_and_grad(lambda x, w: f(x, w, "xla"), (0, 1))(x, w)
  l1, (dx1, dw1) = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, "pallas_interpret"),
                                              (0, 1)))(x, w)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  amax = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(dx1, np.float32), np.asarray(dx0, np.float32), rtol=0,
                             atol=2 ** -8 * amax(dx0))
  np.testing.assert_allclose(dw1, dw0, rtol=0, atol=2 ** -8 * amax(dw0))
  with pytest.raises(ValueError, match="chunked_cross_entropy: implementation must be one of"):
    f(x, w, "triton")


def test_chunked_cross_entropy_rejects_bad_input():
  x, w, t = jnp.zeros((2, 4, 8)), jnp.zeros((8, 10)), jnp.zeros((2, 4), jnp.int32)
  with pytest.raises(ValueError, match="chunk_tokens"):
    chunked_cross_entropy(x, w, t, chunk_tokens=0)
  with pytest.raises(ValueError, match="do not match"):
    chunked_cross_entropy(x, w, t[:, :3])


def test_attention_option_validated_and_xla_on_cpu():
  small = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, dtype="float32")
  with pytest.raises(ValueError, match="Execution.attention"):
    Execution(attention="flash")
  with pytest.raises(ValueError, match="BF16 attention: implementation must be one of"):
    _model(small, execution=Execution(attention="pallas"))
  with pytest.raises(ValueError, match="'cudnn' needs dtype bfloat16"):
    _model(small, execution=Execution(attention="cudnn"))
  with pytest.raises(ValueError, match="runs BF16 attention only"):
    _model(small, Recipe(attention="nvfp4"), execution=Execution(attention="cudnn"))
  op = _model(small, Recipe(attention="nvfp4"), execution=Execution(attention="xla")).blocks[0].attn
  assert op.attention_op.implementation == "xla"
  assert attention_impl(CFG) == "xla"  # float32 model
  bf16 = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=4)
  assert attention_impl(bf16) == ("cudnn" if _platform.default_platform() == "cuda" else "xla")


def test_attention_auto_follows_the_default_platform(monkeypatch):
  """"auto" takes cuDNN only where computations go to a CUDA GPU: not on ROCm or the CPU, and not
  inside ``jax.default_device(cpu)`` on a GPU machine."""
  bf16 = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=4)
  for platform, want in (("cuda", "cudnn"), ("rocm", "xla"), ("cpu", "xla")):
    monkeypatch.setattr(_platform, "default_platform", lambda p=platform: p)
    assert attention_impl(bf16) == want
  monkeypatch.undo()
  with jax.default_device(jax.devices("cpu")[0]):
    assert _platform.default_platform() == "cpu" and attention_impl(bf16) == "xla"


_LOWER_FOR_H200 = r"""
import re, jax, jax.numpy as jnp
from jax._src import core, dispatch, custom_partitioning as cp
from jax._src.cudnn import fused_attention_stablehlo as fa
from jax._src.interpreters import mlir
from jax.sharding import AbstractDevice, AbstractMesh
from flax import nnx
from fp4jax.loss import chunked_cross_entropy
from fp4jax.model import ModelConfig, Transformer
from fp4jax.recipe import get_recipe
# No GPU here: pretend cuDNN 9.10 on sm_90, and lower custom_partitioning as for one device.
fa.check_cudnn_version = lambda: 91000
fa.check_compute_capability = lambda c: tuple(map(int, c.split("."))) <= (9, 0)
dispatch.prim_requires_devices_during_lowering.clear()
mlir.register_lowering(cp.custom_partitioning_p, lambda ctx, *v, call, **_: mlir.lower_fun(
    core.jaxpr_as_fun(call), multiple_results=True)(ctx, *v))
from fp4jax.execution import Execution
cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=2, scan_layers=True)
g, st = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, get_recipe("bf16"), rngs=nnx.Rngs(0),
                                                     execution=Execution(attention="cudnn"))))
def loss(st, tok):
  m = nnx.merge(g, st)
  return chunked_cross_entropy(m.features(tok), m.lm_head.kernel[...], tok, chunk_tokens=256,
                               implementation="pallas")
tok = jax.ShapeDtypeStruct((4, 256), jnp.int32)
mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
with jax.sharding.use_abstract_mesh(mesh):
  txt = jax.jit(jax.grad(loss)).trace(st, tok).lower(lowering_platforms=("cuda",)).as_text()
calls = set(re.findall(r"custom_call @([\w$.]+)", txt))
print("CALLS", sorted(calls))
print("SCORES", "x256x256x" in txt, "4x256x512xf32" in txt)
dots = re.findall(r"stablehlo.dot_general[^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", txt)
print("DOTS", len(dots), "F32_OPERANDS", sorted({d for d in dots if "f32>" in d[0] + d[1]}))
"""


def test_attention_lowers_to_cudnn_for_h200_without_scores_or_full_logits():
  """The bf16 model lowered for CUDA (abstract H200, no GPU): cuDNN fused attention forward and
  backward, the Pallas loss kernel (Triton), no T×T score tensor, no (B, T, V) float32 logits,
  bf16 operands in every GEMM.
  Private jax hooks, so a subprocess."""
  import subprocess
  import sys
  from pathlib import Path
  r = subprocess.run([sys.executable, "-c", _LOWER_FOR_H200], capture_output=True, text=True,
                     timeout=300, cwd=Path(__file__).resolve().parents[1])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "__cudnn$fmhaSoftmax" in r.stdout and "__cudnn$fmhaSoftmaxBackward" in r.stdout
  assert "__gpu$xla.gpu.triton" in r.stdout, r.stdout  # the fused loss kernel, one per chunk
  assert "SCORES False False" in r.stdout, r.stdout
  # Every GEMM of forward and backward takes bf16 operands: a float32 cotangent entering a dot
  # makes XLA run a float32 (TF32) GEMM (see fp4jax.ops.mixed_matmul).
  n_dots = int(r.stdout.split("DOTS ")[1].split()[0])
  assert n_dots >= 12 and "F32_OPERANDS []" in r.stdout, r.stdout


def test_auto_attention_falls_back_to_xla_when_cudnn_refuses(monkeypatch):
  """On a 'GPU' without cuDNN (here: the CPU pretending), ``Execution.attention='auto'``
  warns and uses XLA; ``'cudnn'`` raises."""
  monkeypatch.setattr(_platform, "default_platform", lambda: "cuda")
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4)
  assert attention_impl(cfg) == "cudnn"
  tokens = jnp.zeros((2, 16), jnp.int32)
  with pytest.warns(UserWarning, match="cuDNN attention unavailable"):
    logits = _model(cfg)(tokens)
  monkeypatch.undo()
  np.testing.assert_array_equal(logits, _model(cfg)(tokens))
  if jax.default_backend() == "cpu":
    with pytest.raises(RuntimeError, match="cuDNN"):
      _model(cfg, execution=Execution(attention="cudnn"))(tokens)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.slow
def test_bf16_qkv_split_gemms_equal_fused_gemm(monkeypatch, n_kv_heads):
  """The bf16 model's q, k, v from three GEMMs (``mixed_matmul_split``) == the fused qkv GEMM and
  slices: same loss bit for bit, gradients within float32 summation order of dx."""
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads)
  g, p = nnx.split(_model(cfg))
  tokens = jax.random.randint(jax.random.key(8), (2, 16), 0, 64)

  def run():  # a fresh function each time: no trace cache across the monkeypatch
    loss = lambda p: cross_entropy(nnx.merge(g, p)(tokens), tokens)
    uses_split = "mixed_matmul_split" in str(jax.make_jaxpr(loss)(p))
    return uses_split, jax.jit(jax.value_and_grad(loss))(p)

  split, (l1, g1) = run()
  with monkeypatch.context() as mp:  # a bf16 matmul without split: the fused path
    mp.setattr(layers.MixedMatmul, "split", None)
    fused_split, (l0, g0) = run()
  assert split and not fused_split
  assert float(l1) == float(l0)
  # On the CPU the gradients come out identical but for a few 1e-7 relative (the dx sum order).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b)))), g1, g0)
