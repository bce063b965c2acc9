"""The precision recipe: what training computes in NVFP4, as one frozen dataclass of numerics.

The four modules are pluggable and cumulative (docs/DESIGN.md, "The linear recipe")::

  linear            bf16 | nvfp4 | nvfp4_lorasvd   every projection of every block
  attention         bf16 | nvfp4                   the QKᵀ / dS products of attention (with tensor reuse)
  optimizer_states  fp32 | nvfp4                   AdamW moments
  newton_schulz     bf16 | nvfp4                   the Muon / ROOT orthogonalization matmuls

Embeddings, the LM head, norms and softmax always stay high precision. ``bf16_first_blocks`` and
``bf16_last_blocks`` keep the linear layers of the first/last k Transformer blocks in BF16 (NVIDIA
keeps ~15% of the linear layers, mostly the last blocks, in BF16). ``bf16_fwd_last`` runs the
forward GEMMs of the NVFP4 projections in BF16 for the last fraction of a run's steps, the backward
still NVFP4 (``at_step``), and with ``bf16_fwd_attention`` attention's score product too;
``down_x`` changes the MLP down-projection's forward input alone (``projection_matmul``).

What each NVFP4 module computes is the config of its op, nested as one field, so an ablation is one
field in one place: ``matmul`` (``fp4jax.ops.MatmulConfig``: the NVFP4 projections' GEMMs, e.g.
``--config.recipe.matmul.hadamard=False``, or an operand's field such as
``--config.recipe.matmul.x.terms=2``), ``attention_op`` (``fp4jax.ops.AttentionConfig``: the
NVFP4 attention's operands, e.g. ``--config.recipe.attention_op.ds.format=bf16``) and ``moments``
(``fp4jax.optim.AdamNvfp4Options``: how NVFP4 moments are stored, e.g.
``--config.recipe.moments.mu.rounding=nearest``). Each applies where its module is NVFP4. Which code
runs an op (kernels, cuDNN, XLA) is not part of a recipe: see ``fp4jax.execution``.

Named presets: ``bf16``, ``fp4_linear`` (NVIDIA's recipe), ``fp4_linear_w1x16_4over6`` (the
method's baseline: 1×16 weight blocks and Four-over-Six scales),
``fp4_linear_w1x16_4over6_fwd_bf16_last10`` (that baseline with its forward GEMMs in BF16 for the last
10% of steps; docs/DESIGN.md, "The linear recipe", has the evidence for both), ``fp4_linear_lorasvd``,
``fp4_full_stack`` (``get_recipe(name)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from fp4jax.layers import DEFAULT_LORA_RANK
from fp4jax.ops.attention import AttentionConfig
from fp4jax.ops.matmul import MatmulConfig
from fp4jax.optim.adam import AdamNvfp4Options
from fp4jax.optim.ns import NS_OPERAND
from fp4jax.quant import BF16, FORMATS, SCALE_RULES, Operand

_LINEAR_CHOICES = ("bf16", "nvfp4", "nvfp4_lorasvd")
_ATTENTION_CHOICES = ("bf16", "nvfp4")
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a Transformer block's projections
_OPTIMIZER_STATE_CHOICES = ("fp32", "nvfp4")
_NEWTON_SCHULZ_CHOICES = ("bf16", "nvfp4")
MODULES = ("linear", "attention", "optimizer_states", "newton_schulz")  # what every preset sets
LORA_RESPLIT_MOMENTS = ("keep", "aligned", "reset")
LORA_RESPLIT_SVDS = ("layer", "randomized", "exact")


@dataclasses.dataclass(frozen=True)
class OperandOverride:
  """Fields of a ``fp4jax.quant.Operand`` to change where the override applies; None keeps the
  operand's own value, so the default changes nothing and the overridden operand follows every
  other change of the config it overrides.

  Attributes:
    format: ``"nvfp4"`` or ``"bf16"`` (the operand enters its GEMM unquantized), or None.
    terms: 1 or 2 (a two-term operand ``Q1 + Q(a − Q1)``), or None.
    scale_rule: one of ``fp4jax.quant.SCALE_RULES``, or None.
    rounding: ``"nearest"`` or ``"stochastic"``, or None.
  """

  format: str | None = None
  terms: int | None = None
  scale_rule: str | None = None
  rounding: str | None = None

  def __post_init__(self):
    for field, choices in (("format", FORMATS), ("terms", (1, 2)), ("scale_rule", SCALE_RULES),
                           ("rounding", ("nearest", "stochastic"))):
      value = getattr(self, field)
      if value is not None and (isinstance(value, bool) or value not in choices):
        raise ValueError(f"OperandOverride.{field}={value!r}: expected one of {choices}, or None to keep "
                         "the operand's")

  @property
  def changes(self) -> dict:
    """The fields it sets (those not None)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

  def apply(self, operand: Operand) -> Operand:
    """``operand`` with the fields this override sets (validated as an ``Operand``)."""
    return dataclasses.replace(operand, **self.changes) if self.changes else operand


