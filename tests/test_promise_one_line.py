"""A mistake is one line and a non-zero exit, and writes nothing: a table of mistakes through the
commands (in-process, through common.run_cli, as their __main__ does: the commands as real
processes, test_readme.py), then what the machine does wrong (a full disk, a read-only folder,
memory that runs out: exit 3) and what is missing (wandb, GPT-2's files), each said in one line."""
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

import attention as attention_cli
import common
import eval as eval_cli
import export as export_cli
import sample as sample_cli
import train as train_cli
from loading import list_checkpoints, read_checkpoint
from tests.conftest import (TEXT, assert_refused, mkdir, prepare_text, run_limited, run_tool,
                            tiny_overrides, tree, write)
from training.config import build_config
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def a_run_in_out(e):
    """The settings of a run whose out dir already holds one (a copy of a checkpoint)."""
    shutil.copy(e["ckpt"], mkdir(e["tmp"] / "out") / "ckpt_0000004.pt")
    return e["base"]()


def toml(e, text):
    return [write(e["tmp"] / "c.toml", text), *e["base"]()]


# train.py with one setting that cannot work: (key, value, what the one-line error says)
BAD_SETTINGS = [
    ("train.lr", "fast", "train.lr: expected float, got 'fast'"),
    ("model.n_head", 3, "model.n_embd=32 is not divisible by model.n_head=3"),
    ("model.n_layer", 0, "model.n_layer must be > 0, got 0"),
    ("train.batch_size", -4, "train.batch_size must be > 0"),
    ("model.block_size", -1, "model.block_size must be > 0"),
    ("model.block_size", 300, f"the val split has {len(TEXT) - int(len(TEXT) * 0.9)} tokens, "
                              f"fewer than block_size + 1 = 301"),
    ("train.keep_checkpoints", 0, "train.keep_checkpoints must be > 0"),
    # a setting that went
    ("train.on_nonfinite", "skip", "unknown config key 'train.on_nonfinite'"),
    ("data.val_fraction", 1, "data.val_fraction must be > 0.0 and < 1.0, got 1.0"),
    ("data.val_fraction", "nan", "data.val_fraction must be > 0.0 and < 1.0, got nan"),
    ("data.encoding_errors", "ignore",
     "data.encoding_errors='ignore' is not one of strict, replace"),
    ("data.tokenizer", "bpe:²57", "write bpe:N with N the vocabulary size"),
    # values of the right type that would pass a type check, then crash or diverge the run
    ("train.lr", "nan", "train.lr must be >= 0, got nan"),
    ("train.lr", "inf", "train.lr must be >= 0, got inf"),
    ("train.weight_decay", "nan", "train.weight_decay must be >= 0, got nan"),
    ("train.grad_clip", "nan", "train.grad_clip must be >= 0, got nan"),
    ("train.beta1", 1.5, "train.beta1 must be >= 0 and < 1, got 1.5"),
    ("train.seed", -1, "train.seed must be >= 0 and <= 4294967295, got -1"),
    ("train.seed", 2**40, "train.seed must be >= 0 and <= 4294967295, got 1099511627776"),
    ("model.rope_base", 0, "model.rope_base must be > 0.0, got 0.0"),
]

# a command given a good checkpoint and options that cannot work
BAD_OPTIONS = [
    (sample_cli, ["--prompt", "Citizen ☃"], "the prompt has 1 character(s) not in the"),
    (sample_cli, ["--prompt", "@no-such-prompt.txt"], "No such file or directory: "),
    (sample_cli, ["--prompt", "@/dev/zero"], "/dev/zero is larger than 1 MB"),
    (sample_cli, ["--top-p", "2"], "--top-p must be in (0, 1]"),
    (sample_cli, ["--seed", str(10**23)], "--seed must be in [0, 2^63)"),
    (sample_cli, ["--device", "cuda:7"], "error: --device='cuda:7'"),
    (sample_cli, ["--device", "tpu"], "error: --device='tpu' is not a device"),
    (attention_cli, ["--prompt", "First", "--dpi", "0"], "--dpi must be in [1, 1000], got 0"),
    (attention_cli, ["--prompt", "First", "--layers", "9"], "--layers: 9 is out of range, the "
                                                            "model has 2"),
    (attention_cli, ["--prompt", "F"], "the prompt has 1 token"),
    (attention_cli, ["--prompt", "First", "--heads", "x"], "--heads takes comma-separated numbers"),
    (attention_cli, ["--prompt", "@no-such-prompt.txt"], "No such file or directory: "),
]

