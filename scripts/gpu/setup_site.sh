#!/usr/bin/env bash
# Install the wheels carried in .whl/ (jsonschema and its three dependencies, fla-core for the
# fla_nsa peer) into /tmp/site on a machine without internet, and check they import.
# The device tool must carry the folder: run(..., carry=[".whl"]). Then, in the same command:
#   source scripts/gpu/setup_site.sh && fsalab bench-kernel --experiment kernel --paper --all ...
# Fetch the wheels here first (python 3.12, x86-64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl jsonschema jsonschema-specifications referencing rpds-py fla-core
if ! ls .whl/jsonschema-*.whl >/dev/null 2>&1; then
  echo "setup_site: no .whl/jsonschema-*.whl here: was .whl carried (carry=[\".whl\"])?" >&2
  return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/jsonschema-[0-9]*.whl .whl/jsonschema_specifications-*.whl .whl/referencing-*.whl .whl/rpds_py-*.whl \
  $(ls .whl/fla_core-*.whl 2>/dev/null)
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jsonschema; print('setup_site: jsonschema', jsonschema.__version__)"
python3 -c "import fla; print('setup_site: fla-core', fla.__version__)" 2>/dev/null || echo "setup_site: fla-core not installed (fla_nsa points will be 'unsupported')"
