"""Coming from torchtitan and going back, against the real torchtitan this Python has, 0.3.0 or 0.2.2
(pretrain/titan_run.py: our debug shape, its c4_test loader on the bundled C4 sample, CPU): its checkpoints
convert bit for bit and give our logits in transformers, train.py continues its run (0.3.0's fused q/k/v
moments split as its own FusedQKVLinear splits its weights), and torchtitan starts from dcp2titan's folder
with our model's loss. Slow, and skipped where torchtitan is not installed (CI): the layouts alone are tested
without it in tests/test_convert.py and tests/test_checkpoint.py. 0.2.2 runs in a venv of its own
(docs/checkpoints.md#coming-from-torchtitan)."""

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402
import checkpoint_convert as C  # noqa: E402
from conftest import SMALL, run_training, titan_names  # noqa: E402
import model as M  # noqa: E402
from pretrain.titan_run import titan_command, titan_tokenizer  # noqa: E402
import train  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "debug_model.toml")
# Both trainers run the SMALL shape (2 of the debug model's blocks, seq 64): its checkpoints carry every
# kind of weight the layouts name, at a fifth of the 6-block, seq-256 steps' time
ARGS = dataclasses.replace(M.flavors["debugmodel"], n_layers=2)
INSTALLED = importlib.util.find_spec("torchtitan") is not None
VERSION = importlib.metadata.version("torchtitan") if INSTALLED else ""  # "0.3.0" or "0.2.2"
WARMUP = ("--lr_scheduler.warmup_steps", "4")  # the same schedule shape in both trainers
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*assuming the intent is to"),
              pytest.mark.skipif(not INSTALLED,
                                 reason="torchtitan is not installed (pip install --no-deps -r requirements-bench.txt)")]


def torchtitan(folder, steps: int, *flags) -> dict:
    """A torchtitan run of our SMALL shape in `folder` (also its tokenizer files): {step: logged loss}."""
    cfg, model, sizes = bench.planned(["--config", CONFIG, *SMALL], 1)
    titan_tokenizer(cfg, str(folder))
    args = argparse.Namespace(steps=steps, warmup=1, nproc=1, device="cpu")  # warmup: its log_freq
    cmd = titan_command(cfg, model.args, sizes, args, str(folder)) + [*WARMUP, "--checkpoint.enable", *flags]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return {int(s): float(v) for s, v in re.findall(r"step:\s*(\d+)\s+loss:\s*([\d.]+)", proc.stdout)}


