"""Before a big job: check the nodes it was given, in a minute, launched like train.py.

    torchrun --nproc_per_node 8 preflight.py check --config configs/llama3_8b.toml   # one node
    CLUSTER_ENV=aws-efa sbatch --nodes 4 slurm/preflight.sbatch   # every node of an allocation
    python preflight.py check --help                              # its options

`check` starts as the trainer does (distributed.init_distributed: device, process group, mesh) and
prints a row per rank (node, device, versions, matmul TFLOP/s), then one line per check, OK, WARN or
FAIL, each with its threshold: software versions, matmul speed, bus bandwidth within and across
nodes, the data (rank 0 resolves the sources once, every node checks its files and reads each
source: pretrain/data_check.py), the dump folder (writable, shared), free space for the run's checkpoints,
the tokenizer. Exit 1 on a FAIL.
Other `--section.key value` arguments set train.py's config, as for the training job."""

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import train
from model import Transformer
from pretrain import checkpoint_folder
from pretrain import data_check
from pretrain import device_check
from pretrain import distributed
from pretrain import dryrun
from pretrain import memory
from pretrain import sources
from pretrain.metrics import peak_tflops

def fail(msg: str):
    """A bad config or data source: one line and exit 2, as train.py ends."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def level(value: float, warn: float, fail: float) -> str:
    """A measurement's verdict against its thresholds: FAIL below `fail`, WARN below `warn`."""
    if value < fail:
        return "FAIL"
    if value < warn:
        return "WARN"
    return "OK"


def rank_checks(cfg, device, rank: int, token: str) -> dict:
    """What this rank sees: node, device, versions, matmul speed, tokenizer sha256, dump folder."""
    gpu = device.type == "cuda"
    runtime = "-"
    if torch.version.cuda:
        runtime = f"CUDA {torch.version.cuda}"
    elif torch.version.hip:
        runtime = f"ROCm {torch.version.hip}"
    node = os.environ.get("SLURMD_NODENAME") or platform.node()  # CI's Slurm nodes share one host
    name = torch.cuda.get_device_name(device) if gpu else f"CPU {platform.machine()}"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpu else "-"
    smi = bool(shutil.which("nvidia-smi") or shutil.which("rocm-smi"))  # the node has GPUs
    # GPUs that torch does not see: a CPU-only torch build in the VENV (unless the job hid them)
    hidden = not gpu and smi and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    r = {"node": node, "device": name, "versions": (torch.__version__, runtime, nccl),
         "hidden_gpus": hidden, "tflops": device_check.matmul_tflops(device, rank), "dump": "", "free": None}
    try:
        with open(cfg.model.tokenizer_path, "rb") as f:
            r["tokenizer"] = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        r["tokenizer"] = f"missing: {type(e).__name__}"
    try:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        with open(os.path.join(cfg.job.dump_folder, f".preflight-{token}-{rank}"), "w") as f:
            f.write(token)
        os.remove(f.name)
        r["free"] = shutil.disk_usage(cfg.job.dump_folder).free
    except OSError as e:
        r["dump"] = f"not writable ({type(e).__name__}: {e})"
    return r


def node_groups(nodes: dict, timeout: float) -> dict:
    """{node: the process group of its ranks}, made on every rank (new_group's rule), each bounded
    by comm.init_timeout_seconds as the trainer's groups are: new_group alone takes the backend's
    default (NCCL 10 minutes, gloo 30), so a frozen rank would hold its node's bandwidth check that
    long."""
    bound = timedelta(seconds=timeout)
    return {name: dist.new_group(members, timeout=bound) for name, members in nodes.items()}


