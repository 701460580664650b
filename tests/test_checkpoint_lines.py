"""What a checkpoint that cannot be written or read says: a file-size limit is named as one, not
as a full disk; a checkpoint of another format version names its version and what reads it."""
import errno
import os
import subprocess
import sys

import pytest
import torch

import sample as sample_cli
from loading import VERSION, read_checkpoint
from tests.conftest import ROOT, run_tool, save_char_model, tiny_overrides
from training.checkpoint import why_unwritten

# bytes: room for the prepared tiny text and the logs, not for a checkpoint
LIMIT = 100_000
UNIX = pytest.mark.skipif(os.name != "posix", reason="a file-size limit (RLIMIT_FSIZE) is Unix's")


def limit_file_size():
    """In the child: files may grow to LIMIT bytes (as after `ulimit -f`)."""
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


@UNIX
def test_a_file_size_limit_while_saving_a_checkpoint_is_said_as_that_limit(tmp_path, text_file):
    out = tmp_path / "out"
    args = tiny_overrides(tmp_path, text_file, out_dir=out)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True,
                       text=True, preexec_fn=limit_file_size, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == (f"error: could not write {out / 'ckpt_0000010.pt'}: it is larger than "
                        f"this process's file-size limit of {LIMIT:,} bytes (ulimit -f; "
                        f"`ulimit -f unlimited` lifts it)\n")
    assert not list(out.glob("*.pt")) and not list(out.glob(".*.tmp")), "no part of a checkpoint"


def raised(error: OSError, wrapped: bool) -> Exception:
    """error as torch.save lets it out: itself, or (wrapped) the RuntimeError of torch's zip
    writer, raised while the file's error was handled."""
    try:
        try:
            raise error
        except OSError:
            if wrapped:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
            raise
    except Exception as e:
        return e


@UNIX
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_full_disk_and_a_file_system_s_size_limit_are_told_apart(wrapped):
    import resource
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        pytest.skip("this test process has a file-size limit of its own")
    full = raised(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), wrapped)
    assert why_unwritten(full) == "No space left on device"
    too_large = raised(OSError(errno.EFBIG, os.strerror(errno.EFBIG)), wrapped)
    assert why_unwritten(too_large) == ("it is larger than its file system allows (FAT32: 4 GiB): "
                                        "write it to another one")
    unknown = RuntimeError("unexpected pos 704 vs 598")
    assert why_unwritten(unknown) == "unexpected pos 704 vs 598: is the disk full?"


@pytest.mark.parametrize("version, reads", [(1, "an earlier"), (VERSION + 1, "a later")])
def test_a_checkpoint_of_another_format_version_names_it_and_what_reads_it(tmp_path, capsys,
                                                                           version, reads):
    run = save_char_model(tmp_path / "run", n_layer=1, n_head=2, n_embd=16, block_size=8)
    path = tmp_path / "other.pt"
    torch.save({**read_checkpoint(run / "best.pt"), "version": version}, path)
    rc, _, err = run_tool(sample_cli, [path], capsys)
    assert rc == 2 and err == (f"error: {path} is a checkpoint of format version {version}, this "
                               f"code reads version {VERSION}: {reads} commit of this repository "
                               f"reads it\n"), err
