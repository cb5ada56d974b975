"""The loss of a micro-batch without its whole logits. The output layer and the loss run a chunk of
positions at a time, and a chunk's logits are recomputed in backward, not kept: with Llama 3's
vocabulary the fp32 logits, their log-softmax and their gradient are the largest tensors of a step,
about 12 bytes a logit. What to compute on the logits stays train.forward_backward's (loss_fn):
cross_entropy_and_z below, or any loss a forker swaps in. And which positions count at all
(ignore_boundaries: a document's first token is nobody's prediction under block_causal).

    h = model(inputs, last_hidden=True)  # (bs, seqlen, dim): the final norm's output
    summed = chunked_loss(model.output, h, labels, loss_fn)
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
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

    total = 0
    for start in range(0, labels.numel(), n):
        part = checkpoint(chunk, h[start:start + n], labels[start:start + n], use_reentrant=False)
        total = total + part
    return total


def cross_entropy_and_z(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> torch.Tensor:
    """(2,): the summed cross-entropy of the positions that count (label != -100), and z_loss x their
    summed squared log-normaliser (PaLM's z-loss: it keeps logsumexp near 0, so the softmax cannot
    drift into large logits). logits (positions, vocab), vocab-sharded under TP; labels (positions,)."""
    ce = F.cross_entropy(logits, labels, reduction="sum")
    if not z_loss:  # no second pass over the logits
        return torch.stack([ce, torch.zeros_like(ce)])
    lse = torch.logsumexp(logits, dim=-1)  # (positions,); under TP replicated: reduced over shards
    counted = (labels != -100).to(lse.dtype)
    if isinstance(lse, DTensor):  # a plain tensor may not meet a DTensor in one op
        counted = DTensor.from_local(counted, lse.device_mesh, lse.placements)
    return torch.stack([ce, z_loss * (lse.pow(2) * counted).sum()])


def ignore_boundaries(labels: torch.Tensor, args) -> torch.Tensor:
    """Labels with the positions that carry no signal set to -100 (ignored by the loss). Under
    block_causal: each position whose label is a document's BOS (the token before it is the last of
    the previous document, and the mask hides the new one from it). Causal keeps every position."""
    if args.attn_mask_type != "block_causal":
        return labels
    return labels.masked_fill(labels == args.bos_id, -100)