def check(args, extra):
    t0 = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    cfg = train.load_config(extra)
    sizes = train.validate(cfg, world)
    with torch.device("meta"):
        model = Transformer(train.model_args(cfg))
    # a checkpoint: fp32 weights and the optimizer's states, every rank's shard of them
    parts = memory.estimate_memory(model, sizes, training=cfg.training, optimizer=cfg.optimizer, cuda=True,
                                   activation_checkpoint=cfg.activation_checkpoint, float8_gather=False)
    ckpt = (parts["weights"] + parts["optimizer"]) * sizes["dp_shard"] * sizes["tp"]
    # the trainer's device, process group and mesh
    device, _ = distributed.init_distributed(cfg.parallelism, sizes, cfg.comm.init_timeout_seconds)
    gpu = device.type == "cuda"

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    token = gather(os.urandom(8).hex())[0]
    r = rank_checks(cfg, device, rank, token)
    # rank 0 writes it, every rank reads it
    shared = os.path.join(cfg.job.dump_folder, f".preflight-{token}")
    if rank == 0 and not r["dump"]:
        with open(shared, "w") as f:
            f.write(token)
    dist.barrier()
    r["shared"] = os.path.isfile(shared) and open(shared).read() == token
    ranks = gather(r)
    nodes = {}
    for i, x in enumerate(ranks):
        nodes.setdefault(x["node"], []).append(i)
    if rank == 0 and not r["dump"]:
        os.remove(shared)
    # Rank 0 prints each check's line as its measurements end: with many nodes the data and the
    # bandwidth take minutes, and a silent preflight looks hung.
    verdict = Verdicts()
    if rank == 0:
        report_ranks(cfg, ranks, ckpt, gpu, verdict)
    listed = data_check.configured(cfg.data.sources, cfg.validation.sources, cfg.eval)
    try:  # rank 0 resolves, once
        manifest, ranks[0]["manifest"], resolved, fresh = data_check.share_sources(
            cfg.data, cfg.job.dump_folder, listed, rank)
    except sources.DataError as e:
        fail(str(e))
    # each node checks every local file, split over its ranks as startup.share_manifest does
    mine = nodes[r["node"]]
    part = mine.index(rank)
    streams = cfg.data.num_streams or sizes["dp"]
    max_seq_len = train.flavor_args(cfg).max_seq_len  # the window evals.load cuts examples to
    unreadable = data_check.read_share(cfg.data, cfg.eval, listed, manifest, fresh, part=part, parts=len(mine),
                                       streams=streams, max_seq_len=max_seq_len,
                                       tokenizer_path=cfg.model.tokenizer_path)
    for x, data in zip(ranks, gather({**(resolved if rank == 0 else {}), **unreadable})):
        x["data"] = data
    if rank == 0:
        report_data(cfg, listed, ranks, nodes, verdict)
    sizes_b = [2**20, 2**24, 2**28, 2**30] if gpu else [2**18, 2**22]  # small on CPU (gloo)
    groups = node_groups(nodes, cfg.comm.init_timeout_seconds)
    intra = None  # one rank on this node: nothing to measure within it
    if len(mine) > 1:
        intra = device_check.bus_bandwidth(groups[r["node"]], device, sizes_b)
    inter = device_check.bus_bandwidth(None, device, sizes_b) if len(nodes) > 1 else None
    for x, measured in zip(ranks, gather(intra)):
        x["intra"] = measured
    code = [0]  # the exit code, rank 0's for every rank
    if rank == 0:
        report_bandwidth(ranks, nodes, inter, sizes_b, gpu, verdict)
        code = [verdict.summary(time.perf_counter() - t0)]
    dist.broadcast_object_list(code)
    dist.barrier()  # no rank tears down its process group while another still uses it
    dist.destroy_process_group()
    sys.exit(code[0])


class Verdicts:
    """Rank 0's verdict lines, each printed as its check ends, and the exit code from them: 1 if any
    FAILs, else 0."""

    def __init__(self):
        self.levels = []  # each check's verdict

    def __call__(self, level: str, check: str, text: str):
        self.levels.append(level)
        print(f"{level:<4} {check}: {text}", flush=True)

    def summary(self, seconds: float) -> int:
        fails = self.levels.count("FAIL")
        warns = self.levels.count("WARN")
        print(f"preflight: {fails} FAIL, {warns} WARN of {len(self.levels)} checks in {seconds:.1f} s",
              flush=True)
        return 1 if fails else 0


