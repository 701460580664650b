"""GPT-2 weights in and out (hf/convert.py, hf/hub.py, export.py), checked against
transformers' own GPT2LMHeadModel: same logits both ways, exact round trips, clear refusals."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sample as sample_cli
from model.config import ModelConfig
from model.gpt import GPT
from common import UserError
from data.tokenizers import CharTokenizer
from hf.convert import config_from_hf, state_dict_from_hf, to_hf
from hf.hub import load_pretrained, save_pretrained
from tests.conftest import (ROOT, gpt2_or_skip, needs_transformers, records, resumed_copy,
                            run_tool, scramble_)


def run(*args, env=None):
    """A command-line tool in a subprocess that never reaches the network."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8",
           **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, encoding="utf-8",
                          timeout=300)


TOL = 1e-4   # fp32, max abs logit difference
TINY = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)


def hf_model(seed: int = 0, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**TINY, **overrides}))
    scramble_(model, seed)
    return model.eval()


def our_model(seed: int = 0, **overrides) -> GPT:
    cfg = ModelConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, **overrides)
    torch.manual_seed(seed)
    model = GPT(cfg)
    scramble_(model, seed)
    return model.eval()


def max_diff(ours: GPT, theirs, seed: int = 0) -> float:
    idx = torch.randint(0, ours.cfg.vocab_size, (3, ours.cfg.block_size),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a, _ = ours(idx, all_logits=True)
        b = theirs(idx).logits
    assert a.shape == b.shape and a.abs().max() > 1.0   # logits large enough for a wrong mapping to show
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- parity with transformers

@needs_transformers
@pytest.mark.parametrize("overrides", [{}, {"activation_function": "gelu"}, {"scale_attn_weights": False},
                                       {"tie_word_embeddings": False}, {"reorder_and_upcast_attn": True}],
                         ids=["gpt2", "exact-gelu", "unscaled", "untied", "upcast"])
def test_import_gives_transformers_logits(tmp_path, overrides):
    """The plain GPT-2 is saved in shards, as the large ones are; the others in one file."""
    theirs = hf_model(**overrides)
    shards = {} if overrides else {"max_shard_size": "20KB"}
    theirs.save_pretrained(tmp_path, **shards)
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == (len(list(tmp_path.glob("*.safetensors"))) > 1) == bool(shards)
    cfg, state = load_pretrained(str(tmp_path))
    ours = GPT(cfg).eval()
    ours.load_state_dict(state)
    diff = max_diff(ours, theirs)
    print(f"import {overrides or 'gpt2'}: max abs logit diff {diff:.2e}")
    assert diff <= TOL


@needs_transformers
@pytest.mark.parametrize("overrides", [{}, {"mlp": "gelu_tanh"}, {"mlp": "relu2"}, {"bias": False},
                                       {"tie_embeddings": False}, {"attn_scale": False},
                                       {"attention": "naive"}],
                         ids=["default", "gelu_tanh", "relu2", "no-bias", "untied", "unscaled",
                              "naive"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, overrides):
    from transformers import GPT2LMHeadModel
    ours = our_model(**overrides)
    save_pretrained(tmp_path, ours.cfg, ours.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert theirs.config.tie_word_embeddings == ours.cfg.tie_embeddings
    diff = max_diff(ours, theirs)
    print(f"export {overrides or 'default'}: max abs logit diff {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("overrides", [{},
                                       {"tie_embeddings": False, "mlp": "gelu_tanh", "attn_scale": False}],
                         ids=["default", "untied-tanh-unscaled"])
def test_round_trip_gives_identical_tensors_and_config(tmp_path, overrides):
    ours = our_model(dropout=0.1, **overrides)
    hf_cfg, hf_state = to_hf(ours.cfg, ours.state_dict())
    back = state_dict_from_hf(hf_state, config_from_hf(hf_cfg, "config.json"), "weights")
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    save_pretrained(tmp_path, ours.cfg, ours.state_dict())
    cfg, state = load_pretrained(str(tmp_path))
    assert cfg == ours.cfg
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())


def test_original_openai_layout_loads(tmp_path):
    """The first GPT-2 checkpoints have no 'transformer.' prefix and store the causal mask as
    attn.bias / attn.masked_bias buffers: both are understood."""
    from safetensors.torch import save_file
    ours = our_model()
    hf_cfg, hf_state = to_hf(ours.cfg, ours.state_dict())
    old = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    for i in range(ours.cfg.n_layer):
        old[f"h.{i}.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    _, state = load_pretrained(str(tmp_path))
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("setting", [("pos", "rope"), ("pos", "alibi"), ("norm", "rmsnorm"),
                                     ("qk_norm", True), ("attention", "linear"), ("attention", "mla")])
def test_export_refuses_models_gpt2_cannot_express(tmp_path, setting):
    name, value = setting
    extra = {"kv_latent_dim": 8} if value == "mla" else {}
    model = our_model(**{name: value}, **extra)
    tokenizer = CharTokenizer("".join(map(chr, range(32, 128)))).meta()
    with pytest.raises(UserError, match=f"model.{name}={value!r}"):
        save_pretrained(tmp_path / "out", model.cfg, model.state_dict(), tokenizer)
    # refused before anything was written, the tokenizer's files too
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value", [("scale_attn_by_inverse_layer_idx", True), ("n_inner", 64),
                                        ("activation_function", "silu"), ("layer_norm_epsilon", 1e-6),
                                        ("model_type", "llama"), ("add_cross_attention", True),
                                        ("n_layer", "two")])
