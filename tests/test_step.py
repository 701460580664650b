"""Every way of running the training step is the same step: the CUDA-graph step (run here without
the capture, on its static buffers and tensor learning rate) trains exactly as the eager one, resumes
exactly, and a compile failure costs a warning line, not the run."""
import pytest
import torch

import training.run as run_module
from training.runtime import pick_device
from training.step import graph_blockers
from training.trainer import train


GRAPH = {"train.cuda_graph": True}


@pytest.fixture
def graph_on_cpu(monkeypatch):
    """Let the trainer choose the graph step on the CPU (where it runs without recording a graph);
    the list it yields holds each graph step built, so a test can see that one ran."""
    import speed.cuda_graph
    built, real = [], speed.cuda_graph.GraphStep.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        built.append(self)
    monkeypatch.setattr(run_module, "graph_blockers", lambda *a: [])
    monkeypatch.setattr(speed.cuda_graph.GraphStep, "__init__", init)
    return built


@pytest.mark.parametrize("extra", [
    {},
    {"model.dropout": 0.1, "train.grad_accum": 2},
    {"train.optimizer": "muon", "train.schedule": "wsd"},
], ids=["adamw", "dropout-accum", "muon"])
def test_the_graph_step_trains_exactly_as_the_eager_step(extra, tiny_cfg, tmp_path, graph_on_cpu):
    eager = train(tiny_cfg(**extra, out_dir=tmp_path / "eager"), quiet=True)
    assert not graph_on_cpu, "the step is eager by default"
    graph = train(tiny_cfg(**extra, **GRAPH, out_dir=tmp_path / "graph"), quiet=True)
    assert len(graph_on_cpu) == 1
    assert sorted(graph["losses"]) == list(range(1, 21))
    for step, loss in eager["losses"].items():
        assert graph["losses"][step] == pytest.approx(loss, abs=1e-6), step
    assert graph["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-6)


def test_the_graph_step_resumes_exactly(tiny_cfg, tmp_path, graph_on_cpu):
    extra = {"model.dropout": 0.1, **GRAPH}
    whole = train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    train(tiny_cfg(**extra, out_dir=tmp_path / "split"), quiet=True, stop_at=7)
    rest = train(tiny_cfg(**extra, out_dir=tmp_path / "split"), quiet=True, resume=True)
    for step in range(8, 21):
        assert rest["losses"][step] == pytest.approx(whole["losses"][step], abs=1e-6), step
    assert len(graph_on_cpu) == 3


def test_the_graph_step_records_the_first_non_finite_step(tiny_cfg, graph_on_cpu, monkeypatch):
    from common import RunError
    real = torch.nn.functional.cross_entropy
    calls = []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) == 3 + 6 else loss   # 3 warm-up steps, then step 6
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", poisoned)
    with pytest.raises(RunError, match="non-finite loss at step 6; stopped, no checkpoint had been written yet"):
        train(tiny_cfg(**GRAPH), quiet=True)
    assert len(graph_on_cpu) == 1


@pytest.mark.parametrize("kw, reason", [
    ({"device": "cpu"}, "CUDA only"), ({"world": 2}, "several processes"),
    ({"dtype": torch.float16}, "fp16 loss scaling"), ({"on_nonfinite": "skip"}, "on_nonfinite = skip"),
])
def test_what_keeps_the_step_eager_is_said(tiny_cfg, kw, reason):
    on_nonfinite = kw.get("on_nonfinite", "stop")
    reasons = graph_blockers(on_nonfinite, torch.device(kw.get("device", "cuda")), kw.get("world", 1),
                             kw.get("dtype", torch.bfloat16))
    assert len(reasons) == 1 and reason in reasons[0]
    assert graph_blockers("stop", torch.device("cuda"), 1, torch.bfloat16) == []


def test_a_compile_failure_falls_back_to_eager_with_a_one_line_warning(tiny_cfg, monkeypatch, capsys):
    class Broken(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("C++ compiler not found\nlong details")
    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    summary = train(tiny_cfg(**{"train.compile": True}), quiet=True)
    assert summary["step"] == 20
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: torch.compile failed, training without it (RuntimeError: C++ compiler not found)"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and bf16 autocast need a CUDA GPU")


@cuda
@pytest.mark.parametrize("compile", [False, True], ids=["eager-model", "compiled-model"])
def test_on_cuda_the_graph_step_follows_the_eager_step(tiny_cfg, tmp_path, monkeypatch, compile):
    """bf16 on a GPU: the graph replays the same kernels, so the losses agree to bf16 rounding."""
    cfg = dict(**{"train.device": "cuda", "train.compile": compile, "train.max_steps": 30, "model.dropout": 0.0})
    eager = train(tiny_cfg(**cfg, **{"train.cuda_graph": False}, out_dir=tmp_path / "eager"), quiet=True)
    graph = train(tiny_cfg(**cfg, **GRAPH, out_dir=tmp_path / "graph"), quiet=True)
    assert sorted(graph["losses"]) == list(range(1, 31))
    for step in (1, 10, 30):
        assert graph["losses"][step] == pytest.approx(eager["losses"][step], abs=2e-2), step
    assert graph["losses"][30] < graph["losses"][1] - 0.5, "it learns"


@cuda
def test_on_cuda_the_default_device_is_the_gpu_with_bf16():
    from training.runtime import pick_dtype
    device = pick_device("auto")
    assert device.type == "cuda" and pick_dtype(device) in (torch.bfloat16, torch.float16)


def test_a_graph_run_checkpoints_float_learning_rates_and_resumes_eagerly(tiny_cfg, tmp_path, monkeypatch):
    """The graph step holds the lr in a device tensor; a checkpoint must not (it loads anywhere)."""
    from training.checkpoint import load_checkpoint
    monkeypatch.setattr(run_module, "graph_blockers", lambda *a: [])
    cfg = tiny_cfg(**{"train.optimizer": "muon", **GRAPH})
    train(cfg, quiet=True, stop_at=10)
    states = load_checkpoint(f"{cfg.out_dir}/ckpt_0000010.pt")["optimizer"]["optimizers"]
    assert len(states) == 2 and all(type(g["lr"]) is float for s in states for g in s["param_groups"])   # Muon, AdamW
    monkeypatch.undo()
    assert train(cfg, quiet=True, resume=True)["step"] == 20
