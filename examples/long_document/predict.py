"""Classify document files with a model saved by train.py.

    python examples/long_document/predict.py FILE [FILE ...]        # the model of train.py's last run
    python examples/long_document/predict.py --model runs/long_document/cpu/model.keras notes.rst
    python examples/long_document/predict.py --model DIR/saved_model FILE      # the SavedModel export
    python examples/long_document/predict.py --data-dir DIR [FILE ...]

It first names the model it loaded: its path, the data set it was trained on, its classes and its
context. The model takes raw text (its TextVectorization layer is part of it) and returns class
probabilities; the class names and what the model was trained on come from ``labels.json`` next to it.
``.gz`` files are read decompressed.

``--data-dir DIR`` says the documents belong to the data set in DIR: a model whose classes are not
DIR's class folders, or whose vocabulary is not the one a run on DIR builds, is refused (it would
answer with another data set's classes or read the words as other words). Without FILEs it then
classifies DIR's test split (the split train.py made) and reports the accuracy beside the chance level.

``--verify reference.json`` (used by train.py) reloads the ``.keras`` file and the SavedModel export
in this fresh process and checks that both give exactly the predictions the trained model gave.

A model of the KerasHub encoder (``labels.json``: ``"attention": "hub"``) loads after ``import
keras_hub`` and runs with ``tf_flash.keras.enable()``, as it was trained; its SavedModel export needs
only ``import tf_flash`` (the traced graph holds the tf_flash op).
"""
import argparse
import gzip
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import cli  # noqa: E402 (no TensorFlow: the checks before loading a model stay fast)

MODEL_KINDS = {"flash": "the example's encoder with FlashMultiHeadAttention",
               "hub": "KerasHub BertBackbone through tf_flash.keras",
               "keras": "the example's encoder with keras MultiHeadAttention"}


class Refusal(Exception):
    """The model does not fit the documents: exit with this one-line message."""


def model_info(path):
    """labels.json next to the model: what it was trained on."""
    labels = os.path.join(os.path.dirname(os.path.normpath(path)), "labels.json")
    if not os.path.isfile(labels):
        raise Refusal(f"no labels.json next to the model (train.py writes it with the model). "
                      f"Received: model={path!r}")
    with open(labels) as f:
        return json.load(f)


def describe(path, meta, source):
    """The lines that name the model: path, data set, classes, context."""
    names = meta["class_names"]
    shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
    lines = [f"model: {path} ({source})"]
    if meta.get("data_dir"):
        lines.append(f"  trained on {meta.get('data_set') or os.path.basename(meta['data_dir'])} "
                     f"({meta['data_dir']}, {meta.get('num_docs', '?')} documents)"
                     + (f", {meta['trained']}" if meta.get("trained") else ""))
    lines.append(f"  {len(names)} classes: {shown}")
    kind = MODEL_KINDS.get(meta.get("attention"), meta.get("attention", "?"))
    lines.append(f"  context {meta['context']} tokens; {kind}")
    if meta.get("test_accuracy") is not None:
        chance = (meta.get("chance") or {}).get("accuracy")
        lines.append(f"  test accuracy {meta['test_accuracy']:.3f}"
                     + (f" (chance {chance:.3f})" if chance is not None else "")
                     + (f", best epoch {meta['best_epoch']} of {meta['epochs']}" if meta.get("best_epoch") else ""))
    return "\n".join(lines)


def class_folders(data_dir):
    return sorted(d for d in os.listdir(data_dir)
                  if os.path.isdir(os.path.join(data_dir, d)) and not d.startswith("."))


def check_classes(meta, data_dir):
    """Refuses a model whose classes are not the data set's class folders (no TensorFlow needed)."""
    folders = class_folders(data_dir)
    if folders != list(meta["class_names"]):
        missing = sorted(set(folders) - set(meta["class_names"]))
        extra = sorted(set(meta["class_names"]) - set(folders))
        detail = "; ".join(x for x in (
            f"not in the model: {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "") if missing else "",
            f"not in {data_dir}: {', '.join(extra[:6])}" + (" ..." if len(extra) > 6 else "") if extra else "",
            "the same names in another order" if not missing and not extra else "") if x)
        raise Refusal(f"the model was trained on {meta.get('data_set', 'another data set')} "
                      f"({len(meta['class_names'])} classes), not on the {len(folders)} classes of "
                      f"{data_dir} ({detail}): train on it first (train.py --data-dir {data_dir}) or "
                      f"pass that run's model with --model")


