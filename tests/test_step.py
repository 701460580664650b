"""Every way of running the training step is the same step: the CUDA-graph step (run here without the
capture, on its static buffer and tensor learning rates) trains exactly as the eager one, resumes
exactly and stops at a non-finite step; its speed figures time finished work; a step's micro-batches
cast each weight once; a compile failure costs a warning line, not the run."""
import time

import pytest
import torch

import training.trainer as trainer
from common import UserError
from loading import read_checkpoint
from tests.conftest import ROOT, records, resumed_copy
from training.config import TrainConfig, build_config
from training.trainer import graph_blocker, train

EAGER = {"train.cuda_graph": False}


@pytest.fixture
def graph_on_cpu(monkeypatch):
    """Let the trainer choose the graph step on the CPU (where it runs without recording a graph); the
    list it yields holds each graph step built, so that a test can see that one ran."""
    import speed.cuda_graph
    built, real = [], speed.cuda_graph.graph_step

    def counted(*args, **kwargs):
        built.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(trainer, "graph_blocker", lambda *a: None)
    monkeypatch.setattr(speed.cuda_graph, "graph_step", counted)
    return built


def test_the_step_is_a_cuda_graph_by_default_wherever_one_can_hold_it(tiny_cfg, graph_on_cpu, capsys):
    assert TrainConfig().cuda_graph is True
    train(tiny_cfg(**{"train.max_steps": 2}), quiet=False)
    assert len(graph_on_cpu) == 1 and "| cpu x 1 thread, float32, CUDA graph |" in capsys.readouterr().out
    train(tiny_cfg(**EAGER, **{"train.max_steps": 2}, out_dir=tiny_cfg().out_dir + "-eager"), quiet=True)
    assert len(graph_on_cpu) == 1, "train.cuda_graph = false turns it off"


def test_the_gpu_configs_compile_only_where_it_pays_back():
    """Compiling took 33 s before the first step on an H100; the classic GPU config trains to its best val
    loss in less than that without it. GPT-2 small's long run pays it back."""
    assert build_config(str(ROOT / "configs/shakespeare_char.toml"), []).train.compile is False
    assert build_config(str(ROOT / "configs/gpt2_124m.toml"), []).train.compile is True


@pytest.mark.parametrize("extra", [
    {},
    {"model.dropout": 0.1, "train.grad_accum": 2},
    {"train.optimizer": "muon", "train.schedule": "wsd"},
], ids=["adamw", "dropout-accum", "muon"])
def test_the_graph_step_trains_exactly_as_the_eager_step(extra, tiny_cfg, tmp_path, graph_on_cpu):
    train(tiny_cfg(**extra, **EAGER, out_dir=tmp_path / "eager"), quiet=True)
    assert not graph_on_cpu
    train(tiny_cfg(**extra, out_dir=tmp_path / "graph"), quiet=True)
    assert len(graph_on_cpu) == 1
    assert list(records(tmp_path / "graph")) == list(range(1, 21))
    assert records(tmp_path / "graph") == pytest.approx(records(tmp_path / "eager"), abs=1e-6)
    assert records(tmp_path / "graph", "eval", "val_loss") == pytest.approx(records(tmp_path / "eager", "eval",
                                                                                    "val_loss"), abs=1e-6)


def test_the_graph_step_resumes_exactly_from_float_learning_rates(tiny_cfg, tmp_path, graph_on_cpu):
    """The graph step holds the lr in a device tensor; a checkpoint must not (it loads anywhere)."""
    cfg = tiny_cfg(**{"model.dropout": 0.1, "train.optimizer": "muon"}, out_dir=tmp_path / "whole")
    train(cfg, quiet=True)
    states = read_checkpoint(tmp_path / "whole" / "ckpt_0000010.pt")["optimizer"]["optimizers"]
    # Muon's and AdamW's
    assert len(states) == 2
    assert all(type(g["lr"]) is float for s in states for g in s["param_groups"])
    resumed = resumed_copy(cfg, 10, tmp_path / "split")
    assert records(resumed) == pytest.approx(records(tmp_path / "whole"), abs=1e-6)
    assert len(graph_on_cpu) == 2


