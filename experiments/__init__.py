"""Experiments: ml-collections configs (``configs/``), the launcher (``train``) and ``compare``.

The library never reads a ConfigDict: ``fp4jax.experiment.Experiment.from_config`` types one, once,
where it enters (``experiments.train.run``), into the ``Experiment`` that ``fp4jax.loop.train`` takes.
"""