def check_vocabulary(meta, data_dir):
    """Refuses a model whose vocabulary differs from the one a run on data_dir builds (the training
    split's TextVectorization vocabulary, the split and size the model's run used). Returns the
    run's documents and split."""
    import common

    texts, labels, names, paths, split = common.load_split(
        data_dir, seed=meta.get("seed", 1337), max_docs_per_class=meta.get("max_docs_per_class", 0))
    if "vocabulary_sha256" not in meta:
        print("  (this model's labels.json records no vocabulary: only its classes were checked)")
        return texts, labels, split
    vocab = common.build_vocabulary([texts[i] for i in split[0]], meta["vocab_size"])
    if common.vocabulary_fingerprint(vocab) != meta["vocabulary_sha256"]:
        raise Refusal(f"the model's vocabulary ({meta['vocabulary_size']} entries, from "
                      f"{meta.get('data_dir', '?')}) is not the one a run on {data_dir} builds "
                      f"({len(vocab)} entries): the same class names, other documents. Train on "
                      f"{data_dir} (train.py --data-dir {data_dir}) or pass that run's model with --model")
    return texts, labels, split


class Predictor:
    """Wraps a .keras model or a SavedModel directory; __call__(list of str) -> probabilities."""

    def __init__(self, path, meta=None):
        import common  # first: it imports TensorFlow (quietly where asked)
        import keras
        import tensorflow as tf

        self.path = path
        meta = meta or model_info(path)
        self.class_names, self.context = meta["class_names"], meta["context"]
        try:
            flash = common.import_tf_flash()  # loads the op library, registers FlashMultiHeadAttention
            flash_error = None
        except ImportError as e:  # a model saved with --attention keras loads without it
            flash, flash_error = None, e
        if meta.get("attention") == "hub" and not os.path.isdir(path):
            common.import_keras_hub()  # registers BertBackbone for load_model
            if flash is None:
                raise RuntimeError(f"{path} runs tf_flash through tf_flash.keras but `import tf_flash` "
                                   f"failed: {flash_error}")
            flash.keras.enable()  # its attention runs tf_flash, as in training
        if os.path.isdir(path):
            self.kind = "SavedModel"
            self._loaded = tf.saved_model.load(path)  # keep a reference: it owns the variables
            self._fn = self._loaded.serve
        elif path.endswith(".keras"):
            self.kind = ".keras"
            try:
                self._model = keras.models.load_model(path)
            except Exception as e:
                if flash is None and "Flash" in str(e):
                    raise RuntimeError(f"{path} uses tf_flash layers but `import tf_flash` failed: "
                                       f"{flash_error}") from e
                raise
            self._fn = lambda x: self._model.predict(x, verbose=0)
        else:
            raise Refusal(f"model must be a .keras file or a SavedModel directory. Received: "
                          f"model={path!r}")

    def __call__(self, texts, batch_size=16):
        import numpy as np
        import tensorflow as tf

        out = []
        for i in range(0, len(texts), batch_size):
            out.append(np.asarray(self._fn(tf.constant(texts[i:i + batch_size]))))
        return np.concatenate(out).astype(np.float32)


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def verify(model_path, reference_path):
    import numpy as np

    with open(reference_path) as f:
        ref = json.load(f)
    expected = np.asarray(ref["probs"], np.float32)
    saved_model = os.path.join(os.path.dirname(os.path.normpath(model_path)), "saved_model")
    status = 0
    for path in (model_path, saved_model):
        model = Predictor(path)
        got = model(ref["texts"])
        diff = float(np.max(np.abs(got - expected)))
        same_class = bool(np.all(got.argmax(-1) == expected.argmax(-1)))
        identical = bool(np.array_equal(got, expected))
        print(f"{model.kind:<10} ({os.path.basename(path)}) reloaded in a fresh "
              f"process: {len(expected)} test documents, max |diff| {diff:.2e}, "
              f"{'identical' if identical else 'NOT bit-identical'}, "
              f"{'same classes' if same_class else 'DIFFERENT classes'}")
        if not same_class or diff > 1e-5:
            status = 1
    print("reload check:", "passed" if status == 0 else "FAILED")
    return status


