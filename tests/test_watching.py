"""Watching a run as it learns: samples while training (which change no loss) and every run's loss
curves (plot.py, which overlays several runs, is tests/test_plot.py's)."""
import json
import re

import pytest

from tests.conftest import run_tool
from training.trainer import train

PNG = b"\x89PNG\r\n\x1a\n"


def records(out_dir, kind):
    return [r for r in map(json.loads, open(f"{out_dir}/metrics.jsonl")) if r["kind"] == kind]


def test_samples_while_training_change_no_loss_bit_for_bit(tiny_cfg, tmp_path):
    extra = {"model.dropout": 0.1, "train.eval_interval": 5}   # dropout: the random draws are untouched too
    train(tiny_cfg(**extra, out_dir=tmp_path / "plain"), quiet=True)
    train(tiny_cfg(**extra, out_dir=tmp_path / "sampled", **{"train.sample_every": 5, "train.sample_prompt": "First",
                                                            "train.sample_tokens": 30}), quiet=True)
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        assert [r[key] for r in records(tmp_path / "sampled", kind)] == [r[key] for r in records(tmp_path / "plain", kind)]
    samples = records(tmp_path / "sampled", "sample")
    assert [s["step"] for s in samples] == [5, 10, 15, 20]
    assert all(s["text"].startswith("First") and len(s["text"]) == len("First") + 30 for s in samples)


def test_sampling_from_a_resumed_run_is_named_but_not_called_a_different_run(tiny_cfg, capsys):
    train(tiny_cfg(**{"train.max_steps": 10}), quiet=True)
    train(tiny_cfg(**{"train.sample_every": 5, "train.sample_tokens": 5, "train.max_steps": 12}), resume=True)
    out, err = capsys.readouterr()
    assert "# resuming with train.sample_every: 0 -> 5" in out and not err, err


def test_sampling_time_is_not_billed_to_the_steps(tiny_cfg, monkeypatch):
    import time
    import training.trainer
    real, calls = training.trainer.generate, []

    def slow_generate(*args, **kwargs):
        # as a long sample would take
        calls.append(time.sleep(0.3))
        yield from real(*args, **kwargs)
    monkeypatch.setattr(training.trainer, "generate", slow_generate)
    cfg = tiny_cfg(**{"train.sample_every": 2, "train.log_interval": 2, "train.max_steps": 10})
    train(cfg, quiet=True)
    assert len(calls) == 5, "the samples were drawn"
    steps = records(cfg.out_dir, "train")
    assert all(r["ms_per_step"] < 100 for r in steps), steps


def test_a_sample_prompt_the_text_cannot_encode_is_refused_at_once(tiny_cfg):
    from common import UserError
    with pytest.raises(UserError, match="train.sample_prompt has 1 character"):
        train(tiny_cfg(**{"train.sample_every": 5, "train.sample_prompt": "☃"}), quiet=True)


def test_every_run_draws_its_curves_at_each_evaluation(tiny_cfg, monkeypatch):
    import viz.curves
    titles, draw = [], viz.curves.draw

    def counted(panels, title, **kw):
        titles.append(title)
        return draw(panels, title, **kw)
    monkeypatch.setattr(viz.curves, "draw", counted)
    cfg = tiny_cfg(**{"log.curves": "true", "train.max_steps": 10})   # evaluations at steps 10 and 20
    train(cfg, quiet=True)
    first = open(f"{cfg.out_dir}/curves.png", "rb").read()
    cfg.train.max_steps = 20
    train(cfg, quiet=True, resume=True)
    second = open(f"{cfg.out_dir}/curves.png", "rb").read()
    assert [t.split(": ")[1] for t in titles] == ["step 10", "step 20"], titles
    assert first.startswith(PNG) and second.startswith(PNG), "a PNG at each evaluation"
    assert first != second, "redrawn at the second evaluation"
    monkeypatch.setattr(viz.curves, "draw", lambda *a, **kw: pytest.fail("log.curves=false draws nothing"))
    off = tiny_cfg(**{"log.curves": "false", "train.max_steps": 10}, out_dir=f"{cfg.out_dir}-off")
    train(off, quiet=True)


def test_every_sample_draws_with_the_same_seed_and_is_printed(tiny_cfg, capsys):
    """Weights that do not move (lr 0) sample the same text at every step: the generator is seeded
    anew for each sample, not once per run. Each sample is printed with its step."""
    cfg = tiny_cfg(**{"train.lr": 0.0, "train.min_lr": 0.0, "train.sample_every": 5, "train.sample_tokens": 20,
                      "train.sample_prompt": "First"})
    train(cfg)
    texts = [s["text"] for s in records(cfg.out_dir, "sample")]
    assert len(texts) == 4 and len(set(texts)) == 1, texts
    out = capsys.readouterr().out
    for step in (5, 10, 15, 20):
        assert f"sample {step:4d} | {texts[0].splitlines()[0]}" in out, out


def test_a_run_s_curves_are_its_losses_and_bits_per_byte(tiny_cfg):
    from viz.curves import read_records, run_panels
    cfg = tiny_cfg(**{"train.log_interval": 5})
    train(cfg, quiet=True)
    logged, evals = records(cfg.out_dir, "train"), records(cfg.out_dir, "eval")
    loss, bpb = run_panels(read_records(f"{cfg.out_dir}/metrics.jsonl"))
    drawn = {line.label: (line.x, line.y) for line in loss.lines}
    assert drawn["train (logged steps)"] == ([r["step"] for r in logged], [r["loss"] for r in logged])
    assert drawn["train (evaluation)"] == ([r["step"] for r in evals], [r["train_loss"] for r in evals])
    assert drawn["val"] == ([r["step"] for r in evals], [r["val_loss"] for r in evals])
    assert [(line.x, line.y) for line in bpb.lines] == [([r["step"] for r in evals],
                                                         [r["val_bpb"] for r in evals])]


def test_samples_curves_and_the_page_on_a_text_that_is_not_shakespeare(tiny_cfg, tmp_path, capsys):
    """Watching a run end to end on Python source (argparse.py): samples of its characters, its
    curves and its attention page."""
    import argparse

    import attention as attention_cli
    source = open(argparse.__file__, encoding="utf-8").read()[:30_000]
    text_file = tmp_path / "argparse.txt"
    text_file.write_bytes(source.encode("utf-8"))
    cfg = tiny_cfg(**{"data.path": text_file, "train.sample_every": 10, "train.sample_prompt": "def ",
                      "train.sample_tokens": 40, "log.curves": "true", "model.block_size": 16})
    train(cfg, quiet=True)
    samples = records(cfg.out_dir, "sample")
    assert [s["step"] for s in samples] == [10, 20]
    assert all(set(s["text"]) <= set(source) for s in samples)
    assert open(f"{cfg.out_dir}/curves.png", "rb").read().startswith(PNG)
    page, prompt = tmp_path / "page.html", source[:16]
    rc, _, err = run_tool(attention_cli, [cfg.out_dir, "--prompt", prompt, "--html", page], capsys)
    data = r'<script id="data" type="application/json">(.*?)</script>'
    inlined = re.search(data, page.read_text("utf-8"), re.S)
    assert rc == 0 and "".join(json.loads(inlined[1])["tokens"]) == prompt, err
