"""Every Triton kernel, grouped by what it computes, with its launch wrapper and tile configs.
Kernels import nothing above them but the compile-ahead registry (precompile.py)."""
