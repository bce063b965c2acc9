"""AdamW with both moments stored in NVFP4.

One update dequantizes the moments, runs Adam's arithmetic in float32 on the fresh moments (the
current gradient enters unquantized) and requantizes them::

  m  = b1 m_old + (1 - b1) g                 m_old = dequantize(mu)
  v  = b2 v_old + (1 - b2) g²                v_old = dequantize(nu)²
  u  = m_hat / (sqrt(v_hat + eps_root) + eps),  clipped to exact Adam's bound |u| <= B_t
  mu = quantize(m),  nu = quantize(sqrt(v))  1×16 blocks, stochastic rounding (AdamNvfp4Options)

√v is stored: it halves v's log-range, so the E4M3 block scales cover it, and its relative error
maps one to one onto the update. A √v entry far below its block's largest stores as 0, and
``m / (0 + eps)`` would explode; the clip to ``adam_update_bound`` (what exact Adam itself can
reach) keeps every update within exact Adam's range. Stochastic rounding keeps slowly decaying
entries decaying (round-to-nearest re-rounds them to the same code); its bits are a keyed counter
hash that XLA fuses into the quantizer (``fp4jax.numerics.counter_bits``). docs/DESIGN.md,
"Optimizer states", gives the measurements behind each choice.

The NVFP4 leaves are updated by plain jnp that XLA fuses and partitions (``implementation="xla"``) or by two
Pallas Triton kernels (``fp4jax.kernels.adam_nvfp4``, the default on a CUDA GPU); both give the same
state bits. Leaves that the storage rule keeps in float32 (``fp4jax.optim.state``) run
``optax.scale_by_adam``'s arithmetic unchanged on float32 moments, whatever the parameters' dtype.
With ``quantize=False``, ``adamw_nvfp4`` is therefore ``optax.adamw`` bit for bit on float32
parameters; on bfloat16 ones it is ``optax.adamw`` run on float32 copies of the parameters and
gradients, its update cast back to bfloat16 (``optax.adamw`` alone keeps its moments in the
parameters' dtype, and rounds ``(1 - b1)·g`` in the gradient's).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp4jax import _platform, execution, numerics
from fp4jax.kernels import adam_nvfp4 as adam_kernel
from fp4jax.kernels.adam_nvfp4 import AdamKernelConfig
from fp4jax.optim import _common
from fp4jax.optim import state as state_lib
from fp4jax.optim.state import DEFAULT_MIN_SIZE
from fp4jax.quant import Operand

_STOCHASTIC = Operand(rounding="stochastic")


NU_TRANSFORMS = ("none", "mean_hadamard")  # how √v is stored (``AdamNvfp4Options.nu_transform``)
SR_SPACES = ("value", "preconditioner")  # where √v's stochastic rounding is unbiased (``nu_sr_space``)
MOMENTS = ("mu", "nu")  # the moments that ``dither`` and ``eden`` name


@dataclasses.dataclass(frozen=True)
class AdamNvfp4Options:
  """How ``scale_by_adam_nvfp4`` stores its moments: the knobs of an ablation study.

  The defaults are the tested choice; each field switches one part of it off or to its alternative.
  Each moment is one ``fp4jax.quant.Operand``: NVFP4 in 1×16 blocks along the storage rule's axis
  (the leaf's last axis that is a multiple of 16), one term; only its ``rounding`` is free. Moments
  kept in float32 everywhere are ``quantize=False`` (the recipe's ``optimizer_states="fp32"``), not a
  ``"bf16"`` operand.

  Attributes:
    min_size: leaves with fewer elements keep float32 moments (the storage rule of
      ``fp4jax.optim.state``).
    mu: the stored first moment m: ``Operand(rounding="stochastic")`` (the default) or
      ``Operand(rounding="nearest")``, which may take Four over Six (``scale_rule="4over6_mse"`` or
      ``"4over6_mae"``: each block's amax maps to 6 or to 4, whichever decodes closer; the global
      scale from the E4M3 bound 256; ``nvfp4.quantize``); None keeps m float32 on every leaf (only √v in NVFP4:
      4.5 + 32 bits per parameter).
    nu: the stored √v, as ``mu``; None keeps v float32 on every leaf, as optax does (only m in NVFP4).
    clip_update: clip the updates of NVFP4 leaves to ``adam_update_bound``, the guard against
      moments quantized to zero (keep it on).
    keep_fp32: leaves whose moments stay float32 with optax's arithmetic, like the storage rule's
      small leaves, by name: each entry a key of the parameter's path (``"lm_head"``) or keys joined
      by ``/`` that follow each other in it (``"embed/embedding"``; ``state.path_matches``). E.g.
      ``("embed", "lm_head")``: the embedding and the LM head of ``fp4jax.model``. A name that
      matches no parameter's path warns at ``init`` (``state.unmatched_patterns``).
    nu_transform: ``"none"`` (√v quantized as it is) or ``"mean_hadamard"``: per 16-element block,
      √v's mean (bfloat16) stored apart and subtracted, the deviations rotated by the 16-point
      Hadamard transform (``nvfp4.hadamard``, key 0), then NVFP4 (``state.CenteredNVFP4Tensor``:
      5.5 bits per element); decoding adds the mean back to the inverse rotation and floors each
      √v at 2^-4 of its block's mean, so no entry decodes to zero or below unless its block's
      mean is zero (and the update's clip still holds).
    nu_sr_space: where √v's stochastic rounding is unbiased: ``"value"`` (E[stored √v] = √v) or
      ``"preconditioner"`` (E[1 / (stored √v · c2 + eps)] = 1 / (√v · c2 + eps), ``c2 = 1 / sqrt(1 -
      b2^t)``: the neighbour above is chosen more often, 0 almost never;
      ``fp4jax.kernels.adam_nvfp4.e2m1_preconditioner_codes``). Needs ``nu.rounding="stochastic"``
      and ``nu_transform="none"``.
    dither: the moments (``"mu"``, ``"nu"``) stored with subtractive dither in the E2M1 index
      domain (``adam_nvfp4.dithered_codes``): each element's value in E2M1 units is mapped onto the
      uniform index grid of the codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0..7, piecewise linear), ``u`` in
      (-1/2, 1/2) from the element's counter-hash byte of the writing step is added, the sum rounded
      to the nearest index; decoding subtracts the same ``u`` and maps back (``dithered_values``),
      ``u`` regenerated from that step's key (``seed`` and the count): nothing is stored, 4.5 bits per
      element as plain NVFP4, scales those of the undithered moment rounded to nearest. The error is
      half the local grid step either way, mean 0 except near 2 and 4 E2M1 units (at most 1/8 unit):
      about half the variance of stochastic rounding over a uniform spread of values (docs/DESIGN.md,
      "Optimizer states", has the measurements). The codes decode to the moment only with the
      writing step's key (``scale_by_adam_nvfp4`` does; ``NVFP4Tensor.dequantize`` alone gives grid
      values). Needs the moment's ``Operand(rounding="nearest")`` with ``scale_rule="max"``; for
      ``"nu"``, ``nu_transform="none"`` (a decoded √v may then be slightly negative; Adam reads its
      square).
    eden: the moments whose block scales are EDEN-calibrated: codes rounded to nearest, then per
      block ``c = ‖a‖² / ⟨a, q⟩`` (``a`` the block in E2M1 units, ``q`` its nearest E2M1 values; sums
      in element order) and the E4M3 scale ``c · dscale`` (at most 448) rounded stochastically with
      16 counter-hash bits, so that the expected decoded block is ``c · q``
      (``adam_nvfp4.eden_scale_codes``): ``c`` is folded into the stored scale, 4.5 bits per element
      as plain NVFP4, decoded by ``NVFP4Tensor.dequantize``. No random rotation: the calibration
      removes the block's magnitude bias of rounding to nearest, not each element's. Needs the
      moment's ``Operand(rounding="nearest")`` with ``scale_rule="max"``, not also in ``dither``;
      for ``"nu"``, ``nu_transform="none"``.
  """

  min_size: int = DEFAULT_MIN_SIZE
  mu: Operand | None = _STOCHASTIC
  nu: Operand | None = _STOCHASTIC
  clip_update: bool = True
  keep_fp32: tuple[str, ...] = ()
  nu_transform: str = "none"
  nu_sr_space: str = "value"
  dither: tuple[str, ...] = ()
  eden: tuple[str, ...] = ()

  def __post_init__(self):
    _common.check_min_size(self.min_size)
    for name in ("mu", "nu"):
      if getattr(self, name) is not None:
        _check_moment(name, getattr(self, name))
    if self.mu is None and self.nu is None:
      raise ValueError("AdamNvfp4Options: mu and nu are both None (no NVFP4 moment); for float32 "
                       "moments use quantize=False (the recipe's optimizer_states='fp32')")
    if not isinstance(self.clip_update, bool):
      raise ValueError(f"clip_update must be a bool, got {self.clip_update!r}")
    keep = self.keep_fp32
    if isinstance(keep, list):
      keep = tuple(keep)
      object.__setattr__(self, "keep_fp32", keep)
    if not isinstance(keep, tuple) or not all(
        isinstance(k, str) and k and all(k.split("/")) for k in keep):
      raise ValueError(f"AdamNvfp4Options.keep_fp32 must be a tuple of key names (non-empty, keys of a "
                       f"path joined by '/'), e.g. ('embed', 'lm_head'); got {keep!r}")
    if self.nu_transform not in NU_TRANSFORMS:
      raise ValueError(f"AdamNvfp4Options.nu_transform must be one of {NU_TRANSFORMS}, got "
                       f"{self.nu_transform!r}")
    if self.nu_sr_space not in SR_SPACES:
      raise ValueError(f"AdamNvfp4Options.nu_sr_space must be one of {SR_SPACES}, got {self.nu_sr_space!r}")
    if self.nu_sr_space != "value" and (getattr(self.nu, "rounding", None) != "stochastic"
                                        or self.nu_transform != "none"):
      raise ValueError(f"AdamNvfp4Options.nu_sr_space={self.nu_sr_space!r} rounds a plain NVFP4 √v "
                       f"stochastically: it needs nu=Operand(rounding='stochastic') and "
                       f"nu_transform='none', got nu={self.nu!r}, nu_transform={self.nu_transform!r}")
    for field in ("dither", "eden"):
      names = getattr(self, field)
      if isinstance(names, list):
        names = tuple(names)
        object.__setattr__(self, field, names)
      if not isinstance(names, tuple) or not all(n in MOMENTS for n in names) or len(set(names)) != len(names):
        raise ValueError(f"AdamNvfp4Options.{field} must be a tuple of distinct names of {MOMENTS}, e.g. "
                         f"('mu', 'nu'); got {names!r}")
      for name in names:
        op = getattr(self, name)
        if getattr(op, "rounding", None) != "nearest" or op.scale_rule != "max":
          raise ValueError(f"AdamNvfp4Options.{field} names {name!r}: it needs {name}=Operand("
                           f"rounding='nearest') with scale_rule='max', got {name}={op!r}")
        if name == "nu" and self.nu_transform != "none":
          raise ValueError(f"AdamNvfp4Options.{field} names 'nu': it needs nu_transform='none', got "
                           f"{self.nu_transform!r}")
    both = set(self.dither) & set(self.eden)
    if both:
      raise ValueError(f"AdamNvfp4Options: {sorted(both)} both in dither and eden; choose one per moment")
    if self.nu_transform != "none" and self.nu is None:
      raise ValueError(f"AdamNvfp4Options.nu_transform={self.nu_transform!r} transforms the stored √v: "
                       f"it needs nu (an NVFP4 Operand), got nu=None")

  @property
  def roundings(self) -> tuple[str, str]:
    """How each moment's codes are rounded, by the kernels' names (``adam_nvfp4.AdamHyper``):
    ``"nearest"`` (also for a float32 moment), ``"stochastic"``, ``"preconditioner"`` (√v),
    ``"dither"`` or ``"eden"``."""
    out = []
    for name in MOMENTS:
      rounding = getattr(getattr(self, name), "rounding", "nearest")
      if name == "nu" and self.nu_sr_space == "preconditioner":
        rounding = "preconditioner"
      out.append("dither" if name in self.dither else "eden" if name in self.eden else rounding)
    return out[0], out[1]

  @property
  def kinds(self) -> tuple[str, str]:
    """How an NVFP4 leaf holds m and √v (``fp4jax.kernels.adam_nvfp4.KINDS``)."""
    nu = "fp32" if self.nu is None else "centered" if self.nu_transform == "mean_hadamard" else "nvfp4"
    return ("fp32" if self.mu is None else "nvfp4"), nu


def encode_moment(x, which: str, options: AdamNvfp4Options, key, zero, *, c2=None, eps=0.0):
  """A fresh float32 moment as ``scale_by_adam_nvfp4`` stores it (its XLA path; the kernels give the
  same bits).

  Args:
    x: m (``which="mu"``) or √v (``"nu"``), float32, the leaf's shape; 1×16 blocks along
      ``state.block_axis(x.shape)``.
    which: ``"mu"`` or ``"nu"``; the moment must be NVFP4 under ``options`` (``options.kinds``).
    options: the storage (``AdamNvfp4Options``): plain NVFP4 with the moment's rounding and scale
      rule, dither, EDEN, √v mean-removed and rotated (``nu_transform``) or rounded in the
      preconditioner's space (``nu_sr_space``).
    key: the writing step's key (the counter bits of the moment's lane: m 0, √v 1).
    zero: a runtime int32 zero (``numerics.runtime_zero``).
    c2, eps: the update's ``1 / sqrt(1 - b2^t)`` and ``eps``, read by preconditioner-space rounding only.

  Returns:
    An ``NVFP4Tensor`` (a ``CenteredNVFP4Tensor`` for ``nu_transform="mean_hadamard"``).
  """
  i = MOMENTS.index(which)
  kind, rounding = options.kinds[i], options.roundings[i]
  if kind == "fp32":
    raise ValueError(f"encode_moment: {which} is float32 under {options!r}")
  rule = getattr(options, which).scale_rule
  if kind == "centered":
    return _common.encode_centered(x, rounding, key, lane=i, scale_rule=rule)
  if rounding == "preconditioner":
    return _common.encode_preconditioned(x, key, c2, eps, zero, lane=i)
  if rounding == "dither":
    return _common.encode_dithered(x, key, zero, i)
  if rounding == "eden":
    return _common.encode_eden(x, key, zero, i)
  return _common.encode(x, rounding, key, lane=i, scale_rule=rule)


def decode_moment(t, which: str, options: AdamNvfp4Options, key) -> jax.Array:
  """The float32 moment that ``encode_moment`` stored in ``t``, as the next update reads it; ``key``
  is the writing step's (only a dithered moment reads it)."""
  i = MOMENTS.index(which)
  return _common.decode_dithered(t, key, i) if options.roundings[i] == "dither" else _common.decode(t)


