"""Apple's GPU (MPS), simulated: nothing of this project is tested or measured there, so it is used only
when named (and says so), in float32 unless bfloat16 is asked for and supported, without torch.compile,
and its random generator is saved with every checkpoint, so that dropout continues exactly on resume."""
import pytest
import torch

from common import UserError
from training import device as runtime
from training.device import pick_device, pick_dtype

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread
MPS = torch.device("mps")


@pytest.fixture
def a_mac(monkeypatch):
    """A Mac with MPS and no CUDA, whose MPS generator is a counter; notes said afresh."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    generator = {"state": torch.arange(8, dtype=torch.uint8), "set": []}

    def get_rng_state(device="mps"):
        generator["state"] = generator["state"] + 1   # every call finds it moved on, as draws would move it
        return generator["state"].clone()
    monkeypatch.setattr(torch.mps, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device="mps": generator["set"].append(state))
    return generator


def test_auto_picks_cuda_or_the_cpu_never_mps_and_mps_when_named_says_it_is_untested(a_mac, capsys):
    assert pick_device("auto") == torch.device("cpu")
    assert capsys.readouterr().err == ""
    assert pick_device("mps") == MPS and pick_device("mps", setting="--device") == MPS
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 2 and all(n.startswith("note: MPS (Apple's GPU) runs this project untested") for n in notes)


def test_on_mps_the_dtype_is_float32_unless_bfloat16_is_asked_for_and_supported(a_mac, monkeypatch):
    assert pick_dtype(MPS, "auto") == torch.float32
    monkeypatch.setattr(runtime, "mps_has_bf16", lambda: True, raising=False)
    assert pick_dtype(MPS, "bfloat16") == torch.bfloat16
    monkeypatch.setattr(runtime, "mps_has_bf16", lambda: False)
    with pytest.raises(UserError, match=r"^train.dtype=bfloat16 but this Mac's MPS lacks it .*: use float32$"):
        pick_dtype(MPS, "bfloat16")
    with pytest.raises(UserError, match=r"^train.dtype=float16 is not supported on MPS"):
        pick_dtype(MPS, "float16")
    assert pick_dtype(torch.device("cpu"), "bfloat16") == torch.bfloat16, "the CPU as before"


def test_train_compile_on_mps_is_a_note_not_an_attempt(a_mac, tiny_cfg, monkeypatch, capsys):
    import speed.compile
    from common import Printer
    from model.gpt import GPT
    from training.trainer import NonFinite, build_step

    def attempt(*args, **kwargs):
        raise AssertionError("torch.compile was tried on MPS")
    monkeypatch.setattr(speed.compile, "compiled_or_eager", attempt)
    cfg = tiny_cfg(**{"train.compile": "true", "model.vocab_size": 48})
    model = GPT(cfg.model)   # (on the CPU: nothing runs here)
    optimizer, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)
    for say, said in ((Printer(), "note: train.compile is not tried on MPS: training eagerly\n"), (Printer(False), "")):
        _, how, _ = build_step(model, model, optimizer, scaler, NonFinite(torch.device("cpu"), True, True), None, MPS,
                            torch.float32, cfg.train, 1, say)
        assert capsys.readouterr().err == said and how == "eager"


def test_the_mps_generator_is_saved_with_a_checkpoint_and_restored_on_resume(a_mac, tiny_cfg):
    from training.checkpoint import load_checkpoint
    from training.trainer import train
    cfg = tiny_cfg(**{"train.max_steps": 4, "train.eval_interval": 4, "train.device": "cpu"})
    train(cfg, quiet=True)
    saved = load_checkpoint(f"{cfg.out_dir}/ckpt_0000004.pt")["rng_ranks"][0]["mps"]
    assert torch.equal(saved, torch.arange(8, dtype=torch.uint8) + 1), "the state when the checkpoint was written"
    cfg.train.max_steps = 6
    train(cfg, quiet=True, resume=True)
    assert len(a_mac["set"]) == 1 and torch.equal(a_mac["set"][0], saved)
