"""fp4jax.recipe: presets, validation, BF16-exempt blocks, the nested op configs."""

import dataclasses
import json
from pathlib import Path

import pytest

from fp4jax import recipe as recipe_lib
from fp4jax.execution import Execution
from fp4jax.layers import DEFAULT_LORA_RANK
from fp4jax.ops.attention import AttentionConfig
from fp4jax.ops.matmul import MatmulConfig, Split
from fp4jax.optim import AdamNvfp4Options
from fp4jax.recipe import PROJECTIONS, Recipe, get_recipe
from fp4jax.quant import Operand

ROOT = Path(__file__).resolve().parents[1]


def test_presets_and_their_modules():
  bf16, lin, lora, full = (get_recipe(n) for n in
                           ("bf16", "fp4_linear", "fp4_linear_lorasvd", "fp4_full_stack"))
  assert (bf16.linear, bf16.attention, bf16.optimizer_states, bf16.newton_schulz) == (
      "bf16", "bf16", "fp32", "bf16")
  assert lin == dataclasses.replace(bf16, linear="nvfp4")
  # The full stack of the study's winners: the linear preset, the centered √v, the method's attention.
  assert full == get_recipe("fp4_linear_w1x16_4over6_fwd_bf16_last10").replace(
      attention="nvfp4", optimizer_states="nvfp4", newton_schulz="nvfp4", moments={"nu_transform": "mean_hadamard"},
      attention_op={"q": {"scale_rule": "4over6_mse"}, "k": {"scale_rule": "4over6_mse"}, "k_smooth": True})
  # LoRA-SVD the method's way: on the method's baseline, re-aligned by a randomized SVD with aligned moments.
  assert lora == get_recipe("fp4_linear_w1x16_4over6").replace(
      linear="nvfp4_lorasvd", lora_resplit_every=300, lora_resplit_moments="aligned", lora_resplit_svd="randomized")


def test_recipe_is_frozen_and_hashable():
  r = get_recipe("fp4_linear")
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.linear = "bf16"
  assert hash(r) == hash(Recipe(linear="nvfp4"))


@pytest.mark.parametrize("field,value", [("linear", "int4"), ("attention", "fp8"),
                                         ("optimizer_states", "bf16"), ("newton_schulz", "fp32"),
                                         ("lora_resplit_moments", "rotate"), ("lora_resplit_svd", "full")])
def test_bad_choice_names_the_field(field, value):
  with pytest.raises(ValueError, match=f"Recipe.{field}="):
    Recipe(**{field: value})


def test_bad_counts_and_unknown_preset():
  with pytest.raises(ValueError, match="bf16_last_blocks"):
    Recipe(bf16_last_blocks=-1)
  with pytest.raises(ValueError, match="lora_rank"):
    Recipe(linear="nvfp4_lorasvd", lora_rank=0)
  with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
    get_recipe("fp8")


def test_overrides():
  r = get_recipe("fp4_linear", bf16_last_blocks=2)
  assert r.linear == "nvfp4" and r.bf16_last_blocks == 2
  assert recipe_lib.PRESETS["fp4_linear"].bf16_last_blocks == 0  # presets untouched


def test_bf16_exempt_blocks():
  r = Recipe(linear="nvfp4", bf16_first_blocks=1, bf16_last_blocks=2)
  assert [r.block_linear(i, 6) for i in range(6)] == ["bf16", "nvfp4", "nvfp4", "nvfp4", "bf16",
                                                      "bf16"]
  assert [get_recipe("bf16").block_linear(i, 3) for i in range(3)] == ["bf16"] * 3
  with pytest.raises(ValueError, match="out of range"):
    r.block_linear(6, 6)


