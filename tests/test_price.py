"""fp4jax.price: a recipe's linear-GEMM time on FP4 tensor cores in BF16 units, on hand-computed cases."""

import math

import pytest

from fp4jax.model import ModelConfig
from fp4jax.ops.matmul import MatmulConfig, Split
from fp4jax.price import gemm_price, price, projection_price
from fp4jax.quant import Operand
from fp4jax.recipe import get_recipe

# d 64, 4 heads of 16, 2 KV heads, d_ff 176: K×N of qkv 64×128, o 64×64, gate_up 64×352, down 176×64.
CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
KN = {"qkv": 64 * 128, "o": 64 * 64, "gate_up": 64 * 352, "down": 176 * 64}
K_PLUS_N = {"qkv": 64 + 128, "o": 64 + 64, "gate_up": 64 + 352, "down": 176 + 64}
ALL = sum(KN.values())  # 46080 multiply-adds per token and GEMM per block


def test_gemm_price_counts_term_gemms_and_bf16_operands():
  nv = MatmulConfig.nvfp4()
  assert [gemm_price(nv, g) for g in ("fwd", "dgrad", "wgrad")] == [0.25, 0.25, 0.25]
  two = MatmulConfig.nvfp4(x=Operand(terms=2), w=Operand(block=(16, 16), terms=2))
  assert [gemm_price(two, g) for g in ("fwd", "dgrad", "wgrad")] == [1.0, 0.5, 0.25]  # Q(w) serves the dgrad
  assert gemm_price(MatmulConfig.nvfp4(x=Operand(format="bf16")), "fwd") == 1.0
  assert gemm_price(MatmulConfig.nvfp4(x=Operand(format="bf16"), dy_wgrad=Operand(terms=2)), "wgrad") == 0.5
  assert gemm_price(MatmulConfig.nvfp4(fwd=False), "fwd") == 1.0
  assert [gemm_price(MatmulConfig.bf16(), g) for g in ("fwd", "dgrad", "wgrad")] == [1.0, 1.0, 1.0]
  with pytest.raises(ValueError, match="unknown GEMM 'bwd'"):
    gemm_price(nv, "bwd")


@pytest.mark.parametrize("name, overrides, want", [
    ("bf16", {}, 1.0),
    ("fp4_linear", {}, 0.25),
    ("fp4_linear", {"matmul": {"x": {"terms": 2}}}, (0.5 + 0.25 + 0.25) / 3),
    ("fp4_linear", {"matmul": {"x": {"terms": 2}, "w": {"terms": 2}}}, (1 + 0.5 + 0.25) / 3),
    ("fp4_linear", {"matmul": {"x": {"format": "bf16"}}}, (1 + 0.25 + 0.25) / 3),
    ("fp4_linear", {"matmul": {"fwd": False}}, (1 + 0.25 + 0.25) / 3),
    ("fp4_linear", {"bf16_last_blocks": 1}, (0.25 + 1) / 2),  # one of the two blocks
    ("fp4_linear", {"down_x": {"format": "bf16"}}, 0.25 + (0.5 - 0.25) * KN["down"] / ALL),
    ("fp4_linear", {"down_x": {"terms": 2}}, 0.25 + (1 / 3 - 0.25) * KN["down"] / ALL),
    # LoRA: r·(K + N) per token and GEMM, against K·N
    ("fp4_linear_lorasvd", {}, 0.25 + 16 * sum(K_PLUS_N.values()) / ALL),
    ("fp4_linear_lorasvd", {"lora_rank": 4, "lora_projections": "down"}, 0.25 + 4 * K_PLUS_N["down"] / ALL),
    # the mean split of x: 2·K to form it, N in each of the forward and the wgrad, over 3·K·N
    ("fp4_linear", {"matmul": {"split": {"tensors": ("x",)}}}, 0.25 + 2 * sum(K_PLUS_N.values()) / (3 * ALL)),
])
def test_price_of_hand_computed_recipes(name, overrides, want):
  assert price(get_recipe(name, **overrides), CFG) == pytest.approx(want, rel=1e-12)


def test_a_subspace_split_pays_its_range_finder():
  k, n, r, q = 64, 128, 8, 1
  config = MatmulConfig.nvfp4(split=Split(("dy",), "subspace", r, q))
  # dy (width N): form 2·r·N, range finder (1 + 2q)·r·N + (1 + q)·r², r·K in the dgrad and the wgrad
  macs = 2 * r * n + (1 + 2 * q) * r * n + (1 + q) * r * r + 2 * r * k
  assert projection_price(config, k, n) == pytest.approx(0.25 + macs / (3 * k * n), rel=1e-12)
  assert projection_price(None, k, n, lora_rank=16) == 1.0  # a BF16 projection: no branch, no split


