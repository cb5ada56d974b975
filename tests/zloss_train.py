"""train.py with another objective and no trainer edit: cross-entropy plus PaLM's z-loss (coefficient from
$ZLOSS, default 1e-4), by replacing train.forward_backward. Launched like train.py:
python tests/zloss_train.py --config ... (1 process here; under TP the logits are vocab-sharded DTensors)."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402

Z = float(os.environ.get("ZLOSS", "1e-4"))


def forward_backward(model, inputs, labels, global_tokens, dp, tp):
    logits = model(inputs).flatten(0, 1)  # (bs * seqlen, vocab)
    counted = labels.flatten() != -100
    ce = F.cross_entropy(logits, labels.flatten(), reduction="sum")
    z = torch.logsumexp(logits[counted], dim=-1).pow(2).sum()  # keeps the softmax normaliser near 1
    loss = (ce + Z * z) / global_tokens  # a share of the global batch's mean, as train.forward_backward's
    (loss * dp).backward()
    return loss.detach()


train.forward_backward = forward_backward  # main() looks the name up at each micro-batch

if __name__ == "__main__":
    train.main(train.load_config(sys.argv[1:]))
