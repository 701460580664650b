"""A BPE trained on the data (bpe:N): deterministic, shaped by the training split alone, byte-level
(any text round-trips), stored whole in meta.json and rebuilt from it, checked when it is read."""
import base64
import json

import numpy as np
import pytest

import data.prepare as prep
from common import UserError
from data.bpe import EOT
from data.tokenizers import load_tokenizer
from tests.conftest import TEXT, gpt2_or_skip, prepare_text

UNSEEN = "héllo wörld, naïve café — 日本語のテキスト 😀🎉 ∑ x² \t\r\n <|endoftext|> \x00 \U0010fffd"


def trained(tmp_path, text: str, tokenizer="bpe:300", name="t.txt", root="prep", **kw) -> tuple:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    out = prepare_text(path, tokenizer, 0.2, tmp_path / root, **kw)
    meta = json.loads((out / "meta.json").read_text())
    return out, meta


def test_the_same_text_gives_the_same_ranks(tmp_path):
    _, first = trained(tmp_path, TEXT, root="a")
    _, again = trained(tmp_path, TEXT, root="b")
    assert first["tokenizer"] == again["tokenizer"]
    assert first["tokenizer"]["kind"] == "bpe" and len(first["tokenizer"]["ranks"]) == 299
    assert first["vocab_size"] == 300 and first["tokenizer"]["special_tokens"] == {EOT: 299}


def test_only_the_training_split_shapes_the_merges(tmp_path):
    split = int(len(TEXT) * 0.8)
    other_val = "".join(reversed(TEXT[split:]))   # same length: the split point does not move
    _, base = trained(tmp_path, TEXT, name="a.txt")
    _, new_val = trained(tmp_path, TEXT[:split] + other_val, name="b.txt")
    _, new_train = trained(tmp_path, TEXT[:split].upper() + TEXT[split:], name="c.txt")
    assert new_val["sha256"] != base["sha256"] and new_val["tokenizer"] == base["tokenizer"]
    assert new_train["tokenizer"] != base["tokenizer"], "the train split does shape them"


def test_training_reads_at_most_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PIECE_CHARS", 97)
    monkeypatch.setattr(prep, "TRAIN_MAX_CHARS", 600)
    head, tail = TEXT[:1000], TEXT[1000:]
    _, a = trained(tmp_path, head + tail, name="a.txt")
    _, b = trained(tmp_path, head + tail.upper(), name="b.txt")   # differs only after the cap
    assert a["tokenizer"] == b["tokenizer"]
    monkeypatch.setattr(prep, "TRAIN_MAX_CHARS", 10**9)
    _, c = trained(tmp_path, head + tail.upper(), name="c.txt", root="uncapped")
    assert c["tokenizer"] != a["tokenizer"]


