"""Data: the Llama 3 tokenizer, per-source readers, a token-weighted mixture (per phase), packing,
exact resume. Where each source's files are (the Hub, the manifest): pretrain/sources.py; the loader
workers that read ahead: pretrain/loader_workers.py.

    python bench.py loader --config configs/debug_model.toml           # token shares, tokens/s
    python bench.py loader --config configs/debug_model.toml --show 2  # decode 2 packed samples
    python download_data.py --config C --world_size N --to DIR  # the files a run reads: a mirror

The stream is cut into `num_streams` logical streams that do not depend on how many GPUs read them:
stream s reads part s of every source, mixes the sources by tokens and packs them into windows of
seq_len + 1 tokens. Data-parallel rank r owns streams r*k .. r*k+k-1 (k = num_streams / dp), and a
global batch takes global_batch_size / num_streams windows from every stream, its rank's micro-batches
taking its streams in turn. So one process and N processes see the same global batch, and resuming
with another DP degree that divides num_streams is exact.
"""

import base64
import binascii
import contextlib
import functools
import io
import json
import logging
import math
import multiprocessing
import os
import random
import time
from typing import Optional

import fsspec
import pyarrow.parquet as pq

from pretrain.data_manifest import make_manifest, source_files
from pretrain.loader_workers import Workers
from pretrain.mirror import open_file
from pretrain.sources import HUB_TIMEOUT, MIB, NO_STEP, DataError, DataSource, HubFile, retry_or_raise


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

# Llama 3's pre-tokenizer splits text into contractions, words, 1-3 digit groups, punctuation runs
# and whitespace.
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL = 256
logger = logging.getLogger("data")


class Tokenizer:
    """Reads a Llama 3 `tokenizer.model` (tiktoken BPE ranks, one `base64 rank` per line).

    The 256 special tokens come right after the BPE ranks, named as in Llama 3.1, so the real
    tokenizer gives bos_id 128000 and eos_id 128001, and the bundled one 1792 and 1793.
    """

    def __init__(self, path: str):
        import tiktoken

        if not os.path.isfile(path):
            raise DataError(f"tokenizer file {path!r} not found; "
                            "download it with download_tokenizer.py or set --model.tokenizer_path")
        # Parsed here rather than with tiktoken.load, which caches files by path in /tmp.
        try:
            with open(path, "rb") as f:
                ranks = {base64.b64decode(tok, validate=True): int(rank)
                         for tok, rank in (line.split() for line in f if line.strip())}
        except (ValueError, binascii.Error) as e:  # a truncated download, or an HF tokenizer.json
            raise DataError(f"tokenizer file {path!r} is not a tiktoken BPE file "
                            f"(`base64 rank` lines): {e}")
        if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
            raise DataError(f"tokenizer file {path!r} has no tokens or non-contiguous ranks")
        n = len(ranks)
        named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                 "<|python_tag|>"]
        reserved = range(2, 2 + NUM_SPECIAL - len(named))  # the rest are numbered on from 2
        names = named + [f"<|reserved_special_token_{i}|>" for i in reserved]
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