def test_schedules_are_averaged_over_the_run():
  late = (1 + 0.25 + 0.25) / 3
  r = get_recipe("fp4_linear", bf16_fwd_last=0.2)
  assert price(r, CFG, steps=10) == pytest.approx(0.8 * 0.25 + 0.2 * late, rel=1e-12)
  assert price(r, CFG, steps=1500) == pytest.approx(0.8 * 0.25 + 0.2 * late, rel=1e-12)
  assert price(r, CFG) == pytest.approx(0.8 * 0.25 + 0.2 * late, rel=1e-12)
  assert price(r, CFG, steps=4) == pytest.approx(0.25)  # ⌊0.2 · 4⌋ = 0 steps switch
  assert price(get_recipe("fp4_linear", bf16_fwd_last=1.0), CFG, steps=7) == pytest.approx(late)
  assert price(get_recipe("bf16", bf16_fwd_last=0.5), CFG, steps=10) == 1.0
  # the late phase keeps the down input's override, which then no longer enters a quantized GEMM
  d = get_recipe("fp4_linear", bf16_fwd_last=0.5, down_x={"terms": 2})
  early = 0.25 + (1 / 3 - 0.25) * KN["down"] / ALL
  assert price(d, CFG, steps=10) == pytest.approx(0.5 * early + 0.5 * late, rel=1e-12)
  assert math.isclose(price(get_recipe("fp4_full_stack"), CFG),
                      price(get_recipe("fp4_linear_w1x16_4over6_fwd_bf16_last10"), CFG))


def test_the_study_table_has_a_price_column():
  from experiments import compare
  row = {"arm": "a", "recipe": "fp4_linear", "seed": 0, "status": "ok", "reference": True, "baseline": None,
         "eval_loss": 2.0, "train_loss": 2.1, "tokens": 100, "params": 10, "tokens_per_s": 5.0, "epochs": 0.5,
         "step_time_s": 0.2}
  rows = [{**row, "price": price(get_recipe("fp4_linear", down_x={"terms": 2}), CFG), "rounding_bits": "counter"},
          {**row, "arm": "b", "reference": False}, {**row, "arm": "c", "status": "no metrics"}]
  text = compare.table(rows, compare.add_gaps(rows))
  header = next(line for line in text.splitlines() if line.startswith("| arm |"))
  assert "| vs baseline % | price | state B/param | SR bits | train loss |" in header
  widths = {line.count("|") for line in text.splitlines() if line.startswith("| ")}
  assert widths == {header.count("|")}  # every row has every column
  assert f"| – | {rows[0]['price']:.3f} | – | counter | 2.1000 |" in text
  assert "| – | – | – | – | 2.1000 |" in text  # b: no price


def test_state_bytes_per_param():
  """AdamW in float32 holds 8 bytes per parameter (m and v) plus its step counts; NVFP4 moments 4.5 bits
  per element of each moment (a 4-bit code and an E4M3 scale per 16) on the leaves the storage rule
  quantizes, float32 on the rest; keeping the embedding's and LM head's moments float32 lies between."""
  import dataclasses

  from experiments import compare
  from fp4jax.experiment import Experiment, TrainConfig
  from fp4jax.optim.factory import OptimizerConfig

  def exp(**recipe):
    return Experiment(CFG, get_recipe("fp4_linear", **recipe), OptimizerConfig(),
                      TrainConfig(steps=10, batch_size=2, seq_len=16))

  fp32 = compare.state_bytes_per_param(exp())
  nvfp4 = compare.state_bytes_per_param(exp(optimizer_states="nvfp4"))
  keep = compare.state_bytes_per_param(exp(optimizer_states="nvfp4", moments={"keep_fp32": ("embed", "lm_head")}))
  assert 8 <= fp32 < 8 + 1e-3
  assert 2 * 4.5 / 8 < nvfp4 < 1.3
  assert nvfp4 < keep < fp32
  with pytest.raises(ValueError, match="vocab_size"):
    e = exp()
    compare.state_bytes_per_param(dataclasses.replace(e, model=dataclasses.replace(e.model, vocab_size=None)))
