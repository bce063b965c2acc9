"""How a run is executed: which code runs each op. Never part of what a run computes.

Every op with more than one implementation takes the same argument, ``implementation`` (the
matmul: ``execution``, a ``MatmulExecution`` whose ``implementation`` it is), with its value from
one vocabulary, ``IMPLEMENTATIONS``:

  auto              the op's fastest path where computations go (``fp4jax._platform.resolve``):
                    its Pallas kernel (or cuDNN) on a CUDA GPU, XLA elsewhere
  xla               jnp code that XLA compiles for any device (the reference numerics)
  pallas            the op's Pallas GPU kernels (Triton lowering; CUDA)
  pallas_interpret  those kernels in Pallas interpret mode (CPU tests of the kernels)
  cudnn             cuDNN's flash attention (``jax.nn.dot_product_attention``; BF16 attention only)

Each op accepts the subset its docstring names (``check`` raises for the others) and computes the
same numbers with each, up to float32 summation order where its docstring says so. Kernel launch
settings are not chosen here: each Pallas kernel takes one frozen ``BlockSizes`` dataclass of its
own module, with defaults tuned on the H200.

``MatmulExecution`` is the choice of one NVFP4 matmul (``fp4jax.ops.nvfp4_matmul``'s
``execution``, ``fp4jax.layers.NVFP4Matmul``'s field): its implementation, how its GEMMs multiply
and its quantizer kernels' amax pass (``AMAX_PASSES``).

``Execution`` gathers the choices of one training run (the ``execution`` section of an experiment
config: ``--config.execution.attention=xla``). A resumed run may change any of them: the run's
identity (``fp4jax.workdir.identity``) is its numerics — model, recipe, optimizer, data — and
holds nothing of this module.
"""

from __future__ import annotations

import dataclasses

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret", "cudnn")
KERNEL_IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")  # an op with Pallas kernels
_GEMMS = ("auto", "decoded", "scaled_matmul")  # how an NVFP4 GEMM multiplies
AMAX_PASSES = ("kernel", "xla")  # how the quantizer kernels' first pass forms an operand's amax


def check(where: str, implementation, supported=KERNEL_IMPLEMENTATIONS) -> str:
  """``implementation`` if ``supported`` (a subset of ``IMPLEMENTATIONS``) holds it, else a
  ``ValueError`` naming ``where`` (the op or config field) and the accepted values."""
  if implementation not in supported:
    raise ValueError(f"{where}: implementation must be one of {tuple(supported)}, got "
                     f"{implementation!r}")
  return implementation


@dataclasses.dataclass(frozen=True)
class MatmulExecution:
  """Which code runs one NVFP4 matmul (hashable, static; the same bits up to float32 summation
  order whatever it says).

  Attributes:
    implementation: which code quantizes: ``"xla"`` (``nvfp4.quantize``), ``"pallas"`` (the
      quantizer kernels of ``fp4jax.kernels.nvfp4_quantize``, CUDA), ``"pallas_interpret"`` (those
      kernels in interpret mode, for CPU tests) or ``"auto"`` (``fp4jax.ops.nvfp4_matmul`` says
      when it picks the kernels).
    gemm: how each quantized GEMM multiplies: ``"decoded"`` (operands decoded exactly
      to bf16, bf16 tensor cores: ``nvfp4.gemm``), ``"scaled_matmul"`` (``jax.nn.scaled_matmul``
      on FP4 tensor cores, compute capability >= 10.0: ``nvfp4.scaled_matmul_gemm``) or ``"auto"``
      (``scaled_matmul`` where the GPU has FP4 tensor cores, else ``decoded``).
    amax: with the quantizer kernels, how their first pass forms each operand's ``max|x|``
      (``AMAX_PASSES``): ``"kernel"`` (a Pallas kernel) or ``"xla"`` (an XLA reduction, so each
      operand is one Triton kernel).
  """

  implementation: str = "auto"
  gemm: str = "auto"
  amax: str = "kernel"

  def __post_init__(self):
    check("MatmulExecution.implementation", self.implementation)
    if self.gemm not in _GEMMS:
      raise ValueError(f"MatmulExecution.gemm must be one of {_GEMMS}, got {self.gemm!r}")
    if self.amax not in AMAX_PASSES:
      raise ValueError(f"MatmulExecution.amax must be one of {AMAX_PASSES}, got {self.amax!r}")


@dataclasses.dataclass(frozen=True)
class Execution:
  """Which code runs each op of a training step (hashable; none of it changes the numerics beyond
  float32 summation order).

  Attributes:
    matmul, gemm, amax: the NVFP4 projections' ``MatmulExecution`` (``matmul_execution``): its
      ``implementation``, ``gemm`` and ``amax``. BF16 projections are one ``jnp.dot``.
    attention: BF16 attention (``jax.nn.dot_product_attention``): ``auto`` (cuDNN on a CUDA GPU when
      the shapes allow it: bf16 compute, head_dim a multiple of 8 up to 128; else XLA), ``cudnn`` or
      ``xla``. NVFP4 attention (``fp4jax.ops.nvfp4_attention``): ``auto``, ``xla``, ``pallas`` or
      ``pallas_interpret``.
    cross_entropy: the loss's pass over each chunk's float32 logits (``fp4jax.loss``): ``auto``
      (the fused Pallas kernel on a CUDA GPU, else XLA), ``xla``, ``pallas`` or
      ``pallas_interpret``.
    optimizer: the NVFP4 AdamW update (``fp4jax.optim.scale_by_adam_nvfp4``): ``auto``, ``xla``,
      ``pallas`` or ``pallas_interpret``. A mesh that shards the optimizer state makes ``auto``
      ``xla`` (the kernels take whole leaves).
  """

  matmul: str = "auto"
  gemm: str = "auto"
  amax: str = "kernel"
  attention: str = "auto"
  cross_entropy: str = "auto"
  optimizer: str = "auto"

  def __post_init__(self):
    check("Execution.matmul", self.matmul)
    check("Execution.attention", self.attention, IMPLEMENTATIONS)
    check("Execution.cross_entropy", self.cross_entropy)
    check("Execution.optimizer", self.optimizer)
    if self.gemm not in _GEMMS:
      raise ValueError(f"Execution.gemm must be one of {_GEMMS}, got {self.gemm!r}")
    if self.amax not in AMAX_PASSES:
      raise ValueError(f"Execution.amax must be one of {AMAX_PASSES}, got {self.amax!r}")

  @property
  def matmul_execution(self) -> MatmulExecution:
    """The NVFP4 projections' ``MatmulExecution``: ``matmul``, ``gemm`` and ``amax``."""
    return MatmulExecution(self.matmul, self.gemm, self.amax)
