"""Every way of running the training step is the same step: the CUDA-graph step (run here without the
capture, on its static buffer, tensor learning rates and device-side records) trains exactly as the eager
one, resumes exactly and stops at a non-finite step; its speed figures time finished work; a step's
micro-batches cast each weight once; a compile failure costs a warning line, not the run."""
import time
from types import SimpleNamespace

import pytest
import torch

import training.trainer as trainer
from common import UserError
from training.config import TrainConfig, build_config
from training.trainer import graph_blockers, train
from tests.conftest import ROOT

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
    monkeypatch.setattr(trainer, "graph_blockers", lambda *a: [])
    monkeypatch.setattr(speed.cuda_graph, "graph_step", counted)
    return built


def test_the_step_is_a_cuda_graph_by_default_wherever_one_can_hold_it(tiny_cfg, graph_on_cpu, capsys):
    assert TrainConfig().cuda_graph is True
    train(tiny_cfg(**{"train.max_steps": 2}), quiet=False)
    assert len(graph_on_cpu) == 1 and "| cpu, float32, CUDA graph |" in capsys.readouterr().out
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
    eager = train(tiny_cfg(**extra, **EAGER, out_dir=tmp_path / "eager"), quiet=True)
    assert not graph_on_cpu
    graph = train(tiny_cfg(**extra, out_dir=tmp_path / "graph"), quiet=True)
    assert len(graph_on_cpu) == 1
    assert sorted(graph["losses"]) == list(range(1, 21))
    for step, loss in eager["losses"].items():
        assert graph["losses"][step] == pytest.approx(loss, abs=1e-6), step
    assert graph["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-6)


def test_the_graph_step_resumes_exactly(tiny_cfg, tmp_path, graph_on_cpu):
    extra = {"model.dropout": 0.1}
    whole = train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    train(tiny_cfg(**extra, out_dir=tmp_path / "split"), quiet=True, stop_at=7)
    rest = train(tiny_cfg(**extra, out_dir=tmp_path / "split"), quiet=True, resume=True)
    for step in range(8, 21):
        assert rest["losses"][step] == pytest.approx(whole["losses"][step], abs=1e-6), step
    assert len(graph_on_cpu) == 3


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_a_non_finite_step_is_named_from_the_device_side_record(graph, tiny_cfg, graph_on_cpu):
    """A weight turned NaN in place after step 5 (as a diverging update would leave it, at the address a
    graph reads) makes step 6's loss NaN; the record on the device names step 6 when the loop reads it at
    its next log line, step 8, and no checkpoint holds the damage."""
    def poison_after_5(step, model):
        if step == 5:
            with torch.no_grad():
                model.norm_f.weight[0] = float("nan")
    cfg = tiny_cfg(**{"train.log_interval": 4, **({} if graph else EAGER)})
    with pytest.raises(UserError, match="non-finite loss at step 6; stopped, no checkpoint had been written yet"):
        train(cfg, quiet=True, on_step=poison_after_5)
    assert len(graph_on_cpu) == graph


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
    records = [r for r in trainer.read_records(f"{cfg.out_dir}/metrics.jsonl") if r["kind"] == "train"]
    assert len(records) == 2 and all(r["ms_per_step"] >= 200 / 4 for r in records), records


def weight_casts_per_step(tiny_cfg, accum: int) -> int:
    """Casts (aten::_to_copy) of tensors shaped as the model's weights in one bf16 training step of
    grad_accum `accum`: what autocast makes of the weights, told apart from the activations by shape."""
    from torch.profiler import ProfilerActivity, profile
    counted = []

    def profiled(step, model):
        if step == 2:
            counted.append(profile(activities=[ProfilerActivity.CPU], record_shapes=True).__enter__())
        elif step == 3:
            counted[0].__exit__(None, None, None)
            shapes = {str([list(p.shape)]) for p in model.parameters() if p.dim() == 2}
            counted[0] = sum(e.count for e in counted[0].key_averages(group_by_input_shape=True)
                             if e.key == "aten::_to_copy" and str(e.input_shapes[:1]) in shapes)
    train(tiny_cfg(**{"train.dtype": "bfloat16", "train.grad_accum": accum, "train.max_steps": 4, **EAGER},
                   out_dir=f"{tiny_cfg().out_dir}-{accum}"), quiet=True, on_step=profiled)
    return counted[0]


def test_a_steps_micro_batches_cast_each_weight_once(tiny_cfg):
    """A step's micro-batches run in one autocast region: each weight, which does not change within a
    step, is cast to bf16 once per step; only its gradient's cast back to fp32 comes with every micro-batch.
    (Casting per micro-batch, one_step would be 2 casts per weight and each micro-batch would add 2 more.)"""
    one, four = weight_casts_per_step(tiny_cfg, 1), weight_casts_per_step(tiny_cfg, 4)
    per_micro = (four - one) / 3                  # what each micro-batch adds: its gradients' casts
    assert one - per_micro == per_micro >= 2 * 6 + 1, (one, four)   # once per step: as many, the weights'


@pytest.mark.parametrize("kw, reason", [
    ({"device": "cpu"}, "CUDA only"), ({"world": 2}, "several processes"),
    ({"dtype": torch.float16}, "fp16 loss scaling"), ({"on_nonfinite": "skip"}, "on_nonfinite = skip"),
])
def test_what_keeps_the_step_eager_is_said(kw, reason):
    t = SimpleNamespace(on_nonfinite=kw.get("on_nonfinite", "stop"))
    reasons = graph_blockers(t, torch.device(kw.get("device", "cuda")), kw.get("world", 1),
                             kw.get("dtype", torch.bfloat16))
    assert len(reasons) == 1 and reason in reasons[0]
    assert graph_blockers(SimpleNamespace(on_nonfinite="stop"), torch.device("cuda"), 1, torch.bfloat16) == []


def test_a_compiling_run_says_so_before_it_waits_and_a_failure_falls_back_to_eager(tiny_cfg, monkeypatch, capsys):
    class Broken(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("C++ compiler not found\nlong details")
    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    summary = train(tiny_cfg(**{"train.compile": True, "train.max_steps": 4}))
    out, err = capsys.readouterr()
    assert summary["step"] == 4 and out.index("# compiling the model: about half a minute") < out.index("step      1")
    lines = [line for line in err.splitlines() if not line.startswith("note: other work keeps")]   # a busy machine
    assert lines == ["warning: torch.compile failed, training without it (RuntimeError: C++ compiler not found)"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and bf16 autocast need a CUDA GPU")


@cuda
@pytest.mark.parametrize("compile", [False, True], ids=["eager-model", "compiled-model"])
def test_on_cuda_the_graph_step_follows_the_eager_step(tiny_cfg, tmp_path, compile):
    """bf16 on a GPU: the graph replays the same kernels, so the losses agree to bf16 rounding."""
    cfg = {"train.device": "cuda", "train.compile": compile, "train.max_steps": 30, "model.dropout": 0.0}
    eager = train(tiny_cfg(**cfg, **EAGER, out_dir=tmp_path / "eager"), quiet=True)
    graph = train(tiny_cfg(**cfg, out_dir=tmp_path / "graph"), quiet=True)
    assert sorted(graph["losses"]) == list(range(1, 31))
    for step in (1, 10, 30):
        assert graph["losses"][step] == pytest.approx(eager["losses"][step], abs=2e-2), step
    assert graph["losses"][30] < graph["losses"][1] - 0.3, "it learns"


@cuda
def test_on_cuda_a_non_finite_step_under_a_recorded_graph_is_named(tiny_cfg):
    def poison_after_5(step, model):
        if step == 5:
            with torch.no_grad():
                model.norm_f.weight[0] = float("nan")
    with pytest.raises(UserError, match="non-finite loss at step 6"):
        train(tiny_cfg(**{"train.device": "cuda", "train.log_interval": 4}), quiet=True, on_step=poison_after_5)


@cuda
def test_on_cuda_the_default_device_is_the_gpu_with_bf16():
    from training.device import pick_device, pick_dtype
    device = pick_device("auto")
    assert device.type == "cuda" and pick_dtype(device) in (torch.bfloat16, torch.float16)


def test_a_graph_run_checkpoints_float_learning_rates_and_resumes_eagerly(tiny_cfg, graph_on_cpu, monkeypatch):
    """The graph step holds the lr in a device tensor; a checkpoint must not (it loads anywhere)."""
    from training.checkpoint import load_checkpoint
    cfg = tiny_cfg(**{"train.optimizer": "muon"})
    train(cfg, quiet=True, stop_at=10)
    states = load_checkpoint(f"{cfg.out_dir}/ckpt_0000010.pt")["optimizer"]["optimizers"]
    assert len(states) == 2 and all(type(g["lr"]) is float for s in states for g in s["param_groups"])   # Muon, AdamW
    monkeypatch.undo()
    assert train(cfg, quiet=True, resume=True)["step"] == 20
