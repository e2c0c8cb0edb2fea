"""The long-document example end to end, at a toy size (examples/long_document/).

Trains the tiny preset on a small synthetic folder-per-class tree (all runs in one process,
--in-process, to keep it short) with FlashMultiHeadAttention at two context lengths, the KerasHub
encoder through tf_flash.keras and the Keras MultiHeadAttention baseline, writes the results table and
plot, saves the KerasHub model (.keras + SavedModel), reloads it in a fresh process (predictions must
match) and predicts with the last run's model; none of it prints TensorFlow's start-up notices.
The README's recipe for your own documents runs briefly on the licence texts of this machine.
Fast checks: the best epoch on validation is kept, the chance level and the advice when a model does
not beat it, predict.py's refusal of a model that does not fit the documents, one-line argument
errors, the mean +- std summary over seeds on made-up runs; prepare_data.py's conversions.
"""
import gzip
import importlib.util
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

# TensorFlow's start-up notices and Keras' warnings that the example's processes must not print.
NOISE = ("cudart_stub", "cuInit", "oneDNN", "cpu_feature_guard", "absl::InitializeLog", "shuffle=True",
         "retracing", "Traceback")


@pytest.fixture
def example_common(monkeypatch):
    """The example's common.py, also for its modules imported here (train, predict). benchmarks/ has a
    module of the same name, which the benchmark scripts that other test files load put in sys.modules
    first; the example's is loaded by path in its place for the test."""
    spec = importlib.util.spec_from_file_location("common", os.path.join(EXAMPLE, "common.py"))
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "common", common)
    spec.loader.exec_module(common)
    return common


@pytest.fixture
def example_env(tmp_path, monkeypatch):
    """The environment of the example's subprocesses: this checkout importable, the last-run record
    in tmp_path (the user's record stays), TensorFlow's own log settings as the scripts choose them."""
    for name in ("TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES", "LONG_DOCUMENT_QUIET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LONG_DOCUMENT_LAST_RUN", str(tmp_path / "last_run.json"))
    return dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


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


def test_prepare_data_licenses_tree(tmp_path):
    import email.message

    meta = email.message.Message()
    meta["License-Expression"] = "MIT OR Apache-2.0"
    assert prepare_data.license_family(prepare_data.python_declared_license(meta)) is None  # dual
    meta = email.message.Message()
    meta["Classifier"] = "License :: OSI Approved :: BSD License"
    assert prepare_data.license_family(prepare_data.python_declared_license(meta)) == "bsd"
    assert prepare_data.license_family(["GPL-2+ and LGPL-2.1+"]) == "gpl"
    assert prepare_data.license_family(["Expat"]) == "mit"
    assert prepare_data.debian_declared_license(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
        "Files: *\nCopyright: 2020 Someone\nLicense: Apache-2.0\n\nFiles: debian/*\nLicense: GPL-2+\n"
    ) == "Apache-2.0"
    assert prepare_data.debian_declared_license("free-form copyright notice") is None

    docs = tmp_path / "doc"
    for i, lic in enumerate(["MIT", "MIT", "GPL-2+", "GPL-3+", "Artistic or GPL-1+"]):
        os.makedirs(docs / f"pkg{i}")
        (docs / f"pkg{i}" / "copyright").write_text(
            f"Files: *\nCopyright: {i}\nLicense: {lic}\n\nLicense: {lic}\n text {i}\n")
    by_class = prepare_data.collect_licenses(str(docs), python_paths=[str(tmp_path / "none")])
    assert {c: sorted(n for n, _ in d) for c, d in by_class.items()} == {
        "mit": ["debian__pkg0", "debian__pkg1"], "gpl": ["debian__pkg2", "debian__pkg3"]}


def test_prepare_data_licensedcode(tmp_path):

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


def _train_tiny(tmp_path, env, *args):
    """train.py --preset tiny on _synthetic_tree's documents (tmp_path/docs) into tmp_path/out with `args`; it must
    succeed. Returns (the process, its stdout + stderr, the output folder)."""
    data, out = tmp_path / "docs", tmp_path / "out"
    _synthetic_tree(str(data))
    cmd = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--preset", "tiny", "--data-dir", str(data),
           "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return proc, log, out


def test_load_tree_and_stratified_split(tmp_path, example_common):
    common = example_common

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