def test_op_configs_nest_in_the_recipe():
  """Each NVFP4 module's numerics is its op's config, one field of the recipe; a nested change is
  one field in one place, validated by the op config itself."""
  full = Recipe(linear="nvfp4", attention="nvfp4", optimizer_states="nvfp4", newton_schulz="nvfp4")
  assert (full.matmul, full.attention_op, full.moments) == (
      MatmulConfig.nvfp4(), AttentionConfig.nvfp4(), AdamNvfp4Options())
  r = full.replace(attention_op={"ds": Operand(format="bf16"), "reuse": False}, matmul={"hadamard": False})
  assert r.attention_op == AttentionConfig.nvfp4(ds=Operand(format="bf16"), reuse=False)
  assert r.matmul == MatmulConfig.nvfp4(hadamard=False) and r.moments == full.moments
  assert get_recipe("fp4_linear", matmul={"rounding_bits": "counter"}).matmul == MatmulConfig.nvfp4(
      rounding_bits="counter")
  # A dataclass nested in an op config takes a dict too: one operand's field.
  two = full.replace(matmul={"x": {"terms": 2}, "split": {"tensors": ("x",)}}).matmul
  assert two == MatmulConfig.nvfp4(x=Operand(terms=2), split=Split(("x",)))
  with pytest.raises(ValueError, match=r"MatmulConfig.x.block=\(16, 16\)"):
    full.replace(matmul={"x": {"block": (16, 16)}})
  with pytest.raises(ValueError, match="AttentionConfig.ds"):
    full.replace(attention_op={"ds": "fp8"})
  with pytest.raises(ValueError, match="rounding_bits"):
    full.replace(matmul={"rounding_bits": "philox"})
  with pytest.raises(TypeError, match="mu_rounding"):
    full.replace(moments={"mu_rounding": "nearest"})  # the moment's rounding is moments.mu.rounding
  with pytest.raises(ValueError, match="Recipe.moments must be a AdamNvfp4Options"):
    Recipe(moments={"mu": Operand(rounding="nearest")})
  with pytest.raises(ValueError, match="Recipe.matmul must be a MatmulConfig"):
    Recipe(matmul=AttentionConfig.nvfp4())
  assert Recipe().lora_rank == DEFAULT_LORA_RANK  # one default, the layer's


def test_operands_are_sections_of_the_experiment_config():
  """Each operand of a nested op config is a section of the experiment config, so the command line
  sets one field of it (``--config.recipe.attention_op.v.format=nvfp4``)."""
  from experiments.configs import tiny
  from experiments.train import from_config
  cfg = tiny.get_config("fp4_full_stack")
  cfg.recipe.attention_op.v.format = "nvfp4"
  cfg.recipe.attention_op.do.format = "nvfp4"
  cfg.recipe.moments.mu.rounding = "nearest"
  _, recipe, *_ = from_config(cfg, vocab_size=257)
  full = get_recipe("fp4_full_stack")
  assert recipe.attention_op == dataclasses.replace(full.attention_op, v=Operand(), do=Operand(rounding="stochastic"))
  assert recipe.moments == dataclasses.replace(full.moments, mu=Operand())
  cfg.recipe.attention_op.v.terms = 2
  with pytest.raises(ValueError, match="AttentionConfig.v.terms must be 1"):
    from_config(cfg, vocab_size=257)


def test_scale_rule_on_the_command_line_reaches_the_matmul():
  """``--config.recipe.matmul.x.scale_rule=4over6_mae`` sets the forward ``x`` operand's rule of the
  recipe's ``MatmulConfig`` (what every quantized linear layer passes to ``nvfp4_matmul``)."""
  from experiments.configs import tiny
  from experiments.train import from_config
  cfg = tiny.get_config("fp4_linear")
  cfg.recipe.matmul.x.scale_rule = "4over6_mae"
  _, recipe, *_ = from_config(cfg, vocab_size=257)
  assert recipe.matmul == MatmulConfig.nvfp4(x=Operand(scale_rule="4over6_mae"))
  assert recipe.matmul.w.scale_rule == "max"
  cfg.recipe.matmul.x.rounding = "stochastic"
  with pytest.raises(ValueError, match="Operand.scale_rule='4over6_mae' requires Operand.rounding='nearest'"):
    from_config(cfg, vocab_size=257)


def test_recipe_holds_no_execution_choice():
  """What a recipe computes is all it holds: no field of it, nested ones included, names the code
  that runs an op (``fp4jax.execution``)."""
  def fields(obj):
    for f in dataclasses.fields(obj):
      v = getattr(obj, f.name)
      yield f.name
      if dataclasses.is_dataclass(v):
        yield from fields(v)
  names = set(fields(get_recipe("fp4_full_stack")))
  assert not names & {"implementation", "gemm", "amax", "kernel", "block_sizes", "interpret",
                       "cross_entropy", "optimizer"}
  assert "recipe" not in {f.name for f in dataclasses.fields(Execution)}


