"""Small pieces shared by the Pallas kernels."""

from jax.experimental.pallas import triton as plgpu


def store(ref, val, mask, eviction_policy=None):
  """``ref[...] = val``, masked where ``mask`` is not None (a block hanging over the array's end);
  ``eviction_policy``: Triton's L2 hint."""
  if mask is None and eviction_policy is None:
    ref[...] = val
  else:
    plgpu.store(ref, val, mask=mask, eviction_policy=eviction_policy)
