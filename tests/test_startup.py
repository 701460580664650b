"""A command takes only what it uses. train.py, sample.py, eval.py and ablate.py, run in one
process and compiling nothing, never import torch._dynamo, which costs a second of start-up on a
CPU and several on a GPU machine (torch.optim's optimizers import it on first use, and so does a
random init on the meta device); nor transformers, safetensors or huggingface_hub, which only a
Hugging Face model asks for. A CPU run leaves other processes their cores: beside a process that
keeps one of its two cores busy, it trains with one thread (two would wait for each other at every
operation); a thread count the user sets is kept."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides

# Runs each command of argv[1] (a JSON list of argument lists) as `python COMMAND ...` would, in
# turn, in this one process; exits naming the first that imported one of UNASKED, and from where.
WATCH = """
import json, runpy, sys, traceback
UNASKED = ("torch._dynamo", "transformers", "safetensors", "huggingface_hub")

class Watch:
    stack = None

    def find_spec(self, name, path=None, target=None):
        if name in UNASKED and Watch.stack is None:
            Watch.stack = f"{name}:\\n" + "".join(traceback.format_stack(limit=12))

sys.meta_path.insert(0, Watch())
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            sys.exit(f"{argv[0]} exited {e.code}")
    if Watch.stack:
        sys.exit(f"{argv[0]} imported {Watch.stack}")
"""


def test_train_sample_eval_and_ablate_import_neither_torch_dynamo_nor_transformers(tmp_path, text_file):
    out, sweep = tmp_path / "out", tmp_path / "sweep.toml"
    sweep.write_text(f"""out_dir = {json.dumps(str(tmp_path / "sweep"))}
seeds = [1]
[overrides]
data.path = {json.dumps(str(text_file))}
data.prepared_dir = {json.dumps(str(tmp_path / "prepared"))}
model = {{n_layer = 1, n_head = 2, n_embd = 16, block_size = 16}}
train = {{batch_size = 4, max_steps = 2, eval_interval = 2, eval_iters = 1, device = "cpu"}}
log.curves = false
[[variants]]
name = "fast"
train.optimizer = "muon"
model.pos = "rope"
model.qk_norm = true
""")
    run = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2, "train.eval_interval": 2})
    commands = [["train.py", *run], ["sample.py", str(out), "--max-new-tokens", "5"],
                ["eval.py", str(out), str(text_file)], ["ablate.py", str(sweep)]]
    r = subprocess.run([sys.executable, "-c", WATCH, json.dumps(commands)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


two_cores = pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
                               reason="needs Linux's CPU affinity and two cores to pin processes to")


def banner_beside_a_busy_core(tmp_path, text_file, **env) -> str:
    """The device part of the banner of a one-step run on two cores, one of which another process
    keeps busy from before the run starts."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, cores[:1]))
    try:
        one_step = {"train.max_steps": 1, "train.eval_interval": 1,
                    "out_dir": tmp_path / f"out{len(env)}"}
        argv = [sys.executable, ROOT / "train.py", *tiny_overrides(tmp_path, text_file, **one_step)]
        plain = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run(argv, capture_output=True, text=True, env=plain | env, timeout=300,
                              preexec_fn=lambda: os.sched_setaffinity(0, cores))
    finally:
        spin.kill()
        spin.wait()
    assert done.returncode == 0, done.stderr
    return next(line for line in done.stdout.splitlines() if "parameters" in line)


@two_cores
def test_a_cpu_run_beside_a_busy_core_trains_with_one_thread_unless_the_user_sets_more(tmp_path,
                                                                                      text_file):
    assert "| cpu x 1 thread," in banner_beside_a_busy_core(tmp_path, text_file)
    banner = banner_beside_a_busy_core(tmp_path, text_file, OMP_NUM_THREADS="2")
    assert "| cpu x 2 threads," in banner
