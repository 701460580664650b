"""Optional speed, imported only where asked for: torch.compile with a fallback, CUDA graphs.
It imports nothing of the project but common.py."""
