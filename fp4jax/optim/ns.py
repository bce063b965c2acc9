"""Newton–Schulz orthogonalization whose matmuls take float32, bfloat16 or NVFP4 operands.

The quintic iteration of Muon (Jordan et al.) on ``X`` (m×n, m <= n after a transpose), normalized
by its Frobenius norm::

  A = X Xᵀ;   B = b A + c A²;   X <- a X + B X          (3 products per step, 5 steps)

``precision`` sets the operands of every product; accumulation is always float32 and the
polynomial combination runs in float32:

- ``"fp32"``: optax's ``orthogonalize_via_newton_schulz`` arithmetic.
- ``"bf16"``: operands rounded to bfloat16 (Muon's usual precision).
- ``"nvfp4"`` (default of the optimizers): every operand is a sum of two NVFP4 tensors,
  ``X = Q1 + Q2`` with ``Q1 = quantize(X)`` and ``Q2 = quantize(X - Q1)`` (residual, "two-term"
  quantization), and each product is three NVFP4 GEMMs ``Q1·P1 + Q1·P2 + Q2·P1`` (the ``Q2·P2`` term
  is below the error of the others). One NVFP4 tensor per operand is not enough: its ~13% product
  error moves the Gram matrix's eigenvalues past the iteration's basin, and the singular values
  grow instead of converging (docs/DESIGN.md, "Newton–Schulz").

Each NVFP4 GEMM is ``fp4jax.nvfp4.gemm`` of operands quantized along the contraction axis
(round-to-nearest): a native NVFP4 GEMM up to summation order; on a GPU with FP4 tensor cores
(``fp4jax._platform.fp4_tensor_cores``) it is that native GEMM, ``nvfp4.scaled_matmul_gemm``.
``X Xᵀ`` and ``A² = A Aᵀ`` (A is
symmetric) reuse one quantization for both sides. X is zero-padded once to multiples of 16 (exact:
padded rows and columns stay zero through the iteration). The NVFP4 mode loops with
``lax.fori_loop`` (one compiled step, not five). The products are forward-only: an optimizer never
differentiates them, so the custom_vjp, stochastic-rounding backward and Hadamard transforms of a
training matmul (``fp4jax.ops.nvfp4_matmul``) are not needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax import _platform, nvfp4
from fp4jax.nvfp4 import BLOCK

PRECISIONS = ("fp32", "bf16", "nvfp4")
MUON_COEFFS = (3.4445, -4.7750, 2.0315)


def _split(x, axis, terms):
  """``terms`` NVFP4 tensors whose sum approximates ``x`` (each quantizes the previous residual)."""
  parts, r = [], x.astype(jnp.float32)
  for t in range(terms):
    q = nvfp4.quantize(r, axis=axis)
    parts.append(q)
    if t + 1 < terms:
      r = r - q.dequantize(jnp.float32)
  return parts


def _gemms(parts_a, parts_b, terms, contracting):
  gemm = nvfp4.scaled_matmul_gemm if _platform.fp4_tensor_cores() else nvfp4.gemm
  out = None
  for i, qa in enumerate(parts_a):
    for j, qb in enumerate(parts_b):
      if i + j >= terms:
        continue
      prod = gemm(qa, qb, contracting)
      out = prod if out is None else out + prod
  return out


def _check_terms(terms):
  if terms not in (1, 2):
    raise ValueError(f"terms must be 1 or 2, got {terms!r}")


def nvfp4_dot(a_MxK, b_KxN, terms: int = 1) -> jax.Array:
  """``a @ b`` with NVFP4 operands quantized along K, float32 accumulation (forward only).

  Args:
    a_MxK: left operand; K must be a multiple of 16.
    b_KxN: right operand.
    terms: 1: one NVFP4 tensor per operand, one GEMM. 2: two-term residual operands, 3 GEMMs.

  Returns:
    The float32 product (up to summation order, what NVFP4 tensor cores compute).

  Example:
    >>> y = nvfp4_dot(jnp.ones((16, 32)), jnp.ones((32, 8)), terms=2)
  """
  _check_terms(terms)
  return _gemms(_split(a_MxK, -1, terms), _split(b_KxN, 0, terms), terms, ((1,), (0,)))


def nvfp4_gram(x_MxK, terms: int = 1) -> jax.Array:
  """``x @ x.T`` with one NVFP4 quantization of ``x`` along K serving both operands (forward only).

  Args/Returns as ``nvfp4_dot``.
  """
  _check_terms(terms)
  parts = _split(x_MxK, -1, terms)
  return _gemms(parts, parts, terms, ((1,), (1,)))


def _products(precision):
  """(matmul, gram, square of a symmetric matrix) for a precision."""
  if precision == "nvfp4":
    gram = lambda x: nvfp4_gram(x, 2)
    return (lambda a, b: nvfp4_dot(a, b, 2)), gram, gram
  if precision == "bf16":
    mm = lambda a, b: jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                              preferred_element_type=jnp.float32)
  else:
    mm = lambda a, b: a @ b
  return mm, (lambda x: mm(x, x.T)), (lambda a: mm(a, a))


def newton_schulz(x_MxN, coeffs: Sequence[float] = MUON_COEFFS, steps: int = 5, *,
                  precision: str = "nvfp4", eps: float = 1e-8) -> jax.Array:
  """Orthogonalizes a matrix with ``steps`` quintic Newton–Schulz iterations.

  Complex matrices are orthogonalized as optax does (``A = X Xᴴ``), through their real
  representation ``[[Re X, -Im X], [Im X, Re X]]`` (2m×2n, a ring homomorphism that maps ``Xᴴ`` to
  the transpose), so every precision, NVFP4 included, takes them: 8 times the real products.

  In NVFP4 the result is not continuous at the ulp level: a last-bit change of the input (another
  compiled program, another summation order) can move a quantized operand to its neighbouring code,
  and the result by ~5e-5 relative (float32 products: ~1e-6).

  Args:
    x_MxN: a 2-D array (any float dtype, computed in float32; complex in complex64).
    coeffs: the quintic's ``(a, b, c)``, used at every step.
    steps: number of iterations (an int, or an int array when it is a traced hyperparameter).
    precision: ``"fp32"``, ``"bf16"`` or ``"nvfp4"`` operands for every matmul (module docstring).
    eps: added to the Frobenius norm before normalizing.

  Returns:
    A float32 (complex64 for complex ``x``) array of the shape of ``x_MxN`` whose singular values are
    near 1 (roughly in [0.7, 1.2] for Muon's coefficients), with ``x``'s singular vectors (empty for
    an empty ``x``).

  Example:
    >>> x = jax.random.normal(jax.random.key(0), (64, 128))
    >>> y = newton_schulz(x, precision="nvfp4")

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
  if jnp.ndim(x_MxN) != 2:
    raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {jnp.shape(x_MxN)}")
  if len(coeffs) != 3:
    raise ValueError(f"coeffs must be (a, b, c), got {coeffs!r}")
  complex_x = jnp.iscomplexobj(x_MxN)
  x = jnp.asarray(x_MxN, jnp.complex64 if complex_x else jnp.float32)
  m, n = x.shape
  if x.size == 0:
    return x
  transposed = m > n
  if transposed:
    x = x.T
  x = x / (jnp.linalg.norm(x) + eps)
  if complex_x:
    re, im = jnp.real(x), jnp.imag(x)
    y = _iterate(jnp.block([[re, -im], [im, re]]), coeffs, steps, precision)
    x = lax.complex(y[:min(m, n), :max(m, n)], y[min(m, n):, :max(m, n)])
  else:
    x = _iterate(x, coeffs, steps, precision)
  return x.T if transposed else x


def _iterate(x, coeffs, steps, precision):
  """The iteration on a normalized float32 ``x`` with no more rows than columns."""
  m, n = x.shape
  mm, gram, square = _products(precision)
  a, b, c = (jnp.float32(v) for v in coeffs)

  def step(_, x):
    g = gram(x)
    return a * x + mm(b * g + c * square(g), x)

  if precision == "nvfp4":
    pad = lambda d: -d % BLOCK
    x = jnp.pad(x, ((0, pad(x.shape[0])), (0, pad(x.shape[1]))))
    x = lax.fori_loop(0, steps, step, x)
    x = x[:m, :n]
  elif isinstance(steps, int):
    for i in range(steps):
      x = step(i, x)
  else:  # an array (optax.inject_hyperparams): a loop of as many steps
    x = lax.fori_loop(0, steps, step, x)
  return x
