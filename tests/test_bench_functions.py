"""The benchmarks' timed functions compute what their FLOP counts claim (benchmarks/common.py make_fns): the
forward, and for forward+backward the gradients of q, k and v for a given output gradient dO, as torch's
out.backward(dout) does in the same tables. And benchmarks/plot.py writes each benchmark's result file, its figure
and its tables from a small made-up result. No timing asserts."""
import importlib.util
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from reference import reference_attention, reference_attention_grad

_SPEC = importlib.util.spec_from_file_location(
    "bench_common", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "common.py"))
common = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(common)


@pytest.mark.parametrize("impl", ["tf_flash", "tf_standard", "tf_standard_xla", "keras_mha"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_is_the_gradient_for_dout(impl, causal, rng):
    q, k, v, dout = (rng.standard_normal((2, 67, 3, 32)) for _ in range(4))  # 67: no multiple of a tile
    fwd, fwd_bwd = common.make_fns(impl, causal)
    with tf.device("/CPU:0"):
        args = [tf.constant(x, tf.float32) for x in (q, k, v, dout)]
        out, grads = fwd(*args), fwd_bwd(*args)
    ref_out, _ = reference_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, reference_attention_grad(q, k, v, dout, causal=causal)):
        np.testing.assert_allclose(grad.numpy(), ref, atol=5e-5, err_msg=name)


@pytest.mark.parametrize("impl", ["tf_flash", "keras_mha"])
def test_chained_calls_feed_each_output_to_the_next_query(impl, rng):
    """--calls-per-function: make_fns(chain=2) is attention(attention(q, k, v), k, v), gradients included (against
    TF's standard attention in float64)."""
    q, k, v, dout = (rng.standard_normal((2, 67, 3, 32)) for _ in range(4))
    with tf.device("/CPU:0"):
        fwd, fwd_bwd = common.make_fns(impl, True, chain=2)
        args = [tf.constant(x, tf.float32) for x in (q, k, v, dout)]
        out, grads = fwd(*args), fwd_bwd(*args)
        _, ref_fwd_bwd = common.make_fns("tf_standard", True, chain=2)
        ref_grads = ref_fwd_bwd(*(tf.constant(x, tf.float64) for x in (q, k, v, dout)))
    once, _ = reference_attention(q, k, v, causal=True)
    twice, _ = reference_attention(once, k, v, causal=True)
    np.testing.assert_allclose(out.numpy(), twice, atol=1e-5)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        np.testing.assert_allclose(grad.numpy(), ref.numpy(), atol=5e-5, err_msg=name)


def test_chained_calls_cast_outputs_back_to_the_query_dtype(monkeypatch):
    """A chain of fp8 calls (bfloat16 outputs) quantizes each output again for the next query: stood in for here by
    an attention whose output dtype differs from its query's (the fp8 forward runs on Hopper GPUs only)."""
    import tf_flash
    seen = []

    def attention(q, k, v, **unused):
        seen.append(q.dtype)
        return tf.cast(q, tf.float32) * 0.5 + tf.reduce_mean(tf.cast(v, tf.float32))

    monkeypatch.setattr(tf_flash, "flash_attention", attention)
    fwd, _ = common.make_fns("tf_flash", False, chain=3)
    with tf.device("/CPU:0"):
        q, k, v = (tf.fill([1, 4, 2, 8], 2.0) for _ in range(3))
        out = fwd(tf.cast(q, tf.float16), tf.cast(k, tf.float16), tf.cast(v, tf.float16), q)
    assert seen == [tf.float16] * 3 and out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), ((2.0 * 0.5 + 2.0) * 0.5 + 2.0) * 0.5 + 2.0)


_PLOT_SPEC = importlib.util.spec_from_file_location(
    "bench_plot", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "plot.py"))
plot = importlib.util.module_from_spec(_PLOT_SPEC)
_PLOT_SPEC.loader.exec_module(plot)
_INFO = {"date_utc": "2026-01-02 03:04 UTC", "gpus": ["NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"],
         "tensorflow": "2.21.0", "keras": "3.15.1", "tf_flash": "0.2.0", "torch": "2.11.0+cu130",
         "git_commit": "abc1234"}


