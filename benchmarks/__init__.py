"""Helpers and scripts around bench.py; a package so `import benchmarks.x` finds these files first."""
