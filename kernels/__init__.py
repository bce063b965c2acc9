"""Pallas GPU kernels (Triton lowering), each beside its jnp reference; imported as ``fp4jax.kernels``.

Kernels know nothing of models. Every kernel has a pure-jnp reference path, a ``custom_vjp``, an
interpret-mode test on CPU and a CUDA lowering check on CPU (tests/), and a GPU comparison run on
the H200. Importing this package does not need a GPU.
"""