def _fake_gpu():
    entries = []
    for impl, rate in (("tf_flash", 600.0), ("torch_cudnn", 500.0), ("torch_flash", 300.0)):
        for dim in (64, 128):
            for causal in (False, True):
                for batch, seqlen in ((2, 512), (1, 1024)):
                    scale = 0.5 if causal else 1.0
                    result = {m: {"median_s": 1e-3, "tflops": rate * scale * (0.7 if m == "fwd_bwd" else 1.0)}
                              for m in ("fwd", "fwd_bwd")}
                    entries.append({"kind": "speed", "impl": impl, "dtype": "bf16", "batch": batch, "seqlen": seqlen,
                                    "heads": 2048 // dim, "dim": dim, "causal": causal, "modes": ["fwd", "fwd_bwd"],
                                    "result": result})
        entries.append({"kind": "memory", "impl": impl, "dtype": "bf16", "batch": 1, "seqlen": 1024, "heads": 16,
                        "dim": 128, "causal": False, "modes": ["fwd_bwd"], "mem_set": "b1 h16 d128",
                        "result": {"peak_mb": 100.0}})
    return {"benchmark": "gpu", "info": _INFO, "command": "python benchmarks/bench_gpu.py --torch",
            "args": {"calls_per_function": 10, "hidden": 2048}, "entries": entries}


def _fake_model():
    def rec(mode, s, ms, peak, status="ok"):
        r = {"mode": mode, "seq_len": s, "batch": 1024 // s, "status": status, "jit_compile": True}
        if status == "ok":
            r.update(median_ms=ms, p10_ms=ms, p90_ms=ms, tokens_per_s=1e6, xla_used=True,
                     flash_op_in_graph="flash" in mode, first_step_s=1.0, peak_bytes=peak * 2**30)
        return r
    results = [rec("keras_mha_xla", 256, 20.0, 4.0), rec("keras_mha_xla", 512, 0, 0, "oom"),
               rec("flash_mha_xla", 256, 10.0, 2.0), rec("flash_mha_xla", 512, 15.0, 2.5)]
    return {"benchmark": "model", "info": dict(_INFO, device="GPU"), "command": "python benchmarks/bench_model.py",
            "config": {"blocks": 4, "width": 768, "heads": 12, "dtype": "mixed_bfloat16", "tokens_per_batch": 1024},
            "modes": ["keras_mha_xla", "flash_mha_xla"], "results": results}


def _fake_cpu():
    def main(impl, causal, s, gflops):
        stats = {"median_s": 0.1, "gflops": gflops, "peak_rss_mb": 500.0}
        return {"section": "main", "impl": impl, "causal": causal, "seqlen": s,
                "result": {"ok": True, "fwd": stats, "fwd_bwd": stats}}
    entries = [{"section": "matmul", "result": {"ok": True, "gflops": 130.0}}]
    entries += [main(i, c, s, g) for i, g in (("tf_flash", 120.0), ("tf_standard", 50.0)) for c in (False, True)
                for s in (512, 1024)]
    entries += [{"section": "sparse", "impl": "tf_flash", "causal": False, "seqlen": 1024, "pattern": p,
                 "result": {"ok": True, "fwd": {"median_s": t}, "fwd_bwd": {"median_s": 2 * t}}}
                for p, t in (("dense mask", 0.8), ("random 1/8", 0.1))]
    entries += [{"section": "dropout", "impl": "tf_flash", "causal": False, "seqlen": 1024, "rate": r,
                 "result": {"ok": True, "fwd": {"median_s": t}, "fwd_bwd": {"median_s": 2 * t}}}
                for r, t in ((0.0, 1.0), (0.1, 1.1))]
    return {"benchmark": "cpu", "info": {"date_utc": "2026-01-02 03:04 UTC", "cpu": "AMD EPYC", "cpu_count": 2},
            "command": "python benchmarks/bench_cpu.py", "args": {"block_size": 128},
            "shape": {"batch": 1, "heads": 8, "dim": 64}, "entries": entries}


def _fake_overhead():
    rows = [{"form": f, "backward": False, "ms": ms, "tflops": 100.0, "batch": 16, "seqlen": 1024, "causal": False,
             "dtype": "bfloat16"} for f, ms in (("floor", 0.5), ("fn_1", 0.6), ("fn_10", 0.4), ("xla_10", 0.4),
                                                 ("eager", 1.3))]
    return {"benchmark": "overhead", "info": _INFO, "command": "python benchmarks/bench_overhead.py", "heads": 16,
            "dim": 128, "calls": 10, "rows": rows}


def _fake_determinism():
    rows = [{"batch": 2, "seqlen": 4096, "heads": 16, "dim": 128, "causal": c, "dropout": 0.0, "atomics_ms": 5.0,
             "deterministic_ms": 6.0, "bit_identical": True, "family": "sm90"} for c in (False, True)]
    return {"benchmark": "determinism", "info": _INFO, "command": "python benchmarks/bench_determinism.py",
            "rows": rows}


@pytest.mark.parametrize("make, expected", [
    (_fake_gpu, ["bfloat16, head dim 128:", "| tf_flash | 600 / 420 | 600 / 420 |",
                 "| tf_flash / cuDNN | 1.20 / 1.20 |", "| tf_flash causal | 300 / 210 |"]),
    (_fake_model, ["| 256 x 4 | 20.0 ms | 10.0 ms (2.00x) | 4.00 / 2.00 |", "| 512 x 2 | out of memory | 15.0 ms |"]),
    (_fake_cpu, ["| tf_flash | 120 / 120 | 120 / 120 |", "| random 1/8 | 100 | 8.00 |", "10 |"]),
    (_fake_overhead, ["10 chained, XLA", "| 16 x 1024 | fwd | 0.500 | 0.600 (100) |"]),
    (_fake_determinism, ["| b2 s4096 h16 d128 | 5.00 | 6.00 | +20.0% | yes | sm90 |"]),
])
def test_plot_writes_the_result_and_its_figure(tmp_path, make, expected):
    """plot.save: the JSON as given and, with matplotlib, the figure beside it; plot.tables: the markdown that
    docs/performance.md shows, headed by the device and the date; plot.py's command line renders it again."""
    payload = make()
    path = str(tmp_path / "result.json")
    png = plot.save(payload, path)
    assert plot.load(path) == json.loads(json.dumps(payload))
    text = plot.tables(payload)
    assert text.startswith(f"Measured on {plot.device_name(payload['info'])}, 2026-01-02")
    for line in expected:
        assert line in text, text
    if importlib.util.find_spec("matplotlib") is None:
        assert png is None
        return
    assert png == str(tmp_path / "result.png") and os.path.getsize(png) > 10000
    os.remove(png)
    assert plot.main([path, "--tables"]) == 0 and os.path.getsize(png) > 10000


_SEG_SPEC = importlib.util.spec_from_file_location(
    "bench_segments", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                   "bench_segments.py"))
