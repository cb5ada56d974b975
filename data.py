"""Data: Llama 3 tokenizer, per-source streaming readers, a token-weighted mixture, and packing.

    python data.py --config configs/debug_model.toml            # realised token shares, loader tokens/s
    python data.py --config configs/debug_model.toml --show 2   # decode 2 packed samples

The stream is cut into `num_streams` logical streams that do not depend on how many GPUs read them:
stream s reads part s of every source, mixes the sources by tokens and packs them into windows of
seq_len + 1 tokens. Data-parallel rank r owns streams r*k .. r*k+k-1 (k = num_streams / dp), and a
global batch takes the same number of windows from every stream. So one process and N processes see
the same global batch, and resuming with another DP degree that divides num_streams is exact.
"""

import base64
import binascii
import json
import logging
import os
import queue
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

import fsspec
import pyarrow.parquet as pq
import torch


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------

# Llama 3's pre-tokenizer split: contractions, words, 1-3 digit groups, punctuation runs, whitespace.
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL = 256
# Pauses before re-opening a file after a transient read error (about 4 minutes in all, then stop).
RETRY_DELAYS = (1, 2, 4, 8, 16, 32, 60, 60, 60)
logger = logging.getLogger("data")


class DataError(ValueError):
    """A problem with the user's tokenizer or data (not a bug): train.py reports it in one line."""


class Tokenizer:
    """Reads a Llama 3 `tokenizer.model` (tiktoken BPE ranks, one `base64 rank` per line).

    The 256 special tokens come right after the BPE ranks, named as in Llama 3.1, so the real
    tokenizer gives bos_id 128000 and eos_id 128001, and the bundled one 1792 and 1793.
    """

    def __init__(self, path: str):
        import tiktoken

        if not os.path.isfile(path):
            raise DataError(f"tokenizer file {path!r} not found; download it with download_tokenizer.py "
                             "or set --model.tokenizer_path")
        # Parsed here rather than with tiktoken.load, which caches files by path in /tmp.
        try:
            with open(path, "rb") as f:
                ranks = {base64.b64decode(tok, validate=True): int(rank)
                         for tok, rank in (line.split() for line in f if line.strip())}
        except (ValueError, binascii.Error) as e:  # a truncated download, or an HF tokenizer.json
            raise DataError(f"tokenizer file {path!r} is not a tiktoken BPE file (`base64 rank` lines): {e}")
        if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
            raise DataError(f"tokenizer file {path!r} has no tokens or non-contiguous ranks")
        n = len(ranks)
        named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        names = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL - len(named))]
        self.special = {name: n + i for i, name in enumerate(names)}
        self.path = path  # loader workers build their own copy from it
        self.model = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PAT,
                                       mergeable_ranks=ranks, special_tokens=self.special)
        self.n_words = n + NUM_SPECIAL
        self.bos_id = self.special["<|begin_of_text|>"]
        self.eos_id = self.special["<|end_of_text|>"]

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list:
        # Special-token strings inside web text are encoded as plain text, never as control tokens.
        ids = self.model.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return self.model.decode(list(ids))


# ---------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------

@dataclass
class DataSource:
    name: str = ""  # label used in logs and metrics.jsonl
    path: str = ""  # hub dataset id (allenai/c4) or a local folder with json/json.gz/jsonl/parquet
    config: Optional[str] = None  # hub config name (e.g. "en"), optional
    data_files: Optional[str] = None  # glob relative to path, optional
    split: str = "train"  # dataset split
    revision: Optional[str] = None  # pinned hub revision (commit sha or tag), optional
    text_column: str = "text"  # column holding the document text
    weight: float = 1.0  # share of tokens (normalised over all sources)


