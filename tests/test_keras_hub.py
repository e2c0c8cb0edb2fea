"""KerasHub models (built from config, random weights, nothing downloaded) run tf_flash through
tf_flash.keras: a BERT encoder (keras.layers.MultiHeadAttention inside) and a Llama decoder with GQA
(KerasHub's fused_attention_op_available() gate) give the outputs and gradients of the switch off, and
run at a sequence length where the standard path's score tensor alone outgrows the whole process."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import keras

keras_hub = pytest.importorskip("keras_hub")

import tf_flash  # noqa: E402
from tf_flash import keras as flash_keras  # noqa: E402
from device_util import DEVICES, gpu_float32_bound_dtype, normal  # noqa: E402
from device_util import float32_tolerance as f32_tol  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _hook_off_after():
    yield
    flash_keras.disable()
    keras.config.enable_flash_attention()


def bert(seqlen, dropout=0.0, num_layers=2):
    return keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=num_layers, num_heads=2, hidden_dim=32,
                                         intermediate_dim=64, dropout=dropout, max_sequence_length=seqlen)


def llama(num_layers=2, heads=4, heads_kv=2, hidden=32, dtype=None):
    return keras_hub.models.LlamaBackbone(vocabulary_size=50, num_layers=num_layers, num_query_heads=heads,
                                          num_key_value_heads=heads_kv, hidden_dim=hidden, intermediate_dim=64,
                                          dtype=dtype)


def gemma(dtype=None):
    return keras_hub.models.GemmaBackbone(vocabulary_size=50, num_layers=2, num_query_heads=4,
                                          num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=8,
                                          dtype=dtype)


def _inputs(rng, kind, batch, seqlen):
    tokens = rng.integers(1, 50, size=(batch, seqlen)).astype("int32")
    lengths = [seqlen] + [max(1, seqlen * (i + 1) // (batch + 1)) for i in range(batch - 1)]
    padding = np.arange(seqlen)[None, :] < np.array(lengths)[:, None]
    tokens = np.where(padding, tokens, 0).astype("int32")
    inputs = {"token_ids": tokens, "padding_mask": padding.astype("int32")}
    if kind == "bert":
        inputs["segment_ids"] = np.zeros_like(tokens)
    return inputs


def _output(model, inputs):
    out = model(inputs)
    return out["sequence_output"] if isinstance(out, dict) else out


def _outputs_and_gradients(model, inputs, d_out):
    with tf.GradientTape() as tape:
        out = _output(model, inputs)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * d_out)
    return out, tape.gradient(loss, model.trainable_weights)


class _CountFlash:
    """Counts tf_flash.flash_attention calls (the hook reaches the op through tf_flash.ops)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.causal_with_lengths = 0  # calls served causal under kv lengths (a decoder's padding x causal mask)
        original = tf_flash.ops.flash_attention

        def counting(*args, **kwargs):
            self.calls += 1
            self.causal_with_lengths += bool(kwargs.get("causal")) and kwargs.get("kv_lengths") is not None
            return original(*args, **kwargs)

        monkeypatch.setattr(tf_flash.ops, "flash_attention", counting)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_outputs_and_gradients_match_the_switch_off(rng, monkeypatch, device, kind):
    seqlen = 37
    with tf.device(device):
        keras.utils.set_random_seed(0)
        model = bert(seqlen) if kind == "bert" else llama()
        inputs = _inputs(rng, kind, 3, seqlen)
        d_out = normal(rng, (3, seqlen, 32))
        expected, expected_grads = _outputs_and_gradients(model, inputs, d_out)
        counter = _CountFlash(monkeypatch)
        with flash_keras.enabled():
            got, got_grads = _outputs_and_gradients(model, inputs, d_out)
            graph_got = tf.function(lambda: _output(model, inputs))()
    assert counter.calls >= 2 * 2, "tf_flash did not run in every layer"  # eager + graph, 2 layers
    if kind == "llama":  # its [B, 1, T, S] padding x causal mask runs causal under kv lengths: in both
        # layers eagerly, and among the branches the graph traces (tf.cond)
        assert counter.causal_with_lengths >= 2 * 2
    atol, rtol = f32_tol(device, 5e-5), f32_tol(device, 1e-4)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=atol, rtol=rtol)
    np.testing.assert_allclose(graph_got.numpy(), expected.numpy(), atol=atol, rtol=rtol)
    pairs = []
    for weight, a, b in zip(model.trainable_weights, got_grads, expected_grads):
        assert (a is None) == (b is None), weight.path
        if b is not None:  # None: a weight the sequence output does not use (BERT's pooler)
            pairs.append((weight.path, tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy()))
    float16_grade = f32_tol(device, 1.0) != 1.0
    # At float16 grade (GPU float32, device_util) a gradient summed over tokens and layers carries rounding
    # of the order of the model's gradients, not of its own entries (the key bias's is 0 in exact
    # arithmetic): each tensor is held to 1% in norm, against the larger of its norm and a thousandth of
    # the largest gradient norm.
    largest = max(np.linalg.norm(b) for _, _, b in pairs)
    for path, a, b in pairs:
        if float16_grade:
            err = np.linalg.norm(a - b)
            assert err <= 1e-2 * max(np.linalg.norm(b), 1e-3 * largest), f"{path}: |a - b| = {err}"
        else:
            np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-4, err_msg=path)


