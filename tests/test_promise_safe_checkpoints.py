"""Checkpoints cannot run code, and a damaged one is named in one line: every member's checksum is
checked, then the format and version, then the weights load strictly into the model the config
describes; torch.load(weights_only=True) refuses what could run code. Every command reads a
checkpoint the same way (model/loading.py): sample.py stands for them all, train.py --resume for
the run."""
import shutil
import struct
import zipfile

import pytest
import torch

import sample as sample_cli
import train as train_cli
from loading import VERSION
from tests.conftest import Evil, assert_refused, mkdir, run_tool, tiny_overrides, write

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def damaged(trained, tmp, kind):
    """A checkpoint file with one kind of damage."""
    path, good = tmp / f"{kind}.pt", trained / "ckpt_0000004.pt"
    data = good.read_bytes()
    if kind == "empty":
        return write(path, b"")
    if kind == "truncated":
        return write(path, data[: len(data) // 2])
    if kind == "flipped":   # one bit of rot in the middle of the largest tensor's bytes
        with zipfile.ZipFile(good) as archive:
            member = max((m for m in archive.infolist() if "/data/" in m.filename),
                         key=lambda m: m.file_size)
        data, at = bytearray(data), member.header_offset
        name_len, extra_len = struct.unpack("<HH", data[at + 26: at + 30])
        data[at + 30 + name_len + extra_len + member.file_size // 2] ^= 0x10
        return write(path, bytes(data))
    ckpt = torch.load(good, weights_only=True)
    model = ckpt["config"]["model"]
    if kind in ("version", "later version"):
        ckpt["version"] = 1 if kind == "version" else VERSION + 1
    elif kind == "foreign":
        ckpt = {"state_dict": ckpt["model"]}
    elif kind == "mismatched":   # its config says 3 layers, its weights have 2
        model["n_layer"] = 3
    elif kind == "reshaped":     # its config says 64 wide, its weights are 32
        model["n_embd"] = 64
    elif kind == "text n_layer":
        model["n_layer"] = str(model["n_layer"])
    torch.save(ckpt, path)
    return path


@pytest.mark.parametrize("kind, message", [
    ("empty", "is not a readable checkpoint"),
    ("truncated", "is not a readable checkpoint"),
    ("version", f"is a checkpoint of format version 1, this code reads version {VERSION}: an "
                "earlier commit of this repository reads it"),
    ("later version", f"is a checkpoint of format version {VERSION + 1}, this code reads version "
                      f"{VERSION}: a later commit of this repository reads it"),
    ("foreign", "is not a checkpoint of this project"),
    ("flipped", "is damaged: archive/"),
    ("mismatched", "does not hold a usable model"),
    ("reshaped", "does not hold a usable model"),
    ("text n_layer", "does not hold a usable model"),
])
def test_a_damaged_checkpoint_is_named_in_one_line(kind, message, tmp_path, trained, capsys):
    path = damaged(trained, tmp_path, kind)
    assert_refused(sample_cli, [path], capsys, tmp_path, f"{path} {message}")


def test_resume_from_a_damaged_latest_checkpoint_is_named_in_one_line(tmp_path, text_file,
                                                                     capsys):
    out = mkdir(tmp_path / "out")
    write(out / "ckpt_0000004.pt", b"")
    assert_refused(train_cli, [*tiny_overrides(tmp_path, text_file), "--resume"], capsys, tmp_path,
                   f"{out / 'ckpt_0000004.pt'} is not a readable checkpoint")


@pytest.mark.parametrize("command", ["sample.py", "train.py --resume"])
def test_a_checkpoint_that_would_run_code_is_refused_and_does_not_run_it(
        command, tmp_path, text_file, trained, capsys):
    marker, out = tmp_path / "pwned", mkdir(tmp_path / "out")
    evil = out / "ckpt_0000004.pt"
    good = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    # a checkpoint of ours in every other way
    torch.save({**good, "config": Evil(marker)}, evil)
    if command == "sample.py":
        tool, argv = sample_cli, [evil, "--max-new-tokens", 5]
    else:
        tool, argv = train_cli, [*tiny_overrides(tmp_path, text_file), "--resume"]
    assert_refused(tool, argv, capsys, tmp_path,
                   f"{evil} was refused: it holds objects that could run code when loaded")
    assert not marker.exists(), "the pickled payload ran"
    # the control: an unrestricted load does run it
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_a_run_dir_holding_a_stray_config_json_is_still_the_run(tmp_path, trained, capsys):
    """A Hugging Face export once written into a run's dir must not make it look like a Hugging
    Face model."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "config.json").write_text('{"model_type": "gpt2"}')
    rc, out, err = run_tool(sample_cli, [run, "--prompt", "First", "--max-new-tokens", 3], capsys)
    assert rc == 0 and out.startswith("First") and "best.pt" in err, err