class SourceReader:
    """Documents of one source for one logical stream, epoch after epoch.

    `datasets` resolves (path, config, data_files, split, revision) to a file list, the same way for a
    hub id and a local folder; the files are then read here (parquet by row group, json lines), so the
    position (epoch, file, row) is exact and a restart seeks straight to it. Each epoch shuffles the
    files with (seed, source, epoch). Streams take every num_streams-th file when there are enough
    files, otherwise every num_streams-th row of every file.
    """

    def __init__(self, src: DataSource, stream: int, num_streams: int, seed: int):
        self.src, self.stream, self.num_streams, self.seed = src, stream, num_streams, seed
        self.epoch, self.file, self.row = 0, 0, 0  # the next document to read
        self._all_files, self._it = None, None

    def _files(self) -> list:
        if self._all_files is None:
            from datasets import load_dataset_builder
            s = self.src
            try:
                builder = load_dataset_builder(s.path, name=s.config, data_files=s.data_files, revision=s.revision)
                self._all_files = sorted(builder.config.data_files[s.split])
            except (FileNotFoundError, KeyError) as e:  # also DataFilesNotFoundError, EmptyDatasetError
                raise DataError(f"data source {s.name!r}: no {s.split!r} files for path={s.path!r} "
                                f"data_files={s.data_files!r} ({type(e).__name__}: {e})".replace("\n", " "))
        files = list(self._all_files)
        random.Random(f"{self.seed}/{self.src.name}/{self.epoch}").shuffle(files)
        return files[self.stream::self.num_streams] if len(files) >= self.num_streams else files

    def _rows(self, path: str, start: int):
        """(row, text) of one file from row `start` on: parquet seeks by row group, json skips lines."""
        col = self.src.text_column
        with fsspec.open(path, "rb", compression="infer") as f:
            if path.endswith(".parquet"):
                pf = pq.ParquetFile(f)
                if col not in pf.schema_arrow.names:
                    raise DataError(f"data source {self.src.name!r}: no column {col!r} in {path} (columns: "
                                    f"{pf.schema_arrow.names}); set text_column")
                first = 0
                for g in range(pf.num_row_groups):
                    n = pf.metadata.row_group(g).num_rows
                    if first + n > start:
                        texts = pf.read_row_group(g, columns=[col]).column(0).to_pylist()
                        yield from ((first + i, t) for i, t in enumerate(texts) if first + i >= start)
                    first += n
            else:  # json lines, plain or compressed (the extension tells fsspec which)
                for row, line in enumerate(f):
                    if row >= start and line.strip():
                        doc = json.loads(line)
                        if col not in doc:
                            raise DataError(f"data source {self.src.name!r}: no key {col!r} in {path} row "
                                            f"{row} (keys: {sorted(doc)}); set text_column")
                        yield row, doc[col]

    def _documents(self):
        """Yield texts from the current position on, keeping (epoch, file, row) up to date.

        A transient read error (connection reset, timeout, HTTP 429/5xx) re-opens the file at the
        position after the last document handed out, after a growing pause, so the stream is the
        same; after RETRY_DELAYS are used up without progress the run stops with one line."""
        failures = 0
        while True:
            files, whole_epoch, found = self._files(), self.file == 0 and self.row == 0, False
            by_rows = len(self._all_files) < self.num_streams  # too few files: split rows instead
            while self.file < len(files):
                try:
                    for row, text in self._rows(files[self.file], self.row):
                        if by_rows and row % self.num_streams != self.stream:
                            continue
                        self.row, found, failures = row + 1, True, 0
                        yield text or ""
                except (DataError, FileNotFoundError, PermissionError, IsADirectoryError):
                    raise
                except Exception as e:
                    status = getattr(getattr(e, "response", None), "status_code", None)
                    if not isinstance(e, OSError) or status in (401, 403, 404) or failures == len(RETRY_DELAYS):
                        raise DataError(f"data source {self.src.name!r}: reading {files[self.file]} at row "
                                        f"{self.row} failed{f' {failures + 1} times' if failures else ''} "
                                        f"({type(e).__name__}: {str(e)[:200]})".replace("\n", " ")) from e
                    logger.warning(f"data source {self.src.name!r}: {type(e).__name__} reading {files[self.file]};"
                                   f" retrying from row {self.row} in {RETRY_DELAYS[failures]} s")
                    time.sleep(RETRY_DELAYS[failures])
                    failures += 1
                    continue
                self.file, self.row = self.file + 1, 0
            if whole_epoch and not found:
                raise DataError(f"data source {self.src.name!r} ({self.src.path}) has no rows for stream "
                                f"{self.stream} of {self.num_streams}")
            self.epoch, self.file, self.row = self.epoch + 1, 0, 0

    def next_text(self) -> str:
        if self._it is None:
            self._it = self._documents()
        return next(self._it)

    def state_dict(self):
        return {"epoch": self.epoch, "file": self.file, "row": self.row}

    def load_state_dict(self, sd):
        self.epoch, self.file, self.row, self._it = sd["epoch"], sd["file"], sd["row"], None


