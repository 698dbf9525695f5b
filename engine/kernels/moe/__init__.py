"""Mixture-of-experts kernels: the router's top-k, grouping pairs by expert, the grouped GEMM,
and decode-sized per-pair products."""
