"""High-precision matmul ``x @ kernel`` for the BF16 parts of a model, with a mixed-precision backward.

``jnp.dot(x.astype(bf16), w.astype(bf16), preferred_element_type=f32)`` is the obvious way to ask
for float32 accumulation, but its autodiff is slow on the GPU: the cotangent of a float32 output is
float32, so both backward GEMMs get one float32 operand, XLA promotes the other, and they run as
float32 (TF32) GEMMs, several times slower than bf16 ones. ``mixed_matmul`` keeps the forward's
numerics and casts the cotangent to the compute dtype first, as Transformer Engine and Megatron do:

  forward  y  = (x_c · k_c)             float32 accumulation, output ``out_dtype``
  dgrad    dx = (dy_c · k_cᵀ)           float32 accumulation, output ``dtype``
  wgrad    dk = (x_cᵀ · dy_c)           float32 accumulation and output (the master weight's)

with ``_c`` the operand cast to ``dtype``. ``mixed_matmul_vjp_reference`` computes the same
gradients from float32 copies of the rounded operands (tests compare the two).

``mixed_matmul_split`` is the same op for several kernels sharing one input (attention's q, k, v):
each output is its own GEMM result, so no strided copy slices one fused output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _contract_last(a):
  """Dimension numbers of a[..., K] · b[K, N]."""
  return ((a.ndim - 1,), (0,)), ((), ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def mixed_matmul(x, kernel, dtype=jnp.bfloat16, out_dtype=None):
  """``x @ kernel`` with operands in ``dtype``, float32 accumulation, a ``dtype`` backward.

  Args:
    x: ``[..., K]`` activations (any float dtype).
    kernel: ``[K, N]`` weight (typically the float32 master weight).
    dtype: operand dtype of the three GEMMs (``jnp.bfloat16``; ``jnp.float32`` gives a plain
      float32 matmul).
    out_dtype: dtype of the result (default ``dtype``; ``jnp.float32`` for logits).

  Returns:
    ``[..., N]`` in ``out_dtype``. Gradients: ``dx`` in ``x.dtype`` (computed in ``dtype``),
    ``dkernel`` in ``kernel.dtype`` (computed with float32 output).
  """
  return _forward(x, kernel, dtype, out_dtype)


def _forward(x, kernel, dtype, out_dtype):
  out_dtype = dtype if out_dtype is None else out_dtype
  xc, kc = x.astype(dtype), kernel.astype(dtype)
  return lax.dot_general(xc, kc, _contract_last(xc), preferred_element_type=out_dtype)


def _fwd(x, kernel, dtype, out_dtype):
  # The residuals are the operands as cast for the GEMM, plus scalars that carry the input dtypes
  # (residuals must be arrays).
  xc, kc = x.astype(dtype), kernel.astype(dtype)
  return _forward(xc, kc, dtype, out_dtype), (xc, kc, jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype))


def _bwd(dtype, out_dtype, res, dy):
  del out_dtype
  xc, kc, x_tag, k_tag = res
  dyc = dy.astype(dtype)
  dx = lax.dot_general(dyc, kc, (((dyc.ndim - 1,), (1,)), ((), ())), preferred_element_type=dtype)
  lead = tuple(range(xc.ndim - 1))
  dk = lax.dot_general(xc, dyc, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
  return dx.astype(x_tag.dtype), dk.astype(k_tag.dtype)


mixed_matmul.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mixed_matmul_split(x, kernels, dtype=jnp.bfloat16):
  """``tuple(x @ k for k in kernels)``: ``mixed_matmul`` of the column-concatenated kernels, its
  output already split.

  The forward is ``mixed_matmul`` per kernel (bit for bit the columns of the fused GEMM). The
  backward sums the dgrads ``dy_i_c · k_i_cᵀ`` in float32 and rounds once, as the fused GEMM's
  single float32 accumulation does (up to summation order), and takes each wgrad as
  ``mixed_matmul``'s.

  Args:
    x: ``[..., K]`` activations.
    kernels: tuple of ``[K, N_i]`` weights (typically float32 master weights or slices of one).
    dtype: operand and output dtype of the GEMMs.

  Returns:
    Tuple of ``[..., N_i]`` in ``dtype``. Gradients: ``dx`` in ``x.dtype`` (rounded to ``dtype``
    once), ``dkernels`` in their kernels' dtypes (float32 output).
  """
  xc = x.astype(dtype)
  return tuple(_forward(xc, k, dtype, None) for k in kernels)


def _split_fwd(x, kernels, dtype):
  xc, kcs = x.astype(dtype), tuple(k.astype(dtype) for k in kernels)
  tags = (jnp.zeros((), x.dtype), tuple(jnp.zeros((), k.dtype) for k in kernels))
  return tuple(_forward(xc, kc, dtype, None) for kc in kcs), (xc, kcs, tags)


def _split_bwd(dtype, res, dys):
  xc, kcs, (x_tag, k_tags) = res
  dycs = [dy.astype(dtype) for dy in dys]
  # The dgrads summed in float32 and rounded once, like the fused GEMM's single accumulation
  # (adding bf16-rounded partials would round once per kernel).
  dx = functools.reduce(jnp.add, (lax.dot_general(dyc, kc, (((dyc.ndim - 1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32)
                                  for dyc, kc in zip(dycs, kcs, strict=True)))
  lead = tuple(range(xc.ndim - 1))
  dks = tuple(lax.dot_general(xc, dyc, ((lead, lead), ((), ())),
                              preferred_element_type=jnp.float32).astype(tag.dtype)
              for dyc, tag in zip(dycs, k_tags, strict=True))
  return dx.astype(dtype).astype(x_tag.dtype), dks


mixed_matmul_split.defvjp(_split_fwd, _split_bwd)


def mixed_matmul_vjp_reference(x, kernel, dy, dtype=jnp.bfloat16):
  """``(dx, dkernel)`` of ``mixed_matmul`` in float32 at HIGHEST precision, from the operands and
  the cotangent rounded to ``dtype`` (the GEMMs' own rounding left out)."""
  f32 = lambda a: a.astype(dtype).astype(jnp.float32)
  xr, kr, dyr = f32(x), f32(kernel), f32(dy)
  hi = lax.Precision.HIGHEST
  dx = jnp.einsum("...n,kn->...k", dyr, kr, precision=hi)
  dk = jnp.einsum("...k,...n->kn", xr, dyr, precision=hi)
  return dx, dk
