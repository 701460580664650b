"""Sampling: the cache changes nothing but speed; the sampler draws from the right distribution and
keeps what the filters allow; a model that cannot be sampled from is named, not sampled. (The cache
against recomputation, for every attention variant and position encoding: tests/test_variants.py.)"""
import pytest
import torch

from common import UserError
from model.config import ModelConfig
from model.gpt import GPT
from model.sampling import Choice, Decoding, generate, sample_next


def make_model(**kw):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=32, **kw)).eval()


def run(model, prompt, n, *args, **kw):
    return torch.cat(list(generate(model, prompt, n, *args, **kw)), dim=1)


def test_seeded_sampling_is_reproducible_and_the_same_with_or_without_cache():
    model = make_model()
    prompt = torch.zeros(2, 1, dtype=torch.long)
    a, b, other = (run(model, prompt, 20, generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, other)
    recomputed = run(model, prompt, 11, generator=torch.Generator().manual_seed(5),
                     decoding=Decoding(use_cache=False))
    assert torch.equal(recomputed, a[:, :11]), "one draw per token, whatever computes the logits"


def test_the_sampler_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(40_000, 4)
    noise = torch.empty(40_000, 4).exponential_(generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(sample_next(logits, Choice(1.0), noise).flatten(), minlength=4) / 40_000
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)   # 4 standard errors
    hot = torch.bincount(sample_next(logits, Choice(0.5), noise).flatten(), minlength=4) / 40_000
    # temperature 0.5: p²
    torch.testing.assert_close(hot, probs ** 2 / (probs ** 2).sum(), atol=0.01, rtol=0)


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(200, 4)
    noise = torch.empty(200, 4).exponential_(generator=torch.Generator().manual_seed(0))
    assert set(sample_next(logits, Choice(top_k=2), noise).flatten().tolist()) == {0, 1}
    nucleus = set(sample_next(logits, Choice(top_p=0.7), noise).flatten().tolist())
    assert nucleus == {0, 1}, "0.5 + 0.3 reaches 0.7: token 2 and 3 are outside the nucleus"
    assert sample_next(logits[:1], Choice(0.0), noise[:1]).item() == 0


def test_a_tiny_temperature_samples_like_greedy_instead_of_overflowing():
    """The rule: logits are shifted to a maximum of 0 before dividing, so logits / temperature stays
    finite (<= 0) for any temperature > 0, and as the temperature goes to 0 sampling becomes greedy."""
    model = make_model()
    prompt = torch.randint(0, 40, (2, 3), generator=torch.Generator().manual_seed(3))
    greedy = run(model, prompt, 20, Choice(temperature=0))
    flushing = torch.set_flush_denormal(True)   # as GPUs do: a subnormal temperature would divide as 0
    try:
        for temperature in (1e-45, 1e-30, 1e-8):
            assert torch.equal(run(model, prompt, 20, Choice(temperature)), greedy), temperature
    finally:
        torch.set_flush_denormal(False)
    assert flushing, "this CPU cannot flush subnormals: the GPU's case was not tested"


def test_the_first_non_finite_token_is_named_even_when_the_flags_are_read_later():
    model = make_model()
    model.pos_emb.weight.data[4] = float("nan")   # position 4: new token 5 after a 1-token prompt
    tokens = []
    with pytest.raises(UserError, match="at new token 5:"):
        for col in generate(model, torch.zeros(1, 1, dtype=torch.long), 12,
                            decoding=Decoding(check_every=4)):
            tokens.append(col)
    assert len(tokens) == 7, "the flags of tokens 5 to 8 are read at the 8th, before it is yielded"


def test_a_padded_vocabulary_never_yields_a_token_the_tokenizer_lacks():
    """A model whose vocabulary is padded past its tokenizer's (GPT-2: 50,304 rows for 50,257 tokens)
    must not pick a padding row, which no tokenizer can decode."""
    model = make_model()
    forward = model.forward

    def padding_wins(*args, **kwargs):   # the rows past a 30-token tokenizer win every choice
        logits, loss = forward(*args, **kwargs)
        return logits + 100.0 * (torch.arange(logits.size(-1)) >= 35), loss
    model.forward = padding_wins
    prompt = torch.zeros(2, 1, dtype=torch.long)
    for temperature in (0, 1.0):
        free = torch.cat(list(generate(model, prompt, 20, Choice(temperature))), dim=1)
        limited = torch.cat(list(generate(model, prompt, 20, Choice(temperature), vocab_limit=30)),
                            dim=1)
        assert (free >= 30).any() and (limited < 30).all(), temperature


# ---------------------------------------------------------------- sample.py: where a sample ends

def test_a_sample_ends_before_its_stop_string_and_a_prompt_holding_it_is_not_cut(tmp_path, capsys):
    import sample as sample_cli
    from tests.conftest import run_tool, save_char_model
    model = save_char_model(tmp_path / "m", n_layer=1, n_head=2, n_embd=16, block_size=16)
    rc, out, err = run_tool(sample_cli, [model, "--prompt", "ee", "--stop", "e", "--max-new-tokens", 300,
                                         "--num-samples", 2, "--device", "cpu"], capsys)
    assert rc == 0, err
    samples = out.split("--- sample ")[1:]
    assert len(samples) == 2
    for s in samples:
        text = s.split("\n", 1)[1].rstrip("\n")
        assert text.startswith("ee") and "e" not in text[2:] and len(text) < 2 + 300, text


def test_a_sample_ends_at_the_end_of_text_token(tmp_path, capsys):
    """A model that always predicts <|endoftext|> (its final norm outputs one vector, the token's
    embedding): the sample is the prompt alone, not 20 tokens of whatever follows the end of a text."""
    import sample as sample_cli
    from data.tokenizers import load_tokenizer
    from tests.conftest import gpt2_or_skip, run_tool
    from loading import FORMAT, VERSION
    gpt2_or_skip()
    model = GPT(ModelConfig(vocab_size=50257, n_layer=1, n_head=1, n_embd=8, block_size=8))
    eot = load_tokenizer({"kind": "tiktoken", "name": "gpt2"}).enc.eot_token
    with torch.no_grad():
        model.norm_f.weight.zero_()
        model.norm_f.bias.copy_(torch.ones(8))
        model.tok_emb.weight[eot] = 10.0
    torch.save({"format": FORMAT, "version": VERSION, "config": {"model": vars(model.cfg)}, "step": 0,
                "model": model.state_dict(), "tokenizer": {"kind": "tiktoken", "name": "gpt2"}},
               tmp_path / "best.pt")
    rc, out, err = run_tool(sample_cli, [tmp_path, "--prompt", "Hello", "--temperature", 0,
                                         "--max-new-tokens", 20, "--device", "cpu"], capsys)
    assert rc == 0 and out == "Hello\n", (out, err)


def test_compiling_the_decoding_step_on_a_cpu_is_said_not_to_pay(tmp_path, capsys):
    import sample as sample_cli
    from tests.conftest import run_tool, save_char_model
    model = save_char_model(tmp_path / "m", n_layer=1, n_head=2, n_embd=16, block_size=16)
    rc, _, err = run_tool(sample_cli, [model, "--compile", "--no-cache", "--max-new-tokens", 2,
                                       "--device", "cpu"], capsys)
    assert rc == 0 and sample_cli.NOTE_CPU_COMPILE in err, err


def test_a_prompt_longer_than_the_context_is_said_once_as_attention_py_says_it(tmp_path, capsys):
    """The model sees only a prompt's last block_size tokens: sample.py says so, once, in attention.py's words
    (loading.py's prompt_ids, which both use); a prompt that fits is not mentioned."""
    import attention
    import sample as sample_cli
    from tests.conftest import run_tool, save_char_model
    model = save_char_model(tmp_path / "m", n_layer=1, n_head=2, n_embd=16, block_size=16)
    note = "note: the prompt has 30 tokens, the model sees at most 16: {} the last 16\n"
    rc, out, err = run_tool(sample_cli, [model, "--prompt", "ab" * 15, "--max-new-tokens", 40, "--num-samples", 2,
                                         "--device", "cpu"], capsys)
    assert rc == 0 and out.startswith("--- sample 1 ---\n" + "ab" * 15), out
    assert err.count("note:") == 1 and note.format("continuing") in err, err
    rc, _, err = run_tool(attention, [model, "--prompt", "ab" * 15, "--out", tmp_path / "maps"], capsys)
    assert rc == 0 and err.count("note:") == 1 and note.format("drawing") in err, err
    rc, _, err = run_tool(sample_cli, [model, "--prompt", "ab" * 8, "--max-new-tokens", 40, "--device", "cpu"], capsys)
    assert rc == 0 and "note:" not in err, err
