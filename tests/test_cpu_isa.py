"""The CPU kernel's instruction-set paths (cc/kernels/cpu/cpu_isa.h): AVX-512 where the CPU has AVX512F,
AVX2 otherwise or with TF_FLASH_CPU_ISA=avx2.

- build_info() names the path taken;
- the AVX-512 object exports only its plain functions (no COMDAT the linker could hand an AVX2 caller), and
  in the library no function outside tf_flash::cpu_avx512 touches a zmm register (runs on any machine);
- the micro-kernels against scalar references (tests/cpu_harness/avx512_kernels_test.cc, compiled here);
- the op on the path this process runs (AVX-512 on such a machine) against the float64 reference: head dims
  32/64/128, lengths off the tiles, causal, masks, GQA, dropout, float32/float16/bfloat16, forward and
  gradients; and the AVX-512 path against the AVX2 path run in a child process.
The cases that need AVX-512 skip elsewhere.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import philox_ref
import tf_flash
from device_util import normal, random_qkv, run_flash, tolerance
from reference import draw_features, max_error, reference_attention, reference_attention_grad, standard_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX512_SOURCE = os.path.join(REPO, "cc", "kernels", "cpu", "flash_attention_avx512.cc")
# cc/BUILD's _AVX512_COPTS (less TF's flags, which this file does not need: it includes no TF header).
AVX512_FLAGS = ["-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-Wno-uninitialized",
                "-Wno-maybe-uninitialized"]


def _cpu_has_avx512f():
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


HAS_AVX512 = _cpu_has_avx512f()
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="the CPU has no AVX512F: only the AVX2 path runs here")


def test_build_info_names_the_path_taken():
    forced = os.environ.get("TF_FLASH_CPU_ISA") == "avx2"
    assert tf_flash.build_info()["cpu_isa"] == ("avx512" if HAS_AVX512 and not forced else "avx2")


# ----------------------------------------------------------------------------------------------------------
# The ODR safeguard: AVX-512 code only in the functions only the AVX-512 path calls
# ----------------------------------------------------------------------------------------------------------

def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"no {name} on this machine")
    return path


def _avx512_object(tmp_path):
    """The AVX-512 object as the build compiles it: the one tools/gpu.sh host made, else compiled here."""
    carried = os.path.join(REPO, ".gpu_build", "obj", "flash_attention_avx512.o")
    if os.path.exists(carried):
        return carried
    obj = tmp_path / "flash_attention_avx512.o"
    subprocess.run([_tool("g++"), *AVX512_FLAGS, f"-I{REPO}", "-c", AVX512_SOURCE, "-o", str(obj)], check=True)
    return str(obj)


def test_avx512_object_exports_only_its_plain_functions(tmp_path):
    obj = _avx512_object(tmp_path)
    listing = subprocess.run([_tool("nm"), "-C", "--defined-only", obj], check=True, capture_output=True,
                             text=True).stdout
    symbols = [line.split(" ", 2)[1:] for line in listing.splitlines() if line.strip()]
    # Weak or unique symbols (W/w/V/v/u/i) are what the linker merges across objects: there must be none.
    weak = [name for kind, name in symbols if kind in "WwVvui"]
    assert not weak, f"weak symbols in the AVX-512 object (the linker may pick them for AVX2 callers): {weak}"
    exported = [name for kind, name in symbols if kind.isupper()]
    assert exported and all(name.startswith("tf_flash::cpu_avx512::") for name in exported), exported


def test_library_touches_zmm_only_in_the_avx512_functions():
    library = tf_flash.build_info()["library"]
    listing = subprocess.run([_tool("objdump"), "-d", "--no-show-raw-insn", "-C", library], check=True,
                             capture_output=True, text=True).stdout
    users, function = set(), None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
        elif "%zmm" in line and function is not None:
            users.add(function)
    assert any("tf_flash::cpu_avx512::" in name for name in users), "no AVX-512 code found in the library"
    outside = sorted(name for name in users if "tf_flash::cpu_avx512::" not in name)
    # The CUDA build links cudart statically: report its functions, fail on any of ours, Eigen's or std's.
    ours = [name for name in outside if re.search(r"tf_flash|Eigen|std::|tensorflow|tsl::|absl", name)]
    if outside:
        print("zmm outside tf_flash::cpu_avx512 (not ours):", outside[:20])
    assert not ours, f"AVX-512 code outside the AVX-512 path: {ours[:20]}"


# ----------------------------------------------------------------------------------------------------------
# The micro-kernels against scalar references
# ----------------------------------------------------------------------------------------------------------

@needs_avx512
def test_micro_kernels_against_scalar_references(tmp_path):
    compiler = _tool("g++")
    obj = tmp_path / "kernels.o"
    subprocess.run([compiler, *AVX512_FLAGS, f"-I{REPO}", "-c", AVX512_SOURCE, "-o", str(obj)], check=True)
    exe = tmp_path / "avx512_kernels_test"
    subprocess.run([compiler, "-std=c++17", "-O2", "-mavx2", "-mfma", f"-I{REPO}",
                    os.path.join(REPO, "tests", "cpu_harness", "avx512_kernels_test.cc"), str(obj), "-o", str(exe)],
                   check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:]


# ----------------------------------------------------------------------------------------------------------
# The op on this process's path against the float64 reference, and the two paths against each other
# ----------------------------------------------------------------------------------------------------------

# name: (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, features). Lengths off the 128 x 256
# tiles and off the 16 lanes; the AVX-512 micro-kernels' every row count and column tail appears.
CASES = {
    "d32": (2, 77, 300, 4, 4, 32, "float32", {}),
    "d64_causal": (1, 300, 300, 2, 2, 64, "float32", {"causal": True}),
    "d128": (1, 130, 267, 2, 2, 128, "float32", {}),
    "d64_mask": (2, 99, 141, 2, 2, 64, "float32", {"attention_mask": "full"}),
    "d64_gqa_causal": (1, 200, 333, 4, 1, 64, "float32", {"causal": True}),
    "d64_lengths_window": (2, 150, 170, 2, 2, 64, "float32",
                           {"q_lengths": "q", "kv_lengths": "kv", "window": (40, 7)}),
    "d48_key_padding": (2, 65, 129, 2, 2, 48, "float32", {"attention_mask": "rows"}),
    "d64_dropout": (2, 61, 280, 4, 2, 64, "float32", {"dropout_rate": 0.2}),
    "d64_bfloat16": (1, 140, 270, 2, 2, 64, "bfloat16", {"causal": True}),
    "d32_float16": (1, 140, 270, 2, 2, 32, "float16", {}),
    "d64_softcap": (1, 100, 290, 2, 2, 64, "float32", {"softcap": 5.0}),
}


def _run_case(name):
    """(inputs, kwargs for the reference, [out, lse, dq, dk, dv]) of CASES[name], inputs from a fixed seed."""
    batch, sq, sk, heads, heads_kv, dim, dtype, features = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name) + 11)
    q, k, v = random_qkv(rng, batch, sq, sk, heads, heads_kv, dim, dtype=tf.as_dtype(dtype))
    dout = normal(rng, (batch, sq, heads, dim))
    kwargs = draw_features(rng, features, batch, sq, sk, heads)
    ref_kwargs = dict(kwargs)
    if kwargs.get("dropout_rate"):
        out, lse, rng_state, dq, dk, dv = run_flash(q, k, v, "/CPU:0", True, dout=dout, seed=[7, 3], **kwargs)
        ref_kwargs["keep_mask"] = philox_ref.keep_mask(int(rng_state[0]), int(rng_state[1]), batch, heads, sq, sk,
                                                       kwargs["dropout_rate"])
    else:
        out, lse, _, dq, dk, dv = run_flash(q, k, v, "/CPU:0", dout=dout, **kwargs)
    return (q, k, v, dout), ref_kwargs, [out, lse, dq, dk, dv]


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference(name):
    (q, k, v, dout), ref_kwargs, (out, lse, dq, dk, dv) = _run_case(name)
    dtype = q.dtype
    ref_out, ref_lse = reference_attention(q, k, v, **ref_kwargs)
    out_tol = tolerance("max_output", dtype)
    if dtype != tf.float32:  # at most 2x the error of same-dtype standard attention
        std_err = max_error(standard_attention(q, k, v, dtype=dtype.as_numpy_dtype, **ref_kwargs), ref_out)
        out_tol = max(out_tol, 2 * std_err)
    assert max_error(out, ref_out) <= out_tol
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=tolerance("lse", dtype))
    for grad_name, got, want in zip("qkv", (dq, dk, dv), reference_attention_grad(q, k, v, dout, **ref_kwargs)):
        assert max_error(got, want) <= tolerance("max_gradient", dtype), f"d{grad_name}: {max_error(got, want)}"


def test_backward_is_deterministic():
    first = _run_case("d64_gqa_causal")[2]
    second = _run_case("d64_gqa_causal")[2]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_cpu_isa, tf_flash
results = {{name: [x.astype(np.float32).tolist() for x in test_cpu_isa._run_case(name)[2]]
           for name in test_cpu_isa.CASES}}
json.dump(dict(isa=tf_flash.build_info()["cpu_isa"], results=results), open({path!r}, "w"))
"""


