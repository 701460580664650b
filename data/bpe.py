"""BPE through tiktoken: a named encoding (gpt2, ...), or bpe:N trained on the train split by
rustbpe, its meta the whole tokenizer: GPT-4's pattern, the 256 bytes and N - 257 merges as
base64 in rank order, and <|endoftext|> (id N - 1) between documents.
"""
import base64
import time

import numpy as np
import tiktoken

from common import UserError

# the end-of-text token between documents (gpt2's name for it)
EOT = "<|endoftext|>"
PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
           r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


def check_encoding(name: str) -> None:
    """A UserError unless name is a tiktoken encoding (its files not loaded)."""
    if name not in (names := tiktoken.list_encoding_names()):
        raise UserError(f"unknown tokenizer {name!r}: use 'char', 'bpe:N' (a BPE of N tokens "
                        f"trained on the data) or a tiktoken encoding ({', '.join(names)})")


class TiktokenTokenizer:
    def __init__(self, enc, meta: dict):
        self.enc = enc
        self._meta = meta
        self.vocab_size = enc.n_vocab
        # between documents, where a sample ends, and an empty prompt
        self.end_token = self.start_token = enc.eot_token

    @classmethod
    def named(cls, name: str) -> "TiktokenTokenizer":
        check_encoding(name)
        try:
            enc = tiktoken.get_encoding(name)
        # the files are downloaded on first use
        except Exception as e:
            raise UserError(f"could not load tiktoken's {name!r} files ({type(e).__name__}); "
                            f"offline, set TIKTOKEN_CACHE_DIR to a folder holding them") from None
        return cls(enc, {"kind": "tiktoken", "name": name})

    def encode(self, text: str) -> list[int]:
        """The ids of text, in which "<|endoftext|>" is just text."""
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return self.enc.encode_to_numpy(text, disallowed_special=())

    def encode_pieces(self, pieces: list) -> np.ndarray:
        """The ids of the pieces, a None the end-of-text token: one tiktoken call, unless
        a piece holds "<|endoftext|>" as text."""
        text = "".join([EOT if p is None else p for p in pieces])
        # the marker cannot overlap itself: a count tells
        if text.count(EOT) == pieces.count(None):
            return self.enc.encode_to_numpy(text, allowed_special={EOT}, disallowed_special=())
        eot = np.array([self.end_token], dtype=np.uint32)
        return np.concatenate([eot if p is None else self.encode_array(p) for p in pieces])

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids))

    def decode_bytes(self, ids) -> bytes:
        return self.enc.decode_bytes(list(ids))

    def meta(self) -> dict:
        return self._meta


# how a refused train_bpe() description begins
DAMAGED = "damaged BPE tokenizer description: "


def trained_bpe(meta: dict) -> TiktokenTokenizer:
    """The tokenizer train_bpe() describes; a damaged one is a UserError (tiktoken checks
    only the pattern and types: a missing byte would panic)."""
    name, pattern, ranks, special = map(meta.get, ("name", "pattern", "ranks", "special_tokens"))
    if not isinstance(name, str) or not isinstance(pattern, str) or not pattern:
        raise UserError(f"{DAMAGED}its name or pattern is missing")
    # not a list of str, or a str that is not base64 (a binascii.Error)
    try:
        tokens = [base64.b64decode(r, validate=True) for r in ranks]
    except (TypeError, ValueError):
        raise UserError(f"{DAMAGED}its ranks are not a list of base64 strings") from None
    mergeable = {t: i for i, t in enumerate(tokens)}
    if len(mergeable) != len(tokens) or b"" in mergeable:
        raise UserError(f"{DAMAGED}a token is empty or appears twice")
    if any(bytes([b]) not in mergeable for b in range(256)):
        raise UserError(f"{DAMAGED}not every byte is a token, so some text could not be encoded")
    if special != {EOT: len(tokens)}:
        raise UserError(f"{DAMAGED}its special tokens must be {EOT} alone, with the id after "
                        f"the {len(tokens)} ranks")
    # a pattern that is not a valid regex; an id that is not an int
    try:
        enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=mergeable,
                                special_tokens=special)
    except (TypeError, ValueError) as e:
        raise UserError(DAMAGED + str(e)[:160]) from None
    return TiktokenTokenizer(enc, meta)


def train_bpe(texts, vocab_size: int) -> tuple[dict, float]:
    """(meta, seconds) of a BPE of vocab_size tokens at most, trained on texts' str pieces."""
    try:
        import rustbpe
    except ImportError:
        raise UserError("training a bpe:N tokenizer needs rustbpe: pip install rustbpe") from None
    start = time.perf_counter()
    trainer = rustbpe.Tokenizer()
    # pieces of up to 2M characters: 8 held at a time (rustbpe holds 8,192 unless told)
    trainer.train_from_iterator(texts, vocab_size - 1, buffer_size=8, pattern=PATTERN)
    tokens = [bytes(t) for t, rank in sorted(trainer.get_mergeable_ranks(), key=lambda r: r[1])]
    meta = {"kind": "bpe", "name": f"bpe{len(tokens) + 1}", "pattern": PATTERN,
            "ranks": [base64.b64encode(t).decode("ascii") for t in tokens],
            "special_tokens": {EOT: len(tokens)}}
    return meta, time.perf_counter() - start
