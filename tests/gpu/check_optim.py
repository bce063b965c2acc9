"""GPU check for fp4jax.optim: GPU-jit == CPU for the NVFP4 optimizer states, and NVFP4 Newton–Schulz
really quantizes on the GPU.

For fixed inputs and seeds, runs under jax.jit on the default backend (the H200) and on the CPU
backend in the same process, and compares:

1. ``nvfp4_matmul`` / ``nvfp4_gram`` (one and two terms): GPU vs CPU within f32 accumulation
   tolerance, and the one-term error against the exact product ~0.13 (not the ~0.003 of bf16
   operands, which would mean XLA folded the quantization away, DESIGN.md §5.1);
2. ``newton_schulz(precision="nvfp4")`` on each device against fp32 Newton–Schulz on the same
   device (distance <= 0.15; ~0.08 expected) and its singular values. GPU and CPU are not compared
   with each other tightly: each step requantizes a product whose f32 summation order differs by
   backend, a 1-ulp difference flips a code at a rounding boundary, and five steps make the two runs
   two equally valid roundings (~7% apart, measured on the H200);
3. ``adamw_nvfp4`` after 3 updates, one jitted update per step (stochastic and nearest rounding;
   on the GPU the Pallas kernels by default, the XLA path once more, and the kernels with
   ``amax="bound"``), against the CPU's XLA
   path: packed codes, E4M3 scales and
   global scales bit for bit (counts reported; at most 1e-5 of the codes may flip), updates to 1e-5
   of their max. The moments' products are rounded before each sum (``_common.rounded``; PTX
   ``mul.rn.f32`` in the kernels), so the
   GPU's FMA contraction cannot change their bits;
4. ``muon_nvfp4(quantize_mu=True)`` after 2 updates: momentum and AdamW-side codes as in 3 (they do
   not depend on Newton–Schulz), updates within 0.3 of their max (Newton–Schulz, as in 2).

On a CPU-only machine it compares CPU with CPU (checks the script itself). Exit code 1 on failure.

  python tests/gpu/check_optim.py        (from the repository root, with PYTHONPATH=.)
  python tests/gpu/check_optim.py --kernel-set EVICT_HINTS=1   (the kernels with other launch settings)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from _check import CPU, DEV, on, rel, report  # noqa: E402
from fp4jax import _fp32, nvfp4, optim  # noqa: E402
from fp4jax.kernels import adam_nvfp4 as adam_kernel  # noqa: E402
from fp4jax.optim import _common, adam, ns  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
MAX_FLIPS = 1e-5


def product_rows():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((256, 1024)).astype(np.float32)
  b = rng.standard_normal((1024, 512)).astype(np.float32)
  exact = a.astype(np.float64) @ b
  rows, ok = [], True
  for terms in (1, 2):
    f = lambda a, b, t=terms: ns.nvfp4_matmul(a, b, t)  # noqa: E731
    g, c = on(DEV, f, a, b), on(CPU, f, a, b)
    r, err = rel(g, c), rel(g, exact)
    lo, hi = (0.05, 0.2) if terms == 1 else (0.005, 0.03)
    good = r <= 1e-5 and lo <= err <= hi
    rows.append((f"nvfp4_matmul terms={terms}", f"rel {r:.1e}; error vs exact {err:.3f}",
                 f"≤ 1e-5; error in [{lo}, {hi}]", good))
    ok &= good
  g, c = on(DEV, ns.nvfp4_gram, a), on(CPU, ns.nvfp4_gram, a)
  good = rel(g, c) <= 1e-5
  rows.append(("nvfp4_gram", f"rel {rel(g, c):.1e}", "≤ 1e-5", good))
  x = rng.standard_normal((256, 768)).astype(np.float32)
  f = lambda x: (optim.newton_schulz(x, precision="nvfp4"), optim.newton_schulz(x, precision="fp32"))  # noqa: E731
  (g, g32), (c, c32) = on(DEV, f, x), on(CPU, f, x)
  s = np.linalg.svd(g.astype(np.float64), compute_uv=False)
  good2 = rel(g, g32) <= 0.15 and rel(c, c32) <= 0.15 and 0.5 < s.min() and s.max() < 1.3
  rows.append(("newton_schulz nvfp4 256x768", f"to fp32: GPU {rel(g, g32):.3f}, CPU {rel(c, c32):.3f}; "
               f"GPU vs CPU {rel(g, c):.3f}; s in [{s.min():.3f}, {s.max():.3f}]",
               "to fp32 ≤ 0.15 each; s in (0.5, 1.3)", good2))
  return rows, ok and good and good2


def sqrt_row(rng):
  """jnp.sqrt and fp4jax._fp32.sqrt_rn on the device against the CPU (information, not a verdict)."""
  x = rng.integers(0x00800000, 0x7F800000, 1 << 22, dtype=np.int64).astype(np.uint32).view(np.float32)
  out = []
  for name, f in (("jnp.sqrt", jnp.sqrt), ("sqrt_rn", _fp32.sqrt_rn)):
    g, c = on(DEV, f, x), on(CPU, f, x)
    out.append(f"{name} {int(np.sum(np.asarray(g).view(np.uint32) != np.asarray(c).view(np.uint32)))}")
  return ("f32 sqrt bits, 4M normal inputs", "; ".join(out) + " differ", "(info)", True)


def _is_q(x):
  return isinstance(x, nvfp4.NVFP4Tensor)


def state_rows(name, tx, params, grads, update_tol):
  def run(device):
    # One jitted update per step, as a training loop runs it. (With several updates in one jitted
    # program, one global scale of the 3-update run came back 1 ulp apart on the H200, while every
    # single update from the same state agreed: XLA optimizes across the updates of one program.)
    step = lambda g, s, p: tx.update(g, s, p)  # noqa: E731
    p, state, us = params, on(device, tx.init, params), []
    for g in grads:
      u, state = on(device, step, g, state, p)
      p = optax.apply_updates(p, u)
      us.append(u)
    return us, state

  (ug, sg), (uc, sc) = run(DEV), run(CPU)
  flips = n_codes = scale_flips = global_flips = 0
  for a, c in zip(jax.tree.leaves(sg, is_leaf=_is_q), jax.tree.leaves(sc, is_leaf=_is_q)):
    if _is_q(a):
      flips += int(np.sum(np.asarray(a.codes) != np.asarray(c.codes)))
      n_codes += int(np.asarray(a.codes).size)
      scale_flips += int(np.sum(np.asarray(a.scales).view(np.uint8) != np.asarray(c.scales).view(np.uint8)))
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


def _bits_differ(a, b):
  return np.flatnonzero(np.asarray(a, np.float32).view(np.uint32).ravel()
                        != np.asarray(b, np.float32).view(np.uint32).ravel())


def diagnose(name, tx, params, grads, b1=0.9, b2=0.95):
  """Finds the first update whose new global scales differ when both devices start from the same
  (CPU) state, and recomputes that update's moment arithmetic (as adam.py does it) on both devices,
  printing which intermediate first differs and its inputs. Information only."""
  state = on(CPU, tx.init, params)
  for t, g in enumerate(grads, 1):
    step = lambda g, s, p: tx.update(g, s, p)  # noqa: E731
    (_, sg), (uc, sc) = on(DEV, step, g, state, params), on(CPU, step, g, state, params)
    adam_g, adam_c, adam_in = sg[0], sc[0], state[0]
    for key in adam_c.mu:
      for moment in ("mu", "nu"):
        a, c = getattr(adam_g, moment)[key], getattr(adam_c, moment)[key]
        if not _is_q(c) or not len(_bits_differ(a.global_scale, c.global_scale)):
          continue
        print(f"  {name}: update {t} from the same state: {moment} global scale of {key} differs")

        def moments(g, mu, nu, count):  # _leaf_update's steps for the default sqrt transform
          to_stored, from_stored = adam._NU_TRANSFORMS["sqrt"]
          m_old, s_old = _common.decode(mu), _common.decode(nu)
          v_old = from_stored(s_old)
          m, v = _common.adam_moments(m_old, v_old, g, b1, b2, _common.runtime_zero(count))
          return dict(m_old=m_old, s_old=s_old, v_old=v_old, m=m, v=v, s=to_stored(v))

        args = (g[key], adam_in.mu[key], adam_in.nu[key], np.int32(t))
        mg, mc = on(DEV, moments, *args), on(CPU, moments, *args)
        for k in mg:
          idx = _bits_differ(mg[k], mc[k])
          if len(idx):
            i = idx[0]
            ins = {n: float(np.asarray(mc[n]).ravel()[i]) for n in ("m_old", "v_old", "s_old")}
            print(f"    {k}: {len(idx)} elements differ; first at {i}: GPU {np.asarray(mg[k]).ravel()[i]!r} "
                  f"CPU {np.asarray(mc[k]).ravel()[i]!r}; g {float(g[key].ravel()[i])!r}, {ins}")
        for k in ("m", "s"):
          print(f"    amax {k}: GPU {np.abs(mg[k]).max()!r} CPU {np.abs(mc[k]).max()!r}")
    params = optax.apply_updates(params, uc)
    state = sc


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernel-set", default=None, metavar="NAME=V[+NAME=V]",
                  help="run the kernels with these launch settings of fp4jax.kernels.adam_nvfp4 "
                       "(its SETTINGS), e.g. EVICT_HINTS=1+ATOMIC_SLOTS=64")
  args = ap.parse_args(argv)
  try:
    setting = adam_kernel.parse_settings(args.kernel_set) if args.kernel_set else {}
  except ValueError as e:
    ap.error(f"--kernel-set: {e}")
  with adam_kernel.settings(**setting):
    return _check(setting)


def _check(setting) -> int:
  print(f"device: {DEV.device_kind} ({DEV.platform}) vs {CPU.device_kind}; jax {jax.__version__}; "
        f"kernel settings {setting or 'default'}")
  rng = np.random.default_rng(1)
  # "head": 600 blocks of 16, so the Pallas update's last program is ragged (64 blocks per program
  # by default).
  shapes = {"embed": (1024, 256), "qkv": (256, 768), "down": (1024, 256), "head": (200, 48),
            "norm": (256,), "b": (768,)}
  params = {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in shapes.items()}
  grads = [{k: (rng.standard_normal(s) * 10.0 ** -rng.uniform(0, 4)).astype(np.float32)
            for k, s in shapes.items()} for _ in range(3)]
  rows, ok = product_rows()
  rows.append(sqrt_row(rng))
  for name, tx, tol, n in (
      ("adamw_nvfp4 stochastic", optim.adamw_nvfp4(1e-3), 1e-5, 3),
      ("adamw_nvfp4 nearest", optim.adamw_nvfp4(1e-3, rounding="nearest"), 1e-5, 3),
      ("adamw_nvfp4 stochastic, XLA on the GPU too", optim.adamw_nvfp4(1e-3, kernel="xla"), 1e-5, 3),
      ("adamw_nvfp4 stochastic, amax='bound'", optim.adamw_nvfp4(1e-3, amax="bound"), 1e-5, 3),
      ("muon_nvfp4 (NVFP4 momentum)", optim.muon_nvfp4(0.02, min_size=0, quantize_mu=True), 0.3, 2)):
    r, o = state_rows(name, tx, params, grads[:n], tol)
    rows, ok = rows + r, ok and o
    if not o and name.startswith("adamw"):
      diagnose(name, tx, params, grads[:n])
  return report(("check", "GPU vs CPU", "bound / note", "pass"), rows, ok)


if __name__ == "__main__":
  sys.exit(main())
