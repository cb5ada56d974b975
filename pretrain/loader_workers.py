"""Loader workers: processes that read and tokenize each (stream, source) pair's documents ahead of
the trainer, into one bounded queue per pair (data.DataLoader starts them with data.num_workers > 0).
Each document travels with its reader's positions, so the trainer checkpoints what it consumed,
whatever was read ahead, and the stream is the same with or without workers."""

import multiprocessing
import os
import queue
import signal
import time

from pretrain.sources import DataError

# Loader workers ignore these: the trainer handles them (save, then exit), then stops its workers.
USR1 = (signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ()  # Windows has no SIGUSR1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT) + USR1


def _worker(tokenizer, reader, jobs: list, queues: dict, stop, parent: int, step):
    """Loader process: reads (reader: data.SourceReader) and tokenizes (tokenizer: data.Tokenizer
    and its file) the documents of its (stream, source) pairs, in order, into one bounded queue per
    pair. Each document travels with its reader positions, so the trainer
    checkpoints exactly what it consumed, whatever was read ahead. SIGTERM/SIGUSR1/SIGINT are
    ignored (the trainer saves, then stops the workers); it ends when told, or when the trainer is
    gone (even by SIGKILL), not after an error: an exit drops what a full pipe has not taken."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # they were blocked from the fork to here, so none got through
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    tok = tokenizer[0](tokenizer[1])
    readers = {}
    for key, spec, position in jobs:  # step is the trainer's loader's, in shared memory
        readers[key] = reader(**spec, step=step)
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
                # data.py's Tokenizer (from its file) and SourceReader: this module does not import data.py,
                # which imports it; the worker process imports them by name
                tokenizer, reader = (type(streams[0].tok), streams[0].tok.path), type(streams[0].readers[0])
                args = (tokenizer, reader, jobs, queues, self.stop, os.getpid(), step)
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
