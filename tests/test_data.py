"""Tokenizers round-trip; batches are shifted windows. The prepared-data cache never uses an entry
that is damaged, unfinished or of another format: it prepares it again (with a one-line notice),
or, where only the entry is at hand, names it in a one-line error; a sound entry is reused as it
is; text that cannot be used is refused before anything is published; encoding errors are part of
the key."""
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from common import UserError
from data.loader import BatchLoader, Share
from data.prepare import FORMAT, load_meta
from data.tokenizers import CharTokenizer, build_tokenizer, load_tokenizer
from tests.conftest import TEXT, gpt2_or_skip, prepare_text


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(UserError, match=r"'z'.*|.*'z'") as e:
        tok.encode("abz€")
    assert "'€'" in str(e.value) and "2 character(s)" in str(e.value)


def test_gpt2_tokenizer_round_trips():
    tok = gpt2_or_skip()
    text = TEXT + " unicode: héllo wörld ✓ <|endoftext|>"
    ids = tok.encode(text)
    assert tok.vocab_size == 50257 and len(ids) < len(text) / 2
    assert tok.decode(ids) == text
    assert load_tokenizer(tok.meta()).encode(text) == ids


def test_unknown_tiktoken_name_is_a_clear_error():
    with pytest.raises(UserError, match="unknown tokenizer 'nope'"):
        build_tokenizer("nope")


def test_prepare_uses_uint32_for_large_vocabularies(tmp_path):
    path = tmp_path / "wide.txt"
    chars = [chr(i) for i in range(0x100, 0x100 + 70000) if not 0xD800 <= i < 0xE000]   # no surrogates
    path.write_text("".join(chars), encoding="utf-8")
    meta = json.loads((prepare_text(path, "char", 0.5, tmp_path / "prep") / "meta.json").read_text())
    assert meta["vocab_size"] > 65536 and meta["dtype"] == "uint32"


def test_batches_are_windows_shifted_by_one_and_seeded(tmp_path, text_file):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    def first_step(seed):
        loader = BatchLoader(out, block_size=16, batch_size=4, seed=seed, share=Share(grad_accum=2))
        return loader.step_windows()
    windows = first_step(7)
    assert windows.shape == (2, 4, 17) and windows.dtype == torch.long
    tok = load_tokenizer(json.loads((out / "meta.json").read_text())["tokenizer"])
    assert all(tok.decode(w.tolist()) in TEXT for w in windows.flatten(0, 1)), "consecutive tokens of the text"
    x, y = BatchLoader(out, block_size=16, batch_size=4).batch("val", torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(first_step(7), windows) and not torch.equal(first_step(8), windows)


def test_bits_per_byte_divides_by_the_bytes_of_the_text(tmp_path, text_file):
    from data.prepare import load_meta
    from model.gpt import bits_per_byte

    def tokens_per_byte(meta, split):
        return meta["tokens"][split] / meta["bytes"][split]
    meta = load_meta(prepare_text(text_file, "char", 0.1, tmp_path / "prep"))
    split = int(len(TEXT) * 0.9)
    assert meta["bytes"] == {"train": split, "val": len(TEXT) - split} == meta["tokens"], "ASCII: a byte a token"
    assert tokens_per_byte(meta, "val") == 1.0
    assert bits_per_byte(2.0, meta["tokens"]["val"], meta["bytes"]["val"]) == pytest.approx(2.0 / math.log(2))
    assert bits_per_byte(1.5, 100, 400) == pytest.approx(1.5 * 100 / 400 / math.log(2))

    wide = tmp_path / "wide.txt"   # 2 to 4 bytes per character: more bytes than char tokens
    text = TEXT[:500] + "héllo wörld ✓ 日本語 😀\n" * 20 + TEXT[500:]
    wide.write_text(text, encoding="utf-8")
    meta = load_meta(prepare_text(wide, "char", 0.3, tmp_path / "prep"))
    split = int(len(text) * 0.7)
    assert meta["bytes"] == {"train": len(text[:split].encode()), "val": len(text[split:].encode())}
    assert tokens_per_byte(meta, "train") < 1

    gpt2_or_skip()
    meta = load_meta(prepare_text(text_file, "gpt2", 0.1, tmp_path / "prep"))
    assert meta["tokens"]["val"] < meta["bytes"]["val"] / 3 and tokens_per_byte(meta, "val") < 1 / 3
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 10, 0)


def test_bytes_of_several_documents_count_their_text(tmp_path):
    """char: the newline between documents is text (a byte); BPE: the end-of-text token is not."""
    from data.prepare import load_meta
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Première. " * 30)
    (docs / "b.txt").write_text("Zweite — " * 30)
    total = len(("Première. " * 30 + "Zweite — " * 30).encode())
    char = load_meta(prepare_text(docs, "char", 0.1, tmp_path / "prep"))
    bpe = load_meta(prepare_text(docs, "bpe:300", 0.1, tmp_path / "prep"))
    assert sum(char["bytes"].values()) == total + 1 and sum(bpe["bytes"].values()) == total


