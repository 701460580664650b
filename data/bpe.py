"""Train a byte-level BPE tokenizer on the training split: data.tokenizer = "bpe:N".

Choices:
  trainer      rustbpe (nanochat's BPE trainer, Rust): it returns tiktoken's mergeable ranks (token
               bytes -> rank) directly, so the result encodes with tiktoken exactly like gpt2 does.
               Hugging Face `tokenizers` trains as well, but keeps byte-level tokens in a remapped
               alphabet that would need translating back to bytes (and trains more slowly).
  bytes        the 256 byte values are tokens 0..255, so every text encodes, characters never seen
               in training included
  pattern      GPT-4's (cl100k) pre-tokenizer regex: no merge crosses a split point, and cutting the
               text where prepare.safe_cut does gives the tokens of the whole text
  vocabulary   N tokens: the 256 bytes, N - 257 merges, and <|endoftext|> (id N - 1), which goes
               between documents like gpt2's
  input        the training split only (the validation text never shapes the merges), streamed in
               pieces, at most TRAIN_MAX_CHARS characters of it
  determinism  the same text and N give the same ranks (tests/test_bpe.py), whatever the thread count
"""
import time

from data.tokenizers import TokenizerError, bpe_meta

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
    if not n.isdigit() or not MIN_VOCAB <= int(n) <= MAX_VOCAB:
        raise TokenizerError(f"tokenizer {spec!r}: write bpe:N with N the vocabulary size, "
                             f"{MIN_VOCAB} to {MAX_VOCAB:,} (e.g. bpe:4096)")
    return int(n)


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
