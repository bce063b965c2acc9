"""fp4jax.telemetry: per-module NVFP4 quantization error, in the train loop and on its own."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import write_pydoc_text

from fp4jax import data, nvfp4, telemetry
from fp4jax import sharding as shd
from fp4jax.execution import Execution
from fp4jax.metrics import read_jsonl
from fp4jax.model import ModelConfig
from fp4jax.optim import AdamNvfp4Options, scale_by_adam_nvfp4
from fp4jax.optim.adam import decode_moment, encode_moment
from fp4jax.quant import Operand
from fp4jax.recipe import get_recipe
from fp4jax.train import OptimizerConfig, TrainConfig, init_state, make_optimizer, train

T, B = 32, 8
PROJECTIONS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  text = write_pydoc_text(tmp_path_factory.mktemp("text"))
  out = tmp_path_factory.mktemp("tokens") / "pydoc-byte"
  data.prepare(str(text), out, tokenizer="byte")
  return str(out)


def _check_pairs(row: dict) -> None:
  """Every rel_err has its snr_db = -20 log10(rel_err); every value finite."""
  for k, v in row.items():
    if k.startswith("telemetry/") and k.endswith("_rel_err"):
      assert math.isfinite(v) and v > 0, (k, v)
      assert row[k[:-len("rel_err")] + "snr_db"] == pytest.approx(-20 * math.log10(v), rel=1e-4)


@pytest.mark.slow
def test_train_loop_logs_telemetry_every_n_steps(data_dir, tmp_path):
  model = ModelConfig(vocab_size=272, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                      dtype="float32")
  tc = TrainConfig(steps=4, batch_size=B, seq_len=T, log_every=3, telemetry_every=2,
                   mesh_shape=(1, 1, 1), progress=False)
  it = data.make_iterator(data_dir, "train", T, B, seed=0)
  train(model, get_recipe("bf16"), OptimizerConfig(warmup_steps=2), tc, tmp_path, it,
        execution=Execution(cross_entropy="xla"))
  rows = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl")}
  assert sorted(rows) == [1, 2, 3, 4]
  for step, row in rows.items():
    # Step 1 (the initial state) and every 2 steps.
    assert any(k.startswith("telemetry/") for k in row) == (step in (1, 2, 4)), step
  for step in (1, 2, 4):
    row = rows[step]
    _check_pairs(row)
    assert row["telemetry_time_s"] > 0
    # Measured on the step's own state, batch and key: its loss is the step's loss.
    assert row["telemetry/loss"] == pytest.approx(row["loss"], abs=1e-5)
    for i in range(model.n_layers):
      for p in PROJECTIONS:
        m = f"telemetry/blocks.{i}.{p}"
        # A BF16 run's weights, activations and gradients under NVIDIA's recipe: ~0.1 each.
        assert 0.08 < row[f"{m}/w_rel_err"] < 0.13, (m, row[f"{m}/w_rel_err"])
        for t in ("x", "dy", "dx", "dw", "mu", "nu"):
          assert 0.03 < row[f"{m}/{t}_rel_err"] < 0.3, (m, t, row[f"{m}/{t}_rel_err"])
        for t in ("w", "x", "dy"):
          top, mean = row[f"{m}/{t}_top16_energy"], row[f"{m}/{t}_mean_energy"]
          assert 0 <= mean < 1 and 0 < top <= 1 + 1e-6, (m, t, top, mean)
      for t in ("q", "k"):
        assert 0.05 < row[f"telemetry/blocks.{i}.attn/{t}_rel_err"] < 0.15
      for t in ("ds", "ds_dq", "ds_dk"):
        assert 0.1 < row[f"telemetry/blocks.{i}.attn/{t}_rel_err"] < 0.4
    for m in ("embed", "lm_head"):
      assert 0.03 < row[f"telemetry/{m}/mu_rel_err"] < 0.3
  names = {re.sub(r"_(rel_err|snr_db)$", "", k) for k in rows[2] if k.startswith("telemetry/")}
  assert len(names) == 1 + model.n_layers * (4 * (7 + 6) + 7) + 2 * 2  # loss; per block 4 projections x
  # (w, x, dy, dx, dw, mu, nu; w, x, dy x top16, mean energy) and q, k, ds, ds_dq, ds_dk, p, p_hadamard;
  # embed and lm_head mu, nu
  tb = list((tmp_path / "tb").glob("events.out.tfevents.*"))
  assert tb and b"telemetry/blocks.0.mlp.down/w_rel_err" in tb[0].read_bytes()


def _measure(model, recipe, opt=None):
  mesh = shd.make_mesh((1, 1, 1))
  tx = make_optimizer(opt or OptimizerConfig(), recipe, 10)
  _, state, shardings = init_state(model, recipe, tx, mesh)
  rng = np.random.default_rng(0)
  batch = {k: jnp.asarray(rng.integers(0, 256, (2, 32)), jnp.int32) for k in ("inputs", "targets")}
  fn = telemetry.jit_telemetry(model, recipe, opt, shardings, mesh, execution=Execution(cross_entropy="xla"))
  row = telemetry.measure(fn, state, batch)
  _check_pairs(row)
  return state, row


@pytest.mark.slow
def test_nvfp4_adam_states_attention_and_scanned_blocks():
  """NVFP4 Adam states (measured on the fresh moments), dS of NVFP4 attention, and the stacked
  blocks of scan_layers."""
  model = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, dtype="bfloat16",
                      scan_layers=True)
  from fp4jax.ops.attention import AttentionConfig

  recipe = get_recipe("bf16", optimizer_states="nvfp4", attention="nvfp4",
                      attention_op=AttentionConfig.nvfp4(v=Operand()))  # V in NVFP4: measured too
  state, row = _measure(model, recipe, OptimizerConfig())
  assert isinstance(state["opt_state"][1][0].mu["blocks"][0]["attn"]["qkv"]["kernel"],
                    nvfp4.NVFP4Tensor)
  for i in range(2):
    attn = f"telemetry/blocks.{i}.attn"
    for t, lo, hi in (("ds", 0.15, 0.35), ("ds_dq", 0.1, 0.4), ("ds_dk", 0.1, 0.4),
                      ("q", 0.05, 0.15), ("k", 0.05, 0.15)):
      assert lo < row[f"{attn}/{t}_rel_err"] < hi, (i, t)
    assert 0.08 < row[f"{attn}.qkv/w_rel_err"] < 0.13
    assert 0.05 < row[f"{attn}/v_rel_err"] < 0.15
    # P from the quantized scores, and what a Hadamard rotation of q and k would give (random init:
    # no outlier channels, so about the same).
    assert 0.03 < row[f"{attn}/p_rel_err"] < 0.2, row[f"{attn}/p_rel_err"]
    assert 0.8 < row[f"{attn}/p_hadamard_rel_err"] / row[f"{attn}/p_rel_err"] < 1.25
  # The stacked moments of blocks 0-1 (one leaf, one global scale).
  for t in ("mu", "nu"):
    assert 0.05 < row[f"telemetry/blocks.0-1.attn.qkv/{t}_rel_err"] < 0.3


@pytest.mark.slow
def test_lorasvd_weight_error_is_relative_to_the_effective_weight():
  """On the method's linear baseline (W in 1x16 blocks along K, Four-over-Six): W is measured by its own
  spec (not as 16x16 tiles), relative to the effective weight."""
  model = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, dtype="bfloat16")
  matmul = get_recipe("fp4_linear_w1x16_4over6").matmul
  assert matmul.w.block == (1, 16) and matmul.w.scale_rule == "4over6_mse"
  state, row = _measure(model, get_recipe("fp4_linear_lorasvd", matmul=matmul))
  up = state["params"]["blocks"][0]["mlp"]["gate_up"]
  w_res = np.asarray(up["kernel"])
  w_eff = w_res + np.asarray(up["lora_a"]) @ np.asarray(up["lora_b"])
  quant = jax.jit(lambda w: nvfp4.fake_quant(w, axis=0, scale_rule="4over6_mse"))
  err = lambda w: np.linalg.norm(np.asarray(quant(jnp.asarray(w, jnp.float32))) - w)
  got = row["telemetry/blocks.0.mlp.gate_up/w_rel_err"]
  assert got == pytest.approx(err(w_res) / np.linalg.norm(w_eff), rel=1e-4)
  tiles = np.linalg.norm(np.asarray(jax.jit(lambda w: nvfp4.fake_quant(w, block=(16, 16)))(w_res)) - w_res)
  assert got != pytest.approx(tiles / np.linalg.norm(w_eff), rel=1e-3)
  # The low-rank branch holds the dominant directions: less error than quantizing W_eff.
  assert got < err(w_eff) / np.linalg.norm(w_eff)
  # The energy shares are of the quantized kernel (W_res), the mean over its rows (the input dim).
  w64 = w_res.astype(np.float64)
  s2 = np.linalg.svd(w64, compute_uv=False) ** 2
  assert row["telemetry/blocks.0.mlp.gate_up/w_top16_energy"] == pytest.approx(
      s2[:16].sum() / s2.sum(), rel=1e-4)
  assert row["telemetry/blocks.0.mlp.gate_up/w_mean_energy"] == pytest.approx(
      w64.shape[0] * np.square(w64.mean(0)).sum() / np.square(w64).sum(), rel=1e-4)
  assert not any("mu_rel_err" in k for k in row)  # no optimizer config: no moments


def test_probed_dense_records_its_input_and_output_cotangent():
  """``probe=True``: under ``nnx.capture`` a Dense sows its matmul's input and its output's
  perturbation, whose gradient is the output's cotangent; ``probe=False`` records nothing."""
  from flax import nnx

  from fp4jax.layers import Dense

  x = jax.random.normal(jax.random.key(0), (2, 3, 16))
  w = jax.random.normal(jax.random.key(1), (2, 3, 32))
  dense = Dense(16, 32, rngs=nnx.Rngs(0), probe=True, use_bias=True)
  loss = lambda d, x: jnp.sum(w * d(x))
  _, zeros, _ = nnx.capture(loss, nnx.Perturbation, nnx.Intermediate)(dense, x)

  graphdef, params = nnx.split(dense)

  def with_perturbation(z):  # the module is merged under the transform that traces it
    out, _, seen = nnx.capture(loss, nnx.Perturbation, nnx.Intermediate, init=z)(
        nnx.merge(graphdef, params), x)
    return out, seen

  (_, seen), vjp = jax.vjp(with_perturbation, zeros)
  (dy,) = vjp((jnp.ones(()), jax.tree.map(jnp.zeros_like, seen)))
  np.testing.assert_array_equal(seen["x"].get_value(), x)
  np.testing.assert_array_equal(dy["y"].get_value(), w)
  plain = Dense(16, 32, rngs=nnx.Rngs(0), use_bias=True)
  _, none, nothing = nnx.capture(loss, nnx.Perturbation, nnx.Intermediate)(plain, x)
  assert not jax.tree.leaves(none) and not jax.tree.leaves(nothing)


