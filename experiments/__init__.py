"""Experiments: ml-collections configs (``configs/``), the launcher (``train``) and ``compare``.

The library never reads a ConfigDict: ``experiments.train.from_config`` turns one into the typed
arguments of ``fp4jax.train.train``.
"""
