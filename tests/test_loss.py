"""The loss a chunk of positions at a time (pretrain/loss.py): the same loss and gradients as the whole logits at
once, within fp32 rounding, with ignored positions and a z-loss swapped in; under TP; and a peak memory that grows
with the batch by its activations, not by its logits (Meta's 128,256-word vocabulary at the debug width)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conftest import SMALL, run_training  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from pretrain import loss as L  # noqa: E402


def z_loss(logits, labels):  # cross-entropy plus PaLM's z-loss, summed: what a forker swaps in
    counted = labels != -100
    return F.cross_entropy(logits, labels, reduction="sum") + 1e-4 * logits[counted].logsumexp(-1).pow(2).sum()


@pytest.mark.parametrize("loss_fn", [lambda x, y: F.cross_entropy(x, y, reduction="sum"), z_loss,
                                     lambda x, y: L.cross_entropy_and_z(x, y, 1e-4)], ids=["ce", "z", "ours"])
def test_chunks_give_the_whole_batchs_loss_and_gradients(loss_fn, monkeypatch):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, multiple_of=32, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (3, 33))
    labels = tokens[:, 1:].masked_fill(torch.rand(3, 32) < 0.2, -100)  # ignored positions, as block_causal's

    def run():
        model.zero_grad()
        h = model(tokens[:, :-1], last_hidden=True)
        loss = L.chunked_loss(model.output, h, labels, loss_fn)  # ours: (2,) cross-entropy, z term
        loss.sum().backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, whole_grads = run()
    monkeypatch.setattr(L, "CHUNK_BYTES", 4 * args.vocab_size * 10)  # 10 positions a chunk: 10 chunks
    assert L.chunk_positions(args.vocab_size) == 10
    chunked, grads = run()
    direct = loss_fn(model(tokens[:, :-1]).flatten(0, 1), labels.flatten())  # the logits at once
    assert torch.allclose(whole, direct.detach(), rtol=1e-6) and torch.allclose(chunked, whole, rtol=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(grad, whole_grads[name], rtol=1e-5, atol=1e-7), name


def test_the_z_term_is_z_loss_times_the_squared_log_normaliser_of_the_positions_that_count():
    logits = torch.randn(6, 50) * 3
    labels = torch.tensor([1, 2, -100, 4, -100, 6])
    ce, z = L.cross_entropy_and_z(logits, labels, 1e-3)
    assert ce == F.cross_entropy(logits, labels, reduction="sum")
    assert torch.allclose(z, 1e-3 * sum(torch.log(torch.exp(logits[i]).sum()) ** 2 for i in (0, 1, 3, 5)))
    assert torch.equal(L.cross_entropy_and_z(logits, labels, 0.0), torch.stack([ce, torch.zeros(())]))


def test_peak_memory_grows_with_the_batch_by_far_less_than_its_logits(monkeypatch):
    """The debug model's width with Meta's tokenizer: a micro-batch of 4 sequences of 1,024 tokens against 1, counted
    on fake tensors (the dry run's LiveStorages). Three more sequences' fp32 logits alone are 1.5 GiB."""
    llama_models = pytest.importorskip("llama_models")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import train
    from data import Tokenizer
    from pretrain.memory import LiveStorages
    meta = Tokenizer(os.path.join(os.path.dirname(llama_models.__file__), "llama3", "tokenizer.model"))
    cfg = train.load_config(["--config", os.path.join(ROOT, "configs", "debug_model.toml"), "--training.seq_len", "1024"])
    args = train.model_args(cfg, meta)
    assert args.vocab_size == 128_256 and args.dim == 256

    def peak(sequences: int) -> int:
        """The step's own bytes at its peak: the weights are made before the count starts."""
        counter = LiveStorages()
        counter.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with counter.fake_mode:
            model = Transformer(args)  # fake weights: shapes, no values
            tokens = torch.randint(0, args.vocab_size, (sequences, 1025))
        with counter.fake_mode, counter:
            train.forward_backward(model, tokens[:, :-1], tokens[:, 1:], torch.tensor(1024.0 * sequences), 1, 1)
        return counter.peak

    logits = 1024 * args.vocab_size * 4  # one sequence's fp32 logits
    grown = peak(4) - peak(1)  # the activations of 3 more sequences; the chunk's logits are no larger
    monkeypatch.setattr(L, "CHUNK_BYTES", 2**40)  # the logits at once, as before pretrain/loss.py
    at_once = peak(4) - peak(1)
    print(f"the peak grows {grown / 2**30:.2f} GiB from 1 to 4 sequences ({at_once / 2**30:.2f} GiB unchunked)")
    assert grown < logits < 3 * logits < at_once


def chunked_train(argv):
    """train.py with chunks of 8 positions (the debug vocabulary's would be one chunk): the TP path."""
    import train
    L.CHUNK_BYTES = 4 * 2048 * 8
    train.main(train.load_config(argv))


@pytest.mark.slow
def test_under_tp_the_chunks_give_the_same_losses(tp_reference, tmp_path):
    """TP 2's vocab-parallel output and loss_parallel, a chunk at a time: the losses of the unchunked reference."""
    import json
    ref_dump, _ = tp_reference
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", str(tmp_path), "--metrics.log_freq", "1",
            "--validation.enable", "false", "--training.steps", "10", *SMALL,
            "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective"]
    proc = run_training(argv, 2, program=__file__, env={"CHECK": "chunked_train"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def losses(dump):
        return [r["loss"] for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r]
    assert len(losses(tmp_path)) == 10
    assert losses(tmp_path) == pytest.approx(losses(ref_dump), rel=1e-5)


@pytest.mark.slow
def test_under_tp_the_z_loss_is_that_of_one_process(tmp_path):
    """training.z_loss on TP 2's vocab-sharded logits, a chunk at a time: the z term's logsumexp reduces over the
    shards. The cross-entropy and the z term of one process."""
    import json
    argv = ["--config", "configs/debug_model.toml", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--training.steps", "3", *SMALL, "--training.z_loss", "1e-3"]
    tp = run_training([*argv, "--job.dump_folder", tmp_path / "tp", "--parallelism.tensor_parallel_degree", "2"], 2,
                      program=__file__, env={"CHECK": "chunked_train"})
    one = run_training([*argv, "--job.dump_folder", tmp_path / "one"])
    for proc in (tp, one):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = [[(r["loss"], r["z_loss"]) for r in map(json.loads, open(tmp_path / d / "metrics.jsonl"))]
              for d in ("tp", "one")]
    assert len(logged[0]) == 3 and 0.04 < logged[0][0][1] < 0.1  # 1e-3 x ~8.1^2
    for (ce, z), (ce1, z1) in zip(*logged):
        assert (ce, z) == pytest.approx((ce1, z1), rel=1e-5)


if __name__ == "__main__":
    globals()[os.environ["CHECK"]](sys.argv[1:])
