"""eval.py scores what it says: every token after the first once, in the windows its docstring
describes; the trainer's exact val loss and transformers' loss on the same windows come out the
same; several files are separate texts; every user mistake is one line and exit code 2."""
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval as eval_cli
from data.prepare import load_meta
from data.loader import strided_windows
from data.prepare import prepare
from model.config import ModelConfig
from model.gpt import GPT, score
from loading import load_model
from tests.conftest import (ROOT, TEXT, gpt2_or_skip, posix_signals, records, run_tool, scramble_,
                            write)
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def scores(argv, capsys) -> dict:
    """eval.py's --json output for argv (on the CPU), checked to have succeeded."""
    rc, out, err = run_tool(eval_cli, [*argv, "--device", "cpu", "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- which tokens are scored

def score_tokens(model, ids, block_size, stride, batch_size):
    """(nats, tokens scored) of model on ids, windowed as eval.py windows them."""
    return score(model, strided_windows(ids, block_size, stride, batch_size))


@pytest.mark.parametrize("n, block_size, stride", [(2, 8, 8), (9, 8, 8), (10, 8, 8), (100, 8, 8), (100, 8, 3),
                                                   (100, 8, 1), (101, 8, 7), (50, 1, 1), (7, 16, 5)])
def test_every_token_after_the_first_is_scored_once_with_at_least_its_context(n, block_size, stride):
    """With tokens 0..n-1 a token's value is its index: the windows must start `stride` apart and the
    scored targets, in order, be 1..n-1."""
    scored, starts = [], []
    for x, y in strided_windows(np.arange(n), block_size, stride, batch_size=3):
        assert torch.equal(x, x[:, :1] + torch.arange(x.size(1))), "a window is consecutive tokens"
        assert torch.equal(y[y >= 0], (x + 1)[y >= 0]), "a target is the token after its input"
        starts += x[:, 0].tolist()
        for row in y:
            for position in torch.nonzero(row >= 0).flatten().tolist():
                target = row[position].item()
                assert position + 1 >= min(target, block_size - stride + 1), "too little context"
                scored.append(target)
    assert scored == list(range(1, n))
    assert starts == list(range(0, stride * len(starts), stride))


def test_a_stride_of_1_is_each_token_predicted_from_its_last_block_size_tokens():
    block = 8
    model = scramble_(GPT(ModelConfig(vocab_size=20, block_size=block, n_layer=2, n_head=2, n_embd=16)))
    ids = np.random.default_rng(0).integers(0, 20, size=40)
    nats, count = score_tokens(model, ids, block, stride=1, batch_size=5)
    by_hand = []
    with torch.no_grad():
        for i in range(1, len(ids)):
            context = torch.tensor(ids[max(0, i - block):i])[None]
            logits, _ = model(context)   # the last position's logits
            by_hand.append(F.cross_entropy(logits[0, -1], torch.tensor(ids[i])).item())
    assert count == len(ids) - 1
    assert nats / count == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-6)
    nonoverlapping, _ = score_tokens(model, ids, block, stride=block, batch_size=5)
    assert abs(nonoverlapping - nats) > 1e-3, "the context must matter, or this test could not fail"


@pytest.mark.parametrize("stride", [None, 7])
def test_eval_py_scores_every_token_of_a_file_but_the_first(trained, tmp_path, capsys, stride):
    path = write(tmp_path / "part.txt", TEXT[:301])   # 300 targets: not a multiple of the block size, 32
    result = scores([trained, path] + (["--stride", stride] if stride else []), capsys)
    assert result["stride"] == (stride or 32) and result["block_size"] == 32
    (row,) = result["files"]
    assert row["tokens"] == 300 and row["bytes"] == 300, "the first character is context, not scored"
    assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2))   # 1 byte per character
    assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    assert result["total"]["loss"] == row["loss"]


def test_a_long_scoring_says_how_far_it_is_on_stderr(trained, tmp_path, capsys, monkeypatch):
    """Into a log (not a terminal) a progress line every 10 s: here the clock moves 11 s a reading."""
    clock = iter(range(0, 10**7, 11))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    a, b = write(tmp_path / "a.txt", TEXT[:301]), write(tmp_path / "b.txt", TEXT[301:602])
    rc, _, err = run_tool(eval_cli, [trained, a, b, "--device", "cpu", "--batch-size", "2"], capsys)
    line = r"scoring (\S+) \(\d/2\): ([\d,]+) / ([\d,]+) tokens, [\d,]+ tokens/s, ETA"
    done = [(m[1], int(m[2].replace(",", "")), int(m[3].replace(",", ""))) for m in re.finditer(line, err)]
    assert rc == 0 and len(done) >= 4, err
    assert [n for _, n, _ in done] == sorted(n for _, n, _ in done) and done[-1][1:] == (600, 600), done
    assert {name for name, _, _ in done} == {str(a), str(b)}, "each line names the file being scored"