def ours(dump, *args, nproc=1) -> tuple:
    """(output, metrics.jsonl's training records) of a train.py run of the debug config, SMALL shape."""
    argv = ["--config", CONFIG, "--job.dump_folder", dump, "--metrics.log_freq", "1", "--validation.enable", "false",
            *WARMUP, *SMALL, *args]
    proc = run_training(argv, nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return proc.stdout + proc.stderr, [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory):
    """10 steps, saves at 5 (full) and 10 (the last: model only, bf16), as the issue's user ran it."""
    folder = tmp_path_factory.mktemp("titan")
    torchtitan(folder, 10, "--checkpoint.interval", "5", "--checkpoint.last_save_model_only",
               "--checkpoint.export_dtype", "bfloat16")
    return folder / "checkpoint"


def test_its_checkpoints_convert_bit_for_bit_with_our_logits(titan_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import LlamaForCausalLM
    params = tmp_path / "params.json"  # torchtitan saves none; the 2-block shape is no flavor of model.py
    json.dump(ARGS.params(), open(params, "w"))
    assert C.dcp_args(str(titan_run), "debugmodel") == M.flavors["debugmodel"]  # --params may name a flavor
    for step, dtype in ((5, torch.float32), (10, torch.bfloat16)):
        dcp_to_torch_save(str(titan_run / f"step-{step}"), str(tmp_path / f"stock{step}.pt"))
        stock = torch.load(tmp_path / f"stock{step}.pt", weights_only=True)
        meta_names = list(M.Transformer(ARGS).state_dict())
        stock = {k: stock[t] for k, t in zip(meta_names, titan_names(dict.fromkeys(meta_names), VERSION))}
        out = tmp_path / f"meta{step}"
        C.main(["dcp2torch", "--input_dir", str(titan_run / f"step-{step}"), "--output_dir", str(out),
                "--params", str(params)])
        sd = torch.load(out / "consolidated.00.pth", weights_only=True)
        assert len(sd) == 9 * ARGS.n_layers + 3 and all(w.dtype == dtype for w in sd.values())
        for k, w in sd.items():
            assert torch.equal(w.view(torch.uint8), stock[k].view(torch.uint8)), k  # bits, not just values
    hf = tmp_path / "hf"
    C.main(["dcp2hf", "--input_dir", str(titan_run / "step-10"), "--output_dir", str(hf),
            "--params", str(params), "--tokenizer_path", os.path.join(ROOT, C.DEFAULT_TOKENIZER)])
    model = M.Transformer(ARGS)
    model.load_state_dict({k: w.float() for k, w in sd.items()})
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(tokens), LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)(tokens).logits
    assert (got - want).abs().max() < 1e-4


def test_train_continues_its_run_or_takes_its_weights(titan_run, tmp_path):
    """From its full step-5 with initial_load_model_only = false (2 FSDP ranks): step 6 next, at the lr our
    schedule has there, and the log says the data position stays behind. From its bf16 step-10: the weights."""
    out, records = ours(tmp_path / "cont", "--checkpoint.initial_load_path", titan_run / "step-5",
                        "--checkpoint.initial_load_model_only", "false", "--training.steps", 7,
                        "--training.local_batch_size", 4, nproc=2)
    assert "is torchtitan's: took its weights, AdamW moments, step 5" in out
    assert "not its data position (another loader)" in out
    cfg = train.load_config(["--config", CONFIG, *WARMUP, *SMALL, "--training.steps", "7"])
    assert [r["step"] for r in records] == [6, 7]
    assert records[0]["lr"] == pytest.approx(cfg.optimizer.lr * train.lr_factor(5, cfg), rel=1e-6)

    out, fresh = ours(tmp_path / "weights", "--checkpoint.initial_load_path", titan_run / "step-10",
                      "--training.steps", 2)
    assert "loaded weights from" in out and [r["step"] for r in fresh] == [1, 2]
    two = train.load_config(["--config", CONFIG, *WARMUP, *SMALL, "--training.steps", "2"])
    assert fresh[0]["lr"] == pytest.approx(two.optimizer.lr * train.lr_factor(0, two), rel=1e-6)  # warm-up again
    # Trained weights: well below a fresh model's loss (ln 2048 = 7.6), on our data.
    assert fresh[0]["loss"] < 7.0 and records[0]["loss"] < 7.5


def first_batch(folder, seq_len=64, batch=8):
    """torchtitan's first batch, from its own dataset class (as pretrain/titan_run.py imports it: without triton
    its MoE kernels, unused by llama3, are stubbed)."""
    if importlib.util.find_spec("triton") is None:
        kernels = sys.modules.setdefault("torchtitan.models.moe.kernels", types.ModuleType("kernels"))
        kernels.generate_permute_indices = kernels.fill_indices_wrapper = None
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
    # 0.3.0 shifts each document's labels within it, and hands positions that titan_run drops on CPU (SDPA)
    tokenizer = HuggingFaceTokenizer(str(folder)) if VERSION.startswith("0.2.") else HuggingFaceTokenizer(
        tokenizer_path=str(folder))
    data = HuggingFaceTextDataset("c4_test", os.path.join(ROOT, "assets/data/c4"), tokenizer, seq_len, infinite=True)
    samples = [sample for sample, _ in zip(data, range(batch))]
    return torch.stack([s[0]["input"] for s in samples]), torch.stack([s[1] for s in samples])


def test_torchtitan_starts_from_dcp2titan_with_our_loss(tmp_path):
    """Our weights (a DCP folder as torch2dcp and the trainer write it) -> dcp2titan -> torchtitan's
    initial_load_path: it trains 3 steps, and its step-1 loss is our model.py's on its first batch."""
    args = ARGS
    torch.manual_seed(7)
    model = M.Transformer(args)
    model.init_weights()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    json.dump(args.params(), open(tmp_path / "ours" / "params.json", "w"))
    C.main(["dcp2titan", "--input_dir", str(tmp_path / "ours"), "--output_dir", str(tmp_path / "titan_in"),
            "--titan_version", VERSION])
    folder = tmp_path / "run"
    folder.mkdir()
    losses = torchtitan(folder, 3, "--checkpoint.initial_load_path", str(tmp_path / "titan_in"))
    assert sorted(losses) == [1, 2, 3]  # it trains on from our weights
    inputs, labels = first_batch(folder)
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert losses[1] == pytest.approx(expected, abs=1e-4)  # torchtitan logs 5 decimals


@pytest.mark.skipif(VERSION.startswith("0.2."), reason="0.2.2 keeps q, k and v apart")
def test_fused_qkv_splits_as_torchtitan_splits_it():
    """titan_layout.split_qkv (how its fused q/k/v moments become ours) cuts rows as 0.3.0's FusedQKVLinear
    cuts its weight into wq, wk and wv on save, for grouped and plain multi-head attention."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from pretrain.titan_layout import split_qkv
    for n_heads, n_kv in ((16, 8), (8, 2), (4, 4)):
        hd, dim = 8, 32
        fused = torch.randn((n_heads + 2 * n_kv) * hd, dim)
        module = types.SimpleNamespace(head_dim=hd, heads_per_kv=n_heads // n_kv, r_dim=n_heads // n_kv + 2)
        theirs = {"wqkv.weight": fused}
        FusedQKVLinear._split_qkv_on_save(module, theirs, "", None)
        ours = split_qkv(fused, n_heads, n_kv)
        for p in ("wq", "wk", "wv"):
            assert torch.equal(ours[p], theirs[f"{p}.weight"]), (n_heads, n_kv, p)
