import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"
os.environ.setdefault("WANDB_MODE", "disabled")
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken_cache")

import torch  # noqa: E402

# A short text with enough variety to be a real (if tiny) language: ~2,300 characters.
TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.

All:
We know't, we know't.

First Citizen:
Let us kill him, and we'll have corn at our own price.
Is't a verdict?

All:
No more talking on't; let it be done: away, away!

Second Citizen:
One word, good citizens.

First Citizen:
We are accounted poor citizens, the patricians good.
What authority surfeits on would relieve us: if they
would yield us but the superfluity, while it were
wholesome, we might guess they relieved us humanely;
but they think we are too dear: the leanness that
afflicts us, the object of our misery, is as an
inventory to particularise their abundance; our
sufferance is a gain to them Let us revenge this with
our pikes, ere we become rakes: for the gods know I
speak this in hunger for bread, not in thirst for revenge.

Second Citizen:
Would you proceed especially against Caius Marcius?

All:
Against him first: he's a very dog to the commonalty.

Second Citizen:
Consider you what services he has done for his country?

First Citizen:
Very well; and could be content to give him good
report fort, but that he pays himself with being proud.

Second Citizen:
Nay, but speak not maliciously.

First Citizen:
I say unto you, what he hath done famously, he did
it to that end: though soft-conscienced men can be
content to say it was for his country he did it to
please his mother and to be partly proud; which he
is, even till the altitude of his virtue.
"""


@contextmanager
def num_threads(n: int):
    """torch's intra-op thread count set to n inside the block, and put back after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def at_most_two_threads():
    """At most two intra-op threads for the session: the tests' tiny models gain nothing from more,
    and the suite shares its machine."""
    with num_threads(min(2, torch.get_num_threads())):
        yield


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT)
    return path


def tiny_overrides(tmp_path, text_file, **extra) -> list[str]:
    """Command-line overrides for a tiny, fast run on text_file."""
    values = {"data.path": text_file, "data.prepared_dir": tmp_path / "prepared", "out_dir": tmp_path / "out",
              "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
              "train.batch_size": 8, "train.max_steps": 20, "train.warmup_steps": 5, "train.eval_interval": 10,
              "train.eval_iters": 2, "train.log_interval": 1}
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


@pytest.fixture
def tiny_cfg(tmp_path, text_file):
    from training.config import build_config

    def make(**extra):
        return build_config(None, tiny_overrides(tmp_path, text_file, **extra))
    return make


def prepare_text(path, tokenizer="char", val_fraction=0.1, root="data/prepared", encoding_errors="strict",
                 block_size=None):
    """data.prepare.prepare() of the text at path with these data settings; the dataset's directory."""
    from data.prepare import DataConfig, prepare
    return prepare(DataConfig(str(path), tokenizer, val_fraction, str(root), encoding_errors), block_size)


def save_char_model(out, sharpen: float = 1.0, seed: int = 0, **model) -> Path:
    """A random (untrained) character model with these ModelConfig values, saved in out as a run's best
    checkpoint with what loading it needs; out. sharpen scales its query and key weights: at the
    default initialization every head attends almost evenly, and heads hardly differ."""
    from data.tokenizers import CharTokenizer
    from model.config import ModelConfig
    from model.gpt import GPT
    from training.checkpoint import FORMAT, VERSION, save_checkpoint
    from training.config import Config
    Path(out).mkdir(parents=True, exist_ok=True)
    cfg = Config(out_dir=str(out))
    tokenizer = CharTokenizer("\n !:,.?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
    cfg.model = ModelConfig(vocab_size=tokenizer.vocab_size, **model)
    torch.manual_seed(seed)
    state = GPT(cfg.model).state_dict()
    for name, value in state.items():
        if name.endswith(("attn.query.weight", "attn.key.weight")):
            value.mul_(sharpen)
    save_checkpoint({"format": FORMAT, "version": VERSION, "config": cfg.to_dict(), "tokenizer": tokenizer.meta(),
                     "model": state, "step": 0, "is_best": True}, out, keep=1)   # what sampling needs, no more
    return Path(out)