bench_segments = importlib.util.module_from_spec(_SEG_SPEC)
_SEG_SPEC.loader.exec_module(bench_segments)


def test_segments_flops_count_the_pairs_the_mask_lets_through():
    """bench_segments.py: the rows are filled exactly, a shorter row is a prefix of a longer one, and each case's
    FLOPs are 4 x dim x heads per (query, key) pair its mask lets through (x 3.5 forward+backward)."""
    lengths = bench_segments.document_lengths(1000, 60, seed=3)
    assert sum(lengths) == 1000 and min(lengths) >= 1
    assert bench_segments.document_lengths(3000, 60, seed=3)[:len(lengths) - 1] == lengths[:-1]
    ids = bench_segments.segment_ids(lengths)
    same = ids[:, None] == ids[None, :]
    below = np.tril(np.ones_like(same))
    for case, mask in (("segments_causal", same & below), ("mask_causal", same & below), ("causal", below),
                       ("segments_bidir", same)):
        assert bench_segments.case_flops(case, [lengths], 3, 8, "fwd") == 4 * 8 * 3 * mask.sum(), case
        assert bench_segments.case_flops(case, [lengths], 3, 8, "fwd_bwd") == 3.5 * 4 * 8 * 3 * mask.sum(), case


def test_segments_table_and_figure(tmp_path):
    stats = {"median_ms": 2.0, "median_s": 2e-3, "tflops": 100.0}
    records = [{"seqlen": 1024, "case": c, "status": "ok", "fwd": dict(stats, median_ms=ms), "fwd_bwd": stats,
                "memory": {"fwd": {"peak_bytes": 2**30}, "fwd_bwd": {"peak_bytes": 2**31}}}
               for c, ms in (("segments_causal", 1.0), ("mask_causal", 3.0), ("causal", 2.0))]
    records.append({"seqlen": 1024, "case": "segments_bidir", "status": "skipped: --time-limit"})
    payload = {"benchmark": "segments", "info": _INFO, "records": records,
               "config": {"seqlens": [1024], "cases": bench_segments.CASES, "mean_doc_len": 128, "batch": 1,
                          "heads": 2, "kv_heads": 2, "dim": 64, "dtype": "float32"},
               "documents": {"1024": {"lengths": [[512, 512]]}}}
    text = bench_segments.table(payload)
    assert "| 1k | segments_causal | 2 | 1.000 | 100 | 2.000 | 100 | 1.00 / 2.00 | 3.00 / 1.00 |" in text, text
    assert "| 1k | causal | 1 |" in text and "| 1k | segments_bidir | skipped: --time-limit |" in text, text
    png = bench_segments.write_outputs(str(tmp_path / "segments.json"), payload)
    assert json.load(open(tmp_path / "segments.json")) == payload
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(png) > 10000