def _check_moment(name: str, op) -> None:
  """Raises unless ``op`` is a moment's spec that the codec and the kernels store."""
  where = f"AdamNvfp4Options.{name}"
  if not isinstance(op, Operand):
    raise ValueError(f"{where} must be an fp4jax.quant.Operand or None (float32), got {op!r}; e.g. "
                     f"Operand(rounding='nearest')")
  if not op.quantized:
    raise ValueError(f"{where}.format must be 'nvfp4', got {op.format!r}; for float32 moments use "
                     f"{name}=None, or quantize=False for both (the recipe's optimizer_states='fp32')")
  if op.block != (1, 16):
    raise ValueError(f"{where}.block must be (1, 16) (the storage rule's blocks), got {op.block}")
  if op.terms != 1:
    raise ValueError(f"{where}.terms must be 1 (a moment is stored as one NVFP4 term), got {op.terms}")


class ScaleByAdamNvfp4State(NamedTuple):
  """State of ``scale_by_adam_nvfp4``: per parameter leaf an ``NVFP4Tensor`` (a
  ``CenteredNVFP4Tensor`` for √v under ``nu_transform="mean_hadamard"``) or a float32 array."""

  count: jax.Array  # int32 scalar: number of updates so far
  mu: optax.Updates  # first moment m
  nu: optax.Updates  # √v where stored NVFP4, v where float32


