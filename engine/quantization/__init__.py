"""FP8 quantization: weights (on-the-fly or pre-quantized checkpoints) and the KV cache."""
