"""Optional: OpenAI's GPT-2 in Hugging Face's format, in and out (convert.py: the weights; tokenizer.py:
our tokenizers as tokenizer.json; hub.py: files, hub names, train.init_from and sampling a GPT-2).
Imported only where a run or command asks for a Hugging Face model."""
