"""Optional machinery for speed, imported only where a run or a command asks for it:
torch.compile with a fallback, and CUDA graphs (the training step and the decoding step). It
imports nothing of the project but common.py; the default path (eager) never loads it."""
