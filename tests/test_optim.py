"""Optimizers and schedules: Muon's updates are orthogonal, the schedules have their shapes, every
parameter is optimized exactly once, and a run with Muon resumes exactly."""
import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from common import UserError
from training.optim import Muon, Optimizers, build_optimizer, lr_at, orthogonalize, set_lr
from tests.conftest import records, resumed_copy
from training.trainer import train


def singular_values(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(m.double())


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32)])
def test_newton_schulz_equalizes_the_singular_values(shape):
    gen = torch.Generator().manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=gen))
    g = u @ torch.diag(torch.logspace(0, 2, k)) @ v.T  # singular values from 1 to 100
    s_raw, s = singular_values(g), singular_values(orthogonalize(g))
    assert s_raw.max() / s_raw.min() > 50
    assert s.min() > 0.6 and s.max() < 1.25, s        # ~U Vᵀ: every direction moves about equally
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    cos = torch.nn.functional.cosine_similarity((u @ vh).flatten(), orthogonalize(g).double().flatten(), dim=0)
    assert cos > 0.95, "same singular vectors as the gradient"


def test_muon_step_is_an_orthogonal_matrix_times_the_lr():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 16))
    w.grad = torch.randn(48, 16)
    before = w.detach().clone()
    Muon([w], lr=0.1, momentum=0.0).step()
    update = (before - w.detach()) / (0.1 * (48 / 16) ** 0.5)
    s = singular_values(update)
    assert s.min() > 0.6 and s.max() < 1.25, s


def test_muon_batches_same_shaped_matrices_without_mixing_them():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
    a.grad, b.grad = torch.randn(8, 8), torch.randn(8, 8)
    a2, b2 = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    a2.grad, b2.grad = a.grad.clone(), b.grad.clone()
    Muon([a, b], lr=0.05).step()
    Muon([a2], lr=0.05).step()
    Muon([b2], lr=0.05).step()
    torch.testing.assert_close(a, a2, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, b2, atol=1e-5, rtol=0)


def test_wsd_warms_up_holds_then_decays_linearly_to_the_floor():
    def lr(step):
        return lr_at(step, lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, schedule="wsd", warmdown_frac=0.2)
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert all(lr(s) == 1.0 for s in range(10, 81))
    assert lr(90) == pytest.approx(0.55)
    assert lr(100) == pytest.approx(0.1)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 100))


def test_cosine_warms_up_then_decays_to_the_floor():
    def lr(step):
        return lr_at(step, lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr(9) == pytest.approx(1.0) and lr(60) == pytest.approx(0.55)
    assert lr(110) == pytest.approx(0.1)


def test_adamw_decays_the_matrices_only_and_holds_every_parameter_once():
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2))   # tied: one weight, two uses
    opt = build_optimizer(model, "adamw", torch.device("cpu"), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    held = [(p, g["weight_decay"]) for g in opt.param_groups for p in g["params"]]
    params = list(model.parameters())
    assert sorted(id(p) for p, _ in held) == sorted(id(p) for p in params)
    assert {p.ndim >= 2 for p in params} == {True, False}, "both kinds are there to tell apart"
    assert all(decay == (0.1 if p.ndim >= 2 else 0.0) for p, decay in held), "no decay on biases or gains"


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2, tie_embeddings=False))
    opt = build_optimizer(model, "muon", torch.device("cpu"), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1,
                          muon_lr=0.02)
    assert isinstance(opt, Optimizers)
    muon, adamw = opt.optimizers
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert in_muon.isdisjoint(in_adamw) and in_muon | in_adamw == {id(p) for p in model.parameters()}
    assert in_muon == {id(p) for p in model.blocks.parameters() if p.ndim == 2}
    assert id(model.tok_emb.weight) in in_adamw and id(model.lm_head.weight) in in_adamw
    set_lr(opt, 0.1)                                   # the end of a schedule to min_lr = lr / 10: every group's floor
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.1)
    assert all(g["lr"] == pytest.approx(1e-4) for g in adamw.param_groups)


def test_resume_with_muon_and_wsd_is_exact(tmp_path, tiny_cfg):
    extra = {"train.optimizer": "muon", "train.schedule": "wsd", "model.tie_embeddings": False}
    cfg = tiny_cfg(**extra, out_dir=tmp_path / "whole")
    train(cfg, quiet=True)
    resumed = resumed_copy(cfg, 10, tmp_path / "split")
    assert records(resumed) == pytest.approx(records(tmp_path / "whole"), abs=1e-6)
    assert records(resumed, "eval", "val_loss") == pytest.approx(records(tmp_path / "whole", "eval", "val_loss"))


def test_resume_with_another_optimizer_is_a_checkpoint_error(tmp_path, tiny_cfg):
    train(tiny_cfg(out_dir=tmp_path / "run", **{"train.max_steps": 5}), quiet=True)
    with pytest.raises(UserError, match="does not fit this run"):
        train(tiny_cfg(**{"train.optimizer": "muon"}, out_dir=tmp_path / "run"), quiet=True, resume=True)
