"""The engine's bookkeeping on the host: requests, sampling settings, the scheduler and its
admission order, the radix cache and the KV slot allocator, what one step computes. No torch
kernels and nothing from executor/, runtime/ or kernels/ (tests/test_layering.py)."""
