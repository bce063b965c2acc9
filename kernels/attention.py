"""Flash attention forward and backward for NVFP4 attention: Pallas (Triton) kernels.

The kernels compute the numerics of ``fp4jax.ops.attention`` (its reference defines them) on
operands that the caller has already decoded:

- ``attention_fwd(q, k, v, *, causal, sm_scale, ...) -> (o, lse)``: per (batch, head, query block),
  a loop over key blocks (stopping at the diagonal when causal) with an online softmax in float32:
  ``S = dot(q, kᵀ) * sm_scale`` (bf16 operands, f32 accumulation), ``O = P·V`` with P in bf16,
  ``lse = m + log(l)``.
- ``attention_bwd(q, k, v, o, lse, do, *, causal, sm_scale, ds_rounding, key, ...) -> (dq, dk, dv)``:
  two kernels, one per key block (dK, dV) and one per query block (dQ), each recomputing
  ``P = exp(S - lse)`` with the forward's dot, ``dP = dO·Vᵀ``, ``δ = rowsum(dO ∘ O)``,
  ``dS = (P ∘ (dP - δ)) * sm_scale``; with ``ds_rounding`` set, dS is quantized to NVFP4 inside the
  tile (``quantize_ds``: 16×16 blocks, one float32 scale per ``ds_tile``) and the decoded dS is the
  bf16 operand of ``dQ = dS·K`` and ``dK = dSᵀ·Q``; ``dV = Pᵀ·dO``.

Layout: q ``[B, T, H, D]``, k and v ``[B, S, Hk, D]`` with ``H % Hk == 0`` (query head ``h`` reads
key/value head ``h // (H // Hk)``), D in {64, 128}, lse ``[B, H, T]`` float32. q and k are the
decoded NVFP4 operands ``nvfp4.dequantize(Q(q), bf16)`` (any bf16 array works).

dS quantization (``quantize_ds``): each ``ds_tile`` of the ``[T, S]`` dS matrix of one (b, h) is
quantized as a tensor of its own by ``nvfp4.quantize(tile, block=(16, 16))`` (TE's order: tile amax,
``S_enc = 2688 / amax``, E4M3 block scales, E2M1 codes), then decoded to bf16 as
``nvfp4.dequantize`` does (``code * scale * S_dec`` in float32). Stochastic rounding takes its bits
from ``ds_rounding_bits`` (a counter hash of (key, b, h, row, col)): the kernels and the reference
draw the same bits for any blocking.

Everything inside the kernels lowers to Triton for sm_90 (no float4 casts, integer E2M1/E4M3
encoding, correctly rounded division by PTX ``div.rn.f32``): see tests/test_kernels_attention.py for
the CPU-side CUDA lowering check.
"""

from __future__ import annotations

import jax


def ds_rounding_bits(key, b, h, n_heads, row, col):
  """uint32 stochastic-rounding bits of dS element (row, col) of batch ``b``, query head ``h``."""
  raise NotImplementedError


def quantize_ds(ds, *, ds_tile=(64, 64), bits=None) -> jax.Array:
  """dS ``[..., T, S]`` (float32) quantized per ``ds_tile`` and decoded to bf16 (the kernels' tile code)."""
  raise NotImplementedError


def attention_fwd(q, k, v, *, causal: bool, sm_scale: float, block_q: int | None = None,
                  block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, interpret: bool = False):
  """Flash attention forward: ``(o [B, T, H, D] q.dtype, lse [B, H, T] float32)``."""
  raise NotImplementedError


def attention_bwd(q, k, v, o, lse, do, *, causal: bool, sm_scale: float,
                  ds_rounding: str | None = None, key=None, ds_tile=(64, 64),
                  block_q: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  interpret: bool = False):
  """Flash attention backward: ``(dq, dk, dv)`` shaped and typed like q, k, v.

  ``ds_rounding``: None (dS in bf16), ``"nearest"`` or ``"stochastic"`` (NVFP4 dS; stochastic
  rounding needs ``key``, a jax.random key).
  """
  raise NotImplementedError
