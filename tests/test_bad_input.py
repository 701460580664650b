"""Bad input ends in one line, a non-zero exit and no file written: a table of cases through the
command-line tools (train.py, sample.py), then the same promises through real subprocesses."""
import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import attention as attention_cli
import export as export_cli
import sample as sample_cli
import train as train_cli
from tests.conftest import ROOT, TEXT, Evil, assert_refused, mkdir, prepare_text, run_tool, tiny_overrides, tree, write
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


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
        ckpt["version"] = 1
    elif kind == "foreign":
        ckpt = {"state_dict": ckpt["model"]}
    elif kind == "mismatched":   # its config says 3 layers, its weights have 2
        model["n_layer"] = 3
    elif kind == "reshaped":     # its config says 64 wide, its weights are 32
        model["n_embd"] = 64
    elif kind == "text n_layer":
        model["n_layer"] = str(model["n_layer"])
    elif kind == "list n_layer":
        model["n_layer"] = [model["n_layer"]]
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
    ("TOML syntax", train_cli, lambda e: [write(e["tmp"] / "c.toml", "[model\nn_layer = 2")] + e["base"](),
     "c.toml is not a TOML config file"),
    ("TOML unknown key", train_cli, lambda e: [write(e["tmp"] / "c.toml", "[train]\nlearning_rate = 1")] + e["base"](),
     "unknown config key 'train.learning_rate'"),
    ("TOML wrong type", train_cli, lambda e: [write(e["tmp"] / "c.toml", '[train]\nbeta1 = "high"')] + e["base"](),
     "train.beta1: expected float, got 'high'"),
    ("missing config", train_cli, lambda e: [e["tmp"] / "nope.toml"] + e["base"](), "No such file or directory: "),
    ("wrong type", train_cli, lambda e: e["base"](**{"train.lr": "fast"}), "train.lr: expected float, got 'fast'"),
    ("heads do not divide", train_cli, lambda e: e["base"](**{"model.n_head": 3}),
     "model.n_embd=32 is not divisible by model.n_head=3"),
    ("zero size", train_cli, lambda e: e["base"](**{"model.n_layer": 0}), "model.n_layer must be > 0, got 0"),
    ("negative size", train_cli, lambda e: e["base"](**{"train.batch_size": -4}), "train.batch_size must be > 0"),
    ("negative block", train_cli, lambda e: e["base"](**{"model.block_size": -1}), "model.block_size must be > 0"),
    ("keep zero", train_cli, lambda e: e["base"](**{"train.keep_checkpoints": 0}), "train.keep_checkpoints must be > 0"),
    ("a setting that went", train_cli, lambda e: e["base"](**{"train.on_nonfinite": "skip"}),
     "unknown config key 'train.on_nonfinite'"),
    ("out dir under a file", train_cli, lambda e: e["base"](out_dir=write(e["tmp"] / "file", "x") / "out"),
     "file is not a writable folder"),
    ("out dir is a file", train_cli, lambda e: e["base"](out_dir=write(e["tmp"] / "file", "x")),
     "file is not a writable folder"),
    ("val fraction of 1", train_cli, lambda e: e["base"](**{"data.val_fraction": 1}),
     "data.val_fraction must be > 0.0 and < 1.0, got 1.0"),
    ("val fraction nan", train_cli, lambda e: e["base"](**{"data.val_fraction": "nan"}),
     "data.val_fraction must be > 0.0 and < 1.0, got nan"),
    ("bad encoding_errors", train_cli, lambda e: e["base"](**{"data.encoding_errors": "ignore"}),
     "data.encoding_errors='ignore' is not one of strict, replace"),
    ("prepared dir under a file", train_cli,
     lambda e: e["base"](**{"data.prepared_dir": write(e["tmp"] / "file", "x") / "p", "data.val_fraction": 0.2}),
     "Not a directory"),
    ("resume, no run", train_cli, lambda e: e["base"]() + ["--resume"], "--resume: no checkpoint"),
    ("resume and overwrite", train_cli, lambda e: e["base"]() + ["--resume", "--overwrite"], "contradict each other"),
] + [   # values of the right type that would pass a type check, then crash or diverge the run
    (f"{key}={value}", train_cli, lambda e, key=key, value=value: e["base"](**{key: value}), message)
    for key, value, message in [
        ("train.lr", "nan", "train.lr must be >= 0, got nan"),
        ("train.lr", "inf", "train.lr must be >= 0, got inf"),
        ("train.weight_decay", "nan", "train.weight_decay must be >= 0, got nan"),
        ("train.grad_clip", "nan", "train.grad_clip must be >= 0, got nan"),
        ("train.beta1", 1.5, "train.beta1 must be >= 0 and < 1, got 1.5"),
        ("train.seed", -1, "train.seed must be >= 0 and <= 4294967295, got -1"),
        ("train.seed", 2**40, "train.seed must be >= 0 and <= 4294967295, got 1099511627776"),
        ("model.rope_base", 0, "model.rope_base must be > 0.0, got 0.0"),
    ]
] + [
    ("fresh run over a run", train_cli, lambda e: in_out_dir(e, e["ckpt"])[:-1],
     "--resume continues it, --overwrite starts over"),
    ("resume, other model", train_cli, lambda e: in_out_dir(e, e["ckpt"]) + ["--model.n_layer=3"],
     "model.n_layer: 2 in the run, 3 now"),
] + [
    (f"resume, {kind} checkpoint", train_cli, lambda e, kind=kind: in_out_dir(e, damaged(e["trained"], e["tmp"], kind)), message)
    for kind, message in [("empty", "not a readable checkpoint"), ("truncated", "not a readable checkpoint"),
                          ("random", "not a readable checkpoint"), ("version", "of format version 1, this code"),
                          ("foreign", "not a checkpoint of this project"), ("evil", "was refused"),
                          ("flipped", "does not match its checksum")]
] + [
    (f"sample, {kind} checkpoint", sample_cli, lambda e, kind=kind: [damaged(e["trained"], e["tmp"], kind)],
     f"{kind}.pt {message}")
    for kind, message in [("empty", "is not a readable checkpoint"),
                          ("truncated", "is not a readable checkpoint"),
                          ("random", "is not a readable checkpoint"),
                          ("text", "is not a readable checkpoint"),
                          ("version", "is a checkpoint of format version 1, this code reads"),
                          ("foreign", "is not a checkpoint of this project"),
                          ("evil", "was refused: it holds objects that could run code"),
                          ("mismatched", "does not hold a usable model"), ("flipped", "is damaged: archive/"),
                          ("reshaped", "does not hold a usable model"),
                          ("text n_layer", "does not hold a usable model"),
                          ("list n_layer", "does not hold a usable model")]
] + [
    ("sample, missing checkpoint", sample_cli, lambda e: [e["tmp"] / "gone.pt"], "checkpoint not found"),
    ("sample, dir without checkpoints", sample_cli, lambda e: [e["tmp"]],
     "no checkpoint (best.pt or ckpt_*.pt)"),
    ("prompt outside the vocabulary", sample_cli, lambda e: [e["ckpt"], "--prompt", "Citizen ☃"],
     "the prompt has 1 character(s) not in the"),
    ("missing prompt file", sample_cli, lambda e: [e["ckpt"], "--prompt", f"@{e['tmp'] / 'p.txt'}"],
     "No such file or directory: "),
    ("bad sampling option", sample_cli, lambda e: [e["ckpt"], "--top-p", "2"], "--top-p must be in (0, 1]"),
    ("seed too large", sample_cli, lambda e: [e["ckpt"], "--seed", str(10**23)],
     "--seed must be in [0, 2^63)"),
    ("endless prompt file", sample_cli, lambda e: [e["ckpt"], "--prompt", "@/dev/zero"],
     "/dev/zero is larger than 1 MB"),
    ("absent GPU", sample_cli, lambda e: [e["ckpt"], "--device", "cuda:7"], "error: --device='cuda:7'"),
    ("unknown device", sample_cli, lambda e: [e["ckpt"], "--device", "tpu"],
     "error: --device='tpu' is not a device"),
    ("a non-ASCII digit in bpe:N", train_cli, lambda e: e["base"](**{"data.tokenizer": "bpe:²57"}),
     "write bpe:N with N the vocabulary size"),
    ("attention, dpi 0", attention_cli, lambda e: [e["ckpt"], "--prompt", "First", "--dpi", "0"],
     "--dpi must be in [1, 1000], got 0"),
    ("attention, a layer out of range", attention_cli,
     lambda e: [e["ckpt"], "--prompt", "First", "--layers", "9"],
     "--layers: 9 is out of range, the model has 2"),
    ("attention, a one-token prompt", attention_cli, lambda e: [e["ckpt"], "--prompt", "F"],
     "the prompt has 1 token"),
    ("attention, missing prompt file", attention_cli,
     lambda e: [e["ckpt"], "--prompt", f"@{e['tmp'] / 'p.txt'}"], "No such file or directory: "),
    ("export into a run's dir", export_cli, lambda e: [e["trained"], e["trained"], "--force"],
     "holds checkpoints of a run: export into a directory of its own"),
    ("export into a dir that is not empty", export_cli,
     lambda e: [e["ckpt"], write(mkdir(e["tmp"] / "notes") / "a.txt", "x").parent],
     "is not empty; pass --force"),
    ("export, missing checkpoint", export_cli, lambda e: [e["tmp"] / "gone.pt", e["tmp"] / "hf"],
     "checkpoint not found"),
]


