"""Progress on long work, on stderr: a tqdm bar on a terminal, and plain lines where stderr is a file (a
Slurm job's log, where a bar's carriage returns would be one endless line). Work that ends within DELAY
seconds shows nothing.

    with Progress(len(shards), "dcp2hf", "shards") as bar:
        for shard in shards:
            ...
            bar.update(1)
"""

import sys
import threading
import time

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
        self.note = ""  # after the numbers: "3/12 files"
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
            self.line()  # the end of what the log showed under way

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
