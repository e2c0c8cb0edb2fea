#!/usr/bin/env bash
# The README's first command: long-document classification with FlashMultiHeadAttention.
#
#   bash scripts/example.sh                 # install, prepare data, train the default CPU config,
#                                           # evaluate, save, reload in a fresh process, predict
#   bash scripts/example.sh --full          # the full experiment (meant for a GPU)
#   SKIP_INSTALL=1 bash scripts/example.sh  # tf_flash already installed
#   bash scripts/example.sh --publish       # also replace examples/long_document/results/cpu (or gpu)
#
# Arguments go to examples/long_document/train.py (see --help there; --tf-logs shows TensorFlow's own
# start-up notices, hidden by default). Outputs: runs/long_document/PRESET/ (results.md, results.json,
# accuracy_vs_context.png, model.keras, saved_model/); runs/long_document/last_run.json names the
# model that examples/long_document/predict.py then uses by default.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" && -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; fi
PYTHON="${PYTHON:-python3}"
start=$(date +%s)

# 1. TensorFlow, Bazel, build and pip-install tf_flash with its [test,examples] extras (matplotlib: the plot).
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  bash scripts/install.sh
fi
# Its output (TensorFlow's start-up notices) only matters when the import fails.
if ! out=$(TF_CPP_MIN_LOG_LEVEL=3 "$PYTHON" -c "import tf_flash; tf_flash.layers.FlashMultiHeadAttention" 2>&1); then
  echo "$out" >&2
  echo "tf_flash does not import: see the errors above (scripts/install.sh)" >&2; exit 1
fi

# 2. The documents: Debian's linux-doc-6.1 (Linux kernel documentation). Where the package is not
# installed (or /usr/share/doc is filtered), prepare_data.py unpacks it with apt-get download + dpkg -x.
DOC=/usr/share/doc/linux-doc-6.1/Documentation
if [[ ! -d "$DOC" && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  apt-get install -y --no-install-recommends linux-doc-6.1 \
    || { apt-get update && apt-get install -y --no-install-recommends linux-doc-6.1; } || true
fi
"$PYTHON" examples/long_document/prepare_data.py --out data/linux-doc

# 3. Train (512 tokens vs long context, flash vs Keras attention), evaluate, save, reload, predict.
"$PYTHON" examples/long_document/train.py --data-dir data/linux-doc "$@"
echo "scripts/example.sh: done in $(( $(date +%s) - start ))s"