# (id, tool, argv from the environment (may write files first), what the one-line error says)
CASES = [
    ("missing data", train_cli, lambda e: e["base"](**{"data.path": e["tmp"] / "missing.txt"}),
     "data file not found"),
    # a directory is one dataset of all its files; here there are none
    ("data dir without files", train_cli,
     lambda e: e["base"](**{"data.path": mkdir(e["tmp"] / "nodata")}),
     "no files in the data directory"),
    ("data dir with a binary file", train_cli, lambda e: e["base"](**{"data.path": e["tmp"]}),
     "is not UTF-8"),
    ("empty data", train_cli,
     lambda e: e["base"](**{"data.path": write(e["tmp"] / "empty.txt", "")}), "data file is empty"),
    ("train split too short", train_cli, lambda e: e["base"](**{"data.path": e["short"]}),
     "the train split has 27 tokens, fewer than block_size + 1 = 33"),
    ("non-UTF-8", train_cli,
     lambda e: e["base"](**{"data.path": write(e["tmp"] / "latin1.txt", b"ab\ncd\xe9t\xe9")}),
     "byte 0xe9 at offset 5; set --data.encoding_errors=replace"),
    # a glob that matches nothing, and an out dir that holds a run: the data is checked first
    ("data before the out dir", train_cli,
     lambda e: tiny_overrides(e["tmp"], e["tmp"] / "books" / "*.txt", out_dir=e["trained"]),
     "error: no files match"),
    ("TOML syntax", train_cli, lambda e: toml(e, "[model\nn_layer = 2"),
     "c.toml is not a TOML config file"),
    ("missing config", train_cli, lambda e: [e["tmp"] / "nope.toml", *e["base"]()],
     "No such file or directory: "),
    ("out dir under a file", train_cli,
     lambda e: e["base"](out_dir=write(e["tmp"] / "file", "x") / "out"),
     "file is not a writable folder"),
    ("out dir is a file", train_cli, lambda e: e["base"](out_dir=write(e["tmp"] / "file", "x")),
     "file is not a writable folder"),
    ("prepared dir under a file", train_cli,
     lambda e: e["base"](**{"data.prepared_dir": write(e["tmp"] / "file", "x") / "p",
                            "data.val_fraction": 0.2}),
     "Not a directory"),
    ("resume, no run", train_cli, lambda e: [*e["base"](), "--resume"], "--resume: no checkpoint"),
    ("resume and overwrite", train_cli, lambda e: [*e["base"](), "--resume", "--overwrite"],
     "contradict each other"),
    ("fresh run over a run", train_cli, a_run_in_out,
     "--resume continues it, --overwrite starts over"),
    ("sample, dir without checkpoints", sample_cli, lambda e: [e["tmp"]],
     "no checkpoint (best.pt or ckpt_*.pt)"),
    ("export into a run's dir", export_cli, lambda e: [e["trained"], e["trained"], "--force"],
     "holds checkpoints of a run: export into a directory of its own"),
    ("export into a dir that is not empty", export_cli,
     lambda e: [e["ckpt"], write(mkdir(e["tmp"] / "notes") / "a.txt", "x").parent],
     "is not empty; pass --force"),
] + [
    (f"{key}={value}", train_cli, lambda e, key=key, value=value: e["base"](**{key: value}), said)
    for key, value, said in BAD_SETTINGS
] + [
    (f"{tool.__name__} {' '.join(options)}", tool, lambda e, o=options: [e["ckpt"], *o], said)
    for tool, options, said in BAD_OPTIONS
]