def report_ranks(cfg, ranks: list, ckpt: float, gpu: bool, verdict: Verdicts):
    """Rank 0: one table of every rank, then the checks of what each rank saw alone: software,
    matmul, dump folder, free space, tokenizer (each line with its threshold)."""
    gib = memory.GIB
    nodes = {x["node"] for x in ranks}
    print(f"preflight: {len(ranks)} ranks on {len(nodes)} node(s), {'NCCL' if gpu else 'gloo'}")
    print(f"{'rank':>4}  {'node':<12} {'device':<22} {'torch':<13} {'cuda/rocm':<11} {'nccl':<8} "
          f"{'TFLOP/s':>8}  {'tokenizer':<10} {'dump':<10} free GiB")
    for i, x in enumerate(ranks):
        dump = "shared" if x["shared"] else "NOT SHARED"
        if x["dump"]:  # not writable
            dump = "FAIL"
        free = f"{x['free'] / gib:.1f}" if x["free"] is not None else "-"
        torch_v, runtime, nccl = x["versions"]
        versions = f"{torch_v[:13]:<13} {runtime:<11} {nccl:<8}"
        print(f"{i:>4}  {x['node'][:12]:<12} {x['device'][:22]:<22} {versions} "
              f"{x['tflops']:>8.3f}  {x['tokenizer'][:10]:<10} {dump:<10} {free}")

    versions = {x["versions"] for x in ranks}
    hidden = [i for i, x in enumerate(ranks) if x["hidden_gpus"]]
    if hidden:
        text = (f"ranks {hidden} have GPUs (nvidia-smi or rocm-smi) that torch does not see: "
                "a CPU-only torch build?")
    elif len(versions) > 1:
        text = f"{len(versions)} different torch/CUDA/NCCL versions: {sorted(versions)}"
    else:
        alike = "torch {}, CUDA/ROCm {}, NCCL {} on every rank (threshold: all alike)"
        text = alike.format(*ranks[0]["versions"])
    verdict("FAIL" if len(versions) > 1 or hidden else "OK", "software", text)

    tf = [x["tflops"] for x in ranks]
    slow = min(range(len(tf)), key=tf.__getitem__)  # the slowest rank
    med = statistics.median(tf)
    # each rank against the median of the others (with two ranks, the overall median is half the
    # slow one's)
    others = [statistics.median(tf[:i] + tf[i + 1:]) if len(tf) > 1 else t
              for i, t in enumerate(tf)]
    of = [t / median for t, median in zip(tf, others)]
    peak = peak_tflops(ranks[0]["device"], cfg.metrics.peak_tflops)  # 0 on CPU: no datasheet peak
    if gpu:  # of the others' median
        warn = 0.8
        fail_ = 0.25
        why = "one slow GPU sets every rank's pace"
    else:
        warn = 0.25
        fail_ = 0.1
        why = "CPU has no datasheet peak, and shared machines are noisy"
    failed = [i for i in range(len(tf)) if of[i] < fail_]
    bad = [i for i in range(len(tf)) if (of[i] < warn or tf[i] < 0.35 * peak) and i not in failed]
    of_peak = f", {100 * med / peak:.0f}% of the datasheet peak {peak:.0f}" if peak else ""
    peak_rule = ""
    if peak:
        peak_rule = ("; or below 35% of the peak: metrics.peak_tflops, else the datasheet table in "
                     "pretrain/metrics.py")
    slowest = "".join(f"; {what}: ranks {r}" for what, r in (("FAIL", failed), ("WARN", bad)) if r)
    if failed:
        matmul = "FAIL"
    elif bad:
        matmul = "WARN"
    else:
        matmul = "OK"
    dtype = "bf16" if gpu else "fp32"
    verdict(matmul, "matmul", f"median {med:.3f} TFLOP/s ({dtype}, the fastest run of each)"
            f"{of_peak}; slowest rank {slow} on {ranks[slow]['node']}: {tf[slow]:.3f} = "
            f"{100 * of[slow]:.0f}% of the others' median{slowest} (threshold: of the others' "
            f"median, FAIL below {fail_:.0%}, WARN below {warn:.0%}: {why}{peak_rule})")

    bad = {i: x["dump"] for i, x in enumerate(ranks) if x["dump"]}
    unshared = [i for i, x in enumerate(ranks) if not x["shared"]]
    if bad:
        first = min(bad)
        text = f"rank {first} on {ranks[first]['node']} (of {len(bad)} ranks): {bad[first]}"
    elif unshared:
        text = f"ranks {unshared} do not see the file rank 0 wrote: not a shared filesystem"
    else:
        text = f"writable from every rank, and shared: rank 0's file seen by all {len(ranks)}"
    verdict("FAIL" if bad or unshared else "OK", f"dump folder {cfg.job.dump_folder}", text)

    c = cfg.checkpoint
    steps = cfg.training.steps
    free = min((x["free"] for x in ranks if x["free"] is not None), default=0)
    # a resume goes on after the newest
    done = checkpoint_folder.checkpoints(os.path.join(cfg.job.dump_folder, c.folder))
    saves = set(range(c.interval, steps + 1, c.interval)) | {steps}  # as train.py saves
    newest = done[-1] if done else 0
    left = len([s for s in saves if s > newest])
    # on disk at most: every one (keep_latest_k = 0), else k kept and the next being written
    # (pretrain/checkpoint_folder.py deletes the old only then); those in the folder already need no new
    # space, a save still to come needs one
    on_disk = len(done) + left
    if c.keep_latest_k:
        on_disk = min(c.keep_latest_k + 1, on_disk)
    need = max(on_disk - len(done), min(left, 1)) if c.enable else 0
    k = c.keep_latest_k
    if k:
        kept = f"keep_latest_k = {k}: {k} kept and the next one being written"
    else:
        kept = f"keep_latest_k = 0 keeps every one: training.steps {steps} / interval {c.interval}"
    if done:
        kept += f", {len(done)} already in the folder"
    space = f"{free / gib:.1f} GiB"
    if c.enable:
        text = (f"{space} for {need} more checkpoint(s) of {ckpt / gib:.2f} GiB ({kept}; bench.py "
                "memory's fp32 weights + AdamW moments; threshold: FAIL below them, WARN below one "
                "more: a stop signal's save)")
    else:
        text = f"{space}; n/a (checkpoint.enable = false)"
    verdict(level(free, (need + 1) * ckpt, need * ckpt), "free space", text)

    shas = {}
    for i, x in enumerate(ranks):
        shas.setdefault(x["tokenizer"], []).append(i)
    if len(shas) > 1:
        per_sha = [f"ranks {v} (node {ranks[v[0]]['node']}): {k[:16]}" for k, v in shas.items()]
        text = "; ".join(per_sha)
    else:
        text = f"sha256 {ranks[0]['tokenizer'][:16]} on all {len(ranks)} ranks"
    text += " (threshold: present, and one sha256 on every rank)"
    differ = len(shas) > 1
    missing = "missing" in ranks[0]["tokenizer"]
    verdict("FAIL" if differ or missing else "OK", f"tokenizer {cfg.model.tokenizer_path}", text)


