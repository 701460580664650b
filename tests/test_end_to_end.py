"""train.py then sample.py, run as a user would: subprocesses, exit codes, what they print."""
import os
import subprocess
import sys

from tests.conftest import ROOT, tiny_overrides


def run(*args, cwd=ROOT):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_train_then_sample(tmp_path, text_file):
    out = tmp_path / "out"
    r = run("train.py", *tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30, "train.log_interval": 10}))
    assert r.returncode == 0, r.stderr
    assert f"\n# {out}: a new run" in r.stdout and "step     30 | loss" in r.stdout and "parameters" in r.stdout
    changed = next(l for l in r.stdout.splitlines() if l.startswith("# not the defaults: "))
    assert all(f"model.{k}" in changed for k in ("n_layer = 2", "n_head = 2", "n_embd = 32", "block_size = 32")), changed
    assert "model.dropout" not in changed and "train.lr" not in changed, "a default is not a change"
    assert "model.vocab_size" not in changed and "parameters, vocab 48 |" in r.stdout, "the data's vocabulary is said"
    assert (out / "best.pt").exists() and (out / "metrics.jsonl").exists() and (out / "config.toml").exists()
    assert "(on the device)" in r.stdout, "a small dataset is copied to the device"

    sample = ("sample.py", str(out), "--prompt", "First", "--num-samples", "2", "--max-new-tokens", "40",
              "--seed", "3")
    r = run(*sample)
    assert r.returncode == 0, r.stderr
    samples = r.stdout.split("--- sample ")[1:]
    assert len(samples) == 2
    for s in samples:
        body = s.split("\n", 1)[1].rstrip("\n")
        assert body.startswith("First") and len(body) == len("First") + 40
    assert run(*sample).stdout == r.stdout, "a seed fixes the samples"

    r = run("sample.py", str(out), "--prompt", "", "--max-new-tokens", "10", "--temperature", "0")
    assert r.returncode == 0 and len(r.stdout) == 11   # 10 characters and the final newline


def test_resume_from_the_command_line(tmp_path, text_file):
    args = tiny_overrides(tmp_path, text_file)
    assert run("train.py", *args).returncode == 0
    r = run("train.py", *tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30}), "--resume")
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "step     21 |" in r.stdout and "step     20 |" not in r.stdout


def test_user_errors_are_one_line_and_exit_non_zero(tmp_path, text_file):
    cases = [
        (["train.py", "--model.n_layr=2"], "did you mean 'model.n_layer'"),
        (["train.py", "--data", str(tmp_path / "missing.txt")], "data file not found"),
        (["sample.py", str(tmp_path / "nothing")], "checkpoint not found"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_first_command_works_without_a_network(tmp_path):
    """python train.py on a fresh machine with no network: the default data ships with the repository.
    The child process can neither resolve a name nor connect anywhere (sitecustomize, run at start)."""
    blocker = tmp_path / "offline"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import socket\n"
        "def refuse(*a, **k):\n"
        "    raise OSError('no network in this test')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n"
        "socket.create_connection = socket.getaddrinfo = refuse\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"}
    args = ["train.py", f"--out_dir={tmp_path / 'out'}", f"--data.prepared_dir={tmp_path / 'prepared'}",
            "--train.max_steps=3", "--train.warmup_steps=1", "--train.eval_interval=3", "--train.eval_iters=1",
            "--train.log_interval=1"]
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "data/tinyshakespeare.txt" in r.stdout and "# done: step 3" in r.stdout
    probe = subprocess.run([sys.executable, "-c", "import socket; socket.socket().connect(('127.0.0.1', 9))"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "no network" in probe.stderr, "the child really had no network"
