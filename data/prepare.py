"""Turn text into an entry of the cache (data/cache.py) in bounded memory: a scan, training
(bpe:N), encoding (BPE on worker processes), in a temporary folder renamed into place whole.
"""
import json
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from itertools import chain, takewhile
from multiprocessing.connection import wait
from pathlib import Path

# run as a file: imports start at the repository, not in data/ (its names would shadow)
if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np

from common import ArgumentParser, UserError, atomic_write, run_cli, usable_cores
from data.bpe import train_bpe
from data.cache import (FORMAT, SPLITS, DataConfig, check_split_sizes, load_meta, mb_progress,
                        prepare, read_entry)
from data.sources import iter_documents
from data.tokenizers import bpe_vocab_size, build_tokenizer, code_points, load_tokenizer

# characters encoded at a time (up to twice as many)
PIECE_CHARS = 1 << 20
# bpe:N learns from the train split's first 256M characters at most
TRAIN_MAX_CHARS = 256_000_000


def build(out: Path, sources: tuple, sha: str, data: DataConfig, block_size) -> dict:
    """Build the entry at out -> its meta.json. sources: the train files, the val files (none:
    val is the train text's end)."""
    if out.exists():
        print(f"notice: {out} is unfinished, damaged or of an older format: "
              f"preparing it again", file=sys.stderr)
    files = sources[0] + sources[1]
    char = data.tokenizer == "char"
    stamp = stamps(files)
    read = (data.encoding_errors, data.text_field)
    total = sum(size for size, _ in stamp)
    progress = mb_progress("scanning", total)
    scans = [scan(group, *read, char, progress) for group in sources if group]
    # each text's characters (char: + the newlines between its documents)
    counts = [n + (docs - 1) * char for _, docs, n, _ in scans]
    split_at = counts[0] if sources[1] else int(counts[0] * (1.0 - data.val_fraction))

    def text(label: str, train_chars: int):
        """(split, batch) pairs: train_chars in "train", then "val"."""
        progress = mb_progress(label, total)
        texts = [(d for p in s[0] for d in iter_documents(p, *read, progress)) for s in scans]
        return chain(*(batches(docs, at, not char) for docs, at in zip(texts, (train_chars, 0))))

    if (size := bpe_vocab_size(data.tokenizer)) is None:
        # char: every character seen, and the newline between documents
        chars = "".join(s[3] for s in scans) + "\n" * any(s[1] > 1 for s in scans)
        tok = build_tokenizer(data.tokenizer, chars)
    else:
        # on the train split's start: takewhile stops at its end
        head = text("training the tokenizer", min(split_at, TRAIN_MAX_CHARS))
        train = takewhile(lambda item: item[0] == "train", head)
        tok_meta, took = train_bpe((p for _, batch in train for p in batch if p), size)
        tok = load_tokenizer(tok_meta)
        print(f"trained {data.tokenizer} on the train split in {took:.1f} s: "
              f"{tok.vocab_size:,} tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out.parent)
    tmp = out.parent / f".{out.name}{TMP}{os.getpid()}-{secrets.token_hex(4)}"
    # the umask's mode, as any file's (not tempfile.mkdtemp's 0700)
    tmp.mkdir()
    # char: a second worker does not pay
    workers = 1 if char else data.workers or len(usable_cores())
    try:
        try:
            encoded = encode(text("encoding", split_at), tok, tmp, workers)
        except UserError:
            # what a change can cause (a character cut short) is said as the change
            check_unchanged(files, stamp)
            raise
        check_unchanged(files, stamp)
        # before publishing: a refused text leaves nothing
        check_split_sizes(encoded["tokens"], block_size)
        own = {"val_path": str(Path(data.val_path).absolute())}
        split = own if sources[1] else {"val_fraction": data.val_fraction}
        split |= {"train_chars": split_at, "val_chars": sum(counts) - split_at}
        meta = {"format": FORMAT, "source": str(Path(data.path).absolute()),
                "sha256": sha, "files": len(files), "tokenizer_spec": data.tokenizer,
                **encoded, "encoding_errors": data.encoding_errors,
                "text_field": data.text_field, "split": split}
        # written last: it makes the entry usable
        atomic_write(tmp / "meta.json", json.dumps(meta, indent=1))
        # one another process just published stays
        if read_entry(out) is None:
            shutil.rmtree(out, ignore_errors=True)
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = meta["tokens"]
    print(f"prepared {data.path} with tokenizer {data.tokenizer}: {tokens['train']:,} train "
          f"and {tokens['val']:,} val tokens (vocab {meta['vocab_size']:,}) -> {out}")
    return meta


def stamps(files: list[Path]) -> list[tuple[int, int]]:
    """Each file's (size, mtime): a text that changed shows."""
    return [(p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def check_unchanged(files: list[Path], stamp: list) -> None:
    """The hash names the entry: a text that changed since `stamp` is refused as such."""
    for path, was, now in zip(files, stamp, stamps(files)):
        if was != now:
            raise UserError(f"{path} changed while it was prepared: "
                            f"try again once it no longer changes")


# A build's folder: .<entry>.tmp-<host>.<pid namespace>-<pid>-<random>, where the pid is one
# process's (containers may share a host name)
PID_NAMESPACE = "/proc/self/ns/pid"
NAMESPACE_ID = os.stat(PID_NAMESPACE).st_ino if os.path.exists(PID_NAMESPACE) else 0
TMP = f".tmp-{socket.gethostname()}.{NAMESPACE_ID}-"


def remove_leftovers(folder: Path) -> None:
    """Remove this machine's killed builds (not on Windows: os.kill(pid, 0) ends a process)."""
    for tmp in folder.glob(f".*{TMP}*") if os.name == "posix" else ():
        pid = re.fullmatch(r"(\d+)-[0-9a-f]{8}", tmp.name.rpartition(TMP)[2])
        if not pid:
            continue
        # signal 0 asks whether it runs (another user's: PermissionError)
        try:
            os.kill(int(pid[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass


def scan(files, errors: str, field: str, want_chars: bool, progress) -> tuple:
    """(files with text, non-blank documents, characters, the characters seen if want_chars)."""
    # each file's documents, in order
    docs = Counter()
    n_chars = 0
    seen = np.zeros(0x110000, dtype=bool)
    for path in files:
        for document in iter_documents(path, errors, field, progress):
            n, blank = 0, True
            for text in document:
                n += len(text)
                blank = blank and text.isspace()
                if want_chars:
                    seen[code_points(text)] = True
            if not blank:
                docs[path] += 1
                n_chars += n
    if not docs:
        raise UserError(f"data file is empty: {files[0]}" if len(files) == 1 else
                        f"the data files are all empty ({len(files)} files, first {files[0]})")
    return list(docs), docs.total(), n_chars, "".join(map(chr, np.flatnonzero(seen)))


# Cutting BPE input here changes no token: none of the gpt2 / cl100k / o200k / bpe:N
# pre-tokenizers runs across "x\n|y" or "x| y" (x, y not whitespace). .* finds the last.
LAST_SAFE_CUT = re.compile(r".*(?:\S\n(?=\S)|\S(?= \S))", re.DOTALL)


def batches(documents, split_at: int, bpe: bool):
    """The documents (iterables of str) as (split, [piece, ...]): split_at characters in
    "train", the rest in "val"; between documents "\n" (char) or None (BPE's end-of-text). A
    batch ends past PIECE_CHARS, at its last LAST_SAFE_CUT or where its last document starts."""
    split, pos = "train", 0
    # the batch's whole pieces, the chunks of its last one, and their characters
    done, held, size = [], [], 0
    for i, document in enumerate(documents):
        if i and bpe:
            done += ["".join(held), None]
            held = []
        for text in chain(["\n"] if i and not bpe else [], document):
            if split == "train" and pos + len(text) >= split_at:
                cut = split_at - pos
                yield split, done + ["".join(held) + text[:cut]]
                text = text[cut:]
                split, done, held, size = "val", [], [], 0
            pos += len(text)
            size += len(text)
            held.append(text)
            if size >= PIECE_CHARS:
                buffer = "".join(held)
                # no safe cut: where the document starts, or (a whole piece) anyway
                cut = LAST_SAFE_CUT.match(buffer) if bpe else None
                if cut:
                    end = cut.end()
                else:
                    end = 0 if done else len(buffer)
                yield split, done + [buffer[:end]]
                done, held, size = [], [buffer[end:]], len(buffer) - end
    yield split, done + ["".join(held)]


def in_order(fn, items, workers: int, make_pool):
    """fn(item) for each item, in order, workers + 1 at a time at most: bounded memory."""
    with make_pool(workers) as pool:
        jobs = deque()
        for item in items:
            jobs.append(pool.submit(fn, item))
            if len(jobs) > workers:
                yield jobs.popleft().result()
        yield from (job.result() for job in jobs)


# encode()'s tokenizer, which the processes it forks inherit
tokenizer = None


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """`workers` processes, forked now with the stops blocked: until a worker sets its own
    handlers, a stop would reach it with the command's."""
    fork = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, mp_context=fork, initializer=start_worker)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # the first task forks them all
        pool.submit(int).result()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return pool


def start_worker() -> None:
    """A worker leaves Ctrl-C to the command, ends at SIGTERM (the pool ends the others so when
    one dies) and with the command, a kill -9 too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    parent = multiprocessing.parent_process().sentinel
    threading.Thread(target=exit_after, args=(parent,), daemon=True).start()


def exit_after(sentinel) -> None:
    wait([sentinel])
    os._exit(1)


def encode_batch(batch) -> tuple:
    """(split, ids, the pieces' UTF-8 bytes)"""
    split, pieces = batch
    return split, tokenizer.encode_pieces(pieces), len("".join(filter(None, pieces)).encode())


def encode(text, tok, tmp: Path, workers: int) -> dict:
    """Encode text's (split, batch) pairs into tmp/<split>.bin -> their meta entries. On forked
    processes (1 worker: a thread): tiktoken holds Python's lock as it lists ids (docs/data.md)."""
    global tokenizer
    tokenizer = tok
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    tokens = dict.fromkeys(SPLITS, 0)
    nbytes = dict.fromkeys(SPLITS, 0)
    low, high = tok.vocab_size, 0
    # fork is safe on Linux (macOS's system libraries are not made for it; Windows has none)
    fork = workers > 1 and sys.platform == "linux"
    results = in_order(encode_batch, text, workers, worker_pool if fork else ThreadPoolExecutor)
    # a stop shuts the pool down here, not in Python's exit (where its threads race)
    with open(tmp / "train.bin", "wb") as train, open(tmp / "val.bin", "wb") as val, \
            closing(results):
        try:
            for split, ids, n in results:
                file = train if split == "train" else val
                file.write(ids.astype(dtype, copy=False).tobytes())
                tokens[split] += len(ids)
                nbytes[split] += n
                low = int(ids.min(initial=low))
                high = int(ids.max(initial=high))
        except BrokenProcessPool:
            raise UserError("an encoding worker process died (out of memory?): "
                            "--data.workers=1 encodes in this one") from None
    if low == high:
        raise UserError(f"the text holds a single distinct token (id {high}, "
                        f"{tok.decode([high])!r}): there is nothing to learn to predict")
    return {"tokenizer": tok.meta(), "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name, "tokens": tokens, "bytes": nbytes}


def main(argv: list[str]) -> int:
    p = ArgumentParser(description="Prepare a text (a file, a folder or a quoted glob) "
                                   "into token files, cached in --root (safe to delete).")
    p.add_argument("path", metavar="source")
    root = Path(__file__).resolve().parent / "prepared"
    p.add_argument("--root", dest="prepared_dir", default=str(root))
    # as --tokenizer or train.py's --data.tokenizer (% is argparse's)
    for name in ("tokenizer", "val_fraction", "encoding_errors", "text_field", "val_path",
                 "workers"):
        field = DataConfig.__dataclass_fields__[name]
        flags = (f"--{name.replace('_', '-')}", f"--data.{name}")
        p.add_argument(*flags, dest=name, type=type(field.default), default=field.default,
                       help=field.metadata["help"].replace("%", "%%"))
    out = prepare(DataConfig(**vars(p.parse_args(argv))))
    tokens = load_meta(out)["tokens"]
    print(f"ready: {out} ({tokens['train']:,} train and {tokens['val']:,} val tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
