"""What differs on Windows, tested here by simulating it: no fcntl (the out dir is locked through
msvcrt), no SIGHUP and no SIGINT to send to another process (a sweep passes a stop on as
CTRL_BREAK_EVENT), text files in the ANSI code page by default and stdout redirected in it (cp1252),
and files that cannot be replaced or deleted while a process maps them. Where the real thing can run
on every system (a lock held by another process), it does."""
import builtins
import errno
import io
import locale
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path, PureWindowsPath
from types import SimpleNamespace

import pytest

import sample as sample_cli
from common import UserError, run_cli
from tests.conftest import ROOT, save_char_model

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread

# ---------------------------------------------------------------- stdout in a code page

NOT_CP1252 = "√Δ"   # in no Western code page


def cp1252_stdout(monkeypatch):
    """sys.stdout as Windows sets it up when output is redirected: the ANSI code page, strict errors."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="cp1252", errors="strict", newline="\n")
    monkeypatch.setattr(sys, "stdout", out)
    return out


def test_sample_writes_what_a_cp1252_stdout_lacks_as_question_marks(tmp_path, monkeypatch, capsys):
    model = save_char_model(tmp_path / "model", chars=" abc" + NOT_CP1252, n_layer=1, n_head=2, n_embd=16,
                            block_size=16)
    out = cp1252_stdout(monkeypatch)
    rc = run_cli(sample_cli.main, [str(model), "--prompt", f"a{NOT_CP1252}b", "--max-new-tokens", "40",
                                   "--num-samples", "2", "--device", "cpu"])
    out.flush()
    text, err = out.buffer.getvalue().decode("cp1252"), capsys.readouterr().err
    assert rc == 0, err
    assert text.startswith("--- sample 1 ---\na??b") and text.count("--- sample 2 ---\na??b") == 1, text
    lines = text.splitlines()
    assert len(lines) == 4 and len(lines[1]) == len(lines[3]) == 4 + 40, "both samples whole, each character written"
    shown = text.count("?")
    assert shown >= 2 * len(NOT_CP1252) and "Traceback" not in err, err


@pytest.mark.skipif(os.name != "posix", reason="closes the child's fd 1 before it starts, as a POSIX shell's >&- does")
def test_sample_with_stdout_closed_is_one_error_line(trained):
    r = subprocess.run([sys.executable, "sample.py", trained, "--max-new-tokens", "5"], cwd=ROOT, stdout=None,
                       stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and r.stderr == "error: stdout is closed: there is nowhere to write the samples to\n", \
        r.stderr


# ---------------------------------------------------------------- the out dir's lock through msvcrt

class FakeMsvcrt:
    """msvcrt.locking as Windows' C runtime does it: nbytes locked from the file's current position (past
    its end too), for the handle that locked them; another handle's attempt fails with EACCES, and so does
    unlocking bytes that are not locked."""
    LK_UNLCK, LK_LOCK, LK_NBLCK, LK_RLCK, LK_NBRLCK = range(5)

    def __init__(self):
        self.held, self.offsets = {}, []   # (file, offset) -> the fd that locked it; every offset locked

    def locking(self, fd, mode, nbytes):
        assert nbytes == 1 and mode in (self.LK_NBLCK, self.LK_UNLCK)
        key = (os.fstat(fd).st_ino, os.lseek(fd, 0, os.SEEK_CUR))
        if mode == self.LK_UNLCK:
            if self.held.get(key) != fd:
                raise OSError(errno.EACCES, "Permission denied")
            del self.held[key]
        elif key in self.held:
            raise OSError(errno.EACCES, "Permission denied")
        else:
            self.held[key] = fd
            self.offsets.append(key[1])


@pytest.fixture
def windows_locks(monkeypatch):
    from training import outdir as lock
    fake = FakeMsvcrt()
    monkeypatch.setattr(lock, "fcntl", None)
    monkeypatch.setattr(lock, "msvcrt", fake)
    return fake


def test_without_fcntl_the_out_dir_is_locked_through_msvcrt(tmp_path, windows_locks):
    from training.outdir import OutDir
    first, second = OutDir(tmp_path), OutDir(tmp_path)
    first.check(resume=False, overwrite=False)
    first.open()
    pid = (tmp_path / ".lock").read_text()
    assert pid == f"{os.getpid()}\n"
    with pytest.raises(UserError, match=rf"^{tmp_path} is in use by another run \(PID {os.getpid()}\); "):
        second.check(resume=False, overwrite=False)
    assert (tmp_path / ".lock").read_text() == pid, "a refused run leaves the holder's PID"
    assert min(windows_locks.offsets) >= len(pid), "Windows' locks are mandatory: the PID must stay readable"
    first.close()
    second.check(resume=False, overwrite=False)
    second.open()
    second.close()
    assert windows_locks.held == {}, "every lock released at once"


def test_a_run_into_an_out_dir_locked_through_msvcrt_is_refused_and_writes_nothing(tiny_cfg, windows_locks):
    from tests.conftest import tree
    from training.outdir import OutDir
    from training.trainer import train
    cfg = tiny_cfg(**{"train.max_steps": 2})
    train(cfg, quiet=True)
    other = OutDir(cfg.out_dir)   # another run's, as Windows would see it
    other.check(resume=True, overwrite=False)
    try:
        before = tree(other.path)
        for flags in ({"overwrite": True}, {"resume": True}):
            with pytest.raises(UserError, match=rf"is in use by another run \(PID {os.getpid()}\)"):
                train(cfg, quiet=True, **flags)
            assert tree(other.path) == before
    finally:
        other.close()
    cfg.train.max_steps = 3
    assert train(cfg, quiet=True, resume=True)["step"] == 3, "the lock released, the out dir is free again"


HOLDER = """
import sys, time
from training.outdir import OutDir
out = OutDir(sys.argv[1])
out.check(resume=False, overwrite=False)
out.open()
print("locked", flush=True)
time.sleep(300)
"""


def test_the_out_dir_lock_holds_across_processes_and_goes_with_its_holder(tmp_path):
    """The real lock of this system (flock, or msvcrt on Windows), held by another process."""
    from training.outdir import OutDir
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UserError, match=rf"in use by another run \(PID {holder.pid}\)"):
            OutDir(tmp_path).check(resume=False, overwrite=False)
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10   # (Windows frees a dead process's locks soon, not at once)
    while True:
        try:
            out = OutDir(tmp_path)
            out.check(resume=False, overwrite=False)
            break
        except UserError:
            assert time.monotonic() < deadline, "the lock outlived its holder"
            time.sleep(0.2)
    out.close()


# ---------------------------------------------------------------- a resumed checkpoint stays free

def test_the_checkpoint_a_run_resumed_from_is_neither_mapped_nor_held_while_it_trains(tiny_cfg, tmp_path):
    """Windows can neither replace nor delete a file that a process maps, and a run replaces best.pt and
    deletes old checkpoints as it goes. While a resumed run trains, the file it resumed from is not in
    this process's memory maps (where /proc shows them), and it can be replaced and deleted."""
    from training.trainer import train
    cfg = tiny_cfg(**{"train.max_steps": 4, "train.eval_interval": 4, "train.optimizer": "adamw"})
    train(cfg, quiet=True)
    resumed, maps = Path(cfg.out_dir) / "ckpt_0000004.pt", Path("/proc/self/maps")
    mapped = []

    def meanwhile(step, model):
        if step == 6:
            mapped.extend(l for l in (maps.read_text().splitlines() if maps.exists() else []) if str(resumed) in l)
            shutil.copy(resumed, tmp_path / "copy.pt")
            os.replace(tmp_path / "copy.pt", resumed)
            os.remove(resumed)

    cfg.train.max_steps = 8
    assert train(cfg, quiet=True, resume=True, on_step=meanwhile)["step"] == 8
    assert mapped == [], mapped