def test_lora_projections():
  assert all(Recipe().lora_on(p) for p in PROJECTIONS)
  r = Recipe(linear="nvfp4_lorasvd", lora_projections="qkv,o")
  assert [r.lora_on(p) for p in PROJECTIONS] == [True, True, False, False]
  for bad in ("qkv,mlp", "", "o,o", ("qkv",)):
    with pytest.raises(ValueError, match="lora_projections"):
      Recipe(lora_projections=bad)
  with pytest.raises(ValueError, match="unknown projection"):
    r.lora_on("mlp")


# A recipe as run folders saved it before the op configs held one Operand per operand.
_OLD_LAYOUT = {
    "linear": "nvfp4_lorasvd", "attention": "nvfp4", "optimizer_states": "nvfp4", "newton_schulz": "nvfp4",
    "bf16_first_blocks": 0, "bf16_last_blocks": 0, "lora_rank": 16, "lora_resplit_every": 0,
    "lora_lr_scale": 1.0, "lora_projections": "all",
    "matmul": {"fwd": True, "dgrad": True, "wgrad": True, "x_rounding": "nearest", "w_rounding": "nearest",
               "dy_dgrad_rounding": "stochastic", "x_wgrad_rounding": "nearest",
               "dy_wgrad_rounding": "stochastic", "hadamard": True, "rounding_bits": "random",
               "bf16_operands": "dy_dgrad", "two_term": "x,w", "split": "dy", "split_method": "mean",
               "split_rank": 8, "split_power_iters": 1},
    "attention_op": {"q": "nvfp4", "k": "nvfp4", "v": "nvfp4", "p": "bf16", "do": "bf16", "ds": "nvfp4",
                     "q_rounding": "nearest", "k_rounding": "nearest", "v_rounding": "nearest",
                     "p_rounding": "nearest", "do_rounding": "stochastic", "ds_rounding": "stochastic",
                     "reuse": True, "ds_tile": [64, 64]},
    "moments": {"min_size": 4096, "mu_rounding": "nearest", "nu_rounding": "stochastic", "clip_update": True},
}


def test_a_recipe_saved_in_the_flat_layout_resumes_as_the_same_recipe():
  """``upgrade_dict`` maps the flat fields onto the operand specs, so a run folder written before them
  resumes; any real difference is still refused, named in today's layout."""
  from experiments.configs.tiny import get_config
  from fp4jax import workdir
  from fp4jax.experiment import Experiment
  from fp4jax.recipe import upgrade_dict

  stack = Recipe(linear="nvfp4_lorasvd", attention="nvfp4", optimizer_states="nvfp4", newton_schulz="nvfp4")
  same = stack.replace(matmul={
      "x": {"terms": 2}, "w": {"terms": 2}, "dy_dgrad": {"format": "bf16"},
      "split": {"tensors": ("dy",), "rank": 8}, "rounding_bits": "random"}, attention_op={"v": {"format": "nvfp4"}},
      moments={"mu": {"rounding": "nearest"}})
  up = upgrade_dict(_OLD_LAYOUT)
  assert up["matmul"]["w"] == {"format": "nvfp4", "rounding": "nearest", "block": [16, 16], "terms": 2,
                               "scale_rule": "max"}
  cfg = get_config("fp4_full_stack").to_dict()
  cfg["recipe"] = _OLD_LAYOUT  # an old config.json types as the same recipe
  assert Experiment.from_config(cfg).recipe == same
  assert upgrade_dict(same.to_dict()) == same.to_dict()  # today's layout passes through
  saved = {"recipe": _OLD_LAYOUT, "seed": 0}
  assert workdir.identity_changes(saved, {"recipe": same.to_dict(), "seed": 0}) == []
  other = same.replace(matmul={"x": {"terms": 1}})
  with pytest.raises(workdir.IncompatibleCheckpointError, match=r"recipe\.matmul\.x\.terms: checkpoint 2"):
    workdir.identity_changes(saved, {"recipe": other.to_dict(), "seed": 0})



