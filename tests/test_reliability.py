"""Checkpoints that cannot be lost or abused, numerical faults that stop or skip cleanly, and bad
input that ends in one line, a non-zero exit and no file written."""
import errno
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import sample as sample_cli
import train as train_cli
from data.prepare import prepare
from data.sources import DataError
from model.gpt import GPT
from tests.conftest import ROOT, TEXT, num_threads, tiny_overrides
from training.checkpoint import (FORMAT, CheckpointError, clean_key, clean_state_dict, list_checkpoints,
                                 load_checkpoint)
from training.config import build_config
from training.errors import RunError, run_cli
from training.guards import NonFiniteGuard
from training.trainer import train


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these tiny models gain nothing from more, and on a busy machine two
    threads spinning at each barrier are several times slower than one."""
    with num_threads(1):
        yield


def run_tool(tool, argv, capsys):
    """(exit code, stdout, stderr) of a command-line tool run in-process, as its __main__ would."""
    capsys.readouterr()
    try:
        rc = run_cli(tool.main, [str(a) for a in argv])
    except SystemExit as e:   # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def run_limited(argv, memory=2 << 30, timeout=120):
    """(exit code, stdout, stderr, peak resident bytes) of `python ARGV` run as a user runs it, with
    its address space limited to `memory` bytes: an allocation beyond that fails at once, as on a
    machine without that much memory, instead of taking this machine's memory from everyone else."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stdout=out, stderr=err, preexec_fn=limit,
                                env={**os.environ, "WANDB_MODE": "disabled"})
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)   # this child's own peak memory, not any other child's
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), usage.ru_maxrss * 1024


def tree(root):
    """Everything under root, with sizes and modification times: any write shows up as a difference."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def settled(snapshot):
    """A tree() snapshot without the directories' modification times, which show only that files came
    and went: what a run that removes what it wrote leaves comparable."""
    return {path: entry if not entry[0] else "dir" for path, entry in snapshot.items()}


class Evil:
    """Unpickling this runs a shell command: the payload a malicious checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 4-step run's out dir (the model of tiny_overrides), shared by the tests that need one."""
    root = tmp_path_factory.mktemp("trained")
    text = root / "tiny.txt"
    text.write_text(TEXT)
    train(build_config(None, tiny_overrides(root, text, **{"train.max_steps": 4, "train.eval_interval": 2})), quiet=True)
    return root / "out"


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_holds_everything_a_resume_needs(trained):
    ckpt = load_checkpoint(trained / "ckpt_0000004.pt")
    assert ckpt["format"] == FORMAT and ckpt["version"] == 1 and ckpt["step"] == 4
    assert ckpt["config"]["model"]["vocab_size"] == len(set(TEXT)), "the resolved config, not the requested one"
    assert ckpt["tokenizer"] == {"kind": "char", "chars": "".join(sorted(set(TEXT)))}
    assert set(ckpt["rng_ranks"][0]) >= {"python", "numpy", "torch", "cuda"} and "generator" in ckpt["loader"]
    assert ckpt["optimizer"]["state"] and "scaler" in ckpt and ckpt["elapsed"] > 0
    assert ckpt["best_val_loss"] < 10 and ckpt["skipped_steps"] == 0


def test_the_last_k_checkpoints_and_the_true_best_are_kept(tiny_cfg, monkeypatch):
    vals = iter([3.0, 2.0, 2.5, 2.7, 2.9])   # the best (step 8) is not the last, and rotates out of ckpt_*
    monkeypatch.setattr("training.trainer.evaluate", lambda *a: {"train": 1.0, "val": next(vals)})
    cfg = tiny_cfg(**{"train.eval_interval": 4, "train.keep_checkpoints": 3})
    train(cfg, quiet=True)
    assert [s for s, _ in list_checkpoints(cfg.out_dir)] == [12, 16, 20]
    best = load_checkpoint(f"{cfg.out_dir}/best.pt")
    assert best["step"] == 8 and best["best_val_loss"] == 2.0
    assert load_checkpoint(f"{cfg.out_dir}/ckpt_0000020.pt")["best_val_loss"] == 2.0


def test_best_is_a_copy_where_hard_links_fail(tiny_cfg, monkeypatch):
    def no_links(*a):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    cfg = tiny_cfg(**{"train.max_steps": 4, "train.eval_interval": 2, "train.keep_checkpoints": 1})
    train(cfg, quiet=True)
    best, last = load_checkpoint(f"{cfg.out_dir}/best.pt"), load_checkpoint(f"{cfg.out_dir}/ckpt_0000004.pt")
    assert best["step"] == 4 and all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.distributed's own imports