_DEC_SPEC = importlib.util.spec_from_file_location(
    "bench_decode", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                 "bench_decode.py"))
bench_decode = importlib.util.module_from_spec(_DEC_SPEC)
_DEC_SPEC.loader.exec_module(bench_decode)


def test_decode_rows_lengths_and_bytes():
    """bench_decode.py: rows parse, the ragged fill stays in [S/2, S], K+V bytes count the valid keys once, and
    the bottom-right mask is the reference's."""
    rows = bench_decode.parse_rows("8x1@8k, 1x1@131072,8x8@32k")
    assert rows == [{"batch": 8, "new": 1, "cache": 8192}, {"batch": 1, "new": 1, "cache": 131072},
                    {"batch": 8, "new": 8, "cache": 32768}]
    assert bench_decode.row_label(rows[1]) == "1 x 1 @ 128k"
    ragged = bench_decode.kv_lengths(rows[0], "ragged", seed=3)
    assert ragged.min() >= 4096 and ragged.max() <= 8192 and len(set(ragged.tolist())) > 1
    assert (bench_decode.kv_lengths(rows[0], "full", seed=3) == 8192).all()
    assert bench_decode.kv_bytes(np.full(8, 32768), 8, 128, 2) == 8 * 32768 * 8 * 128 * 2 * 2
    from reference import element_mask
    lengths = np.array([5, 9])
    np.testing.assert_array_equal(bench_decode.bottom_right_visible(lengths, 3, 12),
                                  element_mask(2, 1, 3, 12, causal="bottom_right", kv_lengths=lengths)[:, 0])


def test_decode_fp8_runs_tf_flash_only():
    """bench_decode.py --dtype fp8: tf_flash's calls only, with K+V at 1 byte per element."""
    with pytest.raises(SystemExit, match="fp8 runs"):
        bench_decode.main(["--dtype", "fp8", "--impls", "tf_flash_xla,xla_dense"])
    assert bench_decode.ITEMSIZE[bench_decode.DTYPES["fp8"]] == 1


@pytest.mark.parametrize("new", [1, 3])
def test_decode_dense_attention_is_bottom_right_gqa(new, rng):
    """The dense XLA peer is the attention it stands for: GQA (query head h reads KV head h // group),
    bottom-right causal within kv_lengths."""
    q = rng.standard_normal((2, new, 4, 16))
    k, v = (rng.standard_normal((2, 40, 2, 16)) for _ in range(2))
    lengths = np.array([40, 23], np.int32)
    with tf.device("/CPU:0"):
        out = tf.function(bench_decode.dense_attention, jit_compile=True)(
            *(tf.constant(x, tf.float32) for x in (q, k, v)), tf.constant(lengths))
    ref, _ = reference_attention(q, k, v, causal="bottom_right", kv_lengths=lengths)
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-5)


