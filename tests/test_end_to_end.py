"""train.py then sample.py, run as a user would: subprocesses, exit codes, what they print."""
import os
import subprocess
import sys

from tests.conftest import ROOT, tiny_overrides


def run(*args, cwd=ROOT, env=None):
    env = env or {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_train_then_sample(tmp_path, text_file):
    out = tmp_path / "out"
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30, "train.log_interval": 10})
    r = run("train.py", *args)
    assert r.returncode == 0, r.stderr
    assert f"\n# {out}: a new run" in r.stdout and "step     30 | loss" in r.stdout
    changed = next(l for l in r.stdout.splitlines() if l.startswith("# not the defaults: "))
    set_here = ("n_layer = 2", "n_head = 2", "n_embd = 32", "block_size = 32")
    assert all(f"model.{k}" in changed for k in set_here), changed
    assert "model.dropout" not in changed and "train.lr" not in changed, "a default is not a change"
    assert "model.vocab_size" not in changed, "the data's vocabulary is no change"
    assert "parameters, vocab 48 |" in r.stdout, "the data's vocabulary is said"
    assert all((out / name).exists() for name in ("best.pt", "metrics.jsonl", "config.toml"))
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


def test_the_first_command_works_without_a_network_from_any_directory(tmp_path):
    """python /path/to/repo/train.py on a fresh machine with no network, from another directory:
    the default data ships with the repository and is the repository's, and a relative --out_dir
    is the working directory's. The child process can neither resolve a name nor connect anywhere
    (sitecustomize, run at start)."""
    blocker = tmp_path / "offline"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import socket\n"
        "def refuse(*a, **k):\n"
        "    raise OSError('no network in this test')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n"
        "socket.create_connection = socket.getaddrinfo = refuse\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"}
    args = [ROOT / "train.py", "--out_dir=run", "--data.prepared_dir=prep", "--train.max_steps=3",
            "--train.warmup_steps=1", "--train.eval_interval=3", "--train.eval_iters=1",
            "--train.log_interval=1", "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=1",
            "--model.block_size=16"]
    r = run(*args, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "data/tinyshakespeare.txt" in r.stdout and "# done: step 3" in r.stdout
    assert (tmp_path / "run" / "ckpt_0000003.pt").is_file() and any((tmp_path / "prep").iterdir())
    default_text = str(ROOT / "data" / "tinyshakespeare.txt")
    assert default_text in (tmp_path / "run" / "config.toml").read_text()
    probe = run("-c", "import socket; socket.socket().connect(('127.0.0.1', 9))", env=env)
    assert probe.returncode != 0 and "no network" in probe.stderr, "the child really had no network"
