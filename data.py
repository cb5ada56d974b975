"""Data: the Llama 3 tokenizer, per-source readers, a token-weighted mixture, packing, loader
workers, exact resume. Where each source's files are (the Hub, the manifest): pretrain/sources.py.

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
import queue
import random
import signal
import time
from typing import Optional

import fsspec
import pyarrow.parquet as pq

from pretrain.data_manifest import make_manifest, source_files
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
# Loader workers ignore these: the trainer handles them (save, then exit), then stops its workers.
USR1 = (signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ()  # Windows has no SIGUSR1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT) + USR1
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
    tokens (not documents) whatever the document lengths. A document split across windows is
    remembered by (source, reader state before it, offset): a restart re-reads one document at most.
    """

    def __init__(self, sources, files: list, tokenizer: Tokenizer, seq_len: int, *, stream: int,
                 num_streams: int, seed: int, timeout: float = HUB_TIMEOUT,
                 budget: float = math.inf, step=NO_STEP):
        total = sum(s.weight for s in sources)
        self.shares = [s.weight / total for s in sources]
        self.readers = [SourceReader(s, f, stream, num_streams, seed, timeout=timeout, budget=budget,
                                     step=step) for s, f in zip(sources, files)]
        self.tok = tokenizer
        self.seq_len = seq_len
        self.counts = [0] * len(sources)  # tokens emitted per source
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
                total = sum(self.counts) + 1
                # deficit = tokens a source should have by now minus tokens it has; ties go to the
                # first source
                self.cur = max(range(len(self.readers)),
                               key=lambda i: self.shares[i] * total - self.counts[i])
                self.doc, self.cur_state, self.positions[self.cur] = read(self.cur)
                self.offset = 0
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
        self.counts = list(sd["counts"])
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


def _worker(tokenizer_path: str, jobs: list, queues: dict, stop, parent: int, step):
    """Loader process: reads and tokenizes the documents of its (stream, source) pairs, in order,
    into one bounded queue per pair. Each document travels with its reader positions, so the trainer
    checkpoints exactly what it consumed, whatever was read ahead. SIGTERM/SIGUSR1/SIGINT are
    ignored (the trainer saves, then stops the workers); it ends when told, or when the trainer is
    gone (even by SIGKILL), not after an error: an exit drops what a full pipe has not taken."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # they were blocked from the fork to here, so none got through
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    tok = Tokenizer(tokenizer_path)
    readers = {}
    for key, spec, position in jobs:  # step is the trainer's loader's, in shared memory
        readers[key] = SourceReader(**spec, step=step)
        readers[key].load_state_dict(position)
    try:
        while not stop.is_set() and os.getppid() == parent:  # a new parent means the trainer died
            idle = True
            for key, r in readers.items():
                if not queues[key].full():
                    before = r.state_dict()
                    queues[key].put((tok.encode(r.next_text()), before, r.state_dict()))
                    idle = False
            if idle:
                time.sleep(0.002)
    except DataError as e:  # hand the one-line error to every queue, behind what is already in it
        undelivered = list(queues.values())
        while not stop.is_set() and os.getppid() == parent:
            for q in list(undelivered):
                if not q.full():  # nobody is waiting on a full queue yet: try again later
                    q.put(("error", str(e), e.fault))
                    undelivered.remove(q)
            time.sleep(0.01)
    for q in queues.values():  # exit without waiting to flush read-ahead nobody will read
        q.cancel_join_thread()


class Workers:
    """num_workers loader processes per rank; (stream, source) pairs are dealt out round-robin."""

    def __init__(self, streams: list, num_workers: int, step, prefetch: int = 64):
        ctx = multiprocessing.get_context("spawn")  # spawn, as the trainer has threads (gloo, OMP)
        pairs = [(s, i) for s in range(len(streams)) for i in range(len(streams[s].readers))]
        self.queues = {key: ctx.Queue(maxsize=prefetch) for key in pairs}
        self.stop = ctx.Event()
        self.procs = []
        self.pairs = pairs  # pair k goes to worker k % num_workers
        self.failed = {}  # (stream, source) -> its error
        self.names = [r.src.name for r in streams[0].readers]  # each source's name, for error lines
        self.step = step  # the loader's step deadline, in memory the workers share
        # A child inherits the signal mask: these stay blocked until the worker ignores them, so a
        # signal sent to every process of the job while a worker starts up cannot kill it. The
        # trainer's own come after.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for w in range(min(num_workers, len(pairs))):
                jobs = []  # what this worker's readers are made from, one per (stream, source) pair
                for s, i in pairs[w::num_workers]:
                    jobs.append(((s, i), streams[s].readers[i].spec(), streams[s].positions[i]))
                queues = {k: self.queues[k] for k, *_ in jobs}
                args = (streams[0].tok.path, jobs, queues, self.stop, os.getpid(), step)
                self.procs.append(ctx.Process(target=_worker, daemon=True, args=args))
                self.procs[-1].start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        # The trainer never puts: it closes its copy of each queue's write end, so a dead worker's
        # queue reads as ended (EOFError), never waiting for the rest of a message it was writing.
        for q in self.queues.values():
            q._writer.close()

    def get(self, s: int, i: int):
        """Source i's next document for stream s, as `PackedStream.read_doc` gives it."""
        if (s, i) in self.failed:
            raise DataError(*self.failed[(s, i)])
        asked = time.monotonic()
        while True:
            # past the step's end, the worker's own line (it names the file) has a second to come
            left = self.step[0] + 1 - time.monotonic()
            try:
                item = self.queues[(s, i)].get(timeout=min(5, max(left, 0.01)))
                break
            except (EOFError, OSError):  # its worker died, maybe mid-message: a fault of its node
                raise self.died(s, i)
            except queue.Empty:
                if left <= 0:  # a read is slow but not failing, or a worker is slow to start
                    raise DataError(self.too_long(s, i, time.monotonic() - asked), fault=True)
        if item[0] == "error":  # the worker has stopped: later reads of this pair fail at once
            self.failed[(s, i)] = item[1:]  # its line, and whether it is a fault
            raise DataError(*item[1:])
        return item

    def died(self, s: int, i: int) -> DataError:
        worker = self.procs[self.pairs.index((s, i)) % len(self.procs)]  # the worker dealt the pair
        worker.join(timeout=1)  # it closed its queues as it exited: its exit code comes next
        killed = worker.exitcode == -signal.SIGKILL  # the out-of-memory killer's signal
        how = "killed by SIGKILL: out of memory?" if killed else f"exit code {worker.exitcode}"
        self.failed[(s, i)] = (f"data loader worker {worker.pid} died ({how})", True)
        return DataError(*self.failed[(s, i)])

    def too_long(self, s: int, i: int, waited: float) -> str:
        seconds = self.step[1]
        return (f"data source {self.names[i]!r}: the reads of one step took longer than "
                f"comm.init_timeout_seconds = {seconds:g} s, how long the other ranks wait for this "
                f"one in a collective: stream {s}'s next document was {waited:.0f} s in coming from "
                "its loader worker; raise it to give the Hub longer")

    def close(self):
        # Nothing is drained: no worker waits to put, and a dead one's queue may end mid-message.
        self.stop.set()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()  # it ignores SIGTERM
                p.join(timeout=5)
        for q in self.queues.values():
            q.close()  # the read-ahead is thrown away
        # Dropping them lets their semaphores go now, not at interpreter exit.
        self.queues = {}
        self.procs = []


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
