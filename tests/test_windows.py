"""What differs on Windows, tested here by simulating it: no fcntl (the out dir is locked through
msvcrt), no SIGHUP and no SIGINT to send to another process (a sweep passes a stop on as
CTRL_BREAK_EVENT), text files in the ANSI code page by default and stdout redirected in it (cp1252),
and files that cannot be replaced or deleted while a process maps them. Where the real thing can run
on every system (a lock held by another process), it does."""
import builtins
import errno
import io
import os
import signal
import subprocess
import sys
import time

import pytest

import sample as sample_cli
from common import RunError, run_cli
from tests.conftest import ROOT, save_char_model

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread

# ---------------------------------------------------------------- stdout in a code page

NOT_CP1252 = "√Δ"   # in no Western code page


def cp1252_stdout(monkeypatch):
    """sys.stdout as Windows sets it up when output is redirected: the ANSI code page, strict errors."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="cp1252", errors="strict", newline="\n")
    monkeypatch.setattr(sys, "stdout", out)
    return out


def test_sample_writes_what_a_cp1252_stdout_lacks_as_question_marks_and_says_so(tmp_path, monkeypatch, capsys):
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
    assert "note: stdout's encoding (cp1252) lacks" in err and f"lacks {shown} of the characters" in err, err


@pytest.mark.skipif(os.name != "posix", reason="closes the child's fd 1 before it starts, as a POSIX shell's >&- does")
def test_sample_with_stdout_closed_is_one_error_line(trained):
    r = subprocess.run([sys.executable, "sample.py", trained, "--max-new-tokens", "5"], cwd=ROOT, stdout=None,
                       stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    lines = [l for l in r.stderr.splitlines() if not l.startswith("# ")]
    assert r.returncode == 2 and lines == ["error: stdout is closed: there is nowhere to write the samples to"], \
        r.stderr
