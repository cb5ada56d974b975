"""Trainer features on one CPU process: accumulation, activation checkpointing, compile, metrics."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(dump, *args):
    cmd = [sys.executable, "train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
           "--metrics.log_freq", "1", "--validation.enable", "false", *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return proc.stdout, [r for r in map(json.loads, f) if "loss" in r]  # training steps, not validation rounds


def losses(records):
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """3 steps, local batch 8, no activation checkpointing, fp32, eager."""
    return train(tmp_path_factory.mktemp("base"), "--training.steps", 3)[1]


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch(baseline, tmp_path):
    _, records = train(tmp_path, "--training.steps", 3, "--training.local_batch_size", 4,
                       "--training.global_batch_size", 8)
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=1e-5)
    assert records[-1]["tokens_seen"] == baseline[-1]["tokens_seen"] == 3 * 8 * 256


@pytest.mark.slow
@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_does_not_change_the_math(baseline, tmp_path, mode, option):
    _, records = train(tmp_path, "--training.steps", 3, "--activation_checkpoint.mode", mode,
                       "--activation_checkpoint.selective_ac_option", option)
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=1e-6)


# One forward + backward of the trainer's parallelized model per AC mode, counting the matmuls and attention
# calls that run (recomputation runs them again). A process of its own: it opens a 1-rank process group.
COUNT_OPS = r"""
import collections
import json
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
import train
from model import Transformer

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
result = {}
for mode in ("none", "selective", "full"):
    cfg = train.load_config(["--config", "configs/debug_model.toml", "--training.seq_len", "32",
                             "--training.local_batch_size", "2", "--activation_checkpoint.mode", mode])
    with torch.device("meta"):
        model = Transformer(train.flavor_args(cfg))
    train.parallelize(model, init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp")), cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    counts = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        model(torch.zeros(2, 32, dtype=torch.long)).sum().backward()
    result[mode] = {op: n for op, n in counts.items() if op == "mm" or "dot_product" in op}
print(json.dumps(result))
"""


@pytest.mark.slow
def test_selective_ac_recomputes_no_matmul_and_no_attention():
    """Selective AC (op) keeps every matmul's and attention's output, whichever SDPA kernel the device runs (the
    CPU's too): the same calls as without AC. Full AC runs each block's forward again."""
    proc = subprocess.run([sys.executable, "-c", COUNT_OPS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    attention = [op for op in counts["none"] if "dot_product" in op and "backward" not in op]
    assert attention and counts["none"][attention[0]] == 6  # one call per block
    assert counts["selective"] == counts["none"]
    assert counts["full"][attention[0]] == 12 and counts["full"]["mm"] > counts["none"]["mm"]


@pytest.mark.slow
def test_compile_per_block(baseline, tmp_path):
    _, records = train(tmp_path, "--training.steps", 3, "--compile.enable")
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=1e-4)  # fused kernels round differently, not much


@pytest.mark.slow
def test_bf16_mixed_precision_stays_close_to_fp32(baseline, tmp_path):
    _, records = train(tmp_path, "--training.steps", 3, "--training.mixed_precision_param", "bfloat16")
    for a, b in zip(losses(records), losses(baseline)):
        assert a == pytest.approx(b, rel=2e-2)


@pytest.mark.slow
def test_mfu_with_configured_peak_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    out, records = train(tmp_path, "--training.steps", 2, "--metrics.peak_tflops", "0.5",
                         "--metrics.enable_tensorboard")
    assert all(r["mfu"] == pytest.approx(100 * r["tflops"] / 0.5) for r in records)
    assert "mfu: n/a" not in out and "mfu: " in out
    tb = os.path.join(tmp_path, "tb")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))


@pytest.mark.slow
def test_mfu_is_na_on_cpu_without_a_peak(baseline):
    assert all(r["mfu"] is None for r in baseline)
    # FLOPs per token: 6 x non-embedding params + 12 x layers x heads x head_dim x seq_len
    flops_per_token = 6 * (5_770_496 - 2048 * 256) + 12 * 6 * 16 * 16 * 256
    assert baseline[-1]["tflops"] == pytest.approx(flops_per_token * baseline[-1]["tps"] / 1e12)


@pytest.mark.slow
def test_the_config_goes_to_config_toml_and_one_summary_line(tmp_path):
    out, _ = train(tmp_path, "--training.steps", 1)
    assert "[training]" not in out and (tmp_path / "config.toml").read_text().count("[training]") == 1
    summary = [ln for ln in out.splitlines() if "5,770,496 parameters" in ln]
    assert len(summary) == 1 and f"config in {tmp_path}/config.toml" in summary[0]
    out, _ = train(tmp_path / "p", "--training.steps", 1, "--job.print_config")
    assert "[training]" in out and "local_batch_size = 8" in out
