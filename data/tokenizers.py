"""Tokenizers behind one interface (encode, decode, vocab_size) and a JSON-able meta() kept
with the dataset and every checkpoint. char: a token per character; BPE: data/bpe.py.
"""
import numpy as np

from common import UserError

# the 256 bytes and <|endoftext|>
MIN_VOCAB = 257
MAX_VOCAB = 1 << 20


def code_points(text: str) -> np.ndarray:
    """uint8 for ASCII text, else uint32."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


class CharTokenizer:
    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}
        # each code point's id, -1 outside the vocabulary
        self.table = np.full(0x110000, -1, dtype=np.int32)
        self.table[code_points(chars)] = np.arange(len(chars))
        # an empty prompt starts from a newline where the vocabulary has one
        self.start_token = self.stoi.get("\n", 0)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    end_token = None

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        ids = self.table[code_points(text)]
        if len(ids) and ids.min() < 0:
            unknown = sorted(set(text) - set(self.stoi))
            shown = ", ".join(map(repr, unknown[:10])) + " ..." * (len(unknown) > 10)
            raise UserError(f"{len(unknown)} character(s) not in the {self.vocab_size}-"
                            f"character vocabulary: {shown}")
        return ids

    def encode_pieces(self, pieces: list[str]) -> np.ndarray:
        """The pieces' ids (no None: that is BPE's end-of-text)."""
        return self.encode_array("".join(pieces))

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")

    def meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


def build_tokenizer(name: str, text: str | None = None):
    """A new tokenizer: 'char' (its vocabulary from text) or a tiktoken encoding name."""
    if name == "char":
        return CharTokenizer.from_text(text)
    return load_tokenizer({"kind": "tiktoken", "name": name})


def load_tokenizer(meta: dict):
    """The tokenizer a meta() describes, checked; data/bpe.py is imported if used."""
    kind = meta.get("kind") if isinstance(meta, dict) else None
    named = kind != "tiktoken" or isinstance(meta.get("name"), str)
    if kind not in ("char", "tiktoken", "bpe") or not named:
        raise UserError(f"not a tokenizer description: {str(meta)[:80]}")
    if kind == "char":
        chars = meta.get("chars")
        if not isinstance(chars, str) or not chars or len(set(chars)) != len(chars):
            raise UserError("damaged char tokenizer description: its characters are "
                            "missing or repeated")
        return CharTokenizer(chars)
    from data.bpe import TiktokenTokenizer, trained_bpe
    return trained_bpe(meta) if kind == "bpe" else TiktokenTokenizer.named(meta["name"])


def bpe_vocab_size(spec: str) -> int | None:
    """N for a spec 'bpe:N', None for any other; a bad N is a UserError."""
    if spec != "bpe" and not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    # isascii too: '²' passes isdigit, but int('²') fails
    if not (n.isascii() and n.isdigit()) or not MIN_VOCAB <= int(n) <= MAX_VOCAB:
        raise UserError(f"tokenizer {spec!r}: write bpe:N with N the vocabulary size, "
                        f"{MIN_VOCAB} to {MAX_VOCAB:,} (e.g. bpe:4096)")
    return int(n)
