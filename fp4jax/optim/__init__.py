"""optax transformations with NVFP4 optimizer states and NVFP4 Newton–Schulz.

- ``adamw_nvfp4`` / ``scale_by_adam_nvfp4``: AdamW whose moments are stored as NVFP4.
- ``state_nbytes``, ``state_sharding``: bytes of a state; shardings that follow the parameters.
"""

from fp4jax.optim._common import DEFAULT_MIN_SIZE, state_nbytes, state_sharding, stores_nvfp4
from fp4jax.optim.adam import (ScaleByAdamNvfp4State, adam_update_bound, adamw_nvfp4,
                               scale_by_adam_nvfp4)

__all__ = [
    "DEFAULT_MIN_SIZE",
    "ScaleByAdamNvfp4State",
    "adam_update_bound",
    "adamw_nvfp4",
    "scale_by_adam_nvfp4",
    "state_nbytes",
    "state_sharding",
    "stores_nvfp4",
]
