"""Where computations go by default, for the "auto" choices between Pallas/cuDNN and XLA paths."""

from __future__ import annotations

import jax


def _default_device():
  device = jax.config.jax_default_device
  if device is None or isinstance(device, str):
    device = jax.devices(device)[0]
  return device


def default_platform() -> str:
  """The platform computations go to by default: that of ``jax.default_device`` when one is set
  (``with jax.default_device(cpu):`` on a GPU machine gives "cpu"), else of JAX's default backend;
  GPUs are told apart as "cuda" or "rocm" (the Pallas kernels lower PTX: CUDA only)."""
  device = _default_device()
  if device.platform != "gpu":
    return device.platform
  version = str(getattr(device.client, "platform_version", "")).lower()
  return "rocm" if "rocm" in version else "cuda"


def fp4_tensor_cores() -> bool:
  """True when computations go to a CUDA GPU with FP4 tensor cores (compute capability 10.0 and up:
  Blackwell), where ``jax.nn.scaled_matmul`` runs NVFP4 GEMMs natively; False on Hopper (9.0),
  which has none, and on every other platform."""
  if default_platform() != "cuda":
    return False
  try:
    return int(str(getattr(_default_device(), "compute_capability", "0")).split(".")[0]) >= 10
  except ValueError:
    return False


def resolve(impl: str, kernel: str, fallback: str = "xla", *, whole_arrays: bool = False) -> str:
  """The one "auto" rule of every op with a GPU kernel: ``impl`` unchanged unless it is ``"auto"``,
  which becomes ``kernel`` when computations go to a CUDA GPU by default (``default_platform``),
  else ``fallback``. ``whole_arrays``: the kernel takes whole (unsharded) arrays, a ``pallas_call``
  that XLA does not partition, so under a mesh of several devices (``jax.set_mesh``) "auto" keeps
  ``fallback``, which XLA partitions, rather than gathering the operands around every call. Ops
  check their own shape limits on top of this rule."""
  if impl != "auto":
    return impl
  if whole_arrays and jax.sharding.get_abstract_mesh().size > 1:
    return fallback
  return kernel if default_platform() == "cuda" else fallback
