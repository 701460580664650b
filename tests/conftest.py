"""The suite's shared text, fixtures and helpers: tiny runs (tiny_cfg, tiny_overrides, trained, and a run's
records, a run resumed from its own checkpoint, a Ctrl-C at a chosen step), running a command as a user
would (run_tool in-process, run_limited as a memory-limited subprocess), a snapshot of a directory tree
(tree) for the promise that a failed command writes nothing; what a test needs of the system
(posix_signals) where not every system has it."""
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"
os.environ.setdefault("WANDB_MODE", "disabled")
# the commands the tests start run tiny models: one thread each (and no note that the CPU is busy)
os.environ["OMP_NUM_THREADS"] = "1"
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken_cache")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import run_cli  # noqa: E402

# A short text with enough variety to be a real (if tiny) language: the first 1,633 characters (48
# distinct ones, ending with a line) of the tinyshakespeare.txt the repository ships.
TEXT = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:1633]


@contextmanager
def num_threads(n: int):
    """torch's intra-op thread count set to n inside the block, and put back after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def at_most_two_threads():
    """At most two intra-op threads for the session: the tests' tiny models gain nothing from more,
    and the suite shares its machine."""
    with num_threads(min(2, torch.get_num_threads())):
        yield


# What a test needs of the system, where not every system has it.
LINUX = sys.platform.startswith("linux")
NO_TRANSFORMERS = "transformers is not installed (pip install -r requirements-dev.txt)"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason=NO_TRANSFORMERS)
posix_signals = pytest.mark.skipif(os.name == "nt", reason="sends another process POSIX signals (kill -9, SIGTERM, "
                                   "SIGINT, SIGHUP, SIGSTOP): Windows can only end a process outright")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT)
    return path


def tiny_overrides(tmp_path, text_file, **extra) -> list[str]:
    """Command-line overrides for a tiny, fast run on text_file."""
    values = {"data.path": text_file, "data.prepared_dir": tmp_path / "prepared", "out_dir": tmp_path / "out",
              "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
              "train.batch_size": 8, "train.max_steps": 20, "train.warmup_steps": 1, "train.eval_interval": 10,
              "train.eval_iters": 2, "train.log_interval": 1, "log.curves": "false",   # (curves: their own tests)
              "train.device": "cpu"}   # what these tests check is the same on a GPU; their exact figures are the CPU's
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


@pytest.fixture
def tiny_cfg(tmp_path, text_file):
    from training.config import build_config

    def make(**extra):
        return build_config(None, tiny_overrides(tmp_path, text_file, **extra))
    return make


def prepare_text(path, tokenizer="char", val_fraction=0.1, root="data/prepared", encoding_errors="strict",
                 block_size=None):
    """data.prepare.prepare() of the text at path with these data settings; the dataset's directory."""
    from data.prepare import DataConfig, prepare
    return prepare(DataConfig(str(path), tokenizer, val_fraction, str(root), encoding_errors), block_size)


def prepared(out: Path):
    """([train ids, val ids], meta.json) of a prepared dataset."""
    meta = json.loads((out / "meta.json").read_text())
    splits = [np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]) for split in ("train", "val")]
    return [split.tolist() for split in splits], meta


@pytest.fixture
def small_reads(monkeypatch):
    """Tiny reads, pieces and Parquet batches, so that a short text crosses many of their boundaries
    (mid-character ones too)."""
    import data.prepare
    import data.sources
    monkeypatch.setattr(data.sources, "READ_BYTES", 7)
    monkeypatch.setattr(data.sources, "PARQUET_ROWS", 3)
    monkeypatch.setattr(data.prepare, "PIECE_CHARS", 97)


# each attention variant's own settings, for a model of 4 heads of 8 channels and a block of 16
OWN = {"naive": {}, "sdpa": {}, "gqa": {"n_kv_head": 2}, "sliding_window": {"window": 5},
       "linear": {}, "mla": {"kv_latent_dim": 12}}

# ---------------------------------------------------------------- shared by several test files

@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread (a module asks for it with pytestmark = pytest.mark.usefixtures("one_thread")):
    these tiny models gain nothing from more, and on a busy machine two threads spinning at each
    barrier are several times slower than one."""
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


def assert_refused(tool, argv, capsys, root, named: str) -> None:
    """tool refuses argv as every command refuses a mistake: exit 2, one `error:` line naming what is
    wrong, and nothing under root written or changed."""
    before = tree(root)
    rc, out, err = run_tool(tool, argv, capsys)
    assert rc == 2, (rc, out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert named in err, err
    assert tree(root) == before, "a refused command wrote or changed a file"


@functools.cache
def torch_address_space() -> int:
    """Bytes of address space that a Python which has imported torch holds: the CUDA build maps
    gigabytes of libraries it never reads, which a limit on the address space must leave room for.
    Measured once (a Python started for it) for the session."""
    code = "import re, torch; print(re.search(r'VmPeak:\\s+(\\d+)', open('/proc/self/status').read())[1])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout) * 1024


def run_limited(argv, memory=2 << 30, timeout=120):
    """(exit code, stdout, stderr, peak resident bytes) of `python ARGV` run as a user runs it, with
    its address space limited to `memory` bytes beyond what importing torch takes: an allocation beyond
    that fails at once, as on a machine without that much memory, instead of taking this machine's
    memory from everyone else. Skips off Linux: macOS does not enforce RLIMIT_AS, and Windows has
    neither it nor os.wait4."""
    if not LINUX:
        pytest.skip("needs a limit on a process's address space (RLIMIT_AS), which Linux alone enforces")
    import resource
    memory += torch_address_space()

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


class Evil:
    """Unpickling this runs a shell command: the payload a malicious checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A real 4-step run's out dir (the model of tiny_overrides), shared by the tests that need one
    (which copy what they would change)."""
    root = tmp_path_factory.mktemp("trained")
    text = root / "tiny.txt"
    text.write_text(TEXT)
    from training.config import build_config
    from training.trainer import train
    train(build_config(None, tiny_overrides(root, text, **{"train.max_steps": 4, "train.eval_interval": 2})), quiet=True)
    return root / "out"


def records(out_dir, kind: str = "train", key: str = "loss") -> dict:
    """{step: value} of a run's metrics.jsonl records of that kind (the losses it logged, say)."""
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if r["kind"] == kind}