def test_import_refuses_configs_this_gpt_cannot_express(tmp_path, key, value):
    ours = our_model()
    hf_cfg, _ = to_hf(ours.cfg, ours.state_dict())
    with pytest.raises(UserError, match=key):
        config_from_hf({**hf_cfg, key: value}, "config.json")


def test_import_refuses_damaged_checkpoints(tmp_path):
    from safetensors.torch import save_file
    ours = our_model()
    hf_cfg, hf_state = to_hf(ours.cfg, ours.state_dict())
    with pytest.raises(UserError, match="no config.json"):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(UserError, match="no model.safetensors.*can run code"):
        load_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(UserError, match="not a readable safetensors"):
        load_pretrained(str(tmp_path))
    cases = [("transformer.h.1.ln_2.weight", None, "lacks the tensor h.1.ln_2.weight"),
             ("transformer.wpe.weight", torch.zeros(8, 32), r"wpe.weight has shape \(8, 32\)"),
             ("transformer.h.2.ln_1.weight", torch.zeros(32), "does not have: h.2.ln_1.weight")]
    for key, tensor, message in cases:
        broken = {k: v for k, v in hf_state.items() if k != key}
        broken |= {key: tensor} if tensor is not None else {}
        save_file(broken, tmp_path / "model.safetensors")
        with pytest.raises(UserError, match=message):
            load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_pretrained(str(tmp_path))


def test_a_hub_name_that_cannot_be_downloaded_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match="neither a directory nor a GPT-2 name"):
        load_pretrained(str(tmp_path / "no_such_dir"))
    # offline, with an empty cache
    r = run("sample.py", "gpt2-medium", "--prompt", "Hi", env={"HF_HOME": str(tmp_path)})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(("error: could not download gpt2-medium from the Hugging Face hub",
                                "error: downloading gpt2-medium needs huggingface_hub")), r.stderr


# ----------------------------------------------------------------------------- train.init_from, sample.py

def test_init_from_takes_the_model_section_and_refuses_conflicts(tmp_path, text_file, tiny_gpt2):
    from training.config import build_config
    base = [f"--data={text_file}", f"--train.init_from={tiny_gpt2}"]
    cfg = build_config(None, base + ["--model.block_size=8", "--model.dropout=0.2",
                                     "--model.attention=naive"])
    m = cfg.model
    assert (m.n_layer, m.n_embd, m.vocab_size, m.mlp) == (2, 32, 50257, "gelu_tanh")
    assert (cfg.model.block_size, cfg.model.dropout, cfg.model.attention) == (8, 0.2, "naive")
    assert cfg.data.tokenizer == "gpt2"
    assert build_config(None, base + ["--model.n_layer=2"]).model.n_layer == 2   # agreeing is no conflict
    for override, key in [("--model.n_layer=4", "model.n_layer=4"),
                          ("--model.block_size=32", "model.block_size=32"),
                          ("--model.pos=rope", "model.pos=rope"),
                          ("--model.vocab_size=50304", "model.vocab_size"),
                          ("--data.tokenizer=char", "data.tokenizer=char")]:
        with pytest.raises(UserError, match=f"{key}.*conflicts with"):
            build_config(None, base + [override])
    toml = tmp_path / "ft.toml"   # a key set in the config file conflicts the same way
    toml.write_text(f'[train]\ninit_from = "{tiny_gpt2}"\n[model]\nn_embd = 64\n')
    with pytest.raises(UserError, match="model.n_embd=64 conflicts with .*n_embd=32"):
        build_config(str(toml), [f"--data={text_file}"])
    with pytest.raises(UserError, match="neither a directory nor"):
        build_config(None, [f"--data={text_file}", f"--train.init_from={tmp_path / 'missing'}"])


