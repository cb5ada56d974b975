"""A dry run of train.py at the job's real world size, on a laptop: `python preflight.py dryrun
--config C --world_size N [--section.key value ...]`. One CPU process, no GPU.

Rank 0 and the last rank, each in a process of its own, join a "fake" process group of N ranks
(collectives return at once) and run the trainer's own code under fake tensors (shapes and dtypes,
no data): train.validate and the GPU job's config rules (float8.check(gpu=True)),
distributed.init_distributed, the model on the meta device, float8.convert, train.parallelize
(without torch.compile: fake tensors are not compiled here), train.build_optimizer, two steps (AdamW
makes its moments in the first, so the second is the steady state's) and Checkpointer.state planned
as DCP would write it. memory.LiveStorages counts each rank's memory at every op. Errors are
train.py's: one `error:` line, exit 2. What it leaves out, and how close it comes to a real run:
docs/performance.md#dry-run."""

import argparse
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers the "fake" backend)
from torch._subclasses.fake_tensor import FakeTensorMode

from model import Transformer
from pretrain import distributed
from pretrain import float8
from pretrain import memory
from pretrain.checkpoint import Checkpointer
from pretrain.config import ConfigError
from pretrain.memory import GIB, LiveStorages


class Nothing:
    """The data loader's place and the spike window in the checkpoint: a few JSON numbers, left out
    here."""

    def state_dict(self):
        return {}


def phase_lines(rank: int, say):
    """done(name): a line for each phase as it ends, with its seconds, handed to `say` (the parent
    prints it on stderr). A 405B dry run at 2,048 ranks takes minutes: a silent one looks hung."""
    last = [time.perf_counter()]

    def done(name: str):
        now = time.perf_counter()
        say(f"dryrun: rank {rank}: {name} {now - last[0]:.1f}s")
        last[0] = now
    return done


def run_rank(cfg, sizes: dict, rank: int, counter: LiveStorages, trainer, say) -> dict:
    """trainer.main's set-up and two steps as `rank`, under fake tensors (`counter` counts their
    memory). Two: AdamW makes its moments (2 x fp32 a parameter shard) in the first optimizer.step,
    so only the second step's forward and backward hold them: its peak is the steady state's."""
    done = phase_lines(rank, say)
    device, mesh = distributed.init_distributed(cfg.parallelism, sizes, cfg.comm.init_timeout_seconds,
                                                fake_rank=rank)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    args = trainer.model_args(cfg)
    t = cfg.training
    dp = dp_mesh.size()
    tp = cfg.parallelism.tensor_parallel_degree
    batch_shape = (t.local_batch_size, t.seq_len + 1)  # a micro-batch's inputs and labels
    torch.manual_seed(t.seed)
    with torch.device("meta"):
        model = Transformer(args)
    float8_scales = float8.convert(model, cfg.float8, cfg.model.converters, False, device,
                                   sharded=sizes["dp"] > 1)  # not compiled here
    done("build")
    trainer.parallelize(model, mesh, dataclasses.replace(cfg, compile=trainer.Compile(enable=False)))
    counter.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with counter.fake_mode, counter:
        counter.phase = "set-up"
        model.to_empty(device=device)
        no_values = lambda name, w, std: None  # noqa: E731 (fake weights hold no values)
        model.init_weights(normal_=no_values, buffer_device=device)
        model.train()
        optimizer, scheduler = trainer.build_optimizer(model, cfg, device)
        setup = counter.live
        done("parallelize")
        for step in (1, 2):
            counter.phase = f"forward and backward of step {step}"
            optimizer.zero_grad(set_to_none=True)
            batches = []
            for _ in range(sizes["grad_accum"]):
                tokens = torch.randint(0, args.vocab_size, batch_shape, device=device)
                batches.append((tokens[:, :-1], trainer.ignore_boundaries(tokens[:, 1:], args)))
            valid_tokens = trainer.count_valid_tokens(batches, dp_mesh.get_group())
            for inputs, labels in batches:
                trainer.forward_backward(model, inputs, labels, valid_tokens, dp, tp, z_loss=t.z_loss)
            del batches, inputs, labels
            counter.phase = f"gradient clipping of step {step}"
            trainer.clip_grad_norm(model, t.max_norm)  # and the all-reduce of the norm it logs
            counter.phase = f"optimizer step {step}"
            optimizer.step()
            float8_scales(model)
            scheduler.step()
            done(f"step {step}")
        after = counter.live
        counter.phase = "checkpoint state dict"
        sync = dataclasses.replace(cfg.checkpoint, async_mode="disabled")
        ckpt = Checkpointer(sync, cfg.job.dump_folder, run_keys={}, steps=t.steps, model=model,
                            optimizer=optimizer, scheduler=scheduler, loader=Nothing(),
                            notes={"model.converters": cfg.model.converters}, guard=Nothing())
        state = ckpt.state(2, 0)
    planner = dcp.DefaultSavePlanner()  # outside the fake mode: offsets from the mesh's real tensor
    planner.set_up_planner(state, is_coordinator=rank == 0)
    items = planner.create_local_plan().items
    tensors = [i.tensor_data for i in items if i.tensor_data is not None]
    written = sum(d.properties.dtype.itemsize * torch.Size(d.chunk.sizes).numel() for d in tensors)
    done("plan")
    dist.destroy_process_group()
    return {"rank": rank, "peak": counter.peak, "peak_phase": counter.peak_phase, "setup": setup,
            "after": after, "items": len(items), "written": written}


