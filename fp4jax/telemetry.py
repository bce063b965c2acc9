"""Quantization telemetry: how far NVFP4 moves each tensor of a training step, per module.

``make_telemetry(model_cfg, recipe, opt_cfg, execution=...)`` returns a pure function
``(state, batch) -> {name: float32 scalar}`` over the train state of ``fp4jax.step`` and one batch. It runs the model's
forward and backward on the batch with the step's key (the train step's own rounding bits), records
the tensors that NVFP4 quantizes (the model is built with ``probe=True``: each projection's matmul
and each attention op record their operands under ``nnx.capture``, and the gradients of their
``nnx.Perturbation``s are their outputs' cotangents; a ``scan_layers`` model runs unrolled), and
measures for each ``x`` and its quantization
``x̂ = deq(Q(x))``::

  rel_err = ‖x̂ − x‖ / ‖x‖          snr_db = −20 · log10(rel_err)      (0 and inf when x = 0)

Each tensor is measured as the run quantizes it: by its operand spec (``fp4jax.quant.Operand``:
block, rounding, scale rule, terms) in the projection's ``MatmulConfig`` and the attention's
``AttentionConfig``; an operand the run leaves in BF16 (a BF16 run, or one operand of an ablation)
is measured with the default recipe's spec (``MatmulConfig.nvfp4()``, ``AttentionConfig.nvfp4()``):
what quantizing it would cost. Names are ``telemetry/<module>/<tensor>_{rel_err,snr_db}``::

  module                 tensor  x                                  Q (the defaults)
  blocks.{i}.attn.qkv,   w       the kernel (W_res with LoRA-SVD)   ``w``: 16×16 tiles (or 1×16 along
  blocks.{i}.attn.o,                                                K); the error is relative to the
  blocks.{i}.mlp.gate_up,                                           effective weight W_res + A·B
  blocks.{i}.mlp.down    x       the projection's input             ``x``: 1×16 along K
                         dy      the gradient of its output         ``dy_dgrad``: 1×16 along N, stochastic
                         dx      dy·Wᵀ                              the dgrad GEMM Q(dy)·Q(W)ᵀ
                         dw      xᵀ·dy                              the wgrad GEMM Q(H·x)ᵀ·Q(H·dy)
  blocks.{i}.attn        q, k    RoPE'd queries and keys            ``q``, ``k``: 1×16 along the head dim;
                                 (k smoothed with ``k_smooth``)
                         v       the values, where NVFP4            ``v``: 1×16 along the head dim
                         ds      the backward's dS, on the first    the op's ``AttentionConfig``:
                                 ``_ATTENTION_EXAMPLES`` sequences   ``fp4jax.analysis``'s
                         ds_dq,  dS·K and dSᵀ·Q from Q(dS)          ``ds_scale_error``, "tile" scope
                         ds_dk
                         p       the forward's P, on those          the op's q and k quantization
                                 sequences                          (``probs_error``)
                         p_hadamard  the same with q and k          ``hadamard=True`` (where the op
                                 Hadamard-rotated                   does not rotate; D a power of two)
  <parameter module>     mu, nu  Adam's m and √v of the update      as the run's ``AdamNvfp4Options``
                                 this batch makes                   store them (``encode_moment``)

Each projection's ``w``, ``x`` and ``dy`` (the tensors above, as 2-D matrices: the kernel K × N,
x tokens × K, dy tokens × N, all tokens of the batch) also get two shares of their energy, in [0, 1]
(``fp4jax.analysis``)::

  <tensor>_top16_energy   Σ_{i≤16} σᵢ² / Σ σᵢ²   the top 16 singular directions (≈ 16/min(M, N)
                                                 for a Gaussian matrix, 0.1 at 384 × 1152)
  <tensor>_mean_energy    T·‖μ‖² / ‖X‖²          the mean row μ (x, dy: the token mean, T tokens;
                                                 w: the mean over the K rows, the input dim)

``w`` there is the kernel that is quantized (W_res under LoRA-SVD). Each costs one float32 Gram
matrix and one eigendecomposition of its smaller side (≤ 2048 for the 20m model: ~0.5 s per call
on an H200 for its 72 matrices).

The Adam moments: NVFP4 storage keeps only x̂, so ``x`` is the float32 moment that the next update
computes (``m = b1·m̂_old + (1 − b1)·g``, ``√v = sqrt(b2·v̂_old + (1 − b2)·g²``, with this batch's
gradient clipped as the optimizer clips it), and the error is that of storing it with the run's
``AdamNvfp4Options`` (``fp4jax.optim.adam.encode_moment``: its rounding, dither, EDEN, mean-removed
rotated √v, preconditioner-space rounding; a stored moment read back as its codes decode). Float32
states, and a moment that the options keep float32, are measured as ``AdamNvfp4Options()`` would
store them (what NVFP4 storage would lose). Only leaves that the storage rule
stores as NVFP4 are measured; under ``scan_layers`` a moment's module is ``blocks.{a}-{b}``, the
run of stacked blocks a..b (one global scale covers the run). Muon's momentum is float32 and not
measured. The whole measurement is one jitted function, called at step 1 and every N steps
(``TrainConfig.telemetry_every``), outside the train step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import analysis, numerics, nvfp4
from fp4jax import quant as quant_lib
from fp4jax.layers import Dense, NVFP4Matmul
from fp4jax.execution import Execution
from fp4jax.loss import chunked_cross_entropy
from fp4jax.model import ModelConfig, Transformer
from fp4jax.ops import attention as attention_ops
from fp4jax.ops.matmul import MatmulConfig, nvfp4_matmul_vjp_reference
from fp4jax.optim.adam import MOMENTS, AdamNvfp4Options, decode_moment, encode_moment
from fp4jax.optim.state import stores_nvfp4
from fp4jax.quant import Operand
from fp4jax.recipe import Recipe
from fp4jax.sharding import BATCH_AXES

PREFIX = "telemetry/"
# The energy shares of each projection's w, x and dy: the top _TOP_K singular directions.
_TOP_K = 16
# dS telemetry materializes (B, H, T, T) scores: it looks at this many sequences of the batch.
_ATTENTION_EXAMPLES = 4
_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


def _projections(model: Transformer):
  """``(name, Dense)`` of every block projection, e.g. ``("blocks.3.mlp.down", dense)``."""
  for path, module in nnx.iter_modules(model):
    if isinstance(module, Dense) and path and path[0] == "blocks":
      yield ".".join(map(str, path)), module


def _attentions(model: Transformer):
  for i, block in enumerate(model.blocks):
    yield f"blocks.{i}.attn", block.attn


def _unstack(params, segments):
  """Parameters of a ``scan_layers`` model as those of the unrolled one (``blocks/{i}``)."""
  blocks = {}
  for j, (start, stop) in enumerate(segments):
    for i in range(start, stop):
      blocks[i] = jax.tree.map(lambda a, i=i - start: a[i], params["blocks"][j])
  return {**params, "blocks": blocks}


def _adam_states(opt_state):
  """The Adam states (``mu``, ``nu`` trees like the params) inside an optimizer state."""
  is_adam = lambda x: all(hasattr(x, f) for f in ("count", "mu", "nu"))
  return [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]


def _name(path, segments=None) -> tuple[str, str]:
  """(module, tensor prefix) of a parameter path: ``blocks.0.attn.qkv`` and ``""`` for its kernel,
  ``lora_a.`` for its LoRA factor. With ``segments`` (``scan_layers``), ``blocks/{j}`` is named
  after the blocks it stacks, ``blocks.0-3``."""
  keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
  if segments is not None and keys[0] == "blocks":
    start, stop = segments[keys[1]]
    keys[1] = f"{start}-{stop - 1}"
  leaf = keys[-1]
  return ".".join(map(str, keys[:-1])), "" if leaf in ("kernel", "embedding") else f"{leaf}."


def _matmul_config(dense: Dense) -> MatmulConfig:
  return dense.matmul.config if isinstance(dense.matmul, NVFP4Matmul) else MatmulConfig.nvfp4()


def _by_module(state) -> dict[str, dict]:
  """Captured variables (``nnx.capture``) as ``{module: {name: value}}``, e.g.
  ``{"blocks.0.attn.qkv": {"x": ...}}``."""
  out: dict = {}
  for path, var in nnx.to_flat_state(state):
    out.setdefault(".".join(map(str, path[:-1])), {})[path[-1]] = var.get_value()
  return out


def _measured(config, default, name: str) -> Operand:
  """The spec that ``name`` of ``config`` (a matmul's or attention's) is measured with: its own where it
  is NVFP4, else the default recipe's (what quantizing it would cost)."""
  op = getattr(config, name)
  return op if op.quantized else getattr(default, name)


