"""Differentiable NVFP4 ops (``custom_vjp``), each beside its pure-jnp reference.

Error studies of these ops (``ds_scale_error``) are in ``fp4jax.analysis``.
"""

from fp4jax.ops.attention import (
    AttentionConfig,
    nvfp4_attention,
    nvfp4_attention_reference,
    nvfp4_attention_vjp_reference,
)
from fp4jax.ops.mixed import mixed_matmul, mixed_matmul_split, mixed_matmul_vjp_reference
from fp4jax.ops.matmul import (
    MatmulConfig,
    nvfp4_matmul,
    nvfp4_matmul_reference,
    nvfp4_matmul_vjp_reference,
)

__all__ = [
    "AttentionConfig",
    "nvfp4_attention",
    "nvfp4_attention_reference",
    "nvfp4_attention_vjp_reference",
    "MatmulConfig",
    "mixed_matmul",
    "mixed_matmul_split",
    "mixed_matmul_vjp_reference",
    "nvfp4_matmul",
    "nvfp4_matmul_reference",
    "nvfp4_matmul_vjp_reference",
]
