"""The saving tests' model and data, how they save it (`train_and_save`), and the fresh-process side:
`python tests/saving_helper.py COMMAND DIR`, run by `run`.

Commands (each prints one JSON line, the last line of stdout):
  reload      import tf_flash; reload every saved form in DIR, run it, continue training the .keras model
  no_import   reload without importing tf_flash; report the error messages
  distribute  MirroredStrategy over 2 devices vs one device (fit, then compare weights); DIR is "cpu"
              (2 logical CPU devices) or "gpu" (the first 2 GPUs)
"""
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402


def build_model(dropout=0.0):
    """The small model every saving test uses: both layers, Keras masking, causal."""
    import keras
    from tf_flash.layers import FlashAttention, FlashMultiHeadAttention

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = FlashMultiHeadAttention(2, 4, dropout=dropout, name="mha")(x, x, use_causal_mask=True)
    heads = keras.layers.Reshape((-1, 2, 4))(x)
    heads = FlashAttention(causal=True, window=(2, 0), name="flash")(heads, heads)
    x = keras.layers.Add()([x, keras.layers.Reshape((-1, 8))(heads)])
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2, name="head")(x))


def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 20, size=(8, 6)).astype("int32")
    tokens[::2, 4:] = 0
    return tokens, rng.integers(0, 2, size=(8,)).astype("int32")


def train_and_save(directory, epochs=1, jit_compile="auto"):
    """build_model(dropout=0.1) fit on data(), saved in DIR in every form `reload` reads (a .keras file,
    model.export, tf.saved_model with a serving signature) and its logits in expected.npz. Returns (model,
    logits)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = build_model(dropout=0.1)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=jit_compile)
    tokens, labels = data()
    model.fit(tokens, labels, epochs=epochs, batch_size=4, verbose=0)
    logits = model.predict(tokens, verbose=0)
    model.save(os.path.join(directory, "model.keras"))
    model.export(os.path.join(directory, "exported"), verbose=False)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="tokens")])
    def serve(tokens):
        return {"logits": model(tokens, training=False)}

    tf.saved_model.save(model, os.path.join(directory, "saved_model"), signatures={"serving_default": serve})
    np.savez(os.path.join(directory, "expected.npz"), tokens=tokens, labels=labels, logits=logits)
    return model, logits


def run(command, directory, **env_overrides):
    """COMMAND on DIR in a fresh process: its JSON result."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env_overrides)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), command, str(directory)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_reloads(directory):
    """`reload` of what train_and_save wrote: every form gives the saved logits, and the .keras model trains
    on. Returns the result."""
    import tensorflow as tf

    result = run("reload", directory)
    # A reloaded graph may fuse the surrounding float32 ops differently; on a GPU those run in TF32.
    tol = 1e-3 if tf.config.list_physical_devices("GPU") else 1e-5
    for key in ("keras_max_diff", "export_max_diff", "tfsm_max_diff", "signature_max_diff"):
        assert result[key] < tol, (key, result)
    assert np.all(np.isfinite(result["keras_continued_loss"])) and result["keras_weights_changed"], result
    return result


def _reload(directory):
    import tensorflow as tf
    import keras
    import tf_flash  # noqa: F401  (registers the op, its gradient and the layers)

    expected = np.load(os.path.join(directory, "expected.npz"))
    tokens, labels = expected["tokens"], expected["labels"]
    result = {}

    model = keras.models.load_model(os.path.join(directory, "model.keras"))
    result["keras_max_diff"] = float(np.abs(model.predict(tokens, verbose=0) - expected["logits"]).max())
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(tokens, labels, epochs=2, batch_size=4, verbose=0)
    result["keras_continued_loss"] = [float(v) for v in history.history["loss"]]
    result["keras_weights_changed"] = any(
        not np.allclose(a, b) for a, b in zip(before, model.get_weights()))

    exported = tf.saved_model.load(os.path.join(directory, "exported"))
    result["export_max_diff"] = float(np.abs(exported.serve(tf.constant(tokens)).numpy()
                                             - expected["logits"]).max())
    layer = keras.layers.TFSMLayer(os.path.join(directory, "exported"), call_endpoint="serve")
    result["tfsm_max_diff"] = float(np.abs(np.asarray(layer(tf.constant(tokens))) - expected["logits"]).max())

    saved = tf.saved_model.load(os.path.join(directory, "saved_model"))
    outputs = saved.signatures["serving_default"](tokens=tf.constant(tokens))
    result["signature_max_diff"] = float(np.abs(list(outputs.values())[0].numpy() - expected["logits"]).max())
    # A different sequence length than the one saved: the signatures are shape-polymorphic.
    longer = np.concatenate([tokens, tokens[:, :3]], axis=1)
    result["export_longer_shape"] = list(exported.serve(tf.constant(longer)).shape)
    return result


def _no_import(directory):
    import tensorflow as tf
    import keras

    result = {}
    try:
        keras.models.load_model(os.path.join(directory, "model.keras"))
        result["keras_error"] = None
    except Exception as err:  # pylint: disable=broad-except
        result["keras_error"] = f"{type(err).__name__}: {err}"
    try:
        tf.saved_model.load(os.path.join(directory, "exported"))
        result["saved_model_error"] = None
    except Exception as err:  # pylint: disable=broad-except
        result["saved_model_error"] = f"{type(err).__name__}: {err}"
    result["tf_flash_imported"] = "tf_flash" in sys.modules
    return result


def _distribute(kind):
    import tensorflow as tf

    if kind == "cpu":
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    else:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    devices = [f"/{kind}:0", f"/{kind}:1"]
    import keras
    import tf_flash  # noqa: F401

    tokens, labels = data()

    def trained(strategy, dropout=0.0, initial=None, samples=8):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = build_model(dropout)
            if initial is not None:
                model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        start = [w.copy() for w in model.get_weights()]
        # Two steps of 4 (2 per replica under the mirrored strategy).
        history = model.fit(tokens[:samples], labels[:samples], epochs=1, batch_size=4, shuffle=False,
                            verbose=0)
        return start, model.get_weights(), history.history["loss"]

    mirrored = tf.distribute.MirroredStrategy(devices)
    start, single, single_loss = trained(tf.distribute.OneDeviceStrategy(devices[0]))
    _, multi, multi_loss = trained(mirrored, initial=start)
    _, _, dropout_loss = trained(mirrored, dropout=0.2, initial=start, samples=4)
    return {
        "devices": [d.name for d in tf.config.list_logical_devices(kind.upper())],
        "replicas": mirrored.num_replicas_in_sync,
        "max_weight_diff": float(max(np.abs(a - b).max() for a, b in zip(single, multi))),
        "weights_moved": float(max(np.abs(a - b).max() for a, b in zip(start, single))),
        "single_loss": [float(v) for v in single_loss],
        "multi_loss": [float(v) for v in multi_loss],
        "dropout_loss": [float(v) for v in dropout_loss],
    }


if __name__ == "__main__":
    command, directory = sys.argv[1], sys.argv[2]
    handler = {"reload": _reload, "no_import": _no_import, "distribute": _distribute}[command]
    print(json.dumps(handler(directory)))
