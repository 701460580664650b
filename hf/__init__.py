"""Optional: GPT-2 in Hugging Face's format, in and out; imported only where asked for."""
