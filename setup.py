"""fp4jax: LLM pretraining with every expensive part in NVFP4, in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="fp4jax",
    version="0.1.0",
    description="Full-stack NVFP4 (4-bit) LLM pretraining in JAX: linear layers, optimizer states, "
    "Newton-Schulz and attention",
    python_requires=">=3.12",
    # fp4jax/kernels is a symbolic link to the top-level kernels/ folder (the Pallas GPU kernels), so
    # fp4jax.kernels is found, and packaged, like any subpackage.
    packages=find_packages(include=["fp4jax", "fp4jax.*", "experiments", "experiments.*"]),
    package_data={"fp4jax": ["corpora/*.json.xz"]},  # the pycode corpus's manifest
    install_requires=[
        "jax>=0.11.2,<0.12",
        "jaxlib>=0.11.2,<0.12",
        "flax>=0.12.10,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.4,<0.13",
        "chex>=0.1.92",
        "ml-collections>=1.1.0",
        "grain>=0.2.18,<0.3",
        "ml_dtypes>=0.5",
        "numpy>=2.0",
        "tensorboardX>=2.6",
        "rich>=13",
    ],
    extras_require={
        "bpe": ["tokenizers>=0.23"],
        # The native Triton quantizer (benchmarks.triton_quantize) on the GPU: jax-triton 0.3.1
        # fits triton 3.6 (which it pulls in) and needs a CUDA build of jaxlib.
        "triton": ["jax-triton==0.3.1"],
        # triton alone (no GPU, no jax-triton) runs the Triton peer's kernels in its CPU interpreter.
        "test": ["tokenizers>=0.23", "pytest>=8", "pytest-xdist>=3.6", "nbformat>=5.10", "nbclient>=0.10",
                 "ipykernel>=6", "matplotlib>=3.8",
                 "ruff>=0.6", "triton==3.6.0; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "notebooks": ["matplotlib>=3.8", "jupyter"],
    },
)