# ---------------------------------------------------------------- a sweep's stop, passed on to its run

class FakePopen:
    """A run's process that the user stops (the signal reaches the sweep while it waits), sending signals
    as Popen does on Windows (SIGTERM = terminate(); CTRL_C_EVENT and CTRL_BREAK_EVENT to a process group
    of its own; any other signal is a ValueError) or on POSIX (any signal)."""
    windows, stop_with, started = False, signal.SIGINT, []

    def __init__(self, argv, **kwargs):
        self.kwargs, self.sent, self.pid, self.returncode = kwargs, [], 12345, None
        FakePopen.started.append(self)

    def send_signal(self, sig):
        if self.windows and sig not in (signal.SIGTERM, signal.CTRL_C_EVENT, signal.CTRL_BREAK_EVENT):
            raise ValueError(f"Unsupported signal: {sig}")
        self.sent.append(sig)

    def terminate(self):
        self.sent.append("terminate")

    def wait(self, timeout=None):
        signal.getsignal(self.stop_with)(self.stop_with, None)   # the user's Ctrl-C (or SIGTERM) meanwhile
        self.returncode = 130
        return self.returncode


@pytest.mark.parametrize("windows", [True, False], ids=["Windows", "POSIX"])
@pytest.mark.parametrize("stop_with", ["SIGINT", "SIGTERM"])
def test_a_sweep_passes_a_stop_on_to_its_run_as_the_system_allows(windows, stop_with, tmp_path, text_file,
                                                                   monkeypatch):
    from ablation import sweep
    from tests.test_ablate import ONE_RUN, write_sweep
    run = sweep.load_sweep(str(write_sweep(tmp_path, text_file, ONE_RUN))).runs[0]
    monkeypatch.setattr(sweep, "WINDOWS", windows, raising=False)
    monkeypatch.setattr(signal, "CTRL_C_EVENT", 0, raising=False)       # (they exist on Windows only)
    monkeypatch.setattr(signal, "CTRL_BREAK_EVENT", 1, raising=False)
    monkeypatch.setattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x200, raising=False)
    monkeypatch.setattr(FakePopen, "windows", windows)
    monkeypatch.setattr(FakePopen, "stop_with", getattr(signal, stop_with))
    monkeypatch.setattr(FakePopen, "started", [])
    monkeypatch.setattr(sweep.subprocess, "Popen", FakePopen)
    assert sweep.execute(run) == (130, True), "exit code 130, and a stop was asked for"
    proc, = FakePopen.started
    if windows:   # a process group of its own, and Ctrl-Break: the run's Python takes it as SIGBREAK
        assert proc.kwargs.get("creationflags") == 0x200 and not proc.kwargs.get("start_new_session")
        assert proc.sent == [signal.CTRL_BREAK_EVENT]
    else:
        assert proc.kwargs.get("start_new_session") is True and "creationflags" not in proc.kwargs
        assert proc.sent == [getattr(signal, stop_with)]


