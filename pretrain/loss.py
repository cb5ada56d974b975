"""The loss of a micro-batch without its whole logits. The output layer and the loss run a chunk of
positions at a time, and a chunk's logits are recomputed in backward, not kept: with Llama 3's
vocabulary the fp32 logits, their log-softmax and their gradient are the largest tensors of a step,
about 12 bytes a logit. What to compute on the logits stays train.forward_backward's (loss_fn):
cross_entropy_and_z below, or any loss a forker swaps in. And which positions count at all
(ignore_boundaries: a document's first token is nobody's prediction under block_causal).

    h = model(inputs, last_hidden=True)  # (bs, seqlen, dim): the final norm's output
    summed = chunked_loss(model.output, h, labels, loss_fn)
"""

import contextlib
from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 2**28  # fp32 logits per chunk at most: 523 positions with Meta's 128,256 words


def chunk_positions(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def chunked_loss(output: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor, loss_fn):
    """loss_fn(logits, labels) summed over chunks of positions (loss_fn sums over its positions).
    output: the model's output layer; under TP it is vocab-parallel (the logits are sharded on the
    vocabulary) and h arrives replicated. One chunk: no recompute, the loss as it was unchunked."""
    h = h.flatten(0, 1)  # (tokens, dim)
    labels = labels.flatten()  # (tokens,)
    n = chunk_positions(output.out_features)
    if labels.numel() <= n:
        return loss_fn(output(h).float(), labels)

    def chunk(x, y):
        return loss_fn(output(x).float(), y)  # (n, vocab) logits, freed once their loss is taken

    # Use split, not h[start:start + n]: in backward a slice's gradient is a zeros of h's size per
    # chunk, added to the others; split's is one cat of the chunks' gradients.
    total = 0
    for x, y in zip(h.split(n), labels.split(n)):  # (n, dim), (n,)
        total = total + checkpoint(chunk, x, y, use_reentrant=False)
    return total


def cross_entropy_and_z(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> torch.Tensor:
    """(2,): the summed cross-entropy of the positions that count (label != -100), and z_loss x their
    summed squared log-normaliser (PaLM's z-loss: it keeps logsumexp near 0, so the softmax cannot
    drift into large logits). logits (positions, vocab), vocab-sharded under TP; labels (positions,)."""
    ce = F.cross_entropy(logits, labels, reduction="sum")
    if not z_loss:  # this skips a second pass over the logits
        return torch.stack([ce, torch.zeros_like(ce)])
    lse = logsumexp(logits)  # (positions,); replicated under TP, reduced over shards
    counted = (labels != -100).to(lse.dtype)
    if isinstance(lse, DTensor):  # a plain tensor may not meet a DTensor in one op
        counted = DTensor.from_local(counted, lse.device_mesh, lse.placements)
    return torch.stack([ce, z_loss * (lse.pow(2) * counted).sum()])


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """(positions,): the log-normaliser of logits (positions, vocab). Under TP (a DTensor sharded
    on the vocabulary, on loss_parallel's 1-D mesh) each rank reduces its shard and two all-reduces
    of one value a position combine them, as loss_parallel's cross-entropy does: torch.logsumexp on
    the DTensor would all-gather the chunk's whole logits on every rank."""
    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits, dim=-1)
    mesh = logits.device_mesh
    local = logits.to_local()  # (positions, vocab / tp)
    # The max, detached, only keeps exp() from overflowing: the result does not depend on it.
    peak = DTensor.from_local(local.detach().amax(-1), mesh, [Partial("max")])
    peak = peak.full_tensor()  # (positions,): an all-reduce max
    share = local.sub(peak[:, None]).exp().sum(-1)  # (positions,): this shard's part of the sum
    # Use a Partial DTensor, not funcol.all_reduce: funcol's backward all-reduces the gradient too,
    # which would count the loss (replicated on every rank) once per rank.
    total = DTensor.from_local(share, mesh, [Partial()]).full_tensor()  # (positions,): all-reduced
    return DTensor.from_local(total.log() + peak, mesh, [Replicate()])


def heldout_loss(model, inputs: torch.Tensor, labels: torch.Tensor, tp: int) -> torch.Tensor:
    """The summed cross-entropy of the positions that count, a chunk at a time as training's: a
    validation batch never holds its whole logits either. Under no_grad (pretrain/evals.py)."""
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        h = model(inputs, last_hidden=True)  # (bs, seqlen, dim)
        ce = chunked_loss(model.output, h, labels, partial(cross_entropy_and_z, z_loss=0.0))[0]
    return ce.full_tensor() if isinstance(ce, DTensor) else ce


def ignore_boundaries(labels: torch.Tensor, args) -> torch.Tensor:
    """Labels with the positions that carry no signal set to -100 (ignored by the loss). Under
    block_causal: each position whose label is a document's BOS (the token before it is the last of
    the previous document, and the mask hides the new one from it). Causal keeps every position."""
    if args.attn_mask_type != "block_causal":
        return labels
    return labels.masked_fill(labels == args.bos_id, -100)