def test_end_to_end_tiny(tmp_path, example_env):
    data, env = tmp_path / "docs", example_env
    proc, log, out = _train_tiny(tmp_path, env, "--contexts", "32,128", "--keras-contexts", "128", "--verbose", "2",
                                 "--in-process")
    assert "reload check: passed" in proc.stdout, log[-4000:]
    assert [n for n in NOISE if n in log] == [], log[-4000:]
    assert "chance level: 0.333" in proc.stdout  # 3 classes, one test document each
    assert "3 test documents, max |diff|" in proc.stdout  # the reload check covers the whole test split

    with open(out / "results.json") as f:
        results = json.load(f)
    runs = {(r["attention"], r["context"]): r for r in results["runs"]}
    assert set(runs) == {("flash", 32), ("flash", 128), ("hub", 128), ("keras", 128)}
    for r in runs.values():
        assert r["status"] == "ok", r
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["macro_f1"] <= 1.0
        assert r["peak_memory_gib"] > 0 and r["epoch_s"] > 0
        assert r["best_epoch"] == 1 and r["chance_accuracy"] == pytest.approx(1 / 3)
    assert results["data"]["classes"] == ["class_0", "class_1", "class_2"]
    assert results["data"]["name"] == "docs" and results["data"]["chance"]["test_docs"] == 3
    md = (out / "results.md").read_text()
    assert md.startswith("# Long-document classification on docs")
    assert md.count("| flash |") == 2 and md.count("| hub | 128 | 1 |") == 1
    assert "test acc (chance 0.333)" in md and "Chance level: 0.333" in md
    with open(out / "labels.json") as f:
        labels = json.load(f)
    assert labels["attention"] == "hub"  # the saved, reloaded and predicting model
    assert labels["data_set"] == "docs" and len(labels["vocabulary_sha256"]) == 64
    assert (out / "accuracy_vs_context.png").stat().st_size > 1000
    assert (out / "model.keras").exists() and (out / "saved_model" / "saved_model.pb").exists()
    with open(tmp_path / "last_run.json") as f:
        assert json.load(f)["model"] == str(out / "model.keras")

    # predict.py on a new file: the last run's model by default (named), then the SavedModel export
    doc = tmp_path / "new.txt"
    doc.write_text(" ".join(["topic1word3", "common5", "topic1word7"] * 40))
    predict = [sys.executable, os.path.join(EXAMPLE, "predict.py")]
    for model in ([], ["--model", str(out / "saved_model")]):
        proc = subprocess.run(predict + model + [str(doc)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.strip().splitlines()
        assert lines[0].startswith(f"model: {model[1] if model else out / 'model.keras'} ("), lines
        assert "last run" in lines[0] or model, lines
        assert "trained on docs" in proc.stdout and "3 classes: class_0, class_1, class_2" in proc.stdout
        assert "context 128 tokens" in proc.stdout
        assert lines[-1].startswith(str(doc) + ": class_"), lines
        assert [n for n in NOISE if n in proc.stdout + proc.stderr] == [], proc.stderr[-3000:]
    # --data-dir: the run's own documents are accepted (classes and vocabulary match): its test split
    proc = subprocess.run(predict + ["--data-dir", str(data)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the same classes and vocabulary" in proc.stdout
    assert "test split: 3 documents" in proc.stdout and "chance 0.333" in proc.stdout


def test_pack_tiny(tmp_path, example_env):
    """--pack: the flash model on packed rows (one shape, segment_ids, a prediction per document) beside the
    bucketed one, both reported with real tokens per second, padding fraction and accuracy."""
    _, log, out = _train_tiny(tmp_path, example_env, "--contexts", "128", "--hub-contexts", "none",
                              "--keras-contexts", "none", "--pack", "--no-save", "--in-process", "--verbose", "0")
    assert [n for n in NOISE if n in log] == [], log[-4000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    runs = {r["attention"]: r for r in results["runs"]}
    assert set(runs) == {"flash", "packed"} and all(r["status"] == "ok" for r in runs.values()), runs
    flash, packed = runs["flash"], runs["packed"]
    # The same documents cut to the same context: the same real tokens, in fewer slots and one shape.
    assert packed["real_tokens"] == flash["real_tokens"] > 0
    assert packed["padding_fraction"] < flash["padding_fraction"]
    assert packed["train_shapes"] == 1 and flash["train_shapes"] >= 1
    assert packed["real_tokens_per_s"] > 0 and flash["real_tokens_per_s"] > 0
    assert packed["test_docs"] == 3 and 0.0 <= packed["accuracy"] <= 1.0  # every test document classified
    assert packed["max_documents"] >= 2 and packed["pack_batch_size"] >= 1
    md = (out / "results.md").read_text()
    assert "| packed | 128 | 1 |" in md and "| real tok/s | padding |" in md
    assert "FlashMultiHeadAttention on packed rows (segment_ids)" in md


def test_pack_only_tiny_xla(tmp_path, example_env):
    """--pack-only under --jit-compile true: the packed run alone, one batch shape (one XLA compilation)."""
    _, _, out = _train_tiny(tmp_path, example_env, "--contexts", "128", "--hub-contexts", "none",
                            "--keras-contexts", "none", "--pack-only", "--jit-compile", "true", "--no-save",
                            "--in-process", "--verbose", "0")
    with open(out / "results.json") as f:
        runs = json.load(f)["runs"]
    assert [(r["attention"], r["status"], r["train_shapes"]) for r in runs] == [("packed", "ok", 1)], runs


def test_packed_batches_hold_every_document_once(example_common):
    """The packed rows of the example: each document once (cut to the context), its label in its slot, the
    batches of one shape with padding rows of weight 0; max_documents_per_row bounds any packing."""
    common = example_common

    rng = np.random.default_rng(0)
    lengths = [5, 40, 3, 0, 17, 64, 100, 9, 9, 30, 2]
    tokens = [rng.integers(2, 50, n).astype(np.int32) for n in lengths]
    labels = np.arange(len(tokens)) % 3
    context = 32
    bound = common.max_documents_per_row(lengths, context)
    assert bound == 6  # 1 (the empty one) + 2 + 3 + 5 + 9 + 9 = 29 <= 32; adding 17 would not fit
    for shuffle in (False, True):
        batches = common.PackedBatches(tokens, labels, context, batch_size=3, max_documents=bound,
                                       shuffle=shuffle, seed=1)
        seen = []
        for inputs, label, weight in batches.dataset():
            assert inputs["token_ids"].shape == (3, context) and label.shape == (3, bound)
            ids, positions = inputs["segment_ids"].numpy(), inputs["positions"].numpy()
            for row in range(3):
                for slot in range(bound):
                    where = ids[row] == slot + 1
                    assert bool(weight[row, slot]) == bool(where.any())
                    if where.any():
                        doc = inputs["token_ids"].numpy()[row][where]
                        assert np.array_equal(positions[row][where], np.arange(where.sum()))
                        match = [i for i, t in enumerate(tokens) if np.array_equal(
                            (t[:context] if len(t) else np.ones(1, np.int32)), doc) and labels[i] == label[row, slot]]
                        assert match, (row, slot)
                        seen.append(len(doc))
        assert sorted(seen) == sorted(max(1, min(n, context)) for n in lengths)
    assert batches.token_stats()[2] == 1
    test_batches = common.PackedBatches(tokens, labels, context, 3, bound)
    slots = test_batches.slots()
    assert sorted(slots[slots >= 0].tolist()) == list(range(len(tokens)))


def test_context_parallel_tiny(tmp_path, example_env):
    """--context-parallel 2 on 2 logical CPU devices: the flash model's documents split along the sequence
    over the replicas of a MirroredStrategy, trained with Keras fit (its worker process makes the devices),
    the test split classified by the same weights on one device."""
    _, log, out = _train_tiny(tmp_path, example_env, "--contexts", "128", "--hub-contexts", "none",
                              "--keras-contexts", "none", "--context-parallel", "2", "--epochs", "2", "--no-save",
                              "--verbose", "0")
    assert [n for n in NOISE if n in log] == [], log[-4000:]
    with open(out / "results.json") as f:
        (run,) = json.load(f)["runs"]
    assert run["status"] == "ok" and run["context_parallel"] == 2 and run["epochs"] == 2, run
    assert run["test_docs"] == 3 and 0.0 <= run["accuracy"] <= 1.0 and np.isfinite(run["val_loss"]).all()
    assert "sequence split over 2 replicas" in (out / "results.md").read_text()


_SHARDED_STEP = """
import json, sys
import numpy as np
sys.path.insert(0, {example!r})
import common  # noqa: E402
import keras, tensorflow as tf  # noqa: E402

strategy = common.replica_strategy(2)
rng = np.random.default_rng(0)
tokens = np.zeros([3, 64], np.int32)
for row, length in enumerate([64, 37, 5]):
    tokens[row, :length] = rng.integers(1, 50, length)
labels = np.array([0, 2, 1], np.int32)

def build():
    keras.utils.set_random_seed(1)
    model = common.build_sharded_classifier(50, 3, 64, embed_dim=8, num_heads=2, ff_dim=16, num_layers=2,
                                            dropout=0.0)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    return model

whole = build()
with strategy.scope():
    sharded = build()
sharded.set_weights(whole.get_weights())
dataset = tf.data.Dataset.from_tensors((tokens, labels))
whole.fit(dataset, epochs=1, verbose=0)
sharded.fit(common.replicated(strategy, dataset), epochs=1, steps_per_epoch=1, verbose=0)
errors = [float(np.max(np.abs(a - b))) for a, b in zip(whole.get_weights(), sharded.get_weights())]
moved = max(float(np.max(np.abs(a - b))) for a, b in zip(whole.get_weights(), build().get_weights()))
print(json.dumps({{"max_error": max(errors), "moved": moved}}))
"""


def test_sharded_fit_step_equals_one_device(tmp_path, example_env):
    """One Keras fit step of the example's sharded encoder on 2 logical CPU devices (each replica its zigzag
    shard of every document, the masked mean summed over the replicas) gives the weights of the same step
    on one device, padding included."""
    script = tmp_path / "step.py"
    script.write_text(_SHARDED_STEP.format(example=EXAMPLE))
    proc = subprocess.run([sys.executable, str(script)], env=example_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["moved"] > 1e-3  # the step changed the weights
    assert result["max_error"] < 1e-5, result


def test_recipe_on_licence_texts(tmp_path, example_env):
    """The README's recipe for your own documents, briefly: the licence texts of this machine as a
    folder-per-class tree, two contexts of the example's model, the chance level reported."""
    tree = tmp_path / "licenses"
    if prepare_data.main(["--source", "licenses", "--out", str(tree), "--min-docs", "10"]) != 0:
        pytest.skip("fewer than 2 licence families with 10 documents on this machine")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--data-dir", str(tree), "--out", str(out),
           "--contexts", "128,512", "--hub-contexts", "none", "--keras-contexts", "none",
           "--max-docs-per-class", "20", "--epochs", "2", "--embed-dim", "16", "--ff-dim", "32",
           "--vocab-size", "2000", "--no-save", "--in-process", "--verbose", "0"]
    proc = subprocess.run(cmd, env=example_env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert [n for n in NOISE if n in log] == [], log[-4000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    assert results["data"]["name"] == "licenses" and results["data"]["chance"]["accuracy"] > 0
    assert {(r["attention"], r["context"]) for r in results["runs"]} == {("flash", 128), ("flash", 512)}
    assert all(r["status"] == "ok" and r["epochs"] <= 2 for r in results["runs"])
    assert all(r["beats_chance"] in (True, False) for r in results["summary"])
    md = (out / "results.md").read_text()
    assert "Chance level:" in md and ("Every model that finished beat it" in md or "Not better than chance" in md)
    assert "hub" not in md.split("Models:")[1].split("\n")[0]  # the footer names only the models that ran


def test_best_epoch_on_validation_is_kept(example_common):
    import keras

    common = example_common

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    shapes = [w.shape for w in model.get_weights()]
    history = [(0.5, 1.0), (0.7, 0.9), (0.7, 0.8), (0.6, 0.7), (0.6, 0.6), (0.9, 0.1)]
    for restore, patience, kept, stopped in ((True, 2, 2.0, 5), (False, 2, 4.0, 5), (True, 0, 5.0, None)):
        callback = common.BestOnValidation(patience=patience, restore=restore)
        callback.set_model(model)
        model.stop_training = False
        callback.on_train_begin()
        for epoch, (acc, loss) in enumerate(history):
            model.set_weights([np.full(s, float(epoch)) for s in shapes])  # "training" epoch `epoch`
            callback.on_epoch_end(epoch, {"val_accuracy": acc, "val_loss": loss, "accuracy": 1.0})
            if model.stop_training:
                break
        callback.on_train_end()
        # ties in accuracy go to the lower loss: epoch 3 (1-based) beats epoch 2
        assert callback.best_epoch == (6 if patience == 0 else 3)
        assert callback.stopped_epoch == stopped
        assert all(np.all(w == kept) for w in model.get_weights()), (restore, patience)


def test_chance_level_and_advice(example_common):
    common = example_common
    import train

    labels = np.array([0] * 6 + [1] * 3 + [2] * 1 + [0, 0, 1, 2])
    train_idx, test_idx = np.arange(10), np.arange(10, 14)
    chance = common.chance_level(labels, train_idx, test_idx, [True, False, True, True])
    assert chance["class_index"] == 0 and chance["accuracy"] == 0.5
    assert chance["long_accuracy"] == pytest.approx(1 / 3) and chance["long_docs"] == 3
    assert common.p_value_above_chance(1.0, 10, 0.5) == pytest.approx(0.5 ** 10)
    assert common.beats_chance(0.9, 200, 0.5) and not common.beats_chance(0.55, 20, 0.5)
    assert not common.beats_chance(0.5, 18, 0.5)  # exactly chance, the case

    reasons, tries = common.chance_advice(train_docs=144, smallest_class=72, test_docs=18, epochs=3,
                                          train_accuracy=0.52, chance=0.5)
    text = " ".join(reasons + tries)
    assert "144 for training" in text and "did not fit" in text and "--epochs" in text
    assert "18 documents" in text
    reasons, _ = common.chance_advice(train_docs=144, smallest_class=72, test_docs=18, epochs=10,
                                      train_accuracy=1.0, chance=0.5)
    assert any("learned its training documents" in r for r in reasons)

    info = {"split": [144, 18, 18], "smallest_train_class": 72}
    chance = {"accuracy": 0.5, "class": "speeches", "test_docs": 18, "long_docs": 18, "long_accuracy": 0.5}
    rows = [{"attention": "flash", "context": 512, "accuracy": 0.5, "epochs": 3, "train_accuracy": 0.5,
             "test_docs": 18}, {"attention": "flash", "context": 4096, "accuracy": 0.95, "epochs": 3,
                                "train_accuracy": 1.0, "test_docs": 18}]
    train.chance_verdicts(rows, chance)
    assert [r["beats_chance"] for r in rows] == [False, True]
    text = train.chance_paragraph(rows, chance, info)
    assert "Chance level: 0.500 on the 18 test documents (always 'speeches'" in text
    assert "**Not better than chance: flash at 512 (0.500).**" in text and "Try:" in text
    assert "Every model" in train.chance_paragraph(rows[1:], chance, info)


@pytest.mark.usefixtures("example_common")
def test_plot_describes_the_run(tmp_path):
    """The issue's run: every test document longer than 512 tokens, a custom data set, flash and keras
    only, both at chance. One line per model (the > 512 line would hide under it), the chance line,
    the data set's name, no model that did not run."""
    pytest.importorskip("matplotlib")
    import train

    runs = [{"attention": a, "context": c, "seed": 1337, "status": "ok", "epochs": 3, "best_epoch": 2,
             "accuracy": 0.5, "macro_f1": 0.33, "long_accuracy": 0.5, "long_macro_f1": 0.33,
             "test_docs": 18, "long_docs": 18, "epoch_s": 1.0, "peak_memory_gib": 1.0}
            for a, c in (("flash", 512), ("flash", 4096), ("keras", 4096))]
    doc = {"device": "CPU", "config": {"data_dir": "/home/me/speeches"}, "runs": runs,
           "data": {"name": "speeches", "chance": {"accuracy": 0.5, "class": "a", "test_docs": 18,
                                                   "long_docs": 18, "long_accuracy": 0.5}}}
    labels = train.plot(doc, str(tmp_path), quiet=True)
    assert (tmp_path / "accuracy_vs_context.png").stat().st_size > 1000
    assert labels == ["chance: always 'a' (0.50)",
                      "FlashMultiHeadAttention: all test docs (all > 512 tokens)",
                      "keras MultiHeadAttention: all test docs (all > 512 tokens)"]


def _fake_model(root, class_names, **extra):
    """A model folder as train.py leaves it, as far as predict.py reads it before loading the model."""
    os.makedirs(root)
    with open(os.path.join(root, "model.keras"), "w") as f:
        f.write("not loaded: predict.py refuses before it loads the model")
    with open(os.path.join(root, "labels.json"), "w") as f:
        json.dump({"class_names": class_names, "context": 512, "attention": "flash",
                   "data_dir": "/elsewhere/admin-docs", "data_set": "admin-docs", "num_docs": 180,
                   "trained": "2026-01-01 00:00 UTC", **extra}, f)
    return os.path.join(root, "model.keras")


@pytest.mark.usefixtures("example_common")
def test_predict_refuses_a_model_of_other_documents(tmp_path, capsys, example_env):
    import predict

    data = tmp_path / "speeches"
    _synthetic_tree(str(data), classes=2, docs_per_class=5)
    doc = str(data / "class_0" / "doc0.txt")
    # other classes: refused before TensorFlow is even needed, after the model is named
    model = _fake_model(str(tmp_path / "run_a"), ["admin-guide", "arch", "networking"])
    assert predict.main(["--model", model, "--data-dir", str(data), doc]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"model: {model} (--model)") and "trained on admin-docs" in out
    assert len(err.strip().splitlines()) == 1 and "not on the 2 classes of" in err
    assert "not in the model: class_0, class_1" in err and "train.py --data-dir" in err
    # the same class names, another vocabulary: refused too
    model = _fake_model(str(tmp_path / "run_b"), ["class_0", "class_1"], vocabulary_sha256="0" * 64,
                        vocabulary_size=300, vocab_size=2000, seed=1337, max_docs_per_class=0)
    assert predict.main(["--model", model, "--data-dir", str(data), doc]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "vocabulary" in err and "other documents" in err
    # the default model is the last run's, named as such
    with open(tmp_path / "last_run.json", "w") as f:
        json.dump({"model": model, "finished": "2026-01-01 00:00 UTC"}, f)
    assert predict.main(["--data-dir", str(data), doc]) == 2
    out, _ = capsys.readouterr()
    assert out.startswith(f"model: {model} (the model of train.py's last run, 2026-01-01 00:00 UTC)")


@pytest.mark.parametrize("script,args,message", [
    ("train.py", ["--data-dir", "/nonexistent/docs"], "--data-dir is not a directory"),
    ("train.py", ["--data-dir", "EMPTY"], "needs a folder per class"),
    ("train.py", ["--epochs", "0", "--data-dir", "EMPTY"], "--epochs must be >= 1"),
    ("train.py", ["--contexts", "512,abc"], "--contexts must be comma-separated integers"),
    ("train.py", ["--preset", "huge"], "invalid choice"),
    ("train.py", ["--context-parallel", "0", "--data-dir", "EMPTY"], "--context-parallel must be >= 1"),
    ("train.py", ["--pack", "--context-parallel", "2", "--data-dir", "EMPTY"], "does not combine with --pack"),
    ("train.py", ["--context-parallel", "2", "--contexts", "100", "--data-dir", "EMPTY"], "multiples of 64"),
    ("train.py", ["--pack", "--attention", "keras", "--data-dir", "EMPTY"], "--pack trains FlashMultiHeadAttention"),
    ("train.py", ["--pack-batch-size", "0", "--data-dir", "EMPTY"], "--pack-batch-size must be >= 1"),
    ("predict.py", ["--model", "/nonexistent/model.keras", "README.md"], "no model at"),
    ("predict.py", ["missing.txt"], "no such file: missing.txt"),
    ("predict.py", [], "give at least one document FILE"),
    ("prepare_data.py", ["--doc-root", "/nonexistent/Documentation", "--out", "OUT"], "--doc-root"),
])
def test_bad_arguments_exit_with_one_line(tmp_path, example_env, script, args, message):
    args = [str(tmp_path) if a == "EMPTY" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLE, script)] + args, env=example_env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"{script}: error: ") and message in proc.stderr, proc.stderr


@pytest.mark.usefixtures("example_common")
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