@needs_avx512
def test_avx512_and_avx2_paths_agree(tmp_path):
    if tf_flash.build_info()["cpu_isa"] != "avx512":
        pytest.skip("this process runs the AVX2 path (TF_FLASH_CPU_ISA=avx2)")
    path = tmp_path / "avx2.json"
    # The child computes on the CPU only (CUDA_VISIBLE_DEVICES: it takes no GPU memory beside this process).
    env = dict(os.environ, TF_FLASH_CPU_ISA="avx2", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", _CHILD.format(tests=os.path.dirname(__file__), path=str(path))], env=env,
                   check=True, timeout=600)
    child = json.load(open(path))
    assert child["isa"] == "avx2"
    for name in CASES:
        dtype = CASES[name][6]
        avx512 = _run_case(name)[2]
        for label, mine, theirs in zip(["out", "lse", "dq", "dk", "dv"], avx512, child["results"][name]):
            mine, theirs = np.asarray(mine, np.float32), np.asarray(theirs, np.float32)
            np.testing.assert_array_equal(np.isfinite(mine), np.isfinite(theirs))
            finite = np.isfinite(mine)
            measure = "max_output" if label in ("out", "lse") else "max_gradient"
            assert max_error(mine[finite], theirs[finite]) <= tolerance(measure, dtype), f"{name} {label}"
