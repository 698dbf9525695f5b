#!/usr/bin/env bash
# Download the cp312 wheels the GPU machine lacks for the structured-output GPU tests
# (xgrammar, llguidance and what they and the tests import: pydantic, jsonschema; peft for
# the LoRA test; gguf, which the tokenizer imports) into
# .whl/gpu/, which git ignores; `carry` it to the device for `scripts/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for spec in xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 pydantic==2.13.4 \
    pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 peft==0.21.2 gguf==0.19.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/gpu "$spec"
done
ls -la .whl/gpu