# ---------------------------------------------------------------------------------------------------
# Mixture and packing
# ---------------------------------------------------------------------------------------------------

class PackedStream:
    """One logical stream: token-weighted mixture of sources, packed into seq_len + 1 windows.

    The next document comes from the source furthest below its token share, so shares are met in
    tokens (not documents) whatever the document lengths. A document split across windows is
    remembered by (source, reader state before it, offset): a restart re-reads one document at most.
    """

    def __init__(self, sources, tokenizer: Tokenizer, seq_len: int, stream: int, num_streams: int, seed: int):
        total = sum(s.weight for s in sources)
        self.shares = [s.weight / total for s in sources]
        self.readers = [SourceReader(s, stream, num_streams, seed) for s in sources]
        self.tok, self.seq_len = tokenizer, seq_len
        self.counts = [0] * len(sources)  # tokens emitted per source
        self.positions = [r.state_dict() for r in self.readers]  # per source: where its next document is
        self.cur, self.cur_state, self.offset, self.doc = None, None, 0, []
        self.feed = self.read_doc  # replaced by a worker queue when the loader has workers

    def read_doc(self, i: int):
        """(tokens, position before, position after) of source i's next document, in this process."""
        before = self.readers[i].state_dict()
        tokens = self.tok.encode(self.readers[i].next_text())
        return tokens, before, self.readers[i].state_dict()

    def _next_doc(self):
        total = sum(self.counts) + 1
        # deficit = tokens a source should have by now minus tokens it has; ties go to the first source
        self.cur = max(range(len(self.readers)), key=lambda i: self.shares[i] * total - self.counts[i])
        self.doc, self.cur_state, self.positions[self.cur] = self.feed(self.cur)
        self.offset = 0

    def next_window(self) -> list:
        out = []
        while len(out) < self.seq_len + 1:
            if self.offset >= len(self.doc):
                self._next_doc()
            take = self.doc[self.offset:self.offset + self.seq_len + 1 - len(out)]
            out += take
            self.offset += len(take)
            self.counts[self.cur] += len(take)
        return out

    def state_dict(self):
        return {"readers": [dict(p) for p in self.positions], "counts": list(self.counts),
                "cur": self.cur, "cur_state": self.cur_state, "offset": self.offset}

    def load_state_dict(self, sd):
        for r, rsd in zip(self.readers, sd["readers"]):
            r.load_state_dict(rsd)
        self.positions = [dict(p) for p in sd["readers"]]
        self.counts, self.cur, self.offset = list(sd["counts"]), sd["cur"], sd["offset"]
        self.cur_state, self.doc = sd["cur_state"], []
        if self.cur is not None:  # re-read the document we were inside of
            reader = self.readers[self.cur]
            reader.load_state_dict(self.cur_state)
            self.doc = self.tok.encode(reader.next_text())
            assert reader.state_dict() == self.positions[self.cur], "re-reading the current document moved the reader"