def test_wrapper_prefixes_never_reach_saved_keys(tmp_path):
    assert clean_key("_orig_mod.module.blocks.0.attn.query.weight") == "blocks.0.attn.query.weight"
    assert clean_key("module._orig_mod.tok_emb.weight") == "tok_emb.weight"
    assert clean_key("blocks.0._orig_mod.mlp.up.bias") == "blocks.0.mlp.up.bias"
    assert clean_key("_fsdp_wrapped_module.blocks.1._checkpoint_wrapped_module.norm1.weight") == "blocks.1.norm1.weight"
    model = GPT(build_config(None, ["--model.vocab_size=20", "--model.n_layer=1", "--model.n_embd=16"]).model)
    names = set(model.state_dict())
    assert set(clean_state_dict(torch.compile(model).state_dict())) == names
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for wrapped in (DistributedDataParallel(torch.compile(model)), torch.compile(DistributedDataParallel(model))):
            assert set(clean_state_dict(wrapped.state_dict())) == names
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_that_would_run_code_is_refused_and_does_not(tmp_path, trained, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    good = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    torch.save({**good, "config": Evil(marker)}, evil)   # a checkpoint of ours in every other way
    with pytest.raises(CheckpointError, match=r"refused.*GLOBAL posix.system"):
        load_checkpoint(evil)
    rc, _, err = run_tool(sample_cli, [evil, "--max-new-tokens", "5"], capsys)
    assert rc == 2 and "refused" in err
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(evil, out / "ckpt_0000004.pt")
    rc, _, err = run_tool(train_cli, [*tiny_overrides(tmp_path, tmp_path / "tiny.txt", out_dir=out), "--resume"], capsys)
    assert rc == 2 and "refused" in err
    assert not marker.exists(), "the pickled payload ran"
    torch.load(evil, weights_only=False)   # the control: an unrestricted load does run it
    assert marker.exists()


def test_a_prefixed_state_dict_still_samples(tmp_path, trained, capsys):
    ckpt = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    ckpt["model"] = {f"module._orig_mod.{k}": v for k, v in ckpt["model"].items()}
    torch.save(ckpt, tmp_path / "prefixed.pt")
    rc, out, err = run_tool(sample_cli, [tmp_path / "prefixed.pt", "--max-new-tokens", "5", "--prompt", "A"], capsys)
    assert rc == 0 and len(out) == len("A") + 5 + 1, err


# ---------------------------------------------------------------- bad input: the table

VOCAB = len(set(TEXT))   # the char tokenizer's vocabulary of the tiny text


def write(path, content):
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


def mkdir(path):
    path.mkdir()
    return path


def damaged(trained, tmp, kind):
    """A checkpoint file with one kind of damage."""
    path = tmp / f"{kind}.pt"
    good = (trained / "ckpt_0000004.pt").read_bytes()
    if kind == "empty":
        return write(path, b"")
    if kind == "truncated":
        return write(path, good[: len(good) // 2])
    if kind == "random":
        return write(path, bytes(range(256)) * 40)
    if kind == "text":
        return write(path, "just some text\n" * 20)
    if kind == "deflated":   # the same members, compressed: a small file could expand to any size when loaded
        with zipfile.ZipFile(trained / "ckpt_0000004.pt") as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
            for member in src.infolist():
                dst.writestr(member.filename, src.read(member))
        return path
    if kind == "flipped":   # one bit of rot in the middle of the largest tensor's bytes
        with zipfile.ZipFile(trained / "ckpt_0000004.pt") as archive:
            member = max((m for m in archive.infolist() if "/data/" in m.filename), key=lambda m: m.file_size)
        data = bytearray(good)
        name_len, extra_len = struct.unpack("<HH", data[member.header_offset + 26: member.header_offset + 30])
        data[member.header_offset + 30 + name_len + extra_len + member.file_size // 2] ^= 0x10
        return write(path, bytes(data))
    ckpt = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    model = ckpt["config"]["model"]
    if kind == "version":
        ckpt["version"] = 99
    elif kind == "foreign":
        ckpt = {"state_dict": ckpt["model"]}
    elif kind == "mismatched":   # its config says 3 layers, its weights have 2
        model["n_layer"] = 3
    elif kind == "reshaped":     # its config says 64 wide, its weights are 32
        model["n_embd"] = 64
    elif kind == "huge":         # a small file whose config claims 8 x 4096: ~6 GB of weights if built
        model.update(n_layer=8, n_embd=4096)
    elif kind == "text n_layer":
        model["n_layer"] = str(model["n_layer"])
    elif kind == "list n_layer":
        model["n_layer"] = [model["n_layer"]]
    elif kind == "text step":
        ckpt["step"] = "x"
    elif kind == "long tokenizer":   # more tokens than the model's vocabulary has rows
        ckpt["tokenizer"]["chars"] += "\u2603\u2604\u2605\u2606"
    elif kind == "nan":
        ckpt["model"]["blocks.0.mlp.up.weight"][3, 4] = float("nan")
    elif kind == "evil":
        ckpt["rng"] = Evil(tmp / "pwned")
    torch.save(ckpt, path)
    return path


def in_out_dir(env, ckpt_path, earlier=False):
    """--resume from ckpt_path as the out dir's latest checkpoint (after an intact one: earlier)."""
    out = env["tmp"] / "out"
    out.mkdir(exist_ok=True)
    shutil.copy(ckpt_path, out / "ckpt_0000004.pt")
    if earlier:
        shutil.copy(env["ckpt"], out / "ckpt_0000002.pt")
    return env["base"]() + ["--resume"]


# (id, tool, argv from the environment (may write files first), message expected in the one-line error)
CASES = [
    ("missing data", train_cli, lambda e: e["base"](**{"data.path": e["tmp"] / "missing.txt"}), "data file not found"),
    ("data dir without files", train_cli,   # a directory is one dataset of all its files; here there are none
     lambda e: e["base"](**{"data.path": mkdir(e["tmp"] / "nodata")}), "no files in the data directory"),
    ("data dir with a binary file", train_cli, lambda e: e["base"](**{"data.path": e["tmp"]}), "is not UTF-8"),
    ("empty data", train_cli, lambda e: e["base"](**{"data.path": write(e["tmp"] / "empty.txt", "")}),
     "data file is empty"),
    ("train split too short", train_cli, lambda e: e["base"](**{"data.path": e["short"]}),
     "the train split has 27 tokens, fewer than block_size + 1 = 33"),
    ("val split too short", train_cli, lambda e: e["base"](**{"model.block_size": 300}),
     f"the val split has {len(TEXT) - int(len(TEXT) * 0.9)} tokens, fewer than block_size + 1 = 301"),
    ("non-UTF-8", train_cli, lambda e: e["base"](**{"data.path": write(e["tmp"] / "latin1.txt", "ab\ncd".encode() + b"\xe9t\xe9")}),
     "byte 0xe9 at offset 5; set --data.encoding_errors=replace"),
    ("TOML syntax", train_cli, lambda e: [write(e["tmp"] / "c.toml", "[model\nn_layer = 2")] + e["base"](), "TOML syntax error"),
    ("TOML unknown key", train_cli, lambda e: [write(e["tmp"] / "c.toml", "[train]\nlearning_rate = 1")] + e["base"](),
     "unknown config key 'train.learning_rate'"),
    ("TOML wrong type", train_cli, lambda e: [write(e["tmp"] / "c.toml", '[model]\nn_layer = "two"')] + e["base"](),
     "model.n_layer: expected int, got 'two'"),
    ("missing config", train_cli, lambda e: [e["tmp"] / "nope.toml"] + e["base"](), "config file not found"),
    ("wrong type", train_cli, lambda e: e["base"](**{"train.lr": "fast"}), "train.lr: expected float, got 'fast'"),
    ("heads do not divide", train_cli, lambda e: e["base"](**{"model.n_head": 3}),
     "model.n_embd=32 is not divisible by model.n_head=3"),
    ("zero size", train_cli, lambda e: e["base"](**{"model.n_layer": 0}), "model.n_layer must be > 0, got 0"),
    ("negative size", train_cli, lambda e: e["base"](**{"train.batch_size": -4}), "train.batch_size must be > 0"),
    ("negative block", train_cli, lambda e: e["base"](**{"model.block_size": -1}), "model.block_size must be > 0"),
    ("keep zero", train_cli, lambda e: e["base"](**{"train.keep_checkpoints": 0}), "train.keep_checkpoints must be > 0"),
    ("bad on_nonfinite", train_cli, lambda e: e["base"](**{"train.on_nonfinite": "pray"}),
     "train.on_nonfinite='pray' is not one of stop, skip"),
    ("out dir under a file", train_cli, lambda e: e["base"](out_dir=write(e["tmp"] / "file", "x") / "out"),
     "cannot create the out dir"),
    ("out dir is a file", train_cli, lambda e: e["base"](out_dir=write(e["tmp"] / "file", "x")), "is a file, not a directory"),
    ("val fraction of 1", train_cli, lambda e: e["base"](**{"data.val_fraction": 1}),
     "data.val_fraction must be between 0 and 1, got 1.0"),
    ("val fraction nan", train_cli, lambda e: e["base"](**{"data.val_fraction": "nan"}),
     "data.val_fraction must be between 0 and 1, got nan"),
    ("bad encoding_errors", train_cli, lambda e: e["base"](**{"data.encoding_errors": "ignore"}),
     "data.encoding_errors='ignore' is not one of strict, replace"),
    ("prepared dir under a file", train_cli,
     lambda e: e["base"](**{"data.prepared_dir": write(e["tmp"] / "file", "x") / "p", "data.val_fraction": 0.2}),
     "cannot write the prepared data"),
    ("resume, no run", train_cli, lambda e: e["base"]() + ["--resume"], "--resume: no checkpoint"),
    ("resume and overwrite", train_cli, lambda e: e["base"]() + ["--resume", "--overwrite"], "contradict each other"),
] + [   # values of the right type that would pass a type check, then crash or diverge the run
    (f"{key}={value}", train_cli, lambda e, key=key, value=value: e["base"](**{key: value}), message)
    for key, value, message in [
        ("train.lr", "nan", "train.lr must be a finite number, got nan"),
        ("train.lr", "inf", "train.lr must be a finite number, got inf"),
        ("train.weight_decay", "nan", "train.weight_decay must be a finite number, got nan"),
        ("train.grad_clip", "nan", "train.grad_clip must be a finite number, got nan"),
        ("train.beta1", 1.5, "train.beta1 must be in [0, 1), got 1.5"),
        ("train.seed", -1, "train.seed must be in [0, 4294967295], got -1"),
        ("train.seed", 2**40, "train.seed must be in [0, 4294967295], got 1099511627776"),
        ("model.rope_base", 0, "model.rope_base must be a finite number > 0, got 0.0"),
    ]
] + [
    ("fresh run over a run", train_cli, lambda e: in_out_dir(e, e["ckpt"])[:-1],
     "already holds checkpoints of a run: continue it with --resume, start over with --overwrite"),
    ("resume, other model", train_cli, lambda e: in_out_dir(e, e["ckpt"]) + ["--model.n_layer=3"],
     "model.n_layer: 2 in the checkpoint, 3 now"),
] + [
    (f"resume, {kind} checkpoint", train_cli, lambda e, kind=kind: in_out_dir(e, damaged(e["trained"], e["tmp"], kind)), message)
    for kind, message in [("empty", "checkpoint is empty"), ("truncated", "not a readable checkpoint: truncated"),
                          ("random", "not a readable checkpoint"), ("version", "format version 99, this code reads version 1"),
                          ("foreign", "not a checkpoint of this project"), ("evil", "was refused"),
                          ("deflated", "(compressed members)"), ("flipped", "does not match its checksum")]
] + [   # a damaged latest checkpoint names the intact one before it
    (f"resume, {kind} beside an intact one", train_cli,
     lambda e, kind=kind: in_out_dir(e, damaged(e["trained"], e["tmp"], kind), earlier=True),
     "the earlier checkpoint ckpt_0000002.pt in the same directory may be intact")
    for kind in ("empty", "truncated", "flipped")
] + [
    (f"sample, {kind} checkpoint", sample_cli, lambda e, kind=kind: [damaged(e["trained"], e["tmp"], kind)], message)
    for kind, message in [("empty", "checkpoint is empty"), ("truncated", "not a readable checkpoint: truncated"),
                          ("random", "not a readable checkpoint"), ("text", "not a readable checkpoint"),
                          ("version", "format version 99"), ("foreign", "not a checkpoint of this project"),
                          ("evil", "was refused"), ("mismatched", "its weights do not match its config"),
                          ("huge", "its weights do not match its config"), ("deflated", "(compressed members)"),
                          ("flipped", "does not match its checksum"),
                          ("reshaped", f"tok_emb.weight is ({VOCAB}, 32), the config needs ({VOCAB}, 64)"),
                          ("nan", "holds non-finite weights (NaN or inf in blocks.0.mlp.up.weight)"),
                          ("text n_layer", "does not hold a usable model: model.n_layer: expected int, got '2'"),
                          ("list n_layer", "does not hold a usable model: model.n_layer: expected int, got [2]"),
                          ("text step", "is damaged: 'step' is missing or not an int"),
                          ("long tokenizer", f"its tokenizer has {VOCAB + 4} tokens, its model only model.vocab_size={VOCAB}")]
] + [
    ("sample, missing checkpoint", sample_cli, lambda e: [e["tmp"] / "gone.pt"], "checkpoint not found"),
    ("sample, dir without checkpoints", sample_cli, lambda e: [e["tmp"]], "no checkpoint (best.pt or ckpt_*.pt)"),
    ("prompt outside the vocabulary", sample_cli, lambda e: [e["ckpt"], "--prompt", "Citizen ☃"],
     "the prompt has 1 character(s) not in the"),
    ("missing prompt file", sample_cli, lambda e: [e["ckpt"], "--prompt", f"@{e['tmp'] / 'p.txt'}"], "prompt file not found"),
    ("bad sampling option", sample_cli, lambda e: [e["ckpt"], "--top-p", "2"], "--top-p must be in (0, 1]"),
    ("seed too large", sample_cli, lambda e: [e["ckpt"], "--seed", str(10**23)], "--seed must be in [0, 2^63)"),
    ("endless prompt file", sample_cli, lambda e: [e["ckpt"], "--prompt", "@/dev/zero"], "/dev/zero is larger than 1 MB"),
    ("absent GPU", sample_cli, lambda e: [e["ckpt"], "--device", "cuda:7"], "error: --device='cuda:7'"),
    ("unknown device", sample_cli, lambda e: [e["ckpt"], "--device", "tpu"], "error: --device='tpu' is not a device"),
]


@pytest.mark.parametrize("name, tool, make_argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_a_non_zero_exit_and_writes_nothing(name, tool, make_argv, message, tmp_path,
                                                                   trained, capsys):
    text = write(tmp_path / "tiny.txt", TEXT)
    short = write(tmp_path / "short.txt", "abcdefghij" * 3)
    for path in (text, short):   # a complete preparation may be cached; it is made here, before the snapshot
        prepare(path, "char", 0.1, tmp_path / "prepared")
    ckpt = tmp_path / "good.pt"
    shutil.copy(trained / "ckpt_0000004.pt", ckpt)
    env = {"tmp": tmp_path, "short": short, "ckpt": ckpt, "trained": trained,
           "base": lambda **kw: tiny_overrides(tmp_path, text, **kw)}
    argv = make_argv(env)
    before = tree(tmp_path)
    rc, out, err = run_tool(tool, argv, capsys)
    assert rc == 2, (rc, out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    assert tree(tmp_path) == before, "a failed run wrote or changed a file"
    assert not (tmp_path / "pwned").exists()


def test_bad_input_through_the_real_entry_points(tmp_path, trained):
    """The same promises when the tools run as a user runs them (a subprocess each)."""
    bad = write(tmp_path / "bad.txt", b"hello \xff world" * 50)
    truncated = damaged(trained, tmp_path, "truncated")
    before = tree(tmp_path)
    cases = [(["train.py", "--data", bad, "--data.prepared_dir", tmp_path / "p", "--out_dir", tmp_path / "o"],
              "byte 0xff at offset 6"),
             (["sample.py", truncated], "truncated")]
    for argv, message in cases:
        r = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "WANDB_MODE": "disabled"})
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, (argv, r.stderr)
    assert tree(tmp_path) == before


def test_replacing_bad_bytes_is_an_option(tmp_path, tiny_cfg):
    (tmp_path / "tiny.txt").write_bytes(TEXT.encode() + b"\xff\xfe")
    assert train(tiny_cfg(**{"data.encoding_errors": "replace", "train.max_steps": 2}), quiet=True)["step"] == 2


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), KeyboardInterrupt()])
def test_a_preparation_cut_short_leaves_nothing_behind(failure, tmp_path, text_file, monkeypatch):
    """The prepared-data cache holds complete preparations or none: never token files without
    their meta.json, which a later run could mistake for data."""
    real_dumps = json.dumps

    def fail_after_the_token_files(*a, **k):
        raise failure

    monkeypatch.setattr(json, "dumps", fail_after_the_token_files)
    with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else DataError,
                       match=None if isinstance(failure, KeyboardInterrupt) else "No space left on device"):
        prepare(text_file, "char", 0.1, tmp_path / "prepared")
    assert list((tmp_path / "prepared").iterdir()) == []
    monkeypatch.setattr(json, "dumps", real_dumps)
    assert (prepare(text_file, "char", 0.1, tmp_path / "prepared") / "meta.json").exists()