def test_a_checkpoint_saved_before_rounding_bits_resumes_on_its_stream_only():
  """A run identity whose ``recipe.matmul`` has no ``rounding_bits`` ran ``jax.random.bits`` (the
  field's default then): resuming it on the counter stream (today's default) is refused, naming the
  field; with ``rounding_bits="random"`` it resumes."""
  from fp4jax import workdir

  now = get_recipe("fp4_linear")
  assert now.matmul.rounding_bits == "counter"
  old = now.to_dict()
  del old["matmul"]["rounding_bits"]
  saved = {"recipe": old, "seed": 0}
  with pytest.raises(workdir.IncompatibleCheckpointError,
                     match=r"recipe\.matmul\.rounding_bits: checkpoint 'random', this run 'counter'"):
    workdir.identity_changes(saved, {"recipe": now.to_dict(), "seed": 0})
  same = now.replace(matmul={"rounding_bits": "random"})
  assert workdir.identity_changes(saved, {"recipe": same.to_dict(), "seed": 0}) == []

def test_resplit_fields_saved_under_the_optimizer_are_the_recipes():
  """``lora_resplit_moments``/``_svd`` were ``OptimizerConfig`` fields: a config.json or an identity
  that holds them under ``optimizer`` reads them into the recipe, one that holds neither resumes as
  the defaults, and a real difference is refused as a change of the recipe."""
  from fp4jax import workdir
  from fp4jax.experiment import Experiment
  from fp4jax.recipe import upgrade_dict

  run = json.loads((ROOT / "experiments/results/20m_h100/w1x16_4over6/config.json").read_text())["config"]
  assert run["optimizer"]["lora_resplit_moments"] == "keep" and "lora_resplit_moments" not in run["recipe"]
  exp = Experiment.from_config(run)
  assert (exp.recipe.lora_resplit_moments, exp.recipe.lora_resplit_svd) == ("keep", "layer")
  moved = {"lora_resplit_moments": "aligned", "lora_resplit_svd": "randomized"}
  old_run = {**run, "optimizer": {**run["optimizer"], **moved}}
  mine = Experiment.from_config(old_run)
  assert mine.recipe == exp.recipe.replace(**moved) and mine.optimizer == exp.optimizer
  assert upgrade_dict(mine.recipe.to_dict(), old_run["optimizer"]) == mine.recipe.to_dict()
  assert Experiment.from_config({**old_run, "recipe": mine.recipe.to_dict()}) == mine  # given twice, the same
  with pytest.raises(ValueError, match="recipe.lora_resplit_svd='exact' and optimizer.lora_resplit_svd"):
    upgrade_dict({**mine.recipe.to_dict(), "lora_resplit_svd": "exact"}, old_run["optimizer"])

  current = workdir.identity(mine)
  saved = {**current, "recipe": {k: v for k, v in current["recipe"].items() if k not in moved},
           "optimizer": {**current["optimizer"], **moved}}  # as the identity was saved with optimizer fields
  assert workdir.identity_changes(saved, current) == []
  before = {**saved, "optimizer": current["optimizer"]}  # saved before either field existed
  assert workdir.identity_changes(before, workdir.identity(exp)) == []
  with pytest.raises(workdir.IncompatibleCheckpointError, match="recipe.lora_resplit_moments: checkpoint 'aligned'"):
    workdir.identity_changes(saved, workdir.identity(exp), allow=("optimizer",))


def test_bf16_forward_tail_is_a_schedule_of_the_run():
  r = get_recipe("fp4_linear", bf16_fwd_last=0.1)
  assert get_recipe("fp4_linear").bf16_fwd_from(1500) == 1500  # no switch by default
  assert r.bf16_fwd_from(1500) == 1350 and r.bf16_fwd_from(10) == 9 and r.bf16_fwd_from(9) == 9
  assert Recipe(bf16_fwd_last=0.3).bf16_fwd_from(10) == 7  # 0.3·10 counts 3 steps, not 2.9999...
  assert Recipe(bf16_fwd_last=1.0).bf16_fwd_from(5) == 0 and Recipe(bf16_fwd_last=1).bf16_fwd_from(5) == 0
  assert r.at_step(1349, 1500) is r
  late = r.at_step(1350, 1500)
  assert late == r.replace(matmul={"fwd": False}) == r.bf16_forward() and r.at_step(1499, 1500) == late
  assert (late.matmul.dgrad, late.matmul.wgrad, late.matmul.dy_dgrad) == (True, True, r.matmul.dy_dgrad)
  for same in (get_recipe("bf16", bf16_fwd_last=0.5), get_recipe("fp4_linear", bf16_fwd_last=0.5,
                                                                  matmul={"fwd": False})):
    assert same.at_step(9, 10) is same  # nothing to switch
  for bad in (-0.1, 1.5, True, "0.1", float("nan")):
    with pytest.raises(ValueError, match="Recipe.bf16_fwd_last"):
      Recipe(bf16_fwd_last=bad)
  with pytest.raises(ValueError, match="steps=0"):
    r.bf16_fwd_from(0)


