"""Optimizers and schedules: AdamW steps as torch.optim.AdamW does, and Muon as its definition
does (orthogonalized updates, each matrix alone); the schedules have their shapes, every parameter
is optimized exactly once, and a run saved by torch.optim.AdamW resumes exactly. (A run with Muon
resumes exactly: test_promise_exact_resume.py.)"""
import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from common import UserError
import training.trainer
from loading import read_checkpoint
from training.optim import AdamW, Muon, Optimizers, build_optimizer, lr_at, orthogonalize, set_lr
from tests.conftest import records, resumed_copy
from training.config import TrainConfig
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


def random_steps(params: list, steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Gradients for `steps` steps of params, the same for every caller of the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


def twins(shapes, seed: int = 0) -> tuple[list, list]:
    """Two lists of the same random parameters, apart."""
    first = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(seed + i)))
             for i, s in enumerate(shapes)]
    return first, [torch.nn.Parameter(p.detach().clone()) for p in first]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_adamw_steps_as_torch_optim_adamw_does(fused):
    """The same weights, gradients and schedule through this AdamW and torch.optim.AdamW, with and
    without weight decay: the same parameters, the same state, and the same state_dict."""
    ours_params, torch_params = twins([(8, 4), (4,), (3, 5), (5,)])
    def groups(p):
        return [{"params": p[0::2], "weight_decay": 0.1, "base_lr": 0.01},
                {"params": p[1::2], "weight_decay": 0.0, "base_lr": 0.01}]
    ours = AdamW(groups(ours_params), lr=0.01, betas=(0.9, 0.95), fused=fused)
    theirs = torch.optim.AdamW(groups(torch_params), lr=0.01, betas=(0.9, 0.95), fused=fused,
                               foreach=not fused)
    for step, grads in enumerate(random_steps(ours_params, 5)):
        for opt, params in ((ours, ours_params), (theirs, torch_params)):
            # a warmup: the lr changes every step
            set_lr(opt, (step + 1) / 5)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(ours_params, torch_params):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-7)
    assert all(p.grad is None for p in ours_params)
    mine, want = ours.state_dict(), theirs.state_dict()
    def indices(state_dict):
        return [g["params"] for g in state_dict["param_groups"]]
    assert indices(mine) == indices(want)
    assert mine["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert mine["state"][i].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(mine["state"][i][key], value, rtol=1.3e-6, atol=1e-7,
                                       check_device=False)


def test_fp16_loss_scaling_unscales_for_adamw_and_skips_a_step_with_an_inf_gradient():
    """torch's GradScaler drives this AdamW as it drives torch.optim's: a scaled gradient is
    unscaled before the step, and a step with an inf in it is skipped (and the scale lowered)."""
    (scaled,), (plain,) = twins([(4, 3)])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ours, reference = AdamW([scaled], lr=0.1), AdamW([plain], lr=0.1)
    # the same gradient g, the one scaled by 1024
    g = torch.randn(4, 3)
    scaler.scale((scaled * g).sum()).backward()
    (plain * g).sum().backward()
    scaler.step(ours)
    scaler.update()
    reference.step()
    torch.testing.assert_close(scaled, plain, rtol=1.3e-6, atol=1e-7)
    before = scaled.detach().clone()
    ours.zero_grad()
    scaler.scale((scaled * float("inf")).sum()).backward()
    scaler.step(ours)
    scaler.update()
    assert torch.equal(scaled, before) and scaler.get_scale() < 1024.0


def test_muon_steps_as_its_definition_does():
    """Muon, which updates same-shaped matrices as one batch (a tall one transposed among the
    wide), gives the parameters of its definition applied to each matrix alone, Nesterov and all."""
    shapes = [(8, 8), (16, 8), (8, 16), (8, 8), (4, 12)]
    ours_params, ref_params = twins(shapes)
    grads = random_steps(ours_params, 3)
    muon = Muon(ours_params, lr=0.05, momentum=0.9)
    for step_grads in grads:
        for p, g in zip(ours_params, step_grads):
            p.grad = g.clone()
        muon.step()
    momenta = [torch.zeros(s) for s in shapes]
    with torch.no_grad():
        for step_grads in grads:
            # M <- momentum M + G; the update G + momentum M (Nesterov), orthogonalized
            for w, g, m in zip(ref_params, step_grads, momenta):
                m.mul_(0.9).add_(g)
                update = g + 0.9 * m
                tall = w.size(0) > w.size(1)
                o = orthogonalize(update.mT).mT if tall else orthogonalize(update)
                w -= 0.05 * max(1.0, w.size(0) / w.size(1)) ** 0.5 * o
    for a, b, m in zip(ours_params, ref_params, momenta):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(muon.state[a]["momentum"], m, rtol=1.3e-6, atol=1e-7)


