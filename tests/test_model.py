"""fp4jax.model and fp4jax.sharding: shapes, causality, GQA, precision placement, sharding table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from fp4jax import sharding as shd
from fp4jax.layers import Fp4Dense, LoraSvdDense
from fp4jax.ops import MatmulConfig
from fp4jax.model import (Dense, ModelConfig, Transformer, cross_entropy, projection_dims, rope)
from fp4jax.recipe import Recipe, RecipeNotAvailableError, get_recipe

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  dtype="float32")


def _model(cfg=CFG, recipe=None, seed=0):
  return Transformer(cfg, recipe or get_recipe("bf16"), rngs=nnx.Rngs(seed))


def test_logits_shape_dtype_and_param_count():
  m = _model()
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, CFG.vocab_size)
  logits = m(tokens)
  assert logits.shape == (2, 32, CFG.vocab_size) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert n == CFG.num_params()
  assert CFG.num_params(embedding=False) == n - CFG.vocab_size * CFG.d_model


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
    for i in range(CFG.n_layers):
      x = getattr(model, f"block{i}")(x, jax.random.key(0))
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
  assert _model().block0.attn.qkv.kernel.shape == (64, (4 + 2 * 2) * 16)


def test_rope_is_a_rotation_and_relative():
  x = jax.random.normal(jax.random.key(3), (1, 8, 2, 16))
  y = rope(x, jnp.arange(8), 10000.0)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  # <rope(q, i), rope(k, j)> depends on i - j only.
  q, k = x[:, :1], x[:, 1:2]
  dot = lambda i, j: float(jnp.sum(rope(q, jnp.array([i]), 1e4) * rope(k, jnp.array([j]), 1e4)))
  assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4)


def test_qk_norm_option():
  with_norm = _model()
  without = _model(ModelConfig(**{**CFG.__dict__, "qk_norm": False}))
  assert hasattr(with_norm.block0.attn, "q_norm") and not hasattr(without.block0.attn, "q_norm")
  assert without(jnp.zeros((1, 16), jnp.int32)).shape == (1, 16, 64)


def test_recipe_places_precision_per_block():
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4)
  m = _model(cfg, Recipe(linear="nvfp4", bf16_first_blocks=1, bf16_last_blocks=1))
  kinds = [type(getattr(m, f"block{i}").mlp.down) for i in range(4)]
  assert kinds == [Dense, Fp4Dense, Fp4Dense, Dense]
  assert m.block1.attn.qkv.config == MatmulConfig.nvfp4() and m.block2.attn.o.config.quantized
  assert isinstance(m.lm_head, Dense)  # LM head stays high precision
  lora = _model(cfg, Recipe(linear="nvfp4_lorasvd", lora_rank=8, bf16_last_blocks=1))
  assert isinstance(lora.block0.mlp.gate_up, LoraSvdDense) and isinstance(lora.block3.mlp.down,
                                                                           Dense)
  assert lora.block0.mlp.gate_up.lora_a.shape == (64, 8)
  assert lora.block0.mlp.gate_up.lora_b.shape == (8, 2 * cfg.ff)


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


def test_attention_nvfp4_raises_not_available():
  with pytest.raises(RecipeNotAvailableError, match="not available yet"):
    _model(recipe=Recipe(attention="nvfp4"))


@pytest.mark.parametrize("kw,match", [
    (dict(n_heads=3, n_kv_heads=2), "not a multiple of n_kv_heads"),
    (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
    (dict(d_model=0), "d_model"),
    (dict(dtype="float16"), "dtype"),
    (dict(head_dim=15), "must be even"),
])
def test_model_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**{**dict(vocab_size=64, d_model=64, n_layers=1, n_heads=4), **kw})


def test_sharding_table():
  mesh = shd.make_mesh((2, 2, 2))
  params = nnx.to_pure_dict(nnx.state(_model(), nnx.Param))
  sh = shd.param_shardings(params, mesh, projection_dims(CFG))
  assert sh["block0"]["attn"]["qkv"]["kernel"].spec == P("fsdp", "tensor")
  assert sh["block0"]["attn"]["o"]["kernel"].spec == P("tensor", "fsdp")
  assert sh["block1"]["mlp"]["gate_up"]["kernel"].spec == P("fsdp", "tensor")
  assert sh["block1"]["mlp"]["down"]["kernel"].spec == P("tensor", "fsdp")
  assert sh["embed"]["embedding"].spec == P("tensor", "fsdp")
  assert sh["lm_head"]["kernel"].spec == P("fsdp", "tensor")
  assert sh["block0"]["attn_norm"]["scale"].spec == P()
  # Low-rank factors of a projection shard only their full-size dimension.
  path = (jax.tree_util.DictKey("block0"), jax.tree_util.DictKey("mlp"),
          jax.tree_util.DictKey("down"), jax.tree_util.DictKey("lora_a"))
  dims = projection_dims(CFG)
  assert shd.param_spec(path, (CFG.ff, 16), dims["down"], mesh) == P("tensor", None)
  assert shd.param_spec(path, (16, 64), dims["down"], mesh) == P(None, "fsdp")
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
def test_scan_layers_equals_unrolled(remat):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, dtype="float32")
  unrolled = ModelConfig(**{**cfg.__dict__, "scan_layers": False})
  scanned = ModelConfig(**{**cfg.__dict__, "scan_layers": True, "remat": remat})
  m1, m2 = _model(unrolled), _model(scanned)
  assert m2._segments() == [(0, 3)]
  tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 64)
  graphdef1, p1 = nnx.split(m1)
  graphdef2, _ = nnx.split(m2)
  loss = lambda g, p: cross_entropy(nnx.merge(g, p)(tokens), tokens)  # noqa: E731
  vg = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
  l1, g1 = vg(graphdef1, p1)
  l2, g2 = vg(graphdef2, p1)
  assert float(l1) == pytest.approx(float(l2), rel=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g1, g2)


def test_segments_follow_exempt_blocks():
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=5, n_heads=2)
  m = _model(cfg, Recipe(linear="nvfp4", bf16_first_blocks=1, bf16_last_blocks=2))
  assert m._segments() == [(0, 1), (1, 3), (3, 5)]


def test_lorasvd_model_shards_low_rank_factors_and_runs():
  cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, dtype="float32")
  m = _model(cfg, Recipe(linear="nvfp4_lorasvd", lora_rank=4))
  g, p = nnx.split(m)
  params = nnx.to_pure_dict(p)
  sh = shd.param_shardings(params, shd.make_mesh((1, 4, 2)), projection_dims(cfg))
  gu = sh["block0"]["mlp"]["gate_up"]
  assert (gu["kernel"].spec, gu["lora_a"].spec, gu["lora_b"].spec) == (
      P("fsdp", "tensor"), P("fsdp", None), P(None, "tensor"))
  tokens = jax.random.randint(jax.random.key(7), (1, 16), 0, 64)
  logits = jax.jit(lambda p, t, k: nnx.merge(g, p)(t, key=k))(p, tokens, jax.random.key(0))
  assert logits.shape == (1, 16, 64) and np.isfinite(np.asarray(logits)).all()
