"""What every rank of train.py does alike before the first step, each ending in one agreement, so
that a problem on one rank stops every rank with its line: the dump folder (and rank 0's lock on
it), the data manifest (resolved by rank 0, checked by every node), the sources' first reads.
`cfg` is train.py's Config."""

import fcntl
import logging
import os
from functools import partial

import torch.distributed as dist

from pretrain import evals
from pretrain.data_manifest import pinned_manifest, shared_manifest, verify_manifest
from pretrain.distributed import agree, agree_on_reads
from pretrain.sources import DataError

logger = logging.getLogger("train")


def open_dump_folder(job, config_toml: str, rank: int, device):
    """Every rank checks that the dump folder (train.py's [job] section: `job`) is usable. Rank 0
    returns an flock on it, held for the whole run (the OS releases it however the process ends): a
    second job pointed here stops before it touches config or checkpoints. Rank 0 writes the
    resolved config there (and logs it, with job.print_config)."""
    folder = job.dump_folder
    error = ""  # this rank's one line, if the folder cannot be used
    lock = None  # only rank 0 takes the lock
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError("not writable")
        if rank == 0:
            lock = open(os.path.join(folder, ".lock"), "a")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = (f"job.dump_folder = {folder!r} is in use by another run "
                 "(its .lock is held); wait for that run to end or choose another dump_folder")
    except OSError as e:
        error = f"job.dump_folder = {folder!r} cannot be used: {e}"
    agree(error, device)
    if rank == 0:
        with open(os.path.join(folder, "config.toml"), "w") as f:
            f.write(config_toml)
    if job.print_config:
        logger.info(config_toml)
    return lock


def held_out(validation, e) -> list:
    """The sources read apart from training: [validation]'s (when enabled) and [eval]'s tasks'."""
    return (validation.sources if validation.enable else []) + evals.sources(e)


def share_manifest(data, held_out: list, dump_folder: str, budget: float, rank: int, device) -> dict:
    """The files of every source of train.py's [data] section (`data`) and of the `held_out` ones
    (validation's, the eval tasks'): rank 0 alone resolves them (or reads the run's pinned
    manifest), every rank gets them through the job's store (data_manifest.shared_manifest), or its
    DataError; with the data mirror they are read from. Then each node checks the local files in
    use once, split over its ranks (a node-local copy may differ). `budget`: a read's retries
    (comm.init_timeout_seconds)."""
    if rank == 0:
        logger.info("data manifest: rank 0 reads or makes it; "
                    "the others wait up to data.resolve_timeout_seconds")
    make = partial(pinned_manifest, data.manifest, dump_folder, data.sources, held_out,
                   timeout=data.hub_timeout_seconds, budget=budget)
    store = dist.distributed_c10d._get_default_store()
    manifest = shared_manifest(store, rank, data.resolve_timeout_seconds, make)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # a node whose copy differs from rank 0's has a fault of its own (agree names it)
    error = verify_manifest(manifest, local_rank, local_world, [*data.sources, *held_out])
    agree(DataError(error, fault="node") if error else "", device)
    return {**manifest, "mirror": data.mirror}


def check_sources(loader, rank: int, wait: float):
    """Every rank opens every source where it resumes: a bad one stops all ranks alike before the
    first step. `wait` (data.resolve_timeout_seconds): rank 0's wait for every rank's outcome."""
    error = ""
    try:
        loader.check()
    except DataError as e:
        error = e
    agree_on_reads(error, rank, wait)