@pytest.mark.parametrize("name, tool, make_argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_a_non_zero_exit_and_writes_nothing(name, tool, make_argv, message, tmp_path,
                                                                   trained, capsys):
    if "/dev/zero" in message and not os.path.exists("/dev/zero"):
        pytest.skip("reads /dev/zero, an endless file Windows does not have")
    text = write(tmp_path / "tiny.txt", TEXT)
    short = write(tmp_path / "short.txt", "abcdefghij" * 3)
    for path in (text, short):   # a complete preparation may be cached; it is made here, before the snapshot
        prepare_text(path, "char", 0.1, tmp_path / "prepared")
    ckpt = tmp_path / "good.pt"
    shutil.copy(trained / "ckpt_0000004.pt", ckpt)
    env = {"tmp": tmp_path, "short": short, "ckpt": ckpt, "trained": trained,
           "base": lambda **kw: tiny_overrides(tmp_path, text, **kw)}
    assert_refused(tool, make_argv(env), capsys, tmp_path, message)
    assert not (tmp_path / "pwned").exists()


def test_a_run_path_typed_from_another_folder_names_the_repository_s_run(tmp_path, trained, monkeypatch, capsys):
    """Runs go to the repository's out/ from wherever train.py runs, but a path typed is the working
    directory's: where out/x is not here and the repository has one, every command's refusal names it."""
    import loading
    repo = tmp_path / "repo"
    shutil.copytree(trained, repo / "out" / "x")
    monkeypatch.setattr(loading, "ROOT", repo)
    monkeypatch.chdir(mkdir(tmp_path / "elsewhere"))
    import eval as eval_cli
    for tool, argv in [(sample_cli, ["out/x"]), (attention_cli, ["out/x", "--prompt", "First"]),
                       (export_cli, ["out/x", "hf"]), (eval_cli, ["out/x", write(tmp_path / "t.txt", TEXT)]),
                       (sample_cli, ["out/x/best.pt"])]:
        rc, _, err = run_tool(tool, argv, capsys)
        assert rc == 2 and err == f"error: checkpoint not found: {argv[0]}; did you mean {repo / argv[0]}?\n", err
    rc, _, err = run_tool(sample_cli, ["out/y"], capsys)   # nothing of that name anywhere: no guess
    assert rc == 2 and err == "error: checkpoint not found: out/y\n", err


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
    with pytest.raises(type(failure)):
        prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    assert list((tmp_path / "prepared").iterdir()) == []
    monkeypatch.setattr(json, "dumps", real_dumps)
    assert (prepare_text(text_file, "char", 0.1, tmp_path / "prepared") / "meta.json").exists()