# ---------------------------------------------------------------- failures in the middle of a run

@pytest.mark.parametrize("failure, message", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "No space left on device"),
    # what torch.save's zip writer raises when the disk fills (a RuntimeError, not an OSError)
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048"), "unexpected pos 4096 vs 2048"),
], ids=["OSError", "RuntimeError"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(failure, message, tmp_path, text_file, monkeypatch,
                                                                 capsys):
    real_save, calls = torch.save, []

    def save_until_the_disk_fills(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise failure
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and err.startswith("error: could not write the checkpoint") and len(err.splitlines()) == 1, err
    assert message in err and "ckpt_0000020.pt" in err and "the checkpoints written before are kept" in err, err
    out_dir = tmp_path / "out"
    assert sorted(p.name for p in out_dir.iterdir()) == [".lock", "best.pt", "ckpt_0000010.pt", "config.toml", "metrics.jsonl"]
    assert load_checkpoint(out_dir / "ckpt_0000010.pt")["step"] == 10


def test_out_of_memory_names_the_fix_and_keeps_the_checkpoint(tmp_path, text_file, monkeypatch, capsys):
    real_clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip_until_memory_runs_out(*a, **k):
        calls.append(1)
        if len(calls) == 13:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_clip(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_until_memory_runs_out)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and "out of memory" in err and "at step 13" in err, err
    assert "smaller --train.batch_size" in err and "--model.block_size" in err and len(err.splitlines()) == 1
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10]
    assert load_checkpoint(tmp_path / "out" / "ckpt_0000010.pt")["step"] == 10


@pytest.mark.parametrize("tool, argv, code, message", [
    ("train.py", lambda tmp, text, ckpt: tiny_overrides(tmp, text, **{"train.batch_size": 300_000_000,
                                                                      "train.device": "cpu"}), 2,
     "error: out of memory on cpu at step 1"),
    ("sample.py", lambda tmp, text, ckpt: [ckpt, "--num-samples", 10_000_000, "--max-new-tokens", 5, "--device", "cpu"], 3,
     "error: out of memory (DefaultCPUAllocator"),
], ids=["train batch", "sample batch"])
def test_memory_that_runs_out_for_real_is_one_line(tool, argv, code, message, tmp_path, trained):
    """Allocations that really fail (a process limited to 2 GB of address space): a batch of 300 million
    sequences to train, 10 million samples to generate."""
    text = write(tmp_path / "tiny.txt", TEXT)
    prepare(text, "char", 0.1, tmp_path / "prepared")
    before = tree(tmp_path)
    rc, out, err, _ = run_limited([tool, *argv(tmp_path, text, trained / "ckpt_0000004.pt")])
    lines = [l for l in err.splitlines() if not l.startswith("# ")]   # sample.py names the checkpoint first
    assert rc == code and len(lines) == 1 and lines[0].startswith(message), err[-2000:]
    assert "smaller" in lines[0] and tree(tmp_path) == before


# ---------------------------------------------------------------- non-finite loss or gradient

class NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss with a non-finite gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def poison(monkeypatch, bad_steps, kind="loss"):
    """Make the training forward of the given (1-based) steps return a non-finite loss or gradient;
    returns a list with a copy of one weight as each training forward saw it."""
    real_forward, seen = GPT.forward, []

    def forward(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        if self.training and targets is not None:
            seen.append(self.lm_head.weight.detach().clone())
            if len(seen) in bad_steps:
                loss = loss * float("inf") if kind == "loss" else NanGradient.apply(loss)
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    return seen


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_a_non_finite_step_stops_the_run_naming_it(kind, tmp_path, text_file, monkeypatch, capsys):
    poison(monkeypatch, {13}, kind)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and f"non-finite {kind} at step 13" in err and "last good checkpoint (step 10) is kept" in err, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10]
    weights = load_checkpoint(tmp_path / "out" / "ckpt_0000010.pt")["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_skip_mode_drops_the_bad_updates_and_counts_them(tiny_cfg, monkeypatch):
    seen = poison(monkeypatch, {13, 15})
    cfg = tiny_cfg(**{"train.on_nonfinite": "skip"})
    summary = train(cfg, quiet=True)
    assert summary["step"] == 20 and summary["skipped_steps"] == 2
    # seen[i] is the weight after step i (as step i + 1's forward saw it)
    assert torch.equal(seen[13], seen[12]) and torch.equal(seen[15], seen[14]), "a skipped update was applied"
    assert not torch.equal(seen[12], seen[11]) and not torch.equal(seen[14], seen[13]), "a good update was dropped"
    records = [json.loads(l) for l in open(f"{cfg.out_dir}/metrics.jsonl")]
    assert [r["skipped_steps"] for r in records if r["kind"] == "train" and r["step"] in (12, 13, 20)] == [0, 1, 2]
    ckpt = load_checkpoint(f"{cfg.out_dir}/ckpt_0000020.pt")
    assert ckpt["skipped_steps"] == 2 and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_skip_mode_still_stops_a_diverged_run(tiny_cfg, monkeypatch):
    poison(monkeypatch, set(range(3, 100)))
    with pytest.raises(RunError, match="at 10 steps in a row"):
        train(tiny_cfg(**{"train.on_nonfinite": "skip"}), quiet=True)


def test_the_deferred_check_names_the_first_bad_step():
    """On an accelerator, stop mode records the first bad step on the device and reads it later."""
    guard = NonFiniteGuard("stop", torch.device("cpu"))
    guard.deferred = True   # as on CUDA
    guard.start_at(40)      # a resumed run counts on from its checkpoint's step
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    assert guard.ok(one, one) and guard.ok(one, nan) and guard.ok(nan, one)
    with pytest.raises(RunError, match="non-finite gradient at step 42; stopped, no checkpoint had been written"):
        guard.check()
    fine = NonFiniteGuard("stop", torch.device("cpu"))
    fine.deferred = True
    assert fine.ok(one, one)
    fine.check()


def numpy_memory_error() -> MemoryError:
    """The exception numpy raises when an array does not fit (its own MemoryError subclass)."""
    try:
        np.empty(1 << 60, np.uint8)
    except MemoryError as e:
        return e
    raise AssertionError("numpy allocated an exbibyte")


def fail_in_forward(monkeypatch, step, error):
    """Make the training forward of the given (1-based) step raise error."""
    real_forward, calls = GPT.forward, []

    def forward(self, idx, targets=None, **kw):
        if self.training and targets is not None:
            calls.append(1)
            if len(calls) == step:
                raise error
        return real_forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", forward)


@pytest.mark.parametrize("existing", [False, True], ids=["new out dir", "existing out dir"])
@pytest.mark.parametrize("make_failure, extra, pattern", [
    (lambda mp: poison(mp, {1}), {}, r"non-finite loss at step 1; stopped, no checkpoint had been written yet"),
    (lambda mp: fail_in_forward(mp, 3, numpy_memory_error()), {},
     r"out of memory on \S+ at step 3 \(Unable to allocate 1.00 EiB.*no checkpoint had been written yet"),
    (lambda mp: fail_in_forward(mp, 3, RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 1000000000000 bytes. Error code 12 (Cannot allocate memory)")), {},
     r"out of memory on \S+ at step 3 \(DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000000000000"
     r".*no checkpoint had been written yet"),
    (lambda mp: fail_in_forward(mp, 3, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")), {},
     r"out of memory on \S+ at step 3 \(CUDA out of memory. Tried to allocate 20.00 GiB\).*no checkpoint had been written"),
    (lambda mp: mp.setitem(sys.modules, "wandb", None), {"log.wandb": "true"},   # `import wandb` fails
     r"^error: log.wandb = true but wandb is not installed \(pip install wandb\)$"),
], ids=["NaN loss", "numpy MemoryError", "CPU allocator", "torch OutOfMemoryError", "no wandb"])
def test_a_run_that_fails_before_its_first_checkpoint_leaves_the_out_dir_as_it_was(
        make_failure, extra, pattern, existing, tmp_path, text_file, monkeypatch, capsys):
    prepare(text_file, "char", 0.1, tmp_path / "prepared")
    if existing:
        write(mkdir(tmp_path / "out") / "notes.txt", "the user's")
    before = tree(tmp_path)
    make_failure(monkeypatch)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file, **extra), capsys)
    assert rc == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, (rc, err)
    assert re.search(pattern, err) and "checkpoint is kept" not in err, err
    assert settled(tree(tmp_path)) == settled(before), "the failed run left files behind"


# ---------------------------------------------------------------- resume

def test_resume_is_exact_from_any_step_twice_over(tmp_path, tiny_cfg):
    extra = {"model.dropout": 0.1, "train.grad_accum": 2, "train.eval_interval": 4, "train.max_steps": 12}
    whole = train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    split = tiny_cfg(**extra, out_dir=tmp_path / "split")
    train(split, quiet=True, stop_at=5)   # not an eval step: the stop saves its own checkpoint
    train(split, quiet=True, resume=True, stop_at=9)
    rest = train(split, quiet=True, resume=True)
    assert sorted(rest["losses"]) == list(range(10, 13))
    records = {}
    for name in ("whole", "split"):
        lines = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        records[name] = [(r["step"], r["loss"], r["lr"]) for r in lines if r["kind"] == "train"]
    assert [r[0] for r in records["split"]] == list(range(1, 13)), "every step logged once"
    for (step, loss, lr), (_, loss_w, lr_w) in zip(records["split"], records["whole"], strict=True):
        assert loss == pytest.approx(loss_w, abs=1e-6) and lr == lr_w, step
    a = load_checkpoint(tmp_path / "whole" / "ckpt_0000012.pt")["model"]
    b = load_checkpoint(tmp_path / "split" / "ckpt_0000012.pt")["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_resume_cleans_up_after_a_kill(tiny_cfg):
    """What a kill -9 can leave: a half-written temp file, a torn metrics line, best.pt not yet linked."""
    cfg = tiny_cfg()
    train(cfg, quiet=True, stop_at=10)
    out_path = Path(cfg.out_dir)
    (out_path / ".ckpt_0000015.pt.tmp").write_bytes(b"PK half")
    with open(out_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "kind": "tra')
    (out_path / "best.pt").unlink()
    assert load_checkpoint(out_path / "ckpt_0000010.pt")["is_best"]
    summary = train(cfg, quiet=True, resume=True)
    assert summary["step"] == 20 and not list(out_path.glob(".*.tmp"))
    steps = [json.loads(l)["step"] for l in (out_path / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(11) == 1 and steps[-1] == 20
    assert (out_path / "best.pt").exists()


def test_resume_needs_the_whole_training_state_and_the_same_tokenizer(tmp_path, tiny_cfg, text_file):
    cfg = tiny_cfg(**{"model.vocab_size": 80, "train.max_steps": 2})
    train(cfg, quiet=True)
    weights_only = tmp_path / "w"
    weights_only.mkdir()
    ckpt = torch.load(f"{cfg.out_dir}/ckpt_0000002.pt", weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("optimizer", "rng_ranks")}, weights_only / "ckpt_0000002.pt")
    with pytest.raises(CheckpointError, match="cannot be resumed from: it lacks optimizer, rng_ranks"):
        train(tiny_cfg(**{"model.vocab_size": 80}, out_dir=weights_only), resume=True, quiet=True)
    text_file.write_text(TEXT.upper())   # the same model, another vocabulary
    with pytest.raises(CheckpointError, match="another tokenizer or vocabulary"):
        train(tiny_cfg(**{"model.vocab_size": 80, "train.max_steps": 4}), resume=True, quiet=True)


def test_a_new_run_removes_only_its_own_temporary_files(tiny_cfg):
    """A kill can leave this project's .<name>.tmp files; the user's own hidden files are not ours to delete."""
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.eval_interval": 2})
    out = mkdir(Path(cfg.out_dir))
    ours = [write(out / f".{name}.tmp", "stale") for name in ("ckpt_0000010.pt", "best.pt", "metrics.jsonl", "config.toml")]
    theirs = [write(out / name, "mine") for name in (".notes.tmp", ".ckpt_latest.pt.tmp", "draft.tmp")]
    train(cfg, quiet=True)
    assert not any(p.exists() for p in ours)
    assert all(p.read_text() == "mine" for p in theirs)


def test_an_out_dir_holding_only_best_pt_is_resumed_as_the_refusal_says(tmp_path, text_file, trained, capsys):
    out = mkdir(tmp_path / "out")
    shutil.copy(trained / "best.pt", out / "best.pt")
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and "already holds best.pt of a run: continue it with --resume" in err, err
    rc, stdout, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": 6}), "--resume"], capsys)
    assert rc == 0 and f"# resuming {out / 'best.pt'} at step 4" in stdout, err
    assert load_checkpoint(out / "ckpt_0000006.pt")["step"] == 6