def test_bert_with_dropout_runs_flash_in_training(rng, monkeypatch):
    """KerasHub's encoders default to dropout 0.1: Keras' MultiHeadAttention sends that down its einsum
    path; with the hook the kernel runs, with its dropout in training and none in inference."""
    keras.utils.set_random_seed(0)
    model = bert(29, dropout=0.1)
    inputs = _inputs(rng, "bert", 2, 29)
    expected = _output(model, inputs)
    counter = _CountFlash(monkeypatch)
    with flash_keras.enabled():
        inference = _output(model, inputs)
        training = model(inputs, training=True)["sequence_output"]
    assert counter.calls == 4
    np.testing.assert_allclose(inference.numpy(), expected.numpy(), atol=5e-5, rtol=1e-4)
    assert np.isfinite(training.numpy()).all() and not np.allclose(training.numpy(), expected.numpy())


def test_the_gate_is_patched_and_restored():
    from keras_hub.src.models.llama import llama_attention
    from keras_hub.src.utils import keras_utils

    original = keras_utils.fused_attention_op_available
    assert original() is False  # KerasHub's answer on TF
    with flash_keras.enabled():
        assert llama_attention.fused_attention_op_available() is True
        assert keras_utils.fused_attention_op_available() is True
    assert llama_attention.fused_attention_op_available is original
    assert keras_utils.fused_attention_op_available is original


def test_keras_hub_imported_after_enable_is_covered():
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {REPO!r})
        import tf_flash
        tf_flash.keras.enable()
        import keras_hub
        from keras_hub.src.models.llama import llama_attention
        from keras_hub.src.models.gemma import gemma_attention
        on = [llama_attention.fused_attention_op_available(), gemma_attention.fused_attention_op_available()]
        tf_flash.keras.disable()
        off = [llama_attention.fused_attention_op_available(), gemma_attention.fused_attention_op_available()]
        print(json.dumps({{"on": on, "off": off}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"on": [True, True], "off": [False, False]}


@pytest.mark.gpu
def test_gemma_gqa_on_gpu_matches_the_switch_off(rng, monkeypatch):
    """Gemma takes KerasHub's fused path only on an accelerator (running_on_gpu()), behind the gate."""
    if not tf.config.list_logical_devices("GPU"):
        pytest.skip("no GPU")
    keras.utils.set_random_seed(0)
    model = gemma()
    inputs = _inputs(rng, "gemma", 2, 41)
    d_out = normal(rng, (2, 41, 32))
    expected, expected_grads = _outputs_and_gradients(model, inputs, d_out)
    counter = _CountFlash(monkeypatch)
    with flash_keras.enabled():
        got, got_grads = _outputs_and_gradients(model, inputs, d_out)
    assert counter.calls == 2
    # float32 on the GPU may compute on float16 operands (tests/device_util.py).
    tol = 2e-2 if gpu_float32_bound_dtype() == "float16" else 1e-4
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=tol, rtol=tol)
    for a, b in zip(got_grads, expected_grads):
        assert (a is None) == (b is None)
        if b is None:
            continue
        a, b = tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy()
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-6)


