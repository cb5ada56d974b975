"""Which kind of failure ended a run, and its exit code. Each is one `error:` line:
- 2, the user's: a config, command line, tokenizer, data source or checkpoint path that a person
  must fix, found at start-up or mid-run. A restart would only repeat it, so none is made.
- 3, the run's: skipped steps in a row, a failed final save, a rank that stopped answering
  (lost_rank).
- 4, a fault of the infrastructure or of one node: a Hub that kept failing, a node that lacks the
  data's files or sees a stale checkpoint folder, a loader worker that died (the out-of-memory
  killer's SIGKILL). A restart may succeed; one node named in the line (`error: node NAME: ...`) is
  left out of it (slurm/multinode.sbatch and recover.py).
A bug keeps its traceback (exit 1)."""

import os
import re
import socket
import traceback

# the repository's root; lost_rank names the frames of its files (train.py, model.py, pretrain/)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = (ROOT, os.path.join(ROOT, "pretrain"))
USER, RUN, FAULT = 2, 3, 4


class Fault(RuntimeError):
    """A fault of the infrastructure or of one node: one line, exit 4. A DataError or
    CheckpointError is one too when its .fault is True (a Hub that kept failing, a wait that ran
    out), or "node" (a node's own view, a file it lacks) when not every node saw it: on every
    node, it is the user's."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (incomplete, another model, another run): one line, exit
    code 2; fault: as Fault says."""

    def __init__(self, line: str, fault: bool = False):
        super().__init__(line)
        self.fault = fault


def is_fault(e: BaseException) -> bool:
    return isinstance(e, Fault) or getattr(e, "fault", False)


def node_name() -> str:
    """This node's name as Slurm knows it (recover.py leaves nodes out by it), else its host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def on_node(line: str, node: str) -> str:
    """A fault's line that names the one node it happened on, as recover.py reads it."""
    return f"node {node}: {line}"


# These match what a rank's exception says when another rank ended, as torch 2.11-2.15 word it
# (tests/test_robustness.py holds the texts and where each came from). NCCL's watchdog mostly
# ends the process itself, with its own lines.
WAITED = (r"Timed out waiting (\d+)ms",
          r"Watchdog caught collective operation timeout: .*?Timeout\(ms\)=(\d+)")
# a connection broke: to the peer's process (SIGKILL, lost node), its listener or c10d's store
GONE = r"Connection (closed|reset) by (remote )?peer|Connection refused|Broken pipe|Socket closed"
GONE += r"|Failed to recv"  # c10d's store lost its host
GONE += r"|ncclRemoteError|Connect timeout"  # the last means a new group's peer never connected


def lost_rank(e: BaseException) -> str:
    """One line, naming where and what broke, for a collective another rank left or never joined;
    else ''."""
    text = str(e).replace("\n", " ")
    waited = next(filter(None, (re.search(w, text) for w in WAITED)), None)
    gone = re.search(GONE, text)
    if not isinstance(e, RuntimeError) or not (waited or gone):
        return ""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) in OURS]
    where = ""
    if ours:
        last = ours[-1]  # the innermost frame of our files
        where = f" in {last.name} ({os.path.relpath(last.filename, ROOT)}:{last.lineno})"
    rank = os.environ.get("RANK", "0")
    if waited:
        seconds = int(waited[1]) / 1000
        return (f"rank {rank}: a collective{where} waited {seconds:g} s "
                "(comm.init_timeout_seconds) for a rank that never joined it: a rank stopped "
                "(crashed, froze, ran out of memory, lost its node); its log or its node's says "
                "which. Raise the timeout only if a step can take longer than that")
    return (f"rank {rank}: a collective{where} lost its connection to another rank ({gone[0]}), "
            "which ended: that rank's own error line or traceback says why")
