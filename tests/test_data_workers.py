"""BPE encoded on every core (data.workers threads): the token files are byte for byte those of
one worker, whatever the batches and the documents hold (a literal <|endoftext|> too); the workers
are no part of the cache key; memory stays bounded, however large the text."""
import json
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

import data.prepare as prep
import data.sources
from data.prepare import DataConfig, prepare
from tests.conftest import TEXT, gpt2_or_skip

# long and short documents, a blank one, one that holds the end-of-text marker as text
LONG = TEXT * 5
DOCS = [LONG[:3000], "héllo ✓ 😀 <|endoftext|> it's", "   ", LONG[3000:3100], "x\r\ny  z",
        LONG[3100:]] + [LONG[i:i + 40] for i in range(0, 2000, 40)]


def files(out):
    """The bytes of a prepared dataset's token files, and its meta.json."""
    meta = json.loads((out / "meta.json").read_text())
    return [(out / f"{s}.bin").read_bytes() for s in prep.SPLITS], meta


@pytest.fixture
def small_pieces(monkeypatch):
    """Small reads and pieces: a short text makes many batches for the workers."""
    monkeypatch.setattr(data.sources, "READ_BYTES", 101)
    monkeypatch.setattr(prep, "PIECE_CHARS", 300)


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe:300"])
def test_every_worker_count_writes_the_bytes_of_one(tmp_path, small_pieces, tokenizer):
    """In a JSONL file and in a text, with the val split inside a document."""
    if tokenizer == "gpt2":
        gpt2_or_skip()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (tmp_path / "text.txt").write_text("".join(DOCS))
    for name in ("docs.jsonl", "text.txt"):
        one, meta = files(prepare(DataConfig(str(tmp_path / name), tokenizer, 0.15,
                                             str(tmp_path / "one"), workers=1)))
        assert len("".join(DOCS)) > 30 * prep.PIECE_CHARS, "many batches"
        for workers in (2, 8):
            out = prepare(DataConfig(str(tmp_path / name), tokenizer, 0.15,
                                     str(tmp_path / f"w{workers}"), workers=workers))
            assert files(out) == (one, meta), f"{name}, {workers} workers"


def test_a_batch_of_documents_encodes_as_each_document_alone(tmp_path):
    """encode_pieces joins a batch's documents by <|endoftext|> for one call to tiktoken: the ids
    are those of each document encoded alone, the end-of-text token between them; a document
    holding the marker as text encodes it as text."""
    tok = gpt2_or_skip()
    eot = tok.end_token
    for docs in ([TEXT[:500], "a", " b ", "\n\nc"], ["x <|endoftext|> y", TEXT[:200]]):
        pieces = [p for d in docs for p in (None, d)][1:]
        alone = [[eot] if p is None else tok.encode(p) for p in pieces]
        assert tok.encode_pieces(pieces).tolist() == [i for ids in alone for i in ids]


def test_the_workers_are_no_part_of_the_cache_key(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    one = prepare(DataConfig(str(path), "bpe:300", 0.1, str(tmp_path / "p"), workers=1))
    capsys.readouterr()
    assert prepare(DataConfig(str(path), "bpe:300", 0.1, str(tmp_path / "p"), workers=4)) == one
    assert "prepared" not in capsys.readouterr().out, "the entry of one worker is reused"


def test_a_refused_worker_count_is_one_line(tmp_path):
    with pytest.raises(prep.UserError, match=r"^data.workers must be >= 0, got -1$"):
        prepare(DataConfig(str(tmp_path / "t.txt"), "gpt2", workers=-1))


def test_memory_does_not_grow_with_the_text_on_many_workers(tmp_path, monkeypatch):
    """8 workers hold 9 batches at most: 10 MB of JSONL takes no more peak memory than 2 MB
    (within 2 MB; 10 MB held whole would cost 10 MB). Small pieces, so that 2 MB fills them all."""
    gpt2_or_skip()
    monkeypatch.setattr(prep, "PIECE_CHARS", 1 << 15)
    record = (json.dumps({"text": TEXT[:2000]}) + "\n").encode()
    peaks = []
    for name, size in (("small", 2_000_000), ("big", 10_000_000)):
        (tmp_path / f"{name}.jsonl").write_bytes(record * (size // len(record)))
        tracemalloc.start()
        try:
            prepare(DataConfig(str(tmp_path / f"{name}.jsonl"), "gpt2", 0.1, str(tmp_path / "p"),
                               workers=8))
            peaks.append(tracemalloc.get_traced_memory()[1] / 1e6)
        finally:
            tracemalloc.stop()
    assert peaks[1] - peaks[0] < 2, f"peak memory grew from {peaks[0]:.1f} to {peaks[1]:.1f} MB"


def test_the_workers_take_a_bounded_number_of_items_ahead_and_keep_their_order():
    """However slow the work, at most workers + 1 items are taken before their results are used."""
    taken = []

    def items():
        for i in range(60):
            taken.append(i)
            yield i
    for workers in (1, 4):
        taken.clear()
        def slowly(x):
            time.sleep(0.002 * (x % 3))
            return -x
        for i, result in enumerate(prep.in_order(slowly, items(), workers, ThreadPoolExecutor)):
            assert result == -i and len(taken) <= i + 1 + workers, (workers, i, len(taken))


def test_ctrl_c_or_an_error_in_a_worker_leaves_nothing(tmp_path, small_pieces, monkeypatch):
    """A worker's exception (Ctrl-C's KeyboardInterrupt here) reaches the command, and the temporary
    folder goes with it."""
    from data.bpe import TiktokenTokenizer
    gpt2_or_skip()
    (tmp_path / "t.txt").write_text("".join(DOCS))
    calls, real = [], TiktokenTokenizer.encode_pieces

    def failing(self, pieces):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, pieces)
    monkeypatch.setattr(TiktokenTokenizer, "encode_pieces", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare(DataConfig(str(tmp_path / "t.txt"), "gpt2", 0.1, str(tmp_path / "p"), workers=3))
    assert list((tmp_path / "p").iterdir()) == []
