"""Sampling: the cache changes nothing but speed; the filters keep what they should."""
import torch

from model.config import ModelConfig
from model.gpt import GPT, InferenceCache
from model.sampling import generate, sample_next, use_decoding_layout


def make_model(**kw):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=32, **kw)).eval()


def test_incremental_decoding_matches_recomputing_the_prefix():
    for pos in ("learned", "rope", "none"):
        model = make_model(pos=pos)
        idx = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))
        full, _ = model(idx, all_logits=True)
        cache = InferenceCache(model, 3, "cpu", torch.float32)
        prefill, _ = model(idx[:, :5], cache=cache, all_logits=True)
        steps = [prefill] + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0, msg=pos)


def test_generation_with_and_without_cache_agree_past_the_block_size():
    model = make_model()
    prompt = torch.randint(0, 40, (2, 3))
    # greedy, 30 tokens with block 12: the window slides several times
    with_cache = torch.cat(list(generate(model, prompt, 30, temperature=0)), dim=1)
    without = torch.cat(list(generate(model, prompt, 30, temperature=0, use_cache=False)), dim=1)
    assert with_cache.shape == (2, 30)
    # the cache re-primes from half a block when full, so agreement is exact up to the first slide
    assert torch.equal(with_cache[:, :10], without[:, :10])


def test_decoding_layout_changes_strides_not_values():
    model, plain = make_model(), make_model()
    use_decoding_layout(model)
    w = model.blocks[0].mlp.up.weight
    assert w.t().is_contiguous() and not w.is_contiguous()
    idx = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(idx, all_logits=True)[0], plain(idx, all_logits=True)[0], atol=1e-5, rtol=0)
    prompt = idx[:, :3]
    assert torch.equal(torch.cat(list(generate(model, prompt, 20, temperature=0)), dim=1),
                       torch.cat(list(generate(plain, prompt, 20, temperature=0)), dim=1))


def test_seeded_sampling_is_reproducible():
    model = make_model()
    prompt = torch.zeros(2, 1, dtype=torch.long)
    a = torch.cat(list(generate(model, prompt, 20, generator=torch.Generator().manual_seed(5))), 1)
    b = torch.cat(list(generate(model, prompt, 20, generator=torch.Generator().manual_seed(5))), 1)
    assert torch.equal(a, b)


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    top2 = {sample_next(logits, 1.0, top_k=2, generator=gen).item() for _ in range(200)}
    assert top2 == {0, 1}
    nucleus = {sample_next(logits, 1.0, top_p=0.7, generator=gen).item() for _ in range(200)}
    assert nucleus == {0, 1}, "0.5 + 0.3 reaches 0.7: token 2 and 3 are outside the nucleus"
    assert sample_next(logits, 0.0).item() == 0
