"""Helpers of the benchmark scripts: the profile's op classes, compile_time's compiler events and Triton
compile times, train_step's recipe specs."""


import math

import pytest
from conftest import run_with_triton_compiler

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
  from benchmarks.train_step import recipe_list, recipe_of
  from fp4jax.recipe import get_recipe

  assert recipe_of("fp4_linear") == get_recipe("fp4_linear")
  assert recipe_list("bf16,fp4_linear") == ["bf16", "fp4_linear"]
  specs = recipe_list("fp4_linear;fp4_linear:matmul.x.terms=2:matmul.w.terms=2")
  assert specs == ["fp4_linear", "fp4_linear:matmul.x.terms=2:matmul.w.terms=2"]
  two = recipe_of(specs[1]).matmul
  assert (two.x.terms, two.w.terms, two.w.block, two.dy_dgrad.terms) == (2, 2, (16, 16), 1)
  r = recipe_of("fp4_linear:matmul.rounding_bits=counter:matmul.hadamard=false:lora_rank=4")
  assert (r.matmul.rounding_bits, r.matmul.hadamard, r.lora_rank) == ("counter", False, 4)
  with pytest.raises(ValueError, match="not FIELD=VALUE"):
    recipe_of("fp4_linear:counter")
  with pytest.raises(ValueError, match="no_such_field"):
    recipe_of("fp4_linear:no_such_field=1")
  with pytest.raises(ValueError, match="rounding_bits"):
    recipe_of("fp4_linear:matmul.rounding_bits=philox")
  with pytest.raises(ValueError, match="hadamrd"):
    recipe_of("fp4_linear:matmul.hadamrd=false")


def test_train_step_times_each_phase_of_a_bf16_forward_tail():
  from benchmarks.train_step import phases
  from fp4jax.recipe import get_recipe

  assert phases(get_recipe("fp4_linear")) == [("", 1.0, get_recipe("fp4_linear"))]
  assert phases(get_recipe("bf16", bf16_fwd_last=0.2)) == [("", 1.0, get_recipe("bf16", bf16_fwd_last=0.2))]
  tail = get_recipe("fp4_linear_w1x16_4over6_fwd_bf16_last10")
  (a, wa, ra), (b, wb, rb) = phases(tail)
  assert (a, b, ra) == ("NVFP4 forward", "BF16 forward", tail) and math.isclose(wa + wb, 1.0)
  assert math.isclose(wb, 0.1) and not rb.matmul.fwd and rb.matmul.dgrad and rb.matmul.wgrad


@pytest.mark.slow
def test_triton_kernels_of_a_lowered_step():
  """`compile_time --lower-for=cuda --triton-compile`, first half: the Triton kernels come out of the
  step lowered for an H200, one per distinct IR and launch setting."""
  import argparse

  from benchmarks.compile_time import execution_of, lower_step, triton_kernels

  args = argparse.Namespace(scan=False, batch=2, seq=32, recipe_option=[])
  lowered, row = lower_step("cuda", "tiny", "fp4_linear", args, execution_of("pallas"))
  kernels = triton_kernels(lowered)
  assert 0 < len(kernels) <= row["triton_calls"] == sum(k["calls"] for k in kernels)
  assert {k["name"] for k in kernels} >= {"nvfp4_amax", "nvfp4_quantize_pairs", "nvfp4_quantize_slabs"}
  for k in kernels:
    assert "tt.func" in k["ir"] and k["ops"] > 0 and k["num_warps"] in (4, 8)
  assert len({(k["ir"], k["num_warps"], k["num_stages"]) for k in kernels}) == len(kernels)


@pytest.mark.slow
def test_triton_compile_of_kernels():
  """Second half: each kernel compiles for sm_90 with the triton package on the CPU (in a fresh
  process: another test module sets TRITON_INTERPRET, and Triton's interpreter cannot compile)."""
  pytest.importorskip("triton")
  run_with_triton_compiler("""
      import functools, jax, jax.numpy as jnp
      from benchmarks.compile_time import H200, compile_triton, triton_kernels
      from fp4jax.kernels import nvfp4_quantize
      mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
      f = jax.jit(functools.partial(nvfp4_quantize.quantize, decoded=True))
      with jax.sharding.use_abstract_mesh(mesh):
        lowered = f.trace(jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
      kernels = compile_triton(triton_kernels(lowered))
      assert [k["name"] for k in kernels] == ["nvfp4_amax", "nvfp4_quantize_pairs"], kernels
      assert all(k["compile_s"] > 0 for k in kernels)
      assert all(k["sass"] is None or k["sass"] > 10 for k in kernels), kernels
      print("ok")
  """)


def test_triton_compile_needs_lower_for():
  from benchmarks.compile_time import main

  with pytest.raises(SystemExit):
    main(["--triton-compile", "--runs=tiny:fp4_linear"])


def test_compile_time_recipe_options_are_checked_before_any_run(capsys):
  from benchmarks.compile_time import main

  with pytest.raises(SystemExit):
    main(["--tiny", "--runs=tiny:fp4_linear", "--recipe-option=matmul.no_such_field=1"])
  assert "no_such_field" in capsys.readouterr().err


def test_quantize_shape_argument():
  import argparse

  from benchmarks.quantize import shape_arg
  assert shape_arg("65536,768") == (65536, 768)
  for bad in ("768", "a,b", "48,100", "0,16"):
    with pytest.raises(argparse.ArgumentTypeError, match="--shape"):
      shape_arg(bad)


def test_sass_instructions_counts_instruction_lines():
  from benchmarks.compile_time import sass_instructions
  sass = ("Function:nvfp4_amax\n--:-:0:-:1\tLDC R1, c[0x0][0x28];\n--:-:1:-:1\tS2R R19, SR_TID.X;\n"
          "02:1:4:-:5\t@!P0 LDG.E R0, desc[UR6][R20.64];\n.L_x_0:\n")
  assert sass_instructions(sass) == 3


@pytest.mark.parametrize("script,flag", [("quantize", "--small"), ("attention", "--small"), ("gemm", "--small"),
                                         ("cross_entropy", "--tiny"), ("optim_update", "--small"),
                                         ("train_step", "--tiny"), ("profile_step", "--tiny")])
def test_gpu_benchmarks_refuse_their_full_size_on_the_cpu(script, flag, capsys):
  """On the CPU a GPU benchmark at its full size stops at once with one line naming its smoke-run flag
  (which still runs: the flag is the way through)."""
  import importlib
  main = importlib.import_module(f"benchmarks.{script}").main
  with pytest.raises(SystemExit) as e:
    main([])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.endswith(f"error: no GPU here (jax's backend is cpu): this benchmark's full size would take hours "
                      f"on a CPU; {flag} runs a small check of it here"), err