def adam_update_bound(count, b1, b2, *, nesterov: bool = False) -> jax.Array:
  """The largest ``|m_hat| / sqrt(v_hat)`` exact Adam can produce at step ``count`` (>= 1).

  With ``r = b1² / b2`` and ``R_t = (1 - r^t) / (1 - r)``, Cauchy–Schwarz over the two EMAs gives
  ``|m_t| <= (1 - b1) sqrt(R_t) |v_t / (1 - b2)|^½`` and ``|g_t| <= |v_t / (1 - b2)|^½``; bias
  corrections as in optax (1 at t = 1, → 1.16 for b1 = 0.9, b2 = 0.95).

  Args:
    count: the step, >= 1.
    b1, b2: Adam's decays.
    nesterov: the bound of optax's Nesterov blend.

  Returns:
    A float32 scalar (inf for ``b2 = 0``).
  """
  t = jnp.asarray(count, jnp.float32)
  b1 = jnp.asarray(b1, jnp.float32)
  b2 = jnp.asarray(b2, jnp.float32)
  r = b1 * b1 / b2
  r_t = jnp.where(jnp.abs(1.0 - r) < 1e-6, t, (1.0 - r**t) / (1.0 - r))
  v_scale = jnp.sqrt((1.0 - b2**t) / (1.0 - b2))
  m_term = (1.0 - b1) * jnp.sqrt(r_t)
  if nesterov:
    bound = b1 * m_term / (1.0 - b1 ** (t + 1.0)) + (1.0 - b1) / (1.0 - b1**t)
  else:
    bound = m_term / (1.0 - b1**t)
  return jnp.where(b2 > 0, bound * v_scale, jnp.inf)


