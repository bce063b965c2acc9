"""fp4jax: pretraining language models with every expensive part in NVFP4.

Modules: ``nvfp4`` (the format), ``ops`` (custom_vjp ops), ``layers`` (flax nnx), ``optim`` (optax
transforms), ``model``, ``recipe``, ``data``, ``train``. Pallas GPU kernels live in the repository's
``kernels/`` folder and are imported as ``fp4jax.kernels``.
"""

import importlib.util as _ilu
import pathlib as _pathlib
import sys as _sys

__version__ = "0.1.0"


def _map_source_kernels():
  # Installed packages get fp4jax.kernels from setup.py's package_dir. From a source tree (the repo
  # root on sys.path, as on the GPU machine), map <repo>/kernels to the same name.
  if "fp4jax.kernels" in _sys.modules:
    return
  src = _pathlib.Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
  if not src.exists() or (_pathlib.Path(__file__).resolve().parent / "kernels").exists():
    return
  spec = _ilu.spec_from_file_location("fp4jax.kernels", src, submodule_search_locations=[str(src.parent)])
  module = _ilu.module_from_spec(spec)
  _sys.modules["fp4jax.kernels"] = module
  spec.loader.exec_module(module)
  globals()["kernels"] = module


_map_source_kernels()
