"""The checkpoint folder, <dump_folder>/<checkpoint.folder>/: which step-N folders in it are
complete, and how a new one gets there whole. A save is written to .step-N.tmp and renamed to
step-N once every rank has written, so a crash at any moment leaves only complete step-N folders
behind, and the previous one stays until the new one is in place. checkpoint.py says what a
checkpoint holds, and resumes from one."""

import concurrent.futures
import json
import logging
import math
import os
import re
import shutil
import time
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

logger = logging.getLogger("checkpoint")  # checkpoint.py's logger, so its lines read "checkpoint"


class SaveError(RuntimeError):
    """The save a stop depends on failed (the previous checkpoint is intact): one line, exit code 3."""


def why(e: BaseException) -> str:
    """A failed save's reason in one line: DCP gathers (error, traceback) per rank; the first."""
    if isinstance(e, CheckpointException):
        e = next(iter(e.failures.values()), (e,))[0]
    return f"{type(e).__name__}: {str(e)[:300]}".replace("\n", " ")


def incomplete(path: str, meta=None):
    """Why a step-N folder cannot be loaded (None if it can): DCP's .metadata (`meta`, if read) must be
    readable, every file it names as long as the data it records there (an rsync cut short)."""
    try:
        meta = meta or dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # the folder is missing, truncated or not DCP at all
        metadata = os.path.join(path, ".metadata")
        return f"{metadata} is missing or unreadable ({type(e).__name__})"
    need = {}
    for info in (meta.storage_data or {}).values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.exists(file) else None
        if have is None or have < size:
            what = "missing" if have is None else f"{have} bytes, the metadata needs {size}"
            return f"{file} is {what}"