def child(cfg, sizes, rank, conn, trainer: str):
    """One rank in its own process: its result, or the trainer's one-line error, down the pipe."""
    try:
        conn.send(run_rank(cfg, sizes, rank, LiveStorages(), importlib.import_module(trainer), say=conn.send))
    except ConfigError as e:
        conn.send({"rank": rank, "error": str(e), "code": 2})
    except Exception as e:  # what the trainer would crash on at start-up: the exception, and where
        where = traceback.extract_tb(e.__traceback__)[-1]
        line = f"{os.path.basename(where.filename)}:{where.lineno}"
        error = f"rank {rank}: {type(e).__name__}: {e} ({line})".replace("\n", " ")
        conn.send({"rank": rank, "error": error, "code": 1})
    conn.close()


def validate(cfg, world_size: int, trainer) -> tuple:
    """(cfg, sizes): train.validate's sizes, with the rules train.py applies only on a GPU
    (float8.check's): the dry run models the GPU job, so a config its GPUs refuse at start-up ends
    here with that line. Not this machine's GPU: a laptop's A100 would refuse float8 for an H100
    cluster. Both as the heaviest of the [[phases]] has them (the longest sequence): its memory is
    the run's peak."""
    sizes = trainer.validate(cfg, world_size, gpu=True)
    training, sizes = sizes["phases"].heaviest(cfg.training, sizes)
    return dataclasses.replace(cfg, training=training), sizes


def dry_run(cfg, world_size: int, trainer, ranks=None) -> list:
    """Results for `ranks` (default 0 and world_size - 1), each in a process of its own, in parallel.
    trainer: the module whose set-up and steps run (train.py, or a fork of it)."""
    cfg, sizes = validate(cfg, world_size, trainer)
    # Each rank forks from a fresh server process that imported the trainer once, not from this one:
    # a fork inherits this process's thread pools, and once it has run CPU ops, torch 2.15 aborts in
    # the child ("Invalid thread pool!").
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([trainer.__name__])
    results = []
    procs = []
    for rank in ranks if ranks is not None else sorted({0, world_size - 1}):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=child, args=(cfg, sizes, rank, send, trainer.__name__), daemon=True)
        proc.start()
        send.close()
        procs.append((rank, proc, recv))
    pending = {recv: (rank, proc) for rank, proc, recv in procs}
    while pending:  # each rank's phase lines as they come, then its result
        for recv in multiprocessing.connection.wait(list(pending)):
            rank, proc = pending[recv]
            try:
                message = recv.recv()
            except EOFError:
                proc.join()
                message = {"rank": rank, "error": f"rank {rank}: the dry run's process died (exit code "
                           f"{proc.exitcode})", "code": 1}
            if isinstance(message, str):
                print(message, file=sys.stderr, flush=True)
                continue
            results.append(message)
            del pending[recv]
            proc.join()
    return sorted(results, key=lambda r: r["rank"])