# ---------------------------------------------------------------- results.md in a code page's world

@pytest.fixture
def cp1252_files(monkeypatch):
    """Text files opened without an encoding are cp1252, as on a Western Windows. (Python 3.11's open()
    asks the C runtime for that default, not the locale module: open itself is wrapped.)"""
    import matplotlib.pyplot   # noqa: F401  (imported as usual, before its files would be opened as cp1252)
    real = builtins.open

    def open_in_cp1252(file, mode="r", buffering=-1, encoding=None, *args, **kwargs):
        if "b" not in mode and encoding in (None, "locale"):
            encoding = "cp1252"
        return real(file, mode, buffering, encoding, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", open_in_cp1252)
    monkeypatch.setattr(io, "open", open_in_cp1252)
    monkeypatch.setattr(locale, "getpreferredencoding", lambda do_setlocale=True: "cp1252")


def test_a_sweep_report_is_utf8_and_printed_whole_whatever_the_locale_s_encoding(tmp_path, text_file, cp1252_files,
                                                                              capsys):
    from ablate import main
    from tests.test_ablate import write_sweep
    path = write_sweep(tmp_path, text_file)
    assert run_cli(main, [str(path), "--report"]) == 0
    md = (tmp_path / "sweep" / "results.md").read_bytes().decode("utf-8")
    assert "| Δ final vs sdpa |" in md and "SE = σ·√(1/n + 1/n_baseline)" in md
    assert "| Δ final vs sdpa |" in capsys.readouterr().out, "printed as written, not as cp1252 would read it"


def test_a_report_that_cannot_be_written_leaves_the_earlier_one_or_none(tmp_path, text_file, monkeypatch):
    from ablation.report import summarize, write_md
    from ablation.sweep import load_sweep
    from tests.test_ablate import write_sweep
    sweep = load_sweep(str(write_sweep(tmp_path, text_file)))
    rows, out = summarize(sweep, []), tmp_path / "sweep"
    out.mkdir()

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    for earlier in (None, "an earlier report\n"):
        if earlier:
            (out / "results.md").write_text(earlier)
        with pytest.raises(OSError, match="No space left"):
            write_md(sweep, rows, out, "python ablate.py sweep.toml")
        assert os.listdir(out) == ([] if earlier is None else ["results.md"]), "no empty or partial file"
        assert earlier is None or (out / "results.md").read_text() == earlier


def test_a_run_s_default_out_dir_is_written_with_forward_slashes_on_windows_too(monkeypatch):
    """out/notes-bpe4096, as the README and every message write it (Windows takes / as well)."""
    from training import config
    monkeypatch.setattr(config, "Path", PureWindowsPath)
    data = SimpleNamespace(path="books\\notes.txt", tokenizer="bpe:4096")
    assert config.default_out_dir(None, data, {"data.path", "data.tokenizer"}) == "out/notes-bpe4096"
