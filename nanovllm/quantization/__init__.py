"""FP8 weights: the checkpoint's quantization_config read (checkpoint_config.py), which layers hold
them and how (config.py, the one place that decides), their numerics and matmul (fp8.py), and the
checkpoint tensors a quantized model takes (loading.py)."""