# A long run in a fresh process: its peak resident memory, against the bytes of the [B, N, T, S]
# float32 score tensor Keras' standard path would materialize (before its softmax copies).
_LONG_SCRIPT = """
import json, resource, sys
sys.path.insert(0, {repo!r})
import numpy as np, tensorflow as tf, keras, keras_hub, tf_flash
tf_flash.keras.enable()
seqlen, kind = {seqlen}, {kind!r}
keras.utils.set_random_seed(0)
if kind == "bert":
    model = keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=1, num_heads=4, hidden_dim=32,
                                          intermediate_dim=32, dropout=0.0, max_sequence_length=seqlen)
else:
    model = keras_hub.models.LlamaBackbone(vocabulary_size=50, num_layers=1, num_query_heads=4,
                                           num_key_value_heads=2, hidden_dim=32, intermediate_dim=32)
tokens = np.random.default_rng(0).integers(1, 50, size=(1, seqlen)).astype("int32")
inputs = {{"token_ids": tokens, "padding_mask": np.ones_like(tokens)}}
if kind == "bert":
    inputs["segment_ids"] = np.zeros_like(tokens)
with tf.GradientTape() as tape:
    out = model(inputs)
    out = out["sequence_output"] if isinstance(out, dict) else out
    loss = tf.reduce_mean(out ** 2)
grads = tape.gradient(loss, model.trainable_weights)
finite = bool(np.isfinite(out.numpy()).all()) and all(bool(np.isfinite(tf.convert_to_tensor(g).numpy()).all())
                                                      for g in grads if g is not None)
print(json.dumps({{"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "finite": finite}}))
"""


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_long_sequence_runs_below_the_score_tensor_size(kind):
    """Forward and backward at 16384 tokens, 4 heads: Keras' standard path would hold a 4 GiB float32
    score tensor per layer (plus its softmax copies); the whole process with the hook peaks below that.
    (Keras' models still build a [B, T, S] boolean mask, 256 MiB here, which the hook passes through.)"""
    seqlen, heads = 16384, 4
    proc = subprocess.run([sys.executable, "-c", _LONG_SCRIPT.format(repo=REPO, seqlen=seqlen, kind=kind)],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    score_bytes = heads * seqlen * seqlen * 4
    assert result["finite"]
    assert result["peak_rss_bytes"] < score_bytes, result


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_generate_gives_the_switch_offs_tokens_and_decodes_on_the_decode_path(kind, dtype, device, monkeypatch):
    """CausalLM.generate under jit_compile (greedy): prefill and decoding steps through tf_flash, the
    decoding steps (one token against a cache past _decode's minimum) on the decode path, the same tokens
    as with the switch off. The model is small, so its greedy choices stand clear of bfloat16's rounding (a
    1B Llama's need not: docs/performance.md)."""
    from tf_flash import _decode  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    with tf.device(device):
        backbone = llama(dtype=dtype) if kind == "llama" else gemma(dtype=dtype)
    task = keras_hub.models.LlamaCausalLM if kind == "llama" else keras_hub.models.GemmaCausalLM
    seqlen, rng = 2056, np.random.default_rng(7)
    padding = (np.arange(seqlen)[None, :] < np.array([[2048], [2030]])).astype("int32")  # prompts to extend
    prompt = {"token_ids": rng.integers(1, 50, size=(2, seqlen)).astype("int32") * padding, "padding_mask": padding}

    def generate():
        with tf.device(device):
            model = task(backbone=backbone, preprocessor=None)
            model.compile(sampler="greedy", jit_compile=True)
            return model.generate(prompt, stop_token_ids=None)["token_ids"]

    off = generate()
    split_counts = []
    original = _decode.attend
    monkeypatch.setattr(_decode, "attend", lambda *args: split_counts.append(args[-1]) or original(*args))
    flash_keras.enable()
    on = generate()
    np.testing.assert_array_equal(on, off)
    # KerasHub's Gemma reaches the fused attention (so tf_flash) only on a GPU (its own gate).
    if kind == "llama" or "GPU" in device:
        assert split_counts, "the decoding steps did not take the decode path"
    if kind == "llama":  # KerasHub repeats K and V to every query head; the kernels get its 2 KV heads
        assert set(split_counts) == {2}, split_counts
