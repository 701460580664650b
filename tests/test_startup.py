"""A command loads only what it uses: train.py, sample.py, eval.py and ablate.py, run in one process
and compiling nothing, never import torch._dynamo, which costs a second of start-up on a CPU and
several on a GPU machine (torch.optim's optimizers import it on first use, and so does a random
init on the meta device); nor transformers, safetensors or huggingface_hub, which only a Hugging
Face model asks for."""
import json
import subprocess
import sys

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