_NESTED = {"matmul": MatmulConfig, "attention_op": AttentionConfig, "moments": AdamNvfp4Options,
           "down_x": OperandOverride}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Precision of each expensive part of training, and what each NVFP4 part computes.

  Attributes:
    linear: precision of the Transformer block projections (q, k, v, o, gate, up, down).
    attention: precision of the attention score products.
    optimizer_states: storage format of the AdamW moments.
    newton_schulz: precision of the Newton–Schulz matmuls (Muon / ROOT only); ``ns_operand`` is the
      ``fp4jax.quant.Operand`` it means.
    bf16_first_blocks: number of leading blocks whose projections stay BF16.
    bf16_last_blocks: number of trailing blocks whose projections stay BF16.
    bf16_fwd_last: fraction f of the run's steps, at its end, whose forward GEMMs ``x · w`` run in
      BF16 in every NVFP4 projection (``matmul.fwd=False`` there) while the dgrad and wgrad stay as
      ``matmul`` says: steps ``⌈(1 − f)·steps⌉ ..`` (0-based, ``bf16_fwd_from``) run ``at_step``'s
      recipe. The random bits of the backward are the same either way (``nvfp4_matmul`` assigns its
      keys by operand), and the model is evaluated as it trains at the step it is evaluated after.
      0.0 (the default): no switch; 1.0: every step.
    bf16_fwd_attention: the late phase of ``bf16_fwd_last`` also computes NVFP4 attention's score
      product in BF16: q and k unquantized (``attention_op.q``/``k.format="bf16"``), so the forward's
      ``S = q·kᵀ`` and the backward's recomputed scores are BF16 while dS (``dQ = dS·K``,
      ``dK = dSᵀ·Q``) stays as ``attention_op`` says: the attention counterpart of the projections'
      BF16 forward. Applies where ``attention="nvfp4"`` and ``bf16_fwd_last > 0``. Default: False.
    lora_rank: rank of the BF16 low-rank branch when ``linear == "nvfp4_lorasvd"``.
    lora_resplit_every: re-split every LoRA-SVD projection (new top-r SVD of ``W_res + A·B``) every
      this many steps; 0 splits once at init (Metis). What happens to the optimizer state of the
      branch at a re-split is ``lora_resplit_moments``. A schedule of the run: a resumed run may
      change it.
    lora_resplit_moments: what a re-split (``lora_resplit_every``) does about the optimizer state
      of the branch's new factors ``lora_a``, ``lora_b`` (``W_res``'s moments are kept: its
      gradient is the loss's gradient in the unchanged effective weight):
      ``"keep"``: the new SVD factors, moments kept as they are (a new SVD may reorder, flip or
      rotate the factors' columns, so the kept moments can point the wrong way);
      ``"aligned"``: the new factors rotated onto the old ones' columns (orthogonal Procrustes,
      ``fp4jax.layers.lora_svd_split``'s ``align_to``: the same product ``A·B`` and balance), moments
      kept, now in the basis they were accumulated in; ``"reset"``: the moments of ``lora_a`` and
      ``lora_b`` set to zero (Adam restarts them without bias correction, the step count being
      global). docs/DESIGN.md, "LoRA-SVD", compares the three.
    lora_resplit_svd: the SVD of a re-split: ``"layer"`` (each layer's ``svd``: exact up to
      ``min(K, N) = 2048``, randomized above), ``"randomized"`` (``fp4jax.layers.randomized_svd``
      at every size) or ``"exact"``.
    lora_lr_scale: the low-rank branch's learning rate (``lora_a``, ``lora_b``) as a multiple of
      the run's: their updates are scaled by it after the optimizer (weight decay included, as a
      learning rate scales it). 1.0 leaves the optimizer as it is; 0.0 freezes the branch.
    lora_projections: which block projections carry the branch: ``"all"`` or some of
      ``PROJECTIONS`` separated by commas (e.g. ``"gate_up,down"``: the MLP only); the others stay
      plain NVFP4.
    matmul: the GEMMs of the NVFP4 projections (``linear`` nvfp4 or nvfp4_lorasvd): NVIDIA's recipe
      (``MatmulConfig.nvfp4()``) by default, one ``fp4jax.quant.Operand`` per operand. Ablations:
      ``hadamard=False`` (no random Hadamard transform of the wgrad operands),
      ``dy_dgrad.rounding`` / ``dy_wgrad.rounding="nearest"`` (the output gradient rounded to
      nearest), ``rounding_bits="random"`` (``jax.random.bits`` for stochastic rounding in place
      of the default counter hash: a different random stream, dearer in the kernels),
      ``x.format="bf16"`` (one operand left unquantized), ``x.terms=2`` (a two-term operand),
      ``split.tensors=("x",)`` (a low-rank split).
    down_x: the forward input ``x`` of each block's MLP down-projection (its ``MatmulConfig.x``) as
      ``matmul.x`` with these fields changed (``OperandOverride``; the default changes nothing),
      e.g. ``down_x.terms=2`` or ``down_x.format="bf16"``: the operand the quantization-scaling
      literature blames (activation outliers of the SwiGLU product). ``projection_matmul("down")``
      is that projection's config.
    attention_op: the products of NVFP4 attention (``attention="nvfp4"``): the method
      (``AttentionConfig.nvfp4()``: q, k and dS in NVFP4, V, P, dO in BF16, tensor reuse) by
      default; one ``fp4jax.quant.Operand`` per operand. Ablations: ``v``/``p``/``do.format="nvfp4"``
      (the P·V branch quantized too), ``ds.format="bf16"``, ``reuse=False`` (the backward on the
      unquantized q, k).
    moments: how NVFP4 moments are stored (``optimizer_states="nvfp4"``): ``AdamNvfp4Options()``
      (m and √v stochastically rounded; ``mu.rounding="nearest"`` is an ablation). Storage variants:
      ``nu=None`` (m alone in NVFP4, v float32) or ``mu=None`` (√v alone); ``keep_fp32=("embed",
      "lm_head")`` (those leaves' moments float32); ``nu_transform="mean_hadamard"`` (√v minus its
      block means, Hadamard-rotated, then NVFP4); ``nu_sr_space="preconditioner"`` (√v's stochastic
      rounding unbiased in 1 / (√v + eps)); ``mu.scale_rule="4over6_mse"`` with ``mu.rounding="nearest"``
      (Four over Six; the same for ``nu``).
  """

  linear: str = "bf16"
  attention: str = "bf16"
  optimizer_states: str = "fp32"
  newton_schulz: str = "bf16"
  bf16_first_blocks: int = 0
  bf16_last_blocks: int = 0
  bf16_fwd_last: float = 0.0
  bf16_fwd_attention: bool = False
  lora_rank: int = DEFAULT_LORA_RANK
  lora_resplit_every: int = 0
  lora_resplit_moments: str = "keep"
  lora_resplit_svd: str = "layer"
  lora_lr_scale: float = 1.0
  lora_projections: str = "all"
  matmul: MatmulConfig = MatmulConfig.nvfp4()
  down_x: OperandOverride = OperandOverride()
  attention_op: AttentionConfig = AttentionConfig.nvfp4()
  moments: AdamNvfp4Options = AdamNvfp4Options()

  def __post_init__(self):
    for field, choices in (("linear", _LINEAR_CHOICES), ("attention", _ATTENTION_CHOICES),
                           ("optimizer_states", _OPTIMIZER_STATE_CHOICES),
                           ("newton_schulz", _NEWTON_SCHULZ_CHOICES),
                           ("lora_resplit_moments", LORA_RESPLIT_MOMENTS), ("lora_resplit_svd", LORA_RESPLIT_SVDS)):
      value = getattr(self, field)
      if value not in choices:
        raise ValueError(f"Recipe.{field}={value!r}: expected one of {choices}")
    for field in ("bf16_first_blocks", "bf16_last_blocks", "lora_rank", "lora_resplit_every"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"Recipe.{field}={value!r}: expected a non-negative int")
    if (isinstance(self.lora_lr_scale, bool) or not isinstance(self.lora_lr_scale, int | float)
        or not 0 <= self.lora_lr_scale < float("inf")):
      raise ValueError(f"Recipe.lora_lr_scale={self.lora_lr_scale!r}: expected a finite number >= 0")
    roles = self.lora_projections.split(",") if isinstance(self.lora_projections, str) else [None]
    if self.lora_projections != "all" and (not all(r in PROJECTIONS for r in roles)
                                           or len(set(roles)) != len(roles)):
      raise ValueError(f"Recipe.lora_projections={self.lora_projections!r}: expected 'all' or distinct "
                       f"names of {PROJECTIONS} separated by commas")
    if self.linear == "nvfp4_lorasvd" and self.lora_rank < 1:
      raise ValueError("Recipe.lora_rank must be >= 1 when linear='nvfp4_lorasvd'")
    for field, cls in _NESTED.items():
      if not isinstance(getattr(self, field), cls):
        raise ValueError(f"Recipe.{field} must be a {cls.__name__}, got "
                         f"{type(getattr(self, field)).__name__}")
    f = self.bf16_fwd_last
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
      raise ValueError(f"Recipe.bf16_fwd_last={f!r}: expected a fraction of the run's steps in [0, 1]")
    if not isinstance(self.bf16_fwd_attention, bool):
      raise ValueError(f"Recipe.bf16_fwd_attention={self.bf16_fwd_attention!r}: expected True or False")
    try:
      self.projection_matmul("down")
    except ValueError as e:
      raise ValueError(f"Recipe.down_x={self.down_x}: {e}") from None

  @property
  def ns_operand(self) -> Operand:
    """The Newton–Schulz operands of ``newton_schulz`` (``fp4jax.optim.newton_schulz``'s
    ``operand``): two-term NVFP4 (``fp4jax.optim.ns.NS_OPERAND``) or bfloat16."""
    return NS_OPERAND if self.newton_schulz == "nvfp4" else BF16

  def lora_on(self, projection: str) -> bool:
    """Whether the block projection ``projection`` (one of ``PROJECTIONS``) carries the LoRA-SVD
    branch when the linear precision is ``nvfp4_lorasvd`` (``lora_projections``)."""
    if projection not in PROJECTIONS:
      raise ValueError(f"unknown projection {projection!r}: expected one of {PROJECTIONS}")
    return self.lora_projections == "all" or projection in self.lora_projections.split(",")

  def projection_matmul(self, projection: str) -> MatmulConfig:
    """The ``MatmulConfig`` of the block projection ``projection`` (one of ``PROJECTIONS``) where it
    is NVFP4: ``matmul``, with ``down_x`` applied to the down-projection's ``x``."""
    if projection not in PROJECTIONS:
      raise ValueError(f"unknown projection {projection!r}: expected one of {PROJECTIONS}")
    if projection != "down" or not self.down_x.changes:
      return self.matmul
    return dataclasses.replace(self.matmul, x=self.down_x.apply(self.matmul.x))

  def bf16_fwd_from(self, steps: int) -> int:
    """The first step (0-based) of a run of ``steps`` steps whose forward GEMMs run in BF16
    (``bf16_fwd_last``): ``⌈(1 − f)·steps⌉``, i.e. the last ``⌊f·steps⌋`` steps; ``steps`` when
    none do."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
      raise ValueError(f"steps={steps!r}: expected a positive int")
    # f·steps rounded to 9 digits first, so that a fraction written in decimal (0.1 · 1500) counts
    # the steps it means despite its binary rounding.
    return steps - math.floor(round(self.bf16_fwd_last * steps, 9))

  def at_step(self, step: int, steps: int) -> Recipe:
    """The recipe that step ``step`` (0-based) of a run of ``steps`` steps computes with: this one
    before ``bf16_fwd_from(steps)``, from there on ``bf16_forward()`` (every NVFP4 projection's
    forward GEMM in BF16, the dgrad and wgrad unchanged; with ``bf16_fwd_attention``, attention's
    q and k too). The two build models of the same parameters.

    Args:
      step: the step's index (the train state's ``step`` before it runs).
      steps: the run's length.

    Returns:
      The ``Recipe`` of that step.
    """
    return self if step < self.bf16_fwd_from(steps) else self.bf16_forward()

  def bf16_forward(self) -> Recipe:
    """The late phase of ``bf16_fwd_last``: this recipe with ``matmul.fwd=False`` (every NVFP4
    projection's forward GEMM in BF16) and, with ``bf16_fwd_attention``, NVFP4 attention's q and k
    in BF16 (dS unchanged); this one where that changes nothing (no NVFP4 projection or quantized
    forward, no NVFP4 attention or quantized q, k)."""
    changes = {}
    if self.matmul.fwd and self.linear != "bf16":
      changes["matmul"] = {"fwd": False}
    op = self.attention_op
    if self.bf16_fwd_attention and self.attention == "nvfp4" and (op.q.quantized or op.k.quantized):
      changes["attention_op"] = {"q": {"format": "bf16"}, "k": {"format": "bf16"}}
    return self.replace(**changes) if changes else self

  def block_linear(self, block: int, n_blocks: int) -> str:
    """The linear precision of Transformer block ``block`` (0-based) in a model of ``n_blocks``.

    Args:
      block: index of the block.
      n_blocks: number of blocks in the model.

    Returns:
      ``"bf16"`` for an exempt block, else ``self.linear``.
    """
    if not 0 <= block < n_blocks:
      raise ValueError(f"block {block} out of range for a model of {n_blocks} blocks")
    if block < self.bf16_first_blocks or block >= n_blocks - self.bf16_last_blocks:
      return "bf16"
    return self.linear

  def replace(self, **changes) -> Recipe:
    """A copy with ``changes`` applied (validated); a nested config, or a dataclass nested in it,
    may be given as a dict of the fields to change, e.g. ``replace(matmul={"hadamard": False})`` or
    ``replace(matmul={"x": {"terms": 2}})``."""
    return _replaced(self, changes)

  def to_dict(self) -> dict:
    """The recipe as nested plain dicts (JSON-able: tuples become lists in JSON)."""
    return dataclasses.asdict(self)


def _replaced(obj, changes: dict):
  """``dataclasses.replace(obj, **changes)`` where a dict value changes the fields of the dataclass
  that the field holds."""
  changes = {k: _replaced(getattr(obj, k), v) if isinstance(v, dict) and dataclasses.is_dataclass(
      getattr(obj, k, None)) else v for k, v in changes.items()}
  return dataclasses.replace(obj, **changes)


# The method's baseline GEMMs: W in 1x16 blocks along K (the dgrad's W re-quantized along N) and
# Four-over-Six scales (MSE) on every nearest-rounded operand: x, W and the wgrad's H·x.
_METHOD_MATMUL = MatmulConfig.nvfp4(x=Operand(scale_rule="4over6_mse"), w=Operand(scale_rule="4over6_mse"),
                                    x_wgrad=Operand(scale_rule="4over6_mse"))

PRESETS: dict[str, Recipe] = {
    "bf16": Recipe(),
    "fp4_linear": Recipe(linear="nvfp4"),
    # The method's baseline (_METHOD_MATMUL).
    "fp4_linear_w1x16_4over6": Recipe(linear="nvfp4", matmul=_METHOD_MATMUL),
    # The method's baseline with its forward GEMMs in BF16 for the last 10% of steps (the backward
    # still NVFP4; docs/DESIGN.md, "The linear recipe", has the evidence).
    "fp4_linear_w1x16_4over6_fwd_bf16_last10": Recipe(linear="nvfp4", bf16_fwd_last=0.1, matmul=_METHOD_MATMUL),
    # LoRA-SVD the method's way: on the method's baseline, a rank-16 BF16 branch re-aligned by a
    # randomized SVD every 300 steps, the new factors rotated onto the old ones so that their moments
    # carry over (docs/DESIGN.md, "LoRA-SVD", has the cadence and the evidence).
    "fp4_linear_lorasvd": Recipe(linear="nvfp4_lorasvd", lora_resplit_every=300, lora_resplit_moments="aligned",
                                 lora_resplit_svd="randomized", matmul=_METHOD_MATMUL),
    # Every module in NVFP4: the linear layers of fp4_linear_w1x16_4over6_fwd_bf16_last10 (no LoRA-SVD),
    # NVFP4 moments with √v mean-removed and Hadamard-rotated, attention with the method's K smoothing and
    # Four-over-Six on q and k, NVFP4 Newton-Schulz (docs/DESIGN.md, "The full stack", says why).
    "fp4_full_stack": Recipe(linear="nvfp4", attention="nvfp4", optimizer_states="nvfp4", newton_schulz="nvfp4",
                             bf16_fwd_last=0.1, matmul=_METHOD_MATMUL,
                             moments=AdamNvfp4Options(nu_transform="mean_hadamard"),
                             attention_op=AttentionConfig.nvfp4(
                                 q=Operand(scale_rule="4over6_mse"), k=Operand(scale_rule="4over6_mse"),
                                 k_smooth=True)),
}


# What a recipe recorded before ``MatmulConfig.rounding_bits`` existed drew its stochastic-rounding bits
# from: the field's default then (``jax.random.bits``).
RECORDED_ROUNDING_BITS = "random"


def recorded_rounding_bits(matmul: Mapping) -> str:
  """The stochastic-rounding stream of a recorded ``recipe.matmul`` (a run's ``config.json`` or
  checkpoint identity): its ``rounding_bits``, else ``RECORDED_ROUNDING_BITS``."""
  return matmul.get("rounding_bits", RECORDED_ROUNDING_BITS)


def preset_changes(name: str) -> dict[str, object]:
  """The recipe fields that the preset ``name`` sets where it is applied to a config's recipe (a
  study arm, a comparison's recipe): its modules (``MODULES``) and every other field in which it
  differs from ``Recipe()`` (e.g. a preset's own ``matmul``); the config's other fields stay.

  Args:
    name: one of ``PRESETS``.

  Returns:
    ``{field: value}``; ``Recipe().replace(**preset_changes(name)) == PRESETS[name]``.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown recipe {name!r}: expected one of {sorted(PRESETS)}")
  preset, default = PRESETS[name], Recipe()
  return {f.name: getattr(preset, f.name) for f in dataclasses.fields(Recipe)
          if f.name in MODULES or getattr(preset, f.name) != getattr(default, f.name)}


def get_recipe(name: str, **overrides) -> Recipe:
  """A named preset, optionally with fields overridden.

  Args:
    name: one of ``PRESETS``.
    **overrides: fields to change, e.g. ``bf16_last_blocks=2`` or ``matmul={"hadamard": False}``.

  Returns:
    The ``Recipe``.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown recipe {name!r}: expected one of {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


_MATMUL_OPERANDS = ("x", "w", "dy_dgrad", "x_wgrad", "dy_wgrad")
_ATTENTION_OPERANDS = ("q", "k", "v", "p", "do", "ds")


def _names(value) -> list[str]:
  return [n for n in value.split(",") if n] if isinstance(value, str) else list(value or ())


FROM_OPTIMIZER = ("lora_resplit_moments", "lora_resplit_svd")  # recipe fields once saved under "optimizer"


def upgrade_dict(recipe: dict, optimizer: Mapping | None = None) -> dict:
  """A recipe's ``to_dict()`` as saved by an earlier layout, in today's layout; today's layout
  passes through unchanged.

  Run folders and checkpoints record the recipe they ran; resuming one written in an earlier layout
  compares it, upgraded, with this run's, and ``fp4jax.experiment.Experiment.from_config`` types an
  old ``config.json`` through it. Two earlier layouts are read:

  - the op configs' flat fields (``matmul.x_rounding``, ``matmul.bf16_operands="x"``,
    ``matmul.two_term="x,w"``, ``matmul.split="x"`` with ``split_method``/``split_rank``/
    ``split_power_iters``; ``attention_op.v="nvfp4"`` with ``attention_op.v_rounding``;
    ``moments.mu_rounding``), before they held one ``fp4jax.quant.Operand`` per operand. Their
    blocks were fixed (16×16 for the matmul's ``w`` and attention's ``ds``, 1×16 elsewhere) and
    their only scale rule ``"max"``: the upgraded specs state them.
  - ``lora_resplit_moments`` and ``lora_resplit_svd`` (``FROM_OPTIMIZER``) saved in the optimizer's
    section: given ``optimizer``, those it holds become the recipe's (``upgrade_config`` also drops
    them from the optimizer's section).

  Args:
    recipe: the saved recipe (nested plain dicts).
    optimizer: the saved optimizer section of the same run or config, or None.

  Returns:
    The recipe's dict in today's layout (a new dict; the inputs are not changed).

  Raises:
    ValueError: the recipe and the optimizer section both hold one of ``FROM_OPTIMIZER`` with
      different values.
  """
  out = dict(recipe)
  for field in FROM_OPTIMIZER:
    if optimizer is None or field not in optimizer:
      continue
    if field in out and out[field] != optimizer[field]:
      raise ValueError(f"recipe.{field}={out[field]!r} and optimizer.{field}={optimizer[field]!r}: "
                       f"{field} is Recipe.{field} now; give it once, in the recipe")
    out[field] = optimizer[field]
  m = out.get("matmul")
  if isinstance(m, dict) and not isinstance(m.get("x"), dict) and "x_rounding" in m:
    m = dict(m)
    bf16, two = _names(m.pop("bf16_operands", "")), _names(m.pop("two_term", ""))
    for op in _MATMUL_OPERANDS:
      m[op] = {"format": "bf16" if op in bf16 else "nvfp4", "rounding": m.pop(f"{op}_rounding"),
               "block": [16, 16] if op == "w" else [1, 16], "terms": 2 if op in two else 1,
               "scale_rule": "max"}
    if "split" in m:
      m["split"] = {"tensors": _names(m.pop("split")), "method": m.pop("split_method", "mean"),
                    "rank": m.pop("split_rank", 16), "power_iters": m.pop("split_power_iters", 1)}
    out["matmul"] = m
  a = out.get("attention_op")
  if isinstance(a, dict) and isinstance(a.get("q"), str):
    a = dict(a)
    for op in _ATTENTION_OPERANDS:
      spec = {"format": a.pop(op)}
      if f"{op}_rounding" in a:
        spec["rounding"] = a.pop(f"{op}_rounding")
      a[op] = {**spec, "block": [16, 16] if op == "ds" else [1, 16], "terms": 1, "scale_rule": "max"}
    out["attention_op"] = a
  mo = out.get("moments")
  if isinstance(mo, dict) and "mu_rounding" in mo:
    mo = dict(mo)
    for name in ("mu", "nu"):
      mo[name] = {"format": "nvfp4", "rounding": mo.pop(f"{name}_rounding"), "block": [1, 16], "terms": 1,
                  "scale_rule": "max"}
    out["moments"] = mo
  return out


def upgrade_config(config: Mapping) -> dict:
  """A saved run's config, or its identity, with its ``recipe`` in today's layout (``upgrade_dict``):
  the fields of ``FROM_OPTIMIZER`` that its ``optimizer`` section holds move into the recipe.

  Args:
    config: a mapping with ``recipe`` and ``optimizer`` sections (either may be absent).

  Returns:
    A new dict; the other sections are those of ``config``.

  Raises:
    ValueError: as ``upgrade_dict``.
  """
  out = dict(config)
  opt = out.get("optimizer")
  opt = dict(opt) if isinstance(opt, Mapping) else None
  if isinstance(out.get("recipe"), Mapping):
    out["recipe"] = upgrade_dict(dict(out["recipe"]), opt)
  elif opt is not None and any(f in opt for f in FROM_OPTIMIZER):
    raise ValueError(f"optimizer.{'/'.join(f for f in FROM_OPTIMIZER if f in opt)}: Recipe fields now, and "
                     "the config has no recipe section to take them: move them to recipe")
  if opt is not None:
    out["optimizer"] = {k: v for k, v in opt.items() if k not in FROM_OPTIMIZER}
  return out

