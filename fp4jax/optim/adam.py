"""AdamW with both moments stored in NVFP4.

One update dequantizes the moments, runs Adam's arithmetic in float32 on the fresh moments (the
current gradient enters the update unquantized), and requantizes them:

  m  = b1 * m_old + (1 - b1) * g                   m_old = dequantize(mu)
  v  = b2 * v_old + (1 - b2) * g²                  v_old = dequantize(nu)²
  u  = m_hat / (sqrt(v_hat + eps_root) + eps),     clipped to exact Adam's bound |u| <= B_t
  mu = quantize(m),  nu = quantize(sqrt(v))        1×16 blocks, stochastic rounding

Design, chosen by measurement (``benchmarks/optim_states.py``, tiny byte LM; benchmarks/RESULTS.md):

- **√v is stored** (``nu_transform="sqrt"``, FlashOptim's choice): it halves v's log-range so the
  E4M3 block scales cover it, and its relative error maps 1:1 onto the update. v itself, v^¼ and a
  log map all did worse on the update error.
- **Zeros are the danger**: in a 1×16 block, √v below 1/24 of the block's largest value stores as 0
  (and whole blocks 2.3e5× below the tensor's max), so without a guard ``m / (√0 + eps)`` explodes:
  every unguarded variant reached |u| ~ 1e5 and the training diverged (loss 134 vs 2.23).
- **The guard is a clip to exact Adam's own bound** (``clip_update``): Cauchy–Schwarz over the two
  EMAs gives ``|m_hat| / sqrt(v_hat) <= B_t`` for exact Adam (``adam_update_bound``; 1 at t=1,
  -> 1.16 for b1=0.9, b2=0.95). NVFP4 leaves clip to it, so no quantization error, in m or in v,
  can produce an update larger than exact Adam could. It trained within 0.3% of float32 AdamW
  (two seeds), while also lifting stored zeros to their block's rounding threshold
  (``zero_guard=True``, an upper bound of the flushed value) made updates too small: +3%.
- **Stochastic rounding** keeps slowly decaying entries decaying (with round-to-nearest an entry
  whose block max holds still re-rounds to the same code forever; see the staleness test);
  nearest rounding trained as well at this scale (``rounding="nearest"``). The rounding bits are a
  keyed hash of the element index that XLA fuses into the quantizer (``_common.counter_bits``: one
  32-bit hash per pair of elements gives 8 bits to each of m's and √v's two roundings), so
  stochastic rounding adds no kernel and no memory traffic (benchmarks/RESULTS.md).

Two implementations of the NVFP4 leaves' update, with the same state bits (tests; on the H200,
``tests/gpu/check_optim.py``): plain jnp, which XLA fuses and partitions (``kernel="xla"``), and two Pallas
Triton kernels (``fp4jax.kernels.adam_nvfp4``; leaves of one size share their launches), the default on
a GPU, which read the gradient and the packed state twice and write the update and the new state (on the
H200, for a 124M GPT-2 pytree: 1.44x ``optax.adamw``'s device time, 1.56 against 1.08 ms; 1.49x in wall
clock with 20 updates in one jit; 1.1–2.1x for one jitted update per call, which is host-bound; the XLA
path ~2.5x when last measured, in session 5; benchmarks/RESULTS.md).

Leaves that the storage rule keeps in float32 (``fp4jax.optim._common``) run ``optax.scale_by_adam``'s
arithmetic unchanged, and with ``quantize=False`` the transform equals optax's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp4jax import _fp32
from fp4jax.kernels import adam_nvfp4 as adam_kernel
from fp4jax.optim import _common
from fp4jax.optim._common import DEFAULT_MIN_SIZE

KERNELS = ("auto", "pallas", "pallas_interpret", "xla")


class ScaleByAdamNvfp4State(NamedTuple):
  """State of ``scale_by_adam_nvfp4``: per parameter leaf an ``NVFP4Tensor`` or a float32 array."""

  count: jax.Array  # int32 scalar: number of updates so far
  mu: optax.Updates  # first moment m
  nu: optax.Updates  # v ** nu_power where stored NVFP4, v where float32


def adam_update_bound(count, b1, b2, *, nesterov: bool = False) -> jax.Array:
  """The largest ``|m_hat| / sqrt(v_hat)`` exact Adam can produce at step ``count`` (>= 1).

  With ``r = b1² / b2`` and ``R_t = (1 - r^t) / (1 - r)``: ``|m_t| <= (1 - b1) sqrt(R_t) |v_t /
  (1 - b2)|^½`` and ``|g_t| <= |v_t / (1 - b2)|^½``; bias corrections as in optax.
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
    min_size: int = DEFAULT_MIN_SIZE,
    rounding: str | tuple[str, str] = "stochastic",
    nu_transform: str | tuple[Callable, Callable] = "sqrt",
    zero_guard: bool = False,
    clip_update: bool = True,
    mu_storage: str = "direct",
    amax: str = "exact",
    group_leaves: bool | None = None,
    seed: int = 0,
    prng_impl: str | None = None,
    kernel: str = "auto",
) -> optax.GradientTransformation:
  """Adam's scaling (no learning rate) with m and a power of v stored as NVFP4.

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator ``sqrt(v_hat) + eps``.
    eps_root: added inside the square root, as in optax.
    nesterov: Nesterov momentum, as ``optax.scale_by_adam(nesterov=True)``.
    quantize: store moments as NVFP4 where the storage rule allows; ``False`` gives
      ``optax.scale_by_adam`` exactly.
    min_size: leaves with fewer elements stay float32 (see ``fp4jax.optim._common``).
    rounding: ``"stochastic"`` (unbiased, keeps slowly decaying moments moving) or ``"nearest"``;
      a pair ``(mu_rounding, nu_rounding)`` sets them apart.
    nu_transform: what is stored for the second moment: ``"sqrt"`` (√v, default), ``"quarter"``
      (v^¼), ``"none"`` (v), or a pair of increasing maps ``(to_stored, from_stored)`` of float32
      arrays (research hook: v >= 0 in, finite non-negative out).
    zero_guard: read a stored code 0 of the second moment as its block's rounding threshold (an
      upper bound of what round-to-nearest flushed; safe but measured to slow training).
    clip_update: clip updates of NVFP4 leaves to ``adam_update_bound`` (the guard against
      moments quantized to zero; keep it on).
    mu_storage: ``"direct"`` stores m; ``"normalized"`` stores m / sqrt(v) of the just-stored v
      (bounded by Adam's bound, so its 1×16 blocks are well conditioned) and reads m back as
      ``stored * sqrt(v_stored)``.
    amax: how each new moment's tensor scale (NVFP4's global scale) is set. ``"exact"`` (default):
      from its amax, as ``nvfp4.quantize`` does (Transformer Engine's rule), which needs a pass over
      the new moments before any is encoded. ``"bound"``: from an upper bound of that amax computed
      from the gradient's amax and the old state's largest block scales (``_common.amax_bounds``):
      every value still fits (no saturation), the scale is looser by the bound's slack, and the
      GPU kernels replace the moments' pass with one over the gradient and the scales. Measured
      (benchmarks/RESULTS.md, session 7): a median slack of 1.14x, a 6% larger update error, and
      no faster on the H200. Needs ``mu_storage="direct"``.
    group_leaves: update leaves of one shape together under ``jax.vmap`` (fewer programs, but
      stacking copies); False updates each leaf on its own; None (default): grouped except when
      JAX's default backend is the CPU (``_common.group_by_default``: same bits, XLA:CPU compiles
      groups slowly).
    seed: stochastic rounding uses ``fold_in(key(seed), count)``: deterministic, nothing to store.
    prng_impl: generator of the per-step key (``jax.random.key``'s ``impl``; default threefry); the
      rounding bits are ``_common.counter_bits`` of that key.
    kernel: how NVFP4 leaves are updated: ``"pallas"`` (two fused Pallas Triton kernels,
      ``fp4jax.kernels.adam_nvfp4``; GPU only), ``"xla"`` (plain jnp), ``"pallas_interpret"``
      (the kernels in interpret mode, for CPU tests), or ``"auto"`` (default): ``"pallas"`` when
      the default platform (``_common.default_platform``) is a CUDA GPU, else ``"xla"``. Both give the same state bits. The kernels
      take the default storage (``nu_transform="sqrt"``, ``mu_storage="direct"``, no
      ``zero_guard``) and leaves blocked along their last axis; other leaves and options use the
      XLA path. They see whole leaves: under a mesh that shards the state (FSDP, tensor
      parallel) use ``"xla"``, which XLA partitions.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ScaleByAdamNvfp4State``.

  References:
    Kingma & Ba, Adam, 2014; Li et al., Memory Efficient Optimizers with 4-bit States, 2023
    (the zero-point problem of the second moment).
  """
  mu_rounding, nu_rounding = (rounding, rounding) if isinstance(rounding, str) else rounding
  _common.check_common(min_size, mu_rounding)
  _common.check_common(min_size, nu_rounding)
  to_stored, from_stored = _nu_maps(nu_transform)
  stochastic = "stochastic" in (mu_rounding, nu_rounding)
  if mu_storage not in ("direct", "normalized"):
    raise ValueError(f"mu_storage must be 'direct' or 'normalized', got {mu_storage!r}")
  normalized_mu = mu_storage == "normalized"
  if amax not in _common.AMAX_RULES:
    raise ValueError(f"amax must be one of {_common.AMAX_RULES}, got {amax!r}")
  if amax == "bound" and normalized_mu:
    raise ValueError("amax='bound' needs mu_storage='direct' (a normalized m has no bound here)")
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
  kernel_ok = (nu_transform == "sqrt" and not normalized_mu and not zero_guard)
  hyper = adam_kernel.AdamHyper(b1=b1, b2=b2, eps=eps, eps_root=eps_root, nesterov=nesterov,
                                clip_update=clip_update, mu_rounding=mu_rounding,
                                nu_rounding=nu_rounding, amax=amax)

  def init_fn(params):
    zeros = lambda p: _common.zeros_state(p.shape, min_size, quantize)  # noqa: E731
    return ScaleByAdamNvfp4State(count=jnp.zeros([], jnp.int32), mu=_common.map_params(zeros, params),
                                 nu=_common.map_params(zeros, params))

  def update_fn(updates, state, params=None):
    del params
    g_leaves, treedef = jax.tree.flatten(updates)
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    quantized = [_common.is_nvfp4(m) for m in mu_leaves]
    count_inc = optax.safe_increment(state.count)

    # Float32 leaves: optax.scale_by_adam's code on the same tree (None where NVFP4), so that with
    # no NVFP4 leaf the traced program is optax's and the bits agree (XLA's fusion, and with it the
    # last bit, depends on the whole tree).
    sub = lambda leaves: treedef.unflatten(  # noqa: E731
        [None if q else x for q, x in zip(quantized, leaves)])
    u32, mu32, nu32 = _fp32_update(sub(g_leaves), sub(mu_leaves), sub(nu_leaves), count_inc)
    u_leaves = treedef.flatten_up_to(u32)
    mu_new, nu_new = treedef.flatten_up_to(mu32), treedef.flatten_up_to(nu32)

    key = _common.step_key(seed, count_inc, prng_impl) if stochastic else None
    q_idx = [i for i, q in enumerate(quantized) if q]
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(quantized))]
    impl = kernel if kernel != "auto" else (
        "pallas" if _common.default_platform() == "cuda" else "xla")
    fused = []
    if impl != "xla" and kernel_ok:
      fused = [i for i in q_idx if adam_kernel.supports(mu_leaves[i])
               and adam_kernel.supports(nu_leaves[i])]
      q_idx = [i for i in q_idx if i not in fused]
    if fused:
      outs = adam_kernel.update_leaves(
          [g_leaves[i] for i in fused], [mu_leaves[i] for i in fused],
          [nu_leaves[i] for i in fused], fused, key, hyper,
          _common.bias_factors(b1, b2, eps_root, count_inc),
          _clip_bound(count_inc), _common.runtime_zero(count_inc),
          interpret=impl == "pallas_interpret")
      for j, i in enumerate(fused):
        u_leaves[i], mu_new[i], nu_new[i] = (o[j] for o in outs)
    leaf_fn = lambda g, m, v, k: _leaf_update(g, m, v, k, count_inc)  # noqa: E731
    for i, out in _common.grouped_map(leaf_fn, q_idx, g_leaves, mu_leaves, nu_leaves, keys,
                                      group=group_leaves).items():
      u_leaves[i], mu_new[i], nu_new[i] = out
    mu, nu = treedef.unflatten(mu_new), treedef.unflatten(nu_new)
    return treedef.unflatten(u_leaves), ScaleByAdamNvfp4State(count=count_inc, mu=mu, nu=nu)

  def _fp32_update(g, mu, nu, count_inc):
    mu = optax.tree.update_moment(g, mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(g, nu, b2, 2)
    mu_hat = _bias_corrected_mu(mu, g, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    u = jax.tree.map(lambda m, v: None if m is None else m / (jnp.sqrt(v + eps_root) + eps),
                     mu_hat, nu_hat, is_leaf=lambda x: x is None)
    return u, mu, nu

  def _leaf_update(g, mu_q, nu_q, key, count_inc):
    g32 = g.astype(jnp.float32)
    read_nu = _common.decode_guarded if zero_guard else _common.decode
    v_old = from_stored(read_nu(nu_q))
    m_old = _common.decode(mu_q)
    if normalized_mu:  # mu holds m / sqrt(v) of the stored v
      m_old = m_old * jnp.sqrt(v_old)
    zero = _common.runtime_zero(count_inc)
    m, v = _common.adam_moments(m_old, v_old, g32, b1, b2, zero)
    m_amax = s_amax = None  # "exact": the quantizer's max|x|
    if amax == "bound":
      floor = _common._ZERO_BLOCK_BOUND if zero_guard else 0.0  # decode_guarded's largest lift
      m_amax, v_amax = _common.amax_bounds(
          _common.max_abs(g32), _common.largest_stored(mu_q),
          from_stored(_common.largest_stored(nu_q, floor)), b1, b2, zero)
      s_amax = to_stored(v_amax)
    stored_v = to_stored(v)
    s = stored_v if nu_transform == "sqrt" else _fp32.sqrt_rn(v)
    u = _common.adam_direction(m, v, s, g32, _common.bias_factors(b1, b2, eps_root, count_inc), b1,
                               eps, eps_root, nesterov, _clip_bound(count_inc))
    nu_new = _common.encode(stored_v, nu_rounding, key, lane=1, amax=s_amax)
    if normalized_mu:
      s_new = jnp.sqrt(from_stored(read_nu(nu_new)))
      m = jnp.where(s_new > 0, m / jnp.where(s_new > 0, s_new, 1.0), 0.0)
    mu_new = _common.encode(m, mu_rounding, key, lane=0, amax=m_amax)
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


# The stored maps use the correctly rounded integer square root: on the H200, jnp.sqrt differed from
# the CPU's in the last bit for 17% of normal float32 inputs (tests/gpu/check_optim.py), which moved
# the stored state's global scales.
_NU_TRANSFORMS = {
    "sqrt": (_fp32.sqrt_rn, lambda s: s * s),
    "quarter": (lambda v: _fp32.sqrt_rn(_fp32.sqrt_rn(v)), lambda q: (q * q) * (q * q)),
    "none": (lambda v: v, lambda v: v),
}


def _nu_maps(nu_transform):
  if isinstance(nu_transform, str):
    if nu_transform not in _NU_TRANSFORMS:
      raise ValueError(f"nu_transform must be one of {sorted(_NU_TRANSFORMS)} or a pair of "
                       f"callables, got {nu_transform!r}")
    return _NU_TRANSFORMS[nu_transform]
  if (not isinstance(nu_transform, tuple) or len(nu_transform) != 2
      or not all(callable(f) for f in nu_transform)):
    raise ValueError(f"nu_transform must be a name or a pair (to_stored, from_stored), "
                     f"got {nu_transform!r}")
  return nu_transform


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
    **nvfp4_options,
) -> optax.GradientTransformationExtraArgs:
  """AdamW with NVFP4 moments: ``chain(scale_by_adam_nvfp4, add_decayed_weights, scale_by_lr)``.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root, nesterov: as ``optax.adamw``.
    weight_decay: decoupled weight decay, multiplied by the learning rate.
    mask: which leaves get weight decay (pytree of bools or callable), as ``optax.adamw``.
    **nvfp4_options: ``quantize``, ``min_size``, ``rounding``, ``nu_transform``, ``zero_guard``,
      ``mu_storage``, ``amax``, ``group_leaves``, ``clip_update``, ``seed``, ``prng_impl``,
      ``kernel`` of ``scale_by_adam_nvfp4``.

  Returns:
    An optax transformation; with ``quantize=False`` it equals ``optax.adamw`` bit for bit.
  """
  return optax.chain(
      scale_by_adam_nvfp4(b1, b2, eps, eps_root, nesterov=nesterov, **nvfp4_options),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
