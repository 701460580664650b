"""Your own data in records: a JSONL line (.jsonl, .jsonl.gz) or a Parquet row is a document of the one
preparation pipeline, tokenized exactly as the same documents in text files are; data.text_field picks
the field; a bad record is one line naming its file and line (or row); pyarrow is needed only for
Parquet; a folder of mixed kinds; the names of runs and cache entries; memory that does not grow."""
import gzip
import json
import sys
from pathlib import Path

import pytest

import data.prepare as prep
from common import UserError
from data.prepare import DataConfig, prepare
from data.cache import data_name, describe
from tests.conftest import TEXT, assert_refused, gpt2_or_skip, prepare_text, prepared

# documents with what could go wrong: non-ASCII, a literal end-of-text marker, a blank one (left out,
# as a blank file is), CRLF, a trailing newline
DOCS = [TEXT[:700], "héllo wörld ✓ 😀 <|endoftext|> it's\n\n", "   \n", TEXT[700:1500], "x\r\ny  z",
        TEXT[1500:]]


def text_files(folder: Path, docs) -> Path:
    """The documents as text files in a folder, in their order (the files' sorted order)."""
    folder.mkdir(exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"{i:03d}.txt").write_bytes(doc.encode())
    return folder


def write_jsonl(path: Path, docs, field="text", opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, field: doc}) + "\n" for i, doc in enumerate(docs))
    return path


def write_parquet(path: Path, docs, field="text", row_group_size=4) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=row_group_size)
    return path


def same_as_text_files(tmp_path, path, tokenizer="char", **settings):
    """path prepares into the tokens, split and bytes of DOCS as text files in a folder."""
    folder = text_files(tmp_path / "as-text", DOCS)
    expected, meta = prepared(prepare_text(folder, tokenizer, 0.2, tmp_path / "p"))
    got, got_meta = prepared(prepare(DataConfig(str(path), tokenizer, 0.2, str(tmp_path / "p"), **settings)))
    assert got == expected
    keys = ("tokenizer", "split", "bytes")
    assert {k: got_meta[k] for k in keys} == {k: meta[k] for k in keys}
    return got


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_jsonl_records_give_the_tokens_of_the_same_documents_as_text_files(tmp_path, small_reads, tokenizer,
                                                                            suffix):
    tok = gpt2_or_skip() if tokenizer == "gpt2" else None
    path = write_jsonl(tmp_path / f"docs{suffix}", DOCS, opener=gzip.open if suffix.endswith(".gz") else open)
    train, val = same_as_text_files(tmp_path, path, tokenizer)
    if tok:   # between the 5 documents with text, and the literal marker in one of them is text
        assert (train + val).count(tok.end_token) == 4


def test_parquet_rows_give_the_tokens_of_the_same_documents_as_text_files(tmp_path, small_reads):
    """Row groups of 4 rows read 3 at a time: batches end at row groups too."""
    pq = pytest.importorskip("pyarrow.parquet")
    path = write_parquet(tmp_path / "docs.parquet", DOCS, field="content")
    assert pq.ParquetFile(path).num_row_groups == 2
    same_as_text_files(tmp_path, path, text_field="content")
    shards = tmp_path / "shards"   # a glob of parquet files, as a Hub dataset's are
    shards.mkdir()
    write_parquet(shards / "train-00000-of-00002.parquet", DOCS[:3])
    write_parquet(shards / "train-00001-of-00002.parquet", DOCS[3:])
    same_as_text_files(tmp_path, shards / "train-*.parquet")


def test_a_mixed_folder_takes_each_file_by_its_kind_and_says_so(tmp_path, capsys):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text(DOCS[0])
    write_jsonl(mixed / "b.jsonl", DOCS[1:3])
    write_parquet(mixed / "c.parquet", DOCS[3:])
    same_as_text_files(tmp_path, mixed)
    size = sum(p.stat().st_size for p in mixed.iterdir()) / 1e6
    summary = f"data: {mixed} (3 files: 1 .txt, 1 .jsonl, 1 .parquet; {size:.1f} MB)"
    assert summary in capsys.readouterr().out.splitlines()


def test_text_field_picks_the_field_and_is_part_of_the_cache_entry(tmp_path):
    path = tmp_path / "posts.jsonl"
    path.write_text("".join(json.dumps({"text": f"Title {i}!", "body": doc}) + "\n"
                            for i, doc in enumerate(DOCS)))
    titles = prepare_text(path, "char", 0.2, tmp_path / "p")
    assert prepared(titles)[1]["text_field"] == "text"
    bodies = same_as_text_files(tmp_path, path, text_field="body")
    assert bodies != prepared(titles)[0] and len(list((tmp_path / "p").glob("posts-jsonl-char-*"))) == 2
    rc = prep.main([str(path), "--data.text_field=body", "--val-fraction=0.2", "--root", str(tmp_path / "p")])
    assert rc == 0 and len(list((tmp_path / "p").glob("posts-jsonl-char-*"))) == 2, "the same entry again"
    text = tmp_path / "notes.txt"   # plain text: the field changes nothing, its entry included
    text.write_text(TEXT)
    assert prepare_text(text, "char", 0.2, tmp_path / "p") == \
        prepare(DataConfig(str(text), "char", 0.2, str(tmp_path / "p"), text_field="body"))
    from training.config import build_config
    assert build_config(None, ["--data", str(path), "--data.text_field=body"]).data.text_field == "body"


