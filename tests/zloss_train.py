"""train.py with another objective and no trainer edit: cross-entropy plus PaLM's z-loss (coefficient from
$ZLOSS, default 1e-4), by replacing train.forward_backward. Launched like train.py:
python tests/zloss_train.py --config ... (1 process here; under TP the logits are vocab-sharded DTensors).
The z term is computed on each chunk of positions pretrain/loss.py hands it, as the cross-entropy is."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from pretrain.loss import chunked_loss  # noqa: E402

Z = float(os.environ.get("ZLOSS", "1e-4"))


def ce_and_z(logits, labels):
    """A chunk's summed cross-entropy plus Z x its z-loss: logits (positions, vocab), labels (positions,)."""
    counted = labels != -100
    z = torch.logsumexp(logits[counted], dim=-1).pow(2).sum()  # keeps the softmax normaliser near 1
    return F.cross_entropy(logits, labels, reduction="sum") + Z * z


def forward_backward(model, inputs, labels, global_tokens, dp, tp):
    h = model(inputs, last_hidden=True)  # (bs, seqlen, dim): the logits come a chunk at a time
    loss = chunked_loss(model.output, h, labels, ce_and_z) / global_tokens  # as train.forward_backward's
    (loss * dp).backward()
    return loss.detach()


train.forward_backward = forward_backward  # main() looks the name up at each micro-batch

if __name__ == "__main__":
    train.main(train.load_config(sys.argv[1:]))
