#!/usr/bin/env bash
# Wheels for FlashInfer on the GPU machine (Python 3.12; it has torch, nvcc 13.0, ninja, numpy,
# einops, click, tabulate, tqdm, requests, nvidia-ml-py, but not flashinfer or the packages
# below), for the engine's FlashInfer prefill (engine/attention/flashinfer_prefill.py) and its GPU
# tests. Run from the project root:  bash scripts/flashinfer_wheels.sh
# It fills .whl_fi/c1 and .whl_fi/c2 with at most 59 MB each (a device call carries 64 MiB with
# the tree). Then chain two calls, the second within ~30 s of the first (the machine stays warm
# that long):
#   call 1: carry [".whl_fi/c1"], command: mkdir -p /tmp/fi && cp .whl_fi/c1/* /tmp/fi/
#   call 2: carry [".whl_fi/c2"], command starts with
#     cp .whl_fi/c2/* /tmp/fi/ && cat /tmp/fi/flashinfer.part.* > /tmp/$(cat /tmp/fi/flashinfer.name) &&
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/flashinfer_python-*.whl /tmp/fi/*.whl &&
#     export PYTHONPATH=$PWD:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a && ...
# FlashInfer compiles its kernel with nvcc at first use: 110 s on the H200 machine's 16 cores.
# To skip that on later machines, bring the whole build back once
# (cd /tmp/fiws && tar czf $OUT/fi_jit_full.tgz .: 3.7 MB for the one module the engine uses)
# and carry it beside c1 (.carry/fijit_full/; c1 + it + the tree ~65 MB, just under the limit;
# unpack with tar xzf ... -C /tmp/fiws, then `find /tmp/fiws -type f -exec touch {} +` after
# the pip install, so ninja finds the build newer than the sources just installed). The
# objects and ninja's log are part of it: FlashInfer runs ninja before every load, and a
# library without them is rebuilt (the engine's "auto" then stays on Triton: kernel_is_built).
# Not fetched: nccl-extensions (22 MB), which flashinfer-python lists but neither
# `import flashinfer` nor the prefill needs (checked on the device).
set -euo pipefail
mkdir -p .git/info && (grep -qx '/.whl_fi/' .git/info/exclude 2>/dev/null || echo '/.whl_fi/' >> .git/info/exclude)
rm -rf .whl_fi && mkdir -p .whl_fi/all
specs="flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 nccl4py==0.6.0
nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1"
plat=""
for n in 39 35 34 31 28 27 24 17; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
for s in $specs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat --platform manylinux2014_x86_64 -d .whl_fi/all "$s"
done
fi=$(ls .whl_fi/all/flashinfer_python-*.whl)
rm -rf .whl_fi/c1 .whl_fi/c2 .whl_fi/c3 .whl_fi/c23
mkdir -p .whl_fi/c1 .whl_fi/c2
basename "$fi" > .whl_fi/c2/flashinfer.name
split -b 56M "$fi" .whl_fi/part.
mv .whl_fi/part.aa .whl_fi/c1/flashinfer.part.aa
mv .whl_fi/part.ab .whl_fi/c2/flashinfer.part.ab
for w in .whl_fi/all/*.whl; do
  [ "$w" = "$fi" ] || cp "$w" .whl_fi/c2/
done
rm -rf .whl_fi/all
du -sh .whl_fi/c*