@pytest.mark.parametrize("lines, message", [
    ([b'{"text": "a"}', b"not json"], "line 2: not JSON (Expecting value)"),
    ([b'{"text": "a"}', b"", b'{"body": "b"}'], "line 3: no string in 'text' (missing or null); --data.text"),
    ([b'{"text": null}'], "line 1: no string in 'text' (missing or null)"),
    ([b'{"text": 5}'], "line 1: no string in 'text' (int)"),
    ([b'["text"]'], "line 1: no string in 'text'"),
    ([b'{"text": "a"}', b'{"text": "caf\xe9"}'], "line 2: not UTF-8 (invalid continuation byte)"),
    ([b'{"text": "a"}', b'{"text": "x\\ud800y"}'], "line 2: a lone surrogate \\ud800 is no character; set --data"),
], ids=["not JSON", "no field", "null", "a number", "not an object", "not UTF-8", "lone surrogate"])
def test_a_bad_record_is_one_line_naming_the_file_and_line(tmp_path, capsys, lines, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    assert_refused(prep, [bad, "--root", tmp_path / "prep"], capsys, tmp_path, f"{bad}, {message}")


def test_a_lone_surrogate_is_replaced_when_asked(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b'{"text": "ab\\ud800cd ab"}\n')
    out = prepare(DataConfig(str(path), prepared_dir=str(tmp_path / "prep"), encoding_errors="replace"))
    assert "\ufffd" in json.loads((out / "meta.json").read_text())["tokenizer"]["chars"]


def test_blank_records_are_left_out_and_none_left_is_an_empty_file(tmp_path):
    path = write_jsonl(tmp_path / "blank.jsonl", ["", " \n", "\t"])
    with pytest.raises(UserError, match="data file is empty"):
        prepare_text(path, "char", 0.1, tmp_path / "p")


def test_parquet_errors_name_the_columns_and_the_row(tmp_path):
    path = write_parquet(tmp_path / "rows.parquet", ["some text", "more text", None])
    with pytest.raises(UserError) as e:
        prepare(DataConfig(str(path), "char", 0.1, str(tmp_path / "p"), text_field="body"))
    assert str(e.value) == f"{path} has no column 'body' (it has: id, text); --data.text_field names the " \
                           f"column that holds the text"
    with pytest.raises(UserError, match=r"rows.parquet, row 3: no string in 'text' \(missing or null\)"):
        prepare_text(path, "char", 0.1, tmp_path / "p")


def test_a_damaged_file_is_one_line_naming_it(tmp_path):
    """A download cut short, a file that is not what its name says, a deflate block of a type that
    does not exist, a Git LFS pointer where the Parquet file should be (a clone without git-lfs):
    one line naming the file and how it was read, not a traceback."""
    records = write_jsonl(tmp_path / "docs.jsonl", DOCS * 50).read_bytes()
    text = TEXT.encode() * 20
    gz_records, gz_text = gzip.compress(records), gzip.compress(text)
    bad_block = bytearray(gz_text)
    # the first deflate block's type: 3, which does not exist
    bad_block[10] |= 0b110
    damaged = {"cut.jsonl.gz": (gz_records[:len(gz_records) // 2], r"\.jsonl\.gz"),
               "plain.jsonl.gz": (records, r"\.jsonl\.gz"),
               "docs.jsonl.gz": (bytes(bad_block), r"\.jsonl\.gz(?=: .*block type)"),
               "cut.txt.gz": (gz_text[:len(gz_text) // 2], "gzip"),
               "plain.txt.gz": (TEXT.encode(), "gzip"), "bad.1.gz": (bytes(bad_block), "gzip"),
               "pointer.parquet": (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n",
                                   r"\.parquet")}
    for name, (content, kind) in damaged.items():
        if name.endswith(".parquet"):
            pytest.importorskip("pyarrow")
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=rf"^{tmp_path / name} cannot be read as {kind}: \S"):
            prepare_text(tmp_path / name, "char", 0.1, tmp_path / "p")


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_gzipped_text_gives_the_tokens_of_the_text(tmp_path, small_reads, tokenizer):
    """A folder of man pages (ls.1.gz) and notes (notes.txt.gz) is read as the same text
    uncompressed, in the same streaming pass."""
    if tokenizer == "gpt2":
        gpt2_or_skip()
    man = ".TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH DESCRIPTION\n" + DOCS[1] + TEXT
    texts = {"ls.1": man, "notes.txt": TEXT[:900]}
    for folder, zipped in (("plain", False), ("gz", True)):
        (tmp_path / folder).mkdir()
        for name, text in texts.items():
            (tmp_path / folder / (name + ".gz" * zipped)).write_bytes(
                gzip.compress(text.encode()) if zipped else text.encode())
    plain, gz = (prepared(prepare_text(tmp_path / folder, tokenizer, 0.1, tmp_path / "p"))
                 for folder in ("plain", "gz"))
    assert gz[0] == plain[0] and gz[1]["bytes"] == plain[1]["bytes"]


def test_pyarrow_is_needed_for_parquet_only(tmp_path, monkeypatch):
    """Without pyarrow (an import of it fails) text and JSONL prepare, and a Parquet file says what to
    install."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "a.txt").write_text(TEXT)
    prepare_text(tmp_path / "a.txt", "char", 0.1, tmp_path / "p")
    prepare_text(write_jsonl(tmp_path / "b.jsonl", DOCS), "char", 0.1, tmp_path / "p")
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError) as e:
        prepare_text(tmp_path, "char", 0.1, tmp_path / "p")
    assert str(e.value) == f"reading {tmp_path / 'c.parquet'} needs pyarrow: pip install pyarrow"


@pytest.mark.parametrize("path, name", [
    ("my_notes.txt", "my_notes"), ("notes/my_notes.txt", "my_notes"), ("books", "books"),
    ("books/*.txt", "books"), ("books/**/*.txt", "books"), ("/usr/share/doc/*/copyright", "doc-copyright"),
    ("*.txt", "data"), ("licenses.txt", "licenses"), ("licenses.jsonl", "licenses-jsonl"),
    ("licenses.JSONL.gz", "licenses-jsonl"), ("licenses.parquet", "licenses-parquet"),
    ("shards/train-*.parquet", "shards-parquet"), ("/data/*/train/*.jsonl", "train-jsonl"),
])
def test_a_data_path_is_named_by_its_literal_parts_and_kind(path, name):
    assert data_name(path) == name


def test_runs_and_cache_entries_share_the_name_and_kinds_never_share_one(tmp_path):
    """A glob with * in a folder is named by its literal parts, not `*`; licenses.txt and licenses.jsonl
    (the same bytes even) go to two out dirs and two cache entries."""
    from training.config import build_config

    def out_dir(path) -> str:
        return Path(build_config(None, ["--data", str(path)]).out_dir).name

    (tmp_path / "doc" / "pkg").mkdir(parents=True)
    (tmp_path / "doc" / "pkg" / "copyright").write_text(TEXT)
    pattern = tmp_path / "doc" / "*" / "copyright"
    assert out_dir(pattern) == "doc-copyright"
    assert prepare_text(pattern, "char", 0.1, tmp_path / "p").name.startswith("doc-copyright-char-")
    text = tmp_path / "licenses.txt"
    text.write_bytes(json.dumps({"text": TEXT}).encode() + b"\n")
    records = tmp_path / "licenses.jsonl"
    records.write_bytes(text.read_bytes())
    assert (out_dir(text), out_dir(records)) == ("licenses", "licenses-jsonl")
    entries = [prepare_text(path, "char", 0.1, tmp_path / "p").name for path in (text, records)]
    assert entries[0].startswith("licenses-char-") and entries[1].startswith("licenses-jsonl-char-")


def test_a_summary_names_known_kinds_and_counts_the_rest_as_other():
    """Version suffixes (libfoo.so.0) and files without an extension are no kind of their own."""
    names = ("libfoo.so.0", "libfoo.so.0.0", "bar.so.6", "README", "a.txt", "b.MD", "c.jsonl.gz")
    summary = describe("lib", [Path(name) for name in names], 2_000_000, "data")
    assert summary == "data: lib (7 files: 4 other, 1 .txt, 1 .md, 1 .jsonl.gz; 2.0 MB)"


def test_memory_does_not_grow_with_a_jsonl_file(tmp_path):
    """The bound for records: preparing 20 MB of JSONL takes less than 8 MB more peak memory than
    preparing 2 MB (about 16 MB: a piece of 1 to 2M characters, its code points and ids); holding its
    records, or the file, would cost the 18 MB of its text at least. Measured in-process by
    tracemalloc, which sees Python's and numpy's allocations: a child process's peak (run_limited)
    starts at its parent's size, from the fork, and would hide a growth of less than ~100 MB."""
    import tracemalloc
    record = (json.dumps({"text": TEXT}) + "\n").encode()
    peaks = []
    for name, size in (("small", 2_000_000), ("big", 20_000_000)):
        (tmp_path / f"{name}.jsonl").write_bytes(record * (size // len(record)))
        tracemalloc.start()
        try:
            prepare_text(tmp_path / f"{name}.jsonl", "char", 0.1, tmp_path / "p")
            peaks.append(tracemalloc.get_traced_memory()[1] / 1e6)
        finally:
            tracemalloc.stop()
    assert peaks[1] - peaks[0] < 8, f"peak memory grew from {peaks[0]:.0f} to {peaks[1]:.0f} MB"
