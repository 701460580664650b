"""Tokenizers behind one small interface: encode, decode, vocab_size, and a JSON-able meta dict that
is saved with the dataset and in every checkpoint, so a model always comes with its tokenizer.

  char  one token per character; the vocabulary is the sorted set of characters of the text.
  BPE   any tiktoken encoding by name ("gpt2", "cl100k_base", ...).

encode_array(text) is encode() as a numpy array, without a Python int per token: what preparing
large files uses (it releases the GIL for BPE, so threads encode in parallel).
"""
import numpy as np


class TokenizerError(ValueError):
    """Text or a tokenizer spec the tokenizer cannot handle; the message says what and where."""


class CharTokenizer:
    name = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def start_token(self) -> int:
        """What an empty prompt starts from: a newline where the vocabulary has one."""
        return self.stoi.get("\n", 0)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - set(self.stoi))
            shown = ", ".join(repr(c) for c in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise TokenizerError(f"{len(unknown)} character(s) not in the {self.vocab_size}-character "
                                 f"vocabulary: {shown}") from None

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as int32 ids: one table lookup per code point (the table is built on first use)."""
        if not hasattr(self, "_table"):
            self._table = np.full(0x110000, -1, dtype=np.int32)
            self._table[[ord(c) for c in self.chars]] = np.arange(len(self.chars), dtype=np.int32)
        if text.isascii():   # 1 byte per character: no need for the 4-byte form
            points = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        else:
            points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self._table[points]
        if len(ids) and ids.min() < 0:
            self.encode(text)   # raises the error that names the unknown characters
        return ids

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")

    def meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


class TiktokenTokenizer:
    def __init__(self, name: str = "gpt2"):
        import tiktoken
        try:
            self.enc = tiktoken.get_encoding(name)
        except ValueError:
            raise TokenizerError(f"unknown tokenizer {name!r}: use 'char' or a tiktoken encoding "
                                 f"({', '.join(tiktoken.list_encoding_names())})") from None
        except Exception as e:   # the BPE files are downloaded on first use
            raise TokenizerError(f"could not load the tiktoken encoding {name!r} ({type(e).__name__}: {e}); "
                                 "with no network, set TIKTOKEN_CACHE_DIR to a folder holding its files") from None
        self.name = name

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    @property
    def start_token(self) -> int:
        return self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)   # "<|endoftext|>" in a text is just text

    def encode_array(self, text: str) -> np.ndarray:
        if hasattr(self.enc, "encode_to_numpy"):   # tiktoken >= 0.8: no Python list in between
            return self.enc.encode_to_numpy(text, disallowed_special=())
        return np.array(self.enc.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids))

    def decode_bytes(self, ids) -> bytes:
        return self.enc.decode_bytes(list(ids))

    def meta(self) -> dict:
        return {"kind": "tiktoken", "name": self.name}


def build_tokenizer(name: str, text: str | None = None):
    """A new tokenizer: 'char' (its vocabulary from text) or a tiktoken encoding name."""
    if name == "char":
        if text is None:
            raise TokenizerError("a char tokenizer is built from a text")
        return CharTokenizer.from_text(text)
    return TiktokenTokenizer(name)


def load_tokenizer(meta: dict):
    """The tokenizer described by meta() (from a dataset's meta.json or a checkpoint)."""
    if not isinstance(meta, dict) or meta.get("kind") not in ("char", "tiktoken"):
        raise TokenizerError(f"not a tokenizer description: {str(meta)[:80]}")
    if meta["kind"] == "char":
        return CharTokenizer(meta["chars"])
    return TiktokenTokenizer(meta["name"])