class SourceReader:
    """Documents of one source for one logical stream, epoch after epoch.

    The files come from the run's manifest, (path or URL, size) sorted by name, and are read here
    (parquet by row group, json lines), so the position (epoch, file, row) is exact and a restart
    seeks straight to it. Each epoch shuffles the files with (seed, source, epoch), unless `ordered`
    (sorted: validation). Streams take every num_streams-th file when there are enough files,
    otherwise every num_streams-th row of every file.
    """

    def __init__(self, src: DataSource, files: list, stream: int, num_streams: int, seed: int, *,
                 ordered: bool = False, timeout: float = HUB_TIMEOUT, budget: float = math.inf,
                 step=NO_STEP):
        self.src = src
        self.stream = stream  # which of the num_streams streams this reader reads
        self.num_streams = num_streams
        self.seed = seed  # with the source and the epoch, it sets the order of the files
        self.ordered = ordered  # validation reads the files sorted, never shuffled
        self.timeout = timeout  # seconds a hub read may go without a byte before it is retried
        self.budget = budget  # seconds a failing read is retried from its start ([comm]'s timeout)
        self.step = step  # its loader's [end, seconds] of the step's reads (NO_STEP for none)
        self.files = [tuple(f) for f in files]
        self.epoch, self.file, self.row = 0, 0, 0  # the next document to read
        self.at = 0  # the row being read, for error messages
        self._it = None  # the document iterator
        self.error = None  # the DataError this reader stopped with: every later read raises it

    def spec(self) -> dict:
        """What a copy of this reader (a loader worker's, a probe's) is made from, with a step."""
        return {"src": self.src, "files": self.files, "stream": self.stream, "seed": self.seed,
                "num_streams": self.num_streams, "ordered": self.ordered, "timeout": self.timeout,
                "budget": self.budget}

    def _files(self) -> list:
        files = list(self.files)
        if not self.ordered:
            random.Random(f"{self.seed}/{self.src.name}/{self.epoch}").shuffle(files)
        return files[self.stream::self.num_streams] if len(files) >= self.num_streams else files

    def _rows(self, path: str, size: int, start: int):
        """(row, text) of a file from row `start`: parquet seeks by row group, json skips lines."""
        col = self.src.text_column
        self.at = start
        # parquet takes exact range reads, no read-ahead: the footer, then the row groups needed
        if path.endswith(".parquet"):
            with open_file(path, size, self.timeout, self.budget, self.src.name, self.step) as f:
                pf = pq.ParquetFile(f)
                first = 0  # the first row of row group g
                if col not in pf.schema_arrow.names:
                    raise DataError(f"data source {self.src.name!r}: no column {col!r} in {path} "
                                    f"(columns: {pf.schema_arrow.names}); set text_column")
                for g in range(pf.num_row_groups):
                    n = pf.metadata.row_group(g).num_rows
                    if first + n > start:
                        self.at = max(first, start)
                        texts = pf.read_row_group(g, columns=[col]).column(0).to_pylist()
                        rows = enumerate(texts, first)  # (row in the file, text)
                        yield from ((row, t) for row, t in rows if row >= start)
                    first += n
            return
        # json lines may be compressed (the extension says how); a hub file is read in 8 MiB ranges
        compression = fsspec.utils.infer_compression(path)
        with open_file(path, size, self.timeout, self.budget, self.src.name, self.step) as raw:
            f = io.BufferedReader(raw, 8 * MIB) if isinstance(raw, HubFile) else raw
            f = fsspec.compression.compr[compression](f, mode="rb") if compression else f
            for row, line in enumerate(f):
                if row >= start and line.strip():
                    doc = json.loads(line)
                    if col not in doc:
                        raise DataError(f"data source {self.src.name!r}: no key {col!r} in {path} "
                                        f"row {row} (keys: {sorted(doc)}); set text_column")
                    yield row, doc[col]
                self.at = row + 1

    def texts(self, one_pass: bool = False):
        """Yield texts from the current position on, keeping (epoch, file, row) up to date;
        `one_pass` stops at the end of the epoch. A Hub file retries a transient error itself, at
        the range where it broke (HubFile). Any other transient error re-opens the file at the row
        after the last document handed out, after a growing pause, so the stream is the same, while
        that can end within the budget from the start of the read. Anything else stops with one line
        naming the file and the row."""
        failures = 0  # failed tries in a row since the last document handed out
        started = time.monotonic()  # when the read of the next document began
        while True:
            files = self._files()
            whole_epoch = self.file == 0 and self.row == 0  # this pass starts at the epoch's start
            found = False  # whether this pass found a row of this stream
            by_rows = len(files) < self.num_streams  # with too few files, streams split the rows
            while self.file < len(files):
                try:
                    for row, text in self._rows(*files[self.file], self.row):
                        if not by_rows or row % self.num_streams == self.stream:
                            self.row = row + 1
                            found = True
                            failures = 0
                            yield text or ""
                            started = time.monotonic()  # the next document is asked for
                except Exception as e:
                    # a next try the Hub does not answer fails within one request's `timeout`
                    what = f"reading {files[self.file][0]} at row {self.at}"
                    retry_or_raise(self.src.name, self.src.path, what, e, failures, started=started,
                                   budget=self.budget, next_try=self.timeout, step=self.step)
                    failures += 1
                    continue
                self.file, self.row = self.file + 1, 0
            if whole_epoch and not found:
                raise DataError(f"data source {self.src.name!r} ({self.src.path}) has no rows "
                                f"for stream {self.stream} of {self.num_streams}")
            if one_pass:
                return
            self.epoch, self.file, self.row = self.epoch + 1, 0, 0

    def next_text(self) -> str:
        # a generator that raised is finished: the next read would be StopIteration
        if self.error is not None:
            raise self.error
        self._it = self._it or self.texts()
        try:
            return next(self._it)
        except DataError as e:
            self.error = e
            raise

    def state_dict(self):
        return {"epoch": self.epoch, "file": self.file, "row": self.row}

    def load_state_dict(self, sd):
        self.epoch, self.file, self.row = sd["epoch"], sd["file"], sd["row"]
        self._it = None
        self.error = None


