"""[model] attn_mask_type = "block_causal" in training: the loss is the mean over the positions that count in
the global batch, so 1 process, FSDP 2 and TP 2 (selective AC) with gradient accumulation give the same losses,
validation included, and a resume is bitwise exact. The model-level tests (a packed window's logits equal its
documents' run alone; FlexAttention's mask equals SDPA's) are in tests/test_model.py.

The data is short documents (2 to 30 words, at most 55 tokens): every 64-token window holds a boundary,
most several, and micro-batches count different numbers of positions, so a mean of per-micro-batch means
would differ between layouts. The runs train the SMALL shape (2 blocks, seq 64)."""

import json
import os
import random
import shutil
import sys

import pytest

from conftest import SMALL, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is was for on that with as by at from his her an were which are this be or had "
         "river town field school music game season church number team world water school line house").split()


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A TOML like the debug config whose one source (and validation source) is a folder of short documents."""
    folder = tmp_path_factory.mktemp("short_docs")
    rng = random.Random(0)
    for split, docs in (("train", 3000), ("validation", 300)):
        os.makedirs(folder / split)
        with open(folder / split / "part-0.jsonl", "w") as f:
            for _ in range(docs):
                # at most 55 tokens: no window of seq 64 lies inside one document
                f.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(2, 30)))}) + "\n")
    with open(os.path.join(ROOT, "configs", "debug_model.toml")) as f:
        head = f.read().split("[[data.sources]]")[0]
    toml = folder / "short_docs.toml"
    toml.write_text(head + "".join(
        f'[[{section}.sources]]\nname = "short"\npath = "{folder}"\ndata_files = "{split}/*.jsonl"\n\n'
        for section, split in (("data", "train"), ("validation", "validation"))))
    return toml


def train(toml, dump, *args, nproc=1):
    argv = ["--config", toml, "--job.dump_folder", dump, "--metrics.log_freq", "1",
            "--model.attn_mask_type", "block_causal", "--training.steps", "4", "--training.global_batch_size", "8",
            "--validation.freq", "4", "--validation.sequences", "-1", "--validation.local_batch_size", "4",
            *SMALL, *args]
    proc = run_training(argv, nproc, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return proc.stdout, records


@pytest.mark.slow
def test_one_process_fsdp_and_tp_give_the_same_losses_and_a_resume_is_exact(short_docs, tmp_path):
    out, one = train(short_docs, tmp_path / "one", "--training.local_batch_size", 4)  # 2 micro-batches
    _, fsdp = train(short_docs, tmp_path / "fsdp", "--training.local_batch_size", 2, "--checkpoint.enable",
                    "--checkpoint.interval", 2, nproc=2)  # 2 ranks x 2 micro-batches
    _, tp = train(short_docs, tmp_path / "tp", "--training.local_batch_size", 4,  # 1 replica x 2 micro-batches
                  "--parallelism.tensor_parallel_degree", 2, "--activation_checkpoint.mode", "selective", nproc=2)
    steps = {name: [r for r in records if "loss" in r] for name, records in (("one", one), ("fsdp", fsdp), ("tp", tp))}
    counted = [r["loss_tokens"] for r in steps["one"]]
    assert all(0.7 * 8 * 64 < c < 0.99 * 8 * 64 for c in counted), counted  # each BOS label is left out
    assert " loss_tokens: " in out  # the log line says how many positions counted
    for name in ("fsdp", "tp"):
        assert [r["loss_tokens"] for r in steps[name]] == counted
        # Only the reduction order differs: measured within 3e-7 of each other. A mean of per-micro-batch means
        # (what the loss was before) differs here by 3.2e-5 at step 4.
        for a, b in zip(steps["one"], steps[name]):
            assert abs(a["loss"] - b["loss"]) <= 2e-6 * a["loss"], (name, a["step"], a["loss"], b["loss"])
    rounds = {name: [r for r in records if "validation_loss" in r] for name, records in (("one", one), ("fsdp", fsdp))}
    assert rounds["one"][0]["validation_tokens"] == rounds["fsdp"][0]["validation_tokens"]  # BOS labels left out
    assert abs(rounds["one"][0]["validation_loss"] - rounds["fsdp"][0]["validation_loss"]) < 1e-5

    # Resume from step 2: steps 3 and 4 are bitwise those of the run that never stopped.
    resumed = tmp_path / "fsdp"
    shutil.rmtree(resumed / "checkpoint" / "step-4")
    os.remove(resumed / "metrics.jsonl")
    _, again = train(short_docs, resumed, "--training.local_batch_size", 2, "--checkpoint.enable",
                     "--checkpoint.interval", 2, nproc=2)
    assert [(r["step"], r["loss"]) for r in again if "loss" in r] == [(r["step"], r["loss"]) for r in steps["fsdp"][2:]]


def test_micro_batches_with_different_counts_give_the_full_batch_gradient():
    """forward_backward divides by the positions counted in the whole batch: two micro-batches, one with most of
    its labels ignored, give the loss and the gradients of the whole batch at once (a mean of the two
    micro-batches' means would weigh the ignored-heavy one's few positions 3x)."""
    sys.path.insert(0, ROOT)
    import torch
    import model as M
    import train
    torch.manual_seed(0)
    net = M.Transformer(M.ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=16))
    net.init_weights()
    inputs = torch.randint(0, 64, (4, 16))
    labels = torch.randint(0, 64, (4, 16))
    labels[:2, 4:] = -100  # the first micro-batch counts 8 positions, the second 32
    total = (labels != -100).sum()
    full = torch.nn.functional.cross_entropy(net(inputs).flatten(0, 1), labels.flatten())
    want = torch.autograd.grad(full, list(net.parameters()))
    shares = [train.forward_backward(net, inputs[i:i + 2], labels[i:i + 2], total, 1, 1) for i in (0, 2)]
    assert abs(sum(ce for ce, _ in shares) - full) < 1e-6
    for p, g in zip(net.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
