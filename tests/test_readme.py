"""Every command in README.md's code blocks runs as written on a fresh clone: each is run in order, as
the shell runs it, in a copy of the repository (so a command may use the runs the earlier ones made, and
the repository is not written), with the user's own texts the README names (my_notes.txt, books/) made
beforehand. Where a command would train or score for minutes, its arguments get a cheap tail (a tiny model,
two steps); one that needs the network or hardware this machine lacks is skipped, with why. A command
this test does not know fails it, and so does an entry for a command the README no longer has: the README
cannot drift from what runs."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TEXT

README = ROOT / "README.md"
TINY = ("--model.n_layer=1 --model.n_head=2 --model.n_embd=32 --model.block_size=32 --train.batch_size=4 "
        "--train.max_steps=2 --train.warmup_steps=1 --train.eval_interval=2 --train.eval_iters=1 "
        "--train.log_interval=1 --log.curves=false --train.device=cpu")
NETWORK = "needs the network: "
# every command of the README, as written (a trailing # comment left out) -> what is added to it to make it
# cheap ("" for nothing), or why it is not run here
RUNS = {
    "python3 -m venv .venv": "skip: makes the virtual environment this test already runs in",
    ". .venv/bin/activate": "skip: enters the virtual environment this test already runs in",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": NETWORK + "installs PyTorch",
    "pip install -r requirements.txt": NETWORK + "installs the requirements",
    "pip install -r requirements-dev.txt": NETWORK + "installs the test requirements",
    "python -m pytest": "skip: the suite itself, which this test is part of",
    "python train.py": TINY,
    'python sample.py out/tinyshakespeare --prompt "ROMEO:"': "",
    "python train.py --data my_notes.txt": TINY,
    "python train.py --data my_notes.txt --data.tokenizer=bpe:4096": TINY,
    "python train.py --data 'books/*.txt' --data.tokenizer=gpt2": TINY,
    "python train.py --data posts.jsonl --data.text_field=body": TINY,
    'hf download roneneldan/TinyStories --repo-type dataset --include "data/*.parquet" --local-dir tinystories':
        NETWORK + "downloads a dataset from the Hugging Face Hub",
    "python train.py --data tinystories --data.tokenizer=gpt2": NETWORK + "trains on the download above",
    'python train.py --out_dir=out/watched --train.sample_every=250 --train.sample_prompt="ROMEO:"': TINY,
    "python eval.py out/tinyshakespeare data/tinyshakespeare.txt": "--max-tokens 500",
    "python train.py configs/shakespeare_char_cpu_fast.toml": TINY,
    "python plot.py out/tinyshakespeare out/shakespeare_char_cpu_fast": "",
    'python sample.py out/my_notes --prompt "The " --num-samples 3 --max-new-tokens 300 '
    '--temperature 0.8': "",
    'python sample.py gpt2 --prompt "The meaning of life is"': NETWORK + "downloads GPT-2's weights",
    "python train.py configs/finetune_gpt2.toml --data my.txt": NETWORK + "downloads GPT-2's weights",
    "python export.py out/finetune_gpt2-my hf_model/": NETWORK + "exports the run above, of GPT-2's weights",
    "python ablate.py configs/ablations/attention_cpu.toml": TINY,
    'python attention.py out/tinyshakespeare --prompt "JULIET: O Romeo, Romeo, wherefore art thou Romeo?" '
    '--html attention.html': "",
    "python attention.py out/tinyshakespeare --prompt $'PETRUCHIO:\\nIt cannot be.\\n'": "",
    "torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.toml --data big.txt":
        "skip: needs 8 GPUs (tests/test_distributed.py trains with 2 CPU processes)",
}
SKIPPED = ("skip: ", NETWORK)
# the user's own texts the README's commands name, which a user would have: made in the copy first (a BPE of
# 4,096 tokens needs more than a page)
OWN_TEXTS = {"my_notes.txt": (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000],
             "books/plays.txt": TEXT, "books/more.txt": TEXT.upper(),
             "posts.jsonl": "".join(json.dumps({"id": i, "body": line}) + "\n" for i, line in enumerate(TEXT.split("\n\n")))}


def readme_commands() -> list[str]:
    """The commands of README.md's shell code blocks, in order: a line each, split at &&, without comments."""
    blocks = re.findall(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", README.read_text(encoding="utf-8"),
                        re.MULTILINE | re.DOTALL)
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [command.strip() for line in lines if line for command in line.split(" && ")]


def test_every_readme_command_is_known_to_this_test():
    commands = readme_commands()
    unknown = [c for c in commands if c not in RUNS]
    assert not unknown, f"README.md has commands this test does not know: {unknown}; add each to RUNS, " \
        "with what makes it cheap or why it cannot run here"
    gone = [c for c in RUNS if c not in commands]
    assert not gone, f"RUNS has commands README.md no longer has: {gone}"


def fresh_clone(dest):
    """What a clone holds that the commands use (the code, configs/, data/'s text), without runs or caches."""
    for path in ROOT.iterdir():
        if path.suffix == ".py":
            shutil.copy(path, dest / path.name)
        elif path.name == "configs" or (path / "__init__.py").is_file() and path.name != "tests":
            shutil.copytree(path, dest / path.name, ignore=shutil.ignore_patterns("__pycache__", "prepared"))
    for name, text in OWN_TEXTS.items():
        (dest / name).parent.mkdir(exist_ok=True)
        (dest / name).write_text(text, encoding="utf-8")


def gpt2_files() -> bool:
    from common import UserError
    from data.tokenizers import build_tokenizer
    try:
        return bool(build_tokenizer("gpt2"))
    except UserError:
        return False


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the README's commands as bash does")
def test_every_readme_command_runs_as_written(tmp_path):
    clone, bin_dir = tmp_path / "clone", tmp_path / "bin"
    clone.mkdir()
    bin_dir.mkdir()
    fresh_clone(clone)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # `python`: this one
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "disabled"}
    ran, have_gpt2 = [], gpt2_files()
    for command in readme_commands():
        tail = RUNS.get(command, "")   # (one not known: as written, besides failing the test above)
        if tail.startswith(SKIPPED) or "tokenizer=gpt2" in command and not have_gpt2:   # (no files: network)
            continue
        r = subprocess.run(["bash", "-c", f"{command} {tail}"], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=300, check=False)
        assert r.returncode == 0, f"{command} {tail}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        if command == "python train.py":   # its last line names the README's next command
            assert r.stdout.endswith("; to sample it: python sample.py out/tinyshakespeare\n"), r.stdout
        ran.append(command)
    compared = clone / "out" / "runs-tinyshakespeare+shakespeare_char_cpu_fast.png"
    assert len(ran) >= 12 and (clone / "attention.html").is_file() and compared.is_file()