def test_a_config_file_with_a_byte_order_mark_loads(tmp_path, tiny_cfg):
    """Windows' Notepad saves UTF-8 with a BOM; TOML itself does not allow one."""
    from training.config import build_config
    path = tmp_path / "notepad.toml"
    path.write_bytes("\ufeff[model]\nn_layer = 3\n".encode("utf-8"))
    assert build_config(str(path), []).model.n_layer == 3


def test_a_checkpoint_with_a_nan_weight_is_named_at_the_first_token_it_spoils(tmp_path, trained, capsys):
    """Loading does not scan the weights; sampling checks the logits, and says so in one error line."""
    path = damaged(trained, tmp_path, "nan")
    rc, out, err = run_tool(sample_cli, [path, "--prompt", "First", "--max-new-tokens", 5], capsys)
    assert rc == 2 and out == "First\n" and err.startswith(f"# {path} (step 4"), err
    assert err.splitlines()[1:] == [f"error: {path}: the model's logits are not finite at new token 1: its "
                                    f"weights are damaged or the model diverged"], err


def test_a_run_dir_holding_a_stray_config_json_is_still_the_run(tmp_path, trained, capsys):
    """A Hugging Face export once written into a run's dir must not make it look like a Hugging Face model."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "config.json").write_text('{"model_type": "gpt2"}')
    rc, out, err = run_tool(sample_cli, [run, "--prompt", "First", "--max-new-tokens", 3], capsys)
    assert rc == 0 and out.startswith("First") and "best.pt" in err, err


def test_missing_gpt2_files_are_said_as_such(tmp_path, trained, monkeypatch, capsys):
    """A checkpoint trained with GPT-2's tokenizer, on a machine where tiktoken cannot get its files."""
    import tiktoken
    ckpt = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    ckpt["tokenizer"] = {"kind": "tiktoken", "name": "gpt2"}   # (its model is the char model: no matter)
    torch.save(ckpt, tmp_path / "gpt2.pt")

    def offline(name):
        raise ConnectionError("no route to host")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    rc, _, err = run_tool(sample_cli, [tmp_path / "gpt2.pt"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "could not load tiktoken's 'gpt2' files (ConnectionError)" in err, err
    assert "set TIKTOKEN_CACHE_DIR" in err, err


def test_wandb_that_cannot_start_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    """log.wandb = true without `wandb login`: wandb raises its own error from init."""
    import types

    class UsageError(Exception):
        pass

    def init(**kwargs):
        raise UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    before = tree(tmp_path)
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file, **{"log.wandb": "true"}), capsys)
    assert rc == 2 and err.count("\n") == 1 and "wandb did not start (UsageError: api_key not configured" in err, err
    assert "wandb login" in err and tree(tmp_path) == before, "the out dir is as it was: none"


