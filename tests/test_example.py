"""The long-document example end to end, at a toy size (examples/long_document/).

Trains the tiny preset on a small synthetic folder-per-class tree (all runs in one process,
--in-process, to keep it short) with FlashMultiHeadAttention at two context lengths, the KerasHub
encoder through tf_flash.keras and the Keras MultiHeadAttention baseline, writes the results table and
plot, saves the KerasHub model (.keras + SavedModel), reloads it in a fresh process (predictions must
match) and predicts a file; the mean +- std summary over seeds on made-up runs.
The data conversion of prepare_data.py is tested on a fake Documentation/ tree.
"""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "long_document")
sys.path.insert(0, EXAMPLE)

import prepare_data  # noqa: E402


def _write_gz(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wb") as f:
        f.write(text.encode())


def test_prepare_data_layout(tmp_path):
    doc = tmp_path / "Documentation"
    for i in range(3):
        _write_gz(str(doc / "admin-guide" / f"guide{i}.rst.gz"), f"Guide {i}\n=======\ntext")
    _write_gz(str(doc / "admin-guide" / "sub" / "deep.rst.gz"), "deep text")
    _write_gz(str(doc / "admin-guide" / "index.rst.gz"), ".. toctree::")
    _write_gz(str(doc / "x86" / "boot.rst.gz"), "x86 boot")
    _write_gz(str(doc / "arm64" / "memory.rst.gz"), "arm64 memory")
    _write_gz(str(doc / "powerpc" / "a.rst.gz"), "ppc")
    _write_gz(str(doc / "translations" / "zh_CN" / "a.rst.gz"), "translated")
    _write_gz(str(doc / "devicetree" / "bindings.rst.gz"), "bindings")
    _write_gz(str(doc / "ABI" / "README.gz"), "abi")
    _write_gz(str(doc / "mm" / "one.rst.gz"), "only one document")
    _write_gz(str(doc / "mm" / "notes.txt.gz"), "not reStructuredText")
    out = tmp_path / "tree"
    assert prepare_data.main(["--doc-root", str(doc), "--out", str(out), "--min-docs", "2"]) == 0
    classes = sorted(os.listdir(out))
    assert classes == ["admin-guide", "arch"]  # mm has 1 doc; excluded folders are gone
    assert sorted(os.listdir(out / "admin-guide")) == [
        "admin-guide__guide0.txt", "admin-guide__guide1.txt", "admin-guide__guide2.txt",
        "admin-guide__sub__deep.txt"]  # index.rst left out, subfolders flattened
    assert len(os.listdir(out / "arch")) == 3  # x86 + arm64 + powerpc merged
    assert (out / "arch" / "x86__boot.txt").read_text() == "x86 boot"


def test_prepare_data_licensedcode(tmp_path):
    import importlib.util

    if importlib.util.find_spec("licensedcode") is None:
        pytest.skip("pip package licensedcode-data is not installed")
    out = tmp_path / "licenses"
    assert prepare_data.main(["--source", "licensedcode", "--out", str(out)]) == 0
    classes = sorted(os.listdir(out))
    assert "permissive" in classes and "copyleft" in classes
    text = (out / "permissive" / os.listdir(out / "permissive")[0]).read_text()
    assert "category:" not in text  # the YAML header (which names the class) is dropped


@pytest.mark.parametrize("bad", [["--min-docs", "0"], ["--doc-root", "/nonexistent/Documentation"]])
def test_prepare_data_bad_arguments(tmp_path, bad):
    with pytest.raises((SystemExit, FileNotFoundError), match="min_docs|doc_root|2"):
        prepare_data.main(bad + ["--out", str(tmp_path / "tree")])


def _synthetic_tree(root, classes=3, docs_per_class=12, seed=0):
    """Documents whose class shows in their words; lengths 20..700 words (some > 512 tokens)."""
    rng = np.random.RandomState(seed)
    shared = [f"common{i}" for i in range(200)]
    for c in range(classes):
        own = [f"topic{c}word{i}" for i in range(30)]
        os.makedirs(os.path.join(root, f"class_{c}"))
        for d in range(docs_per_class):
            n = int(rng.choice([20, 60, 150, 700]))
            words = [own[rng.randint(30)] if rng.rand() < 0.3 else shared[rng.randint(200)]
                     for _ in range(n)]
            with open(os.path.join(root, f"class_{c}", f"doc{d}.txt"), "w") as f:
                f.write(" ".join(words))


def test_load_tree_and_stratified_split(tmp_path):
    import common

    _synthetic_tree(str(tmp_path / "tree"), classes=3, docs_per_class=10)
    texts, labels, names, paths = common.load_tree(str(tmp_path / "tree"))
    assert names == ["class_0", "class_1", "class_2"] and len(texts) == 30
    train, val, test = common.stratified_split(labels, seed=1)
    assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(30))
    for split in (val, test):
        assert sorted(np.bincount(labels[split]).tolist()) == [1, 1, 1]
    again = common.stratified_split(labels, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip((train, val, test), again))
    assert common.macro_f1([0, 1, 1], [0, 1, 0], 2) == pytest.approx((2 / 3 + 2 / 3) / 2)


