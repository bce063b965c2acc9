"""Shared pieces of the NVFP4 optimizers: state codecs, keys, grouped updates.

The storage rule, the bytes of a state and its shardings are public, in ``fp4jax.optim.state``.
Leaves of the same shape can be updated together under ``jax.vmap`` (``grouped_map``: one program
per shape, not per leaf, each leaf with its own global scale and random bits).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import _platform, numerics, nvfp4
from fp4jax._fp32 import div_rn_normal
from fp4jax.nvfp4 import BLOCK, NVFP4Tensor
from fp4jax.kernels import adam_nvfp4 as adam_kernel
from fp4jax.optim.state import CenteredNVFP4Tensor, _fit, block_axis, stores_nvfp4

_F32 = jnp.dtype(jnp.float32)


def is_nvfp4(x) -> bool:
  return isinstance(x, NVFP4Tensor)


def concrete_float(x) -> float | None:
  """``x`` as a Python float when its value is known while tracing, else None.

  Hyperparameters are Python numbers, except under ``optax.inject_hyperparams``, where they are
  arrays of the optimizer state (tracers inside a jit): those take the paths that need no static
  value.
  """
  if isinstance(x, jax.core.Tracer):
    return None
  return float(x)


def check_decay(name, x):
  """A decay (``b1``, ``b2``, ``beta``) must lie in [0, 1); traced values are not checked."""
  v = concrete_float(x)
  if v is not None and not 0.0 <= v < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {x!r}")


def check_non_negative(name, x):
  """``eps``-like arguments must be >= 0; traced values are not checked."""
  v = concrete_float(x)
  if v is not None and not v >= 0.0:
    raise ValueError(f"{name} must be >= 0, got {x!r}")


def check_steps(name, x):
  """An iteration count must be an int >= 0; traced values are not checked."""
  if isinstance(x, jax.core.Tracer) or (hasattr(x, "dtype") and not isinstance(x, (int, float))):
    return
  if isinstance(x, bool) or not isinstance(x, int) or x < 0:
    raise ValueError(f"{name} must be an int >= 0, got {x!r}")


def moment_dtype(param_dtype, dtype=None):
  """The dtype of a moment of a parameter of ``param_dtype``: ``dtype`` (default float32), made
  complex (complex64 for float32) for a complex parameter, whose moment keeps its phase."""
  dtype = _F32 if dtype is None else jnp.dtype(dtype)
  if jnp.issubdtype(param_dtype, jnp.complexfloating):
    return jnp.promote_types(dtype, jnp.complex64)
  return dtype


def is_complex(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.complexfloating)


def _param_sharding(p):
  """``p``'s ``NamedSharding`` where it is known: a concrete array's or a ``ShapeDtypeStruct``'s, or
  a traced value's sharding type under explicit mesh axes (``jax.sharding.AxisType.Explicit``);
  None otherwise (one device, or XLA's choice under auto axes)."""
  if isinstance(p, jax.core.Tracer):
    sharding = jax.typeof(p).sharding
    if AxisType.Explicit not in getattr(sharding.mesh, "axis_types", ()):
      return None
  else:
    sharding = getattr(p, "sharding", None)
  return sharding if isinstance(sharding, NamedSharding) else None


def zeros(shape, dtype, like):
  """Zeros of ``shape`` sharded like the parameter ``like`` (its mesh axes that do not divide a
  dimension of ``shape`` dropped, as ``state_sharding`` does), so that ``init`` builds the state
  with the shardings ``update`` returns."""
  sharding = _param_sharding(like)
  if sharding is None or len(sharding.spec) > len(shape):
    return jnp.zeros(shape, dtype)
  sharding = _fit(sharding, shape)
  if isinstance(sharding.mesh, AbstractMesh):
    return jax.sharding.reshard(jnp.zeros(shape, dtype), sharding)
  return jnp.zeros(shape, dtype, device=sharding)


def explicit_spec(x):
  """The ``PartitionSpec`` of a traced or concrete array sharded over explicit mesh axes, else None."""
  sharding = jax.typeof(x).sharding
  if AxisType.Explicit not in getattr(sharding.mesh, "axis_types", ()):
    return None
  return sharding.spec


def sharded_explicitly(x) -> bool:
  """Whether any array of ``x`` is split over an explicit mesh axis."""
  return any(s is not None and any(a is not None for a in s)
             for s in (explicit_spec(a) for a in jax.tree.leaves(x)))


def auto(fn, out_like, *args):
  """``fn(*args)``; where an argument is split over explicit mesh axes, with those axes automatic
  inside (``jax.sharding.auto_axes``) and the outputs sharded like ``out_like`` (arrays shaped like
  the outputs; replicated where not explicitly sharded). The NVFP4 codec's block reshapes and
  Newton–Schulz's products have no explicit sharding rule: inside, XLA partitions them."""
  if not sharded_explicitly((args, out_like)):
    return fn(*args)
  out_specs = jax.tree.map(lambda x: explicit_spec(x) or P(), out_like)
  return jax.sharding.auto_axes(fn, out_sharding=out_specs)(*args)


def check_min_size(min_size):
  if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
    raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")


def zeros_nvfp4(shape, like=None) -> NVFP4Tensor:
  """``quantize(zeros(shape))`` without computing it (works for abstract shapes in ``init``); codes
  and scales sharded like the parameter ``like`` (``zeros``), the global scale replicated."""
  shape = tuple(shape)
  ax = block_axis(shape)
  div = lambda d: tuple(n // d if i == ax else n for i, n in enumerate(shape))
  return NVFP4Tensor(
      codes=zeros(div(2), jnp.uint8, like),
      scales=zeros(div(BLOCK), jnp.float8_e4m3fn, like),
      global_scale=jnp.ones((), jnp.float32),
      shape=shape, block=(1, BLOCK), axis=ax, dtype=_F32)


def stores_nvfp4_param(p, min_size: int, quantize: bool) -> bool:
  """Whether the moments of parameter ``p`` are NVFP4: the storage rule, for real parameters only
  (a complex parameter's moments keep their phase in complex64)."""
  return quantize and not is_complex(p) and stores_nvfp4(p.shape, min_size)


def zeros_state(p, min_size: int, quantize: bool, dtype=None):
  """A zero moment for parameter ``p``: NVFP4 under the storage rule, else ``dtype`` (default
  ``moment_dtype(p.dtype)``), sharded like ``p``."""
  if stores_nvfp4_param(p, min_size, quantize):
    return zeros_nvfp4(p.shape, p)
  return zeros(tuple(p.shape), moment_dtype(p.dtype) if dtype is None else dtype, p)


def zeros_moment(p, kind: str, dtype=None):
  """A zero moment of ``kind`` (``adam_nvfp4.KINDS``) for parameter ``p``: ``zeros_nvfp4``,
  ``zeros_centered``, or (``"fp32"``) ``dtype`` (default ``moment_dtype(p.dtype)``), sharded like ``p``."""
  if kind == "nvfp4":
    return zeros_nvfp4(p.shape, p)
  if kind == "centered":
    return zeros_centered(p.shape, p)
  return zeros(tuple(p.shape), moment_dtype(p.dtype) if dtype is None else dtype, p)


def _is_param(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def map_params_with_path(fn, params):
  """``map_params`` with each leaf's key path: ``fn(path, leaf)``."""
  return jax.tree_util.tree_map_with_path(fn, params, is_leaf=_is_param)


def map_params(fn, params):
  """``jax.tree.map`` over parameter-like leaves (anything with ``shape`` and ``dtype``).

  Wrappers that are pytree nodes around one array (flax ``nnx.Variable``) count as leaves, so the
  state holds plain arrays and ``NVFP4Tensor``s, never a Variable wrapping an ``NVFP4Tensor``.
  """
  return jax.tree.map(fn, params, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def encode(x, rounding: str, key, lane: int = 0, scale_rule: str = "max") -> NVFP4Tensor:
  """float32 ``x`` -> NVFP4, 1×16 blocks along ``block_axis(x.shape)``; stochastic rounding takes its
  bits from ``numerics.counter_bits(key, x.shape, lane)``; ``scale_rule``: ``nvfp4.quantize``'s (Four
  over Six with nearest rounding)."""
  bits = numerics.counter_bits(key, x.shape, lane) if rounding == "stochastic" else None
  return nvfp4.quantize(x.astype(jnp.float32), block=(1, BLOCK), axis=block_axis(x.shape),
                        rounding=rounding, bits=bits, scale_rule=scale_rule)


def encode_centered(x, rounding: str, key, lane: int = 1, scale_rule: str = "max") -> CenteredNVFP4Tensor:
  """float32 ``x`` (>= 0) -> ``CenteredNVFP4Tensor``, 1×16 blocks along ``block_axis(x.shape)``: the
  block means removed, the rest rotated (``adam_nvfp4.center_rotate``) and quantized as ``encode``
  quantizes (the same counter bits, by element position)."""
  ax = block_axis(x.shape)
  xm = jnp.moveaxis(x.astype(jnp.float32), ax, -1)
  blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK, BLOCK)
  mean, y = adam_kernel.center_rotate(blocks)
  y = jnp.moveaxis(y.reshape(xm.shape), -1, ax)
  t = encode(y, rounding, key, lane, scale_rule)
  return CenteredNVFP4Tensor(codes=t.codes, scales=t.scales, global_scale=t.global_scale,
                             shape=t.shape, block=t.block, axis=t.axis, dtype=t.dtype,
                             mean=jnp.moveaxis(mean, -1, ax))


def encode_preconditioned(x, key, c2, eps, zero, lane: int = 1) -> NVFP4Tensor:
  """float32 ``x`` (>= 0, Adam's √v) -> NVFP4 as ``encode`` stores it (the same scales), its codes
  stochastically rounded in the preconditioner space (``adam_nvfp4.e2m1_preconditioner_codes``, with
  the counter bits of ``encode``); ``c2``: the update's ``1 / sqrt(bc2)``; ``zero``: a runtime zero."""
  ax = block_axis(x.shape)
  x32 = numerics.flush_subnormals(x.astype(jnp.float32))
  t, escale, dscale, _, zero_block = _nearest_blocks(x32, ax)  # its scales, as encode's
  expand = lambda b: jnp.repeat(b, BLOCK, axis=ax)
  mul = lambda a, b: numerics.rounded(a * b, zero)
  code = adam_kernel.e2m1_preconditioner_codes(x32, expand(escale), expand(dscale), t.global_scale,
                                               expand(zero_block), numerics.counter_bits(key, x.shape, lane),
                                               c2, eps, mul)
  return t.with_code_indices(code)


def _nearest_blocks(x32, ax):
  """``nvfp4.quantize(x32)`` to nearest (flushed input) and its per-element encode scale, decoded
  block scale and zero-block mask, expanded along ``ax``."""
  t = nvfp4.quantize(x32, block=(1, BLOCK), axis=ax, rounding="nearest")
  dcode = jax.lax.bitcast_convert_type(t.scales, jnp.uint8)
  escale, dscale = t.encode_scales(), t.block_scales()
  zero_block = (dscale == 0) | ~jnp.isfinite(t.global_scale)
  return t, escale, dscale, dcode, zero_block


def encode_dithered(x, key, zero, lane: int = 0) -> NVFP4Tensor:
  """float32 ``x`` -> NVFP4 with subtractive dither: ``encode``'s scales (nearest rounding), the codes
  ``adam_nvfp4.dithered_codes`` with the counter bits of ``encode``; ``decode_dithered`` with the same
  key and lane decodes them."""
  ax = block_axis(x.shape)
  x32 = numerics.flush_subnormals(x.astype(jnp.float32))
  t, escale, _, _, zero_block = _nearest_blocks(x32, ax)
  expand = lambda b: jnp.repeat(b, BLOCK, axis=ax)
  mul = lambda a, b: numerics.rounded(a * b, zero)
  code = adam_kernel.dithered_codes(x32, expand(escale), expand(zero_block),
                                    numerics.counter_bits(key, x.shape, lane), mul)
  return t.with_code_indices(code)


def decode_dithered(t: NVFP4Tensor, key, lane: int = 0) -> jax.Array:
  """The moment stored by ``encode_dithered`` with ``key`` (the step that wrote it) and ``lane``:
  ``(dithered_values(code, bits) · dscale) · S_dec`` in float32 (``NVFP4Tensor.dequantize``'s
  products on the dithered E2M1-unit values)."""
  q = adam_kernel.dithered_values(t.code_indices(), numerics.counter_bits(key, t.shape, lane))
  return (q * jnp.repeat(t.block_scales(), BLOCK, axis=t.axis)) * t.global_scale


def encode_eden(x, key, zero, lane: int = 0) -> NVFP4Tensor:
  """float32 ``x`` -> NVFP4 with EDEN-calibrated block scales: ``encode``'s codes to nearest, each
  block's E4M3 scale replaced by ``adam_nvfp4.eden_scale_codes`` (sums in element order, products
  rounded; the 16 scale bits from the counter bits of the block's elements 0 and 1 in ``lane``)."""
  ax = block_axis(x.shape)
  x32 = numerics.flush_subnormals(x.astype(jnp.float32))
  t, escale, dscale, dcode, zero_block = _nearest_blocks(x32, ax)
  mul = lambda a, b: numerics.rounded(a * b, zero)
  a = mul(x32, jnp.repeat(escale, BLOCK, axis=ax))
  q = t.elements()
  blocks = lambda y: jnp.moveaxis(y, ax, -1).reshape(*dscale.shape[:ax], *dscale.shape[ax + 1:],
                                                    dscale.shape[ax], BLOCK)
  back = lambda y: jnp.moveaxis(y, -1, ax)
  total = lambda y: back(functools.reduce(jnp.add, [blocks(y)[..., i] for i in range(BLOCK)]))
  n2, ip = total(mul(a, a)), total(mul(a, q))
  bits = blocks(numerics.counter_bits(key, x.shape, lane))
  bits16 = back(adam_kernel.eden_bits16(bits[..., 0], bits[..., 1]))
  code = adam_kernel.eden_scale_codes(n2, ip, dscale, dcode, zero_block, bits16, mul, div_rn_normal)
  return dataclasses.replace(t, scales=jax.lax.bitcast_convert_type(code.astype(jnp.uint8),
                                                                     jnp.float8_e4m3fn))


def zeros_centered(shape, like=None) -> CenteredNVFP4Tensor:
  """``encode_centered(zeros(shape))`` without computing it: ``zeros_nvfp4`` and zero means."""
  t = zeros_nvfp4(shape, like)
  return CenteredNVFP4Tensor(codes=t.codes, scales=t.scales, global_scale=t.global_scale,
                             shape=t.shape, block=t.block, axis=t.axis, dtype=t.dtype,
                             mean=zeros(t.scales.shape, jnp.bfloat16, like))


def decode(t: NVFP4Tensor) -> jax.Array:
  return t.dequantize(jnp.float32)


def group_by_default() -> bool:
  """Whether same-shape leaves are batched: not when the default platform is the CPU.

  On an accelerator, grouping launches fewer kernels; XLA:CPU compiles a vmapped group slowly and
  gains nothing from it. Grouped and ungrouped updates give the same bits.
  """
  return _platform.default_platform() != "cpu"


def grouped_map(fn, indices, *leaf_lists, group: bool):
  """``fn(*args)`` for every index in ``indices``, leaves of one shape batched under ``jax.vmap``.

  Args:
    fn: maps one leaf's arguments (arrays, ``NVFP4Tensor``s, keys or None) to a tuple of outputs.
    indices: the leaf indices to compute.
    *leaf_lists: per argument, a list indexed by leaf index.
    group: False computes each leaf on its own (no stacking copies; more, smaller programs).

  Returns:
    A dict index -> tuple of outputs.
  """
  groups: dict = {}
  for i in indices:
    sig = tuple((getattr(a[i], "shape", None), str(getattr(a[i], "dtype", None)))
                for a in leaf_lists)
    groups.setdefault(sig if group else i, []).append(i)
  out = {}
  for idx in groups.values():
    if len(idx) == 1:
      out[idx[0]] = fn(*(a[idx[0]] for a in leaf_lists))
      continue
    stacked = [None if a[idx[0]] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *(a[i] for i in idx))
               for a in leaf_lists]
    axes = [None if x is None else 0 for x in stacked]
    res = jax.vmap(fn, in_axes=axes)(*stacked)
    for j, i in enumerate(idx):
      out[i] = jax.tree.map(lambda x, j=j: x[j], res)
  return out


def step_key(seed: int, count) -> jax.Array:
  """The random key of one step: ``fold_in(key(seed), count)``; deterministic and checkpoint-free.

  The per-element rounding bits are ``numerics.counter_bits`` of the key (folded with the leaf's
  index), the same on every backend and sharding.
  """
  return jax.random.fold_in(jax.random.key(seed), count)
