"""The loss-gap study: BF16 against each NVFP4 module, its ablations and remedies, on one config.

Every arm is written out: its preset, its changes (dotted keys from the config's root, as
``--config.<key>`` sets them), its seed, the arm it is read against (``baseline``; None for the
bf16 seeds, the reference whose mean every gap is taken against) and what it measures.
``python -m experiments.study --list`` prints this table.
"""

import dataclasses

from experiments.studies import Arm
from fp4jax.recipe import PRESETS

_FWD_ONLY = {"recipe.matmul.dgrad": False, "recipe.matmul.wgrad": False,
             "recipe.matmul.hadamard": False}
_ATTN_QK_4OVER6 = {"recipe.attention": "nvfp4", "recipe.attention_op.q.scale_rule": "4over6_mse",
                   "recipe.attention_op.k.scale_rule": "4over6_mse"}
_W1X16 = {"recipe.matmul.w.block": (1, 16)}
_W1X16_4OVER6 = {**_W1X16, "recipe.matmul.x.scale_rule": "4over6_mse", "recipe.matmul.w.scale_rule": "4over6_mse",
                 "recipe.matmul.x_wgrad.scale_rule": "4over6_mse"}
_REALIGN = {"recipe.lora_resplit_moments": "aligned", "recipe.lora_resplit_svd": "randomized"}
# LoRA-SVD as NVIDIA's recipe plus a rank-16 branch split once at initialization (the preset
# fp4_linear_lorasvd is the method's: on its baseline, re-aligned).
_ONCE = {"recipe.linear": "nvfp4_lorasvd"}
_STATES = {"recipe.optimizer_states": "nvfp4"}
# The full stack on NVIDIA's recipe: LoRA-SVD linear layers (split once), NVFP4 moments, NVIDIA's NVFP4
# attention, NVFP4 Newton-Schulz (the arm fp4_full_stack; the preset fp4_full_stack is the winners' stack).
_LORASVD_STACK = {**_ONCE, **_STATES, "recipe.attention": "nvfp4", "recipe.newton_schulz": "nvfp4"}
_FULL_STACK_METHOD = {**_W1X16_4OVER6, **_REALIGN, "recipe.lora_resplit_every": -2,
                      "recipe.moments.nu_transform": "mean_hadamard", **_ATTN_QK_4OVER6,
                      "recipe.attention_op.k_smooth": True}
_STATES_NEAREST = {**_STATES, "recipe.moments.mu.rounding": "nearest", "recipe.moments.nu.rounding": "nearest"}
_STATES_MEAN_HADAMARD = {**_STATES, "recipe.moments.nu_transform": "mean_hadamard"}
# On the linear preset, the full stack without the attention remedies: NVFP4 moments with the centered √v,
# NVIDIA's NVFP4 attention, NVFP4 Newton-Schulz (used by Muon only).
_WINNERS_STATES_ATTN = {**_STATES_MEAN_HADAMARD, "recipe.attention": "nvfp4", "recipe.newton_schulz": "nvfp4"}
_FOUR_OVER_SIX_FWD = {"recipe.matmul.x.scale_rule": "4over6_mse", "recipe.matmul.w.scale_rule": "4over6_mse"}


def _group(group: str, *arms: Arm) -> tuple[Arm, ...]:
  return tuple(Arm(a.name, a.preset, a.changes, a.seed, a.baseline, a.what, group) for a in arms)