def _attention_config(op) -> attention_ops.AttentionConfig:
  config = getattr(op, "config", None)
  return config if isinstance(config, attention_ops.AttentionConfig) else \
      attention_ops.AttentionConfig.nvfp4()


def make_telemetry(model_cfg: ModelConfig, recipe: Recipe, opt_cfg=None, *,
                   execution: Execution,
                   attention_examples: int = _ATTENTION_EXAMPLES) -> Callable:
  """The telemetry function of a run (module docstring): ``(state, batch) -> {name: scalar}``.

  Args:
    model_cfg, recipe: the run's model and recipe (``state["params"]`` is that model's pure dict).
    opt_cfg: the run's ``fp4jax.train.OptimizerConfig`` (Adam's ``b1``, ``b2`` and ``grad_clip``);
      None skips the Adam moments.
    execution: which code runs each op (the run's ``fp4jax.execution.Execution``).
    attention_examples: sequences of the batch that the dS telemetry looks at.

  Returns:
    A pure function of the train state ``{"step", "params", "opt_state", "rng"}`` and a batch
    ``{"inputs", "targets"}``, returning float32 scalars named ``telemetry/<module>/<metric>``
    (``<tensor>_{rel_err,snr_db}``, and ``<tensor>_{top16,mean}_energy`` of each projection's
    ``w``, ``x``, ``dy``; and ``telemetry/loss``, the batch's loss). Jit it (``jit_telemetry``).
  """
  cfg = dataclasses.replace(model_cfg, scan_layers=False, remat=False)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, recipe, rngs=nnx.Rngs(0), execution=execution,
                                                probe=True))
  graphdef, _ = nnx.split(abstract)
  # The moments as the run stores them; a run with float32 moments (or one float32 moment) is
  # measured as the default NVFP4 storage would store them.
  storage = recipe.moments if recipe.optimizer_states == "nvfp4" else AdamNvfp4Options()
  segments = abstract.segments
  hdim_ok = cfg.head_dim % nvfp4.BLOCK == 0  # the attention reference's head dims

  def loss_fn(model, inputs, targets, key):
    x_BxTxD = model.features(inputs, key=key)
    return chunked_cross_entropy(x_BxTxD, model.lm_head.kernel[...], targets,
                                 implementation=execution.cross_entropy)

  def forward(params, perturbations, inputs, targets, key):
    """Loss, recorded tensors (``nnx.Intermediate``) and zero perturbations of the probed model;
    ``perturbations`` (zeros, or None to make them) are added to the probed outputs."""
    if model_cfg.scan_layers:
      params = _unstack(params, segments)
    model = nnx.merge(graphdef, params)
    # Perturbation first: it is an Intermediate too.
    loss, zeros, seen = nnx.capture(loss_fn, nnx.Perturbation, nnx.Intermediate,
                                    init=perturbations)(model, inputs, targets, key)
    return loss, (seen, zeros)

  def telemetry(state, batch):
    params, inputs, targets = state["params"], batch["inputs"], batch["targets"]
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
    shapes = jax.eval_shape(lambda p: forward(p, None, inputs, targets, key)[1][1], params)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    loss, vjp, (seen, _) = jax.vjp(lambda p, z: forward(p, z, inputs, targets, key), params, zeros,
                                   has_aux=True)
    grads, dys = vjp(jnp.ones((), loss.dtype))
    seen, dys = _by_module(seen), _by_module(dys)
    base = jax.random.fold_in(key, 0x7E1E)
    keys = (jax.random.fold_in(base, i) for i in itertools.count())
    model = nnx.merge(graphdef, _unstack(params, segments) if model_cfg.scan_layers else params)
    quant, products, ds, probs, shares = _Jobs(), [], [], [], {}
    default, default_attn = MatmulConfig.nvfp4(), attention_ops.AttentionConfig.nvfp4()
    for name, dense in _projections(model):
      config = _matmul_config(dense)
      w = dense.kernel[...].astype(_F32)
      x = seen[name]["x"].reshape(-1, dense.in_features)
      dy = dys[name]["y"].reshape(-1, dense.out_features).astype(x.dtype)
      w_op, x_op, dy_op = (_measured(config, default, t) for t in ("w", "x", "dy_dgrad"))
      quant.add(f"{name}/w", _tiles(w) if w_op.block == (16, 16) else _rows(w, 0), w_op, next(keys),
                ref_norm=_norm(dense.effective_kernel()))
      quant.add(f"{name}/x", _rows(x, -1), x_op, next(keys))
      quant.add(f"{name}/dy", _rows(dy, -1), dy_op, next(keys))
      products.append((name, config, x, dense.kernel[...], dy, next(keys)))
      for t, a in (("w", w), ("x", x), ("dy", dy)):
        shares[f"{name}/{t}_top{_TOP_K}_energy"] = analysis.top_energy_share(a, _TOP_K)
        shares[f"{name}/{t}_mean_energy"] = analysis.mean_energy_share(a)
    for name, attn in _attentions(model):
      config = _attention_config(attn.attention_op)
      q, k, v = (seen[name][t] for t in ("q", "k", "v"))
      q_in, k_in = attention_ops.quantized_inputs(q, k, config)  # rotated, smoothed: what Q(·) sees
      quant.add(f"{name}/q", _rows(q_in, -1), _measured(config, default_attn, "q"), next(keys))
      quant.add(f"{name}/k", _rows(k_in, -1), _measured(config, default_attn, "k"), next(keys))
      if config.v.quantized:  # V in NVFP4 (an ablation: the method keeps it BF16)
        quant.add(f"{name}/v", _rows(v, -1), config.v, next(keys))
      if hdim_ok:
        n = min(attention_examples, inputs.shape[0])
        do = dys[name]["out"][:n].astype(q.dtype)
        ds.append((name, config, (q[:n], k[:n], v[:n], do, next(keys))))
        probs.append((name, config, (q[:n], k[:n], v[:n], next(keys))))
    moments = {}
    if opt_cfg is not None:
      moments = _moments(state["opt_state"], grads, opt_cfg, storage, next(keys),
                         segments if model_cfg.scan_layers else None)
    out = {PREFIX + "loss": loss.astype(_F32)}
    measured = {**quant.run(), **_run_products(products), **_run_ds(ds), **_run_probs(probs), **moments}
    for metric, (err, ref) in measured.items():
      rel = jnp.where(ref > 0, err / jnp.where(ref > 0, ref, 1.0), 0.0)
      out[f"{PREFIX}{metric}_rel_err"] = rel
      out[f"{PREFIX}{metric}_snr_db"] = -20.0 * jnp.log10(rel)
    out.update({PREFIX + k: v for k, v in shares.items()})
    return out

  return telemetry


