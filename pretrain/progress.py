"""How far work has got. A training run's clock (RunClock): its elapsed time and ETA, for the log line.
And progress on long work, on stderr: a tqdm bar on a terminal, and plain lines where stderr is a file
(a Slurm job's log, where a bar's carriage returns would be one endless line). Work that ends within
DELAY seconds shows nothing.

    with Progress(len(shards), "dcp2hf", "shards") as bar:
        for shard in shards:
            ...
            bar.update(1)
"""

import collections
import contextlib
import sys
import threading
import time
import types

from tqdm import tqdm

DELAY = 3.0  # seconds before anything shows
EVERY = 15.0  # seconds between two plain lines


def amount(n: float, unit: str) -> str:
    """1,234 files, or 1.5 GiB for bytes."""
    if unit != "B":
        return f"{n:,.0f} {unit}"
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {name}"
    return f"{n:.0f} B"


class Progress:
    """`total` things in `unit` (B: bytes, shown as KiB to GiB). update() may come from several threads
    (download_data.py's fetches)."""

    def __init__(self, total: float, desc: str, unit: str = "it"):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = 0
        self.note = ""  # shown after the numbers, e.g. "3/12 files"
        self.start = time.monotonic()
        self.shown = self.start  # when the last plain line was
        self.lock = threading.Lock()
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                            delay=DELAY, file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        elif time.monotonic() - self.start >= DELAY and self.shown != self.start:
            self.line()  # a last line ends what the log showed under way

    def update(self, n: float = 1, total: float = None, note: str = None):
        """n more done; total: a new total (work found done already); note: the text after the numbers."""
        with self.lock:
            self.done += n
            self.total = self.total if total is None else total
            self.note = self.note if note is None else note
            if self.bar is not None:
                self.bar.total = self.total
                if note is not None:
                    self.bar.set_postfix_str(note, refresh=False)
                self.bar.update(n)
                return
            now = time.monotonic()
            if now - self.start >= DELAY and (now - self.shown >= EVERY or self.shown == self.start):
                self.line()

    def line(self):
        now = time.monotonic()
        self.shown = now
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        note = f", {self.note}" if self.note else ""
        text = f"{self.desc}: {amount(self.done, self.unit)} of {amount(self.total, self.unit)}{share}{note}"
        print(f"{text}, {now - self.start:.0f} s", file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """12m05s, 1h02m, 2d03h: the log line's elapsed time and ETA."""
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class RunClock:
    """This launch's elapsed time, and its ETA to training.steps: the recent steps' training time for
    each step left, plus the validation, eval and checkpoint rounds still due, each at the cost its
    last round took (a round not yet run counts nothing). The rounds are timed apart (timed), so the
    log line's tps and the steps' time leave them out (lap)."""

    def __init__(self, steps: int, every: dict, now=time.perf_counter):
        """steps: training.steps; every: {"validation", "eval", "checkpoint": steps between two
        rounds, 0: none} (train.validate's sizes["rounds"])."""
        self.now = now
        self.start = now()
        self.steps = steps
        self.every = dict(every)
        self.cost = {}  # kind -> its last round's seconds
        self.spent = dict.fromkeys([*self.every, "rewind"], 0.0)  # kind -> all its rounds' seconds
        self.mark = self.start  # where the steps of the next lap began
        self.paused = 0.0  # the rounds' seconds since then
        self.laps = collections.deque(maxlen=9)  # (steps, training seconds) of the recent laps

    @contextlib.contextmanager
    def timed(self, kind: str):
        """`with clock.timed("validation") as took:` a round; took.seconds once it ends."""
        took = types.SimpleNamespace(seconds=0.0)
        t0 = self.now()
        yield took
        took.seconds = self.now() - t0
        self.cost[kind] = took.seconds
        self.spent[kind] += took.seconds
        self.paused += took.seconds

    def lap(self, steps: int) -> float:
        """The training seconds of the `steps` since the last lap, its rounds left out (lap(0): the
        laps start here)."""
        now = self.now()
        seconds = now - self.mark - self.paused
        self.mark = now
        self.paused = 0.0
        if steps:
            self.laps.append((steps, seconds))
        return seconds

    def rounds(self) -> str:
        """The `done:` line's account of the rounds' time (rewinds only where there were any)."""
        s = self.spent
        rewinds = f"rewinds {s['rewind']:.1f}s, " if s["rewind"] else ""  # their reloads' seconds
        return (f"validation {s['validation']:.1f}s, evals {s['eval']:.1f}s, {rewinds}"
                f"saves {s['checkpoint']:.1f}s")

    def due(self, kind: str, step: int) -> int:
        """Rounds of `kind` at `step` and after (every `every` steps, and at the last step): a step's
        rounds come after its log line."""
        every = self.every[kind]
        if not every:
            return 0
        return self.steps // every - (step - 1) // every + (self.steps % every != 0)

    def times(self, step: int) -> dict:
        """At `step`'s log line: elapsed_seconds and eta_seconds."""
        recent = list(self.laps)[1:] or list(self.laps)  # lap 1 holds start-up, compile, warm-up
        steps = sum(n for n, _ in recent)
        per_step = sum(s for _, s in recent) / steps if steps else 0.0
        rounds = sum(self.due(kind, step) * self.cost.get(kind, 0.0) for kind in self.every)
        eta = (self.steps - step) * per_step + rounds
        return {"elapsed_seconds": self.now() - self.start, "eta_seconds": eta}
