"""The memory a training step needs per device, estimated from the model's shapes and the run's
layout: what `bench.py memory`, the dry run, `preflight.py check` and `bench.py matrix` print. A
property of model.py's ops and train.py's layout, so re-check the byte counts after editing either
(tests/test_memory.py measures them). And the memory counted as a step runs (LiveStorages): the dry
run's figure per rank, and tests/test_dryrun.py's on real runs.
"""

import os
import resource
import sys
import weakref

import torch
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from pretrain import muon
from pretrain.loss import chunk_positions

GIB = 2**30
# What the devices report (nvidia-smi's MiB): "fits" is judged against these.
GPUS = [("H100 80 GB", 81559 * 2**20), ("H200 141 GB", 143771 * 2**20)]
# "fits" adds this share to the estimate for what it does not count: the caching allocator's
# fragmentation, NCCL, the CUDA context. On an H100 the allocator reserved about this much over the
# peak allocated, and a smaller margin filled the GPU until the allocator stalled mid-step to free
# its cache and retry (docs/performance.md#one-h100).
FRAGMENTATION = 1.25
FREE = 1 - 1 / FRAGMENTATION  # the share of a GPU's memory that "fits" leaves free


def peak_resident_bytes() -> int:
    """The process's peak resident memory since it started (train.py's memory figure on CPU)."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def resident_bytes() -> int:
    """The process's resident memory now (Linux), or its peak so far (close to it at start-up)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS)
        return peak_resident_bytes()