def test_batches_drawn_on_the_device_and_from_the_memory_mapped_files_are_the_same(tmp_path, text_file,
                                                                                 monkeypatch):
    """A dataset is copied to the device when it fits, else read memory-mapped: on one device both draw the
    same windows from the same generator, and evaluate the same fixed windows."""
    import data.loader
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    resident = BatchLoader(out, block_size=16, batch_size=4, seed=3, share=Share(grad_accum=2))
    monkeypatch.setattr(data.loader, "free_memory", lambda device: 0)
    mapped = BatchLoader(out, block_size=16, batch_size=4, seed=3, share=Share(grad_accum=2))
    assert resident.resident and not mapped.resident
    for _ in range(3):
        assert torch.equal(resident.step_windows(), mapped.step_windows())
    for split in ("train", "val"):
        for (x, y), (x2, y2) in zip(resident.eval_windows(split), mapped.eval_windows(split), strict=True):
            assert torch.equal(x, x2) and torch.equal(y, y2) and x.dtype == torch.long


def test_an_exact_evaluation_scores_every_val_token_once_and_a_fixed_train_sample(tmp_path, text_file):
    from data.loader import strided_windows
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    loader = BatchLoader(out, block_size=16, batch_size=4)
    val = [torch.cat([t.flatten() for t in pair]) for pair in zip(*loader.eval_windows("val"))]
    every = [torch.cat([t.flatten() for t in pair]) for pair in zip(*strided_windows(
        np.asarray(loader.splits["val"].cpu()), 16, 16, 4))]
    assert torch.equal(val[0], every[0]) and torch.equal(val[1], every[1]), "every target once, in order"
    assert len(val[1]) == loader.meta["tokens"]["val"] - 1
    train = list(loader.eval_windows("train"))
    windows = -(-(loader.meta["tokens"]["val"] - 1) // 16)
    assert sum(len(x) for x, _ in train) == max(2, round(windows / 8)), "an eighth as many"
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(train, loader.eval_windows("train"))), "fixed"


def test_the_train_sample_of_a_long_split_ends_at_its_last_window(tmp_path, text_file, monkeypatch):
    """Evenly spaced offsets computed in integers: float32 ones of a split past 2^24 tokens could pass its end."""
    import data.loader
    monkeypatch.setattr(data.loader, "free_memory", lambda device: 0)
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    meta = json.loads((out / "meta.json").read_text())
    n = 56_777_236
    with open(out / "train.bin", "wb") as f:   # (sparse: zeros, a valid id)
        f.truncate(2 * n)
    meta["tokens"]["train"] = n
    (out / "meta.json").write_text(json.dumps(meta))
    loader = BatchLoader(out, block_size=16, batch_size=4)
    starts = []
    monkeypatch.setattr(loader, "windows", lambda split, s: starts.append(s) or torch.zeros(len(s), 17).long())
    list(loader.eval_windows("train"))
    assert int(torch.cat(starts)[-1]) == n - 17 and int(torch.cat(starts)[0]) == 0


def test_a_checkpoint_s_data_order_from_another_kind_of_generator_goes_on_in_a_new_order(tmp_path, text_file,
                                                                                        capsys):
    """Data on the device then, memory-mapped now (or the reverse): the saved state cannot be taken; the run
    says so and draws a new order, not the one it began with."""
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    fresh, moved = (BatchLoader(out, block_size=16, batch_size=4, seed=1) for _ in range(2))
    moved.load_state_dict({"generator": torch.Generator().manual_seed(5).get_state(), "device": "cuda"})
    assert "notice: the checkpoint drew its batches on cuda, this run on cpu" in capsys.readouterr().err
    assert not torch.equal(fresh.step_windows(), moved.step_windows())


def edit_meta(out, change):
    meta = json.loads((out / "meta.json").read_text())
    change(meta)
    (out / "meta.json").write_text(json.dumps(meta))


def truncate(path, by=1):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


ENTRY_DAMAGES = {   # what makes the entry unusable, and the reason the notice gives
    "truncated train.bin": (lambda out: truncate(out / "train.bin"), "has a train.bin that is not the"),
    "deleted val.bin": (lambda out: (out / "val.bin").unlink(), "has a val.bin that is not the"),
    "extra bytes in val.bin": (lambda out: open(out / "val.bin", "ab").write(b"\0\0"), "val.bin that is not"),
    "a count that is not the file's": (lambda out: edit_meta(out, lambda m: m["tokens"].update(val=-5)),
                                       "val.bin that is not the -10 bytes"),
    "meta.json not JSON": (lambda out: (out / "meta.json").write_text('{"format": 3,'), "no readable meta"),
    "meta.json not an object": (lambda out: (out / "meta.json").write_text("[]"), "is of format None"),
    "another format": (lambda out: edit_meta(out, lambda m: m.update(format=FORMAT - 1) or m.pop("bytes")),
                       f"is of format {FORMAT - 1}, not this code's {FORMAT}"),
    "no meta.json": (lambda out: (out / "meta.json").unlink(), "has no readable meta.json"),
}