def test_decode_table_and_figure(tmp_path):
    rows = [dict(r, lengths={"full": [8192] * 2, "ragged": [5000, 7000]}) for r in bench_decode.parse_rows("2x1@8k")]
    ok = {"status": "ok", "median_us": 100.0, "tbps": 1.5}
    records = [dict(ok, row=0, fill="full", impl="tf_flash", splits=1),
               dict(ok, row=0, fill="full", impl="tf_flash_xla", median_us=80.0, tbps=1.875, splits=8),
               dict(ok, row=0, fill="full", impl="keras_switch_xla", median_us=120.0, tbps=1.25),
               dict(ok, row=0, fill="full", impl="xla_dense", median_us=300.0, tbps=0.5),
               {"row": 0, "fill": "full", "impl": "torch_sdpa", "status": "skipped: no torch"},
               {"row": 0, "fill": "full", "impl": "check", "status": "ok", "max_abs_diff_vs_tf_flash_unsplit": 1e-3,
                "max_abs_diff_vs_xla_dense": 2e-3, "max_abs_diff_vs_keras_switch_xla": 5e-4}]
    payload = {"benchmark": "decode", "info": _INFO, "records": records,
               "config": {"rows": rows, "fills": ["full"], "heads": 8, "kv_heads": 2, "dim": 64,
                          "dtype": "bfloat16", "calls_per_function": 10}}
    text = bench_decode.table(payload)
    assert ("| 2 x 1 @ 8k | 100 us, 1.5 TB/s | 80 us, 1.88 TB/s | 120 us, 1.25 TB/s | 300 us, 0.5 TB/s | skipped: no "
            "torch | 1 run / 8 runs | 1.0e-03 | 2.0e-03 | 5.0e-04 |" in text), text
    png = bench_decode.write_outputs(str(tmp_path / "decode.json"), payload)
    assert json.load(open(tmp_path / "decode.json")) == payload
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(png) > 10000


_GEN_SPEC = importlib.util.spec_from_file_location(
    "bench_generate", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                   "bench_generate.py"))
bench_generate = importlib.util.module_from_spec(_GEN_SPEC)
_GEN_SPEC.loader.exec_module(bench_generate)


def test_generate_param_count_cases_and_token_comparison():
    """bench_generate.py: the parameter formula is KerasHub's count (a tiny LlamaBackbone from config), the
    cases run shorter prompts first and per prompt "on", "prefill_only", "no_attention", "off", and the token
    comparison finds the first difference."""
    keras_hub = pytest.importorskip("keras_hub")
    config = dict(bench_generate.QUICK, num_layers=3, vocabulary_size=97)
    assert keras_hub.models.LlamaBackbone(**config).count_params() == bench_generate.llama_param_count(**config)
    assert bench_generate.llama_param_count(**bench_generate.MODEL) == 1_104_218_112
    assert bench_generate.parse_prompts("32k, 4096") == [32768, 4096]
    assert bench_generate.case_order([32768, 4096], ["off", "on"]) == [[4096, "on"], [4096, "off"], [32768, "on"],
                                                                       [32768, "off"]]
    assert bench_generate.case_order([4096], ["off", "no_attention", "prefill_only", "on"]) == [
        [4096, "on"], [4096, "prefill_only"], [4096, "no_attention"], [4096, "off"]]
    assert bench_generate.compare_tokens([1, 2, 3], [1, 2, 3]) == {"identical": True, "equal_tokens": 3,
                                                                   "first_difference": None}
    assert bench_generate.compare_tokens([1, 5, 3, 7], [1, 2, 3, 4]) == {"identical": False, "equal_tokens": 2,
                                                                         "first_difference": 1}
    assert bench_generate.compare_tokens(None, [1])["identical"] is None