def estimate_memory(model, sizes: dict, *, training, optimizer, activation_checkpoint, float8_gather: bool,
                    cuda: bool) -> dict:
    """Bytes per device at a training step's peak, by part, for eager mode (compile keeps less).

    Weights, gradients and AdamW's moments are fp32 (or bf16 moments), sharded over dp_shard x tp;
    Muon's step (optimizer.name) holds a whole matrix or two beside the gradients (muon.in_flight).
    At the peak FSDP holds the root's weights (embedding, norm, output) and the last block gathered
    in the param dtype; without FSDP (one dp rank) bf16 autocast keeps a copy of every block's
    weights for backward, and the residual stream stays fp32. Per block and token, backward keeps
    (counted from model.py's ops; b: bytes of the activations' dtype, d: dim, kv: kv heads x
    head_dim, f: FFN hidden; the fp32 copies in RMSNorm and rope are 4 bytes each):
      AC none 5bd + 2b kv' + 12d + 4kv + 4bf + 4 n_heads, where kv' (the k and v attention keeps)
      is kv, or d on CUDA in fp32 (model.causal_attention copies the kv heads there); selective op
      b(5d + 2kv + 2f) (the matmul and attention outputs); full bd (the block input). With AC one
      block's full set comes back during its backward.
    The loss keeps fp32 log-probs of a chunk of positions (pretrain/loss.py; at most the micro-batch's
    tokens) x vocab, and its backward holds two more such tensors;
    under TP (loss parallel) the sharded log-softmax keeps its input, the fp32 logits, too, and the
    output layer keeps its all-gathered input whole.
    CPU adds the process's resident memory before the model exists (Python, torch, tokenizer).
    float8_gather (float8 with enable_fsdp_float8_all_gather) gathers the blocks' Linear weights in 1 byte each;
    activations stay as counted (torchao keeps each Float8Linear's input in high precision)."""
    a = model.args
    t = training
    tp = sizes["tp"]
    shards = sizes["dp_shard"] * tp
    bw = 2 if t.mixed_precision_param == "bfloat16" else 4  # the param dtype's bytes
    b = bw if sizes["dp"] > 1 else 4  # the activations' (a little high under autocast)
    block = model.layers[0]
    n_total = model.num_params()
    n_block = sum(q.numel() for q in block.parameters())
    d = a.dim
    kv = block.attention.wk.out_features
    f = block.feed_forward.w1.out_features
    tokens = t.local_batch_size * t.seq_len
    # With sequence parallelism the norms see tokens / tp; attention and FFN see a tp-th of the
    # heads and hidden units over all tokens; the inputs gathered for wq/wk/wv and w1/w3 and the
    # partial sums out of wo and w2 are full size.
    norm = 2 * (b * d + 4 * d) / tp
    kv_kept = d if cuda and b == 4 else kv
    split = 3 * b * d + 2 * b * kv_kept + 4 * d + 4 * kv + 4 * b * f + 4 * a.n_heads  # over tp
    full_size = 2 * b * d if tp > 1 else 0
    full_block = norm + split / tp + full_size
    # Bytes per token one block keeps for backward, by AC mode.
    saved = {"none": full_block,
             "full": b * d / tp,  # the block input
             # wq, attention, wk, wv, w1, w3 | the input | wo, w2
             "op": bw * (2 * d + 2 * kv + 2 * f) / tp + b * d / tp + 2 * b * d}
    ac = activation_checkpoint
    mode = "op" if ac.mode == "selective" and ac.selective_ac_option == "op" else ac.mode
    if mode == "selective":  # full AC on every Nth block, none on the others
        n_ac = len(range(0, a.n_layers, int(ac.selective_ac_option)))
        all_blocks = n_ac * saved["full"] + (a.n_layers - n_ac) * full_block
    else:
        all_blocks = a.n_layers * saved[mode]
    n_linear = sum(q.numel() for q in block.parameters() if q.ndim == 2)  # wq wk wv wo w1 w2 w3
    root_and_last = n_total - (a.n_layers - 1) * n_block  # the root and the last block
    float8_saves = (bw - 1) * n_linear * float8_gather  # float8 gathers 1 byte per Linear weight
    gathered = (bw * root_and_last - float8_saves) / tp  # FSDP's; without: autocast's (fp32: none)
    gathered = gathered if sizes["dp"] > 1 else (bw == 2) * 2 * a.n_layers * n_block / tp
    loss_bytes = 16 if tp > 1 else 12  # per logit: TP's log-softmax keeps the fp32 logits too
    # AdamW: two moments a parameter; Muon (pretrain/muon.py): one momentum buffer a matrix weight
    state = 4 if optimizer.state_dtype == "bfloat16" else 8
    n_muon = n_linear * a.n_layers if optimizer.name == "Muon" else 0
    parts = {"weights": 4 * n_total / shards,
             "optimizer": (state * (n_total - n_muon) + state / 2 * n_muon) / shards,
             "gradients": 4 * n_total / shards,
             "gathered": gathered,
             # the blocks', plus the final norm's and the output layer's input
             "activations": tokens * (all_blocks + 4 * d / tp + b * d),
             # a chunk of positions at a time, vocab-sharded under TP
             "loss": min(tokens, chunk_positions(a.vocab_size)) * loss_bytes * a.vocab_size / tp,
             "runtime": 0 if cuda else resident_bytes(),
             "muon": muon.in_flight(block) if n_muon else 0}
    # Two candidate peaks. (1) The loss's backward: every block's activations and the loss tensors
    # (and the gradients under accumulation; otherwise zero_grad(set_to_none) freed them). (2) A
    # block's backward: gradients of the blocks above, activations of the blocks below, and the
    # block's own working set (what AC recomputes, plus about two FFN-sized gradients). It peaks at
    # the top or the bottom block: linear in between.
    accumulating = sizes["grad_accum"] > 1
    at_loss = parts["activations"] + parts["loss"] + (parts["gradients"] if accumulating else 0)
    kept = saved[mode] if mode in saved else all_blocks / a.n_layers  # what AC keeps of a block
    working = tokens * (full_block - kept + 2 * b * f / tp)
    grad_out = 4 * (model.output.weight.numel() + d) / shards  # the output layer and final norm
    grad_block = 4 * n_block / shards
    if accumulating:
        in_blocks = parts["gradients"] + parts["activations"] + working
    else:
        top = grad_block + parts["activations"]  # one block's gradients, every block's activations
        bottom = a.n_layers * grad_block + parts["activations"] / a.n_layers  # the other way round
        in_blocks = working + grad_out + max(top, bottom)
    parts["total"] = (parts["weights"] + parts["optimizer"] + parts["gathered"] + parts["runtime"]
                      + max(at_loss, in_blocks, parts["gradients"] + parts["muon"]))
    return parts