def test_the_data_is_checked_before_the_out_dir(tmp_path, trained, capsys):
    """A glob that matches nothing is said as such, not as an out dir that already holds a run."""
    args = tiny_overrides(tmp_path, tmp_path / "books" / "*.txt", out_dir=trained)
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.startswith("error: no files match") and "already holds" not in err, err


@pytest.mark.parametrize("failure", [
    OSError(errno.EROFS, os.strerror(errno.EROFS), "/mnt/ro/out"),
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/x/ckpt.pt"),
], ids=["read-only", "full"])
def test_a_fault_of_the_machine_is_said_with_its_path(failure, capsys):
    from common import run_cli

    def main(argv):
        raise failure
    assert run_cli(main, []) == 2
    assert capsys.readouterr().err == f"error: {failure.strerror}: {failure.filename}\n"


def test_a_read_only_out_dir_is_one_line_saying_what_to_do(tmp_path, text_file, small_disk, capsys):
    import subprocess
    disk = small_disk("2m")
    args = tiny_overrides(tmp_path, text_file, out_dir=disk / "out", **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
        for extra in ([], ["--resume"]):
            rc, _, err = run_tool(train_cli, [*args, "--overwrite", *extra] if not extra else [*args, *extra], capsys)
            assert rc == 2 and err.count("\n") == 1, err
            assert err == f"error: cannot write the out dir {disk / 'out'}: {disk / 'out'} is not a writable " \
                          f"folder\n", err
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