@pytest.mark.parametrize("damage", ENTRY_DAMAGES, ids=list(ENTRY_DAMAGES))
def test_a_damaged_entry_is_prepared_again_with_a_notice(tmp_path, text_file, capsys, damage):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    good = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    change, _ = ENTRY_DAMAGES[damage]
    change(out)
    capsys.readouterr()

    with pytest.raises(UserError, match=rf"the prepared dataset {re.escape(str(out))} is missing, unfinished, "
                                        rf"damaged or of an older format: delete it and prepare the data again$"):
        load_meta(out)   # where the text is not at hand: a one-line error that names the entry
    with pytest.raises(UserError, match="delete it"):
        BatchLoader(out, block_size=8, batch_size=2)

    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") == out
    err = capsys.readouterr().err.strip()
    assert err == f"notice: {out} is unfinished, damaged or of an older format: preparing it again", err
    assert "\n" not in err
    assert {name: (out / name).read_bytes() for name in good} == good, "the same entry as before the damage"
    assert os.listdir(tmp_path / "prep") == [out.name], "no temporary dir left"


def test_a_sound_entry_is_reused_without_a_notice_and_new_content_is_a_new_one(tmp_path, text_file, capsys):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    stamp = os.stat(out / "train.bin").st_mtime_ns
    capsys.readouterr()
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") == out
    assert capsys.readouterr() == ("", "") and os.stat(out / "train.bin").st_mtime_ns == stamp
    assert load_meta(out)["format"] == FORMAT
    text_file.write_text(TEXT + "more")
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") != out, "new content, new entry"


def test_a_text_too_short_for_the_block_is_refused_before_it_is_published(tmp_path, text_file):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 3)
    for tokenizer in ("char", "bpe:300"):
        with pytest.raises(UserError, match=r"the (train|val) split has \d+ tokens, fewer than block_size "
                                            r"\+ 1 = 9; use a longer text or a smaller --model.block_size"):
            prepare_text(short, tokenizer, 0.1, tmp_path / "prep", block_size=8)
        assert os.listdir(tmp_path / "prep") == [], "no entry and no temporary dir"
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")   # no block_size: no check
    with pytest.raises(UserError, match="the val split has 164 tokens, fewer than block_size"):
        prepare_text(text_file, "char", 0.1, tmp_path / "prep", block_size=200)   # a cache hit is checked too
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep", block_size=163) == out


def test_encoding_errors_are_part_of_the_cache_key(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(TEXT.encode() + b"\xff")
    replaced = prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="replace")
    assert load_meta(replaced)["encoding_errors"] == "replace"
    with pytest.raises(UserError, match="byte 0xff at offset"):
        prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="strict")
    assert load_meta(replaced)["encoding_errors"] == "replace", "kept"
    clean = tmp_path / "clean.txt"
    clean.write_text(TEXT)
    assert prepare_text(clean, "char", 0.1, tmp_path / "prep") != \
        prepare_text(clean, "char", 0.1, tmp_path / "prep", encoding_errors="replace")


def test_token_ids_past_the_vocabulary_in_a_file_of_the_right_size_are_one_line(tmp_path, text_file,
                                                                                monkeypatch):
    """The cache's checks read meta.json and file sizes; a train.bin damaged in place is caught where
    its windows are read, copied to the device or memory-mapped, before the embedding would fail on
    them: one line that names the entry."""
    import data.loader
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tokens[::7] = 60_000   # far past the 48 characters, same size, same dtype
    tokens.tofile(out / "train.bin")
    for _ in ("copied to the device", "memory-mapped"):
        with pytest.raises(UserError) as e:
            BatchLoader(out, block_size=32, batch_size=8).step_windows()
        said = str(e.value)
        assert "\n" not in said and f"{out} holds token id 60000 in train.bin" in said
        assert "delete it and prepare the data again" in said
        monkeypatch.setattr(data.loader, "free_memory", lambda device: 0)


def test_a_text_of_one_distinct_token_is_refused(tmp_path):
    """A file of NUL bytes (or any one character over and over) would train to a loss of 0 on nothing."""
    path = tmp_path / "zeros.txt"
    path.write_bytes(b"\0" * 5000)
    for tokenizer in ("char", "gpt2"):
        if tokenizer == "gpt2":
            gpt2_or_skip()   # (once the char case has passed)
        with pytest.raises(UserError, match=r"a single distinct token \(id \d+, '\\x00'\): there is nothing"):
            prepare_text(path, tokenizer, 0.1, tmp_path / "prep")
    assert not list((tmp_path / "prep").glob("zeros*")), "nothing was kept"


def test_a_file_name_too_long_for_a_cache_entry_is_prepared(tmp_path):
    path = tmp_path / ("n" * 240 + ".txt")   # with the tokenizer, hash and split it would pass 255 bytes
    path.write_text(TEXT)
    assert load_meta(prepare_text(path, "char", 0.1, tmp_path / "prep"))["tokens"]["train"] > 0