def format_estimate(parts: dict) -> str:
    items = "  ".join(f"{k} {v / 2**30:.2f}" for k, v in parts.items() if k != "total" and v)
    return f"memory estimate per device: {parts['total'] / 2**30:.2f} GiB ({items} GiB)"


def verdict(total: float, capacity: float) -> str:
    """"fits" with FRAGMENTATION's margin, "tight" without it, else "too big"."""
    if FRAGMENTATION * total <= capacity:
        return "fits"
    return "tight" if total <= capacity else "too big"


class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages alive now (`live`) and at most so far (`peak`, with the `phase`
    it was in). Each storage an op returns is counted once, by its identity, until it is freed;
    storages made before the mode was entered are not. Real and fake tensors alike."""

    def __init__(self):
        super().__init__()
        self.paused = 0  # > 0 inside Paused: ops' outputs are not counted
        self.fake_mode = None  # the FakeTensorMode it runs under, set by dryrun.run_rank
        self.bytes = {}  # storage id -> its bytes now
        self.refs = {}  # storage id -> the weakref whose callback drops it
        self.live = 0  # bytes of the storages alive now
        self.phase = ""  # what the steps are doing now, set by dryrun.run_rank
        self.peak, self.peak_phase = 0, ""  # the most live bytes so far, and the phase it was in

    def add(self, storage, nbytes=None):
        key = id(storage)
        nbytes = storage.nbytes() if nbytes is None else nbytes  # given: the size resize_ sets
        if key not in self.refs:
            self.refs[key] = weakref.ref(storage, lambda _, key=key: self.drop(key))
        self.live += nbytes - self.bytes.get(key, 0)
        self.bytes[key] = nbytes
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase

    def drop(self, key):
        self.live -= self.bytes.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass(t) for t in tree_leaves((args, kwargs))):
            return NotImplemented  # a DTensor or float8 op: its ops on plain tensors come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out) if not self.paused else ():
            real = isinstance(t, torch.Tensor) and t.device.type != "meta"
            if real and id(t.untyped_storage()) not in self.refs:
                self.add(t.untyped_storage())
        return out

    def __enter__(self):
        # FSDP2 frees and re-allocates its unsharded parameters by resizing their storage in place
        self.resize = torch.UntypedStorage.resize_

        def resized(storage, n):  # the storage's new size counted
            out = self.resize(storage, n)
            self.add(storage, n)
            return out
        torch.UntypedStorage.resize_ = resized
        # DTensor infers an op's global shape by running it on global-shape fake tensors, under this
        # lock (a nullcontext unless set): no memory of any rank, so not counted. torch 2.11 has no
        # lock: there the method that holds those fake tensors is paused whole.
        if hasattr(ShardingPropagator, "_fake_mode_lock"):
            self.patched = ("_fake_mode_lock", ShardingPropagator._fake_mode_lock, Paused(self))
        else:
            infer = ShardingPropagator._propagate_tensor_meta_non_cached
            self.patched = ("_propagate_tensor_meta_non_cached", infer, Paused(self)(infer))
        setattr(ShardingPropagator, self.patched[0], self.patched[2])
        return super().__enter__()

    def __exit__(self, *exc):  # both back as they were before __enter__
        torch.UntypedStorage.resize_ = self.resize
        setattr(ShardingPropagator, self.patched[0], self.patched[1])
        return super().__exit__(*exc)


class Paused:
    """A context (and, called on a function, a decorator) in which `counter` counts nothing."""

    def __init__(self, counter: LiveStorages):
        self.counter = counter

    def __call__(self, fn):
        def paused(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return paused

    def __enter__(self):
        self.counter.paused += 1

    def __exit__(self, *exc):
        self.counter.paused -= 1
