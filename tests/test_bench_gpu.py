"""`python bench.py gpu` (benchmarks/gpu.py) as a user meets it: without a GPU it says so in its report
and runs nothing; with one, every part runs as a child with its log, a part that fails or runs past its
limit is recorded and the next one runs, and report.md gives each part's status, time and the end of
its log (its figures). A report is never overwritten."""
import re
import subprocess
import sys

import pytest
import torch

import bench
from benchmarks import gpu
from common import UserError
from tests.conftest import ROOT


def test_without_a_gpu_it_says_so_runs_nothing_and_names_what_would_have_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report"
    assert bench.main(["gpu", "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "no CUDA GPU here" in said and str(out / "report.md") in said
    report = (out / "report.md").read_text()
    assert "**No GPU figure was measured**" in report and sorted(p.name for p in out.iterdir()) == ["report.md"]
    for name in ("tests", "train-classic", "train-124m", "sample", "race"):
        assert re.search(rf"^\| {name} \| not run \|  \| `python .+` \|$", report, re.M), name
    assert "| `python bench.py train configs/gpt2_124m.toml --steps 1 --rounds 3` |" in report
    assert f"| PyTorch | {torch.__version__}," in report
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert f"| commit | {commit.stdout.strip() or 'unknown'}" in report


def test_every_part_runs_with_its_log_and_a_failure_or_a_time_out_does_not_stop_the_next(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu, "parts", lambda quick, overrides: [
        ("broken", ["-c", "print('about to fail'); raise SystemExit(3)"], 60),
        ("stuck", ["-c", "import time; print('waiting', flush=True); time.sleep(600)"], 1),
        ("fine", ["-c", "print('\\n'.join(f'line {i}' for i in range(30))); print('plain  1.23 ms/step')"], 60)])
    out = tmp_path / "report"
    assert bench.main(["gpu", "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "about to fail" in said and "plain  1.23 ms/step" in said, "each part's output is shown as it comes"
    report = (out / "report.md").read_text()
    for name, status in (("broken", "failed"), ("stuck", "timed out"), ("fine", "ok")):
        assert re.search(rf"^\| {name} \| {status} \| \d+ s \|", report, re.M), name
        assert re.search(rf"^## {name}: {status}$", report, re.M), name
    assert "exit code 3" in report and "about to fail" in report and "waiting" in report
    fine = report[report.index("## fine"):]
    assert "plain  1.23 ms/step" in fine and "line 16" in fine and "line 15" not in fine, "the last lines of its log"
    assert (out / "fine.log").read_text().count("line ") == 30, "the whole log is kept"
    assert "(broken, stuck did not pass)" in said


def test_a_report_is_never_overwritten(tmp_path):
    (tmp_path / "report.md").write_text("an earlier run's")
    with pytest.raises(UserError, match="already holds a report.md"):
        gpu.bench_gpu(["bench.py", "gpu"], out=str(tmp_path))
    assert (tmp_path / "report.md").read_text() == "an earlier run's"


def test_every_part_is_a_command_bench_py_takes():
    """A part is a bench.py command (or pytest): a renamed option would fail only on a GPU machine."""
    for quick in (False, True):
        for name, argv, limit in gpu.parts(quick, ["--train.dtype=bfloat16"]):
            if argv[0] == "bench.py":
                args, overrides = bench.parser().parse_known_args(argv[1:])
                assert overrides == ([] if args.command not in bench.TAKE_OVERRIDES else ["--train.dtype=bfloat16"])


def test_a_part_is_stopped_without_process_groups_where_windows_has_none(monkeypatch):
    """Windows lacks os.killpg and SIGKILL: there the child itself is ended."""
    monkeypatch.setattr(gpu, "WINDOWS", True)
    monkeypatch.delattr(gpu.os, "killpg")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gpu.stop(proc)
    assert proc.wait(timeout=10) is not None
