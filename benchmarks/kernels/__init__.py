"""Kernel micro-benchmarks: nanovllm's kernels on the GPU at their defaults, outside the engine."""