def test_telemetry_every_must_be_a_non_negative_int():
  with pytest.raises(ValueError, match="telemetry_every"):
    TrainConfig(steps=1, batch_size=1, seq_len=1, telemetry_every=-1)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.slow
def test_chunked_error_equals_the_whole_tensors_error(block):
  """Tensors measured in chunks (the amax block carries each tensor's global scale) give the error
  of quantizing each tensor whole, bit for bit per block: chunks of 48 rows, tensors of 0, 16,
  100 (1x16 only) and 400 rows with amaxes 1e-3 to 1e3, and a NaN tensor."""
  rng = np.random.default_rng(0)
  sizes = (16, 400, 0) if block == (16, 16) else (16, 100, 400, 0)
  tensors = [jnp.asarray(rng.standard_normal((n, 16)) * 10.0 ** (i % 7 - 3), jnp.float32)
             for i, n in enumerate(sizes)]
  tensors.append(tensors[1].at[3, 5].set(jnp.nan))
  jobs = telemetry._Jobs(chunk_rows=48)
  key = jax.random.key(0)
  for i, t in enumerate(tensors):
    jobs.add(f"t{i}", t, Operand(block=block), key)
  got = jobs.run()
  for i, t in enumerate(tensors):
    x = t if block == (1, 16) else t.reshape(-1, 16, 16)  # whole tensors (their 16x16 tiles)
    err = np.linalg.norm(np.asarray(jax.jit(nvfp4.fake_quant, static_argnames="block")(x, block=block) - x))
    e, r = (float(v) for v in got[f"t{i}"])
    if i == len(tensors) - 1:
      assert math.isnan(e)
    else:
      assert e == pytest.approx(err, rel=1e-6, abs=0) and r == pytest.approx(
          np.linalg.norm(np.asarray(t)), rel=1e-6)


