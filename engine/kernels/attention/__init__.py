"""Attention kernels: split-KV decode, ragged extend, shared-prefix (radix-grouped) decode and
LSE merge, the KV store, and their launch configs."""