def nan_weights_before(monkeypatch, step: int) -> None:
    """The norm gains and biases turn NaN in place before the given step (as a diverging update would
    leave them, at the addresses a graph reads)."""
    real, calls = trainer.set_lr, []

    def set_lr(optimizer, factor):
        calls.append(1)
        if len(calls) == step:
            with torch.no_grad():
                for p in optimizer.param_groups[-1]["params"]:
                    p.fill_(float("nan"))
        return real(optimizer, factor)
    monkeypatch.setattr(trainer, "set_lr", set_lr)


def test_a_non_finite_step_is_named_where_the_loop_reads_the_loss(tiny_cfg, graph_on_cpu,
                                                                  monkeypatch):
    """NaN weights at step 6, where the graph step reads them, make its loss NaN; the loop reads it
    at its next log line, step 8, and stops there naming the steps between, with no checkpoint
    holding the damage. (The eager step: tests/test_promise_numerical_faults.py.)"""
    nan_weights_before(monkeypatch, 6)
    cfg = tiny_cfg(**{"train.log_interval": 4})
    with pytest.raises(UserError, match="the loss became nan between steps 4 and 8; stopped, no "
                                        "checkpoint was written"):
        train(cfg, quiet=True)
    assert len(graph_on_cpu) == 1


def test_the_log_line_times_finished_steps(tiny_cfg, monkeypatch):
    """A stand-in for an asynchronous device: its work is queued, and done only when a value is read
    (here: reading the loss waits 0.2 s). ms/step must count that wait, as a GPU's would."""
    real_item = torch.Tensor.item

    def item_of_a_busy_device(self):
        if self.dim() == 0 and self.dtype == torch.float32 and self.requires_grad is False:
            time.sleep(0.2)
        return real_item(self)
    cfg = tiny_cfg(**{"train.log_interval": 4, "train.max_steps": 8, **EAGER})
    monkeypatch.setattr(torch.Tensor, "item", item_of_a_busy_device)
    train(cfg, quiet=True)
    timed = records(cfg.out_dir, key="ms_per_step")
    assert len(timed) == 2 and all(ms >= 200 / 4 for ms in timed.values()), timed


def weight_casts_per_step(accum: int) -> int:
    """Casts (aten::_to_copy) of tensors shaped as the model's weights in one bf16 train_step of grad_accum
    `accum`: what autocast makes of the weights, told apart from the activations by shape."""
    from torch.profiler import ProfilerActivity, profile

    from model.config import ModelConfig
    from model.gpt import GPT
    model = GPT(ModelConfig(vocab_size=48, n_layer=2, n_head=2, n_embd=32, block_size=32))
    optimizer, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)
    windows = torch.randint(0, 48, (accum, 4, 33))
    low = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
    # (allocations)
    trainer.train_step(model, optimizer, scaler, low(), 1.0, None, windows)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.train_step(model, optimizer, scaler, low(), 1.0, None, windows)
    shapes = {str([list(p.shape)]) for p in model.parameters() if p.dim() == 2}
    return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
               if e.key == "aten::_to_copy" and str(e.input_shapes[:1]) in shapes)


def test_a_steps_micro_batches_cast_each_weight_once():
    """A step's micro-batches run in one autocast region: each weight, which does not change within a
    step, is cast to bf16 once per step; only its gradient's cast back to fp32 comes with every micro-batch.
    (Casting per micro-batch, one step would be 2 casts per weight and each micro-batch would add 2 more.)"""
    one, four = weight_casts_per_step(1), weight_casts_per_step(4)
    per_micro = (four - one) / 3                  # what each micro-batch adds: its gradients' casts
    assert one - per_micro == per_micro >= 2 * 6 + 1, (one, four)   # once per step: as many, the weights'


@pytest.mark.parametrize("device, world, dtype, reason", [
    ("cpu", 1, torch.bfloat16, "graphs are CUDA's"), ("cuda", 2, torch.bfloat16, "several processes"),
    ("cuda", 1, torch.float16, "fp16's loss scaling")])
def test_what_keeps_the_step_eager_is_said(device, world, dtype, reason):
    assert reason in graph_blocker(trainer.Place(torch.device(device), dtype, world=world))
    assert graph_blocker(trainer.Place(torch.device("cuda"), torch.bfloat16)) is None


