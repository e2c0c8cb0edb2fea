"""Smoke tests of benchmarks/bench_model.py: the CPU quick run completes and writes its result (JSON, and the
figure where matplotlib is installed), and a run that exceeds --timeout is recorded while the benchmark still
finishes. No timing asserts."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_model.py")
_SPEC = importlib.util.spec_from_file_location("bench_plot", os.path.join(REPO, "benchmarks", "plot.py"))
plot = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plot)
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _run(tmp_path, *args, timeout=600, name="model"):
    stem = str(tmp_path / name)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the quick run is the CPU smoke run
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", stem, *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(stem + ".json") as f:
        payload = json.load(f)
    return stem, payload, proc.stdout


def test_quick_run_writes_table_and_json(tmp_path):
    stem, payload, stdout = _run(tmp_path, "--modes", "flash_mha_noxla,keras_flash_switch")
    assert payload["benchmark"] == "model" and payload["command"].startswith("python benchmarks/bench_model.py")
    by_mode = {r["mode"]: r for r in payload["results"]}
    assert set(by_mode) == {"flash_mha_noxla", "keras_flash_switch"}
    flash = by_mode["flash_mha_noxla"]
    assert flash["status"] == "ok", flash
    assert flash["steps"] == 2 and flash["median_ms"] > 0 and flash["peak_bytes"] > 0
    assert flash["xla_used"] is False and flash["flash_op_in_graph"] is True
    # tf_flash.keras is optional here: either it ran or it is recorded as missing, never a crash.
    assert by_mode["keras_flash_switch"]["status"] in ("ok", "unavailable"), by_mode["keras_flash_switch"]
    assert payload["info"]["tensorflow"] and payload["info"]["date_utc"] and payload["config"]["steps"] == 2
    assert "| 64 x 4 |" in stdout and "FlashMultiHeadAttention, no XLA" in stdout  # the tables, printed last
    assert "flash_mha_noxla" in stdout  # one progress line per finished (mode, length)
    if HAVE_MATPLOTLIB:
        assert os.path.getsize(stem + ".png") > 0


def test_timeout_is_recorded_and_run_goes_on(tmp_path):
    _, payload, _ = _run(tmp_path, "--modes", "keras_mha", "--lengths", "32,64", "--timeout", "1")
    statuses = {r["seq_len"]: r["status"] for r in payload["results"]}
    assert statuses == {32: "timeout", 64: "skipped"}, payload["results"]


def test_merge_of_two_runs(tmp_path):
    first, _, _ = _run(tmp_path, "--modes", "keras_mha", "--timeout", "1", name="a")
    second, _, _ = _run(tmp_path, "--modes", "flash_mha_noxla", "--timeout", "1", name="b")
    merged = str(tmp_path / "merged")
    proc = subprocess.run([sys.executable, SCRIPT, "--merge", first + ".json", second + ".json", "--out", merged],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(merged + ".json") as f:
        payload = json.load(f)
    assert {(r["mode"], r["status"]) for r in payload["results"]} == {("keras_mha", "timeout"),
                                                                      ("flash_mha_noxla", "timeout")}
    assert payload["command"].endswith("(merged)") and payload["info"]["date_utc"]
    assert "keras_mha" in proc.stdout


@pytest.mark.parametrize("bad", [["--modes", "nope"], ["--width", "65"]])
def test_bad_arguments_are_refused(tmp_path, bad):
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path / "m"), *bad],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and ("--modes" in proc.stderr or "--width" in proc.stderr)


def test_repeats_interleave_modes_and_report_the_median_run(tmp_path):
    _, payload, table = _run(tmp_path, "--modes", "flash_mha_noxla,keras_mha", "--lengths", "32", "--repeats", "3")
    runs = [(r["mode"], r["repeat"]) for r in payload["results"]]
    assert runs == [(m, i) for i in range(3) for m in ("flash_mha_noxla", "keras_mha")], runs  # A B A B A B
    assert "ms/step of each run" in table
    flash = sorted(r["median_ms"] for r in payload["results"] if r["mode"] == "flash_mha_noxla")
    assert f"| flash_mha_noxla | 32 x 8 | ok | {flash[1]:.2f} |" in table  # the median run


def test_combine_repeats_keeps_the_median_run_and_failures():
    ok = [{"mode": "m", "seq_len": 8, "status": "ok", "median_ms": ms, "repeat": i} for i, ms in enumerate([3, 1, 2, 9])]
    failed = {"mode": "m", "seq_len": 8, "status": "timeout", "repeat": 4}
    lone = {"mode": "m", "seq_len": 16, "status": "oom"}
    combined = {r["seq_len"]: r for r in plot.combine_repeats(ok + [failed, lone])}
    assert combined[8]["median_ms"] == 2 and combined[8]["run_medians_ms"] == [1, 2, 3, 9]
    assert combined[8]["failed_runs"] == 1 and combined[16] == lone


def test_families_run_each_tf_flash_mode_per_family(tmp_path):
    _, payload, stdout = _run(tmp_path, "--modes", "keras_mha,flash_mha_noxla", "--lengths", "32",
                              "--families", "default,sm80")
    assert [r["mode"] for r in payload["results"]] == ["keras_mha", "flash_mha_noxla", "flash_mha_noxla@sm80"]
    assert all(r["status"] == "ok" for r in payload["results"]), payload["results"]
    assert "flash_mha_noxla@sm80" in stdout


def test_bad_families_are_refused(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--families", "sm90", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "--families" in proc.stderr and "sm90" in proc.stderr


def test_xla_autotune_cache_is_passed_to_the_workers(tmp_path):
    cache = tmp_path / "xla_cache"
    _, payload, _ = _run(tmp_path, "--modes", "keras_mha_xla", "--lengths", "32", "--xla-autotune-cache", str(cache))
    assert payload["results"][0]["status"] == "ok", payload["results"]  # XLA accepted the flag
    assert payload["config"]["xla_autotune_cache"] == str(cache) and cache.is_dir()
