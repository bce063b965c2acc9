"""optax transformations with NVFP4 optimizer states and NVFP4 Newton–Schulz.

- ``adamw_nvfp4`` / ``scale_by_adam_nvfp4``: AdamW whose moments are stored as NVFP4
  (``AdamNvfp4Options``: the storage knobs; ``AdamKernelConfig``: the GPU kernels' launch settings).
- ``muon_nvfp4`` / ``scale_by_muon_nvfp4``: Muon with NVFP4 Newton–Schulz.
- ``root`` / ``scale_by_root_nvfp4``: ROOT (shape-specific coefficients, outlier soft-thresholding).
- ``newton_schulz``, ``nvfp4_dot``, ``nvfp4_gram``: the orthogonalization and its forward-only NVFP4
  products.
- ``state_nbytes``, ``state_sharding``, ``stores_nvfp4``, ``is_state_leaf``: bytes of a state;
  shardings that follow the parameters; the storage rule; the ``is_leaf`` that pairs a state with a
  params-shaped tree (``fp4jax.optim.state``).

Error studies of these transformations (``orthogonality_error``) are in ``fp4jax.analysis``.

No transformation depends on a model, config or mesh; all take ``jax.ShapeDtypeStruct`` params in
``init``.
"""

from fp4jax.kernels.adam_nvfp4 import AdamKernelConfig
from fp4jax.optim.adam import (AdamNvfp4Options, ScaleByAdamNvfp4State, adam_update_bound,
                               adamw_nvfp4, scale_by_adam_nvfp4)
from fp4jax.optim.muon import (ScaleByMuonNvfp4State, default_muon_mask, muon_nvfp4,
                               scale_by_muon_nvfp4, scale_by_orthogonalized_momentum,
                               scale_by_shape)
from fp4jax.optim.ns import MUON_COEFFS, newton_schulz, nvfp4_dot, nvfp4_gram
from fp4jax.optim.root import ROOT_NS_COEFFS, root, root_coeffs, scale_by_root_nvfp4
from fp4jax.optim.state import (DEFAULT_MIN_SIZE, is_state_leaf, state_nbytes, state_sharding,
                                stores_nvfp4)

__all__ = [
    "DEFAULT_MIN_SIZE",
    "MUON_COEFFS",
    "ROOT_NS_COEFFS",
    "AdamKernelConfig",
    "AdamNvfp4Options",
    "ScaleByAdamNvfp4State",
    "ScaleByMuonNvfp4State",
    "adam_update_bound",
    "adamw_nvfp4",
    "default_muon_mask",
    "is_state_leaf",
    "muon_nvfp4",
    "newton_schulz",
    "nvfp4_dot",
    "nvfp4_gram",
    "root",
    "root_coeffs",
    "scale_by_adam_nvfp4",
    "scale_by_muon_nvfp4",
    "scale_by_orthogonalized_momentum",
    "scale_by_root_nvfp4",
    "scale_by_shape",
    "state_nbytes",
    "state_sharding",
    "stores_nvfp4",
]