def test_bf16_forward_tail_of_attention_unquantizes_q_and_k_alone():
  """``bf16_fwd_attention``: the late phase also takes attention's q and k to BF16, dS and the rest
  of ``attention_op`` unchanged; nothing changes before the switch, without the tail, or where
  attention is BF16."""
  r = get_recipe("fp4_full_stack", bf16_fwd_attention=True)
  assert r.at_step(1349, 1500) is r
  late = r.at_step(1350, 1500)
  op, late_op = r.attention_op, late.attention_op
  assert (late_op.q.format, late_op.k.format) == ("bf16", "bf16") and op.q.quantized and op.k.quantized
  assert late_op == dataclasses.replace(op, q=dataclasses.replace(op.q, format="bf16"),
                                        k=dataclasses.replace(op.k, format="bf16"))
  assert late_op.ds == op.ds and late_op.ds.quantized and late_op.k_smooth == op.k_smooth
  assert late.matmul == r.bf16_forward().matmul == dataclasses.replace(r.matmul, fwd=False)
  # Without the flag the late phase leaves attention alone (the preset's own tail).
  plain = get_recipe("fp4_full_stack")
  assert plain.at_step(1499, 1500).attention_op == plain.attention_op
  # BF16 attention, or no tail: nothing to switch.
  for same in (get_recipe("fp4_full_stack", attention="bf16", bf16_fwd_attention=True, matmul={"fwd": False}),
               get_recipe("fp4_full_stack", bf16_fwd_attention=True, bf16_fwd_last=0.0)):
    assert same.at_step(1499, 1500) is same
  # Attention alone switches where the projections are BF16.
  attn = get_recipe("bf16", attention="nvfp4", bf16_fwd_attention=True, bf16_fwd_last=0.5)
  assert attn.at_step(9, 10) == attn.replace(attention_op={"q": {"format": "bf16"}, "k": {"format": "bf16"}})
  for bad in (1, "True", None):
    with pytest.raises(ValueError, match="Recipe.bf16_fwd_attention"):
      Recipe(bf16_fwd_attention=bad)


def test_down_x_overrides_the_down_projection_input_alone():
  r = get_recipe("fp4_linear", down_x={"terms": 2})
  assert r.down_x == recipe_lib.OperandOverride(terms=2)
  for p in PROJECTIONS:
    want = r.matmul if p != "down" else dataclasses.replace(r.matmul, x=Operand(terms=2))
    assert r.projection_matmul(p) == want, p
  # It follows the recipe's x: only the fields it sets change.
  r = r.replace(matmul={"x": {"scale_rule": "4over6_mse"}})
  assert r.projection_matmul("down").x == Operand(terms=2, scale_rule="4over6_mse")
  bf = get_recipe("fp4_linear", down_x={"format": "bf16"})
  assert bf.projection_matmul("down").x.format == "bf16" and bf.projection_matmul("qkv").x.format == "nvfp4"
  assert Recipe().projection_matmul("down") is Recipe().matmul  # the default changes nothing
  assert bf.bf16_forward().projection_matmul("down") == dataclasses.replace(
      bf.projection_matmul("down"), fwd=False)
  with pytest.raises(ValueError, match=r"OperandOverride.terms=3: expected one of \(1, 2\)"):
    Recipe(down_x=recipe_lib.OperandOverride(terms=3))
  with pytest.raises(ValueError, match="OperandOverride.format='fp8'"):
    get_recipe("fp4_linear", down_x={"format": "fp8"})
  with pytest.raises(ValueError, match=r"Recipe.down_x=.*requires Operand.rounding='nearest'"):
    get_recipe("fp4_linear", down_x={"scale_rule": "4over6_mse", "rounding": "stochastic"})
  with pytest.raises(ValueError, match="unknown projection 'mlp'"):
    r.projection_matmul("mlp")


