"""fp4jax.optim under jax.jit on the GPU equals the CPU: NVFP4 optimizer states bit for bit, and
NVFP4 Newton–Schulz really quantizes.

  FP4JAX_GPU_TESTS=1 python -m pytest -m gpu -s tests/gpu/test_optim_gpu.py

For fixed inputs and seeds, on the GPU and on the CPU backend of the same process:

1. ``nvfp4_dot`` / ``nvfp4_gram`` (one and two terms): GPU vs CPU within float32 accumulation
   tolerance, and the one-term error against the exact product ~0.13 (not the ~0.003 of bf16
   operands, which would mean XLA folded the quantization away);
2. ``newton_schulz(operand=Operand(terms=2))`` on each device against fp32 Newton–Schulz on the same device
   (distance <= 0.15) and its singular values. GPU and CPU are not compared with each other tightly:
   each step requantizes a product whose summation order differs by backend, and five steps make
   the two runs two equally valid roundings;
3. ``adamw_nvfp4`` after 3 updates, one jitted update per step (stochastic and nearest rounding; on
   the GPU the Pallas kernels with the default and another ``AdamKernelConfig``, and the XLA path),
   against the CPU's XLA path: packed codes, E4M3 scales and global scales bit for bit (at most 1e-5
   of the codes may flip), updates to 1e-5 of their max; the same for ``AdamNvfp4Options``' storage
   variants (m or √v alone in NVFP4, the mean-removed Hadamard-rotated √v with its bfloat16 means,
   leaves kept float32 by name, √v rounded in the preconditioner space, Four over Six, subtractive
   dither, EDEN-calibrated block scales);
4. ``muon_nvfp4`` after 2 updates: the AdamW side's codes as in 3, updates within 0.3 of their max
   (Newton–Schulz, as in 2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _check import devices, on, rel, table

from fp4jax import numerics, nvfp4, optim
from fp4jax.optim import _common
from fp4jax.quant import Operand

pytestmark = pytest.mark.gpu

MAX_FLIPS = 1e-5
# "head": 600 blocks of 16, so the kernels' last program is ragged.
SHAPES = {"embed": (1024, 256), "qkv": (256, 768), "down": (1024, 256), "head": (200, 48),
          "norm": (256,), "b": (768,)}
OTHER_LAUNCHES = optim.AdamKernelConfig(block_rows=32, stats_block_rows=64, atomic_slots=1,
                                        launch_group=1, evict_hints=False)
OPTIMIZERS = {
    "adamw_nvfp4 stochastic": (lambda: optim.adamw_nvfp4(1e-3), 1e-5, 3),
    "adamw_nvfp4 nearest": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
        mu=Operand(), nu=Operand())), 1e-5, 3),
    "adamw_nvfp4 stochastic, other launch settings": (
        lambda: optim.adamw_nvfp4(1e-3, block_sizes=OTHER_LAUNCHES), 1e-5, 3),
    "adamw_nvfp4 stochastic, XLA on the GPU too": (lambda: optim.adamw_nvfp4(1e-3, implementation="xla"), 1e-5, 3),
    "muon_nvfp4": (lambda: optim.muon_nvfp4(0.02, adam_options=optim.AdamNvfp4Options(min_size=0)),
                   0.3, 2),
    # AdamNvfp4Options' storage variants: one moment float32 (the kernels load and store it whole),
    # the centered √v (means, Hadamard butterflies in the kernels), embedding and head kept float32.
    "adamw_nvfp4 m only": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(nu=None)), 1e-5, 3),
    "adamw_nvfp4 v only": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(mu=None)), 1e-5, 3),
    "adamw_nvfp4 mean_hadamard": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
        nu_transform="mean_hadamard")), 1e-5, 3),
    "adamw_nvfp4 mean_hadamard nearest, keep_fp32 embed": (
        lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
            nu=Operand(), nu_transform="mean_hadamard", keep_fp32=("embed",))), 1e-5, 3),
    "adamw_nvfp4 mean_hadamard, XLA on the GPU too": (lambda: optim.adamw_nvfp4(
        1e-3, implementation="xla", options=optim.AdamNvfp4Options(nu_transform="mean_hadamard")), 1e-5, 3),
    "adamw_nvfp4 preconditioner-space SR": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
        nu_sr_space="preconditioner")), 1e-5, 3),
    "adamw_nvfp4 four over six (mse m, mae v)": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
        mu=Operand(scale_rule="4over6_mse"), nu=Operand(scale_rule="4over6_mae"))), 1e-5, 3),
    # Subtractive dither (the writing step's key decodes the state) and EDEN's calibrated scales.
    "adamw_nvfp4 dither (m and v)": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
        mu=Operand(), nu=Operand(), dither=("mu", "nu"))), 1e-5, 3),
    "adamw_nvfp4 eden (m and v)": (lambda: optim.adamw_nvfp4(1e-3, options=optim.AdamNvfp4Options(
        mu=Operand(), nu=Operand(), eden=("mu", "nu"))), 1e-5, 3),
}


def _is_q(x):
  return isinstance(x, nvfp4.NVFP4Tensor)


def product_rows(dev, cpu):
  rng = np.random.default_rng(0)
  a = rng.standard_normal((256, 1024)).astype(np.float32)
  b = rng.standard_normal((1024, 512)).astype(np.float32)
  exact = a.astype(np.float64) @ b
  rows, ok = [], True
  for terms in (1, 2):
    f = lambda a, b, t=terms: optim.nvfp4_dot(a, b, Operand(terms=t))
    g, c = on(dev, f, a, b), on(cpu, f, a, b)
    r, err = rel(g, c), rel(g, exact)
    lo, hi = (0.05, 0.2) if terms == 1 else (0.005, 0.03)
    good = r <= 1e-5 and lo <= err <= hi
    rows.append((f"nvfp4_dot terms={terms}", f"rel {r:.1e}; error vs exact {err:.3f}",
                 f"≤ 1e-5; error in [{lo}, {hi}]", good))
    ok &= good
  g, c = on(dev, optim.nvfp4_gram, a), on(cpu, optim.nvfp4_gram, a)
  good = rel(g, c) <= 1e-5
  rows.append(("nvfp4_gram", f"rel {rel(g, c):.1e}", "≤ 1e-5", good))
  x = rng.standard_normal((256, 768)).astype(np.float32)
  f = lambda x: (optim.newton_schulz(x, operand=Operand(terms=2)), optim.newton_schulz(x, operand=None))
  (g, g32), (c, c32) = on(dev, f, x), on(cpu, f, x)
  s = np.linalg.svd(g.astype(np.float64), compute_uv=False)
  good2 = rel(g, g32) <= 0.15 and rel(c, c32) <= 0.15 and 0.5 < s.min() and s.max() < 1.3
  rows.append(("newton_schulz nvfp4 256x768", f"to fp32: GPU {rel(g, g32):.3f}, CPU {rel(c, c32):.3f}; "
               f"GPU vs CPU {rel(g, c):.3f}; s in [{s.min():.3f}, {s.max():.3f}]",
               "to fp32 ≤ 0.15 each; s in (0.5, 1.3)", good2))
  # Information: the backend's sqrt against the correctly rounded one, on 4M normal inputs.
  x = rng.integers(0x00800000, 0x7F800000, 1 << 22, dtype=np.int64).astype(np.uint32).view(np.float32)
  differ = []
  for name, fn in (("jnp.sqrt", jnp.sqrt), ("sqrt_rn", numerics.sqrt_rn)):
    g, c = on(dev, fn, x), on(cpu, fn, x)
    differ.append(f"{name} {int(np.sum(g.view(np.uint32) != c.view(np.uint32)))}")
  rows.append(("f32 sqrt bits, 4M normal inputs", "; ".join(differ) + " differ", "(info)", True))
  return rows, ok and good and good2


def _inputs():
  rng = np.random.default_rng(1)
  params = {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in SHAPES.items()}
  grads = [{k: (rng.standard_normal(s) * 10.0 ** -rng.uniform(0, 4)).astype(np.float32)
            for k, s in SHAPES.items()} for _ in range(3)]
  return params, grads


def state_rows(dev, cpu, name, tx, params, grads, update_tol):
  """The states and updates of ``len(grads)`` updates on both devices, one jitted update per step
  (as a training loop runs it: XLA may optimize across the updates of one program)."""
  def run(device):
    step = lambda g, s, p: tx.update(g, s, p)
    p, state, us = params, on(device, tx.init, params), []
    for g in grads:
      u, state = on(device, step, g, state, p)
      p = optax.apply_updates(p, u)
      us.append(u)
    return us, state

  (ug, sg), (uc, sc) = run(dev), run(cpu)
  flips = n_codes = scale_flips = global_flips = 0
  for a, c in zip(jax.tree.leaves(sg, is_leaf=_is_q), jax.tree.leaves(sc, is_leaf=_is_q)):
    if _is_q(a):
      flips += int(np.sum(np.asarray(a.codes) != np.asarray(c.codes)))
      n_codes += int(np.asarray(a.codes).size)
      scale_flips += int(np.sum(np.asarray(a.scales).view(np.uint8) != np.asarray(c.scales).view(np.uint8)))
      if hasattr(a, "mean"):  # a centered √v: its bfloat16 block means count with the scales
        scale_flips += int(np.sum(np.asarray(a.mean).view(np.uint16) != np.asarray(c.mean).view(np.uint16)))
      ga, gc = (np.asarray(t.global_scale).reshape(-1).view(np.uint32) for t in (a, c))
      if np.any(ga != gc):
        global_flips += 1
        print(f"  {name}: global scale differs, leaf {a.shape}: GPU {ga.view(np.float32)} CPU "
              f"{gc.view(np.float32)} ({(ga.astype(np.int64) - gc.astype(np.int64)).tolist()} ulp)")
  worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(c)))) / (float(np.max(np.abs(c))) + 1e-30)
              for a, c in zip(jax.tree.leaves(ug), jax.tree.leaves(uc)))
  ok_codes = flips <= MAX_FLIPS * n_codes
  ok_scales = scale_flips <= MAX_FLIPS * n_codes and global_flips == 0
  ok_updates = worst <= update_tol
  rows = [(f"{name}: packed codes", f"{flips} / {n_codes} differ", f"≤ {MAX_FLIPS:g} of codes", ok_codes),
          (f"{name}: e4m3 scales / global scales", f"{scale_flips} / {global_flips} differ", "0 global",
           ok_scales),
          (f"{name}: updates", f"max diff {worst:.1e} of max |u|", f"≤ {update_tol:g}", ok_updates)]
  return rows, ok_codes and ok_scales and ok_updates


def diagnose(dev, cpu, name, tx, params, grads, b1=0.9, b2=0.95):
  """Information on a failure: the first update whose new global scales differ when both devices
  start from the same (CPU) state, and which intermediate of the XLA path's moment arithmetic first
  differs there, with its inputs."""
  state = on(cpu, tx.init, params)
  step = lambda g, s, p: tx.update(g, s, p)

  def moments(g, mu, nu, count):
    m_old, s_old = _common.decode(mu), _common.decode(nu)
    m, v = numerics.adam_moments(m_old, s_old * s_old, g, b1, b2, numerics.runtime_zero(count))
    return dict(m_old=m_old, s_old=s_old, m=m, v=v, s=numerics.sqrt_rn(v))

  for t, g in enumerate(grads, 1):
    (_, sg), (uc, sc) = on(dev, step, g, state, params), on(cpu, step, g, state, params)
    for key in sc[0].mu:
      for moment in ("mu", "nu"):
        a, c = getattr(sg[0], moment)[key], getattr(sc[0], moment)[key]
        if not _is_q(c) or np.asarray(a.global_scale).view(np.uint32) == np.asarray(c.global_scale).view(np.uint32):
          continue
        print(f"  {name}: update {t} from the same state: {moment} global scale of {key} differs")
        args = (g[key], state[0].mu[key], state[0].nu[key], np.int32(t))
        mg, mc = on(dev, moments, *args), on(cpu, moments, *args)
        for k in mg:
          idx = np.flatnonzero(mg[k].view(np.uint32).ravel() != mc[k].view(np.uint32).ravel())
          if len(idx):
            print(f"    {k}: {len(idx)} elements differ; first at {idx[0]}: GPU {mg[k].ravel()[idx[0]]!r} "
                  f"CPU {mc[k].ravel()[idx[0]]!r}; g {float(g[key].ravel()[idx[0]])!r}")
    params = optax.apply_updates(params, uc)
    state = sc


def test_nvfp4_products_and_newton_schulz():
  rows, ok = product_rows(*devices())
  text = table(("check", "GPU vs CPU", "bound / note", "pass"), rows)
  assert ok, text


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_states_equal_the_cpu(name):
  make, tol, n = OPTIMIZERS[name]
  dev, cpu = devices()
  params, grads = _inputs()
  rows, ok = state_rows(dev, cpu, name, make(), params, grads[:n], tol)
  text = table(("check", "GPU vs CPU", "bound / note", "pass"), rows)
  if not ok and name.startswith("adamw") and " only" not in name:
    diagnose(dev, cpu, name, make(), params, grads[:n])
  assert ok, text