_ARMS: tuple[Arm, ...] = (
    *_group(
        "bf16",
        Arm("bf16_s0", "bf16", {}, 0, None, "the reference, seed 0: the seeds' spread is the noise floor"),
        Arm("bf16_s1", "bf16", {}, 1, None, "the reference, seed 1: the seeds' spread is the noise floor"),
        Arm("bf16_s2", "bf16", {}, 2, None, "the reference, seed 2: the seeds' spread is the noise floor"),
    ),
    *_group(
        "module",
        Arm("fp4_linear", "fp4_linear", {}, 0, "bf16_s0",
            "every block projection in NVFP4 (NVIDIA's recipe: 1x16 activations and gradients, 16x16 "
            "weight tiles, SR on gradients, Hadamard on the wgrad)"),
        Arm("lorasvd_once", "fp4_linear", _ONCE, 0, "fp4_linear",
            "the same with the BF16 low-rank branch (LoRA-SVD, rank 16, split once at init)"),
        Arm("lorasvd_states", "fp4_linear", {**_ONCE, "recipe.optimizer_states": "nvfp4"}, 0,
            "lorasvd_once", "LoRA-SVD linear layers + AdamW moments in NVFP4"),
        Arm("fp4_full_stack", "fp4_linear", _LORASVD_STACK, 0, "lorasvd_states",
            "LoRA-SVD linear + NVFP4 AdamW states + NVFP4 attention (QK^T and dS, tensor reuse)"),
        Arm("full_stack_w1x16_4over6", "fp4_linear", {**_LORASVD_STACK, **_W1X16_4OVER6}, 0, "fp4_full_stack",
            "the full stack on the method's linear baseline: W in 1x16 blocks along K, Four-over-Six on x, W, H.x"),
    ),
    *_group(
        "muon",
        Arm("muon_bf16", "bf16", {"optimizer.name": "muon"}, 0, "bf16_s0",
            "Muon (AdamW on embedding, head, vectors) with BF16 Newton-Schulz operands"),
        Arm("muon_nvfp4", "bf16", {"recipe.newton_schulz": "nvfp4", "optimizer.name": "muon"}, 0,
            "muon_bf16", "Muon with NVFP4 Newton-Schulz operands (fp32 accumulation)"),
        Arm("muon_bf16_s1", "bf16", {"optimizer.name": "muon"}, 1, "bf16_s1", "Muon with BF16 operands, seed 1"),
        Arm("muon_nvfp4_s1", "bf16", {"recipe.newton_schulz": "nvfp4", "optimizer.name": "muon"}, 1,
            "muon_bf16_s1", "Muon with NVFP4 Newton-Schulz operands, seed 1"),
        Arm("muon_linear", "fp4_linear_w1x16_4over6_fwd_bf16_last10", {"optimizer.name": "muon"}, 0, "muon_bf16",
            "Muon (BF16 Newton-Schulz, float32 AdamW moments) on the linear preset's NVFP4 layers"),
        Arm("muon_linear_s1", "fp4_linear_w1x16_4over6_fwd_bf16_last10", {"optimizer.name": "muon"}, 1,
            "muon_bf16_s1", "Muon on the linear preset's NVFP4 layers, seed 1"),
        Arm("muon_winners_states", "fp4_linear_w1x16_4over6_fwd_bf16_last10",
            {**_STATES_MEAN_HADAMARD, "optimizer.name": "muon"}, 0, "muon_linear",
            "Muon on the linear preset with NVFP4 AdamW moments (centered √v) on the embedding, head and vectors "
            "(Muon's momentum float32)"),
        Arm("muon_winners_states_s1", "fp4_linear_w1x16_4over6_fwd_bf16_last10",
            {**_STATES_MEAN_HADAMARD, "optimizer.name": "muon"}, 1, "muon_linear_s1",
            "Muon on the linear preset with NVFP4 states, seed 1"),
        Arm("full_stack_muon", "fp4_linear", {**_LORASVD_STACK, "optimizer.name": "muon"}, 0, "muon_bf16",
            "the full stack with Muon: NVFP4 Newton-Schulz on the blocks' matrices, NVFP4 AdamW moments on the rest"),
        Arm("full_stack_muon_s1", "fp4_linear", {**_LORASVD_STACK, "optimizer.name": "muon"}, 1, "muon_bf16_s1",
            "the full stack with Muon, seed 1"),
    ),
    *_group(
        "attention",
        Arm("pv_quantized", "fp4_linear", {**_LORASVD_STACK, "recipe.attention_op.v.format": "nvfp4",
                                           "recipe.attention_op.p.format": "nvfp4",
                                           "recipe.attention_op.do.format": "nvfp4"}, 0, "fp4_full_stack",
            "V, P, dO in NVFP4 too: P.V, dO.V^T, P^T.dO quantized, not protected"),
        Arm("ds_bf16", "fp4_linear", {**_LORASVD_STACK, "recipe.attention_op.ds.format": "bf16"}, 0, "fp4_full_stack",
            "dS in BF16: dQ = dS.K and dK = dS^T.Q unquantized"),
        Arm("no_reuse", "fp4_linear", {**_LORASVD_STACK, "recipe.attention_op.reuse": False}, 0, "fp4_full_stack",
            "the backward on the unquantized q, k instead of the forward's Q(q), Q(k)"),
    ),
    *_group(
        "linear",
        Arm("no_rht", "fp4_linear", {"recipe.matmul.hadamard": False}, 0, "fp4_linear",
            "fp4_linear without the random Hadamard transform of the wgrad operands"),
        Arm("sr_off", "fp4_linear", {"recipe.matmul.dy_dgrad.rounding": "nearest",
                                     "recipe.matmul.dy_wgrad.rounding": "nearest"}, 0, "fp4_linear",
            "fp4_linear with dy rounded to nearest, not stochastically (dgrad and wgrad)"),
    ),
    *_group(
        "lorasvd",
        Arm("lorasvd_resplit10", "fp4_linear", {**_ONCE, "recipe.lora_resplit_every": -10}, 0,
            "lorasvd_once", "re-split the branch 10 times over the run (top-r SVD of the trained weight)"),
        Arm("lorasvd_rank4", "fp4_linear", {**_ONCE, "recipe.lora_rank": 4}, 0, "lorasvd_once",
            "rank 4 instead of 16"),
        Arm("lorasvd_rank32", "fp4_linear", {**_ONCE, "recipe.lora_rank": 32}, 0, "lorasvd_once",
            "rank 32 instead of 16"),
        Arm("lorasvd_lr0", "fp4_linear", {**_ONCE, "recipe.lora_lr_scale": 0.0}, 0, "lorasvd_once",
            "the branch frozen at its init split (learning rate x0)"),
        Arm("lorasvd_lr4", "fp4_linear", {**_ONCE, "recipe.lora_lr_scale": 4.0}, 0, "lorasvd_once",
            "the branch's learning rate x4"),
        Arm("lorasvd_attn", "fp4_linear", {**_ONCE, "recipe.lora_projections": "qkv,o"}, 0, "lorasvd_once",
            "the branch on the attention projections only (qkv, o)"),
        Arm("lorasvd_mlp", "fp4_linear", {**_ONCE, "recipe.lora_projections": "gate_up,down"}, 0,
            "lorasvd_once", "the branch on the MLP projections only (gate_up, down)"),
    ),
    *_group(
        "module",
        Arm("fp4_linear_s1", "fp4_linear", {}, 1, "bf16_s1", "fp4_linear, seed 1"),
        Arm("fp4_linear_s2", "fp4_linear", {}, 2, "bf16_s2", "fp4_linear, seed 2"),
    ),
    # Where the linear layers' gap is: fp4_linear with only some GEMMs (or operands) in NVFP4,
    # read against bf16 at the same seed.
    *_group(
        "attribution",
        Arm("q_fwd", "fp4_linear", _FWD_ONLY, 0, "bf16_s0", "only the forward GEMM Q(x)·Q(W) in NVFP4"),
        Arm("q_fwd_w", "fp4_linear", {**_FWD_ONLY, "recipe.matmul.x.format": "bf16"}, 0, "bf16_s0",
            "only Q(W) of the forward (x in BF16)"),
        Arm("q_fwd_x", "fp4_linear", {**_FWD_ONLY, "recipe.matmul.w.format": "bf16"}, 0, "bf16_s0",
            "only Q(x) of the forward (W in BF16)"),
        Arm("q_dgrad", "fp4_linear", {"recipe.matmul.fwd": False, "recipe.matmul.wgrad": False,
                                      "recipe.matmul.hadamard": False}, 0, "bf16_s0",
            "only the dgrad GEMM Q(dy)·Q(W)ᵀ in NVFP4"),
        Arm("q_wgrad", "fp4_linear", {"recipe.matmul.fwd": False, "recipe.matmul.dgrad": False}, 0, "bf16_s0",
            "only the wgrad GEMM Q(H·x)ᵀ·Q(H·dy) in NVFP4"),
        Arm("q_fwd_s1", "fp4_linear", _FWD_ONLY, 1, "bf16_s1", "only the forward GEMM Q(x)·Q(W) in NVFP4, seed 1"),
        Arm("q_fwd_w_s1", "fp4_linear", {**_FWD_ONLY, "recipe.matmul.x.format": "bf16"}, 1, "bf16_s1",
            "only Q(W) of the forward (x in BF16), seed 1"),
        Arm("q_fwd_x_s1", "fp4_linear", {**_FWD_ONLY, "recipe.matmul.w.format": "bf16"}, 1, "bf16_s1",
            "only Q(x) of the forward (W in BF16), seed 1"),
        Arm("q_dgrad_s1", "fp4_linear", {"recipe.matmul.fwd": False, "recipe.matmul.wgrad": False,
                                         "recipe.matmul.hadamard": False}, 1, "bf16_s1",
            "only the dgrad GEMM Q(dy)·Q(W)ᵀ in NVFP4, seed 1"),
        Arm("q_wgrad_s1", "fp4_linear", {"recipe.matmul.fwd": False, "recipe.matmul.dgrad": False}, 1,
            "bf16_s1", "only the wgrad GEMM Q(H·x)ᵀ·Q(H·dy) in NVFP4, seed 1"),
    ),
    # Remedies of the linear layers' gap: one change of fp4_linear, read against it at the same seed.
    *_group(
        "remedy",
        Arm("split_mean", "fp4_linear", {"recipe.matmul.split.tensors": ("x", "dy"),
                                         "recipe.matmul.split.method": "mean"}, 0,
            "fp4_linear", "x and dy split as 1·μᵀ + R: the token mean in BF16, R in NVFP4"),
        Arm("split_subspace", "fp4_linear", {"recipe.matmul.split.tensors": ("x", "dy"),
                                             "recipe.matmul.split.method": "subspace",
                                             "recipe.matmul.split.rank": 16}, 0, "fp4_linear",
            "x and dy split as U·P + R: a rank-16 subspace per step in BF16, R in NVFP4"),
        Arm("two_term_fwd", "fp4_linear", {"recipe.matmul.x.terms": 2, "recipe.matmul.w.terms": 2}, 0, "fp4_linear",
            "the forward's x and W as two NVFP4 terms Q1 + Q(a − Q1)"),
        Arm("two_term_x", "fp4_linear", {"recipe.matmul.x.terms": 2}, 0, "fp4_linear",
            "the forward's x as two NVFP4 terms (W one term)"),
        Arm("two_term_w", "fp4_linear", {"recipe.matmul.w.terms": 2}, 0, "fp4_linear",
            "the forward's W as two NVFP4 terms (x one term)"),
        Arm("two_term_bwd", "fp4_linear", {"recipe.matmul.dy_dgrad.terms": 2, "recipe.matmul.x_wgrad.terms": 2,
                                          "recipe.matmul.dy_wgrad.terms": 2}, 0, "fp4_linear",
            "the backward's dy (dgrad, wgrad) and H·x as two NVFP4 terms"),
        Arm("split_mean_s1", "fp4_linear", {"recipe.matmul.split.tensors": ("x", "dy"),
                                            "recipe.matmul.split.method": "mean"}, 1,
            "fp4_linear_s1", "x and dy split as 1·μᵀ + R: the token mean in BF16, R in NVFP4, seed 1"),
        Arm("split_subspace_s1", "fp4_linear", {"recipe.matmul.split.tensors": ("x", "dy"),
                                                "recipe.matmul.split.method": "subspace",
                                                "recipe.matmul.split.rank": 16}, 1, "fp4_linear_s1",
            "x and dy split as U·P + R: a rank-16 subspace per step in BF16, R in NVFP4, seed 1"),
        Arm("two_term_fwd_s1", "fp4_linear", {"recipe.matmul.x.terms": 2, "recipe.matmul.w.terms": 2}, 1,
            "fp4_linear_s1",
            "the forward's x and W as two NVFP4 terms Q1 + Q(a − Q1), seed 1"),
        Arm("two_term_x_s1", "fp4_linear", {"recipe.matmul.x.terms": 2}, 1, "fp4_linear_s1",
            "the forward's x as two NVFP4 terms (W one term), seed 1"),
        Arm("two_term_w_s1", "fp4_linear", {"recipe.matmul.w.terms": 2}, 1, "fp4_linear_s1",
            "the forward's W as two NVFP4 terms (x one term), seed 1"),
        Arm("two_term_bwd_s1", "fp4_linear", {"recipe.matmul.dy_dgrad.terms": 2, "recipe.matmul.x_wgrad.terms": 2,
                                             "recipe.matmul.dy_wgrad.terms": 2}, 1,
            "fp4_linear_s1", "the backward's dy (dgrad, wgrad) and H·x as two NVFP4 terms, seed 1"),
    ),
    # The method's baseline (Four-over-Six block scaling; 1×16 weight blocks), read against fp4_linear at
    # the same seed.
    *_group(
        "baseline",
        Arm("fourover6_fwd", "fp4_linear", _FOUR_OVER_SIX_FWD, 0, "fp4_linear",
            "the forward's x and W scaled by Four-over-Six (MSE choice of 6 or 4 per block)"),
        Arm("fourover6_fwd_s1", "fp4_linear", _FOUR_OVER_SIX_FWD, 1, "fp4_linear_s1",
            "the forward's x and W scaled by Four-over-Six (MSE choice of 6 or 4 per block), seed 1"),
        Arm("fourover6_fwd_mae", "fp4_linear", {"recipe.matmul.x.scale_rule": "4over6_mae",
                                                "recipe.matmul.w.scale_rule": "4over6_mae"}, 0, "fp4_linear",
            "the forward's x and W scaled by Four-over-Six (absolute-error choice of 6 or 4 per block)"),
        Arm("fourover6_fwd_s2", "fp4_linear", _FOUR_OVER_SIX_FWD, 2, "fp4_linear_s2",
            "the forward's x and W scaled by Four-over-Six (MSE choice of 6 or 4 per block), seed 2"),
        Arm("fourover6_all_s1", "fp4_linear", {**_FOUR_OVER_SIX_FWD, "recipe.matmul.x_wgrad.scale_rule": "4over6_mse"},
            1, "fp4_linear_s1", "Four-over-Six (MSE) on x, W and the wgrad's H·x, seed 1"),
        Arm("fourover6_all", "fp4_linear", {**_FOUR_OVER_SIX_FWD, "recipe.matmul.x_wgrad.scale_rule": "4over6_mse"},
            0, "fp4_linear", "Four-over-Six (MSE) on every nearest-rounded operand: x, W and the wgrad's H·x "
            "(stochastic rounding of dy keeps the max rule)"),
    ),
    # NVFP4 attention alone (the bf16 recipe otherwise) and the method's remedies, read against it at the
    # same seed.
    *_group(
        "attention_alone",
        Arm("attn_only", "bf16", {"recipe.attention": "nvfp4"}, 0, "bf16_s0",
            "NVFP4 attention alone (QK^T and dS; V, P, dO in BF16; tensor reuse), BF16 linear layers"),
        Arm("attn_only_s1", "bf16", {"recipe.attention": "nvfp4"}, 1, "bf16_s1",
            "NVFP4 attention alone, seed 1"),
        Arm("attn_k_smooth", "bf16", {"recipe.attention": "nvfp4", "recipe.attention_op.k_smooth": True}, 0,
            "attn_only", "K smoothing: k's mean over the keys subtracted before Q(k)"),
        Arm("attn_k_smooth_s1", "bf16", {"recipe.attention": "nvfp4", "recipe.attention_op.k_smooth": True}, 1,
            "attn_only_s1", "K smoothing, seed 1"),
        Arm("attn_qk_4over6", "bf16", _ATTN_QK_4OVER6, 0, "attn_only", "Four-over-Six (MSE) scales on Q(q) and Q(k)"),
        Arm("attn_method", "bf16", {**_ATTN_QK_4OVER6, "recipe.attention_op.k_smooth": True}, 0, "attn_only",
            "K smoothing and Four-over-Six on Q(q), Q(k)"),
        Arm("attn_method_s1", "bf16", {**_ATTN_QK_4OVER6, "recipe.attention_op.k_smooth": True}, 1, "attn_only_s1",
            "K smoothing and Four-over-Six on Q(q), Q(k), seed 1"),
        Arm("attn_method_hadamard", "bf16", {**_ATTN_QK_4OVER6, "recipe.attention_op.k_smooth": True,
                                             "recipe.attention_op.hadamard": True}, 0, "attn_method",
            "the method's attention with q and k rotated along D by a Hadamard matrix before Q(q), Q(k)"),
        Arm("attn_method_hadamard_s1", "bf16", {**_ATTN_QK_4OVER6, "recipe.attention_op.k_smooth": True,
                                                "recipe.attention_op.hadamard": True}, 1, "attn_method_s1",
            "the method's attention with q and k Hadamard-rotated, seed 1"),
        Arm("attn_v_nvfp4", "bf16", {"recipe.attention": "nvfp4", "recipe.attention_op.v.format": "nvfp4"}, 0,
            "attn_only", "V in NVFP4 too (one Q(v) in P.V and dO.V^T; P and dO in BF16)"),
    ),
    # 1x16 weight blocks along K (the dgrad's W re-quantized along N from the forward's), alone (against
    # fp4_linear) and on top of Four-over-Six on the nearest-rounded operands (against fourover6_all):
    # the candidates for the method's baseline.
    *_group(
        "baseline",
        Arm("w1x16", "fp4_linear", _W1X16, 0, "fp4_linear",
            "W in 1x16 blocks along K (the dgrad's W: Q_N of the dequantized forward W)"),
        Arm("w1x16_s1", "fp4_linear", _W1X16, 1, "fp4_linear_s1",
            "W in 1x16 blocks along K (the dgrad's W: Q_N of the dequantized forward W), seed 1"),
        Arm("w1x16_4over6", "fp4_linear", _W1X16_4OVER6, 0, "fourover6_all",
            "W in 1x16 blocks along K and Four-over-Six (MSE) on x, W and the wgrad's H·x"),
        Arm("w1x16_4over6_s1", "fp4_linear", _W1X16_4OVER6, 1, "fourover6_all_s1",
            "W in 1x16 blocks along K and Four-over-Six (MSE) on x, W and the wgrad's H·x, seed 1"),
    ),
    # Cheap precision where the gap is: one change of fp4_linear, read against it at the same seed.
    *_group(
        "remedy",
        Arm("fwd_bf16_last10", "fp4_linear", {"recipe.bf16_fwd_last": 0.1}, 0, "fp4_linear",
            "the forward GEMMs in BF16 for the last 10% of steps (the backward NVFP4)"),
        Arm("fwd_bf16_last10_s1", "fp4_linear", {"recipe.bf16_fwd_last": 0.1}, 1, "fp4_linear_s1",
            "the forward GEMMs in BF16 for the last 10% of steps (the backward NVFP4), seed 1"),
        Arm("fwd_bf16_last20", "fp4_linear", {"recipe.bf16_fwd_last": 0.2}, 0, "fp4_linear",
            "the forward GEMMs in BF16 for the last 20% of steps (the backward NVFP4)"),
        Arm("fwd_bf16_last20_s1", "fp4_linear", {"recipe.bf16_fwd_last": 0.2}, 1, "fp4_linear_s1",
            "the forward GEMMs in BF16 for the last 20% of steps (the backward NVFP4), seed 1"),
        Arm("down_x_two_term", "fp4_linear", {"recipe.down_x.terms": 2}, 0, "fp4_linear",
            "the MLP down-projection's input as two NVFP4 terms (the other projections as fp4_linear)"),
        Arm("down_x_two_term_s1", "fp4_linear", {"recipe.down_x.terms": 2}, 1, "fp4_linear_s1",
            "the MLP down-projection's input as two NVFP4 terms, seed 1"),
        Arm("down_x_bf16", "fp4_linear", {"recipe.down_x.format": "bf16"}, 0, "fp4_linear",
            "the MLP down-projection's input in BF16"),
        Arm("down_x_bf16_s1", "fp4_linear", {"recipe.down_x.format": "bf16"}, 1, "fp4_linear_s1",
            "the MLP down-projection's input in BF16, seed 1"),
    ),
    # The random stream of stochastic rounding: a keyed counter hash (cheap in the kernels) in place of
    # jax.random.bits, read against fp4_linear at the same seed.
    *_group(
        "stream",
        Arm("counter_bits", "fp4_linear", {"recipe.matmul.rounding_bits": "counter"}, 0, "fp4_linear",
            "stochastic rounding of dy and H·dy from the counter hash instead of jax.random.bits"),
        Arm("counter_bits_s1", "fp4_linear", {"recipe.matmul.rounding_bits": "counter"}, 1, "fp4_linear_s1",
            "stochastic rounding from the counter hash, seed 1"),
        Arm("full_stack_winners_counter", "fp4_full_stack", {"recipe.matmul.rounding_bits": "counter"}, 0,
            "full_stack_winners", "the full stack of the measured winners with the linear layers' stochastic "
            "rounding from the counter hash"),
        Arm("full_stack_winners_counter_s1", "fp4_full_stack", {"recipe.matmul.rounding_bits": "counter"}, 1,
            "full_stack_winners_s1", "the full stack of the measured winners, counter-hash rounding, seed 1"),
    ),
    # The method's baseline (1x16 W, Four-over-Six) with the forward GEMMs in BF16 at the end of training,
    # read against that baseline at the same seed.
    *_group(
        "remedy",
        Arm("w1x16_4over6_last10", "fp4_linear", {**_W1X16_4OVER6, "recipe.bf16_fwd_last": 0.1}, 0, "w1x16_4over6",
            "the method's baseline with the forward GEMMs in BF16 for the last 10% of steps"),
        Arm("w1x16_4over6_last10_s1", "fp4_linear", {**_W1X16_4OVER6, "recipe.bf16_fwd_last": 0.1}, 1,
            "w1x16_4over6_s1", "the method's baseline with the forward GEMMs in BF16 for the last 10%, seed 1"),
        Arm("w1x16_4over6_last20", "fp4_linear", {**_W1X16_4OVER6, "recipe.bf16_fwd_last": 0.2}, 0, "w1x16_4over6",
            "the method's baseline with the forward GEMMs in BF16 for the last 20% of steps"),
        Arm("w1x16_4over6_last20_s1", "fp4_linear", {**_W1X16_4OVER6, "recipe.bf16_fwd_last": 0.2}, 1,
            "w1x16_4over6_s1", "the method's baseline with the forward GEMMs in BF16 for the last 20%, seed 1"),
    ),
    # LoRA-SVD the method's way on the method's baseline: W 1x16 with Four-over-Six, the branch re-aligned by a
    # randomized SVD every k steps, read against that baseline at the same seed.
    *_group(
        "lorasvd",
        Arm("lorasvd_method300", "fp4_linear_lorasvd", {"recipe.lora_resplit_every": -5},
            0, "w1x16_4over6", "the method's baseline + rank-16 branch re-aligned every 300 steps"),
        Arm("lorasvd_method750", "fp4_linear_lorasvd", {"recipe.lora_resplit_every": -2},
            0, "w1x16_4over6", "the method's baseline + rank-16 branch re-aligned every 750 steps"),
        Arm("lorasvd_method300_r32", "fp4_linear_lorasvd", {"recipe.lora_resplit_every": -5, "recipe.lora_rank": 32}, 0,
            "w1x16_4over6", "the method's baseline + rank-32 branch re-aligned every 300 steps"),
        Arm("lorasvd_method300_s1", "fp4_linear_lorasvd", {"recipe.lora_resplit_every": -5},
            1, "w1x16_4over6_s1", "the method's baseline + rank-16 branch re-aligned every 300 steps, seed 1"),
        Arm("lorasvd_method300_r32_s1", "fp4_linear_lorasvd", {"recipe.lora_resplit_every": -5, "recipe.lora_rank": 32},
            1, "w1x16_4over6_s1", "the method's baseline + rank-32 branch re-aligned every 300 steps, seed 1"),
    ),
    # Every remedy of the method at once: the full stack on the method's linear baseline, LoRA-SVD re-aligned
    # twice, √v mean-removed and Hadamard-rotated, K smoothing and Four-over-Six on q and k.
    *_group(
        "module",
        Arm("full_stack_method", "fp4_linear", {**_LORASVD_STACK, **_FULL_STACK_METHOD}, 0, "fp4_full_stack",
            "the full stack with the method's remedies: W 1x16 + Four-over-Six, LoRA-SVD re-aligned every 750 "
            "steps, √v mean-removed and rotated, K smoothing and Four-over-Six on q, k"),
        Arm("full_stack_method_s1", "fp4_linear", {**_LORASVD_STACK, **_FULL_STACK_METHOD}, 1, "bf16_s1",
            "the full stack with the method's remedies, seed 1"),
        Arm("full_stack_winners", "fp4_full_stack", {}, 0, "bf16_s0",
            "the full stack of the measured winners: fp4_linear_w1x16_4over6_fwd_bf16_last10, √v mean-removed "
            "and rotated, K smoothing and Four-over-Six on q, k"),
        Arm("full_stack_winners_s1", "fp4_full_stack", {}, 1, "bf16_s1",
            "the full stack of the measured winners, seed 1"),
        Arm("full_stack_ds_bf16", "fp4_full_stack", {"recipe.attention_op.ds.format": "bf16"}, 0,
            "full_stack_winners", "the full stack of the winners with attention's dS in BF16 (dQ, dK unquantized)"),
        Arm("full_stack_ds_bf16_s1", "fp4_full_stack", {"recipe.attention_op.ds.format": "bf16"}, 1,
            "full_stack_winners_s1", "the full stack of the winners with attention's dS in BF16, seed 1"),
        Arm("full_stack_attn_fwd_bf16", "fp4_full_stack", {"recipe.bf16_fwd_attention": True}, 0,
            "full_stack_winners", "the full stack of the winners with attention's scores (q, k) in BF16 in the "
            "last 10% of steps, beside the projections' BF16 forward (dS still NVFP4)"),
        Arm("full_stack_attn_fwd_bf16_s1", "fp4_full_stack", {"recipe.bf16_fwd_attention": True}, 1,
            "full_stack_winners_s1", "the full stack of the winners with attention's scores in BF16 in the last "
            "10% of steps, seed 1"),
        Arm("full_stack_attn_hadamard", "fp4_full_stack", {"recipe.attention_op.hadamard": True}, 0,
            "full_stack_winners", "the full stack of the winners with attention's q and k Hadamard-rotated along D"),
        Arm("full_stack_attn_hadamard_s1", "fp4_full_stack", {"recipe.attention_op.hadamard": True}, 1,
            "full_stack_winners_s1", "the full stack of the winners with q and k Hadamard-rotated, seed 1"),
        Arm("winners_states", "fp4_linear_w1x16_4over6_fwd_bf16_last10", _STATES_MEAN_HADAMARD, 0,
            "w1x16_4over6_last10", "the linear preset + NVFP4 AdamW moments, √v mean-removed and rotated"),
        Arm("winners_states_s1", "fp4_linear_w1x16_4over6_fwd_bf16_last10", _STATES_MEAN_HADAMARD, 1,
            "w1x16_4over6_last10_s1", "the linear preset + NVFP4 moments with the centered √v, seed 1"),
        Arm("winners_states_keep_embed_head", "fp4_linear_w1x16_4over6_fwd_bf16_last10",
            {**_STATES_MEAN_HADAMARD, "recipe.moments.keep_fp32": ("embed", "lm_head")}, 0, "winners_states",
            "the linear preset + NVFP4 moments with the centered √v, the embedding's and LM head's float32"),
        Arm("winners_states_keep_embed_head_s1", "fp4_linear_w1x16_4over6_fwd_bf16_last10",
            {**_STATES_MEAN_HADAMARD, "recipe.moments.keep_fp32": ("embed", "lm_head")}, 1, "winners_states_s1",
            "the linear preset + NVFP4 moments with the centered √v, the embedding's and LM head's float32, "
            "seed 1"),
        Arm("winners_states_attn", "fp4_linear_w1x16_4over6_fwd_bf16_last10",
            _WINNERS_STATES_ATTN, 0, "winners_states",
            "the linear preset + NVFP4 moments (centered √v) + NVFP4 attention, NVIDIA's (no K smoothing or 4/6)"),
        Arm("winners_states_attn_s1", "fp4_linear_w1x16_4over6_fwd_bf16_last10",
            _WINNERS_STATES_ATTN, 1, "winners_states_s1",
            "the linear preset + NVFP4 moments (centered √v) + NVFP4 attention, seed 1"),
        Arm("full_stack_winners_muon", "fp4_full_stack", {"optimizer.name": "muon"}, 0,
            "muon_bf16", "the full stack of the measured winners with Muon: NVFP4 Newton-Schulz on the blocks' "
            "matrices, NVFP4 AdamW moments (centered √v) on the rest"),
        Arm("full_stack_winners_muon_s1", "fp4_full_stack", {"optimizer.name": "muon"}, 1,
            "muon_bf16_s1", "the full stack of the measured winners with Muon, seed 1"),
    ),
    # LoRA-SVD re-aligned the method's way: a randomized SVD of the effective weight every k steps, the new
    # factors rotated onto the old ones' columns so that their Adam moments stay in their basis.
    *_group(
        "lorasvd",
        Arm("lorasvd_realign300", "fp4_linear", {**_ONCE, **_REALIGN, "recipe.lora_resplit_every": -5}, 0,
            "lorasvd_once", "re-aligned every 300 steps (4 times), rank 16"),
        Arm("lorasvd_realign750", "fp4_linear", {**_ONCE, **_REALIGN, "recipe.lora_resplit_every": -2}, 0,
            "lorasvd_once", "re-aligned every 750 steps (once, mid-run), rank 16"),
        Arm("lorasvd_realign300_r32", "fp4_linear",
            {**_ONCE, **_REALIGN, "recipe.lora_resplit_every": -5, "recipe.lora_rank": 32}, 0, "lorasvd_once",
            "re-aligned every 300 steps, rank 32"),
        Arm("lorasvd_realign750_r32", "fp4_linear",
            {**_ONCE, **_REALIGN, "recipe.lora_resplit_every": -2, "recipe.lora_rank": 32}, 0, "lorasvd_once",
            "re-aligned every 750 steps, rank 32"),
    ),
    # NVFP4 AdamW moments on fp4_linear: where their cost lies (m or √v alone; the embedding and LM head kept
    # float32) and the method's encodings, each read against linear_states at the same seed.
    *_group(
        "states",
        Arm("linear_states", "fp4_linear", _STATES, 0, "fp4_linear", "fp4_linear + NVFP4 AdamW moments (m and √v)"),
        Arm("linear_states_s1", "fp4_linear", _STATES, 1, "fp4_linear_s1", "fp4_linear + NVFP4 AdamW moments, seed 1"),
        Arm("states_m_only", "fp4_linear", {**_STATES, "recipe.moments.nu": None}, 0, "fp4_linear",
            "only m in NVFP4 (v float32)"),
        Arm("states_v_only", "fp4_linear", {**_STATES, "recipe.moments.mu": None}, 0, "fp4_linear",
            "only √v in NVFP4 (m float32)"),
        Arm("states_keep_embed_head", "fp4_linear", {**_STATES, "recipe.moments.keep_fp32": ("embed", "lm_head")}, 0,
            "linear_states", "NVFP4 moments except the embedding's and the LM head's (float32)"),
        Arm("states_m_only_s1", "fp4_linear", {**_STATES, "recipe.moments.nu": None}, 1, "fp4_linear_s1",
            "only m in NVFP4, seed 1"),
        Arm("states_v_only_s1", "fp4_linear", {**_STATES, "recipe.moments.mu": None}, 1, "fp4_linear_s1",
            "only √v in NVFP4, seed 1"),
        Arm("states_keep_embed_head_s1", "fp4_linear", {**_STATES, "recipe.moments.keep_fp32": ("embed", "lm_head")},
            1, "linear_states_s1", "NVFP4 moments except the embedding's and the LM head's, seed 1"),
        Arm("states_mean_hadamard", "fp4_linear", {**_STATES, "recipe.moments.nu_transform": "mean_hadamard"}, 0,
            "linear_states", "√v stored as its 16-block mean (bf16) and the Hadamard-rotated rest in NVFP4"),
        Arm("states_mean_hadamard_s1", "fp4_linear", {**_STATES, "recipe.moments.nu_transform": "mean_hadamard"}, 1,
            "linear_states_s1", "√v mean-removed and Hadamard-rotated, seed 1"),
        Arm("states_mean_hadamard_keep_embed_head", "fp4_linear",
            {**_STATES_MEAN_HADAMARD, "recipe.moments.keep_fp32": ("embed", "lm_head")}, 0, "states_mean_hadamard",
            "the centered √v, the embedding's and LM head's moments float32"),
        Arm("states_mean_hadamard_keep_embed_head_s1", "fp4_linear",
            {**_STATES_MEAN_HADAMARD, "recipe.moments.keep_fp32": ("embed", "lm_head")}, 1,
            "states_mean_hadamard_s1", "the centered √v, the embedding's and LM head's moments float32, seed 1"),
        Arm("states_mean_hadamard_dither_m", "fp4_linear",
            {**_STATES_MEAN_HADAMARD, "recipe.moments.mu.rounding": "nearest", "recipe.moments.dither": ("mu",)}, 0,
            "states_mean_hadamard", "the centered √v, m with subtractive dither"),
        Arm("states_precond_sr", "fp4_linear", {**_STATES, "recipe.moments.nu_sr_space": "preconditioner"}, 0,
            "linear_states", "√v rounded stochastically in 1/(√v + ε), the preconditioner's space"),
        Arm("states_nearest", "fp4_linear", {**_STATES, "recipe.moments.mu.rounding": "nearest",
                                             "recipe.moments.nu.rounding": "nearest"}, 0, "linear_states",
            "m and √v rounded to nearest"),
        Arm("states_nearest_4over6", "fp4_linear", {**_STATES, "recipe.moments.mu.rounding": "nearest",
                                                    "recipe.moments.nu.rounding": "nearest",
                                                    "recipe.moments.mu.scale_rule": "4over6_mse",
                                                    "recipe.moments.nu.scale_rule": "4over6_mse"}, 0,
            "states_nearest", "m and √v rounded to nearest with Four-over-Six scales"),
        Arm("states_dither", "fp4_linear", {**_STATES_NEAREST, "recipe.moments.dither": ("mu", "nu")}, 0,
            "linear_states", "m and √v with subtractive dither (nearest codes, the hash's offsets removed on load)"),
        Arm("states_dither_s1", "fp4_linear", {**_STATES_NEAREST, "recipe.moments.dither": ("mu", "nu")}, 1,
            "linear_states_s1", "m and √v with subtractive dither, seed 1"),
        Arm("states_eden", "fp4_linear", {**_STATES_NEAREST, "recipe.moments.eden": ("mu", "nu")}, 0,
            "states_nearest", "m and √v rounded to nearest, block scales EDEN-calibrated"),
        Arm("states_eden_m_precond_v", "fp4_linear", {**_STATES, "recipe.moments.mu.rounding": "nearest",
                                                      "recipe.moments.eden": ("mu",),
                                                      "recipe.moments.nu_sr_space": "preconditioner"}, 0,
            "linear_states", "EDEN-calibrated nearest m, √v rounded stochastically in the preconditioner's space"),
    ),
)


# This study's runs (experiments/results/20m_h100, 20m_h200) drew the linear layers' stochastic-rounding bits
# from jax.random.bits: every arm with NVFP4 linear layers names that stream, and the `stream` arms read the
# counter hash (MatmulConfig's default) against it, one change at the same seed.
_STUDY_STREAM = {"recipe.matmul.rounding_bits": "random"}


def _study_stream(arm: Arm) -> Arm:
  if (arm.changes.get("recipe.linear", PRESETS[arm.preset].linear) == "bf16"
      or "recipe.matmul.rounding_bits" in arm.changes):
    return arm
  return dataclasses.replace(arm, changes={**arm.changes, **_STUDY_STREAM})


ARMS: tuple[Arm, ...] = tuple(map(_study_stream, _ARMS))