def _worker(tokenizer_path: str, jobs: list, queues: dict, stop):
    """Loader process: reads and tokenizes the documents of its (stream, source) pairs, in order, into
    one bounded queue per pair. Each document travels with its reader positions, so the training
    process checkpoints exactly what it consumed, whatever the workers have read ahead."""
    tok, parent = Tokenizer(tokenizer_path), os.getppid()
    readers = {}
    for key, src, stream, num_streams, seed, position in jobs:
        readers[key] = SourceReader(src, stream, num_streams, seed)
        readers[key].load_state_dict(position)
    try:
        while not stop.is_set():
            idle = True
            for key, r in readers.items():
                if not queues[key].full():
                    before = r.state_dict()
                    tokens = tok.encode(r.next_text())
                    queues[key].put((tokens, before, r.state_dict()))
                    idle = False
            if idle:
                if os.getppid() != parent:  # the trainer is gone (even by SIGKILL): stop too
                    return
                time.sleep(0.002)
    except DataError as e:  # hand the one-line error to every queue, behind what is already in it
        undelivered = list(queues.values())
        while undelivered and not stop.is_set():
            for q in list(undelivered):
                try:
                    q.put_nowait(("error", str(e)))
                    undelivered.remove(q)
                except queue.Full:  # nobody is waiting on a full queue yet: try again later
                    pass
            time.sleep(0.01)


class Workers:
    """num_workers loader processes per rank; (stream, source) pairs are dealt out round-robin."""

    def __init__(self, streams: list, num_workers: int, prefetch: int = 64):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")  # not fork: the trainer process has threads (gloo, OMP, arrow)
        pairs = [(s, i) for s in range(len(streams)) for i in range(len(streams[s].readers))]
        self.queues = {key: ctx.Queue(maxsize=prefetch) for key in pairs}
        self.stop = ctx.Event()
        self.procs = []
        for w in range(min(num_workers, len(pairs))):
            jobs = [(key, streams[key[0]].readers[key[1]].src, streams[key[0]].readers[key[1]].stream,
                     streams[key[0]].readers[key[1]].num_streams, streams[key[0]].readers[key[1]].seed,
                     streams[key[0]].positions[key[1]]) for key in pairs[w::num_workers]]
            proc = ctx.Process(target=_worker, daemon=True,
                               args=(streams[0].tok.path, jobs, {k: self.queues[k] for k, *_ in jobs}, self.stop))
            proc.start()
            self.procs.append(proc)
        for s, st in enumerate(streams):
            st.feed = lambda i, s=s: self.get((s, i))

    def get(self, key):
        while True:
            try:
                item = self.queues[key].get(timeout=5)
                break
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise DataError(f"data loader worker {dead[0].pid} died (exit code {dead[0].exitcode})")
        if item[0] == "error":
            raise DataError(item[1])
        return item

    def close(self):
        self.stop.set()
        for q in self.queues.values():  # unblock a worker waiting to put
            try:
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
        for q in self.queues.values():
            q.cancel_join_thread()  # the read-ahead is thrown away, not flushed
            q.close()
        self.queues, self.procs = {}, []  # lets their semaphores go now, not at interpreter exit


