"""Several machines, proven on one, and stopping a run under torchrun, with real launchers as a user
starts them: two torchrun launchers as two nodes (--nnodes=2, 127.0.0.1, gloo, one process each)
train to the losses of one process with the same global batch, and only global rank 0 writes; a
node lost mid-run (its launcher and its worker killed) ends the other within a minute, with one line
of ours, the checkpoints whole, and --resume goes on (a run that ends: tests/test_distributed.py);
Ctrl-C to torchrun says the stop once, with the torchrun command that continues the run."""
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch

from loading import list_checkpoints, load_model, read_checkpoint
from tests.conftest import ROOT, posix_signals, records, tiny_overrides
from training.config import build_config
from training.trainer import train

NEEDS = "torchrun, gloo, and pgrep to find a launcher's workers"
pytestmark = [posix_signals, pytest.mark.skipif(
    not torch.distributed.is_available() or shutil.which("pgrep") is None, reason=NEEDS)]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(folder, text_file, **extra) -> list[str]:
    """A tiny run's settings, its out dir and prepared data under folder (relative paths: the folder
    each node runs in), the global batch 8 sequences."""
    values = {"train.batch_size": 4, "train.max_steps": 6, "train.warmup_steps": 2,
              "train.eval_interval": 2, "train.eval_iters": 2}
    return tiny_overrides(folder, text_file, **(values | extra))


def start_nodes(argv, folders, logs):
    """Node 0 and node 1 of one run, each a torchrun launcher in its own session (a machine of its
    own), started in its folder, its output in logs/node<N>.out and .err."""
    port, nodes = free_port(), []
    for node, folder in enumerate(folders):
        folder.mkdir(exist_ok=True)
        launcher = [*TORCHRUN, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
                    "--master_addr=127.0.0.1", f"--master_port={port}"]
        with open(logs / f"node{node}.out", "w") as out, open(logs / f"node{node}.err", "w") as err:
            nodes.append(subprocess.Popen([*launcher, str(ROOT / "train.py"), *argv], cwd=folder,
                                          env=ENV, stdout=out, stderr=err, start_new_session=True))
    return nodes, port


def kill_node(launcher: subprocess.Popen) -> None:
    """A machine lost: its torchrun launcher and its workers (torchrun starts each worker in a
    session of its own) killed at once."""
    pgrep = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    for group in [launcher.pid, *map(int, pgrep.stdout.split())]:
        with suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def end(nodes) -> None:
    """Nothing left running: each launcher and its workers killed if still there, and waited for."""
    for proc in nodes:
        kill_node(proc)
    for proc in nodes:
        proc.wait(timeout=60)


