"""bench.py's helpers: workloads, engine runs, roofline counting, device probes, statistics, the report."""
