"""Classify document files with a model saved by train.py.

    python examples/long_document/predict.py FILE [FILE ...]
    python examples/long_document/predict.py --model runs/long_document/cpu/model.keras notes.rst
    python examples/long_document/predict.py --model DIR/saved_model FILE      # the SavedModel export

The model takes raw text (its TextVectorization layer is part of it) and returns class probabilities;
the class names come from ``labels.json`` next to the model. ``.gz`` files are read decompressed.

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
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import common  # noqa: E402,F401 (registers PositionEmbedding for load_model)

try:
    common.import_tf_flash()  # loads the op library, registers FlashMultiHeadAttention
except ImportError as e:  # a model saved with --attention keras loads without it
    _TF_FLASH_ERROR = e
else:
    _TF_FLASH_ERROR = None


class Predictor:
    """Wraps a .keras model or a SavedModel directory; __call__(list of str) -> probabilities."""

    def __init__(self, path):
        self.path = path
        labels = os.path.join(os.path.dirname(os.path.normpath(path)), "labels.json")
        with open(labels) as f:
            meta = json.load(f)
        self.class_names, self.context = meta["class_names"], meta["context"]
        if meta.get("attention") == "hub" and not os.path.isdir(path):
            common.import_keras_hub()  # registers BertBackbone for load_model
            if _TF_FLASH_ERROR is not None:
                raise RuntimeError(f"{path} runs tf_flash through tf_flash.keras but `import tf_flash` "
                                   f"failed: {_TF_FLASH_ERROR}")
            common.import_tf_flash().keras.enable()  # its attention runs tf_flash, as in training
        if os.path.isdir(path):
            self.kind = "SavedModel"
            self._loaded = tf.saved_model.load(path)  # keep a reference: it owns the variables
            self._fn = self._loaded.serve
        elif path.endswith(".keras"):
            self.kind = ".keras"
            try:
                self._model = keras.models.load_model(path)
            except Exception as e:
                if _TF_FLASH_ERROR is not None and "Flash" in str(e):
                    raise RuntimeError(f"{path} uses tf_flash layers but `import tf_flash` failed: "
                                       f"{_TF_FLASH_ERROR}") from e
                raise
            self._fn = lambda x: self._model.predict(x, verbose=0)
        else:
            raise ValueError(f"model must be a .keras file or a SavedModel directory. Received: "
                             f"model={path!r}")

    def __call__(self, texts, batch_size=4):
        out = []
        for i in range(0, len(texts), batch_size):
            out.append(np.asarray(self._fn(tf.constant(texts[i:i + batch_size]))))
        return np.concatenate(out).astype(np.float32)


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def verify(model_path, reference_path):
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
              f"process: {len(expected)} documents, max |diff| {diff:.2e}, "
              f"{'identical' if identical else 'NOT bit-identical'}, "
              f"{'same classes' if same_class else 'DIFFERENT classes'}")
        if not same_class or diff > 1e-5:
            status = 1
    print("reload check:", "passed" if status == 0 else "FAILED")
    return status


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="document files to classify")
    p.add_argument("--model", default=os.path.join(REPO_ROOT, "runs", "long_document", "cpu",
                                                   "model.keras"),
                   help="a .keras file or a SavedModel directory saved by train.py")
    p.add_argument("--top", type=int, default=3, help="show this many classes per document")
    p.add_argument("--verify", metavar="REFERENCE_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not os.path.exists(args.model):
        p.error(f"no model at {args.model!r}: run examples/long_document/train.py first, or pass "
                f"--model")
    if args.verify:
        return verify(args.model, args.verify)
    if not args.files:
        p.error("give at least one document FILE")
    model = Predictor(args.model)
    probs = model([read(f) for f in args.files])
    for path, prob in zip(args.files, probs):
        top = np.argsort(-prob)[:args.top]
        ranked = ", ".join(f"{model.class_names[c]} {prob[c]:.2f}" for c in top)
        print(f"{path}: {model.class_names[top[0]]}  ({ranked})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