@pytest.mark.slow
def test_chunked_stochastic_error_is_that_of_stochastic_rounding():
  """Stochastic rounding in chunks: each chunk has its own bits, and the error matches that of
  quantizing the tensor whole to within the rounding noise (1e5 blocks)."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((100_000, 16)), jnp.float32)
  jobs = telemetry._Jobs(chunk_rows=4096)
  jobs.add("x", x, Operand(rounding="stochastic"), jax.random.key(3))
  e, r = (float(v) for v in jobs.run()["x"])
  whole = nvfp4.fake_quant(x, rounding="stochastic", key=jax.random.key(4))
  assert e / r == pytest.approx(float(jnp.linalg.norm(whole - x) / jnp.linalg.norm(x)), rel=0.01)


@pytest.mark.parametrize("op", [Operand(terms=2), Operand(scale_rule="4over6_mse"),
                                Operand(block=(16, 16), terms=2)], ids=["two_term", "4over6", "tile_two_term"])
def test_chunked_error_follows_the_operand_spec(op):
  """A two-term or Four-over-Six operand measured in chunks gives the error of quantizing each tensor
  whole with that spec: Q1 + Q(a − Q1) with the residual's own (whole-tensor) global scale."""
  rng = np.random.default_rng(2)
  tensors = [jnp.asarray(rng.standard_normal((n, 16)) * 10.0 ** (i - 1), jnp.float32)
             for i, n in enumerate((400, 48, 160))]
  jobs = telemetry._Jobs(chunk_rows=48)
  for i, t in enumerate(tensors):
    jobs.add(f"t{i}", t, op, jax.random.key(0))
  got = jobs.run()

  @jax.jit
  def whole(x):
    x = x if op.block == (1, 16) else x.reshape(-1, 16, 16)
    q = lambda a: nvfp4.fake_quant(a, block=op.block, scale_rule=op.scale_rule)
    q1 = q(x)
    fq = q1 + q(x - q1) if op.terms == 2 else q1
    return jnp.linalg.norm(fq - x)

  for i, t in enumerate(tensors):
    assert float(got[f"t{i}"][0]) == pytest.approx(float(whole(t)), rel=1e-6)
  # The second term matters: its error is far below one term's.
  if op.terms == 2:
    one = telemetry._Jobs(chunk_rows=48)
    one.add("t", tensors[0], Operand(block=op.block), jax.random.key(0))
    assert float(got["t0"][0]) < 0.3 * float(one.run()["t"][0])


