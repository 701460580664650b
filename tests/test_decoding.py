"""The eager code yields each token before it computes the next. Decoding in runs of k tokens
(one CUDA graph replay each with --compile on a GPU) gives the tokens of decoding one at a time:
the same draws in the same order, across slides of the cache and at an end that is not a
multiple of k; compiled, the tokens of the eager code."""
import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from model.sampling import Choice, Decoder, Decoding, generate
from speed.decoding import run_lengths

CHOICES = [Choice(temperature=0), Choice(0.8), Choice(1.0, top_k=5), Choice(1.0, top_p=0.9)]


def make_model(**shape):
    torch.manual_seed(0)
    shape = dict(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=32) | shape
    return GPT(ModelConfig(**shape)).eval()


def decode(model, choice, n, device="cpu", **decoding):
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]], device=device)
    generator = torch.Generator(device=device).manual_seed(7)
    columns = generate(model, prompt, n, choice, generator, decoding=Decoding(**decoding))
    return torch.cat(list(columns), dim=1).cpu()


def in_runs(run, decoder):
    """The eager step in speed/decoding.py's runs (those of its CUDA graphs)."""
    decoder.sizes = run_lengths(decoder.model.cfg.block_size)
    return run


def test_the_eager_code_streams_each_token_before_computing_the_next(monkeypatch):
    """Without a CUDA graph a run saves nothing: sample.py shows each token as it is chosen,
    not in bursts."""
    model = make_model()
    forward, calls = model.forward, []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    for i, _ in enumerate(generate(model, torch.tensor([[1, 2, 3]]), 29, Choice(0.8)), 1):
        assert len(calls) == i, "a token waited for the ones after it"


@pytest.mark.parametrize("choice", CHOICES, ids=["greedy", "sampled", "top_k", "top_p"])
def test_runs_of_k_tokens_give_the_tokens_of_one_at_a_time(choice, monkeypatch):
    # block 12: slides at 12 tokens keep 6, which runs of 5 do not divide; 29 = 5 * 5 + 4
    model = make_model()
    runs, real = [], Decoder.run

    def recording(decoder, n):
        runs.append(n)
        return real(decoder, n)
    monkeypatch.setattr(Decoder, "run", recording)
    tokens = {}
    for k in (1, 5, 16):
        monkeypatch.setattr("speed.decoding.TOKENS_PER_RUN", k)
        runs.clear()
        tokens[k] = decode(model, choice, 29, speed_up=in_runs)
        assert min(k, 6) in runs and 1 in runs, (k, runs)
    assert tokens[1].shape == (2, 29)
    assert torch.equal(tokens[5], tokens[1]) and torch.equal(tokens[16], tokens[1])


def test_the_compiled_runs_give_the_tokens_of_the_eager_code():
    """speed/decoding.py's compiled step (inductor's C++ on a CPU: one small compile, which greedy
    and sampled decoding share) draws outside the compiled graph, from the same generator in the
    same order; greedy, it chooses the eager code's tokens through slides of the cache."""
    from speed.decoding import compiled
    torch._dynamo.reset()
    model = make_model(n_layer=1, n_embd=16, pos="rope")
    for choice in CHOICES[:2]:
        assert torch.equal(decode(model, choice, 20, speed_up=compiled), decode(model, choice, 20))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs replay a graph")


@CUDA
@pytest.mark.parametrize("choice", CHOICES[:2], ids=["greedy", "sampled"])
def test_graph_replays_draw_from_the_seeded_generator_as_the_eager_code(choice, capsys):
    """The runs recorded as CUDA graphs draw from the user's generator (registered with each
    graph), and the draws of their warm-up are undone: the eager code's tokens, up to the
    rounding of the compiled kernels (a near tie may flip, hence the tolerance)."""
    from speed.decoding import compiled
    torch._dynamo.reset()
    model = make_model(block_size=64).cuda()
    eager = decode(model, choice, 100, "cuda")
    graphed = decode(model, choice, 100, "cuda", speed_up=compiled)
    assert "warning" not in capsys.readouterr().err
    assert (graphed == eager).float().mean() > 0.95