def test_generate_table_and_figure(tmp_path):
    ok = {"status": "ok", "new_tokens": 256, "generated": 256, "tokens": [5] * 256, "compile_first_s": 40.0}
    records = [dict(ok, prompt=4096, mode="on", tokens_per_s=128.0, generate_s=2.0, prefill_s=0.4,
                    decode_tokens_per_s=160.0, peak_bytes=3 * 2**30),
               dict(ok, prompt=4096, mode="off", tokens_per_s=64.0, generate_s=4.0, peak_bytes=6 * 2**30,
                    prefill_status="skipped: --time-limit"),
               dict(ok, prompt=32768, mode="on", tokens_per_s=100.0, generate_s=2.56, prefill_s=0.56,
                    decode_tokens_per_s=128.0, peak_bytes=4 * 2**30),
               dict(ok, prompt=32768, mode="prefill_only", tokens_per_s=50.0, generate_s=5.12, prefill_s=0.56,
                    decode_tokens_per_s=64.0, peak_bytes=4 * 2**30, tokens=[5] * 255 + [6]),
               dict(ok, prompt=32768, mode="no_attention", tokens_per_s=150.0, generate_s=1.7, prefill_s=0.56,
                    decode_tokens_per_s=160.0, peak_bytes=4 * 2**30, tokens=[7] * 256),
               {"prompt": 32768, "mode": "off", "status": "OOM"}]
    payload = {"benchmark": "generate", "info": _INFO, "records": records,
               "config": {"prompts": [4096, 32768], "modes": ["on", "prefill_only", "no_attention", "off"],
                          "new_tokens": 256,
                          "model": bench_generate.MODEL, "param_count": 1_104_218_112, "dtype": "bfloat16"}}
    payload["comparisons"] = bench_generate.compare(payload)
    assert payload["comparisons"][0] == {"prompt": 4096, "identical": True, "equal_tokens": 256,
                                         "first_difference": None, "speedup": 2.0, "decode_speedup": None,
                                         "prefill_only": {"identical": None, "equal_tokens": None,
                                                          "first_difference": None}, "attention_share": None}
    assert payload["comparisons"][1]["decode_speedup"] == 2.0
    assert payload["comparisons"][1]["attention_share"] == pytest.approx(0.2)
    text = bench_generate.table(payload)
    assert "| 4k | on | 128.0 | 2.00x | 2.00 s | 0.40 s | 160.0 | - | 40.00 s | 3.00 GiB | - |" in text, text
    assert "| 4k | off | 64.0 | - | 4.00 s | skipped: --time-limit | - | - | 40.00 s | 6.00 GiB | yes |" in text, text
    assert "| 32k | on | 100.0 | - | 2.56 s | 0.56 s | 128.0 | 2.00x |" in text, text
    assert "| 32k | prefill_only | 50.0 | - | 5.12 s | 0.56 s | 64.0 | - | 40.00 s | 4.00 GiB | no: 255/256 equal, " \
           "first at 255 |" in text, text
    assert "| 32k | no_attention | 150.0 | - | 1.70 s | 0.56 s | 160.0 | - | 40.00 s | 4.00 GiB | - |" in text, text
    assert "| 32k | off | OOM |" in text, text
    png = bench_generate.write_outputs(str(tmp_path / "generate.json"), payload)
    assert json.load(open(tmp_path / "generate.json")) == payload
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(png) > 10000


_PAR_SPEC = importlib.util.spec_from_file_location(
    "bench_parallel", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                   "bench_parallel.py"))
bench_parallel = importlib.util.module_from_spec(_PAR_SPEC)
_PAR_SPEC.loader.exec_module(bench_parallel)


def test_parallel_ratios_within_a_gpu_kind_and_figure(tmp_path):
    """bench_parallel.py: FLOP/s per GPU against one GPU of the same kind at the same tokens per GPU; runs of
    another kind get no ratio; the summary line and the figure hold every run."""
    def run(device, gpus, tokens, tflops, **extra):
        return dict({"device": device, "gpus": gpus, "tokens_per_gpu": tokens, "tokens": gpus * tokens,
                     "status": "ok", "median_ms": 100.0, "tflops_per_gpu": tflops, "peak_bytes": 2**30}, **extra)

    records = [run("H100", 1, 16384, 160.0), run("H100", 2, 16384, 200.0, communication_share=0.125),
               run("H200", 2, 16384, 240.0), {"gpus": 4, "tokens_per_gpu": 16384, "tokens": 65536,
                                              "status": "error", "error": "InvalidArgumentError: ..."}]
    bench_parallel._add_ratios(records)
    assert records[1]["flops_per_gpu_vs_one_gpu"] == pytest.approx(1.25)
    assert "flops_per_gpu_vs_one_gpu" not in records[2]
    assert bench_parallel._summary(records[1]) == "100 ms/step, 200.0 TFLOP/s per GPU, communication 12%"
    assert bench_parallel._summary(records[3]) == "error: InvalidArgumentError: ..."
    cfg = {"blocks": 4, "width": 768, "causal": False}
    bench_parallel.write_outputs(str(tmp_path / "parallel.json"), records, cfg, None, dict(_INFO, gpus=["H100"]))
    assert json.load(open(tmp_path / "parallel.json"))["records"][1]["flops_per_gpu_vs_one_gpu"] == pytest.approx(1.25)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "parallel.png").stat().st_size > 0
