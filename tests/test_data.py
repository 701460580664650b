"""Tokenizers round-trip; preparing writes what meta.json says and is cached; batches are shifted windows."""
import json
import math

import numpy as np
import pytest
import torch

from data.loader import BatchLoader, Share
from common import UserError
from data.tokenizers import CharTokenizer, build_tokenizer, load_tokenizer
from tests.conftest import TEXT, gpt2_or_skip, prepare_text


def test_char_tokenizer_round_trips_and_saves():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.vocab_size == len(set(TEXT))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    again = load_tokenizer(json.loads(json.dumps(tok.meta())))
    assert again.encode(TEXT) == tok.encode(TEXT)


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


def test_the_default_data_ships_with_the_repo_and_prepares_offline(tmp_path, monkeypatch):
    import socket

    from tests.conftest import ROOT
    from training.config import Config

    path = ROOT / Config().data.path
    assert path.is_file() and path.stat().st_size > 1_000_000, "data/tinyshakespeare.txt is in the repository"

    def no_network(*a, **k):
        raise AssertionError("preparing the default data tried to open a network connection")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    out = prepare_text(path, Config().data.tokenizer, Config().data.val_fraction, tmp_path / "prep")
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 65


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


def test_damaged_token_ids_in_a_memory_mapped_dataset_are_one_line(tmp_path, text_file, monkeypatch):
    import data.loader
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tokens[::3] = 60_000
    tokens.tofile(out / "train.bin")
    monkeypatch.setattr(data.loader, "free_memory", lambda device: 0)
    with pytest.raises(UserError, match=f"{out} holds token id 60000 in train.bin"):
        BatchLoader(out, block_size=16, batch_size=4).step_windows()


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
