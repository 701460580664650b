"""Tokenizers round-trip; preparing writes what meta.json says and is cached; batches are shifted windows."""
import json
import os

import numpy as np
import pytest
import torch

from data.loader import BatchLoader
from data.prepare import DataError, prepare, read_text
from data.tokenizers import CharTokenizer, TokenizerError, build_tokenizer, load_tokenizer
from tests.conftest import TEXT


def test_char_tokenizer_round_trips_and_saves():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.vocab_size == len(set(TEXT))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    again = load_tokenizer(json.loads(json.dumps(tok.meta())))
    assert again.encode(TEXT) == tok.encode(TEXT)


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(TokenizerError, match=r"'z'.*|.*'z'") as e:
        tok.encode("abz€")
    assert "'€'" in str(e.value) and "2 character(s)" in str(e.value)


def gpt2_or_skip():
    try:
        return build_tokenizer("gpt2")
    except TokenizerError as e:
        pytest.skip(f"gpt2 BPE files unavailable (set TIKTOKEN_CACHE_DIR): {e}")


def test_gpt2_tokenizer_round_trips():
    tok = gpt2_or_skip()
    text = TEXT + " unicode: héllo wörld ✓ <|endoftext|>"
    ids = tok.encode(text)
    assert tok.vocab_size == 50257 and len(ids) < len(text) / 2
    assert tok.decode(ids) == text
    assert load_tokenizer(tok.meta()).encode(text) == ids


def test_unknown_tiktoken_name_is_a_clear_error():
    with pytest.raises(TokenizerError, match="unknown tokenizer 'nope'"):
        build_tokenizer("nope")


def test_prepare_writes_token_files_and_meta(tmp_path, text_file):
    out = prepare(text_file, "char", 0.1, tmp_path / "prep")
    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(meta["tokenizer"])
    split = int(len(TEXT) * 0.9)
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    assert meta["dtype"] == "uint16" and meta["tokens"] == {"train": len(train), "val": len(val)}
    assert tok.decode(train.tolist()) == TEXT[:split] and tok.decode(val.tolist()) == TEXT[split:]
    assert len(meta["sha256"]) == 64 and meta["split"]["val_fraction"] == 0.1


def test_prepare_is_cached_by_content(tmp_path, text_file):
    first = prepare(text_file, "char", 0.1, tmp_path / "prep")
    stamp = os.stat(first / "train.bin").st_mtime_ns
    assert prepare(text_file, "char", 0.1, tmp_path / "prep") == first
    assert os.stat(first / "train.bin").st_mtime_ns == stamp, "a second run must reuse the files"
    text_file.write_text(TEXT + "more")
    assert prepare(text_file, "char", 0.1, tmp_path / "prep") != first, "new content, new dataset"


def test_prepare_uses_uint32_for_large_vocabularies(tmp_path):
    path = tmp_path / "wide.txt"
    chars = [chr(i) for i in range(0x100, 0x100 + 70000) if not 0xD800 <= i < 0xE000]   # no surrogates
    path.write_text("".join(chars), encoding="utf-8")
    meta = json.loads((prepare(path, "char", 0.5, tmp_path / "prep") / "meta.json").read_text())
    assert meta["vocab_size"] > 65536 and meta["dtype"] == "uint32"


def test_non_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello \xff world")
    with pytest.raises(DataError, match="offset 6"):
        read_text(path)
    assert "\ufffd" in read_text(path, errors="replace")


def test_batches_are_windows_shifted_by_one_and_seeded(tmp_path, text_file):
    out = prepare(text_file, "char", 0.1, tmp_path / "prep")
    loader = BatchLoader(out, block_size=16, batch_size=4, seed=7)
    x, y = loader.batch("train")
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    tok = load_tokenizer(json.loads((out / "meta.json").read_text())["tokenizer"])
    assert tok.decode(x[0].tolist() + y[0, -1:].tolist()) in TEXT
    x2, _ = BatchLoader(out, block_size=16, batch_size=4, seed=7).batch("train")
    assert torch.equal(x, x2)
    x3, _ = BatchLoader(out, block_size=16, batch_size=4, seed=8).batch("train")
    assert not torch.equal(x, x3)


def test_a_split_shorter_than_a_block_is_a_clear_error(tmp_path, text_file):
    out = prepare(text_file, "char", 0.1, tmp_path / "prep")
    with pytest.raises(DataError, match="val split has .* fewer than block_size"):
        BatchLoader(out, block_size=1000, batch_size=2)


def test_missing_data_is_downloaded_through_a_temporary_file(tmp_path, text_file):
    from data.prepare import download
    target = tmp_path / "sub" / "input.txt"
    download(text_file.resolve().as_uri(), target)
    assert target.read_text() == TEXT and not list(target.parent.glob("*.part"))


def test_a_failed_download_says_how_to_pass_a_local_file(tmp_path):
    from data.prepare import download
    target = tmp_path / "input.txt"
    with pytest.raises(DataError, match="could not be downloaded .* pass a local copy with --data PATH"):
        download((tmp_path / "nowhere.txt").as_uri(), target)
    assert not target.exists() and not (tmp_path / "input.txt.part").exists()
