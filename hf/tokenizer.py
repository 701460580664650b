"""Our tokenizers as Hugging Face's tokenizer.json and tokenizer_config.json: AutoTokenizer
and pipeline("text-generation") then encode and decode as we do.

tiktoken's BPE is byte-level BPE stored another way: its regex a Split pre-tokenizer, then
ByteLevel's one character a byte (BYTES); its ranks the vocab, the merges found from them.
Where they differ: an unknown character is dropped (we refuse it), "<|endoftext|>" in a text
is the special token (text to us), and {n,m}+ (not possessive there) is {n,m}.
"""
import re

from common import UserError
from data.bpe import EOT
from data.tokenizers import load_tokenizer

# GPT-2's bytes_to_unicode
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
_OTHERS = iter(range(256, 512))
BYTES = [chr(b) if b in _PRINTABLE else chr(next(_OTHERS)) for b in range(256)]


def merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each token of two bytes or more, in rank order."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
            if min(pair_ranks) >= rank:
                raise UserError(f"BPE token {token!r} cannot be made from tokens of lower ranks")
            i = pair_ranks.index(min(pair_ranks))
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            out.append(tuple(parts))
    return out


def as_chars(token: bytes) -> str:
    return "".join(BYTES[b] for b in token)


def tokenizer_files(meta: dict, max_length: int) -> tuple[dict, int | None]:
    """({file name: JSON}, the <|endoftext|> id or None) of meta's tokenizer."""
    if meta["kind"] == "char":
        vocab, pairs, special = {c: i for i, c in enumerate(meta["chars"])}, [], {}
        pre, decoder = None, {"type": "Fuse"}
    else:
        enc = load_tokenizer(meta).enc
        ranks, special = enc._mergeable_ranks, enc._special_tokens
        vocab = {as_chars(token): rank for token, rank in ranks.items()}
        pairs = [f"{as_chars(a)} {as_chars(b)}" for a, b in merges(ranks)]
        decoder = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                   "use_regex": False}
        pattern = re.sub(r"(\{\d+(,\d*)?\})\+", r"\1", enc._pat_str)
        split = {"type": "Split", "pattern": {"Regex": pattern},
                 "behavior": "Isolated", "invert": False}
        pre = {"type": "Sequence", "pretokenizers": [split, decoder]}
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for token, i in special.items()]
    # ignore_merges: a piece that is a token stays whole, as in tiktoken
    model = {"type": "BPE", "ignore_merges": True, "vocab": vocab | special, "merges": pairs}
    tokenizer = {"version": "1.0", "added_tokens": added, "pre_tokenizer": pre,
                 "decoder": decoder, "model": model}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    if EOT in special:
        config |= {"bos_token": EOT, "eos_token": EOT}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}, special.get(EOT)
