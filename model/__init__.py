from model.config import ModelConfig
from model.gpt import GPT, InferenceCache

__all__ = ["GPT", "InferenceCache", "ModelConfig"]
