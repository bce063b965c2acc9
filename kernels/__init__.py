"""Pallas GPU kernels (Triton lowering), imported as ``fp4jax.kernels``.

Kernels know nothing of models: each computes the numerics of a jnp reference path in the library
(``fp4jax.numerics`` holds the pieces they share), runs in interpret mode in the CPU tests, is
checked to lower to Triton for an H200 on the CPU, and is compared with the CPU on the GPU
(``tests/gpu``). A kernel that is differentiated has a ``custom_vjp``; the optimizer and loss
kernels are not differentiated. Importing this package does not need a GPU.
"""
