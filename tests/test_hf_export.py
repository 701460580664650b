"""An exported directory is a whole Hugging Face model: AutoTokenizer encodes and decodes exactly as
our tokenizer does (char, bpe:N, gpt2), and pipeline("text-generation") continues a prompt, offline.
Models are built directly (tiny, random), never trained."""
import json
import os

import pytest
import torch

import export
from common import UserError
from data.bpe import train_bpe
from data.tokenizers import CharTokenizer, load_tokenizer
from hf.hub import save_pretrained
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import TEXT, gpt2_or_skip, needs_transformers, run_tool, save_char_model

pytestmark = needs_transformers
TEXTS = ["Hello world", "It's 2024: 12345 apples, 3.14 pies... (really?!)", "  runs   of    spaces  ", "x",
         "line one\n\nline two\r\n   indented\ttab\n", "café 日本語 ☃ naïve"]


def tokenizer(kind: str):
    if kind == "char":
        return CharTokenizer.from_text("".join(TEXTS))
    if kind == "bpe":
        pytest.importorskip("rustbpe")
        # " 234" as a token: "12345" then differs where the pattern's digits rule (at most 3) is lost
        return load_tokenizer(train_bpe([TEXT + "".join(TEXTS) * 3 + " 234" * 50], 320)[0])
    return gpt2_or_skip()


def export_tiny(path, kind: str):
    """(our tokenizer, a tiny random model of its vocabulary, path), both saved there by save_pretrained."""
    tok = tokenizer(kind)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():   # logits far apart: greedy decoding is the same whatever the float rounding
        model.tok_emb.weight.mul_(50)
    assert save_pretrained(path, model.cfg, model.state_dict(), tok.meta()) == ["tokenizer.json",
                                                                                "tokenizer_config.json"]
    return tok, model, path


@pytest.fixture(scope="module", params=["char", "bpe", "gpt2"])
def exported(request, tmp_path_factory):
    return request.param, *export_tiny(tmp_path_factory.mktemp(request.param), request.param)


def test_auto_tokenizer_encodes_and_decodes_as_ours(exported):
    from transformers import AutoTokenizer
    kind, tok, _, path = exported
    theirs = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == text
    eos = None if kind == "char" else tok.vocab_size - 1   # <|endoftext|> follows the BPE's ranks
    assert theirs.eos_token_id == eos
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == eos
    assert theirs.model_max_length == 32


def test_pipeline_continues_a_prompt_greedily_as_our_model_does(exported):
    from transformers import pipeline
    kind, tok, model, path = exported
    prompt = "Hello world"
    ids = torch.tensor([tok.encode(prompt)])
    for _ in range(4):   # our greedy continuation
        with torch.no_grad():
            logits, _ = model(ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    generate = pipeline("text-generation", model=str(path))
    greedy = dict(max_new_tokens=4, do_sample=False)
    assert generate(prompt, return_tensors=True, **greedy)[0]["generated_token_ids"] == ids[0].tolist()
    text = generate(prompt, **greedy)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt), text
    if kind == "char":   # one character a token: the text is exactly the tokens'
        assert text == prompt + tok.decode(ids[0, -4:].tolist())
    # its defaults: sampling, up to the context
    assert generate(prompt)[0]["generated_text"].startswith(prompt)


def test_generation_config_bounds_a_default_call_without_a_warning_for_max_new_tokens(tmp_path):
    """generation_config.json holds no max_length: with one, every call giving max_new_tokens (as the docs'
    calls do) warns that both are set. Its max_new_tokens, half the context, keeps a call with none within
    the context (the pipeline's own default, 256 new tokens, runs past a small model's position table)."""
    import logging

    from transformers import pipeline
    _, _, path = export_tiny(tmp_path, "char")
    assert json.loads((path / "generation_config.json").read_text()) == {
        "max_new_tokens": 16, "bos_token_id": None, "eos_token_id": None}
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        generate = pipeline("text-generation", model=str(path))
        assert len(generate("Hello world", max_new_tokens=5, do_sample=False)[0]["generated_text"]) == 16
        assert len(generate("Hello world")[0]["generated_text"]) == 11 + 16
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in said if "max_length" in m], said


def test_a_vocabulary_in_rank_order_is_needed_for_merges():
    """A token no lower-ranked pair makes cannot be a merge: said, not written wrong."""
    from hf.tokenizer import merges
    ranks = {bytes([b]): b for b in range(256)} | {b"abc": 256, b"ab": 257}
    with pytest.raises(UserError, match="b'abc' cannot be made"):
        merges(ranks)
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"abc": 257}
    assert merges(ranks) == [(b"a", b"b"), (b"ab", b"c")]


def test_export_says_what_it_wrote_and_what_fits_the_context(tmp_path, capsys):
    """Past the context (here 8 positions) transformers' pipeline ends in an IndexError: the export
    names the limit, and the default it wrote to generation_config.json. Its files have the modes
    the umask gives any file the user writes, and --force writes them again."""
    run = save_char_model(tmp_path / "run", block_size=8, n_layer=1, n_head=2, n_embd=16)
    out = tmp_path / "hf"
    rc, said, err = run_tool(export, [run, out], capsys)
    assert rc == 0 and f"{run / 'best.pt'} -> " in said, err
    assert "# tokenizer char: tokenizer.json, tokenizer_config.json" in said
    assert said.splitlines()[-1] == ("# the prompt plus max_new_tokens must fit the context: 8 "
                                     "tokens in all (max_new_tokens 4 unless given)")
    umask = os.umask(0)
    os.umask(umask)
    names = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == dict.fromkeys(names, 0o666 & ~umask)
    assert run_tool(export, [run, out, "--force"], capsys)[0] == 0