# Every measurement is a pair (‖x̂ − x‖, ‖x‖). The quantizer error of a tensor's rows is measured
# in chunks of ``_CHUNK_ROWS`` rows, all tensors of one kind of measurement in one ``lax.map`` (XLA
# compiles each NVFP4 quantizer slowly: one program per kind, not one per tensor shape). A chunk
# quantizes as its tensor does: a head of ``_HEAD`` rows whose first value is the tensor's amax gives
# the chunk the tensor's global scale, and each block's codes depend only on the block and that
# scale, so the chunk's blocks come out as in the whole tensor (the head is left out of the error;
# zero rows that fill the last chunk quantize to 0 exactly). The head is 16 rows (one 16×16 tile, or
# sixteen 1×16 blocks) so that every chunk has a multiple of 16 rows (XLA:CPU compiles the quantizer
# slowly on other row counts). Memory is that of the tensors (as float32) plus one chunk.
_CHUNK_ROWS = 1 << 16
_HEAD = nvfp4.BLOCK


def _norm(x) -> jax.Array:
  return jnp.linalg.norm(jnp.asarray(x, _F32).ravel())


def _rows(x, axis: int):
  """``x`` as (blocks, 16) rows of its own dtype: each row one 1×16 block along ``axis``."""
  return jnp.moveaxis(jnp.asarray(x), axis, -1).reshape(-1, nvfp4.BLOCK)