def numbered(folder: str) -> list:
    """The N of every step-N folder, complete or not, lowest first."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(m[1]) for d in names if (m := re.fullmatch(r"step-(\d+)", d)))


def checkpoints(folder: str, warn: bool = False) -> list:
    """Steps of the complete checkpoints, oldest first; `warn` logs each incomplete step-N."""
    steps = numbered(folder)
    reasons = {s: incomplete(os.path.join(folder, f"step-{s}")) for s in steps}
    for s in [s for s in steps if reasons[s] and warn]:
        logger.warning(f"skipping incomplete checkpoint step-{s}: {reasons[s]}")
    return [s for s in steps if not reasons[s]]


def newest_complete(folder: str, below: float = math.inf, warn: bool = False):
    """The newest complete step-N below `below`, or None. Checked from the newest down: a long run's
    folder costs a listing and a check or two. `warn` logs each incomplete one passed over."""
    for s in reversed(numbered(folder)):
        reason = incomplete(os.path.join(folder, f"step-{s}")) if s < below else "later"
        if not reason:
            return s
        if warn and s < below:
            logger.warning(f"skipping incomplete checkpoint step-{s}: {reason}")
    return None


def remove(folder: str, steps: list):
    """The step-N of `steps`, each renamed to a crashed save's name before it is deleted (the next
    save clears one that a crash leaves), so that none is ever half there to be resumed from."""
    for n in steps:
        tmp = os.path.join(folder, f".step-{n}.tmp")
        os.rename(os.path.join(folder, f"step-{n}"), tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def newest(folder: str) -> str:
    step = newest_complete(folder)
    return os.path.join(folder, f"step-{step}") if step is not None else "none"


class Saver:
    """Writes one run's step-N folders, each atomically; an async save stays in flight until a
    later step boundary puts it in place. `cfg` is train.py's [checkpoint] section; `params()` is
    what params.json holds (the model's shape, for checkpoint_convert.py)."""

    def __init__(self, cfg, folder: str, params):
        self.cfg = cfg
        self.folder = folder
        self.params = params
        self.rank = dist.get_rank()
        # Saves run DCP's collectives on a gloo group of their own (async ones from a background
        # thread), made now, while the launcher's store answers (a signal may have ended torchrun
        # by the time a save starts). Its timeout is save_timeout_seconds, as long as a save may
        # take, not [comm]'s timeout. A dry run's fake backend gets no such group.
        use_group = cfg.enable and dist.get_backend() != "fake"
        self.group = self.save_group() if use_group else None
        self.pending = None  # (future, step, start time) of an async save not yet in place

    def writing(self) -> bool:
        """Whether this rank is still writing an async save."""
        return self.pending is not None and not self.pending[0].done()

    def save_group(self):
        timeout = timedelta(seconds=self.cfg.save_timeout_seconds)
        return dist.new_group(backend="gloo", timeout=timeout)

    def save(self, step: int, make_state, final: bool):
        """Write step-N with what `make_state()` returns, called once the save in flight has ended
        and the folder is clear: in the background (async_mode) unless the run stops after it."""
        if self.pending is not None:  # at most one save in flight
            self.finish()
        # a failed save dropped it, and the dry run has none; every rank saves at the same step
        if self.group is None:
            self.group = self.save_group()
        t0 = time.perf_counter()
        tmp = os.path.join(self.folder, f".step-{step}.tmp")
        if self.rank == 0:  # clear leftovers of crashed saves
            os.makedirs(self.folder, exist_ok=True)
            for d in os.listdir(self.folder):
                if re.fullmatch(r"\.step-\d+\.tmp", d):
                    shutil.rmtree(os.path.join(self.folder, d), ignore_errors=True)
        dist.barrier()
        state = make_state()
        background = self.cfg.async_mode == "async" and not final
        future = concurrent.futures.Future()  # a sync save's outcome, held as an async one's
        try:
            if background:
                future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
            else:
                dcp.save(state, checkpoint_id=tmp, process_group=self.group)
                future.set_result(None)
        except (CheckpointException, OSError, RuntimeError) as e:
            # a full disk, quota or save_timeout_seconds (gloo) may fail some ranks; finish() agrees
            future.set_exception(e)
        self.pending = (future, step, time.monotonic())
        blocked = f"training blocked {time.perf_counter() - t0:.2f}s"
        if background:  # it is put in place (or fails, on every rank) at a later step boundary
            return logger.info(f"checkpoint step-{step}: {blocked} (async)")
        self.finish(final, f": {blocked}")

    def finish(self, final: bool = False, note: str = " (async)"):
        """Wait until every rank's save has ended (at most save_timeout_seconds from its start), then
        rename it into place if it went well on every rank; else it failed on all alike (`final`: raise)."""
        future, step, started = self.pending
        self.pending = None
        # every rank polls in step on the default group (its ranks are all here) until none writes
        while True:
            late = time.monotonic() > started + self.cfg.save_timeout_seconds
            state = "late" if late else "writing"
            if future.done():
                state = why(future.exception()) if future.exception() else ""
            states = [None] * dist.get_world_size()
            # a gather that timed out fails on some ranks only: all learn it
            dist.all_gather_object(states, state)
            if "writing" not in states:
                break
            time.sleep(0.1)
        # report the cause, not its effects
        error = "late" if "late" in states else next((s for s in states if s), "")
        if error == "late":
            error = (f"rank {states.index('late')} was still writing after "
                     f"checkpoint.save_timeout_seconds = {self.cfg.save_timeout_seconds} s")
        if error:
            # a write may still run, or the group timed out: every rank makes a new one at the next save
            self.group = None
            return self.failed(step, error, final)
        try:
            self.commit(step)
            logger.info(f"saved checkpoint {self.folder}/step-{step}{note}")
        except OSError as e:
            self.failed(step, why(e), final)

    def close(self):
        """On an error exit, with no collective (a rank may be gone): wait for this rank's async
        save, at most save_timeout_seconds from its start; rank 0 puts it in place if it went well
        there, which means that every rank wrote its files (DCP writes .metadata on rank 0 after
        gathering every rank's result)."""
        if self.pending is None:
            return
        future, step, started = self.pending
        self.pending = None
        try:
            left = started + self.cfg.save_timeout_seconds - time.monotonic()
            future.result(timeout=max(0.0, left))
            if self.rank == 0:
                self.put_in_place(step)
                saved = f"{self.folder}/step-{step}"
                logger.info(f"saved checkpoint {saved} (async, before the error exit)")
        except Exception as e:  # its write, its collectives, its time limit or the rename failed
            logger.error(f"checkpoint step-{step} failed ({why(e)}); the newest complete "
                         f"checkpoint is still {newest(self.folder)}")

    def commit(self, step: int):
        """Once every rank has written (dcp fsyncs each file): one rename makes step-N appear
        whole. A failure (a stale step-N, a quota) is every rank's."""
        dist.barrier()
        if error := self.on_rank0(self.put_in_place, step):
            raise OSError(f"putting it in place: {error}")
        keep = self.cfg.keep_latest_k  # old checkpoints go only now, after the new one is complete
        for old in (checkpoints(self.folder)[:-keep] if keep > 0 and self.rank == 0 else []):
            shutil.rmtree(os.path.join(self.folder, f"step-{old}"), ignore_errors=True)

    def drop_after(self, step: int) -> list:
        """A rewind's: remove every step-N above `step`, on the timeline the rewind left, so that a
        restart resumes on the rewound one. No save is in flight (the rewind finished it)."""
        later = [n for n in numbered(self.folder) if n > step] if self.rank == 0 else []
        if self.group is None:  # a failed save dropped it; every rank rewinds at the same step
            self.group = self.save_group()
        # It runs on the save group: deleting checkpoints may take as long as writing them did.
        if error := self.on_rank0(remove, self.folder, later, group=self.group):
            raise SaveError(f"rewind to step-{step}: cannot remove the later checkpoints of "
                            f"{self.folder} ({error}); remove every step-N above {step} before a "
                            "restart, or it resumes on the timeline the rewind left")
        return later

    def on_rank0(self, change, *args, group=None) -> str:
        """Rank 0 alone changes the folder, which every node shares; every rank learns how that
        went, on `group` (None: the default one): "" or rank 0's error."""
        outcome = [""]
        if self.rank == 0:
            try:
                change(*args)
            except OSError as e:
                outcome[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(outcome, src=0, group=group)
        return outcome[0]

    def put_in_place(self, step: int):
        """Rank 0's part of a commit: params.json, then the one rename."""
        tmp = os.path.join(self.folder, f".step-{step}.tmp")
        final = os.path.join(self.folder, f"step-{step}")
        with open(os.path.join(tmp, "params.json"), "w") as f:  # what checkpoint_convert.py needs
            json.dump(self.params(), f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        dir_fd = os.open(self.folder, os.O_RDONLY)
        os.fsync(dir_fd)  # make the rename itself survive a power loss
        os.close(dir_fd)

    def failed(self, step: int, reason: str, final: bool):
        """The previous checkpoint is untouched; training goes on and the next interval tries
        again, unless this was the save a stop depends on."""
        if self.rank == 0:
            shutil.rmtree(os.path.join(self.folder, f".step-{step}.tmp"), ignore_errors=True)
        msg = (f"checkpoint step-{step} failed ({reason}); the newest complete checkpoint is "
               f"still {newest(self.folder)}")
        if final:
            raise SaveError(msg)
        logger.error(msg)
