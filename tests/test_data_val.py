"""A dataset's own validation split (data.val_path): its files are the val split, whole, and nothing
is carved from the training text; files of val_path inside the data folder are never trained on;
the cache key covers both texts; eval.py scores a val.jsonl as the trainer's val split."""
import json

import pytest

import eval as eval_cli
from common import UserError
from data.prepare import DataConfig, prepare
from tests.conftest import TEXT, gpt2_or_skip, prepared, records, run_tool, tiny_overrides
from tests.test_data_formats import write_jsonl, write_parquet

pytestmark = pytest.mark.usefixtures("one_thread")   # a tiny model is trained below

TRAIN = [TEXT[i:i + 300] for i in range(0, 1200, 300)]
VAL = ["Zounds! quoth he, a validation story.", TEXT[1200:]]   # (Z: no train document holds one)


def gpt2_ids(docs) -> list[int]:
    """The documents' gpt2 ids, each encoded alone, the end-of-text token between them."""
    tok = gpt2_or_skip()
    return [i for n, doc in enumerate(docs) for i in [tok.end_token] * (n > 0) + tok.encode(doc)]


def test_a_hub_folder_s_validation_files_are_the_val_split_and_never_trained_on(tmp_path, capsys):
    """--data hub/data --data.val_path 'hub/data/validation-*.parquet': the train files alone are
    the train split, whole, and the validation file is the val split."""
    pytest.importorskip("pyarrow")
    gpt2_or_skip()
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    write_parquet(hub / "train-00000-of-00002.parquet", TRAIN[:2])
    write_parquet(hub / "train-00001-of-00002.parquet", TRAIN[2:])
    write_parquet(hub / "validation-00000-of-00001.parquet", VAL)
    for tokenizer in ("char", "gpt2"):
        out = prepare(DataConfig(str(hub), tokenizer, 0.5, str(tmp_path / "p"),
                                 val_path=str(hub / "validation-*.parquet")))
        (train, val), meta = prepared(out)
        if tokenizer == "gpt2":
            assert (train, val) == (gpt2_ids(TRAIN), gpt2_ids(VAL))
        else:   # a newline between documents
            chars = meta["tokenizer"]["chars"]
            assert "".join(chars[i] for i in train) == "\n".join(TRAIN)
            assert "".join(chars[i] for i in val) == "\n".join(VAL)
        assert meta["split"]["val_path"] == str(hub / "validation-*.parquet")
    said = capsys.readouterr().out
    assert f"data: {hub} (2 files: 2 .parquet;" in said, "the train files only"
    assert f"val: {hub / 'validation-*.parquet'} (1 file: 1 .parquet;" in said


def test_a_pair_of_jsonl_files_and_the_cache_key_of_both(tmp_path, capsys):
    gpt2_or_skip()
    train_file = write_jsonl(tmp_path / "train.jsonl", TRAIN)
    val_file = write_jsonl(tmp_path / "val.jsonl", VAL)

    def entry(val_fraction=0.1):
        return prepare(DataConfig(str(train_file), "gpt2", val_fraction, str(tmp_path / "p"),
                                  val_path=str(val_file)))
    out = entry()
    assert prepared(out)[0] == [gpt2_ids(TRAIN), gpt2_ids(VAL)]
    capsys.readouterr()
    assert entry(0.5) == out and "prepared" not in capsys.readouterr().out, \
        "val_fraction is unused: the same entry"
    write_jsonl(val_file, VAL[:1] + TRAIN[:1])
    assert prepared(entry())[0] == [gpt2_ids(TRAIN), gpt2_ids(VAL[:1] + TRAIN[:1])], "val changed"
    write_jsonl(train_file, TRAIN[1:])
    assert prepared(entry())[0][0] == gpt2_ids(TRAIN[1:]), "train changed"
    assert len(list((tmp_path / "p").iterdir())) == 3


def test_a_data_folder_of_val_files_only_is_one_line(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "val.jsonl", VAL)
    with pytest.raises(UserError, match=r"holds no files but those of --data.val_path"):
        prepare(DataConfig(str(tmp_path / "d"), "char", val_path=str(tmp_path / "d" / "val.jsonl")))
    with pytest.raises(UserError, match=r"^no files match .*nothing-\*"):
        prepare(DataConfig(str(tmp_path / "d"), "char", val_path=str(tmp_path / "nothing-*")))


def test_eval_py_scores_a_val_jsonl_as_the_trainers_val_split(tmp_path, capsys):
    """Trained with --data.val_path val.jsonl (an exact evaluation): eval.py on val.jsonl scores its
    records as the documents of the val split, to the trainer's val loss."""
    from training.config import build_config
    from training.trainer import train
    write_jsonl(tmp_path / "train.jsonl", TRAIN * 3)
    write_jsonl(tmp_path / "val.jsonl", VAL)
    cfg = build_config(None, tiny_overrides(tmp_path, tmp_path / "train.jsonl", **{
        "data.val_path": tmp_path / "val.jsonl", "train.eval_iters": 0, "train.max_steps": 10,
        "model.block_size": 16}))
    train(cfg, quiet=True)
    val_loss = records(cfg.out_dir, "eval", "val_loss")[10]
    ckpt = cfg.out_dir + "/ckpt_0000010.pt"
    argv = [ckpt, tmp_path / "val.jsonl", "--device", "cpu", "--json"]
    rc, out, err = run_tool(eval_cli, argv, capsys)
    assert rc == 0, err
    total = json.loads(out)["total"]
    assert total["tokens"] == len("\n".join(VAL)) - 1
    assert total["loss"] == pytest.approx(val_loss, abs=1e-6)
