"""Tokenizers behind one small interface: encode, decode, vocab_size, and a JSON-able meta dict that
is saved with the dataset and in every checkpoint, so a model always comes with its tokenizer.

  char   one token per character; the vocabulary is the sorted set of characters of the text.
  BPE    any tiktoken encoding by name ("gpt2", "cl100k_base", ...).
  bpe:N  a byte-level BPE with N tokens trained on the data's training split (train_bpe, below);
         its meta holds the whole tokenizer (pattern, base64 token bytes in rank order,
         <|endoftext|>), so tiktoken rebuilds it from the meta alone, with no file and no network.

encode_array(text) is encode() as a numpy array, without a Python int per token: what preparing
large files uses (it releases the GIL for BPE, so threads encode in parallel).
"""
import base64
import binascii
import time

import numpy as np

from common import TokenizerError

EOT = "<|endoftext|>"   # the end-of-text token between documents (gpt2's name for it)


def code_points(text: str) -> np.ndarray:
    """The text's code points as an array: uint8 for ASCII text (1 byte a character), else uint32."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


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
        ids = self._table[code_points(text)]
        if len(ids) and ids.min() < 0:
            self.encode(text)   # raises the error that names the unknown characters
        return ids

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode("utf-8")

    def meta(self) -> dict:
        return {"kind": "char", "chars": self.chars}


def check_encoding_name(name: str) -> None:
    """A TokenizerError unless tiktoken knows the encoding name (without loading its files)."""
    import tiktoken
    if name not in tiktoken.list_encoding_names():
        raise TokenizerError(f"unknown tokenizer {name!r}: use 'char', 'bpe:N' (a BPE of N tokens trained on "
                             f"the data) or a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())})")


class TiktokenTokenizer:
    """BPE encoded by tiktoken: a named encoding, or one trained on the data (see trained_bpe)."""

    def __init__(self, enc, meta: dict):
        self.enc, self._meta, self.name = enc, meta, enc.name

    @classmethod
    def named(cls, name: str = "gpt2") -> "TiktokenTokenizer":
        import tiktoken
        check_encoding_name(name)
        try:
            enc = tiktoken.get_encoding(name)
        except Exception as e:   # the BPE files are downloaded on first use
            raise TokenizerError(f"could not load tiktoken's {name!r} files ({type(e).__name__}); without a network, "
                                 f"set TIKTOKEN_CACHE_DIR to a folder that holds them") from None
        return cls(enc, {"kind": "tiktoken", "name": name})

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
        return self._meta


def bpe_meta(pattern: str, tokens: list[bytes]) -> dict:
    """The JSON description of a trained BPE: tokens[i] is the bytes of the token of rank (and id) i;
    <|endoftext|> comes after them."""
    return {"kind": "bpe", "name": f"bpe{len(tokens) + 1}", "pattern": pattern,
            "ranks": [base64.b64encode(t).decode("ascii") for t in tokens],
            "special_tokens": {EOT: len(tokens)}}


def trained_bpe(meta: dict) -> TiktokenTokenizer:
    """The tokenizer bpe_meta() describes, checked: a damaged description is a TokenizerError."""
    import tiktoken

    def damaged(why: str) -> TokenizerError:
        return TokenizerError(f"damaged BPE tokenizer description: {why}")

    name, pattern, ranks, special = (meta.get(k) for k in ("name", "pattern", "ranks", "special_tokens"))
    if not isinstance(name, str) or not isinstance(pattern, str) or not pattern:
        raise damaged("its name or pattern is missing")
    if not isinstance(ranks, list) or not all(isinstance(r, str) for r in ranks):
        raise damaged("its ranks are not a list of base64 strings")
    try:
        tokens = [base64.b64decode(r, validate=True) for r in ranks]
    except (binascii.Error, ValueError):
        raise damaged("a rank is not base64") from None
    mergeable = {t: i for i, t in enumerate(tokens)}
    if len(mergeable) != len(tokens) or b"" in mergeable:
        raise damaged("a token is empty or appears twice")
    if any(bytes([b]) not in mergeable for b in range(256)):
        raise damaged("not every byte is a token, so some text could not be encoded")
    after_ranks = list(range(len(tokens), len(tokens) + len(special))) if isinstance(special, dict) else None
    if not after_ranks or EOT not in special or sorted(v for v in special.values() if type(v) is int) != after_ranks:
        raise damaged(f"its special tokens must include {EOT} and follow the {len(tokens)} ranks")
    try:
        enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=mergeable, special_tokens=special)
    except ValueError as e:   # the pattern is not a valid regex
        raise damaged(str(e)[:160]) from None
    return TiktokenTokenizer(enc, meta)


def build_tokenizer(name: str, text: str | None = None):
    """A new tokenizer: 'char' (its vocabulary from text) or a tiktoken encoding name. ('bpe:N' is
    trained while preparing the data, on the training split: see train_bpe and data/prepare.py.)"""
    if name == "char":
        if text is None:
            raise TokenizerError("a char tokenizer is built from a text")
        return CharTokenizer.from_text(text)
    if name.startswith("bpe:"):
        raise TokenizerError(f"{name} is trained on the data when it is prepared (data/prepare.py)")
    return TiktokenTokenizer.named(name)


def load_tokenizer(meta: dict):
    """The tokenizer described by meta() (from a dataset's meta.json or a checkpoint), checked."""
    if not isinstance(meta, dict) or meta.get("kind") not in ("char", "tiktoken", "bpe"):
        raise TokenizerError(f"not a tokenizer description: {str(meta)[:80]}")
    if meta["kind"] == "char":
        if not isinstance(meta.get("chars"), str) or not meta["chars"] or len(set(meta["chars"])) != len(meta["chars"]):
            raise TokenizerError("damaged char tokenizer description: its characters are missing or repeated")
        return CharTokenizer(meta["chars"])
    if meta["kind"] == "bpe":
        return trained_bpe(meta)
    if not isinstance(meta.get("name"), str):
        raise TokenizerError(f"not a tokenizer description: {str(meta)[:80]}")
    return TiktokenTokenizer.named(meta["name"])


# ---------------------------------------------------------------- a BPE trained on the data (bpe:N)
#
# Choices:
#   trainer      rustbpe (nanochat's BPE trainer, Rust): it returns tiktoken's mergeable ranks (token
#                bytes -> rank) directly, so the result encodes with tiktoken exactly like gpt2 does.
#                Hugging Face `tokenizers` trains as well, but keeps byte-level tokens in a remapped
#                alphabet that would need translating back to bytes (and trains more slowly).
#   bytes        the 256 byte values are tokens 0..255, so every text encodes, characters never seen
#                in training included
#   pattern      GPT-4's (cl100k) pre-tokenizer regex: no merge crosses a split point, and cutting the
#                text where prepare.safe_cut does gives the tokens of the whole text
#   vocabulary   N tokens: the 256 bytes, N - 257 merges, and <|endoftext|> (id N - 1), which goes
#                between documents like gpt2's
#   input        the training split only (the validation text never shapes the merges), streamed in
#                pieces, at most TRAIN_MAX_CHARS characters of it
#   determinism  the same text and N give the same ranks (tests/test_bpe.py), whatever the thread count

PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
           r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
MIN_VOCAB = 257          # the 256 bytes and <|endoftext|>
MAX_VOCAB = 1 << 20
TRAIN_MAX_CHARS = 256_000_000   # the first 256M characters of the train split: a bound on the counting time


def bpe_vocab_size(spec: str) -> int | None:
    """N for a tokenizer spec 'bpe:N', None for any other spec; a malformed N is a TokenizerError."""
    if spec != "bpe" and not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    if not (n.isascii() and n.isdigit()) or not MIN_VOCAB <= int(n) <= MAX_VOCAB:   # ('²' is a digit to isdigit)
        raise TokenizerError(f"tokenizer {spec!r}: write bpe:N with N the vocabulary size, "
                             f"{MIN_VOCAB} to {MAX_VOCAB:,} (e.g. bpe:4096)")
    return int(n)


def check_tokenizer_spec(spec: str) -> None:
    """A TokenizerError unless spec is char, bpe:N or a tiktoken encoding this machine can load."""
    if spec != "char" and bpe_vocab_size(spec) is None:
        check_encoding_name(spec)


def capped(texts, max_chars: int):
    """texts, stopping once max_chars characters have gone by (whole pieces: up to one piece more)."""
    seen = 0
    for text in texts:
        if seen >= max_chars:
            return
        seen += len(text)
        yield text


def train_bpe(texts, vocab_size: int, batch: int = 8) -> tuple[dict, float]:
    """(tokenizer meta, seconds) of a BPE of vocab_size tokens trained on the str pieces in texts.
    rustbpe holds `batch` pieces at a time and counts them in parallel. A text with too few distinct
    pairs gives fewer tokens than asked for (the meta says how many)."""
    try:
        import rustbpe
    except ImportError:
        raise TokenizerError("training a bpe:N tokenizer needs rustbpe: pip install rustbpe") from None
    start = time.perf_counter()
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(capped(texts, TRAIN_MAX_CHARS), vocab_size - 1, buffer_size=batch, pattern=PATTERN)
    ranked = sorted(trainer.get_mergeable_ranks(), key=lambda item: item[1])
    if [rank for _, rank in ranked] != list(range(len(ranked))):
        raise TokenizerError("rustbpe returned ranks that are not 0..n-1")
    return bpe_meta(PATTERN, [bytes(token) for token, _ in ranked]), time.perf_counter() - start
