"""Small pieces shared by the Pallas kernels."""

from jax.experimental.pallas import triton as plgpu


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def store(ref, val, mask):
  """``ref[...] = val``, masked where ``mask`` is not None (a block hanging over the array's end)."""
  if mask is None:
    ref[...] = val
  else:
    plgpu.store(ref, val, mask=mask)
