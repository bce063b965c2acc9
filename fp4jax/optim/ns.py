"""Newton–Schulz orthogonalization whose matmuls take float32, bfloat16 or NVFP4 operands.

The quintic iteration of Muon (Jordan et al.) on ``X`` (m×n, m <= n after a transpose), normalized
by its Frobenius norm::

  A = X Xᵀ;   B = b A + c A²;   X <- a X + B X          (3 products per step, 5 steps)

``operand`` (a ``fp4jax.quant.Operand``, or None) sets the operands of every product; accumulation
is always float32 and the polynomial combination runs in float32:

- ``None``: float32 operands, optax's ``orthogonalize_via_newton_schulz`` arithmetic.
- ``Operand(format="bf16")``: operands rounded to bfloat16 (Muon's usual precision).
- ``Operand(terms=2)`` (``NS_OPERAND``, default of the optimizers): every operand is a sum of two
  NVFP4 tensors, ``X = Q1 + Q2`` with ``Q1 = quantize(X)`` and ``Q2 = quantize(X - Q1)``
  (``fp4jax.quant.quantize_terms``), and each product is three NVFP4 GEMMs ``Q1·P1 + Q1·P2 + Q2·P1``
  (``fp4jax.quant.gemm_terms`` with ``order=2``: the ``Q2·P2`` term is below the error of the
  others). One NVFP4 tensor per operand (``Operand()``) is not enough: its ~13% product error moves
  the Gram matrix's eigenvalues past the iteration's basin, and the singular values grow instead of
  converging (docs/DESIGN.md, "Newton–Schulz").

Each NVFP4 GEMM is ``fp4jax.nvfp4.gemm`` of operands quantized in 1×16 blocks along the
contraction axis (round-to-nearest: the only block and rounding an ``operand`` may name): a native
NVFP4 GEMM up to summation order; on a GPU with FP4 tensor cores
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
from fp4jax.quant import Operand, gemm_terms, quantize_terms

MUON_COEFFS = (3.4445, -4.7750, 2.0315)
NS_OPERAND = Operand(terms=2)  # the optimizers' Newton–Schulz operands: two-term NVFP4


def check_operand(where: str, operand, *, quantized: bool = False) -> None:
  """Raises a ``ValueError`` naming ``where`` unless ``operand`` is one Newton–Schulz takes: None
  (float32; not where ``quantized``), or an ``Operand`` that is bf16 (not where ``quantized``) or
  NVFP4 in 1×16 blocks with round-to-nearest (the products draw no random bits) and
  ``scale_rule="max"``."""
  if operand is None and not quantized:
    return
  if not isinstance(operand, Operand) or (quantized and not operand.quantized):
    want = "an NVFP4 fp4jax.quant.Operand" if quantized else "a fp4jax.quant.Operand or None"
    raise ValueError(f"{where} must be {want}, got {operand!r}")
  if operand.quantized and (operand.rounding != "nearest" or operand.block != (1, BLOCK)):
    raise ValueError(f"{where}={operand!r}: Newton–Schulz quantizes in 1×16 blocks along the "
                     "contraction with round-to-nearest; use Operand(terms=...) with the defaults")
  if operand.quantized and operand.scale_rule != "max":
    raise ValueError(f"{where}.scale_rule must be 'max' (Newton–Schulz scales each block by its amax), "
                     f"got {operand.scale_rule!r}")


def _terms(x, axis, operand: Operand) -> tuple:
  """The NVFP4 terms of ``x`` along ``axis`` (``quantize_terms``: each quantizes the residual)."""
  return quantize_terms(x.astype(jnp.float32), operand.terms, lambda a, _: nvfp4.quantize(a, axis=axis))


def _gemms(parts_a, parts_b, terms, contracting):
  gemm = nvfp4.scaled_matmul_gemm if _platform.fp4_tensor_cores() else nvfp4.gemm
  return gemm_terms(parts_a, parts_b, lambda qa, qb: gemm(qa, qb, contracting), order=terms)


def nvfp4_dot(a_MxK, b_KxN, operand: Operand = Operand()) -> jax.Array:
  """``a @ b`` with NVFP4 operands quantized along K, float32 accumulation (forward only).

  Args:
    a_MxK: left operand; K must be a multiple of 16.
    b_KxN: right operand.
    operand: how both operands are quantized (NVFP4, 1×16 blocks along K, round-to-nearest):
      ``terms=1``: one NVFP4 tensor per operand, one GEMM; ``terms=2``: two-term residual
      operands, 3 GEMMs (``Q1·P1 + Q1·P2 + Q2·P1``).

  Returns:
    The float32 product (up to summation order, what NVFP4 tensor cores compute).

  Raises:
    ValueError: an ``operand`` that is not NVFP4 in 1×16 blocks with round-to-nearest.

  Example:
    >>> y = nvfp4_dot(jnp.ones((16, 32)), jnp.ones((32, 8)), Operand(terms=2))
  """
  check_operand("nvfp4_dot: operand", operand, quantized=True)
  return _gemms(_terms(a_MxK, -1, operand), _terms(b_KxN, 0, operand), operand.terms, ((1,), (0,)))


def nvfp4_gram(x_MxK, operand: Operand = Operand()) -> jax.Array:
  """``x @ x.T`` with one NVFP4 quantization of ``x`` along K serving both operands (forward only).

  Args/Returns/Raises as ``nvfp4_dot``.
  """
  check_operand("nvfp4_gram: operand", operand, quantized=True)
  parts = _terms(x_MxK, -1, operand)
  return _gemms(parts, parts, operand.terms, ((1,), (1,)))


def _products(operand):
  """(matmul, gram, square of a symmetric matrix) for ``operand``."""
  if operand is not None and operand.quantized:
    gram = lambda x: nvfp4_gram(x, operand)
    return (lambda a, b: nvfp4_dot(a, b, operand)), gram, gram
  if operand is not None:
    mm = lambda a, b: jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                              preferred_element_type=jnp.float32)
  else:
    mm = lambda a, b: a @ b
  return mm, (lambda x: mm(x, x.T)), (lambda a: mm(a, a))


def newton_schulz(x_MxN, coeffs: Sequence[float] = MUON_COEFFS, steps: int = 5, *,
                  operand: Operand | None = NS_OPERAND, eps: float = 1e-8) -> jax.Array:
  """Orthogonalizes a matrix with ``steps`` quintic Newton–Schulz iterations.

  Complex matrices are orthogonalized as optax does (``A = X Xᴴ``), through their real
  representation ``[[Re X, -Im X], [Im X, Re X]]`` (2m×2n, a ring homomorphism that maps ``Xᴴ`` to
  the transpose), so every ``operand``, NVFP4 included, takes them: 8 times the real products.

  In NVFP4 the result is not continuous at the ulp level: a last-bit change of the input (another
  compiled program, another summation order) can move a quantized operand to its neighbouring code,
  and the result by ~5e-5 relative (float32 products: ~1e-6).

  Args:
    x_MxN: a 2-D array (any float dtype, computed in float32; complex in complex64).
    coeffs: the quintic's ``(a, b, c)``, used at every step.
    steps: number of iterations (an int, or an int array when it is a traced hyperparameter).
    operand: the operands of every matmul (module docstring): None (float32),
      ``Operand(format="bf16")`` (bfloat16) or an NVFP4 ``Operand`` (``NS_OPERAND``: two terms).
    eps: added to the Frobenius norm before normalizing.

  Returns:
    A float32 (complex64 for complex ``x``) array of the shape of ``x_MxN`` whose singular values are
    near 1 (roughly in [0.7, 1.2] for Muon's coefficients), with ``x``'s singular vectors (empty for
    an empty ``x``).

  Raises:
    ValueError: an ``operand`` Newton–Schulz does not take (``check_operand``), a matrix that is
      not 2-D, or ``coeffs`` that are not three numbers.

  Example:
    >>> x = jax.random.normal(jax.random.key(0), (64, 128))
    >>> y = newton_schulz(x, operand=Operand(terms=2))

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.
  """
  check_operand("newton_schulz: operand", operand)
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
    y = _iterate(jnp.block([[re, -im], [im, re]]), coeffs, steps, operand)
    x = lax.complex(y[:min(m, n), :max(m, n)], y[min(m, n):, :max(m, n)])
  else:
    x = _iterate(x, coeffs, steps, operand)
  return x.T if transposed else x


def _iterate(x, coeffs, steps, operand):
  """The iteration on a normalized float32 ``x`` with no more rows than columns."""
  m, n = x.shape
  mm, gram, square = _products(operand)
  a, b, c = (jnp.float32(v) for v in coeffs)

  def step(_, x):
    g = gram(x)
    return a * x + mm(b * g + c * square(g), x)

  if operand is not None and operand.quantized:
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
