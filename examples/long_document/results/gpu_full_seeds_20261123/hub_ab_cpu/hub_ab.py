"""A/B on CPU: KerasHub BertBackbone (full-preset sizes, context 512) with Keras' flash switch served by
tf_flash vs Keras' standard attention, float32 or mixed_bfloat16: does the hub model's failure to learn on
the GPU full run come from the kernels or from the recipe?

    python3 hub_ab.py on|off LEARNING_RATE EPOCHS [none|mixed_bfloat16 [WARMUP_EPOCHS]]   (data/linux-doc from prepare_data.py)
"""
import os, sys, time
EXAMPLE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, EXAMPLE)
import numpy as np, keras, tensorflow as tf
import common
switch, lr, epochs = sys.argv[1] == "on", float(sys.argv[2]), int(sys.argv[3])
if len(sys.argv) > 4 and sys.argv[4] != "none": keras.mixed_precision.set_global_policy(sys.argv[4])
warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 0  # train.py's hub recipe: warm-up epochs, cosine decay
texts, labels, names, _ = common.load_tree(os.path.join(EXAMPLE, "..", "..", "data", "linux-doc"))
train, val, test = common.stratified_split(labels, seed=1337)
vocab = common.build_vocabulary([texts[i] for i in train], 30000)
tokens = common.tokenize(texts, vocab)
common.set_seed(1337)
b = lambda idx, sh: common.LengthBucketedBatches([tokens[i] for i in idx], labels[idx], 512, 16, shuffle=sh, seed=1337)
model = common.build_hub_classifier(len(vocab), len(names), 512, 256, 4, 512, 4, 0.1)
import train as train_script
train_batches = b(train, True)
schedule = train_script.learning_rate(dict(attention="hub", learning_rate=lr, hub_learning_rate=lr,
                                    hub_warmup_epochs=warmup, epochs=epochs), train_batches.num_batches)
model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"], jit_compile=False)
import contextlib
ctx = common.import_tf_flash().keras.enabled() if switch else contextlib.nullcontext()
t = time.time()
with ctx:
    h = model.fit(train_batches.dataset(), validation_data=b(val, False).dataset(), epochs=epochs, verbose=2)
print(f"RESULT {sys.argv[4:]} switch={'on' if switch else 'off'} lr={lr}: loss {[round(x, 3) for x in h.history['loss']]} "
      f"val_acc {[round(x, 3) for x in h.history['val_accuracy']]} ({time.time() - t:.0f}s)", flush=True)