def heldout_windows(src: DataSource, tokenizer: Tokenizer, seq_len: int,
                    limit: Optional[int] = None, manifest: Optional[dict] = None,
                    timeout: float = HUB_TIMEOUT, budget: float = math.inf) -> list:
    """The first `limit` (None: all) windows of seq_len + 1 tokens of one source, for validation:
    its files (from the manifest's validation sources; None: resolved now) in sorted order, read
    once from the start (no shuffle, no epochs), documents packed as in training. The same arguments
    give the same windows."""
    out = []  # the windows
    buf = []  # tokens not yet in a window
    files = source_files(manifest or make_manifest([], [src], timeout, budget), src, "validation")
    reader = SourceReader(src, files, stream=0, num_streams=1, seed=0, ordered=True, timeout=timeout,
                          budget=budget)
    for text in reader.texts(one_pass=True):
        buf += tokenizer.encode(text)
        while len(buf) > seq_len and (limit is None or len(out) < limit):
            out.append(buf[:seq_len + 1])
            buf = buf[seq_len + 1:]
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"validation source {src.name!r} has no complete sequence "
                        f"of seq_len+1 = {seq_len + 1} tokens")
    return out


# --------------------------------------------------------------------------------------------------
# Mixture, packing, loader workers
# --------------------------------------------------------------------------------------------------