def test_two_nodes_train_as_one_process_and_a_lost_node_ends_the_other_in_one_line(
        tmp_path, text_file, monkeypatch):
    """The same command on two "machines" (two folders: relative out dir and prepared data), as a
    user runs it on each: rank 0's node holds the run, rank 1's node only the data it prepared.
    Node 1 killed (launcher and worker) once a checkpoint is on node 0's out dir: node 0 ends
    within a minute, non-zero, our worker saying one line (then torchrun's own report of the
    failed worker); the newest checkpoint loads, and one process resumes it (grad_accum=2: the
    same global batch) to the end. Each loss of the two nodes is that of one process with batch
    8 (a flat learning rate: the same whatever max_steps)."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    flat = {"train.max_steps": 2000, "train.eval_interval": 5, "train.min_lr": 1e-3}
    argv = settings(Path("."), text_file, **flat)
    out = folders[0] / "out"
    nodes, port = start_nodes(argv, folders, tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not list_checkpoints(out) and nodes[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list_checkpoints(out), (tmp_path / "node0.err").read_text()
        kill_node(nodes[1])
        lost = time.monotonic()
        nodes[0].wait(timeout=120)
        waited = time.monotonic() - lost
    finally:
        end(nodes)
    err = (tmp_path / "node0.err").read_text()
    assert waited < 60 and nodes[0].returncode != 0, (waited, err)
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    # (torchrun's own traceback follows: a virtual environment inside the repository is not ours)
    frames = [line for line in err.splitlines() if f'File "{ROOT}' in line and "-packages" not in line]
    assert len(ours) == 1 and "[rank0]" not in err and not frames, err
    step, path = list_checkpoints(out)[-1]
    assert ours[0].startswith("error: another process of this run ended or stopped answering (")
    torchrun = ("torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 --master_addr=127.0.0.1 "
                f"--master_port={port} {ROOT / 'train.py'} {shlex.join(argv)} --resume")
    assert ours[0].endswith(f"; the checkpoint of step {step} is kept in {out}: {torchrun} "
                            f"(on each machine, with its own --node_rank) continues it"), ours[0]
    assert os.listdir(folders[1]) == ["prepared"], "rank 1 wrote outside its prepared data"
    logs = [(tmp_path / f"node{n}.out").read_text() for n in (0, 1)]
    assert "x 2 processes (DDP) | 256 tokens/step" in logs[0] and "step " not in logs[1], logs
    load_model(path)
    assert read_checkpoint(path)["step"] == step < 2000
    monkeypatch.chdir(folders[0])
    one_process = ["--train.grad_accum=2", f"--train.max_steps={step + 3}"]
    cfg = build_config(None, [*argv, *one_process], resume=True)
    assert train(cfg, resume=True, quiet=True)["step"] == step + 3
    assert max(records(out)) == step + 3
    alone = {**flat, "train.batch_size": 8, "train.max_steps": step, "out_dir": tmp_path / "one"}
    train(build_config(None, settings(tmp_path, text_file, **alone)), quiet=True)
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        two = {s: v for s, v in records(out, kind, key).items() if s <= step}
        assert two == pytest.approx(records(tmp_path / "one", kind, key), abs=1e-5), kind


def test_a_two_node_run_ends_on_both_nodes_and_only_rank_0_wrote_the_run(tmp_path, text_file):
    """To its last step: both launchers exit 0; node 0's folder holds the run, node 1's only the
    data it prepared."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    nodes, _ = start_nodes(settings(Path("."), text_file), folders, tmp_path)
    try:
        for proc in nodes:
            proc.wait(timeout=180)
    finally:
        end(nodes)
    logs = [(tmp_path / f"node{n}.err").read_text() for n in (0, 1)]
    assert [p.returncode for p in nodes] == [0, 0], logs
    assert sorted(os.listdir(folders[0] / "out")) == ["best.pt", "ckpt_0000004.pt",
                                                      "ckpt_0000006.pt", "config.toml",
                                                      "metrics.jsonl"]
    assert os.listdir(folders[1]) == ["prepared"], "rank 1 wrote outside its prepared data"


def test_ctrl_c_under_torchrun_says_the_stop_once_with_the_torchrun_command(tmp_path, text_file):
    """Ctrl-C reaches torchrun alone (each worker is in a session of its own), which passes it to
    its workers: the notice once, and the stop line once, naming the command as torchrun started
    it (how it resumes, on any number of processes: tests/test_distributed.py)."""
    endless = {"train.max_steps": 100_000, "train.eval_interval": 100_000}
    argv = settings(tmp_path, text_file, **endless)
    launch = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *argv]
    proc = subprocess.Popen(launch, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= 3:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        end([proc])
    assert proc.returncode != 0 and err.count("SIGINT: finishing this step") == 1, err
    stopped = [line for line in out.splitlines() if line.startswith("stopped by")]
    again = f"torchrun --standalone --nproc_per_node=2 train.py {shlex.join(argv)} --resume"
    assert len(stopped) == 1 and stopped[0].endswith(f"; {again} continues it"), out
    step = list_checkpoints(tmp_path / "out")[-1][0]
    saved = f"stopped by SIGINT at step {step}: checkpoint saved in {tmp_path / 'out'}"
    assert stopped[0].startswith(saved), stopped
