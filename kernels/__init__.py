"""Triton/CUDA kernels, each beside its plain-torch reference."""