def test_the_shipped_finetune_config_is_gpt2_small_without_a_download(text_file):
    from training.config import build_config
    cfg = build_config(str(ROOT / "configs" / "finetune_gpt2.toml"), [f"--data={text_file}"])
    m = cfg.model
    assert (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.mlp) == (12, 12, 768, 50257, "gelu_tanh")
    assert m.block_size <= 1024, "GPT-2's position table has 1024 rows"
    assert cfg.data.tokenizer == "gpt2" and cfg.train.init_from == "gpt2"
    with pytest.raises(UserError, match=r"model.n_layer=4 conflicts with gpt2's n_layer=12 "
                                        r"\(train.init_from\); remove the override"):
        build_config(str(ROOT / "configs" / "finetune_gpt2.toml"),
                     [f"--data={text_file}", "--model.n_layer=4"])


def test_finetune_starts_from_the_pretrained_weights_and_resumes(tmp_path, tiny_cfg, tiny_gpt2):
    """The first training loss is transformers' loss on the same batch (with the position table
    cropped to block_size 8); a resumed run continues its own checkpoint, not the pretrained weights."""
    from transformers import GPT2LMHeadModel
    gpt2_or_skip()   # the run's tokenizer

    from data.loader import BatchLoader
    from data.prepare import prepare
    from training.trainer import train
    extra = {"train.init_from": tiny_gpt2, "model.block_size": 8, "model.dropout": 0.0, "train.batch_size": 4,
             "train.max_steps": 4, "train.eval_interval": 2, "train.lr": 1e-2, "train.warmup_steps": 0}
    whole_cfg = tiny_cfg(**extra, out_dir=tmp_path / "whole")
    train(whole_cfg, quiet=True)
    whole = records(tmp_path / "whole")
    cfg = tiny_cfg(**extra, out_dir=tmp_path / "split")
    # the first step's batch
    windows = BatchLoader(prepare(cfg.data), 8, 4, seed=cfg.train.seed).step_windows()[0]
    x, y = windows[:, :-1], windows[:, 1:].reshape(-1)
    with torch.no_grad():
        logits = GPT2LMHeadModel.from_pretrained(tiny_gpt2).eval()(x).logits
    hf_loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y).item()
    assert whole[1] == pytest.approx(hf_loss, abs=1e-4)
    assert whole[4] < whole[1] - 0.5   # and it trains

    weights = tiny_gpt2 / "model.safetensors"
    weights.rename(tiny_gpt2 / "hidden")   # resuming must not need them
    try:
        resumed = resumed_copy(whole_cfg, 2, tmp_path / "split")
    finally:
        (tiny_gpt2 / "hidden").rename(weights)
    assert records(resumed)[4] == pytest.approx(whole[4], abs=1e-5)


def test_sample_py_samples_a_hugging_face_directory_greedily_as_transformers_does(tiny_gpt2,
                                                                                  capsys):
    from transformers import GPT2LMHeadModel

    tok = gpt2_or_skip()
    prompt = "First Citizen:"
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        expected = GPT2LMHeadModel.from_pretrained(tiny_gpt2).eval().generate(
            ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.size(1):].tolist()
    argv = [tiny_gpt2, "--prompt", prompt, "--max-new-tokens", 6, "--temperature", 0,
            "--device", "cpu"]
    rc, out, err = run_tool(sample_cli, argv, capsys)
    assert rc == 0 and "Hugging Face GPT-2" in err, err
    assert out == prompt + tok.decode_bytes(expected).decode("utf-8", errors="replace") + "\n"