def _tiles(w_KxN):
  """A (K, N) matrix as (tiles · 16, 16) rows: each run of 16 rows one 16×16 tile."""
  k, n = w_KxN.shape
  b = nvfp4.BLOCK
  return w_KxN.reshape(k // b, b, n // b, b).transpose(0, 2, 1, 3).reshape(-1, b)


def _pad_stack(arrays, shape):
  return jnp.stack([jnp.pad(a, [(0, s - d) for s, d in zip(shape, a.shape, strict=True)])
                    for a in arrays])


def _chunks(rows, chunk_rows: int):
  """``rows`` (n, 16) as float32 (chunks, _HEAD + chunk_rows, 16): zero rows fill the last chunk, and
  each chunk starts with ``_HEAD`` rows that are zero but for the tensor's amax in the first (NaN
  taken as inf, as the quantizer takes it)."""
  n, width = rows.shape
  count = max(1, -(-n // chunk_rows))
  body = jnp.pad(rows.astype(_F32), ((0, count * chunk_rows - n), (0, 0)))
  amax = jnp.max(jnp.where(jnp.isnan(rows), jnp.inf, jnp.abs(rows))) if n else 0.0
  first = jnp.arange(_HEAD * width).reshape(_HEAD, width) == 0
  head = jnp.where(first, jnp.asarray(amax, _F32), 0.0)
  return jnp.concatenate([jnp.broadcast_to(head, (count, _HEAD, width)),
                          body.reshape(count, chunk_rows, width)], axis=1)


class _Jobs:
  """Quantization-error measurements of (blocks, 16) rows, grouped by operand spec
  (``fp4jax.quant.Operand``: block, rounding, scale rule, terms).

  A two-term operand (``terms=2``) is measured as ``Q1 + Q2`` with ``Q2 = Q(a − deq(Q1))`` (the
  residual in float32 from the materialized first term, as ``quant.quantize_terms`` forms it): a
  first pass over the chunks finds each tensor's residual amax, which the second pass puts into each
  chunk's head, so the residual's global scale is the whole tensor's too (each pass quantizes Q1 of its
  chunk: the residuals are not kept, so memory stays that of one chunk).
  """

  def __init__(self, chunk_rows: int = _CHUNK_ROWS):
    self.groups: dict = {}
    self.chunk_rows = chunk_rows

  def add(self, metric: str, rows, operand: Operand, key, ref_norm=None):
    if not operand.quantized:
      raise ValueError(f"telemetry measures NVFP4 operands; {metric} is {operand!r}")
    self.groups.setdefault(operand, []).append((metric, rows, key, ref_norm))

  def run(self) -> dict:
    out = {}
    for op, jobs in self.groups.items():
      # Whole 16-row tiles per chunk; no more rows than the largest tensor needs.
      size = min(self.chunk_rows, max(r.shape[0] for _, r, _, _ in jobs))
      size = max(_HEAD, -(-size // _HEAD) * _HEAD)
      chunks = [_chunks(rows, size) for _, rows, _, _ in jobs]
      job = jnp.asarray(np.concatenate([np.full(c.shape[0], i) for i, c in enumerate(chunks)]))
      index = jnp.asarray(np.concatenate([np.arange(c.shape[0]) for c in chunks]))
      keys = jnp.stack([k for _, _, k, _ in jobs])
      stacked = jnp.concatenate(chunks)

      def terms(rows, key, amax2=None, op=op):
        """The chunk's terms (``quant.quantize_terms``), each the quantized tensor; the second with
        ``amax2``, the whole tensor's residual amax, in its head (its global scale), or ``amax2=None``:
        the residual itself, unquantized."""
        def q(a, t):
          if t == 1 and amax2 is None:
            return a
          if t == 1:
            a = a.at[0, 0].set(amax2)
          return nvfp4.quantize(a, block=op.block, axis=-1, rounding=op.rounding, scale_rule=op.scale_rule,
                                key=key if t == 0 else jax.random.fold_in(key, 1))
        return quant_lib.quantize_terms(rows, op.terms, q)

      amax2 = None
      if op.terms == 2:  # each tensor's residual amax: the global scale of its second term
        def residual_amax(a, keys=keys, terms=terms):
          rows, j, i = a
          r = terms(rows, jax.random.fold_in(keys[j], i))[1][_HEAD:]
          return jnp.max(jnp.where(jnp.isnan(r), jnp.inf, jnp.abs(r)))
        amax2 = jax.ops.segment_max(lax.map(residual_amax, (stacked, job, index)), job,
                                    num_segments=len(jobs))

      def one(a, op=op, keys=keys, terms=terms, amax2=amax2):
        rows, j, i = a
        x = rows[_HEAD:]
        parts = terms(rows, jax.random.fold_in(keys[j], i), None if amax2 is None else amax2[j])
        fq = functools.reduce(jnp.add, [t.dequantize(jnp.float32) for t in parts])
        err = fq[_HEAD:] - x
        return jnp.sum(jnp.square(err)), jnp.sum(jnp.square(x))

      errs, refs = lax.map(one, (stacked, job, index))
      bounds = np.cumsum([0] + [c.shape[0] for c in chunks])
      for i, (metric, _, _, ref_norm) in enumerate(jobs):
        lo, hi = bounds[i], bounds[i + 1]
        out[metric] = (jnp.sqrt(errs[lo:hi].sum()),
                       jnp.sqrt(refs[lo:hi].sum()) if ref_norm is None else ref_norm)
    return out


def _run_products(products) -> dict:
  """``dx`` and ``dw``: the dgrad and wgrad GEMMs of each projection from quantized operands
  (``nvfp4_matmul_vjp_reference``) against the exact float32 products."""
  out = {}
  for config in dict.fromkeys(c for _, c, *_ in products):
    jobs = [p for p in products if p[1] == config]
    m = jobs[0][2].shape[0]
    k = max(x.shape[1] for _, _, x, *_ in jobs)
    n = max(w.shape[1] for _, _, _, w, _, _ in jobs)
    xs = _pad_stack([x for _, _, x, *_ in jobs], (m, k))
    ws = _pad_stack([w for _, _, _, w, _, _ in jobs], (k, n))
    dys = _pad_stack([dy for *_, dy, _ in jobs], (m, n))

    def one(a, config=config):
      x, w, dy, key = a
      dx_q, dw_q = nvfp4_matmul_vjp_reference(x, w, dy, key=key, config=config)
      x32, w32, dy32 = x.astype(_F32), w.astype(_F32), dy.astype(_F32)
      dx = jnp.dot(dy32, w32.T, precision=_HIGHEST)
      dw = jnp.dot(x32.T, dy32, precision=_HIGHEST)
      return _norm(dx_q - dx), _norm(dx), _norm(dw_q - dw), _norm(dw)

    r = lax.map(one, (xs, ws, dys, jnp.stack([p[-1] for p in jobs])))
    for i, (name, *_) in enumerate(jobs):
      out[f"{name}/dx"] = (r[0][i], r[1][i])
      out[f"{name}/dw"] = (r[2][i], r[3][i])
  return out


def _run_ds(ds) -> dict:
  """``ds`` (and its products ``ds_dq``, ``ds_dk``): ``ds_scale_error``'s "tile" scope, the dS
  quantization of the attention op, per block."""
  out = {}
  for config in dict.fromkeys(c for _, c, _ in ds):
    jobs = [d for d in ds if d[1] == config]

    def one(a, config=config):
      q, k, v, do, key = a
      tile = analysis.ds_scale_error(q, k, v, do, key=key, config=config)["tile"]
      return tile["ds_rel"], tile["dq_rel"], tile["dk_rel"]

    args = tuple(jnp.stack(xs) for xs in zip(*(a for _, _, a in jobs), strict=True))
    r = lax.map(one, args)
    for i, (name, _, _) in enumerate(jobs):
      for j, metric in enumerate(("ds", "ds_dq", "ds_dk")):
        out[f"{name}/{metric}"] = (r[j][i], jnp.ones((), _F32))
  return out


def _run_probs(probs) -> dict:
  """``p``: the forward's P from the op's quantized q and k (``analysis.probs_error``), per block;
  ``p_hadamard``: the same with q and k Hadamard-rotated (``AttentionConfig.hadamard``), where the op
  does not rotate them and the head dim is a power of two: what the rotation would change."""
  out = {}
  for config in dict.fromkeys(c for _, c, _ in probs):
    jobs = [p for p in probs if p[1] == config]
    d = jobs[0][2][0].shape[-1]
    rotated = dataclasses.replace(config, hadamard=True)
    other = rotated if not config.rotates and rotated.rotates and not d & (d - 1) else None

    def one(a, configs=(config,) if other is None else (config, other)):
      q, k, v, key = a
      return analysis.probs_error(q, k, v, configs, key=key)

    args = tuple(jnp.stack(xs) for xs in zip(*(a for _, _, a in jobs), strict=True))
    r = lax.map(one, args)  # [jobs, configs]
    for i, (name, _, _) in enumerate(jobs):
      out[f"{name}/p"] = (r[i, 0], jnp.ones((), _F32))
      if other is not None:
        out[f"{name}/p_hadamard"] = (r[i, 1], jnp.ones((), _F32))
  return out


def _moments(opt_state, grads, opt_cfg, storage, key, segments) -> dict:
  """Adam's fresh ``m`` and ``√v`` (this batch's gradient, clipped as the optimizer clips it) of every
  leaf that NVFP4 storage applies to, stored as ``storage`` (``AdamNvfp4Options``) stores them
  (``fp4jax.optim.adam.encode_moment``, decoded by ``decode_moment``): ``{metric: (‖x̂ − x‖, ‖x‖)}``.
  A moment that ``storage`` keeps float32 is measured as ``AdamNvfp4Options()`` would store it.
  The i-th moment measured (leaves in order, m before √v) takes the key ``fold_in(key, i)``; leaves
  of one shape are measured in one ``lax.map``."""
  if opt_cfg.grad_clip > 0:
    norm = optax.tree.norm(grads)
    scale = jnp.where(norm < opt_cfg.grad_clip, 1.0, opt_cfg.grad_clip / norm)
    grads = jax.tree.map(lambda g: g * scale, grads)
  b1, b2 = opt_cfg.b1, opt_cfg.b2
  is_q = lambda x: isinstance(x, nvfp4.NVFP4Tensor)
  options = {w: storage if getattr(storage, w) is not None else AdamNvfp4Options() for w in MOMENTS}
  groups: dict = {}
  for state in _adam_states(opt_state):
    count = optax.safe_increment(state.count)  # the step that writes the fresh moments
    mus = jax.tree_util.tree_flatten_with_path(state.mu, is_leaf=is_q)[0]
    nus = jax.tree.leaves(state.nu, is_leaf=is_q)
    for (path, mu), nu in zip(mus, nus, strict=True):
      if not (is_q(mu) or is_q(nu) or stores_nvfp4(mu.shape, storage.min_size)):
        continue
      g = _at(grads, path).astype(_F32)
      # A stored moment as its codes decode (a dithered one without its offsets: they need the
      # optimizer's seed and leaf order).
      m_old = mu.dequantize(_F32) if is_q(mu) else mu
      v_old = jnp.square(nu.dequantize(_F32)) if is_q(nu) else nu
      m, v = numerics.adam_moments(m_old, v_old, g, b1, b2, numerics.runtime_zero(count))
      s = numerics.sqrt_rn(v)
      module, prefix = _name(path, segments)
      for which, x in (("mu", m), ("nu", s)):
        index = sum(map(len, groups.values()))  # the moment's key: fold_in(key, index)
        groups.setdefault((which, x.shape), []).append((f"{module}/{prefix}{which}", x, count, index))
  out = {}
  for (which, _), jobs in groups.items():
    opts = options[which]

    def one(a, which=which, opts=opts):
      x, count, k = a
      zero = numerics.runtime_zero(count)
      c2 = numerics.bias_factors(b1, b2, 0.0, count)[2]
      t = encode_moment(x, which, opts, k, zero, c2=c2, eps=opt_cfg.eps)
      err = decode_moment(t, which, opts, k) - x
      return jnp.sum(jnp.square(err)), jnp.sum(jnp.square(x))

    keys = jnp.stack([jax.random.fold_in(key, index) for *_, index in jobs])
    errs, refs = lax.map(one, (jnp.stack([x for _, x, _, _ in jobs]),
                               jnp.stack([c for _, _, c, _ in jobs]), keys))
    for i, (metric, *_) in enumerate(jobs):
      out[metric] = (jnp.sqrt(errs[i]), jnp.sqrt(refs[i]))
  return out


def _at(tree, path):
  for k in path:
    tree = tree[getattr(k, "key", getattr(k, "idx", k))]
  return tree


def jit_telemetry(model_cfg: ModelConfig, recipe: Recipe, opt_cfg, shardings, mesh, *,
                  execution: Execution) -> Callable:
  """``make_telemetry`` jitted with the train state's shardings (not donated) and the batch split
  over the mesh's batch axes; the outputs are replicated."""
  fn = jax.jit(make_telemetry(model_cfg, recipe, opt_cfg, execution=execution),
               in_shardings=(shardings, {k: NamedSharding(mesh, P(BATCH_AXES, None))
                                         for k in ("inputs", "targets")}),
               out_shardings=NamedSharding(mesh, P()))

  def run(state, batch):
    with jax.set_mesh(mesh):
      return fn(state, batch)

  return run


def measure(telemetry: Callable, state, batch) -> dict[str, float]:
  """Runs ``telemetry`` and waits for it: its values as floats, plus ``telemetry_time_s`` (the
  call's wall time, compilation included on the first call)."""
  start = time.perf_counter()
  values = {k: float(v) for k, v in jax.device_get(telemetry(state, batch)).items()}
  values["telemetry_time_s"] = time.perf_counter() - start
  return values