def default_model():
    """The model of train.py's last run, and how to say so."""
    record = cli.last_run_file()
    if not os.path.isfile(record):
        raise Refusal("no trained model yet: run examples/long_document/train.py (or "
                      "scripts/example.sh) first, or pass --model")
    with open(record) as f:
        last = json.load(f)
    if not os.path.exists(last["model"]):
        raise Refusal(f"the last run's model {last['model']} is gone ({record}): train again or pass --model")
    return last["model"], f"the model of train.py's last run, {last.get('finished', '')}".rstrip(", ")


def evaluate(model, texts, labels, split, meta):
    """Accuracy on the data set's test split, beside the chance level."""
    import numpy as np
    import common

    train, _, test = split
    probs = model([texts[i] for i in test])
    acc = common.accuracy(labels[test], probs.argmax(-1))
    majority = int(np.bincount(labels[train]).argmax())
    chance = common.accuracy(labels[test], np.full(len(test), majority))
    verdict = ("beats chance" if common.beats_chance(acc, len(test), chance) else
               "NOT better than chance: see examples/README.md, \"Your own documents\"")
    print(f"test split: {len(test)} documents, accuracy {acc:.3f} (chance {chance:.3f}, always "
          f"'{meta['class_names'][majority]}'): {verdict}")


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="document files to classify")
    p.add_argument("--model", default=None,
                   help="a .keras file or a SavedModel directory saved by train.py (default: the model "
                        "of train.py's last run, recorded in runs/long_document/last_run.json)")
    p.add_argument("--data-dir", default=None,
                   help="the documents' data set (folder-per-class tree): refuse a model trained on "
                        "other classes or another vocabulary; without FILEs, classify its test split")
    p.add_argument("--top", type=int, default=3, help="show this many classes per document")
    p.add_argument("--tf-logs", action="store_true",
                   help="show TensorFlow's own log lines (GPU probing, oneDNN notices), hidden by default")
    p.add_argument("--verify", metavar="REFERENCE_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top must be >= 1. Received: top={args.top}")
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        p.error(f"--data-dir is not a directory. Received: data_dir={args.data_dir!r}")
    if not args.files and not args.data_dir and not args.verify:
        p.error("give at least one document FILE (or --data-dir DIR to classify its test split)")
    try:
        if args.model is None:
            args.model, source = default_model()
        else:
            source = "--model"
            if not os.path.exists(args.model):
                raise Refusal(f"no model at {args.model!r}: run examples/long_document/train.py first, "
                              f"or pass the path of a saved model")
        meta = model_info(args.model)
        print(describe(args.model, meta, source), flush=True)
        if args.data_dir:
            check_classes(meta, args.data_dir)
        cli.quiet_tensorflow(tf_logs=args.tf_logs)
        cli.import_tensorflow()
        if args.verify:
            return verify(args.model, args.verify)
        if args.data_dir:
            texts, labels, split = check_vocabulary(meta, args.data_dir)
            print(f"  matches {args.data_dir}: the same classes and vocabulary")
        model = Predictor(args.model, meta)
    except Refusal as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.data_dir and not args.files:
        evaluate(model, texts, labels, split, meta)
        return 0
    import numpy as np

    probs = model([read(f) for f in args.files])
    for path, prob in zip(args.files, probs):
        top = np.argsort(-prob)[:args.top]
        ranked = ", ".join(f"{model.class_names[c]} {prob[c]:.2f}" for c in top)
        print(f"{path}: {model.class_names[top[0]]}  ({ranked})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
