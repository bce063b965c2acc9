"""Test-wide setup: 8 simulated CPU devices (sharding tests), float32 matmuls at full precision, and
the ``gpu`` marker (GPU checks: skipped on the CPU; ``FP4JAX_GPU_TESTS=1 pytest -m gpu`` on the GPU) and
the ``slow`` marker (notebooks, launcher subprocesses, interpret-mode kernels: ``pytest -m "not slow"``
is the fast tier).

XLA's CPU backend compiles without LLVM's optimizations (``--xla_backend_optimization_level=0``):
the suite's time is mostly XLA compiling small programs. The few programs whose run is the test's
time (exhaustive loops over every float32, 10,000-step scans) are compiled at XLA's default level
(``RUN_OPTIMIZED``, about 2-5x faster runs); the levels can differ in the last bits of XLA's
transcendental functions (e.g. the ``pow`` of Adam's bias correction), so a test compiles the sides it
compares alike."""

import os

ON_CPU = os.environ.get("FP4JAX_GPU_TESTS") != "1"
if ON_CPU:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache: one fresh folder per test session, never the user's ~/.cache
# (the launchers' default, ``$FP4JAX_CACHE``). On the CPU it is shared by the test processes and every
# process they start (launchers, study arms and notebook kernels read the JAX_* variables), and every
# program is kept, however fast it compiled: tests build the same programs again (a run stopped and
# resumed, the same quantize in another test or the other xdist worker) and load them instead.
if "FP4JAX_CACHE" not in os.environ:
  import atexit
  import shutil
  import tempfile
  os.environ["FP4JAX_CACHE"] = tempfile.mkdtemp(prefix="fp4jax-test-xla-cache-")
  atexit.register(shutil.rmtree, os.environ["FP4JAX_CACHE"], ignore_errors=True)
if ON_CPU:
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["FP4JAX_CACHE"])
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

if ON_CPU:  # also where a plugin imported jax before the variables above were set
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402

# ``jax.jit(f, compiler_options=RUN_OPTIMIZED)``: XLA's default CPU optimization level for one program.
RUN_OPTIMIZED = {"xla_backend_optimization_level": 3}
from jax.sharding import AbstractDevice, AbstractMesh  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the GPU machine with `pytest -m gpu`)")
  config.addinivalue_line("markers", "slow: seconds to minutes on the CPU (the fast tier is `pytest -m \"not slow\"`)")


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` are skipped unless a CUDA GPU is the default backend. On the GPU machine,
  run ``FP4JAX_GPU_TESTS=1 pytest -m gpu tests``: the variable keeps JAX off the forced CPU platform."""
  if not ON_CPU and jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (FP4JAX_GPU_TESTS=1 on the GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)

def run_with_triton_compiler(code: str, timeout: float = 300) -> None:
  """Runs Python ``code`` in a fresh process with this one's import path and without
  ``TRITON_INTERPRET`` (a test module sets it for Triton's interpreter, whose process cannot compile
  for a GPU); fails the test unless the process exits 0 and prints ``ok`` last."""
  import subprocess
  import sys
  import textwrap

  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  env["PYTHONPATH"] = os.pathsep.join(sys.path)
  r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                     timeout=timeout)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# An abstract H200 for CUDA lowering checks on the CPU: trace under
# ``jax.sharding.use_abstract_mesh(H200)`` and lower with ``lowering_platforms=("cuda",)``.
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=None, platform="gpu"))


@pytest.fixture
def triton_modules(monkeypatch):
  """The Triton (TTIR) modules lowered while the test runs, each checked by MLIR's verifier
  (Pallas itself does not verify; the verifier catches invalid IR such as bad pointer types)."""
  from jax._src.pallas.triton import lowering
  modules, original = [], lowering.lower_jaxpr_to_triton_module

  def verified(*args, **kwargs):
    result = original(*args, **kwargs)
    assert result.module.operation.verify()
    modules.append(str(result.module))
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", verified)
  return modules


class Preempted(Exception):
  """Raised by ``StopAfter``: the job was killed."""


class StopAfter:
  """A data iterator (grain's get_state/set_state) that dies after ``n`` batches: a preemption."""

  def __init__(self, it, n):
    self.it, self.n = it, n

  def __iter__(self):
    return self

  def __next__(self):
    if self.n == 0:
      raise Preempted()
    self.n -= 1
    return next(self.it)

  def get_state(self):
    return self.it.get_state()

  def set_state(self, state):
    self.it.set_state(state)


WORDS = "the king and the queen walk in the forest at night with a sword and a crown. "


def write_docs(folder, n: int, name: str = "doc_{i:02d}.txt"):
  """A folder corpus of ``n`` small documents of ``WORDS`` (each a little longer than the last)."""
  folder.mkdir()
  for i in range(n):
    (folder / name.format(i=i)).write_text(f"document {i}: " + WORDS * (20 + i))
  return folder


def write_pydoc_text(folder, n_docs: int = 20):
  """A folder corpus of real text: the first ``n_docs`` topics of CPython's own documentation
  (``pydoc_data.topics``, shipped with every Python), one ``.txt`` file each; returns the folder."""
  import pydoc_data.topics
  folder.mkdir(parents=True, exist_ok=True)
  for i, (name, body) in enumerate(sorted(pydoc_data.topics.topics.items())[:n_docs]):
    (folder / f"{i:03d}-{name}.txt").write_text(body)
  return folder


def tiny_config(settings, arg=None):
  """The ``tiny`` experiment config (``experiments/configs/tiny.py``, its ``arg``) with ``settings``
  (dotted keys, e.g. ``{"optimizer.learning_rate": 1e-3}``) set on it."""
  from experiments.configs import tiny
  cfg = tiny.get_config(arg)
  for key, value in settings.items():
    *path, leaf = key.split(".")
    node = cfg
    for p in path:
      node = node[p]
    node[leaf] = value
  return cfg


def state_type(tree):
  """An optimizer state's type as jit sees it: tree structure, and each array's shape and dtype."""
  import jax.numpy as jnp
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def run_updates(tx, params, grads, n: int, update=None):
  """``n`` steps of the optax transform ``tx`` from ``params`` with the gradients ``grads(params, step)``;
  ``update`` defaults to the jitted ``tx.update``. Returns the updates of each step, the last state and
  the state's type (``state_type``) at init and after each step."""
  import optax
  update = update or jax.jit(tx.update)
  state = tx.init(params)
  types, all_updates = [state_type(state)], []
  for step in range(n):
    updates, state = update(grads(params, step), state, params)
    types.append(state_type(state))
    all_updates.append(updates)
    params = optax.apply_updates(params, updates)
  return all_updates, state, types
