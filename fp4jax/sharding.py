"""Device mesh and the parameter sharding table.

The mesh has three axes: ``data`` (pure data parallel: params replicated), ``fsdp`` (data parallel
with parameters and optimizer states sharded, ZeRO-3 style) and ``tensor`` (Megatron-style tensor
parallel). The batch is split over ``("data", "fsdp")``.

One explicit table maps each projection to the mesh axes of its input and output dimensions::

  role        (in axis, out axis)     what it is
  embedding   ("tensor", "fsdp")      embed/embedding (V, D): vocab over tensor
  lm_head     ("fsdp", "tensor")      lm_head/kernel (D, V)
  qkv         ("fsdp", "tensor")      column parallel (q|k|v concatenated: GSPMD re-lays the split)
  o           ("tensor", "fsdp")      row parallel
  gate_up     ("fsdp", "tensor")      column parallel
  down        ("tensor", "fsdp")      row parallel
  (anything else, e.g. norm scales: replicated)

A 2-D leaf of shape (in, out) gets ``P(in_axis, out_axis)``; a low-rank factor (in, r) gets
``P(in_axis, None)`` and (r, out) gets ``P(None, out_axis)``; a dimension not divisible by its axis
size is left unsharded. Leading axes of stacked leaves (``ModelConfig.scan_layers``: (L, in, out))
are not sharded. Optimizer states follow their parameters (``fp4jax.optim.state_sharding``).

Multi-host: call ``jax.distributed.initialize()`` (no arguments under SLURM / Open MPI / TPU pods;
else ``coordinator_address=, num_processes=, process_id=``) before anything touches the devices;
``make_mesh`` then spans ``jax.devices()`` of every host and each host feeds its slice of the batch
(``fp4jax.data.to_global_batch`` builds the global batch arrays).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the mesh axes the batch is split over

# role (the name of the module that owns the leaf) -> (axis of the input dim, axis of the output dim)
SHARDING_TABLE: dict[str, tuple[str | None, str | None]] = {
    "embedding": ("tensor", "fsdp"),
    "lm_head": ("fsdp", "tensor"),
    "qkv": ("fsdp", "tensor"),
    "o": ("tensor", "fsdp"),
    "gate_up": ("fsdp", "tensor"),
    "down": ("tensor", "fsdp"),
}


def make_mesh(shape: tuple[int, int, int] | None = None, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh with Auto axis types (GSPMD propagation).

  Args:
    shape: sizes of (data, fsdp, tensor); one entry may be -1 (fill with the remaining devices).
      None means all devices on ``fsdp``. A mesh smaller than the device count uses the first
      devices.
    devices: devices to use; default ``jax.devices()``.

  Returns:
    The ``Mesh``.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  shape = tuple((1, -1, 1) if shape is None else shape)
  if len(shape) != 3:
    raise ValueError(f"mesh shape {shape}: expected 3 sizes for axes {AXES}")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {shape}: at most one -1")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if n % known:
      raise ValueError(f"mesh shape {shape} does not divide the {n} devices")
    shape = tuple(n // known if s == -1 else s for s in shape)
  if int(np.prod(shape)) > n:
    raise ValueError(f"mesh shape {shape} needs {int(np.prod(shape))} devices; only {n} are "
                     "available")
  devices = devices[:int(np.prod(shape))]  # a smaller mesh uses the first devices
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _role(path) -> str | None:
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  for name in reversed(names[:-1]):
    if name in SHARDING_TABLE:
      return name
  return names[-1] if names and names[-1] in SHARDING_TABLE else None


def _fit(axis, dim, mesh: Mesh):
  return axis if axis is not None and dim % mesh.shape[axis] == 0 else None


def param_spec(path, shape: tuple[int, ...], in_out: tuple[int, int] | None, mesh: Mesh) -> P:
  """The PartitionSpec of one parameter leaf (see the module docstring)."""
  role = _role(path)
  if role is None or len(shape) < 2:
    return P()
  in_axis, out_axis = SHARDING_TABLE[role]
  lead, (rows, cols) = (None,) * (len(shape) - 2), shape[-2:]
  if in_out is not None and (rows != in_out[0]) != (cols != in_out[1]):
    # A low-rank factor: (in, r) or (r, out).
    if rows == in_out[0]:
      return P(*lead, _fit(in_axis, rows, mesh), None)
    return P(*lead, None, _fit(out_axis, cols, mesh))
  return P(*lead, _fit(in_axis, rows, mesh), _fit(out_axis, cols, mesh))


def param_shardings(params, mesh: Mesh, dims: dict[str, tuple[int, int]] | None = None):
  """NamedShardings for a parameter pytree (pure dict or nnx.State) from ``SHARDING_TABLE``.

  Args:
    params: pytree of arrays or ShapeDtypeStructs, keyed as in ``fp4jax.model``.
    mesh: a (data, fsdp, tensor) mesh.
    dims: optional ``role -> (in_features, out_features)`` of each projection (e.g.
      ``fp4jax.model.projection_dims(cfg)``), used to recognise low-rank factors; None treats
      every 2-D leaf as a full matrix.

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``params``.
  """
  def one(path, x):
    io = (dims or {}).get(_role(path))
    return NamedSharding(mesh, param_spec(path, tuple(x.shape), io, mesh))
  return jax.tree_util.tree_map_with_path(one, params)


def replicated(mesh: Mesh) -> NamedSharding:
  """The fully replicated sharding on ``mesh``."""
  return NamedSharding(mesh, P())