def test_schedule_and_override_on_the_command_line():
  """``--config.recipe.bf16_fwd_last=0.1`` and ``--config.recipe.down_x.terms=2`` (or ``.format=bf16``)
  are fields of the experiment config; the recipe's dict passes ``upgrade_dict`` unchanged."""
  from absl import flags
  from ml_collections import config_flags

  from experiments.configs import tiny
  from fp4jax.experiment import Experiment
  from fp4jax.recipe import upgrade_dict
  cfg = tiny.get_config("fp4_linear")
  assert set(cfg.recipe.down_x) == {f.name for f in dataclasses.fields(recipe_lib.OperandOverride)}
  fv, argv = flags.FlagValues(), ["prog", "--config.recipe.bf16_fwd_last=0.1", "--config.recipe.down_x.terms=2",
                                  "--config.recipe.down_x.format=bf16"]
  config_flags.DEFINE_config_dict("config", cfg, flag_values=fv, sys_argv=argv)
  fv(argv)
  recipe = Experiment.from_config(fv.config).recipe
  assert recipe == get_recipe("fp4_linear", bf16_fwd_last=0.1, down_x={"terms": 2, "format": "bf16"})
  assert upgrade_dict(recipe.to_dict()) == recipe.to_dict()
  assert Experiment.from_config({**cfg.to_dict(), "recipe": recipe.to_dict()}).recipe == recipe
  # A recipe saved before these fields existed types with their defaults.
  old = {k: v for k, v in get_recipe("fp4_linear").to_dict().items() if k not in ("bf16_fwd_last", "down_x")}
  assert Experiment.from_config({**cfg.to_dict(), "recipe": old}).recipe == get_recipe("fp4_linear")


def test_a_preset_may_set_its_own_op_config(monkeypatch):
  """A preset that sets fields beyond the modules (its own ``matmul``) reaches a study arm, a
  comparison's recipe and the command line's ``:<preset>`` whole; the config's other fields stay."""
  from experiments import compare
  from experiments.configs import tiny
  from experiments.studies import Arm
  from fp4jax.experiment import Experiment
  for name, preset in recipe_lib.PRESETS.items():
    assert Recipe().replace(**recipe_lib.preset_changes(name)) == preset
  mine = get_recipe("fp4_linear", matmul={"x": {"scale_rule": "4over6_mse"}, "w": {"scale_rule": "4over6_mse"}})
  monkeypatch.setitem(recipe_lib.PRESETS, "fp4_linear_4over6", mine)
  assert set(recipe_lib.preset_changes("fp4_linear_4over6")) == {*recipe_lib.MODULES, "matmul"}
  exp = Experiment.from_config(tiny.get_config()).with_changes({"recipe.lora_rank": 8})
  arm = Arm("a", "fp4_linear_4over6", {"recipe.matmul.hadamard": False}).apply(exp)
  assert arm.recipe == mine.replace(lora_rank=8, matmul={"hadamard": False})
  assert compare.recipe_experiments(exp, ["fp4_linear_4over6"])["fp4_linear_4over6"].recipe == mine.replace(
      lora_rank=8)
  assert Experiment.from_config(tiny.get_config("fp4_linear_4over6")).recipe == mine
  with pytest.raises(ValueError, match="unknown recipe 'nope'"):
    recipe_lib.preset_changes("nope")


