"""The loss a chunk of positions at a time (pretrain/loss.py): the same loss and gradients as the whole logits at
once, within fp32 rounding, with ignored positions and a z-loss swapped in; under TP; and a peak memory that grows
with the batch by its activations, not by its logits (Meta's 128,256-word vocabulary at the debug width)."""

import os
import sys
from functools import partial

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


def test_the_backward_joins_the_chunks_gradients_once(monkeypatch):
    """chunked_loss splits h: in backward the chunks' gradients are joined into one tensor of h's size (a cat), where
    a slice per chunk (h[start:start + n]) made a zeros of h's size for each chunk and added them up. Counted on the
    backward's aten ops (views aside), 3 chunks; the gradient is the whole logits' at once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WholeSize(TorchDispatchMode):
        """The names of the ops that make a new tensor of h's (tokens, dim) shape."""

        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and isinstance(out, torch.Tensor) and out.shape == (24, 16):
                self.ops.append(str(func))
            return out

    torch.manual_seed(0)
    output = torch.nn.Linear(16, 64, bias=False)
    h = torch.randn(2, 12, 16, requires_grad=True)  # (bs, seqlen, dim): 24 positions
    labels = torch.randint(0, 64, (2, 12)).masked_fill(torch.rand(2, 12) < 0.2, -100)
    loss_fn = partial(L.cross_entropy_and_z, z_loss=1e-3)
    monkeypatch.setattr(L, "CHUNK_BYTES", 4 * 64 * 8)  # 8 positions a chunk: 3 chunks
    loss = L.chunked_loss(output, h, labels, loss_fn)
    with WholeSize() as made:
        loss.sum().backward()
    assert made.ops == ["aten.cat.default"], made.ops
    whole = h.detach().requires_grad_()
    direct = loss_fn(output(whole).flatten(0, 1), labels.flatten())  # the logits at once
    direct.sum().backward()
    assert torch.allclose(loss, direct, rtol=1e-6)
    assert torch.allclose(h.grad, whole.grad, rtol=1e-5, atol=1e-7)


def test_the_held_out_loss_takes_a_chunk_of_positions_at_a_time(monkeypatch):
    """Validation's loss (L.heldout_loss, under no_grad) is the whole logits' summed cross-entropy, and no tensor of
    it holds more than a chunk's logits (docs/internals.md#validation: what whole logits cost at 8B)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=1000, multiple_of=32, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (3, 33))
    labels = tokens[:, 1:].masked_fill(torch.rand(3, 32) < 0.2, -100)
    weight = model.output.weight.untyped_storage().data_ptr()
    rows = []  # the positions of each tensor over the vocabulary (the output weight's views aside)

    class Logits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            out = func(*args_, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.shape[-1:] == (args.vocab_size,):
                    if t.untyped_storage().data_ptr() != weight:
                        rows.append(t.numel() // args.vocab_size)
            return out

    monkeypatch.setattr(L, "CHUNK_BYTES", 4 * args.vocab_size * 10)  # 10 positions a chunk: 10 chunks
    with torch.no_grad(), Logits():
        ours = L.heldout_loss(model, tokens[:, :-1], labels, tp=1)
    with torch.no_grad():
        whole = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), labels.flatten(), reduction="sum")
    assert torch.allclose(ours, whole, rtol=1e-6) and rows and max(rows) == 10


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


def test_under_tp_the_z_term_reduces_the_shards_without_gathering_the_logits():
    """TP 2's vocab-parallel output layer (train.py's style) and loss_parallel: the z term's logsumexp all-reduces one
    max and one sum a position, it never all-gathers a chunk's logits (CommDebugMode counts the collectives of forward
    and backward); the z term and its gradients are one process's, in one chunk and in 3."""
    proc = run_training([], 2, program=__file__, env={"CHECK": "tp_z_term"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def tp_z_term(argv):
    """The test above, on each rank of 2."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.distributed.tensor.parallel import parallelize_module
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same output layer, h and labels on both ranks
    output = torch.nn.Linear(16, 64, bias=False)
    h = torch.randn(2, 12, 16)  # (bs, seqlen, dim): the final norm's output, 24 positions
    labels = torch.randint(0, 64, (2, 12)).masked_fill(torch.rand(2, 12) < 0.2, -100)
    one = copy.deepcopy(output)  # one process's
    style = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(output, mesh, style)  # (tokens, vocab / 2) logits on each rank
    tp_h = distribute_tensor(h, mesh, [Replicate()])  # replicated, as train.py's model gives it

    def z_term(layer, h):
        """The z term of h's loss, and its gradients w.r.t. h and the layer's weight."""
        layer.zero_grad()
        h = h.detach().requires_grad_()
        with loss_parallel():
            z = L.chunked_loss(layer, h, labels, partial(L.cross_entropy_and_z, z_loss=1e-3))[1]
            z.backward()
        return [z.detach(), h.grad, layer.weight.grad]

    def whole(tensors):
        return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]

    # One chunk: CommDebugMode's module tracker fails on a module called twice in one forward
    comm = CommDebugMode()
    with comm:
        tp = z_term(output, tp_h)
    gathers = [str(op) for op in comm.get_comm_counts() if "all_gather" in str(op)]
    assert not gathers, f"the loss all-gathered the logits: {dict(comm.get_comm_counts())}"
    L.CHUNK_BYTES = 4 * 64 * 8  # 8 positions a chunk: 3 chunks
    expected = z_term(one, h)
    for tensors in (tp, z_term(output, tp_h)):  # one chunk, then 3
        for got, want in zip(whole(tensors), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[os.environ["CHECK"]](sys.argv[1:])
