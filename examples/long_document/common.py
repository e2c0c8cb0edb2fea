"""Shared pieces of the long-document example: data, split, tokenization, batching, model, metrics.

Importing this module registers the example's own Keras layer (``PositionEmbedding``), so
``keras.models.load_model`` finds it; ``import tf_flash`` registers the attention layers.
"""
import hashlib
import math
import os
import random
import sys

import numpy as np

import cli

cli.import_tensorflow()  # without its start-up notices where the script asked for quiet

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

SHORT_CONTEXT = 512  # documents longer than this many tokens are the "long" subset in the results


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def load_tree(data_dir):
    """Reads a folder-per-class tree (keras.utils.text_dataset_from_directory convention).

    Returns (texts, labels, class_names, paths); labels index into the sorted class names.
    """
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"data directory not found. Received: data_dir={data_dir!r} "
            "(run examples/long_document/prepare_data.py, or pass a folder-per-class tree)")
    class_names = sorted(d for d in os.listdir(data_dir)
                         if os.path.isdir(os.path.join(data_dir, d)) and not d.startswith("."))
    if len(class_names) < 2:
        raise ValueError(f"need at least 2 class folders in data_dir. Received: data_dir={data_dir!r} "
                         f"with classes {class_names}")
    texts, labels, paths = [], [], []
    for label, name in enumerate(class_names):
        folder = os.path.join(data_dir, name)
        for dirpath, _, files in sorted(os.walk(folder)):
            for f in sorted(files):
                if f.startswith("."):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, "rb") as fh:
                    texts.append(fh.read().decode("utf-8", errors="replace"))
                labels.append(label)
                paths.append(path)
    return texts, np.asarray(labels, np.int32), class_names, paths