class PackedStream:
    """One logical stream: token-weighted mixture of sources, packed into seq_len + 1 windows.

    The next document comes from the source furthest below its token share, so shares are met in
    tokens (not documents) whatever the document lengths. The shares count from the start of the
    phase (set_phase): a new mixture holds from the phase's first window, with no burst of one source
    catching up on the tokens it was owed before. A document split across windows is remembered by
    (source, reader state before it, offset): a restart re-reads one document at most.
    """

    def __init__(self, sources, files: list, tokenizer: Tokenizer, seq_len: int, *, stream: int,
                 num_streams: int, seed: int, timeout: float = HUB_TIMEOUT,
                 budget: float = math.inf, step=NO_STEP):
        self.shares = shares([s.weight for s in sources])
        self.readers = [SourceReader(s, f, stream, num_streams, seed, timeout=timeout, budget=budget,
                                     step=step) for s, f in zip(sources, files)]
        self.tok = tokenizer
        self.seq_len = seq_len
        self.counts = [0] * len(sources)  # tokens emitted per source
        self.phase = 0  # the phase (pretrain/phases.py) the shares are of
        self.phase_counts = [0] * len(sources)  # tokens emitted per source since the phase began
        # where each source's next document is
        self.positions = [r.state_dict() for r in self.readers]
        self.cur = None  # the source of the document being packed
        self.cur_state = None  # its reader's position before that document
        self.offset = 0  # tokens of the document already packed
        self.doc = []  # the document's tokens

    def read_doc(self, i: int):
        """(tokens, position before, position after) of source i's next document, read in this
        process."""
        before = self.readers[i].state_dict()
        tokens = self.tok.encode(self.readers[i].next_text())
        return tokens, before, self.readers[i].state_dict()

    def next_window(self, read=None) -> list:
        """The next seq_len + 1 tokens. `read(i)` gives source i's next document as `read_doc` does
        (the default); the loader passes its workers' queues instead."""
        read = read or self.read_doc
        out = []
        while len(out) < self.seq_len + 1:
            if self.offset >= len(self.doc):
                total = sum(self.phase_counts) + 1
                # deficit = tokens a source should have by now in this phase minus tokens it has;
                # ties go to the first source
                self.cur = max(range(len(self.readers)),
                               key=lambda i: self.shares[i] * total - self.phase_counts[i])
                self.doc, self.cur_state, self.positions[self.cur] = read(self.cur)
                self.offset = 0
            take = self.doc[self.offset:self.offset + self.seq_len + 1 - len(out)]
            out += take
            self.offset += len(take)
            self.counts[self.cur] += len(take)
            self.phase_counts[self.cur] += len(take)
        return out

    def set_phase(self, phase: int, seq_len: int, weights: list):
        """From the next window: windows of seq_len + 1 tokens, and the mixture `weights` counted
        from here if `phase` is a new one (a resume inside a phase keeps its counts). The document
        being packed goes on where it was cut, whatever its source's new weight."""
        if phase != self.phase:
            self.phase, self.phase_counts = phase, [0] * len(self.readers)
        self.seq_len = seq_len
        self.shares = shares(weights)

    def state_dict(self):
        return {"readers": [dict(p) for p in self.positions], "counts": list(self.counts),
                "cur": self.cur, "cur_state": self.cur_state, "offset": self.offset,
                "phase": self.phase, "phase_counts": list(self.phase_counts)}

    def load_state_dict(self, sd):
        for r, rsd in zip(self.readers, sd["readers"]):
            r.load_state_dict(rsd)
        # a source appended at a resume (for a phase to come) starts at its beginning, unread
        new = len(self.readers) - len(sd["readers"])
        self.positions = [dict(p) for p in sd["readers"]] + self.positions[len(sd["readers"]):]
        self.counts = list(sd["counts"]) + [0] * new
        # checkpoints from before phases hold one mixture, counted from step 0
        self.phase = sd.get("phase", 0)
        self.phase_counts = list(sd.get("phase_counts", sd["counts"])) + [0] * new
        self.cur = sd["cur"]
        self.offset = sd["offset"]
        self.cur_state = sd["cur_state"]
        self.doc = []
        if self.cur is not None:  # re-read the document we were inside of
            reader = self.readers[self.cur]
            reader.load_state_dict(self.cur_state)
            self.doc = self.tok.encode(reader.next_text())
            moved = "re-reading the current document moved the reader"
            assert reader.state_dict() == self.positions[self.cur], moved


def shares(weights: list) -> list:
    """Each source's share of the tokens."""
    total = sum(weights)
    return [w / total for w in weights]


