# Sourced on the lent GPU machine (no network) by scripts/gpu_round.sh and examples/long_document/gpu_full.sh:
# installs the KerasHub wheels carried in .whl/ (pip download here) into /tmp/site and puts it on PYTHONPATH.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
