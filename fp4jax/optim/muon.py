"""Muon with NVFP4 Newton–Schulz.

``scale_by_muon_nvfp4`` is ``optax.contrib.scale_by_muon`` (EMA momentum, bias correction, Nesterov
blend, Newton–Schulz orthogonalization of each 2-D leaf) where the Newton–Schulz products take NVFP4
operands (``fp4jax.optim.ns``). ``muon_nvfp4`` routes 2-D weights to it and embeddings, the LM head
and every non-2-D leaf to ``adamw_nvfp4``, like ``optax.contrib.muon``. The momentum stays float32
(or ``mu_dtype``): stochastic-rounding noise in an NVFP4 momentum accumulates through the EMA, and
Newton–Schulz lifts its small singular directions to the size of the signal's (docs/DESIGN.md,
"Newton–Schulz").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp4jax.optim import _common
from fp4jax.optim.adam import AdamNvfp4Options, adamw_nvfp4
from fp4jax.optim.ns import MUON_COEFFS, NS_OPERAND, check_operand, newton_schulz
from fp4jax.quant import Operand

_ADAM_NAMES = ("embed", "wte", "wpe", "lm_head", "unembed")


class ScaleByMuonNvfp4State(NamedTuple):
  """State of ``scale_by_muon_nvfp4``: the momentum of each leaf (float32 or ``mu_dtype``)."""

  count: jax.Array  # int32 scalar
  mu: optax.Updates


def scale_by_orthogonalized_momentum(
    coeffs_for_shape: Callable[[tuple[int, int]], Sequence[float]],
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    *,
    nesterov: bool = True,
    ns_operand: Operand | None = NS_OPERAND,
    mu_dtype=None,
    outlier_quantile: float | None = None,
) -> optax.GradientTransformation:
  """The engine of Muon and ROOT: momentum, optional soft-thresholding, Newton–Schulz.

  Args:
    coeffs_for_shape: ``(rows, cols) -> (a, b, c)`` quintic coefficients.
    ns_steps: Newton–Schulz iterations.
    beta: momentum decay (EMA: ``mu = beta * mu + (1 - beta) * g``).
    eps: added to the Frobenius norm before Newton–Schulz.
    nesterov: orthogonalize ``beta * mu_hat + (1 - beta) * g_hat`` (optax's Nesterov blend).
    ns_operand: the Newton–Schulz products' operands (``fp4jax.optim.newton_schulz``'s
      ``operand``): ``Operand(terms=2)`` (two-term NVFP4, the default), ``Operand(format="bf16")``
      or None (float32).
    mu_dtype: dtype of the momentum (default float32; bfloat16 halves it).
    outlier_quantile: ROOT's soft-thresholding: clip the (Nesterov) momentum to
      ``±quantile(|M|, q)`` before orthogonalizing (the part above is dropped). None: off.

  Returns:
    An ``optax.GradientTransformation``; every leaf must be 2-D (empty ones get empty updates).
    Its numeric arguments may be arrays (``optax.inject_hyperparams``): a traced ``ns_steps``
    loops with ``lax.fori_loop``, and ``outlier_quantile`` is checked when its value is known.
  """
  check_operand("ns_operand", ns_operand)
  _common.check_steps("ns_steps", ns_steps)
  _common.check_decay("beta", beta)
  _common.check_non_negative("eps", eps)
  q = None if outlier_quantile is None else _common.concrete_float(outlier_quantile)
  if q is not None and not 0.0 < q <= 1.0:
    raise ValueError(f"outlier_quantile must be in (0, 1], got {outlier_quantile!r}")

  def init_fn(params):
    for path, p in jax.tree_util.tree_leaves_with_path(params):
      if len(p.shape) != 2:
        raise ValueError(f"Muon/ROOT needs 2-D leaves; {jax.tree_util.keystr(path)} has shape "
                         f"{p.shape} (route it to AdamW, e.g. with muon_nvfp4's muon_mask)")
    zeros = lambda p: _common.zeros(
        tuple(p.shape), _common.moment_dtype(p.dtype, mu_dtype), p)
    return ScaleByMuonNvfp4State(count=jnp.zeros([], jnp.int32), mu=_common.map_params(zeros, params))

  def orthogonalize(m_hat):
    if m_hat.size == 0:
      return jnp.zeros(m_hat.shape, jnp.complex64 if _common.is_complex(m_hat) else jnp.float32)
    if outlier_quantile is not None:
      thr = jnp.quantile(jnp.abs(m_hat), outlier_quantile) + 1e-9
      if _common.is_complex(m_hat):  # the magnitude clipped, the phase kept
        m_hat = m_hat * jnp.minimum(1.0, thr / jnp.maximum(jnp.abs(m_hat), thr))
      else:
        m_hat = jnp.clip(m_hat, -thr, thr)
    return newton_schulz(m_hat, coeffs_for_shape(m_hat.shape), ns_steps, operand=ns_operand,
                         eps=eps)

  def update_fn(updates, state, params=None):
    del params
    g_leaves, treedef = jax.tree.flatten(updates)
    mu_leaves = treedef.flatten_up_to(state.mu)
    count_inc = optax.safe_increment(state.count)

    def mu_hat_of(mu, g):
      if nesterov:
        return (beta * optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc))
                + (1 - beta) * optax.tree.bias_correction(g, beta, count_inc))
      return optax.tree.bias_correction(mu, beta, count_inc)

    def leaf(g, mu):
      mu_new = optax.tree.update_moment(g, mu, beta, 1)
      stored = mu_new.astype(mu.dtype)  # float32 (or mu_dtype) whatever the gradient's dtype
      # Explicitly sharded leaves: Newton–Schulz partitioned by XLA, the update sharded like g.
      u = _common.auto(orthogonalize, g, mu_hat_of(mu_new, g))
      return u.astype(g.dtype), stored

    # Leaves of one shape grouped: batched Newton–Schulz products (explicitly sharded leaves alone).
    group = not any(_common.sharded_explicitly(x) for x in g_leaves + mu_leaves)
    outs = _common.grouped_map(leaf, range(len(g_leaves)), g_leaves, mu_leaves, group=group)
    u = treedef.unflatten([outs[i][0] for i in range(len(g_leaves))])
    mu = treedef.unflatten([outs[i][1] for i in range(len(g_leaves))])
    return u, ScaleByMuonNvfp4State(count=count_inc, mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_muon_nvfp4(
    ns_coeffs: Sequence[float] = MUON_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    *,
    nesterov: bool = True,
    ns_operand: Operand | None = NS_OPERAND,
    mu_dtype=None,
) -> optax.GradientTransformation:
  r"""Muon's scaling (no learning rate, no shape scale) with NVFP4 Newton–Schulz.

  .. math::
    \mu_t = \beta \mu_{t-1} + (1 - \beta) g_t, \quad
    u_t = \operatorname{NS}\big(\beta \hat\mu_t + (1 - \beta) \hat g_t\big)

  (with Nesterov; ``NS(mu_hat)`` without), with ``NS`` the quintic Newton–Schulz iteration of
  ``fp4jax.optim.newton_schulz``. With ``ns_operand=None`` (float32) it computes
  ``optax.contrib.scale_by_muon``: the momentum bit for bit, the update to float32 rounding (the same
  products, summed in another order). The momentum is float32 (or ``mu_dtype``) for every parameter
  dtype, where optax keeps it in the parameters' dtype: on bfloat16 parameters the equality is with
  optax's transformation initialized on float32 copies of them. Updates take the gradients' dtype.
  Empty leaves get empty updates.

  Args:
    ns_coeffs: quintic coefficients ``(a, b, c)``, the same at every step.
    ns_steps, beta, eps, nesterov: as ``optax.contrib.scale_by_muon``.
    ns_operand: the Newton–Schulz operands (``fp4jax.quant.Operand``): ``Operand(terms=2)`` (two-term
      NVFP4, the default), ``Operand(format="bf16")`` or None (float32 products).
    mu_dtype: dtype of the momentum (default float32).

  Returns:
    An ``optax.GradientTransformation`` for 2-D leaves.

  Example:
    >>> tx = scale_by_muon_nvfp4()
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> updates, state = tx.update(params, tx.init(params))

  References:
    Jordan et al., Muon, 2024; Liu et al., Muon is Scalable for LLM Training, 2025.
  """
  if len(ns_coeffs) != 3:
    raise ValueError(f"ns_coeffs must be (a, b, c), got {ns_coeffs!r}")
  coeffs = tuple(float(c) for c in ns_coeffs)
  return scale_by_orthogonalized_momentum(
      lambda shape: coeffs, ns_steps, beta, eps, nesterov=nesterov, ns_operand=ns_operand,
      mu_dtype=mu_dtype)


def scale_by_shape(consistent_rms: float | None = None) -> optax.GradientTransformation:
  """Muon's shape scale of a (fan_in, fan_out) update: ``sqrt(max(1, fan_out / fan_in))`` (Jordan),
  or with ``consistent_rms`` (e.g. 0.2, Moonshot) ``consistent_rms * sqrt(max(fan_in, fan_out))``.
  Empty updates pass through.
  """
  def scale(u):
    fan_in, fan_out = u.shape
    if u.size == 0:
      return u
    if consistent_rms is None:
      return u * jnp.sqrt(jnp.maximum(1.0, fan_out / fan_in)).astype(u.dtype)
    return u * jnp.asarray(consistent_rms * max(fan_in, fan_out) ** 0.5, u.dtype)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(scale, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def default_muon_mask(params) -> Any:
  """True for 2-D leaves whose path names no embedding or head: the path, its keys joined by ``/``
  and lowercased, contains none of ``embed``, ``wte``, ``wpe``, ``lm_head``, ``unembed``."""
  def is_muon(path, p):
    names = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return len(p.shape) == 2 and not any(n in names.lower() for n in _ADAM_NAMES)
  return jax.tree_util.tree_map_with_path(is_muon, params)


def _label(m) -> str:
  if isinstance(m, optax.contrib.MuonDimensionNumbers):
    if _axes(m.reduction_axis) != (0,) or _axes(m.output_axis) != (1,):
      raise ValueError(f"only MuonDimensionNumbers(reduction_axis=0, output_axis=1) is supported "
                       f"(2-D weights), got {m}")
    return "muon"
  return "muon" if m is True or (m is not None and m is not False and bool(m)) else "adam"


def _axes(a):
  return (a,) if isinstance(a, int) else tuple(a)


def partitioned(muon_tx, adam_tx, muon_mask) -> optax.GradientTransformationExtraArgs:
  """``optax.partition`` of the leaves: ``muon_mask`` True -> ``muon_tx``, else ``adam_tx``.

  ``muon_mask`` is a pytree like the params (or a callable of the params returning one) of bools,
  or of ``optax.contrib.MuonDimensionNumbers`` / ``None`` as optax's ``muon_weight_dimension_numbers``.
  """
  is_leaf = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)

  def labels(params):
    mask = muon_mask(params) if callable(muon_mask) else muon_mask
    labels = jax.tree.map(_label, mask, is_leaf=is_leaf)
    if not jax.tree.leaves(params):  # optax.tree.map_params's placeholder
      return labels
    # A label at a subtree (a prefix mask, e.g. None for a whole block) is given to each of its
    # leaves, as optax expands a prefix: every inner state is then shaped like the parameters.
    return jax.tree.map(lambda label, sub: _common.map_params(lambda _: label, sub), labels, params)
  return optax.partition({"muon": muon_tx, "adam": adam_tx}, labels)


def muon_nvfp4(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Sequence[float] = MUON_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask=None,
    *,
    nesterov: bool = True,
    ns_operand: Operand | None = NS_OPERAND,
    quantize: bool = True,
    mu_dtype=None,
    consistent_rms: float | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_mask: Callable | Mapping | None = None,
    adam_options: AdamNvfp4Options = AdamNvfp4Options(),
    seed: int = 0,
    adam_implementation: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  """Muon for 2-D weights, ``adamw_nvfp4`` for embeddings, the LM head and non-2-D leaves.

  Args:
    learning_rate: Muon's learning rate (float or schedule).
    ns_coeffs, ns_steps, beta, eps, nesterov, ns_operand: see ``scale_by_muon_nvfp4``.
    weight_decay, weight_decay_mask: decoupled weight decay of the Muon leaves.
    quantize: NVFP4 moments on the AdamW side (``adamw_nvfp4``); ``False`` gives float32 ones.
    mu_dtype: dtype of the Muon momentum (default float32).
    consistent_rms: None: Jordan's ``sqrt(max(1, fan_out/fan_in))``; 0.2: Moonshot's
      ``0.2 * sqrt(max(m, n))`` (AdamW-like update RMS, lets both share a learning rate).
    adam_b1, adam_b2, adam_weight_decay: the AdamW side (Nesterov follows ``nesterov``, as optax).
    adam_learning_rate: AdamW's learning rate; default ``learning_rate``.
    muon_mask: pytree (or ``params -> pytree``) of bools, or of ``MuonDimensionNumbers`` / None
      as optax's ``muon_weight_dimension_numbers``, choosing the Muon leaves; default
      ``default_muon_mask`` (2-D and not named like an embedding or LM head).
    adam_options: ``options`` of the AdamW side (``AdamNvfp4Options``).
    seed: ``seed`` of the AdamW side's stochastic rounding.
    adam_implementation: ``implementation`` of the AdamW side (``scale_by_adam_nvfp4``: "auto", "pallas", "xla",
      "pallas_interpret").

  Returns:
    An ``optax.partition`` transformation (state: ``optax.PartitionState``). Every numeric
    argument can be injected (``optax.inject_hyperparams``; pass callables such as
    ``muon_mask`` in ``static_args``), and it composes with ``optax.MultiSteps``, ``optax.chain``
    and ``optax.masked``.

  Example:
    >>> tx = muon_nvfp4(learning_rate=0.02)
    >>> params = {"embed": jnp.zeros((256, 64)), "w": jnp.zeros((64, 64))}
    >>> updates, state = tx.update(params, tx.init(params), params)

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.
  """
  muon_tx = optax.chain(
      scale_by_muon_nvfp4(ns_coeffs, ns_steps, beta, eps, nesterov=nesterov,
                          ns_operand=ns_operand, mu_dtype=mu_dtype),
      scale_by_shape(consistent_rms),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )
  adam_tx = adamw_nvfp4(learning_rate if adam_learning_rate is None else adam_learning_rate,
                        adam_b1, adam_b2, eps, weight_decay=adam_weight_decay, nesterov=nesterov,
                        quantize=quantize, options=adam_options, seed=seed,
                        implementation=adam_implementation)
  return partitioned(muon_tx, adam_tx, default_muon_mask if muon_mask is None else muon_mask)
