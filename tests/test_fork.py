"""Research edits that need no trainer change: new parameters (QK-norm) train alike on 1 process, FSDP and TP."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import model  # noqa: E402


def qknorm_losses(dump, *args, nproc=1):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    cmd = [*launcher, "tests/qknorm_train.py", "--config", "configs/debug_model.toml", "--job.dump_folder", str(dump),
           "--training.steps", "3", "--metrics.log_freq", "1", "--validation.enable", "false", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r]


def test_qk_norm_subclass_trains_alike_on_one_process_fsdp_and_tp(tmp_path):
    one = qknorm_losses(tmp_path / "one")
    fsdp = qknorm_losses(tmp_path / "fsdp", "--training.local_batch_size", "4", nproc=2)
    tp = qknorm_losses(tmp_path / "tp", "--parallelism.tensor_parallel_degree", "2", nproc=2)
    assert len(one) == 3 and one[2] < one[0]
    assert fsdp == pytest.approx(one, rel=1e-5) and tp == pytest.approx(one, rel=1e-5)


def test_init_weights_default_rule_for_new_parameters():
    args = model.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
    m = model.Transformer(args)
    m.layers[0].gate = torch.nn.Parameter(torch.empty(64, 64))  # what a research edit adds
    m.layers[0].scale = torch.nn.Parameter(torch.empty(64))
    torch.manual_seed(0)
    m.init_weights()
    assert torch.equal(m.layers[0].scale, torch.ones(64))
    assert 0.015 < m.layers[0].gate.std() < 0.025 and m.layers[0].gate.abs().max() <= 0.06
