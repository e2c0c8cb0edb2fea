"""The CPU kernel's instruction-set paths (cc/kernels/cpu/cpu_isa.h): avx512_amx (bfloat16 products on AMX tiles)
where the CPU has AMX-BF16, avx512_bf16 (bfloat16 products through vdpbf16ps, with AVX512F/BW/VL and AVX512_BF16)
where it has AVX512_BF16 and no AMX-BF16, AVX-512 where it has AVX512F, AVX2 otherwise; TF_FLASH_CPU_ISA=avx2 /
avx512 / avx512_amx forces one up to what the CPU has, avx512_bf16 wherever the CPU has it. Run the file again under
TF_FLASH_CPU_ISA=avx512_bf16 (or avx512) to hold that path's in-process cases on a CPU whose default is another.

- build_info() names the path taken;
- each AVX-512 object exports only its plain functions (no COMDAT the linker could hand an AVX2 caller), and
  in the library no function outside tf_flash::cpu_avx512 / cpu_avx512bf16 touches a zmm register (runs on
  any machine), none outside cpu_avx512bf16 holds vdpbf16ps (runs without AVX512_BF16), and none but its AMX
  functions an AMX instruction;
- the micro-kernels against scalar references (tests/cpu_harness/avx512_kernels_test.cc and
  avx512bf16_kernels_test.cc, compiled here);
- the op on the path this process runs against the float64 reference: head dims 32/64/128, lengths off the
  tiles, causal, masks, GQA, dropout, softcap, float32/float16/bfloat16, forward and gradients; the backward's
  determinism; this path against each narrower one run in a child process (the bfloat16 products against the
  float32 ones, and both against AVX2); and the AMX path, in a child process, against the reference.
The cases that need a feature the CPU lacks skip, saying which.
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
AVX512BF16_SOURCE = os.path.join(REPO, "cc", "kernels", "cpu", "flash_attention_avx512bf16.cc")
# cc/BUILD's _AVX512_COPTS and _AVX512BF16_COPTS (less TF's flags, which these files do not need: they include
# no TF header).
AVX512_FLAGS = ["-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-Wno-uninitialized",
                "-Wno-maybe-uninitialized"]
AVX512BF16_FLAGS = AVX512_FLAGS + ["-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
# Each AVX-512 file by the namespace of the only functions it may export: (source, flags, namespace).
AVX512_OBJECTS = {"avx512": (AVX512_SOURCE, AVX512_FLAGS, "tf_flash::cpu_avx512::"),
                  "avx512bf16": (AVX512BF16_SOURCE, AVX512BF16_FLAGS, "tf_flash::cpu_avx512bf16::")}
# The paths, narrowest first (cpu_isa.h: CpuIsa).
PATHS = ["avx2", "avx512", "avx512_bf16", "avx512_amx"]


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_FLAGS = _cpu_flags()
HAS_AVX512 = "avx512f" in _FLAGS
HAS_AVX512_BF16 = HAS_AVX512 and {"avx512bw", "avx512vl", "avx512_bf16"} <= _FLAGS
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="the CPU has no AVX512F: only the AVX2 path runs here")
HAS_AMX_BF16 = HAS_AVX512_BF16 and {"amx_tile", "amx_bf16"} <= _FLAGS
needs_avx512_bf16 = pytest.mark.skipif(
    not HAS_AVX512_BF16, reason="the CPU lacks AVX512_BF16 (or AVX512BW/VL): the bfloat16 dot products cannot run here")
needs_amx_bf16 = pytest.mark.skipif(not HAS_AMX_BF16, reason="the CPU lacks AMX-TILE / AMX-BF16: the AMX path cannot "
                                                             "run here")


def _default_path():
    if HAS_AMX_BF16:
        return "avx512_amx"  # (where Linux grants the tile state, as every kernel since 5.16 does)
    if HAS_AVX512_BF16:
        return "avx512_bf16"
    return "avx512" if HAS_AVX512 else "avx2"


def test_build_info_names_the_path_taken():
    default = _default_path()
    forced = os.environ.get("TF_FLASH_CPU_ISA")
    expected = default
    if forced == "avx512_amx":
        expected = "avx512_amx" if HAS_AMX_BF16 else default  # (Linux may refuse the tile state: then the default)
    elif forced == "avx512_bf16":
        expected = "avx512_bf16" if HAS_AVX512_BF16 else default
    elif forced in PATHS and PATHS.index(forced) < PATHS.index(default):
        expected = forced
    assert tf_flash.build_info()["cpu_isa"] == expected


# ----------------------------------------------------------------------------------------------------------
# The ODR safeguard: AVX-512 code only in the functions only the AVX-512 path calls
# ----------------------------------------------------------------------------------------------------------

def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"no {name} on this machine")
    return path


def _avx512_object(tmp_path, which):
    """An AVX-512 object as the build compiles it: the one tools/gpu.sh host made, else compiled here."""
    source, flags, _ = AVX512_OBJECTS[which]
    name = os.path.basename(source)[:-len(".cc")] + ".o"
    carried = os.path.join(REPO, ".gpu_build", "obj", name)
    if os.path.exists(carried):
        return carried
    obj = tmp_path / name
    subprocess.run([_tool("g++"), *flags, f"-I{REPO}", "-c", source, "-o", str(obj)], check=True)
    return str(obj)


@pytest.mark.parametrize("which", sorted(AVX512_OBJECTS))
def test_avx512_object_exports_only_its_plain_functions(tmp_path, which):
    obj = _avx512_object(tmp_path, which)
    namespace = AVX512_OBJECTS[which][2]
    listing = subprocess.run([_tool("nm"), "-C", "--defined-only", obj], check=True, capture_output=True,
                             text=True).stdout
    symbols = [line.split(" ", 2)[1:] for line in listing.splitlines() if line.strip()]
    # Weak or unique symbols (W/w/V/v/u/i) are what the linker merges across objects: there must be none.
    weak = [name for kind, name in symbols if kind in "WwVvui"]
    assert not weak, f"weak symbols in the AVX-512 object (the linker may pick them for AVX2 callers): {weak}"
    exported = [name for kind, name in symbols if kind.isupper()]
    assert exported and all(name.startswith(namespace) for name in exported), exported


def test_library_touches_zmm_only_in_the_avx512_functions():
    library = tf_flash.build_info()["library"]
    listing = subprocess.run([_tool("objdump"), "-d", "--no-show-raw-insn", "-C", library], check=True,
                             capture_output=True, text=True).stdout
    users, bf16_users, amx_users, function = set(), set(), set(), None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
        elif function is not None:
            if "%zmm" in line:
                users.add(function)
            if re.search(r"\bv(dpbf16ps|cvtne2?ps2bf16)\b", line):
                bf16_users.add(function)
            if re.search(r"\b(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|tilerelease|tdp\w+)\b",
                         line):
                amx_users.add(function)
    for namespace in ("tf_flash::cpu_avx512::", "tf_flash::cpu_avx512bf16::"):
        assert any(namespace in name for name in users), f"no {namespace} code found in the library"
    # The bfloat16 instructions only where the AVX512_BF16 path alone calls (AVX512F machines lack them).
    assert bf16_users and all("tf_flash::cpu_avx512bf16::" in name for name in bf16_users), sorted(bf16_users)[:20]
    # AMX only in the AMX functions, which the AMX path alone calls.
    assert amx_users and all("tf_flash::cpu_avx512bf16::" in name and "mx" in name.lower() for name in amx_users), \
        sorted(amx_users)[:20]
    outside = sorted(name for name in users if not re.search(r"tf_flash::cpu_avx512(bf16)?::", name))
    # The CUDA build links cudart statically: report its functions, fail on any of ours, Eigen's or std's.
    ours = [name for name in outside if re.search(r"tf_flash|Eigen|std::|tensorflow|tsl::|absl", name)]
    if outside:
        print("zmm outside tf_flash::cpu_avx512 (not ours):", outside[:20])
    assert not ours, f"AVX-512 code outside the AVX-512 path: {ours[:20]}"


# ----------------------------------------------------------------------------------------------------------
# The micro-kernels against scalar references
# ----------------------------------------------------------------------------------------------------------

def _run_harness(tmp_path, which):
    """Compiles AVX512_OBJECTS[which] with its flags and tests/cpu_harness/<which>_kernels_test.cc (AVX2 flags:
    the harness itself is plain C++), runs it and returns its output."""
    compiler = _tool("g++")
    source, flags, _ = AVX512_OBJECTS[which]
    obj = tmp_path / "kernels.o"
    subprocess.run([compiler, *flags, f"-I{REPO}", "-c", source, "-o", str(obj)], check=True)
    exe = tmp_path / f"{which}_kernels_test"
    subprocess.run([compiler, "-std=c++17", "-O2", "-mavx2", "-mfma", f"-I{REPO}",
                    os.path.join(REPO, "tests", "cpu_harness", f"{which}_kernels_test.cc"), str(obj), "-o", str(exe)],
                   check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:]
    return run.stdout


@needs_avx512
def test_micro_kernels_against_scalar_references(tmp_path):
    _run_harness(tmp_path, "avx512")


@needs_avx512_bf16
def test_bf16_products_against_scalar_chains(tmp_path):
    _run_harness(tmp_path, "avx512bf16")


def test_harnesses_compile(tmp_path):
    """Where the CPU cannot run them, the harnesses and the AVX-512 files still compile (and link)."""
    compiler = _tool("g++")
    for which, (source, flags, _) in AVX512_OBJECTS.items():
        obj = tmp_path / f"{which}.o"
        subprocess.run([compiler, *flags, f"-I{REPO}", "-c", source, "-o", str(obj)], check=True)
        subprocess.run([compiler, "-std=c++17", "-O2", "-mavx2", "-mfma", f"-I{REPO}",
                        os.path.join(REPO, "tests", "cpu_harness", f"{which}_kernels_test.cc"), str(obj), "-o",
                        str(tmp_path / which)], check=True)


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
    # bfloat16: the products of the AVX512_BF16 path (P and dS rounded to bfloat16) where the CPU has it.
    "bf16_d32": (2, 77, 300, 4, 4, 32, "bfloat16", {}),
    "bf16_d128": (1, 130, 267, 2, 2, 128, "bfloat16", {}),
    "bf16_d64_mask": (2, 99, 141, 2, 2, 64, "bfloat16", {"attention_mask": "full"}),
    "bf16_d64_gqa_causal": (1, 200, 333, 4, 1, 64, "bfloat16", {"causal": True}),
    "bf16_d64_lengths_window": (2, 150, 170, 2, 2, 64, "bfloat16",
                                {"q_lengths": "q", "kv_lengths": "kv", "window": (40, 7)}),
    "bf16_d48_key_padding": (2, 65, 129, 2, 2, 48, "bfloat16", {"attention_mask": "rows"}),
    "bf16_d64_dropout": (2, 61, 280, 4, 2, 64, "bfloat16", {"dropout_rate": 0.2}),
    "bf16_d40_odd_lengths": (1, 131, 259, 2, 2, 40, "bfloat16", {"causal": True}),
    "bf16_d64_softcap": (1, 100, 290, 2, 2, 64, "bfloat16", {"softcap": 5.0}),
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
    inputs, ref_kwargs, results = _run_case(name)
    _check_against_reference(inputs, ref_kwargs, results)


def _check_against_reference(inputs, ref_kwargs, results):
    (q, k, v, dout), (out, lse, dq, dk, dv) = inputs, [np.asarray(x) for x in results]
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


@pytest.mark.parametrize("name", ["d64_gqa_causal", "bf16_d64_gqa_causal", "bf16_d64_dropout"])
def test_backward_is_deterministic(name):
    first = _run_case(name)[2]
    second = _run_case(name)[2]
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


def _child_results(tmp_path, isa, run=0):
    """CASES' results from a child process forced to the path `isa`, which it must have run."""
    path = tmp_path / f"{isa}_{run}.json"
    # The child computes on the CPU only (CUDA_VISIBLE_DEVICES: it takes no GPU memory beside this process).
    env = dict(os.environ, TF_FLASH_CPU_ISA=isa, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", _CHILD.format(tests=os.path.dirname(__file__), path=str(path))], env=env,
                   check=True, timeout=600)
    child = json.load(open(path))
    assert child["isa"] == isa, f"the child ran {child['isa']}, not {isa}"
    return child