def test_end_to_end_tiny(tmp_path):
    data = tmp_path / "docs"
    out = tmp_path / "out"
    _synthetic_tree(str(data))
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--preset", "tiny", "--data-dir",
           str(data), "--out", str(out), "--contexts", "32,128", "--keras-contexts", "128",
           "--verbose", "2", "--in-process"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "reload check: passed" in proc.stdout, log[-4000:]

    with open(out / "results.json") as f:
        results = json.load(f)
    runs = {(r["attention"], r["context"]): r for r in results["runs"]}
    assert set(runs) == {("flash", 32), ("flash", 128), ("hub", 128), ("keras", 128)}
    for r in runs.values():
        assert r["status"] == "ok", r
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["macro_f1"] <= 1.0
        assert r["peak_memory_gib"] > 0 and r["epoch_s"] > 0
    assert results["data"]["classes"] == ["class_0", "class_1", "class_2"]
    assert (out / "results.md").read_text().count("| flash |") == 2
    assert (out / "results.md").read_text().count("| hub | 128 | 1 |") == 1
    with open(out / "labels.json") as f:
        assert json.load(f)["attention"] == "hub"  # the saved, reloaded and predicting model
    assert (out / "accuracy_vs_context.png").stat().st_size > 1000
    assert (out / "model.keras").exists() and (out / "saved_model" / "saved_model.pb").exists()

    # predict.py on a new file, with the .keras model and with the SavedModel export
    doc = tmp_path / "new.txt"
    doc.write_text(" ".join(["topic1word3", "common5", "topic1word7"] * 40))
    for model in (out / "model.keras", out / "saved_model"):
        proc = subprocess.run([sys.executable, os.path.join(EXAMPLE, "predict.py"), "--model",
                               str(model), str(doc)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = proc.stdout.strip().splitlines()[-1]
        assert line.startswith(str(doc) + ": class_"), line


def test_summary_over_seeds():
    import train

    runs = [{"attention": "flash", "context": 512, "seed": s, "status": "ok", "epochs": 3, "accuracy": a,
             "macro_f1": a - 0.1, "long_accuracy": a - 0.2, "long_macro_f1": a - 0.3, "epoch_s": 2.0,
             "epoch_cpu_s": 4.0, "peak_memory_gib": m} for s, a, m in ((1, 0.7, 1.0), (2, 0.8, 1.5), (3, 0.9, 1.2))]
    runs.append({"attention": "keras", "context": 512, "seed": 1, "status": "OOM"})
    flash, keras_row = train.aggregate(runs)
    assert flash["seeds"] == 3 and flash["status"] == "ok" and flash["peak_memory_gib"] == 1.5
    assert flash["accuracy"] == pytest.approx(0.8) and flash["accuracy_std"] == pytest.approx(0.1)
    assert train.fmt_mean(flash, "long_accuracy") == "0.600 +- 0.100"
    assert keras_row["seeds"] == 0 and keras_row["status"] == "OOM" and keras_row["accuracy"] is None
