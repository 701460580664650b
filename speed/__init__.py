"""Optional speed, imported only where asked for: torch.compile with a fallback, and CUDA
graphs (the training and decoding steps). It imports nothing of the project but common.py."""
