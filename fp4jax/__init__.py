"""fp4jax: pretraining language models with every expensive part in NVFP4.

Modules: ``nvfp4`` (the format), ``numerics`` (the bit-exact codecs and arithmetic shared with the
kernels), ``ops`` (custom_vjp ops), ``layers`` (flax nnx), ``optim`` (optax transforms), ``model``,
``recipe``, ``data``, ``train``. The Pallas GPU kernels live in the repository's top-level
``kernels/`` folder; ``fp4jax/kernels`` is a symbolic link to it, so they import as ``fp4jax.kernels``.
"""

__version__ = "0.1.0"
