"""`python bench.py gpu` (benchmarks/gpu.py): it runs every part it can, records a part that fails
without stopping, names what it skipped and why, and reads each part's figures from the lines the
benchmarks really print."""
import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import bench
from benchmarks import gpu, sampling, step
from benchmarks.gpu_report import race_figures, sample_figures, train_figures
from benchmarks.race import race
from common import RunError
from tests.conftest import ROOT, tiny_overrides


def test_the_cuda_only_tests_are_those_marked_skipif_not_cuda_available(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(textwrap.dedent('''
        import pytest, torch
        cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        other = pytest.mark.skipif(True, reason="never")

        @cuda
        def test_through_a_name(): pass

        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        @pytest.mark.parametrize("a", [1, 2])
        def test_directly(a): pass

        @other
        def test_skipped_for_another_reason(): pass

        @pytest.mark.parametrize("device", ["cuda"])
        def test_naming_cuda_in_a_parameter(device): pass
        '''))
    assert gpu.cuda_only_tests(tests) == ["tests/test_x.py::test_through_a_name", "tests/test_x.py::test_directly"]
    found = gpu.cuda_only_tests()
    assert {"tests/test_step.py::test_on_cuda_the_graph_step_follows_the_eager_step",
            "tests/test_variants.py::test_the_compiled_decoding_step_on_cuda_is_recomputation"} <= set(found)
    assert "tests/test_step.py::test_what_keeps_the_step_eager_is_said" not in found


def test_on_a_gpu_every_part_runs_and_quick_leaves_out_only_the_race():
    full = {p.name: p for p in gpu.plan(True, False, None, [])}
    assert list(full) == ["tests", "train-classic", "train-124m", "sample", "race"]
    assert not any(p.skip for p in full.values())
    assert "--train.grad_accum=32" in full["train-124m"].argv
    assert not any("instead of the shape's" in note for note in full["train-124m"].notes)
    assert full["race"].argv[:5] == ["bench.py", "race", "--classic", "configs/shakespeare_char.toml", "--fast"]
    quick = {p.name: p for p in gpu.plan(True, True, 4, [])}
    assert [name for name, p in quick.items() if p.skip] == ["race"]
    assert "--train.grad_accum=4" in quick["train-124m"].argv
    assert "grad_accum 4 instead of the shape's 32" in quick["train-124m"].notes[-1], "says what MFU means then"


def test_without_a_gpu_it_runs_what_it_can_records_failures_and_names_what_it_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")             # the children see no GPU either
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real_plan = gpu.plan
    broken = gpu.Part("broken", "a child that fails", ["-c", "print('about to fail'); raise SystemExit(1)"], 60)
    stuck = gpu.Part("stuck", "a child that outlives its limit", ["-c", "import time; time.sleep(600)"], 1)
    monkeypatch.setattr(gpu, "plan", lambda *args: [broken, stuck, *real_plan(*args)])
    out = tmp_path / "report"
    assert bench.main(["gpu", "--quick", "--out", str(out), f"--data.prepared_dir={tmp_path / 'prepared'}"]) == 1
    report = (out / "report.md").read_text()
    ran = {"broken": "failed", "stuck": "timed out", "tests": "ok", "train-cpu-quick": "ok", "sample-cpu-quick": "ok"}
    for name, status in ran.items():
        assert re.search(rf"^\| {name} \| {status} \|", report, re.M), name
        assert (out / f"{name}.log").exists()
    assert "exit code 1; the last lines of broken.log" in report and "about to fail" in report
    for name in ("train-classic", "train-124m", "sample", "race"):
        assert re.search(rf"^- \*\*{name}\*\* \(`python bench.py .*`\): needs a CUDA GPU", report, re.M), name
    assert "No GPU figure was measured" in report
    assert re.search(r"pytest: \*\*\d+ skipped in", report), "every CUDA-only test ran, and skipped"
    assert "| trainer |" in report and "| plain |" in report and re.search(r"^\| 1 \| [\d.]+ \|", report, re.M)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert f"| PyTorch | {torch.__version__} |" in report
    assert f"| commit | {commit.stdout.strip() or 'unknown'}" in report


def test_a_report_is_never_overwritten(tmp_path):
    (tmp_path / "report.md").write_text("an earlier run's")
    with pytest.raises(RunError, match="already holds a report.md"):
        gpu.bench_gpu(["bench.py", "gpu"], out=str(tmp_path))
    assert (tmp_path / "report.md").read_text() == "an earlier run's"


def test_the_default_report_directory_is_one_git_ignores():
    path = gpu.default_out_dir("abc123")
    assert path.relative_to(ROOT).parts[:2] == ("out", "bench_gpu") and path.name.endswith("-abc123")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT)
    assert ignored.returncode in (0, 128), "0: ignored; 128: not a git checkout"


def test_the_train_figures_are_read_from_bench_train_rows_cuda_names_too(tmp_path, text_file, monkeypatch):
    monkeypatch.setattr(step, "matmul_peak", lambda device, dtype: {"torch.mm": 1e12})
    monkeypatch.setattr(step, "variants_for", lambda cfg, device: {"eager": (False, False),
                                                                   "compiled+graph": (False, True)})
    lines = []
    result = step.bench_train(None, tiny_overrides(tmp_path, text_file), steps=1, rounds=1, say=lines.append)
    figures = "\n".join(train_figures("\n".join(lines)))
    for name in ("eager", "compiled+graph", "plain"):
        assert f"| {name} | {result[name]['ms_per_step']:.2f} |" in figures
        assert f"| {result[name]['mfu']:.1%} |" in figures


def test_the_sample_figures_are_read_from_the_cuda_table(monkeypatch):
    """bench_sample_cuda's own lines, with the GPU's parts replaced: made-up rates, a CPU model."""
    rates = {(True, True): 1000.0, (True, False): 100.0, (False, False): 50.0}
    monkeypatch.setattr(sampling, "make_model", lambda device, real=sampling.make_model: real("cpu"))
    monkeypatch.setattr(sampling, "tokens_per_s", lambda model, n, use_cache, samples=1, compile=False:
                        rates[use_cache, compile] * samples)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    lines = []
    sampling.bench_sample_cuda(20, "cuda", say=lines.append)
    figures = sample_figures("\n".join(lines))
    assert any(line.startswith("| 1 | 1000 | 100 | 50 | 10.0x | 20.0x |") for line in figures)
    assert any(line.startswith("| 16 | 16000 | 1600 | 800 | 10.0x | 20.0x |") for line in figures)


def test_the_race_figure_is_the_ratio_race_prints(tmp_path, text_file):
    slow, fast = tmp_path / "slow.toml", tmp_path / "fast.toml"
    slow.write_text("[train]\nlr = 1e-4\nmin_lr = 1e-5\n")
    fast.write_text("[train]\nlr = 1e-2\nmin_lr = 1e-3\n")
    lines = []
    result = race(str(slow), str(fast), tiny_overrides(tmp_path, text_file, **{"train.max_steps": 20}), evals=4,
                  say=lines.append)
    head = race_figures("\n".join(lines))[0]
    assert ("never reached" in head) if math.isinf(result["ratio"]) else (f"**{result['ratio']:.3f}**" in head)


def test_a_part_is_stopped_without_process_groups_where_windows_has_none(monkeypatch):
    """Windows lacks os.killpg and SIGKILL: there the child itself is ended."""
    monkeypatch.setattr(gpu, "WINDOWS", True)
    monkeypatch.delattr(gpu.os, "killpg")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gpu.stop(proc)
    assert proc.returncode is not None