@pytest.mark.parametrize("name, tool, make_argv, message", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_a_non_zero_exit_and_writes_nothing(name, tool, make_argv, message,
                                                                  tmp_path, trained, capsys):
    if "/dev/zero" in message and not os.path.exists("/dev/zero"):
        pytest.skip("reads /dev/zero, an endless file Windows does not have")
    text = write(tmp_path / "tiny.txt", TEXT)
    short = write(tmp_path / "short.txt", "abcdefghij" * 3)
    # a complete preparation may be cached; it is made here, before the snapshot
    for path in (text, short):
        prepare_text(path, "char", 0.1, tmp_path / "prepared")
    ckpt = tmp_path / "good.pt"
    shutil.copy(trained / "ckpt_0000004.pt", ckpt)
    env = {"tmp": tmp_path, "short": short, "ckpt": ckpt, "trained": trained,
           "base": lambda **kw: tiny_overrides(tmp_path, text, **kw)}
    assert_refused(tool, make_argv(env), capsys, tmp_path, message)


def test_a_run_path_typed_from_another_folder_names_the_repository_s_run(tmp_path, trained,
                                                                        monkeypatch, capsys):
    """Runs go to the repository's out/ from wherever train.py runs, but a path typed is the
    working directory's: where out/x is not here and the repository has one, every command's
    refusal names it."""
    import loading
    repo = tmp_path / "repo"
    shutil.copytree(trained, repo / "out" / "x")
    monkeypatch.setattr(loading, "ROOT", repo)
    monkeypatch.chdir(mkdir(tmp_path / "elsewhere"))
    for tool, argv in [(sample_cli, ["out/x"]), (attention_cli, ["out/x", "--prompt", "First"]),
                       (export_cli, ["out/x", "hf"]),
                       (eval_cli, ["out/x", write(tmp_path / "t.txt", TEXT)]),
                       (sample_cli, ["out/x/best.pt"])]:
        rc, _, err = run_tool(tool, argv, capsys)
        said = f"error: checkpoint not found: {argv[0]}; did you mean {repo / argv[0]}?\n"
        assert rc == 2 and err == said, err
    # nothing of that name anywhere: no guess
    rc, _, err = run_tool(sample_cli, ["out/y"], capsys)
    assert rc == 2 and err == "error: checkpoint not found: out/y\n", err


def test_a_config_file_with_a_byte_order_mark_loads(tmp_path):
    """Windows' Notepad saves UTF-8 with a BOM; TOML itself does not allow one."""
    path = tmp_path / "notepad.toml"
    path.write_bytes("\ufeff[model]\nn_layer = 3\n".encode("utf-8"))
    assert build_config(str(path), []).model.n_layer == 3


def test_a_read_only_out_dir_is_one_line_saying_what_to_do(tmp_path, text_file, small_disk,
                                                           capsys):
    disk = small_disk("2m")
    args = tiny_overrides(tmp_path, text_file, out_dir=disk / "out", **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
        for again in ("--overwrite", "--resume"):
            rc, _, err = run_tool(train_cli, [*args, again], capsys)
            assert rc == 2 and err == (f"error: cannot write the out dir {disk / 'out'}: "
                                       f"{disk / 'out'} is not a writable folder\n"), err
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)


def test_out_of_memory_names_the_fix_and_keeps_the_checkpoint(tmp_path, text_file, monkeypatch,
                                                              capsys):
    real_clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip_until_memory_runs_out(*a, **k):
        calls.append(1)
        if len(calls) == 13:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_clip(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_until_memory_runs_out)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 3 and err.startswith("error: out of memory (CUDA out of memory"), err
    assert len(err.splitlines()) == 1 and "try a smaller batch, block size or model" in err, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10]
    assert read_checkpoint(tmp_path / "out" / "ckpt_0000010.pt")["step"] == 10