def report_data(cfg, listed: list, ranks: list, nodes: dict, verdict: Verdicts):
    """Rank 0: the data manifest, and whether each node reads each source and eval task."""
    manifest_level, text = ranks[0]["manifest"]  # rank 0's, from data_check.rank0_manifest
    verdict(manifest_level, "data manifest", text)
    from_mirror = ""
    if cfg.data.mirror:
        from_mirror = f", from the data mirror {cfg.data.mirror} where it holds the file"
    for _, _, name in listed:  # data_check.configured's
        errors = {}
        for x in ranks:  # a node's first error: its ranks checked a share each
            if x["data"].get(name) and not errors.get(x["node"]):
                errors[x["node"]] = x["data"][name]
        read = "its local files match rank 0's and the first document reads"
        if name.startswith("eval task"):
            read = "its first example reads in the task's layout"
        if errors:
            first = next(iter(errors.values()))
            verdict("FAIL", name, f"unreadable on node(s) {', '.join(errors)}: {first}")
        else:
            verdict("OK", name, f"{read} on every node ({len(nodes)}){from_mirror}")


def report_bandwidth(ranks: list, nodes: dict, inter, sizes_b: list, gpu: bool, verdict: Verdicts):
    """Rank 0: the bus bandwidth within the slowest node and across the nodes, against thresholds."""
    at = "/".join(f"{s >> 20} MiB" if s >= 2**20 else f"{s >> 10} KiB" for s in sizes_b)
    within = {n: ranks[m[0]]["intra"] for n, m in nodes.items() if ranks[m[0]]["intra"]}
    across = {f"{len(nodes)} nodes": inter} if inter else {}
    for check, meas in (("bandwidth within nodes", within), ("bandwidth across nodes", across)):
        inside = "within" in check
        if not meas:
            alone = "one rank per node" if inside else "one node"
            verdict("OK", check, f"n/a ({alone})")
            continue
        # the slowest node: by its largest all-reduce
        worst = min(meas, key=lambda n: meas[n]["all-reduce"][-1])
        big = meas[worst]["all-reduce"][-1]
        fail_below = 0  # GB/s
        warn_below = 0
        if not gpu:
            rule = "none on CPU (gloo): no line rate to compare with"
        elif inside:
            warn_below = 50
            rule = "WARN below 50 GB/s, less than PCIe 5 x16's 64: no NVLink/xGMI"
        else:
            # busbw across nodes is about the node's NIC rate: NCCL runs a ring per NIC (rail), and
            # GPU nodes have one NIC per GPU. The per-GPU figures and where they come from:
            # docs/slurm.md#preflight. The node with the fewest GPUs (and NICs) sets the pace.
            g = min(len(m) for m in nodes.values())
            fail_below = 2.5 * g
            warn_below = 20 * g
            rule = (f"per GPU x {g} GPUs per node, FAIL below 2.5 GB/s: NCCL over TCP sockets, not "
                    "EFA/InfiniBand; WARN below 20 GB/s: 8 x 400 Gbit/s nodes (H100, EFA or NDR "
                    "InfiniBand) reach about 45 GB/s per GPU, 8 x 200 Gbit/s HDR nodes about 23; "
                    "below it a rail is down, NCCL sees fewer NICs or no GPUDirect RDMA, or the "
                    "nodes have fewer NICs than GPUs")
        per_op = [f"{op} {' '.join(f'{v:.2f}' for v in gbs)} GB/s"
                  for op, gbs in meas[worst].items()]
        rates = "; ".join(per_op)
        where = "slowest node " if inside else ""
        text = f"{where}{worst}: busbw at {at}: {rates} (threshold, at the largest size: {rule})"
        verdict(level(big, warn_below, fail_below), check, text)


