"""What a run promises its user besides a trained model: a --help that documents every setting, and
log lines that say how long is left."""
import re
from pathlib import Path

import pytest

import train as train_cli
from tests.conftest import ROOT, interrupt_at, run_tool
from training.config import FIELDS, Config, flat, fmt
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_help_documents_every_setting_with_type_default_and_meaning(capsys):
    rc, out, err = run_tool(train_cli, ["--help"], capsys)
    assert rc == 0 and not err
    found = {m[1]: (m[2], m[3], m[4]) for line in out.splitlines()
             if (m := re.fullmatch(r"  --([\w.]+)=(\S*) +(\w+) +(.*)", line))}
    defaults = flat(Config().to_dict())
    assert len(FIELDS) > 50 and set(found) == set(FIELDS)
    for key, field in FIELDS.items():
        assert found[key] == (fmt(defaults[key]), field.type.__name__, field.metadata["help"]), key
    assert found["train.lr"][2] == "AdamW's peak learning rate"


def test_docs_config_md_shows_the_help_of_today(capsys):
    rc, out, _ = run_tool(train_cli, ["--help"], capsys)
    assert rc == 0 and out[out.index("Settings"):] in (ROOT / "docs" / "config.md").read_text(), \
        "docs/config.md is out of date: paste the settings of `python train.py --help` into it"


LOG_LINE = re.compile(r"step +(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| "
                      r"+(\d+\.\d) ms/step \| [\d,]+ tok/s \| ETA ((?:\d+:)?\d?\d:\d\d)")


def seconds(duration: str) -> int:
    """'1:02:05' -> 3725, '8:20' -> 500."""
    return sum(int(part) * 60**i for i, part in enumerate(reversed(duration.split(":"))))


def test_each_log_line_shows_the_time_left_at_the_whole_run_s_pace(tiny_cfg, capsys, monkeypatch):
    """The time left is the steps left at the pace of the whole run so far (its evaluations too),
    not of the last log interval alone: here each step's time, and the ETA, within a factor of
    two."""
    max_steps = 100_000
    interrupt_at(monkeypatch, 8)
    train(tiny_cfg(**{"train.max_steps": max_steps, "train.eval_interval": 3}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 8
    ms = []
    for line in lines:
        m = LOG_LINE.fullmatch(line)
        assert m, line
        step, eta = int(m[1]), seconds(m[3])
        ms.append(float(m[2]))
        pace = sum(ms) / len(ms) / 1000
        assert 0.5 * pace * (max_steps - step) <= eta, line


def test_the_final_line_gives_the_whole_run_s_time_and_tokens(tiny_cfg, capsys, monkeypatch):
    cfg = tiny_cfg(**{"train.grad_accum": 2})
    interrupt_at(monkeypatch, 10)
    first = train(cfg)
    assert "# done" not in capsys.readouterr().out, "a run stopped early is not done"
    monkeypatch.undo()
    rest = train(cfg, resume=True)
    done = capsys.readouterr().out.splitlines()[-1]
    m = re.fullmatch(r"# done: step 20, best val loss (\d+\.\d{4}), ((?:\d+:)?\d?\d:\d\d) "
                     r"\((\d+\.\d) s\), ([\d,]+) tokens; to sample it: python (\S+) (\S+)", done)
    assert m and Path(m[5]).absolute() == ROOT / "sample.py", done
    assert Path(m[6]).absolute() == Path(cfg.out_dir), "the sample command of this run, from here"
    assert float(m.group(1)) == pytest.approx(rest["best_val_loss"], abs=5e-5)
    assert float(m.group(3)) == pytest.approx(rest["elapsed_s"], abs=0.05)
    assert rest["elapsed_s"] > first["elapsed_s"]
    assert abs(seconds(m.group(2)) - rest["elapsed_s"]) <= 0.5
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
    tokens = int(m.group(4).replace(",", ""))
    assert tokens == 20 * tokens_per_step, "every step's tokens, the resumed ones too"


def test_a_warm_up_longer_than_the_run_is_said_in_the_banner(tiny_cfg, capsys):
    train(tiny_cfg(**{"train.max_steps": 4, "train.warmup_steps": 10, "train.eval_interval": 4}))
    out = capsys.readouterr().out
    assert "train.warmup_steps = 10 is not below train.max_steps = 4" in out, out
    assert "--train.warmup_steps=1" in out
