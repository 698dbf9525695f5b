#!/usr/bin/env bash
# Installs radixserve and its test dependencies into the current Python environment.
# torch==2.13.0 first: on the project's CPU machines that wheel lies on disk, while a bare
# `torch` requirement would fetch a multi-GB CUDA build. Elsewhere any torch >= 2.8 will do.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0 || "$PY" -m pip install -q "torch>=2.8"
fi
"$PY" -m pip install -q -e ".[test]"
