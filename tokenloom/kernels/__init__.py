"""Hand-written kernels for hot spots PyTorch's stock CPU kernels serve poorly."""