def schedule(**settings) -> TrainConfig:
    return TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, **settings)


def test_wsd_warms_up_holds_then_decays_linearly_to_the_floor():
    def lr(step):
        return lr_at(step, schedule(max_steps=100, schedule="wsd", warmdown_frac=0.2))
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert all(lr(s) == 1.0 for s in range(10, 81))
    assert lr(90) == pytest.approx(0.55)
    assert lr(100) == pytest.approx(0.1)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 100))


def test_cosine_warms_up_then_decays_to_the_floor():
    def lr(step):
        return lr_at(step, schedule(max_steps=110))
    assert lr(9) == pytest.approx(1.0) and lr(60) == pytest.approx(0.55)
    assert lr(110) == pytest.approx(0.1)


def test_train_lr_0_freezes_adamw_s_groups_and_leaves_muon_its_own_lr():
    """The schedule is one multiplier of each group's base lr: AdamW's lr does not set Muon's."""
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2))
    t = TrainConfig(optimizer="muon", lr=0.0, min_lr=0.0, muon_lr=0.02, warmup_steps=10, max_steps=110)
    opt = build_optimizer(model, t, torch.device("cpu"))
    set_lr(opt, lr_at(50, t))
    muon, adamw = opt.optimizers
    assert muon.param_groups[0]["lr"] > 0.01 and all(g["lr"] == 0 for g in adamw.param_groups)


def test_adamw_decays_the_matrices_only_and_holds_every_parameter_once():
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2))   # tied: one weight, two uses
    opt = build_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1), torch.device("cpu"))
    held = [(p, g["weight_decay"]) for g in opt.param_groups for p in g["params"]]
    params = list(model.parameters())
    assert sorted(id(p) for p, _ in held) == sorted(id(p) for p in params)
    assert {p.ndim >= 2 for p in params} == {True, False}, "both kinds are there to tell apart"
    assert all(decay == (0.1 if p.ndim >= 2 else 0.0) for p, decay in held), "no decay on biases or gains"


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2, tie_embeddings=False))
    t = TrainConfig(optimizer="muon", lr=1e-3, weight_decay=0.1, muon_lr=0.02)
    opt = build_optimizer(model, t, torch.device("cpu"))
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


def test_resume_with_another_optimizer_is_a_checkpoint_error(tmp_path, tiny_cfg):
    train(tiny_cfg(out_dir=tmp_path / "run", **{"train.max_steps": 5}), quiet=True)
    with pytest.raises(UserError, match="does not fit this run"):
        train(tiny_cfg(**{"train.optimizer": "muon"}, out_dir=tmp_path / "run"), quiet=True, resume=True)


def test_a_run_saved_by_torch_optim_adamw_resumes_as_the_run_that_never_stopped(tmp_path, tiny_cfg,
                                                                                monkeypatch):
    """A checkpoint from before this project's own AdamW (torch.optim.AdamW's state_dict, with
    its every option) resumes with this AdamW: the later losses are those of the run that went on
    with torch's."""
    def torch_adamw(model, t, device):
        groups = build_optimizer(model, t, device).param_groups
        return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
    cfg = tiny_cfg(out_dir=tmp_path / "whole")
    with monkeypatch.context() as patched:
        patched.setattr(training.trainer, "build_optimizer", torch_adamw)
        train(cfg, quiet=True)
    saved = read_checkpoint(tmp_path / "whole" / "ckpt_0000010.pt")["optimizer"]
    assert {"amsgrad", "fused", "capturable"} <= saved["param_groups"][0].keys(), "torch's format"
    resumed, whole = resumed_copy(cfg, 10, tmp_path / "split"), tmp_path / "whole"
    assert records(resumed) == pytest.approx(records(whole), abs=1e-6)
    assert records(resumed, "eval", "val_loss") == pytest.approx(records(whole, "eval", "val_loss"))