def test_a_compiling_run_says_so_before_it_waits_and_a_failure_falls_back_to_eager(tiny_cfg, monkeypatch, capsys):
    class Broken(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("C++ compiler not found\nlong details")
    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    summary = train(tiny_cfg(**{"train.compile": True, "train.max_steps": 4}))
    out, err = capsys.readouterr()
    assert summary["step"] == 4 and out.index("# compiling the model: about a minute") < out.index("step      1")
    assert err.splitlines() == ["warning: torch.compile failed, training without it (RuntimeError: C++ compiler "
                                "not found)"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and bf16 autocast need a CUDA GPU")


@cuda
@pytest.mark.parametrize("compile", [False, True], ids=["eager-model", "compiled-model"])
def test_on_cuda_the_graph_step_follows_the_eager_step(tiny_cfg, tmp_path, compile):
    """bf16 on a GPU: the graph replays the same kernels, so the losses agree to bf16 rounding."""
    cfg = {"train.device": "cuda", "train.compile": compile, "train.max_steps": 30, "model.dropout": 0.0}
    train(tiny_cfg(**cfg, **EAGER, out_dir=tmp_path / "eager"), quiet=True)
    assert "CUDA graph" in train(tiny_cfg(**cfg, out_dir=tmp_path / "graph"), quiet=True)["how"]
    eager, graph = records(tmp_path / "eager"), records(tmp_path / "graph")
    assert list(graph) == list(range(1, 31))
    for step in (1, 10, 30):
        assert graph[step] == pytest.approx(eager[step], abs=2e-2), step
    assert graph[30] < graph[1] - 0.3, "it learns"


@cuda
def test_on_cuda_a_non_finite_step_under_a_recorded_graph_is_named(tiny_cfg, monkeypatch):
    nan_weights_before(monkeypatch, 6)
    with pytest.raises(UserError, match="the loss became nan between steps 4 and 8"):
        train(tiny_cfg(**{"train.device": "cuda", "train.log_interval": 4}), quiet=True)


@cuda
def test_on_cuda_the_default_device_is_the_gpu_with_bf16():
    from model.device import pick_device, pick_dtype
    device = pick_device("auto")
    assert device.type == "cuda" and pick_dtype(device) in (torch.bfloat16, torch.float16)


def test_the_graph_step_fed_from_memory_mapped_files_trains_as_the_one_that_draws_on_the_device(
        tiny_cfg, tmp_path, graph_on_cpu, monkeypatch):
    """A dataset too large for the device stays memory-mapped: the graph replays on a buffer
    refilled before each step from the files, and trains exactly as the one whose windows are drawn
    on the device."""
    import data.loader
    train(tiny_cfg(out_dir=tmp_path / "resident"), quiet=True)
    monkeypatch.setattr(data.loader, "free_memory", lambda device: 0)
    train(tiny_cfg(out_dir=tmp_path / "mapped"), quiet=True)
    assert len(graph_on_cpu) == 2
    assert records(tmp_path / "mapped") == records(tmp_path / "resident")
    assert records(tmp_path / "mapped", "eval", "val_loss") == records(tmp_path / "resident", "eval", "val_loss")


@cuda
def test_on_cuda_a_graph_fed_from_the_gpu_s_own_draws_resumes_where_it_stopped(tiny_cfg, tmp_path):
    """The windows are drawn on the GPU by a generator there; its state in the checkpoint
    resumes the same batches (bf16 and the GPU's atomic adds: the same losses to well under a batch's noise)."""
    cfg = tiny_cfg(**{"train.device": "cuda", "model.dropout": 0.1}, out_dir=tmp_path / "whole")
    assert "CUDA graph" in train(cfg, quiet=True)["how"]
    resumed = resumed_copy(cfg, 10, tmp_path / "resumed")
    whole = records(tmp_path / "whole")
    assert records(resumed) == pytest.approx(whole, abs=5e-3)
    assert max(abs(whole[s] - whole[s + 1]) for s in range(11, 20)) > 2e-2, "a batch's noise is larger"
