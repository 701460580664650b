"""Optional: OpenAI's GPT-2 in Hugging Face's format, in and out (convert.py the weights,
tokenizer.py our tokenizers, hub.py files, hub names and train.init_from); imported only
where a run or command asks for it."""