@needs_amx_bf16
def test_amx_path_matches_reference(tmp_path):
    """The AMX path against the float64 reference, bfloat16 cases, in a child process forced to it (whatever
    TF_FLASH_CPU_ISA this process runs under); a second child's results are bit-equal (determinism)."""
    child = _child_results(tmp_path, "avx512_amx")
    again = _child_results(tmp_path, "avx512_amx", run=1)
    for name in CASES:
        if CASES[name][6] != "bfloat16":
            continue
        inputs, ref_kwargs, _ = _run_case(name)
        results = [np.asarray(x, np.float32) for x in child["results"][name]]
        _check_against_reference(inputs, ref_kwargs, results)
        for first, second in zip(results, again["results"][name]):
            np.testing.assert_array_equal(first, np.asarray(second, np.float32))


@needs_avx512
@pytest.mark.parametrize("narrower", ["avx2", "avx512", "avx512_bf16"])
def test_this_path_and_a_narrower_one_agree(tmp_path, narrower):
    mine = tf_flash.build_info()["cpu_isa"]
    if PATHS.index(mine) <= PATHS.index(narrower):
        pytest.skip(f"this process runs the {mine} path (TF_FLASH_CPU_ISA or the CPU), not wider than {narrower}")
    child = _child_results(tmp_path, narrower)
    for name in CASES:
        dtype = CASES[name][6]
        wide = _run_case(name)[2]
        for label, ours, theirs in zip(["out", "lse", "dq", "dk", "dv"], wide, child["results"][name]):
            ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
            np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
            finite = np.isfinite(ours)
            measure = "max_output" if label in ("out", "lse") else "max_gradient"
            assert max_error(ours[finite], theirs[finite]) <= tolerance(measure, dtype), f"{name} {label}"