class DataLoader:
    """Batches for one data-parallel rank: (inputs, labels), each (local_batch_size, seq_len)."""

    def __init__(self, sources, tokenizer, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_degree: int, *, num_streams: int = 0, seed: int = 0, num_workers: int = 0,
                 manifest: Optional[dict] = None, timeout: float = HUB_TIMEOUT,
                 budget: float = math.inf):
        num_streams = num_streams or dp_degree
        if num_streams % dp_degree:
            raise DataError(f"data.num_streams={num_streams} must be a multiple of the "
                            f"data-parallel degree {dp_degree}")
        per_rank = num_streams // dp_degree
        self.names = [s.name for s in sources]
        self.stream_ids = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        manifest = manifest or make_manifest(sources, (), timeout, budget)  # None is resolved here
        files = [source_files(manifest, s) for s in sources]
        # [end, seconds] of a step's reads (reads_within), in memory the loader workers share
        self.step = multiprocessing.get_context("spawn").RawArray("d", [math.inf, math.inf])
        self.streams = [PackedStream(sources, files, tokenizer, seq_len, stream=s, seed=seed,
                                     num_streams=num_streams, timeout=timeout, budget=budget,
                                     step=self.step) for s in self.stream_ids]
        # A stream gives `turn` windows in a row, then the next one: where local_batch_size is a
        # multiple of the streams, each micro-batch takes the same from each (the layout before
        # resizing); else the micro-batches take the streams one window each, in turn.
        self.turn = 1 if local_batch_size % per_rank else local_batch_size // per_rank
        self.at = 0  # windows taken in this round of turns; 0 at a step's end (train.validate's rule)
        self.local_batch_size = local_batch_size
        self.num_workers = num_workers
        self.workers = None
        self.budget = budget  # seconds a batch's reads may take in all (reads_within)

    def check(self):
        """Read the next document of every (stream, source), in this process and in a copy (the
        stream is untouched): call it before the first step (after a resume) on every rank, so a
        missing or unreadable source is a DataError there, not inside a step."""
        for st in self.streams:
            for r, position in zip(st.readers, st.positions):
                probe = SourceReader(**r.spec(), step=self.step)
                probe.load_state_dict(position)
                probe.next_text()

    def __iter__(self):
        return self

    def __next__(self):
        # workers start late, after a resume has set the positions
        if self.num_workers and self.workers is None:
            self.workers = Workers(self.streams, self.num_workers, self.step)
        reads = [None] * len(self.streams)  # None means each stream reads in this process
        if self.workers:
            reads = [functools.partial(self.workers.get, s) for s in range(len(self.streams))]
        rows = []
        with self.reads_within():
            while len(rows) < self.local_batch_size:
                s = self.at // self.turn  # whose turn it is
                rows.append(self.streams[s].next_window(reads[s]))
                self.at = (self.at + 1) % (self.turn * len(self.streams))
        import torch  # here, not at the top: loader workers never need it and start a second sooner
        batch = torch.tensor(rows, dtype=torch.long)  # (local_batch_size, seq_len + 1)
        return batch[:, :-1], batch[:, 1:]

    @contextlib.contextmanager
    def reads_within(self):
        """Every Hub read and retry inside the block, here and in the loader workers, ends within
        the loader's budget (comm.init_timeout_seconds) of its start, in all, or stops with one
        DataError line: the other ranks wait for this one in a collective, and slow retries, each
        within its own budget, add up. An enclosing block's end holds (train.read_step's)."""
        if self.step[0] != math.inf:  # this is inside an enclosing block
            yield
            return
        self.step[:] = [time.monotonic() + self.budget, self.budget]
        try:
            yield
        finally:
            self.step[0] = math.inf

    def close(self):
        """Stop the workers; a later batch starts new ones at the positions consumed so far."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def set_phase(self, phase: int, seq_len: int, weights: list):
        """Every stream's windows and mixture from the next batch on (PackedStream.set_phase)."""
        for st in self.streams:
            st.set_phase(phase, seq_len, weights)

    def source_tokens(self) -> dict:
        return {n: sum(st.counts[i] for st in self.streams) for i, n in enumerate(self.names)}

    def state_dict(self) -> dict:
        """Per logical stream, keyed by stream id: a run on another DP degree picks up its own."""
        assert self.at == 0, "a resume is exact at a step's end, after a whole round of turns"
        return {s: st.state_dict() for s, st in zip(self.stream_ids, self.streams)}

    def load_state_dict(self, sd: dict):
        assert self.workers is None, "load the state before the first batch"
        for s, st in zip(self.stream_ids, self.streams):
            st.load_state_dict(sd[s])
