"""The prepared-data cache never uses an entry that is damaged, unfinished or of another format:
it prepares it again (with a one-line notice), or, where only the entry is at hand, names it in a
one-line error. A sound entry is reused as it is; text that cannot be used is refused before
anything is published; encoding errors are part of the key."""
import json
import os
import re

import numpy as np
import pytest

from common import UserError
from data.prepare import FORMAT, load_meta
from data.loader import BatchLoader
from tests.conftest import TEXT, gpt2_or_skip, prepare_text


def edit_meta(out, change):
    meta = json.loads((out / "meta.json").read_text())
    change(meta)
    (out / "meta.json").write_text(json.dumps(meta))


def truncate(path, by=1):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


DAMAGES = {   # what makes the entry unusable, and the reason the notice gives
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


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_entry_is_prepared_again_with_a_notice(tmp_path, text_file, capsys, damage):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    good = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    change, _ = DAMAGES[damage]
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
    with pytest.raises(UserError, match="data.encoding_errors='ignore' is not one of strict, replace"):
        prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="ignore")


def test_token_ids_past_the_vocabulary_in_a_file_of_the_right_size_are_one_line(tmp_path, text_file):
    """The cache's checks read meta.json and file sizes; a train.bin damaged in place is caught where
    its windows are read, before the embedding would fail on them: one line that names the entry."""
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tokens[::7] = 60_000   # far past the 48 characters, same size, same dtype
    tokens.tofile(out / "train.bin")
    with pytest.raises(UserError) as e:
        BatchLoader(out, block_size=32, batch_size=8).step_windows()
    assert "\n" not in str(e.value) and f"{out} holds token id 60000 in train.bin" in str(e.value)
    assert "delete it and prepare the data again" in str(e.value)


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
