"""The ranks of one job, and what they tell each other: the process group and the (dp_replicate,
dp_shard, tp) mesh with every group's wait bounded; one rank's error raised on every rank (agree);
rank 0's reading handed to the others through the job's c10d store (a reading may outlast a
collective's timeout); preemption signals. train.py, dryrun.py and preflight.py start alike through
init_distributed.
"""

import ctypes
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pretrain.config import ConfigError
from pretrain.faults import Fault, node_name, on_node
from pretrain.sources import DataError

def agree(error, device) -> None:
    """Every rank learns whether any rank failed (error: '' or its exception), and all raise that
    rank's one line, so no rank is left waiting in a collective for one that has stopped."""
    flag = torch.tensor(int(bool(error)), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, (str(error), getattr(error, "fault", False), node_name()))
        raise_first(errors)


def raise_first(errors: list, user=ConfigError):
    """Raise the first of every rank's (line, fault, node) that has a line: a Fault (pretrain/faults.py
    says which), named after its node when only some nodes saw it (a restart leaves it out), else a
    `user` error."""
    line, fault, node = next(e for e in errors if e[0])
    everywhere = {n for text, _, n in errors if text} == {n for _, _, n in errors}
    if not fault or (fault == "node" and everywhere):
        raise user(line)
    raise Fault(line if everywhere else on_node(line, node))


def agree_on_reads(error, rank: int, wait: float) -> None:
    """agree() after every rank read on its own (a read's retries may outlast a collective's
    timeout): in the job's store, rank 0 waits up to `wait` s (data.resolve_timeout_seconds) for
    every rank's outcome, and every rank raises rank 0's verdict, the first rank's error, or that a
    rank never answered (a fault: a slow Hub)."""
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    # a restarted job's store keeps old keys
    key = f"checked_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    store.set(f"{key}/{rank}", json.dumps((str(error), getattr(error, "fault", False), node_name())))
    if rank == 0:
        keys = [f"{key}/{r}" for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=wait))
            errors = [json.loads(e) for e in store.multi_get(keys)]
            verdict = ("", False)
            if any(line for line, _, _ in errors):
                try:
                    raise_first(errors)
                except (ConfigError, Fault) as e:
                    verdict = (str(e), isinstance(e, Fault))
        except RuntimeError:  # c10d's DistStoreError
            late = [r for r in range(world) if not store.check([keys[r]])]
            verdict = (f"rank 0 waited data.resolve_timeout_seconds = {wait:g} s for rank "
                       f"{late[0]} (of {len(late)} late) to read the next document of its sources: "
                       "a slow or rate-limited Hub? Raise it", True)
        store.set(f"{key}/verdict", json.dumps(verdict))
    try:  # this covers rank 0's own reading, then its wait for the others
        store.wait([f"{key}/verdict"], timedelta(seconds=2 * wait))
    except RuntimeError as e:
        raise DataError(f"rank {rank} waited 2 x data.resolve_timeout_seconds = {2 * wait:g} s for "
                        "rank 0 to read the next document of its sources and hear from every rank: "
                        "raise it", fault=True) from e
    line, fault = json.loads(store.get(f"{key}/verdict"))
    if line:
        raise DataError(line, fault=fault)


def wait_for_rank0(store, key: str, rank: int, wait: float, what: str,
                   name: str = "data.resolve_timeout_seconds"):
    """Where rank 0 reads alone (`what`), the others wait for it in the job's c10d store, up to
    `wait` s (what that reading may take; the key `name`), not in a collective
    (comm.init_timeout_seconds, for ranks that are all working). Rank 0 calls it when done; what it
    last put under `key`/doing is the waiting ranks' line if they give up."""
    if rank == 0:
        return store.set(key, "done")
    try:
        store.wait([key], timedelta(seconds=wait))
    except RuntimeError as e:  # c10d's DistStoreError
        doing = "starting"  # rank 0 put no line there yet
        if store.check([f"{key}/doing"]):
            doing = store.get(f"{key}/doing").decode()
        raise DataError(f"rank {rank} waited {name} = {wait:g} s for rank 0 to read {what} alone, "
                        f"and it was still {doing}: a slow Hub or filesystem? Raise it",
                        fault=True) from e


def from_rank0(t: torch.Tensor, device) -> torch.Tensor:
    """Rank 0's 1-D tensor on every rank (the others pass any tensor of its dtype): its length, then
    its data."""
    n = torch.tensor(len(t), device=device)
    dist.broadcast(n, src=0)
    if dist.get_rank() == 0:
        out = t.to(device)
    else:
        out = torch.empty(int(n), dtype=t.dtype, device=device)
    dist.broadcast(out, src=0)
    return out.cpu()


def attempt_store(timeout: timedelta) -> dict:
    """After `torchrun --max-restarts` restarted the ranks, a store of their own: torchrun's store
    keeps the failed attempt's keys, so a rank of this one could read a dead rank's gloo address
    (connection refused)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def init_distributed(p, sizes: dict, timeout_seconds: float, fake_rank: int = -1):
    """This rank's device (its GPU, else the CPU), the process group and the (dp_replicate,
    dp_shard, tp) mesh of train.py's [parallelism] `p` and validate's `sizes`; every collective
    bounded by `timeout_seconds` (comm.init_timeout_seconds). preflight.py check starts alike.
    dryrun.py's fake_rank: that rank of a "fake" group of the job's size, on CPU."""
    if torch.cuda.is_available() and fake_rank < 0:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        backend = "gloo" if fake_rank < 0 else "fake"
    timeout = timedelta(seconds=timeout_seconds)
    device_id = device if backend == "nccl" else None  # NCCL binds its communicator to this GPU
    if "RANK" in os.environ and fake_rank < 0:  # torchrun / srun
        restarted = attempt_store(timeout)  # a restarted attempt's own store, else {}
        dist.init_process_group(backend, timeout=timeout, device_id=device_id, **restarted)
    else:
        # plain `python train.py` is one process, needing no ports; dryrun.py is one rank of the job
        rank = 0
        world = 1
        if fake_rank >= 0:
            rank = fake_rank
            world = sizes["dp"] * p.tensor_parallel_degree
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device_id)
    shape = (p.data_parallel_replicate_degree, sizes["dp_shard"], p.tensor_parallel_degree)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    if p.tensor_parallel_degree > 1:
        # The gradient norm is a sum over FSDP and TP shards: with this mesh DTensor does it in one
        # all-reduce, not one per dimension in sequence (which can differ between ranks, and which
        # it warns about).
        mesh["dp_shard", "tp"]._flatten()
    mesh["dp_replicate", "dp_shard"]._flatten("dp")  # main's dp groups ranks with different data
    # The mesh's subgroups get the backend's default timeout (NCCL 10 min, gloo 30 min), not the one
    # above: set it on every group, so a rank that freezes ends the job after init_timeout_seconds
    # whichever group waits for it. (torch 2.15 has set_timeout.)
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    for group in list(dist.distributed_c10d._world.pg_map) if backend != "fake" else []:
        set_timeout(timeout, group)
    return device, mesh


def stop_on_signals() -> list:
    """Preemption (Slurm's warning signal, or a plain kill; torchrun's death reaches a rank as SIGTERM):
    the list gets the signal, and the loop finishes the step, saves and exits 0. Not a threading.Event:
    a second signal inside the first handler's Event.set() would wait on its lock forever."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    return stop


def ignore_stop_signals():
    """From here on a preemption signal is ignored: a rank that has saved and is shutting down must
    not be killed by a second one (Python restores the default, fatal, handler while exiting)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