def test_the_methods_baseline_preset_is_the_studys_arm():
  # The preset holds what its study arm (w1x16_4over6: fp4_linear with these changes) measured, on the
  # default rounding stream (the study's arms name jax.random's; the counter_bits arms read the two alike).
  from experiments.studies.loss_gap import ARMS
  arm = next(a for a in ARMS if a.name == "w1x16_4over6")
  assert arm.changes["recipe.matmul.rounding_bits"] == "random"
  changes = {k.removeprefix("recipe.matmul."): v for k, v in arm.changes.items()
             if k != "recipe.matmul.rounding_bits"}
  matmul = get_recipe("fp4_linear").matmul
  for key, value in changes.items():
    op, field = key.split(".")
    matmul = dataclasses.replace(matmul, **{op: dataclasses.replace(getattr(matmul, op), **{field: value})})
  assert get_recipe("fp4_linear_w1x16_4over6") == get_recipe("fp4_linear").replace(matmul=matmul)
  # ... and the cheapest recipe within +0.5% of bf16 is that arm's BF16-forward tail (w1x16_4over6_last10).
  tail = next(a for a in ARMS if a.name == "w1x16_4over6_last10")
  assert tail.changes == {**arm.changes, "recipe.bf16_fwd_last": 0.1}
  assert get_recipe("fp4_linear_w1x16_4over6_fwd_bf16_last10") == get_recipe("fp4_linear_w1x16_4over6").replace(
      bf16_fwd_last=0.1)



def test_the_full_stack_preset_is_what_its_study_arms_ran():
  """The preset ``fp4_full_stack`` is the recipe the 20m arms ``full_stack_winners`` (and ``_s1``) recorded
  in their ``config.json``, but for the rounding stream (theirs ``jax.random``; the counter-stream arms
  measured no difference)."""
  from fp4jax.experiment import Experiment

  for arm in ("full_stack_winners", "full_stack_winners_s1"):
    run = json.loads((ROOT / f"experiments/results/20m_h100/{arm}/config.json").read_text())["config"]
    assert Experiment.from_config(run).recipe == get_recipe("fp4_full_stack", matmul={"rounding_bits": "random"})
  run = json.loads((ROOT / "experiments/results/20m_h100/full_stack_winners_counter/config.json").read_text())
  assert Experiment.from_config(run["config"]).recipe == get_recipe("fp4_full_stack")

@pytest.mark.slow
def test_full_stack_with_muon_updates_every_parameter():
  """The experiment preset ``fp4_full_stack_muon`` (the recipe ``fp4_full_stack`` and ``optimizer.name=muon``:
  the optimizer is the experiment's, not the recipe's) on the model's parameters: Muon with NVFP4
  Newton–Schulz on the blocks' 2-D matrices, NVFP4 AdamW moments on the embedding, the LM head and the
  vectors. Built from the tiny config (one block), two updates past the warmup's zero learning rate are
  finite and move every parameter. (The model's NVFP4 forward and backward are the full stack's, tested
  apart.)"""
  import jax
  import numpy as np
  import optax
  from experiments.configs import tiny
  from experiments.train import from_config
  from fp4jax import sharding as shd
  from fp4jax.nvfp4 import NVFP4Tensor
  from fp4jax.optim import ScaleByMuonNvfp4State
  from fp4jax.step import init_state
  from fp4jax.train import make_optimizer
  cfg = tiny.get_config("fp4_full_stack_muon")
  assert cfg.optimizer.name == "muon" and tiny.get_config("fp4_full_stack").optimizer.name == "adamw"
  cfg.optimizer.warmup_steps = 1
  cfg.model.update(n_layers=1, d_model=32, n_heads=2)
  model, recipe, opt, _, execution = from_config(cfg, vocab_size=257)
  assert recipe == get_recipe("fp4_full_stack") and opt.name == "muon" and not model.scan_layers
  tx = make_optimizer(opt, recipe, 10)
  _, state, _ = init_state(model, recipe, tx, shd.make_mesh((1, 1, 1)), execution=execution)
  params, opt_state = state["params"], state["opt_state"]
  grads = jax.tree.map(lambda p: np.sin(np.arange(p.size, dtype=np.float32).reshape(p.shape)) * 1e-2, params)
  update = jax.jit(tx.update)
  before = jax.device_get(params)
  for _ in range(2):
    updates, opt_state = update(grads, opt_state, params)
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
    params = optax.apply_updates(params, updates)
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), before, params)
  assert all(jax.tree.leaves(moved))
  muon = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByMuonNvfp4State))
          if isinstance(x, ScaleByMuonNvfp4State)]
  assert muon, "no Muon state"
  packed = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, NVFP4Tensor))
            if isinstance(x, NVFP4Tensor)]
  assert packed  # the AdamW side's NVFP4 moments