def scale_by_adam_nvfp4(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    nesterov: bool = False,
    quantize: bool = True,
    options: AdamNvfp4Options = AdamNvfp4Options(),
    seed: int = 0,
    implementation: str = "auto",
    block_sizes: AdamKernelConfig = AdamKernelConfig(),
) -> optax.GradientTransformation:
  r"""Adam's scaling (no learning rate) with m and √v stored as NVFP4.

  .. math::
    m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2,
    \quad u_t = \operatorname{clip}\Big(\frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon},
    \pm B_t\Big)

  with ``m`` and ``√v`` kept as NVFP4 between steps (module docstring) and ``B_t`` the
  ``adam_update_bound``.

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator ``sqrt(v_hat) + eps``.
    eps_root: added inside the square root, as in optax.
    nesterov: Nesterov momentum, as ``optax.scale_by_adam(nesterov=True)``.
    quantize: store moments as NVFP4 where the storage rule allows; ``False`` gives
      ``optax.scale_by_adam`` bit for bit with float32 moments (module docstring).
    options: the storage knobs (``AdamNvfp4Options``).
    seed: stochastic rounding (and dither, EDEN's scale rounding) uses ``fold_in(key(seed), count)``:
      deterministic, nothing to store; a dithered moment is decoded with the key of the count that
      wrote it.
    implementation: which code updates NVFP4 leaves (``fp4jax.execution``): ``"pallas"`` (two Pallas Triton kernels,
      ``fp4jax.kernels.adam_nvfp4``; CUDA GPUs), ``"xla"`` (plain jnp), ``"pallas_interpret"`` (the
      kernels in interpret mode, for CPU tests) or ``"auto"``: ``"pallas"`` when computations go to
      a CUDA GPU by default, else ``"xla"``. Both give the same state bits. The kernels take leaves
      blocked along their last axis (others use the XLA path) and see whole leaves: under a mesh
      that shards the state (FSDP, tensor parallel) use ``"xla"``, which XLA partitions. The
      kernels compile ``b1``, ``b2``, ``eps`` and ``eps_root`` in: traced values (from
      ``optax.inject_hyperparams`` under ``jax.jit``) take the XLA path.
    block_sizes: the kernels' launch settings (``AdamKernelConfig``).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ScaleByAdamNvfp4State``.

  Example:
    >>> from fp4jax.quant import Operand
    >>> tx = scale_by_adam_nvfp4(options=AdamNvfp4Options(nu=Operand(rounding="nearest")))
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> updates, state = tx.update(params, tx.init(params))

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_,
    2014; Li et al., `Memory Efficient Optimizers with 4-bit States
    <https://arxiv.org/abs/2309.01507>`_, 2023 (the zero-point problem of the second moment).
  """
  if not isinstance(options, AdamNvfp4Options):
    raise ValueError(f"options must be an AdamNvfp4Options, got {type(options).__name__}")
  execution.check("scale_by_adam_nvfp4", implementation)
  _common.check_decay("b1", b1)
  _common.check_decay("b2", b2)
  _common.check_non_negative("eps", eps)
  _common.check_non_negative("eps_root", eps_root)
  if not isinstance(block_sizes, AdamKernelConfig):
    raise ValueError(f"block_sizes must be an AdamKernelConfig, got {type(block_sizes).__name__}")
  min_size, clip_update = options.min_size, options.clip_update
  mu_kind, nu_kind = options.kinds
  # A float32 moment has no rounding; "nearest" keeps it out of the random bits' bookkeeping.
  mu_rounding, nu_rounding = options.roundings
  mu_rule, nu_rule = (getattr(op, "scale_rule", "max") for op in (options.mu, options.nu))
  stochastic = {"stochastic", "preconditioner", "dither", "eden"} & {mu_rounding, nu_rounding}
  # A dithered moment is decoded with the key of the step that wrote it.
  dithered = "dither" in {mu_rounding, nu_rounding}
  # The kernels compile Adam's constants in; traced ones (optax.inject_hyperparams under jit) take
  # the XLA path, which gives the same bits.
  constants = [_common.concrete_float(x) for x in (b1, b2, eps, eps_root)]
  hyper = None if None in constants else adam_kernel.AdamHyper(
      *constants, nesterov=nesterov, clip_update=clip_update, mu_rounding=mu_rounding,
      nu_rounding=nu_rounding, mu_kind=mu_kind, nu_kind=nu_kind, mu_scale_rule=mu_rule,
      nu_scale_rule=nu_rule)
  # numerics.adam_direction reads eps_root only to choose its square root (the stored √v when
  # eps_root is 0); a traced eps_root takes the general one, sqrt(v + eps_root * bc2).
  eps_root_choice = 1.0 if constants[3] is None else constants[3]

  def init_fn(params):
    if missed := state_lib.unmatched_patterns(params, options.keep_fp32):
      warnings.warn(f"AdamNvfp4Options.keep_fp32: {missed} match no parameter's key path here, so no "
                    "moments are kept float32 for them (a pattern is key names joined by '/', e.g. 'embed' "
                    "or 'embed/embedding')", stacklevel=2)
    def kind(path, p, nvfp4_kind):
      keep = not _common.stores_nvfp4_param(p, min_size, quantize) or state_lib.path_matches(
          path, options.keep_fp32)
      return "fp32" if keep else nvfp4_kind
    mu = lambda path, p: _common.zeros_moment(p, kind(path, p, mu_kind))
    # v is real: float32 for complex parameters too (optax keeps it complex with a zero imaginary part).
    nu = lambda path, p: _common.zeros_moment(p, kind(path, p, nu_kind), jnp.float32)
    return ScaleByAdamNvfp4State(count=jnp.zeros([], jnp.int32),
                                 mu=_common.map_params_with_path(mu, params),
                                 nu=_common.map_params_with_path(nu, params))

  def update_fn(updates, state, params=None):
    del params
    g_leaves, treedef = jax.tree.flatten(updates)
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    quantized = [_common.is_nvfp4(m) or _common.is_nvfp4(v) for m, v in zip(mu_leaves, nu_leaves)]
    count_inc = optax.safe_increment(state.count)

    # Float32 leaves: optax.scale_by_adam's code on the same tree (None where NVFP4), so that with
    # no NVFP4 leaf the traced program is optax's and the bits agree (XLA's fusion, and with it the
    # last bit, depends on the whole tree).
    sub = lambda leaves: treedef.unflatten(
        [None if q else x for q, x in zip(quantized, leaves)])
    u32, mu32, nu32 = _fp32_update(sub(g_leaves), sub(mu_leaves), sub(nu_leaves), count_inc)
    # Updates in the gradients' dtype, moments in their own (float32, complex64): the casts are no-ops
    # on float32 parameters, whose bits stay optax's.
    cast = lambda xs, like: [x if x is None else x.astype(y.dtype) for x, y in zip(xs, like)]
    u_leaves = cast(treedef.flatten_up_to(u32), g_leaves)
    mu_new = cast(treedef.flatten_up_to(mu32), mu_leaves)
    nu_new = cast(treedef.flatten_up_to(nu32), nu_leaves)

    key = _common.step_key(seed, count_inc) if stochastic else None
    q_idx = [i for i, q in enumerate(quantized) if q]
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(quantized))]
    prev_key = _common.step_key(seed, state.count) if dithered else None
    prev_keys = [None if prev_key is None else jax.random.fold_in(prev_key, i) for i in range(len(quantized))]
    impl = _platform.resolve(implementation, "pallas", "xla")
    # Leaves split over explicit mesh axes take the XLA path (the kernels see whole leaves).
    sharded = {i for i in q_idx if _common.sharded_explicitly(
        (g_leaves[i], mu_leaves[i], nu_leaves[i]))}
    fused = []
    if impl != "xla" and hyper is not None:
      fused = [i for i in q_idx if adam_kernel.supports_leaf(mu_leaves[i], nu_leaves[i])
               and i not in sharded]
      q_idx = [i for i in q_idx if i not in fused]
    if fused:
      outs = adam_kernel.update_leaves(
          [g_leaves[i] for i in fused], [mu_leaves[i] for i in fused],
          [nu_leaves[i] for i in fused], fused, key, hyper,
          numerics.bias_factors(b1, b2, eps_root, count_inc),
          _clip_bound(count_inc), numerics.runtime_zero(count_inc), prev_key=prev_key,
          block_sizes=block_sizes, interpret=impl == "pallas_interpret")
      for j, i in enumerate(fused):
        u_leaves[i], mu_new[i], nu_new[i] = (o[j] for o in outs)
    # Under explicit sharding each leaf is computed alone, with its mesh axes automatic inside
    # (the codec's block reshapes) and its outputs sharded like the gradient and the stored state.
    leaf_fn = lambda g, m, v, k, pk: _common.auto(
        _leaf_update, (g, m, v), g, m, v, k, pk, count_inc)
    group = _common.group_by_default() and not sharded
    for i, out in _common.grouped_map(leaf_fn, q_idx, g_leaves, mu_leaves, nu_leaves, keys, prev_keys,
                                      group=group).items():
      u_leaves[i], mu_new[i], nu_new[i] = out
    mu, nu = treedef.unflatten(mu_new), treedef.unflatten(nu_new)
    return treedef.unflatten(u_leaves), ScaleByAdamNvfp4State(count=count_inc, mu=mu, nu=nu)

  def _fp32_update(g, mu, nu, count_inc):
    # The gradient in the moment's dtype first: a bfloat16 or float16 gradient's square would
    # underflow (or overflow) in its own dtype, and a zero v under a nonzero m makes m / eps.
    g = jax.tree.map(lambda g, m: None if m is None else g.astype(m.dtype), g, mu,
                     is_leaf=lambda x: x is None)
    mu = optax.tree.update_moment(g, mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(g, nu, b2, 2)
    mu_hat = _bias_corrected_mu(mu, g, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    u = jax.tree.map(lambda m, v: None if m is None else m / (jnp.sqrt(v + eps_root) + eps),
                     mu_hat, nu_hat, is_leaf=lambda x: x is None)
    return u, mu, nu

  def _leaf_update(g, mu_q, nu_q, key, prev_key, count_inc):
    # The kernels compute the same steps (kernels/adam_nvfp4.py); keep the two in step.
    g32 = g.astype(jnp.float32)
    nu_nvfp4 = nu_kind != "fp32"
    s_old = decode_moment(nu_q, "nu", options, prev_key) if nu_nvfp4 else None
    m_old = decode_moment(mu_q, "mu", options, prev_key) if mu_kind != "fp32" else mu_q
    zero = numerics.runtime_zero(count_inc)
    m, v = numerics.adam_moments(m_old, s_old * s_old if nu_nvfp4 else nu_q, g32, b1, b2, zero)
    # The correctly rounded square root: the backend's differs from the CPU's in the last bit on
    # the GPU, which would move the stored state's global scales. Where v overflows float32 from a
    # finite gradient, its root is computed at a smaller scale (the kernels do the same).
    if nu_nvfp4:
      s, _ = adam_kernel.overflow_root(v, adam_kernel.scaled_second_moment(s_old, g32, b2, zero),
                                       numerics.sqrt_rn)
    else:
      s = numerics.sqrt_rn(v)
    u = numerics.adam_direction(m, v, s, g32, numerics.bias_factors(b1, b2, eps_root, count_inc),
                                b1, eps, eps_root_choice, nesterov, _clip_bound(count_inc))
    c2 = numerics.bias_factors(b1, b2, eps_root, count_inc)[2] if nu_rounding == "preconditioner" else None
    nu_new = encode_moment(s, "nu", options, key, zero, c2=c2, eps=eps) if nu_nvfp4 else v
    mu_new = encode_moment(m, "mu", options, key, zero) if mu_kind != "fp32" else m
    return u.astype(g.dtype), mu_new, nu_new

  def _clip_bound(count_inc):
    return adam_update_bound(count_inc, b1, b2, nesterov=nesterov) if clip_update else None

  def _bias_corrected_mu(mu, g, count_inc):
    if nesterov:
      return jax.tree.map(
          lambda m, g: b1 * m + (1 - b1) * g,
          optax.tree.bias_correction(mu, b1, optax.safe_increment(count_inc)),
          optax.tree.bias_correction(g, b1, count_inc))
    return optax.tree.bias_correction(mu, b1, count_inc)

  return optax.GradientTransformation(init_fn, update_fn)


def adamw_nvfp4(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 0.1,
    mask=None,
    *,
    nesterov: bool = False,
    quantize: bool = True,
    options: AdamNvfp4Options = AdamNvfp4Options(),
    seed: int = 0,
    implementation: str = "auto",
    block_sizes: AdamKernelConfig = AdamKernelConfig(),
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW with NVFP4 moments: ``chain(scale_by_adam_nvfp4, add_decayed_weights, scale_by_lr)``.

  .. math::
    w_{t} = w_{t-1} - \eta_t \big(u_t + \lambda w_{t-1}\big)

  with ``u_t`` the update of ``scale_by_adam_nvfp4`` and ``λ`` the weight decay.

  Every numeric argument can be injected (``optax.inject_hyperparams``; give
  ``hyperparam_dtype=jnp.float32`` for bfloat16 parameters, or optax rounds the injected values to
  bfloat16; a callable ``mask`` goes in ``static_args``), and the transformation composes with
  ``optax.MultiSteps``, ``optax.chain`` and
  ``optax.masked``.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root, nesterov: as ``optax.adamw``.
    weight_decay: decoupled weight decay, multiplied by the learning rate.
    mask: which leaves get weight decay (pytree of bools or callable), as ``optax.adamw``.
    quantize, options, seed, implementation, block_sizes: as ``scale_by_adam_nvfp4``.

  Returns:
    An optax transformation. With ``quantize=False`` it equals ``optax.adamw`` bit for bit on
    float32 parameters; its moments are float32 for every parameter dtype, so on bfloat16
    parameters it equals ``optax.adamw`` run on float32 copies of the parameters and gradients,
    its update cast back to bfloat16.

  Example:
    >>> tx = adamw_nvfp4(learning_rate=3e-3)
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> params = optax.apply_updates(params, updates)
    >>> scheduled = optax.inject_hyperparams(adamw_nvfp4)(learning_rate=optax.linear_schedule(
    ...     0.0, 3e-3, 100))

  References:
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return optax.chain(
      scale_by_adam_nvfp4(b1, b2, eps, eps_root, nesterov=nesterov, quantize=quantize,
                          options=options, seed=seed, implementation=implementation,
                          block_sizes=block_sizes),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