def main(argv: list):
    p = argparse.ArgumentParser(prog="preflight.py", description=__doc__.split("\n")[0],
                                epilog="python preflight.py WHAT --help lists its options")
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    doc = ("launched like train.py (torchrun, srun): devices, bandwidth, data, dump folder, "
           "tokenizer on every node; exit 1 on a FAIL")
    epilog = ("Other --section.key value arguments set train.py's config (python train.py --help "
              "lists them).")
    job = sub.add_parser("check", help=doc, description=doc, epilog=epilog)
    config_help = "train.py's TOML config (e.g. configs/llama3_8b.toml)"
    job.add_argument("--config", action="append", help=config_help)
    dry = sub.add_parser("dryrun", help=dryrun.HELP, description=dryrun.HELP, epilog=dryrun.EPILOG)
    dryrun.arguments(dry)
    a, rest = p.parse_known_args(argv)
    configs = [arg for path in a.config or [] for arg in ("--config", path)]  # train.py refuses two
    rest = configs + rest
    if a.what == "dryrun":  # one CPU process, no GPU: pretrain/dryrun.py
        sys.exit(dryrun.run(a.world_size, rest, train))  # the trainer whose steps it runs
    try:
        check(a, rest)
    except train.ConfigError as e:  # a bad key or value: one line
        fail(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