def test_any_text_round_trips_through_the_stored_meta_alone(tmp_path):
    _, meta = trained(tmp_path, TEXT)
    tok = load_tokenizer(json.loads(json.dumps(meta["tokenizer"])))
    for text in (UNSEEN, TEXT, "", " ", "\n\n", "ZZZZqqqq"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode("utf-8")
        assert max(ids, default=0) < tok.vocab_size == 300
    assert len(tok.encode(TEXT)) < 0.75 * len(TEXT.encode()), "the merges compress the text they came from"
    assert tok.encode("<|endoftext|>") != [tok.start_token], "in a text it is just text"


def test_the_vocabulary_size_is_part_of_the_cache_key(tmp_path):
    out300, m300 = trained(tmp_path, TEXT, "bpe:300")
    out400, m400 = trained(tmp_path, TEXT, "bpe:400")
    assert out300 != out400 and (m300["vocab_size"], m400["vocab_size"]) == (300, 400)
    assert "bpe300" in out300.name and "bpe400" in out400.name
    assert trained(tmp_path, TEXT, "bpe:300")[0] == out300


def test_documents_are_separated_by_the_end_of_text_token(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT[:1500])
    (docs / "b.txt").write_text(TEXT[1500:])
    out = prepare_text(docs, "bpe:300", 0.1, tmp_path / "prep")
    meta = json.loads((out / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]).tolist()
    tok = load_tokenizer(meta["tokenizer"])
    assert ids.count(tok.start_token) == 1 and tok.decode(ids) == TEXT[:1500] + EOT + TEXT[1500:]


def test_too_few_pairs_give_fewer_tokens_and_say_so(tmp_path):
    _, meta = trained(tmp_path, "abab abab abab " * 50, "bpe:5000")
    assert meta["vocab_size"] < 5000 and meta["vocab_size"] == len(meta["tokenizer"]["ranks"]) + 1


@pytest.mark.parametrize("spec", ["bpe:abc", "bpe:256", "bpe", "bpe:99999999", "bpe:-5"])
def test_a_bad_vocabulary_size_is_refused_before_anything_is_read(tmp_path, text_file, spec):
    with pytest.raises(UserError, match=r"write bpe:N with N the vocabulary size, 257 to"):
        prepare_text(text_file, spec, 0.1, tmp_path / "prep")
    assert not (tmp_path / "prep").exists()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


DAMAGES = {
    "ranks not a list": (lambda t: t.update(ranks="abc"), "not a list of base64"),
    "a rank not base64": (lambda t: t["ranks"].__setitem__(280, "@@@"), "not a list of base64 strings"),
    "a byte missing": (lambda t: t["ranks"].__setitem__(65, _b64(b"\xff\xfe")), "not every byte"),
    "a token twice": (lambda t: t["ranks"].__setitem__(280, t["ranks"][281]), "appears twice"),
    "an empty token": (lambda t: t["ranks"].__setitem__(280, ""), "empty or appears twice"),
    "no end-of-text": (lambda t: t.update(special_tokens={}), r"special tokens must be <\|endoftext\|> alone"),
    "end-of-text id clashes": (lambda t: t.update(special_tokens={EOT: 5}), "with the id after the 299 ranks"),
    "end-of-text id not an int": (lambda t: t.update(special_tokens={EOT: "299"}), "with the id after the 299 ranks"),
    "end-of-text id a float": (lambda t: t.update(special_tokens={EOT: 299.0}), "damaged BPE tokenizer description"),
    "pattern not a regex": (lambda t: t.update(pattern="(unclosed"), "damaged BPE tokenizer description"),
    "no pattern": (lambda t: t.pop("pattern"), "name or pattern is missing"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_description_is_a_one_line_tokenizer_error(tmp_path, damage):
    _, meta = trained(tmp_path, TEXT)
    tok_meta = json.loads(json.dumps(meta["tokenizer"]))
    change, message = DAMAGES[damage]
    change(tok_meta)
    with pytest.raises(UserError, match=message) as e:
        load_tokenizer(tok_meta)
    assert "\n" not in str(e.value)


def test_another_special_token_written_as_text_is_encoded_as_text():
    """A chat corpus holds '<|endofprompt|>' (cl100k_base's) as plain text: records of it encode
    as the same text would alone, with the end-of-text token between documents."""
    gpt2_or_skip()
    import tiktoken
    from data.bpe import TiktokenTokenizer
    gpt2 = tiktoken.get_encoding("gpt2")
    special = {**gpt2._special_tokens, "<|endofprompt|>": gpt2.n_vocab}
    enc = tiktoken.Encoding("gpt2-chat", pat_str=gpt2._pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                            special_tokens=special)
    tok = TiktokenTokenizer(enc, {})
    pieces = ["Q: hi <|endofprompt|> A:", None, " bye"]
    alone = [tok.encode_array(pieces[0]), [tok.end_token], tok.encode_array(pieces[2])]
    assert tok.encode_pieces(pieces).tolist() == [i for part in alone for i in part]