def resumed_copy(cfg, step: int, dest) -> Path:
    """A copy of cfg's finished run, resumed from its checkpoint at `step` to the end (as a run stopped
    there would be): its out dir, whose metrics the uninterrupted run's must equal."""
    import shutil
    from training.trainer import train
    shutil.copytree(cfg.out_dir, dest)
    cfg.out_dir = str(dest)
    train(cfg, resume=True, checkpoint=Path(dest) / f"ckpt_{step:07d}.pt", quiet=True)
    return Path(dest)


def interrupt_at(monkeypatch, step: int, signum=None):
    """The next runs get SIGINT (or signum) during their `step`-th step (counted across them), as from a
    user's Ctrl-C: when the loop asks for that step's learning rate, once a step whichever way it runs."""
    import signal
    import training.trainer
    real, steps = training.trainer.lr_at, [0]

    def lr_at(*args, **kwargs):
        steps[0] += 1
        if steps[0] == step:
            signal.raise_signal(signum or signal.SIGINT)
        return real(*args, **kwargs)
    monkeypatch.setattr(training.trainer, "lr_at", lr_at)


def write(path, content):
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


def mkdir(path):
    path.mkdir()
    return path


def gpt2_or_skip():
    """tiktoken's gpt2 tokenizer, or a skip where its BPE files cannot be had (no network, no cache)."""
    from common import UserError
    from data.tokenizers import build_tokenizer
    try:
        return build_tokenizer("gpt2")
    except UserError as e:
        pytest.skip(f"gpt2 BPE files unavailable (set TIKTOKEN_CACHE_DIR): {e}")


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
    from model.gpt import GPT
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


def scramble_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random and O(1)-ish (biases and norm shifts non-zero, norm gains around 1),
    so that the logits depend strongly on the context and a mix-up of layouts, activations, scales
    or windows shows in them; the model, in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.dim() == 1 and ("ln_" in name or "norm" in name) and name.endswith("weight")
            p.copy_((1 if gain else 0) + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """The directory of a tiny random GPT-2 saved by transformers: context 16, GPT-2's vocabulary
    (tiktoken's gpt2 is its tokenizer)."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip(NO_TRANSFORMERS)
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(1)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=50257)
    path = tmp_path_factory.mktemp("gpt2_tiny")
    scramble_(GPT2LMHeadModel(config), seed=1).save_pretrained(path)
    return path


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) mounts a file system of that size (e.g. "600k") under tmp_path and returns its
    path; it is unmounted after the test. Skips where mounting is not allowed (it needs root and Linux)."""
    mounted = []

    def mount(size: str) -> Path:
        if not LINUX:
            pytest.skip("mounts a small tmpfs, which needs Linux (and root)")
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a small file system here ({r.stderr.strip() or 'mount failed'}); needs root")
        mounted.append(disk)
        return disk
    yield mount
    for disk in mounted:
        if subprocess.run(["umount", str(disk)]).returncode:
            subprocess.run(["umount", "-l", str(disk)])

CHARS = "\n !:,.?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def save_char_model(out, sharpen: float = 1.0, seed: int = 0, chars: str = CHARS, **model) -> Path:
    """A random (untrained) character model of these characters with these ModelConfig values, saved in
    out as a run's best checkpoint with what loading it needs; out. sharpen scales its query and key
    weights: at the default initialization every head attends almost evenly, and heads hardly differ."""
    from data.tokenizers import CharTokenizer
    from model.config import ModelConfig
    from model.gpt import GPT
    from loading import FORMAT, VERSION
    from training.checkpoint import save_checkpoint
    from training.config import Config
    Path(out).mkdir(parents=True, exist_ok=True)
    cfg = Config(out_dir=str(out))
    tokenizer = CharTokenizer(chars)
    cfg.model = ModelConfig(vocab_size=tokenizer.vocab_size, **model)
    torch.manual_seed(seed)
    state = GPT(cfg.model).state_dict()
    for name, value in state.items():
        if name.endswith(("attn.query.weight", "attn.key.weight")):
            value.mul_(sharpen)
    save_checkpoint({"format": FORMAT, "version": VERSION, "config": cfg.to_dict(), "tokenizer": tokenizer.meta(),
                     "model": state, "step": 0, "is_best": True}, out, keep=1)   # what sampling needs, no more
    return Path(out)