def stratified_split(labels, val_frac=0.1, test_frac=0.1, seed=1337):
    """Index arrays (train, val, test), each class split in the same proportions (>= 1 doc each)."""
    if not (0 < val_frac < 1 and 0 < test_frac < 1 and val_frac + test_frac < 1):
        raise ValueError(f"fractions must be in (0, 1) and sum below 1. Received: "
                         f"val_frac={val_frac}, test_frac={test_frac}")
    rng = np.random.RandomState(seed)
    train, val, test = [], [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_val = max(1, int(round(len(idx) * val_frac)))
        n_test = max(1, int(round(len(idx) * test_frac)))
        val += idx[:n_val].tolist()
        test += idx[n_val:n_val + n_test].tolist()
        train += idx[n_val + n_test:].tolist()
    return tuple(np.sort(np.asarray(s, np.int64)) for s in (train, val, test))


def load_split(data_dir, seed=1337, max_docs_per_class=0):
    """The documents of a run: the tree, at most max_docs_per_class per class (0: all), split.

    Returns (texts, labels, class_names, paths, (train, val, test)); train.py and predict.py's check
    of a model against a data set both use it, so they see the same split.
    """
    texts, labels, class_names, paths = load_tree(data_dir)
    if max_docs_per_class:
        keep = np.concatenate([np.flatnonzero(labels == c)[:max_docs_per_class]
                               for c in range(len(class_names))])
        texts, labels, paths = [texts[i] for i in keep], labels[keep], [paths[i] for i in keep]
    return texts, labels, class_names, paths, stratified_split(labels, seed=seed)


def length_stats(lengths):
    lengths = np.asarray(lengths)
    return {"median": int(np.median(lengths)), "p90": int(np.percentile(lengths, 90)),
            "max": int(lengths.max()), "mean": int(lengths.mean())}


# ----------------------------------------------------------------------------------------------
# Tokenization (Keras TextVectorization; vocabulary from the training split only)
# ----------------------------------------------------------------------------------------------
def make_vectorizer(vocabulary=None, max_tokens=None, output_sequence_length=None, ragged=False):
    return keras.layers.TextVectorization(
        max_tokens=max_tokens, standardize="lower_and_strip_punctuation", split="whitespace",
        output_mode="int", output_sequence_length=output_sequence_length, ragged=ragged,
        vocabulary=vocabulary, name="text_vectorization")


def build_vocabulary(train_texts, vocab_size):
    vec = make_vectorizer(max_tokens=vocab_size)
    vec.adapt(tf.data.Dataset.from_tensor_slices(train_texts).batch(64))
    return vec.get_vocabulary()


def vocabulary_fingerprint(vocabulary):
    """SHA-256 of the vocabulary (token ids depend on its order): models and runs compare by it."""
    return hashlib.sha256("\n".join(vocabulary).encode("utf-8")).hexdigest()


def tokenize(texts, vocabulary, batch_size=64):
    """Full-length int32 token ids of every text (no truncation, no padding)."""
    vec = make_vectorizer(vocabulary=vocabulary, ragged=True)
    out = []
    for i in range(0, len(texts), batch_size):
        rag = vec(tf.constant(texts[i:i + batch_size]))
        out += [np.asarray(r, np.int32) for r in rag.numpy()]
    return out


# ----------------------------------------------------------------------------------------------
# Batching: documents of similar length share a batch, each batch is padded to a multiple of
# `pad_to` tokens (at most `context`). Padding is id 0, which the embedding masks.
# ----------------------------------------------------------------------------------------------
class LengthBucketedBatches:
    def __init__(self, tokens, labels, context, batch_size, shuffle=False, seed=0, pad_to=128,
                 pool_batches=32):
        self.tokens = [t[:context] for t in tokens]
        self.labels = np.asarray(labels, np.int32)
        self.context, self.batch_size, self.shuffle = context, batch_size, shuffle
        self.seed, self.pad_to, self.pool = seed, min(pad_to, context), pool_batches * batch_size
        self.epoch = 0
        self.num_batches = math.ceil(len(self.tokens) / batch_size)

    def batch_indices(self):
        n = len(self.tokens)
        lengths = np.array([len(t) for t in self.tokens])
        if not self.shuffle:
            order = np.argsort(lengths, kind="stable")
            return [order[i:i + self.batch_size] for i in range(0, n, self.batch_size)]
        rng = np.random.RandomState(self.seed + self.epoch)
        self.epoch += 1
        perm = rng.permutation(n)
        batches = []
        for i in range(0, n, self.pool):  # sort within pools of documents, then batch
            pool = perm[i:i + self.pool]
            pool = pool[np.argsort(lengths[pool], kind="stable")]
            batches += [pool[j:j + self.batch_size] for j in range(0, len(pool), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def padded(self, idx):
        longest = max(1, max(len(self.tokens[i]) for i in idx))
        width = min(self.context, self.pad_to * math.ceil(longest / self.pad_to))
        x = np.zeros((len(idx), width), np.int32)
        for row, i in enumerate(idx):
            x[row, :len(self.tokens[i])] = self.tokens[i]
        return x

    def __iter__(self):
        for idx in self.batch_indices():
            yield self.padded(idx), self.labels[idx]

    def dataset(self):
        ds = tf.data.Dataset.from_generator(
            self.__iter__, output_signature=(tf.TensorSpec((None, None), tf.int32),
                                             tf.TensorSpec((None,), tf.int32)))
        return ds.apply(tf.data.experimental.assert_cardinality(self.num_batches)).prefetch(2)

    def order(self):
        """Document order of an unshuffled pass (to map predictions back)."""
        return np.concatenate(self.batch_indices())


    def token_stats(self):
        """(real tokens, token slots, distinct batch shapes) of one pass: the real tokens are the documents'
        (cut to the context), the slots every token of the padded batches. A shuffled pass's batches are
        those of the first training epoch (the epochs differ little)."""
        import copy

        batches = copy.copy(self).batch_indices()  # a copy: the epoch counter of the training pass stays
        widths = [self.padded(idx).shape[1] for idx in batches]
        slots = sum(len(idx) * width for idx, width in zip(batches, widths))
        return sum(len(t) for t in self.tokens), slots, len(set(widths))


# ----------------------------------------------------------------------------------------------
# Packing (--pack): several documents in each row of exactly `context` tokens, told apart by segment ids,
# so every batch has one static shape and almost every token is a real one.
# ----------------------------------------------------------------------------------------------
def max_documents_per_row(lengths, context):
    """The most documents (cut to `context`, an empty one counting as one token) that one row of `context`
    tokens can hold: the shortest ones, as many as fit. Every packing fits in it, whatever the order."""
    fitted = np.sort(np.maximum(np.minimum(np.asarray(lengths), context), 1))
    return max(1, int(np.searchsorted(np.cumsum(fitted), context, side="right")))


def first_fit_order(lengths, context):
    """An order of the documents (lengths already cut to `context`) in which packing them one after the
    other (next fit, as `pack_documents` does) wastes little: first fit decreasing. The longest documents
    open rows, and each shorter one goes into the first row with room for it; the documents are then listed
    row by row. In a random order a document that does not fit the room left closes the row instead (at
    512 tokens, where half the documents fill a row alone, that leaves 18% padding on the kernel docs)."""
    lengths = np.asarray(lengths)
    rows, room = [], np.zeros(0, np.int64)
    for index in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(room >= lengths[index])
        if len(fits):
            rows[fits[0]].append(int(index))
            room[fits[0]] -= lengths[index]
        else:
            rows.append([int(index)])
            room = np.append(room, context - lengths[index])
    return [index for row in rows for index in row]


class PackedBatches:
    """Documents packed by `tf_flash.data.pack_documents` into rows of `context` tokens, batched.

    Each document is cut to its first `context` tokens (`long_documents="truncate"`: the bucketed batches
    see the same tokens) and classified once: a row holds up to `max_documents` documents, each with its
    label in a slot, and the model pools each document alone (`segment_ids`). The documents are packed
    once, in the order of `first_fit_order` (little padding); training reshuffles the rows every epoch.
    The last batch is filled with rows of padding (weight 0), so every batch is [batch_size, context]: one
    shape, one XLA compilation. An empty document is one out-of-vocabulary token (id 1), so that it is
    still classified, as in the bucketed batches.

    dataset() yields ({"token_ids", "segment_ids", "positions"}: [batch, context] int32, labels
    [batch, max_documents] int32, weights [batch, max_documents] float32: 1 for a document's slot, 0 for an
    unused one).
    """

    def __init__(self, tokens, labels, context, batch_size, max_documents, shuffle=False, seed=0):
        import tf_flash

        self.tokens = [np.asarray(t[:context], np.int32) if len(t) else np.ones(1, np.int32) for t in tokens]
        self.labels = np.asarray(labels, np.int32)
        self.context, self.batch_size, self.max_documents = context, batch_size, max_documents
        self.shuffle, self.seed = shuffle, seed
        # The packing order; document_ids of the rows index it, self.order maps them back.
        self.order = np.asarray(first_fit_order([len(t) for t in self.tokens], context), np.int64)
        ordered = [self.tokens[i] for i in self.order]
        ragged = tf.RaggedTensor.from_row_lengths(np.concatenate(ordered), [len(t) for t in ordered])
        docs = tf.data.Dataset.from_tensor_slices({"tokens": ragged, "label": self.labels[self.order]})
        rows = tf_flash.data.pack_documents(docs, context, token_key="tokens", long_documents="truncate",
                                            max_documents_per_row=max_documents)
        self.rows = rows.cache()
        # One pass packs the documents (and fills the cache); packing filters, so the count comes from it.
        self.num_rows = int(self.rows.reduce(0, lambda count, _: count + 1))
        self.num_batches = math.ceil(self.num_rows / batch_size)

    def _fill_batch(self, rows):
        """A batch of fewer rows completed with rows of padding (document_ids -1, so weight 0)."""
        missing = self.batch_size - tf.shape(rows["token_ids"])[0]
        filled = {}
        for key, value in rows.items():
            pad = [[0, missing]] + [[0, 0]] * (value.shape.rank - 1)
            filled[key] = tf.pad(value, pad, constant_values=-1 if key == "document_ids" else 0)
            filled[key] = tf.ensure_shape(filled[key], [self.batch_size] + value.shape.as_list()[1:])
        return filled

    def _batched(self, reshuffle):
        rows = self.rows
        if reshuffle:
            rows = rows.shuffle(self.num_rows, seed=self.seed, reshuffle_each_iteration=True)
        return rows.batch(self.batch_size).map(self._fill_batch)

    def dataset(self):
        def to_example(rows):
            inputs = {key: tf.cast(rows[key], tf.int32) for key in ("token_ids", "segment_ids", "positions")}
            return inputs, rows["label"], tf.cast(rows["document_ids"] >= 0, tf.float32)

        ds = self._batched(self.shuffle).map(to_example)
        return ds.apply(tf.data.experimental.assert_cardinality(self.num_batches)).prefetch(2)

    def slots(self):
        """The index (in `tokens`) of the document in every slot, [batches x batch_size, max_documents]
        (-1: no document), in the order of an unshuffled pass of dataset() (to map predictions back)."""
        ids = np.concatenate([batch["document_ids"].numpy() for batch in self._batched(False)])
        return np.where(ids >= 0, self.order[np.maximum(ids, 0)], -1)

    def token_stats(self):
        """(real tokens, token slots, distinct batch shapes) of one pass (see LengthBucketedBatches)."""
        return sum(len(t) for t in self.tokens), self.num_batches * self.batch_size * self.context, 1


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
@keras.saving.register_keras_serializable(package="tf_flash_examples")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned position embedding to token embeddings [B, S, D]; passes the Keras mask on."""

    def __init__(self, max_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1. Received: max_length={max_length}")
        self.max_length = int(max_length)
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, input_shape):
        self.embeddings = self.add_weight(name="embeddings", shape=(self.max_length, input_shape[-1]),
                                          initializer=self.initializer)

    def call(self, inputs):
        length = keras.ops.shape(inputs)[1]
        return inputs + keras.ops.cast(self.embeddings[None, :length], inputs.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length,
                "initializer": keras.initializers.serialize(self.initializer)}


class BestOnValidation(keras.callbacks.Callback):
    """Keeps the model of the best epoch on the validation split.

    Best: the highest validation accuracy, ties broken by the lower validation loss (a small
    validation split often ties). Training stops after `patience` epochs without a better epoch
    (0: never); at the end the best epoch's weights are restored unless restore=False (the last
    epoch's weights stay). best_epoch is 1-based.
    """

    def __init__(self, patience=0, restore=True):
        super().__init__()
        self.patience, self.restore = int(patience), bool(restore)
        self.best = self.best_epoch = self.best_weights = self.stopped_epoch = None
        self.wait = 0

    def on_train_begin(self, logs=None):
        self.best = self.best_epoch = self.best_weights = self.stopped_epoch = None
        self.wait = 0

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        if logs.get("val_accuracy") is None:
            return
        key = (float(logs["val_accuracy"]), -float(logs.get("val_loss", 0.0)))
        if self.best is None or key > self.best:
            self.best, self.best_epoch, self.wait = key, epoch + 1, 0
            if self.restore:
                self.best_weights = [np.array(w) for w in self.model.get_weights()]
            return
        self.wait += 1
        if self.patience and self.wait >= self.patience:
            self.stopped_epoch = epoch + 1
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.restore and self.best_weights is not None:
            self.model.set_weights(self.best_weights)


def import_tf_flash():
    """`import tf_flash` (loads the op library, registers the layers); falls back to this checkout."""
    try:
        import tf_flash
    except ModuleNotFoundError:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if not os.path.isdir(os.path.join(repo, "tf_flash")):
            raise
        sys.path.insert(0, repo)
        import tf_flash
    return tf_flash


def attention_class(attention):
    if attention == "flash":
        return import_tf_flash().layers.FlashMultiHeadAttention
    if attention == "keras":
        return keras.layers.MultiHeadAttention
    raise ValueError(f"attention must be 'flash' or 'keras'. Received: attention={attention!r}")


def import_keras_hub():
    try:
        import keras_hub
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("the KerasHub encoder (--hub-contexts) needs keras-hub: "
                                  "`pip install keras-hub`") from err
    return keras_hub


@keras.saving.register_keras_serializable(package="tf_flash_examples")
class BertInputs(keras.layers.Layer):
    """Token ids [B, S] (0 = padding) -> the inputs of a KerasHub BertBackbone (one segment)."""

    def call(self, tokens):
        return {"token_ids": tokens, "segment_ids": keras.ops.zeros_like(tokens),
                "padding_mask": keras.ops.not_equal(tokens, 0)}

    def compute_output_spec(self, tokens):
        spec = keras.KerasTensor(tokens.shape, dtype=tokens.dtype)
        return {"token_ids": spec, "segment_ids": keras.KerasTensor(tokens.shape, dtype=tokens.dtype),
                "padding_mask": keras.KerasTensor(tokens.shape, dtype="bool")}


def build_hub_classifier(vocab_size, num_classes, context, embed_dim=64, num_heads=2, ff_dim=128,
                         num_layers=2, dropout=0.1):
    """The same task on a KerasHub encoder: `keras_hub.models.BertBackbone` built from its config
    (random weights, nothing downloaded), position embeddings sized to the context.

    Its attention is `keras.layers.MultiHeadAttention`; run it under `tf_flash.keras.enabled()` and
    that layer calls tf_flash's kernels (KerasHub's padding mask becomes kv lengths, its dropout the
    kernel's). Masked mean of the sequence output -> Dense softmax, as the other model.
    """
    keras_hub = import_keras_hub()
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    inputs = BertInputs(name="bert_inputs")(tokens)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocab_size, num_layers=num_layers, num_heads=num_heads, hidden_dim=embed_dim,
        intermediate_dim=ff_dim, dropout=dropout, max_sequence_length=context, num_segments=1,
        name="bert_backbone")
    x = backbone(inputs)["sequence_output"]
    x = keras.layers.GlobalAveragePooling1D(name="masked_mean")(x, mask=inputs["padding_mask"])
    x = keras.layers.Dropout(dropout)(x)
    probs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="classifier")(x)
    return keras.Model(tokens, probs, name=f"long_doc_hub_{context}")


def build_classifier(vocab_size, num_classes, context, embed_dim=64, num_heads=2, ff_dim=128,
                     num_layers=2, dropout=0.1, attention="flash"):
    """Token ids [B, S] (0 = padding, S <= context) -> class probabilities [B, num_classes].

    Pre-LayerNorm transformer encoder. Embedding(mask_zero=True) creates the padding mask and Keras
    masking carries it through the blocks into the attention layers (query and value masks) and
    into the masked mean pooling.
    """
    mha = attention_class(attention)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, embed_dim, mask_zero=True, name="token_embedding")(tokens)
    x = PositionEmbedding(context, name="position_embedding")(x)
    x = keras.layers.Dropout(dropout)(x)
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln1")(x)
        h = mha(num_heads=num_heads, key_dim=embed_dim // num_heads, name=f"block{i}_attention")(h, h)
        x = keras.layers.Add(name=f"block{i}_add1")([x, keras.layers.Dropout(dropout)(h)])
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(ff_dim, activation="gelu", name=f"block{i}_ff1")(h)
        h = keras.layers.Dense(embed_dim, name=f"block{i}_ff2")(h)
        x = keras.layers.Add(name=f"block{i}_add2")([x, keras.layers.Dropout(dropout)(h)])
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    x = keras.layers.GlobalAveragePooling1D(name="masked_mean")(x)
    x = keras.layers.Dropout(dropout)(x)
    probs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="classifier")(x)
    return keras.Model(tokens, probs, name=f"long_doc_{attention}_{context}")


@keras.saving.register_keras_serializable(package="tf_flash_examples")
class DocumentMean(keras.layers.Layer):
    """The mean of hidden states [B, L, D] over each document of each packed row -> [B, num_documents, D]
    (`tf_flash.data.segment_mean`: slot j is segment id j + 1; padding, id 0, is left out)."""

    def __init__(self, num_documents, **kwargs):
        super().__init__(**kwargs)
        self.num_documents = int(num_documents)

    def call(self, hidden, segment_ids):
        return import_tf_flash().data.segment_mean(hidden, segment_ids, self.num_documents)

    def get_config(self):
        return {**super().get_config(), "num_documents": self.num_documents}


def build_packed_classifier(vocab_size, num_classes, context, max_documents, embed_dim=64, num_heads=2,
                            ff_dim=128, num_layers=2, dropout=0.1):
    """The classifier of build_classifier on packed rows: token ids, segment ids and positions [B, context]
    -> class probabilities of every document slot [B, max_documents, num_classes].

    The same blocks, with the attention kept inside each document by `segment_ids` (padding, id 0, attends
    only to padding), the position embedding read at each token's position within its document, and the
    masked mean taken per document (DocumentMean) instead of per row.
    """
    mha = import_tf_flash().layers.FlashMultiHeadAttention
    token_ids = keras.Input((context,), dtype="int32", name="token_ids")
    segment_ids = keras.Input((context,), dtype="int32", name="segment_ids")
    positions = keras.Input((context,), dtype="int32", name="positions")
    x = keras.layers.Embedding(vocab_size, embed_dim, name="token_embedding")(token_ids)
    # PositionEmbedding's table and initializer, indexed by position within the document.
    position = keras.layers.Embedding(context, embed_dim, embeddings_initializer="glorot_uniform",
                                      name="position_embedding")(positions)
    x = keras.layers.Add(name="embeddings")([x, position])
    x = keras.layers.Dropout(dropout)(x)
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln1")(x)
        h = mha(num_heads=num_heads, key_dim=embed_dim // num_heads, name=f"block{i}_attention")(
            h, h, segment_ids=segment_ids)
        x = keras.layers.Add(name=f"block{i}_add1")([x, keras.layers.Dropout(dropout)(h)])
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(ff_dim, activation="gelu", name=f"block{i}_ff1")(h)
        h = keras.layers.Dense(embed_dim, name=f"block{i}_ff2")(h)
        x = keras.layers.Add(name=f"block{i}_add2")([x, keras.layers.Dropout(dropout)(h)])
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    x = DocumentMean(max_documents, name="document_mean")(x, segment_ids)
    x = keras.layers.Dropout(dropout)(x)
    probs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="classifier")(x)
    return keras.Model({"token_ids": token_ids, "segment_ids": segment_ids, "positions": positions}, probs,
                       name=f"long_doc_packed_{context}")


# ----------------------------------------------------------------------------------------------
# Context parallelism (--context-parallel N): each document's sequence split over N replicas
# ----------------------------------------------------------------------------------------------
def replica_strategy(replicas):
    """A MirroredStrategy over `replicas` devices: the first GPUs where there are enough, else as many logical
    CPU devices (made here: call it before TensorFlow runs its first op, or after ensure_cpu_replicas)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < replicas:
            raise ValueError(f"--context-parallel {replicas} needs {replicas} GPUs. Received: {len(gpus)} visible")
        return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
    ensure_cpu_replicas(replicas)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def ensure_cpu_replicas(replicas):
    """Splits the CPU into `replicas` logical devices (one process, as tf.distribute tests do); a no-op where
    that many exist. TensorFlow fixes its devices at its first op, so this comes before it."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu) or []
    if len(configured) >= replicas:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    except RuntimeError as err:
        raise RuntimeError(f"--context-parallel {replicas} on a CPU needs {replicas} logical CPU devices, made "
                           f"before TensorFlow starts; it had started with {max(1, len(configured))}") from err


def _parallel():
    return import_tf_flash().parallel


@keras.saving.register_keras_serializable(package="tf_flash_examples")
class SequenceShard(keras.layers.Layer):
    """Inside the replica function of a strategy with several replicas: this replica's shard of a [B, S, ...]
    sequence (`tf_flash.parallel.shard_sequence`, zigzag: the layout FlashMultiHeadAttention(context_parallel=
    True) expects). Elsewhere (one device, building the model) the identity, so the same model runs whole."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x):
        return _parallel().shard_sequence(x) if _parallel().in_replica_context() else x

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="tf_flash_examples")
class SequencePositions(keras.layers.Layer):
    """Token ids [B, S] -> their positions in the sequence, [B, S] int32 (before any sharding: a shard's
    positions are then those of the whole sequence, as the position embedding must see them)."""

    def call(self, tokens):
        return tf.broadcast_to(tf.range(tf.shape(tokens)[1])[tf.newaxis], tf.shape(tokens))

    def compute_output_spec(self, tokens):
        return keras.KerasTensor(tokens.shape, dtype="int32")


@keras.saving.register_keras_serializable(package="tf_flash_examples")
class SequenceMean(keras.layers.Layer):
    """The masked mean of [B, S, D] over the sequence (GlobalAveragePooling1D's), summed over the replicas
    when the sequence is sharded: every replica then holds the whole sequence's mean, and so the whole
    loss (Keras scales each replica's loss by 1/replicas and sums the gradients: exact)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x, mask=None):
        weight = tf.ones(tf.shape(x)[:2], x.dtype) if mask is None else tf.cast(mask, x.dtype)
        total = tf.reduce_sum(x * weight[..., tf.newaxis], axis=1)
        count = tf.reduce_sum(weight, axis=1, keepdims=True)
        if _parallel().in_replica_context():
            total, count = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM,
                                                                         [total, count])
        return total / tf.maximum(count, 1.0)

    def compute_mask(self, x, mask=None):
        return None

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])


def build_sharded_classifier(vocab_size, num_classes, context, embed_dim=64, num_heads=2, ff_dim=128,
                             num_layers=2, dropout=0.1):
    """build_classifier's encoder for sequences split over the replicas of a strategy: token ids
    [B, context] (0 = padding, the whole sequence on every replica) -> class probabilities.

    Each replica takes its zigzag shard of the tokens and of their positions (SequenceShard), embeds it
    (positions of the whole sequence), runs the blocks on its shard with
    FlashMultiHeadAttention(context_parallel=True) (attention over the whole sequence, the shards' padding
    masks gathered) and pools with the masked mean summed over the replicas (SequenceMean). Outside a
    strategy every layer is the plain one: the same weights classify whole sequences on one device.
    """
    mha = import_tf_flash().layers.FlashMultiHeadAttention
    tokens = keras.Input((context,), dtype="int32", name="tokens")
    positions = SequenceShard(name="position_shard")(SequencePositions(name="positions")(tokens))
    shard = SequenceShard(name="token_shard")(tokens)
    x = keras.layers.Embedding(vocab_size, embed_dim, mask_zero=True, name="token_embedding")(shard)
    position = keras.layers.Embedding(context, embed_dim, embeddings_initializer="glorot_uniform",
                                      name="position_embedding")(positions)
    x = keras.layers.Add(name="embeddings")([x, position])
    x = keras.layers.Dropout(dropout)(x)
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln1")(x)
        h = mha(num_heads=num_heads, key_dim=embed_dim // num_heads, context_parallel=True,
                name=f"block{i}_attention")(h, h)
        x = keras.layers.Add(name=f"block{i}_add1")([x, keras.layers.Dropout(dropout)(h)])
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(ff_dim, activation="gelu", name=f"block{i}_ff1")(h)
        h = keras.layers.Dense(embed_dim, name=f"block{i}_ff2")(h)
        x = keras.layers.Add(name=f"block{i}_add2")([x, keras.layers.Dropout(dropout)(h)])
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    x = SequenceMean(name="masked_mean")(x)
    x = keras.layers.Dropout(dropout)(x)
    probs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name="classifier")(x)
    return keras.Model(tokens, probs, name=f"long_doc_sharded_{context}")


def replicated(strategy, dataset):
    """A distributed dataset in which every replica gets every batch of `dataset` (repeated without end:
    give fit its steps): each replica then takes its own shard of the same documents. With one input
    pipeline, tf.distribute hands consecutive elements to the replicas in turn."""
    def per_pipeline(context):
        return dataset.repeat().flat_map(
            lambda *batch: tf.data.Dataset.from_tensors(batch).repeat(context.num_replicas_in_sync))
    return strategy.distribute_datasets_from_function(per_pipeline)


def build_text_model(classifier, vocabulary, context):
    """Raw strings [B] -> probabilities: TextVectorization (fixed vocabulary) + the classifier."""
    text = keras.Input((), dtype="string", name="text")
    tokens = make_vectorizer(vocabulary=vocabulary, output_sequence_length=context)(text)
    return keras.Model(text, classifier(tokens), name=classifier.name + "_text")


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------
def accuracy(y_true, y_pred):
    return float(np.mean(np.asarray(y_true) == np.asarray(y_pred))) if len(y_true) else float("nan")


def macro_f1(y_true, y_pred, num_classes):
    """Mean F1 over the classes present in y_true or y_pred (as sklearn's f1_score(average='macro'))."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    f1s = []
    for c in range(num_classes):
        tp = np.sum((y_true == c) & (y_pred == c))
        fp = np.sum((y_true != c) & (y_pred == c))
        fn = np.sum((y_true == c) & (y_pred != c))
        if tp + fp + fn == 0:
            continue
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(f1s)) if f1s else float("nan")


def chance_level(labels, train, test, long_mask):
    """The accuracy of always answering the training split's most frequent class: on the test split,
    and on its documents longer than SHORT_CONTEXT tokens (long_mask over the test split)."""
    labels = np.asarray(labels)
    majority = int(np.bincount(labels[train]).argmax())
    hits = labels[test] == majority
    long_mask = np.asarray(long_mask, bool)
    return {"class_index": majority, "accuracy": float(hits.mean()),
            "long_accuracy": float(hits[long_mask].mean()) if long_mask.any() else None,
            "test_docs": int(len(test)), "long_docs": int(long_mask.sum())}


def p_value_above_chance(accuracy, n, chance):
    """One-sided binomial test: the probability that a classifier right with probability `chance`
    gets at least accuracy * n of n documents right."""
    k = int(round(accuracy * n))
    if n == 0 or chance <= 0:
        return 0.0 if k > 0 else 1.0
    if chance >= 1:
        return 1.0

    def log_pmf(i):
        return (math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                + i * math.log(chance) + (n - i) * math.log1p(-chance))
    return float(min(1.0, sum(math.exp(log_pmf(i)) for i in range(k, n + 1))))


def beats_chance(accuracy, n, chance, alpha=0.05):
    """True when `accuracy` on n test documents is above `chance` beyond what luck gives (p < alpha)."""
    return accuracy is not None and accuracy > chance and p_value_above_chance(accuracy, n, chance) < alpha


def chance_advice(train_docs, smallest_class, test_docs, epochs, train_accuracy, chance):
    """Why a model may not have beaten chance and what to try, from the run's numbers: a list of
    sentences."""
    reasons, tries = [], []
    if (smallest_class is not None and smallest_class < 50) or train_docs < 200:
        reasons.append(f"few documents: {train_docs} for training"
                       + (f", {smallest_class} in the smallest class" if smallest_class is not None else ""))
        tries.append("more documents (a hundred or more per class)")
    if train_accuracy is not None and train_accuracy < chance + 0.1:
        reasons.append(f"the model did not fit even its training documents (training accuracy "
                       f"{train_accuracy:.2f} after {epochs} epoch{'s' if epochs != 1 else ''})")
        tries.append("more epochs (--epochs 20: the best epoch on validation is kept) or a higher "
                     "--learning-rate")
    elif train_accuracy is not None and train_accuracy > 0.9:
        reasons.append(f"it learned its training documents (training accuracy {train_accuracy:.2f}) "
                       f"but not what generalizes")
        tries.append("more documents, or a smaller model and shorter context (--contexts 512)")
    if test_docs < 100:
        se = math.sqrt(max(chance * (1 - chance), 1e-9) / max(test_docs, 1))
        reasons.append(f"a small test split: {test_docs} documents, one standard error ~{se:.2f}")
        tries.append("--seeds 3 to see the spread between runs")
    if not tries:
        tries.append("more epochs (--epochs 10), more documents, or --seeds 3 to see the spread")
    return reasons, tries


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    keras.utils.set_random_seed(seed)