def test_an_operand_left_in_bf16_is_not_a_measurement():
  with pytest.raises(ValueError, match="NVFP4 operands"):
    telemetry._Jobs().add("x", jnp.ones((16, 16)), Operand(format="bf16"), jax.random.key(0))


@pytest.mark.parametrize("options", [
    AdamNvfp4Options(mu=Operand(), nu=Operand(), dither=("mu", "nu")),
    AdamNvfp4Options(nu_transform="mean_hadamard"),
    AdamNvfp4Options(mu=None, nu_sr_space="preconditioner"),
], ids=["dither", "mean_hadamard", "v_only_preconditioner"])
def test_moments_are_measured_as_the_options_store_them(options):
  """The moments' error is that of ``encode_moment`` / ``decode_moment`` with the run's options (a
  moment the options keep float32 as the default storage would store it), leaves of one shape
  measured together."""
  rng = np.random.default_rng(3)
  shapes = {"a": (128, 64), "b": (128, 64), "c": (32, 256)}
  params = {k: {"kernel": jnp.zeros(v)} for k, v in shapes.items()}
  state = scale_by_adam_nvfp4(options=options).init(params)
  grads = {k: {"kernel": jnp.asarray(rng.standard_normal(v), jnp.float32)} for k, v in shapes.items()}
  cfg = OptimizerConfig(grad_clip=0.0)
  key = jax.random.key(5)
  got = jax.jit(lambda s, g: telemetry._moments(s, g, cfg, options, key, None))(state, grads)
  assert sorted(got) == [f"{k}/{w}" for k in "abc" for w in ("mu", "nu")]

  @jax.jit
  def direct(x, which, i):
    opts = options if getattr(options, which) is not None else AdamNvfp4Options()
    k = jax.random.fold_in(key, i)
    t = encode_moment(x, which, opts, k, jnp.int32(0), c2=1 / jnp.sqrt(1 - jnp.float32(cfg.b2)), eps=cfg.eps)
    return jnp.linalg.norm(decode_moment(t, which, opts, k) - x), jnp.linalg.norm(x)

  direct = jax.jit(direct.__wrapped__, static_argnums=1)
  for i, (name, which) in enumerate((n, w) for n in "abc" for w in ("mu", "nu")):
    g = grads[name]["kernel"]  # zero moments before: m = (1 − b1)·g, √v = sqrt((1 − b2)·g²)
    x = (1 - cfg.b1) * g if which == "mu" else jnp.sqrt((1 - cfg.b2) * g * g)
    want = direct(x, which, i)
    assert float(want[0]) > 0.01 * float(want[1])
    for a, b in zip(got[f"{name}/{which}"], want, strict=True):
      assert float(a) == pytest.approx(float(b), rel=1e-4), (name, which)