# ------------------------------------------------ the same numbers as the trainer and transformers

def test_equals_the_trainers_val_loss_on_the_val_split(tiny_cfg, tmp_path, capsys):
    """The trainer's exact evaluation (train.eval_iters = 0) scores the val split in consecutive windows,
    the last one shorter: eval.py on the split's text scores the same tokens with the same contexts."""
    cfg = tiny_cfg(**{"train.eval_iters": 0, "train.eval_interval": 20, "model.block_size": 16})
    train(cfg, quiet=True)
    val_loss = records(cfg.out_dir, "eval", "val_loss")[20]
    dataset = prepare(cfg.data)
    val = np.fromfile(dataset / "val.bin", dtype=load_meta(dataset)["dtype"])
    assert (len(val) - 1) % 16, "the split ends in a shorter window"
    ckpt = Path(cfg.out_dir) / "ckpt_0000020.pt"
    text = write(tmp_path / "val.txt", load_model(ckpt).tokenizer.decode(val.tolist()))
    result = scores([ckpt, text, "--batch-size", 3], capsys)["total"]
    assert result["tokens"] == len(val) - 1
    assert result["loss"] == pytest.approx(val_loss, abs=1e-6)
    shifted = write(tmp_path / "shifted.txt", load_model(ckpt).tokenizer.decode(val[1:].tolist()))
    assert abs(scores([ckpt, shifted], capsys)["total"]["loss"] - val_loss) > 1e-4, \
        "windows cut elsewhere give another loss, or this test could not fail"


def test_max_tokens_scores_the_first_n_and_skip_unknown_leaves_out_what_the_model_never_saw(trained, tmp_path,
                                                                                          capsys):
    whole = write(tmp_path / "whole.txt", TEXT[:201])
    first = scores([trained, write(tmp_path / "long.txt", TEXT[:1000]), "--max-tokens", 200], capsys)["total"]
    assert first["tokens"] == 200 and first == {**scores([trained, whole], capsys)["total"], "file": "total"}
    accents = write(tmp_path / "accents.txt", TEXT[:100] + "é" + TEXT[100:201] + "☃")
    rc, out, err = run_tool(eval_cli, [trained, accents, "--device", "cpu", "--json", "--skip-unknown"],
                            capsys)
    assert rc == 0 and "left out 2 characters the model never saw" in err, err
    loss = scores([trained, whole], capsys)["total"]["loss"]
    assert json.loads(out)["total"]["loss"] == pytest.approx(loss)


