"""For the recovery tests: train.py on a node whose Hub reads keep timing out, as a node with a broken route to the
Hub sees it, with no test-only code in train.py. The loader's first read of its sources at start-up raises what
pretrain/sources.retry_or_raise raises once a timeout has outlasted every retry; then train.py runs as __main__, with
its own error line and exit code. The cluster's torchrun starts it in place of train.py (tests/test_slurm.py)."""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data  # noqa: E402
from pretrain import sources  # noqa: E402


def timed_out(loader):
    sources.retry_or_raise("c4", "allenai/c4", "reading hf://datasets/allenai/c4/en/c4-train.00000-of-01024.json.gz",
                           TimeoutError("The read operation timed out"), len(sources.RETRY_DELAYS))


data.DataLoader.check = timed_out
sys.argv[0] = os.path.join(ROOT, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
