"""Helpers of the benchmark scripts: the profile's op classes, compile_time's compiler events and Triton
compile times, train_step's recipe specs."""

import json

import pytest

from benchmarks.profile_step import kind_of


@pytest.mark.parametrize("name,kind", [
    ("nvfp4_quantize_pairs__7", "NVFP4 quantizer kernels"),
    ("nvfp4_quantize_slabs", "NVFP4 quantizer kernels"),
    ("nvfp4_amax__11", "NVFP4 quantizer kernels"),
    ("nvfp4_attention_dkdv", "attention kernels (Pallas)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention (cuDNN)"),
    ("nvjet_sm90_tss_256x96_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("gemm_fusion_dot_general_170", "GEMM"),
    ("input_transpose_fusion_13", "copy / transpose"),
    ("input_add_reduce_fusion_24", "reduction"),
    ("loop_add_fusion_12", "fusion (elementwise)"),
    ("softmax_xent", "other"),
])
def test_profile_kinds(name, kind):
  assert kind_of(name) == kind


def test_compile_events_name_xla_phases(tmp_path):
  """`compile_time --compile-profile`: XLA's own annotations of a compilation, longest first, without
  JAX's Python frames."""
  import jax
  import jax.numpy as jnp

  from benchmarks.compile_time import compile_events

  lowered = jax.jit(lambda x: jnp.sin(x) @ x.T).trace(jnp.ones((64, 64))).lower()
  with jax.profiler.trace(str(tmp_path)):
    lowered.compile()
  events = compile_events(str(tmp_path), 20)
  names = [n for n, _, _ in events]
  assert names and not any(n.startswith("$") for n in names)
  assert any("RunBackend" in n for n in names), names
  ms = [t for _, t, _ in events]
  assert ms == sorted(ms, reverse=True) and all(c >= 1 for _, _, c in events)


def test_train_step_recipe_specs():
  from benchmarks.train_step import recipe_of
  from fp4jax.recipe import get_recipe

  assert recipe_of("fp4_linear") == get_recipe("fp4_linear")
  r = recipe_of("fp4_linear:linear_rounding_bits=counter:linear_hadamard=false:lora_rank=4")
  assert (r.linear_rounding_bits, r.linear_hadamard, r.lora_rank) == ("counter", False, 4)
  with pytest.raises(ValueError, match="not FIELD=VALUE"):
    recipe_of("fp4_linear:counter")
  with pytest.raises(ValueError, match="no_such_field"):
    recipe_of("fp4_linear:no_such_field=1")
  with pytest.raises(ValueError, match="linear_rounding_bits"):
    recipe_of("fp4_linear:linear_rounding_bits=philox")


def test_triton_compile_of_a_lowered_step(tmp_path):
  """`compile_time --lower-for=cuda --triton-compile`: the Triton kernels come out of the lowered step
  (one per distinct IR and launch setting) and compile for sm_90 on the CPU with the triton package.
  In a fresh process: Triton's interpreter (another test module sets TRITON_INTERPRET) cannot compile."""
  import os
  import subprocess
  import sys

  pytest.importorskip("triton")
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  env["PYTHONPATH"] = os.pathsep.join(sys.path)
  r = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--lower-for=cuda", "--triton-compile",
                      "--runs=tiny:fp4_linear:pallas"], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  row = next(json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))
  assert row["ok"] and 0 < row["triton_kernels"] <= row["triton_calls"], row
  assert row["triton_compile_s"] > 0
  table = [line for line in r.stdout.splitlines() if line.startswith("| nvfp4_")]
  assert len(table) == row["triton_kernels"]
  assert {line.split("|")[1].strip() for line in table} >= {"nvfp4_amax", "nvfp4_quantize_pairs"}


def test_triton_compile_needs_lower_for():
  from benchmarks.compile_time import main

  with pytest.raises(SystemExit):
    main(["--triton-compile", "--runs=tiny:fp4_linear"])