@pytest.mark.parametrize("tool, argv, memory", [
    ("train.py", lambda tmp, text, ckpt: tiny_overrides(tmp, text, **{
        "train.batch_size": 300_000_000}), 2 << 30),
    ("train.py", lambda tmp, text, ckpt: tiny_overrides(tmp, text, **{
        "model.n_layer": 300_000, "model.n_embd": 8, "model.n_head": 1}), 150 << 20),
    ("sample.py", lambda tmp, text, ckpt: [ckpt, "--num-samples", 100_000_000,
                                           "--max-new-tokens", 5, "--device", "cpu"], 2 << 30),
], ids=["train batch", "train model", "sample batch"])
def test_memory_that_runs_out_for_real_is_one_line(tool, argv, memory, tmp_path, trained):
    """Allocations that really fail (a process limited in its address space): a batch of 300
    million sequences to train, a model of 300,000 layers to build (whichever allocation fails
    first, Python's, C++'s or torch's), 100 million samples to generate. sample.py writes
    nothing."""
    text = write(tmp_path / "tiny.txt", TEXT)
    prepare_text(text, "char", 0.1, tmp_path / "prepared")
    before = tree(tmp_path)
    argv = [tool, *argv(tmp_path, text, trained / "ckpt_0000004.pt")]
    rc, out, err, _ = run_limited(argv, memory=memory)
    # sample.py names the checkpoint first
    lines = [line for line in err.splitlines() if not line.startswith("# ")]
    assert rc == 3 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error: out of memory (") and "smaller" in lines[0], err[-2000:]
    assert tree(tmp_path) == before or tool == "train.py"


# ---------------------------------------------------------------- what is missing

def offline(name):
    raise ConnectionError("no route to host")


def test_missing_gpt2_files_are_said_as_such(tmp_path, trained, monkeypatch, capsys):
    """A checkpoint trained with GPT-2's tokenizer, on a machine where tiktoken cannot get its
    files."""
    import tiktoken
    ckpt = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    # its model is the char model: no matter
    ckpt["tokenizer"] = {"kind": "tiktoken", "name": "gpt2"}
    torch.save(ckpt, tmp_path / "gpt2.pt")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    rc, _, err = run_tool(sample_cli, [tmp_path / "gpt2.pt"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "could not load tiktoken's 'gpt2' files (ConnectionError)" in err, err
    assert "set TIKTOKEN_CACHE_DIR" in err, err


class UsageError(Exception):
    """What wandb raises from init without `wandb login`."""


def no_login(**kwargs):
    raise UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")


@pytest.mark.parametrize("wandb, said", [
    (None, "(ModuleNotFoundError: import of wandb halted"),
    (types.SimpleNamespace(init=no_login), "(UsageError: api_key not configured"),
], ids=["not installed", "no login"])
def test_wandb_that_cannot_start_is_one_line_and_the_run_writes_nothing(wandb, said, tmp_path,
                                                                        text_file, monkeypatch,
                                                                        capsys):
    """Neither a new run's out dir nor, with --overwrite, an earlier run's is touched: it is
    neither replaced nor set aside."""
    # None: `import wandb` fails
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    before = tree(tmp_path)
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2, "train.eval_interval": 2})
    rc, _, err = run_tool(train_cli, [*args, "--log.wandb=true"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("error: log.wandb = true but wandb did not start " + said), err
    assert "wandb login" in err, err
    assert tree(tmp_path) == before, "the refused run left files behind"
    assert run_tool(train_cli, args, capsys)[0] == 0
    before = tree(tmp_path)
    rc, _, err = run_tool(train_cli, [*args, "--log.wandb=true", "--overwrite"], capsys)
    assert rc == 2 and tree(tmp_path) == before, err


def test_a_failed_allocation_inside_c_code_is_said_without_its_internals():
    """Python's SystemError where a C function could not allocate names a function's address:
    the line says what happened instead."""
    error = SystemError("<function Block.__init__ at 0x7f00> returned NULL without setting an "
                        "exception")
    code, line = common.verdict(error)
    assert code == 3 and line.startswith("error: out of memory (an allocation failed): "), line