class DataLoader:
    """Batches for one data-parallel rank: (inputs, labels), each (local_batch_size, seq_len)."""

    def __init__(self, sources, tokenizer, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_degree: int, num_streams: int = 0, seed: int = 0, num_workers: int = 0):
        num_streams = num_streams or dp_degree
        if num_streams % dp_degree or local_batch_size % (num_streams // dp_degree):
            raise DataError(f"data.num_streams={num_streams} must be a multiple of the data-parallel "
                             f"degree {dp_degree}, and local_batch_size={local_batch_size} a multiple "
                             f"of the streams per rank ({num_streams // max(dp_degree, 1)})")
        per_rank = num_streams // dp_degree
        self.names = [s.name for s in sources]
        self.streams = [PackedStream(sources, tokenizer, seq_len, s, num_streams, seed)
                        for s in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)]
        self.per_stream = local_batch_size // per_rank
        self.stream_ids = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        self.num_workers, self.workers = num_workers, None

    def __iter__(self):
        return self

    def __next__(self):
        if self.num_workers and self.workers is None:  # started late: after a resume set the positions
            self.workers = Workers(self.streams, self.num_workers)
        rows = [st.next_window() for st in self.streams for _ in range(self.per_stream)]
        batch = torch.tensor(rows, dtype=torch.long)  # (local_batch_size, seq_len + 1)
        return batch[:, :-1], batch[:, 1:]

    def check(self):  # TEMP stub until the data branch lands
        for st in self.streams:
            for r in st.readers:
                files = r._files()
                if files:
                    next(r._rows(files[0], 0), None)

    def close(self):
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            for st in self.streams:
                st.feed = None  # the stream cannot go on without its workers

    def source_tokens(self) -> dict:
        return {n: sum(st.counts[i] for st in self.streams) for i, n in enumerate(self.names)}

    def state_dict(self) -> dict:
        """Per logical stream, keyed by stream id: a run on another DP degree picks up its own."""
        return {s: st.state_dict() for s, st in zip(self.stream_ids, self.streams)}

    def load_state_dict(self, sd: dict):
        assert self.workers is None, "load the state before the first batch"
        for s, st in zip(self.stream_ids, self.streams):
            st.load_state_dict(sd[s])


def heldout_windows(src, tokenizer, seq_len, limit=None):  # TEMP stub until the data branch lands
    reader = SourceReader(src, 0, 1, 0)
    reader._files()
    out, buf = [], []
    for path in reader._all_files:
        for _, text in reader._rows(path, 0):
            buf += tokenizer.encode(text or "")
            while len(buf) >= seq_len + 1:
                out.append(buf[:seq_len + 1])
                buf = buf[seq_len + 1:]
                if limit is not None and len(out) >= limit:
                    return out
    if not out:
        raise DataError(f"validation source {src.name!r} has no complete sequence")
    return out


def main():
    import argparse
    import train

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--show", type=int, default=0, help="decode this many packed samples")
    p.add_argument("--tokens", type=int, default=1_000_000, help="tokens to read for the statistics")
    args, rest = p.parse_known_args()
    cfg = train.load_config(rest)
    tok = Tokenizer(cfg.model.tokenizer_path)
    loader = DataLoader(cfg.data.sources, tok, cfg.training.seq_len, 1, 0, 1, 1, cfg.data.seed,
                        cfg.data.num_workers)
    if args.show:
        for i in range(args.show):
            x, _ = next(loader)
            print(f"--- sample {i} ({x.shape[1]} tokens) ---\n{tok.decode(x[0].tolist())}")
        loader.close()
        return
    t0 = time.perf_counter()
    next(loader)  # the first batch pays for starting workers and opening files: timed on its own
    first, t0, n = time.perf_counter() - t0, time.perf_counter(), 0
    while n < args.tokens:
        x, _ = next(loader)
        n += x.numel()
    dt = time.perf_counter() - t0
    counts = loader.source_tokens()
    total = sum(counts.values())
    weights = {s.name: s.weight / sum(x.weight for x in cfg.data.sources) for s in cfg.data.sources}
    for name, c in counts.items():
        print(f"{name:>16}: {c:>10,} tokens  share {c / total:6.2%}  (weight {weights[name]:6.2%})")
    loader.close()
    workers = f"{cfg.data.num_workers} worker(s)" if cfg.data.num_workers else "no workers"
    print(f"loader: {n:,} tokens in {dt:.2f}s = {n / dt:,.0f} tokens/s after a first batch in {first:.2f}s "
          f"(one stream, {workers})")


if __name__ == "__main__":
    from train import ConfigError  # train.py imports this module; importing it back is fine here

    try:
        main()
    except (ConfigError, DataError) as e:  # the user's input, not a bug: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
