"""The memory estimate (memory.estimate_memory, what `bench.py memory` prints) against a training step's measured peak.

The measurement is torch's FSDPMemTracker (MemTracker where one data-parallel rank trains without FSDP): it
counts every tensor storage alive (weights, gradients,
optimizer states, activations, temporaries) through a real step of the trainer's parallelize() on CPU,
so the comparison is exact at the tensor level and free of the allocator noise in a process's RSS.
Run as a script (under torchrun for several ranks), this file prints one JSON line per config: {"args", "estimate",
"measured"}.
"""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conftest import run_training  # noqa: E402

# 2 of the debug model's blocks at its seq 256, batch 4: activations and the logits are ~2/3 of the measured
# peak without AC, model states the rest (the estimate: -1.4%..+3.0% off, 2026-11-26), at a third of the
# time of 6 blocks
SHAPE = ["--config", os.path.join(ROOT, "configs/debug_model.toml"), "--training.local_batch_size", "4",
         "--model.n_layers", "2"]
SAC = ["--activation_checkpoint.mode", "selective"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
ONE_PROCESS = [[], ["--activation_checkpoint.mode", "full"], SAC,
               [*SAC, "--activation_checkpoint.selective_ac_option", "2"], BF16, [*BF16, *SAC],
               ["--training.global_batch_size", "16"],  # accumulation: gradients live through forward
               ["--optimizer.name", "Muon"]]  # its momentum for the matrices, AdamW's moments for the rest
TWO_PROCESSES = [[], ["--parallelism.tensor_parallel_degree", "2"],
                 ["--parallelism.tensor_parallel_degree", "2", *SAC, *BF16], ["--optimizer.name", "Muon"]]


def measure(configs):
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    import bench
    import train
    from model import Transformer

    if "RANK" in os.environ:  # several ranks
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for extra in configs:
        cfg = train.load_config([*SHAPE, *extra])
        sizes = train.validate(cfg, dist.get_world_size())
        with torch.device("meta"):
            model = Transformer(train.flavor_args(cfg))
        parts = bench.estimated(cfg, model, sizes, cuda=False)
        estimate = parts["total"] - parts["runtime"]  # without the process itself
        mesh = init_device_mesh("cpu", (1, sizes["dp_shard"], cfg.parallelism.tensor_parallel_degree),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        train.parallelize(model, mesh, cfg)
        model.to_empty(device="cpu")
        model.init_weights()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if cfg.optimizer.name == "Muon":  # the trainer's, sharded as the weights are
            optimizer = train.build_optimizer(model, cfg, torch.device("cpu"))[0]
        tokens = torch.randint(0, model.args.vocab_size, (cfg.training.local_batch_size, cfg.training.seq_len + 1))
        tracker = None

        global_tokens = torch.tensor(float(tokens[:, 1:].numel() * sizes["grad_accum"] * sizes["dp"]))

        def step():  # the trainer's step: accumulation, its loss, clipping, AdamW, gradients set to None
            for _ in range(sizes["grad_accum"]):
                if tracker is not None:
                    tracker.reset_mod_stats()  # it tracks one forward per module unless reset
                train.forward_backward(model, tokens[:, :-1], tokens[:, 1:], global_tokens, sizes["dp"],
                                       cfg.parallelism.tensor_parallel_degree)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # the first step creates AdamW's state
        if sizes["dp"] > 1:
            tracker = FSDPMemTracker(model, optimizer)
        else:  # no FSDP (train.parallelize's autocast): the general tracker, told of the model and AdamW
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
        with tracker:
            step()
        measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        if dist.get_rank() == 0:
            print(json.dumps({"args": extra, "estimate": estimate, "measured": measured}), flush=True)
    dist.destroy_process_group()


def run(configs, nproc):
    proc = run_training([json.dumps(configs)], nproc, program=os.path.abspath(__file__))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,configs", [(1, ONE_PROCESS), (2, TWO_PROCESSES)], ids=["1proc", "2proc"])
def test_estimate_is_within_15_percent_of_the_measured_peak(nproc, configs):
    results = run(configs, nproc)
    assert len(results) == len(configs)
    for r in results:
        error = r["estimate"] / r["measured"] - 1
        # Within 15%, and never more than 5% under: an estimate that is low sends a user into an OOM.
        assert -0.05 <= error <= 0.15, f"{r['args']}: estimate {r['estimate']:,.0f} vs measured {r['measured']:,.0f} B"


def test_estimate_scales_with_the_layout():
    """Sharding divides the model states; AC and TP shrink activations; the big flavors come out in the
    range published for them (8B, seq 8192, bf16, selective AC on 8 GPUs: tens of GiB, not hundreds)."""
    import torch

    import bench
    import train
    from model import Transformer, flavors

    def total(flavor, world, *extra, part="total"):
        cfg = train.load_config(["--config", os.path.join(ROOT, "configs/llama3_8b.toml"), "--model.flavor", flavor,
                                 *extra])
        with torch.device("meta"):
            model = Transformer(flavors[flavor])
        return bench.estimated(cfg, model, train.validate(cfg, world), cuda=True)[part] / 2**30

    assert total("8B", 8, part="optimizer") == pytest.approx(total("8B", 16, part="optimizer") * 2)
    assert total("8B", 8, "--activation_checkpoint.mode", "full") < total("8B", 8) < total(
        "8B", 8, "--activation_checkpoint.mode", "none")
    assert total("8B", 8, "--parallelism.tensor_parallel_degree", "2", part="activations") < total(
        "8B", 8, part="activations")
    assert 20 < total("8B", 8) < 80


@pytest.mark.parametrize("name,world", [("llama3_1b", 8), ("llama3_3b", 8), ("llama3_8b", 8), ("llama3_70b", 32),
                                        ("llama3_405b", 128)])
def test_shipped_configs_fit_an_80_gib_gpu(name, world):
    """Each GPU config, on the smallest job its header names, fits an H100 80 GB with memory.FREE
    to spare for the allocator's fragmentation (what `bench.py memory` calls "fits")."""
    import bench
    from pretrain import memory

    cfg, model, sizes = bench.planned(["--config", os.path.join(ROOT, f"configs/{name}.toml")], world)
    total = bench.estimated(cfg, model, sizes, cuda=True)["total"]
    assert memory.FRAGMENTATION * total < 80 * 2**30, f"{name} on {world} GPUs: {total / 2**30:.1f} GiB estimated"


def test_resident_memory_without_proc(monkeypatch):
    """macOS has no /proc: the CPU estimate falls back to the peak RSS so far instead of failing."""
    import builtins

    from pretrain import memory

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    on_linux = memory.resident_bytes()
    monkeypatch.setattr(builtins, "open", no_proc)
    assert memory.resident_bytes() >= 0.9 * on_linux  # the peak so far is never below the current figure


if __name__ == "__main__":
    measure(json.loads(sys.argv[1]))
