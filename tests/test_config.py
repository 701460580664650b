"""Defaults < TOML file < command line; values coerced; mistakes named."""
from pathlib import Path

import pytest

import train as train_cli
from common import UserError
from tests.conftest import ROOT, TEXT, run_tool
from training.config import PATHS, build_config, describe, flat, load_toml

SHIPPED = sorted((ROOT / "configs").glob("*.toml"))


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_file_overrides_defaults_and_command_line_overrides_file(tmp_path):
    path = write(tmp_path, '[model]\nn_layer = 3\nn_embd = 64\n[train]\nlr = 0.01\n')
    cfg = build_config(str(path), ["--model.n_layer=5", "--train.batch_size", "7", "--data", "x.txt"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.train.lr, cfg.train.batch_size) == (5, 64, 0.01, 7)
    assert cfg.data.path == str(Path.cwd() / "x.txt"), "a command-line path is the working directory's"


def test_runs_on_other_data_or_tokens_never_share_an_out_dir_by_surprise(tmp_path):
    """The README's commands each get their own out dir; a config file's out_dir holds only for its own data."""
    def out_dir(*args):
        config = [a for a in args if a.endswith(".toml")]
        out = build_config(config[0] if config else None, [a for a in args if not a.endswith(".toml")]).out_dir
        return Path(out).relative_to(ROOT).as_posix() if Path(out).is_relative_to(ROOT) else out
    assert out_dir() == "out/tinyshakespeare"
    assert out_dir("--data", "notes/my_notes.txt") == "out/my_notes"
    assert out_dir("--data", "my_notes.txt", "--data.tokenizer=bpe:4096") == "out/my_notes-bpe4096"
    assert out_dir("--data", "books/*.txt", "--data.tokenizer=gpt2") == "out/books-gpt2"
    fast = "configs/shakespeare_char_cpu_fast.toml"
    assert out_dir(fast) == "out/shakespeare_char_cpu_fast"
    assert out_dir(fast, "--data", "prose.txt") == "out/shakespeare_char_cpu_fast-prose"
    assert out_dir(fast, "--data.tokenizer=gpt2") == "out/shakespeare_char_cpu_fast-gpt2"
    assert out_dir("configs/shakespeare_gpt2bpe.toml", "--data", "prose.txt") == "out/shakespeare_gpt2bpe-prose", \
        "the config's own tokenizer is in its name already"
    assert out_dir(fast, "--data", "prose.txt", "--out_dir=mine") == "mine"
    assert out_dir(str(write(tmp_path, "[model]\nn_layer = 3\n"))) == "out/c", "a config without out_dir: its name"


def test_values_are_coerced_to_field_types():
    cfg = build_config(None, ["--train.lr=3e-4", "--train.compile=true", "--model.bias=0", "--model.dropout=0"])
    assert cfg.train.lr == 3e-4 and cfg.train.compile is True and cfg.model.bias is False
    assert isinstance(cfg.model.dropout, float)


@pytest.mark.parametrize("args, message", [
    (["--model.n_layr=3"], "unknown config key 'model.n_layr' (did you mean 'model.n_layer'?)"),
    (["--modle.n_layer=3"], "unknown config key 'modle.n_layer' (did you mean 'model.n_layer'?)"),
    (["--model.n_layer=2.5"], "model.n_layer: expected int"),
    (["--model.attention=magic"], "model.attention='magic' is not one of"),
    (["--train.lr"], "unexpected argument '--train.lr'"),
    (["oops"], "unexpected argument 'oops'"),
    (["--train.optimizer=sgd"], "train.optimizer='sgd' is not one of adamw, muon"),
    (["--train.schedule=step"], "train.schedule='step' is not one of cosine, wsd"),
    (["--train.optimizer=muon", "--train.fsdp=true"], "train.fsdp shards what train.optimizer=muon"),
])
def test_bad_overrides_name_the_problem(args, message):
    with pytest.raises(UserError) as e:
        build_config(None, args)
    assert message in str(e.value)


@pytest.mark.parametrize("text, override, message", [
    ("[model]\nn_layer = [1, 2]\n", "--model.n_layer=1", "model.n_layer: expected int, got [1, 2]"),
    ('[train]\nlr = "fast"\n', "--train.lr=0.01", "train.lr: expected float, got 'fast'"),
    ("[train]\nlearning_rate = 3\n", "--train.lr=0.01", "unknown config key 'train.learning_rate'"),
])
def test_a_config_file_with_an_error_is_refused_whatever_the_command_line_sets(
        tmp_path, capsys, text, override, message):
    """The command line setting the same key does not hide the file's mistake: the file is the
    user's to fix."""
    path = write(tmp_path, text)
    with pytest.raises(UserError) as e:
        build_config(str(path), [override])
    assert str(e.value).startswith(f"{path}: {message}")
    rc, _, err = run_tool(train_cli, [path, override, f"--out_dir={tmp_path / 'out'}"], capsys)
    assert rc == 2 and err.startswith(f"error: {path}: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_described_config_is_valid_toml_that_round_trips(tmp_path):
    """Every value comes back as it was, quotes and control characters too."""
    prompt = "ROMEO:\n\t\"O\" \\ \u2603\x7f"
    cfg = build_config(None, ["--model.n_layer=3", "--out_dir=o", "--log.wandb_run_name=a \"b\"",
                              f"--train.sample_prompt={prompt}", "--train.sample_every=5"])
    assert cfg.train.sample_prompt == prompt
    path = write(tmp_path, describe(cfg))
    assert build_config(str(path), []).to_dict() == cfg.to_dict()


def test_the_shipped_configs_are_found():
    assert {"shakespeare_char.toml", "shakespeare_char_cpu.toml"} <= {p.name for p in SHIPPED}, SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_config_loads_and_every_value_it_sets_is_the_runs(path):
    """Its out dir is named after the file (a copied config does not write into another's runs), and
    every key of the file reaches the config as written: none is overridden or lost on the way."""
    cfg = build_config(str(path), [])
    assert cfg.out_dir == str(ROOT / "out" / path.stem)
    settings = [(section, values) for section, values in load_toml(path).items() if isinstance(values, dict)]
    assert settings, "a config sets at least one section"
    for section, values in settings:
        for key, value in values.items():
            resolved = str(ROOT / value) if f"{section}.{key}" in PATHS else value   # the repository's paths
            assert flat(cfg.to_dict())[f"{section}.{key}"] == resolved, f"{section}.{key}"


def test_paths_resolve_where_they_were_written_wherever_the_command_runs(tmp_path, monkeypatch):
    """The defaults and the shipped configs point into the repository; a config file elsewhere into its
    own folder; the command line into the working directory."""
    monkeypatch.chdir(tmp_path)
    default = build_config(None, [])
    assert (default.data.path, default.data.prepared_dir, default.out_dir) == \
        (str(ROOT / "data/tinyshakespeare.txt"), str(ROOT / "data/prepared"), str(ROOT / "out/tinyshakespeare"))
    shipped = build_config(str(ROOT / "configs/shakespeare_char_cpu.toml"), [])
    assert shipped.data.path == str(ROOT / "data/tinyshakespeare.txt")
    (tmp_path / "mine").mkdir()
    mine = write(tmp_path / "mine", '[data]\npath = "notes.txt"\n')   # mine/c.toml
    assert build_config(str(mine), []).data.path == str(tmp_path / "mine" / "notes.txt")
    assert build_config(str(mine), ["--data", "other.txt"]).data.path == str(tmp_path / "other.txt")


@pytest.mark.parametrize("make, message", [
    (lambda tmp: (tmp / "my.txt").write_text(TEXT) and tmp / "my.txt", "is not a TOML config file"),
    (lambda tmp: ROOT / "configs", "Is a directory: "),
])
def test_a_config_that_is_not_one_says_what_it_is(make, message, tmp_path, capsys):
    rc, out, err = run_tool(train_cli, [make(tmp_path), "--out_dir", tmp_path / "o"], capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("key", ["out_dir", "data.path", "data.prepared_dir"])
def test_an_empty_path_is_refused_not_taken_as_the_working_directory(key):
    with pytest.raises(UserError, match=f"^{key} is empty"):
        build_config(None, [f"--{key}="])


def test_an_empty_out_dir_in_a_config_file_means_out_name(tmp_path):
    path = write(tmp_path, 'out_dir = ""\n[model]\nn_layer = 3\n')
    assert build_config(str(path), []).out_dir == str(ROOT / "out" / "c")


def test_a_val_path_is_taken_from_where_it_is_typed_and_none_stays_none(tmp_path, monkeypatch):
    """A relative data.val_path resumes from any folder: it is stored absolute, as data.path is."""
    monkeypatch.chdir(tmp_path)
    assert build_config(None, ["--data.val_path=val.jsonl"]).data.val_path == str(tmp_path / "val.jsonl")
    assert build_config(None, []).data.val_path == ""