HELP = ("train.py's set-up and two steps (the second holds the optimizer's state) at the job's "
        "world size, as rank 0 and the last rank: steady-state memory per rank")
EPILOG = ("One CPU process, no GPU; train.py's config rules for GPUs apply (H100-class: float8 "
          "matmuls). Other --section.key value arguments set train.py's config.")


def arguments(p: argparse.ArgumentParser):
    config_help = "train.py's TOML config (e.g. configs/llama3_405b.toml)"
    p.add_argument("--config", action="append", help=config_help)
    world_help = "GPUs in the job (e.g. 2048); it sets the sharding"
    p.add_argument("--world_size", type=int, required=True, help=world_help)


def run(world_size: int, rest: list, trainer) -> int:
    """The dry run of the trainer's config `rest` (--config and --section.key value arguments): its
    report, or the trainer's one `error:` line; the exit code. trainer: train.py, as the program
    that runs the dry run (preflight.py) hands it over: nothing in pretrain/ imports a program."""
    t0 = time.perf_counter()
    try:
        cfg = trainer.load_config(rest)
        cfg, sizes = validate(cfg, world_size, trainer)
        results = dry_run(cfg, world_size, trainer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    failed = next((r for r in results if "error" in r), None)
    if failed:
        print(f"error: {failed['error']}", file=sys.stderr, flush=True)
        return failed["code"]
    par = cfg.parallelism
    with torch.device("meta"):
        model = Transformer(trainer.model_args(cfg))
    with_float8 = ", float8" if "float8" in cfg.model.converters else ""
    compile_is = " is skipped" if cfg.compile.enable else " is off"
    print(f"dryrun: model {cfg.model.flavor} ({model.num_params():,} parameters), "
          f"world {world_size} = dp_replicate {par.data_parallel_replicate_degree} "
          f"x dp_shard {sizes['dp_shard']} x tp {par.tensor_parallel_degree}, "
          f"grad accumulation {sizes['grad_accum']}, activation checkpoint "
          f"{cfg.activation_checkpoint.mode}{with_float8}; fake process group and fake tensors, "
          f"eager (compile{compile_is}); two steps, the second holding the optimizer's state as every "
          "later step does")
    for r in results:
        print(f"rank {r['rank']}: peak {r['peak'] / GIB:.2f} GiB in {r['peak_phase']} "
              f"(after set-up {r['setup'] / GIB:.2f}, after step 2 {r['after'] / GIB:.2f}); "
              f"checkpoint: {r['items']} items, {r['written'] / GIB:.2f} GiB from this rank")
    print("not counted: NCCL's buffers, the CUDA context, the caching allocator's fragmentation, "
          "compile's workspaces, a validation or eval round; "
          f"\"fits\" keeps {memory.FREE:.0%} of the GPU free for them")
    f8_gather = "float8" in cfg.model.converters and cfg.float8.enable_fsdp_float8_all_gather
    estimate = memory.estimate_memory(model, sizes, training=cfg.training, optimizer=cfg.optimizer, cuda=True,
                                      activation_checkpoint=cfg.activation_checkpoint, float8_gather=f8_gather)
    print(f"bench.py memory's {memory.format_estimate(estimate)}")
    peak = max(r["peak"] for r in results)
    total = estimate["total"]  # bytes per rank, by bench.py memory's estimate
    for name, capacity in memory.GPUS:
        print(f"{name}: {memory.verdict(peak, capacity)} ({100 * peak / capacity:.0f}% of its "
              f"memory at the dry run's peak; {memory.verdict(total, capacity)} by the estimate)")
    print(f"dryrun took {time.perf_counter() - t0:.1f} s")
    return 0
