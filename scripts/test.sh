#!/usr/bin/env bash
# The README's test command: all setup (scripts/install.sh, with the [test] extras), then the pytest suite.
#
#   bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -k causal -x
#
# Runs from the repository root: tf_flash is imported from the source tree and loads the library
# Bazel just built (bazel-bin/cc/_flash_attention_ops.so), the same one that was pip-installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" && -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; fi
PYTHON="${PYTHON:-python3}"
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  bash scripts/install.sh
fi
start=$(date +%s)
status=0
"$PYTHON" -m pytest -q tests "$@" || status=$?
echo "scripts/test.sh: pytest finished in $(( $(date +%s) - start ))s with status $status" >&2
exit $status
