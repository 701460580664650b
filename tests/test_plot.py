"""plot.py and the loss curves (viz/curves.py) on runs written by hand (metrics.jsonl and config.toml,
as a run leaves them)."""
from viz.curves import read_records


def test_read_records_skips_damaged_lines_with_one_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "kind": "eval", "val_loss": 2.0}\n{"step": 1, "kin\n\xff\xfe\n'
                     b'{"step": "2", "kind": "eval"}\n[1, 2]\n\n{"step": 3, "kind": "train", "loss": 1.5}\n')
    assert [r["step"] for r in read_records(path)] == [0, 3]
    assert capsys.readouterr().err == f"warning: {path}: skipped 4 damaged line(s)\n"
    assert len(read_records(path, warn=False)) == 2 and capsys.readouterr().err == ""
    assert read_records(tmp_path / "none.jsonl") == [], "no log yet: no records"