@posix_signals
def test_ctrl_c_stops_the_scoring_and_prints_the_figures_of_what_was_scored(trained, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    text = write(tmp_path / "long.txt", TEXT * 300)   # minutes of scoring, one window at a time
    proc = subprocess.Popen([sys.executable, "eval.py", trained, text, "--device", "cpu", "--batch-size", "1",
                             "--stride", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stderr:
        if line.startswith("# windows of"):   # said just before the scoring starts
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    row = out.splitlines()[1].split()
    scored = int(row[1].replace(",", ""))
    assert row[0] == str(text) and 0 < scored < len(TEXT) * 300 - 1 and math.isfinite(float(row[2])), out
    assert err.strip().endswith(f"interrupted: the figures are those of the {scored:,} tokens "
                                f"scored before it"), err


def transformers_loss(model, ids: list[int], block_size: int, stride: int) -> tuple[float, int]:
    """(mean loss, tokens) by transformers' logits, window after window: a window feeds up to
    block_size tokens from its start and scores the targets after those the windows before it scored;
    the next window starts `stride` tokens later."""
    total, scored_until, start = 0.0, 0, 0   # scored_until: the index of the last token scored so far
    with torch.no_grad():
        while scored_until < len(ids) - 1:
            end = min(start + block_size, len(ids) - 1)   # the index of this window's last target
            logits = model(torch.tensor([ids[start:end]])).logits[0]   # row j predicts ids[start + j + 1]
            new = logits[scored_until - start:]
            total += F.cross_entropy(new, torch.tensor(ids[scored_until + 1:end + 1]), reduction="sum").item()
            scored_until, start = end, start + stride
    return total / (len(ids) - 1), len(ids) - 1


@pytest.mark.parametrize("stride", [None, 5])
def test_equals_transformers_loss_on_the_same_windows(tiny_gpt2, tmp_path, capsys, stride):
    from transformers import GPT2LMHeadModel
    path, model = tiny_gpt2, GPT2LMHeadModel.from_pretrained(tiny_gpt2).eval()
    ids = gpt2_or_skip().encode(TEXT[:500])
    assert (len(ids) - 1) % 16, "a shorter last window is scored too"
    text = write(tmp_path / "text.txt", TEXT[:500])
    result = scores([path, text] + (["--stride", stride] if stride else []), capsys)["total"]
    loss, tokens = transformers_loss(model, ids, 16, stride or 16)
    assert result["tokens"] == tokens
    assert result["loss"] == pytest.approx(loss, abs=1e-5)
    assert loss > 1, "a random model: far from a perfect score"


# ---------------------------------------------------------------- several files

def test_a_glob_gives_a_row_per_file_and_a_token_weighted_total(trained, tmp_path, capsys):
    a, b = write(tmp_path / "a.txt", TEXT[:700]), write(tmp_path / "b.txt", TEXT[700:1000])
    result = scores([trained, tmp_path / "*.txt"], capsys)
    rows, total = result["files"], result["total"]
    assert [r["file"] for r in rows] == [str(a), str(b)]
    assert [r["tokens"] for r in rows] == [699, 299], "each file's first token is not scored"
    alone = scores([trained, b], capsys)["files"][0]
    assert alone["loss"] == pytest.approx(rows[1]["loss"], abs=1e-9), "no context crosses from a.txt to b.txt"
    assert total["tokens"] == 998
    assert total["loss"] == pytest.approx((699 * rows[0]["loss"] + 299 * rows[1]["loss"]) / 998)
    assert total["bits_per_byte"] == pytest.approx(total["loss"] / math.log(2))
    rc, out, _ = run_tool(eval_cli, [trained, tmp_path / "*.txt", "--device", "cpu"], capsys)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 4
    assert lines[0].split() == ["file", "tokens", "loss", "bits/byte", "perplexity"]
    assert [line.split()[0] for line in lines[1:]] == [str(a), str(b), "total"]
    assert lines[3].split()[1:3] == ["998", f"{total['loss']:.4f}"]


# ---------------------------------------------------------------- mistakes

MISTAKES = [   # (what, the file it makes in a directory, what the error line says)
    ("missing", lambda d: d / "nope.txt", "data file not found"),
    ("empty", lambda d: write(d / "empty.txt", ""), "has 0 token"),
    ("not UTF-8", lambda d: write(d / "latin1.txt", "caf\xe9\n".encode("latin-1")),
     r"latin1.txt is not UTF-8: byte 0xe9 at offset 3$"),
    ("no match", lambda d: d / "*.md", r"no files match .*\*\.md"),
    ("unknown chars", lambda d: write(d / "accents.txt", "Citizen: café, naïve"),
     r"accents.txt has 2 character.*'é', 'ï'"),
    ("one token", lambda d: write(d / "one.txt", "A"), "one.txt has 1 token"),
]


@pytest.mark.parametrize("make, message", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_a_file_that_cannot_be_scored_is_one_line_and_nothing_is_scored(trained, tmp_path, capsys, make,
                                                                        message):
    good = write(tmp_path / "good.txt", TEXT[:200])
    rc, out, err = run_tool(eval_cli, [trained, good, make(tmp_path), "--device", "cpu"], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(message, err.strip()), err


@pytest.mark.parametrize("args, message", [
    (["--stride", "0"], "--stride must be >= 1, got 0"),
    (["--stride", "33"], "--stride must be at most the model's context of 32 tokens, got 33"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--device", "tpu"], "--device='tpu' is not a device"),
])
def test_a_bad_option_is_one_line(trained, tmp_path, capsys, args, message):
    rc, out, err = run_tool(eval_cli, [trained, write(tmp_path / "t.txt", TEXT[:100]), *args], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_figure_that_is_not_a_finite_number_is_shown_as_such_and_is_valid_json():
    """A loss past ~709 nats overflows exp(): its perplexity is no number, in the table and in --json."""
    assert eval_cli.figures("nan.txt", tokens=10, nbytes=40, nats=float("nan"))["loss"] is None
    row = eval_cli.figures("diverged.txt", tokens=10, nbytes=40, nats=10 * 800.0)
    assert row["perplexity"] is None and row["bits_per_byte"] == pytest.approx(800 * 10 / 40 / math.log(2))
    assert json.loads(json.dumps(row, allow_nan=False))["perplexity"] is None
    assert eval_cli.table([row]).splitlines()[1].split()[-1] == "-"
