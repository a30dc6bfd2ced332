"""Engine tools: profiles of engine steps, kernels compiled mid-run, n samples, bench.py A/B runs."""
