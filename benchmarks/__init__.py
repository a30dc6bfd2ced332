"""bench.py's harness, the kernel micro-benchmarks and the engine tools (benchmarks/README.md): a
package, so every module is imported as benchmarks.<part>.<module> and run from the repository root
as `python -m benchmarks.<part>.<module>`."""
