"""What keeps the parallel layout out of the math, for train.parallelize and the init: weights that
start identical on 1 process, FSDP and TP, and parameters the TP plan leaves out made replicated."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from model import keyed_normal_
from pretrain.config import ConfigError


def replicate_unplanned(model: torch.nn.Module, tp_mesh):
    """Parameters the TP plan does not name (a q/k norm, a gate) become replicated on the TP mesh
    (clip_grad_norm_ needs one mesh). Each TP rank computes on its share of the activations, so the
    gradients are summed over TP ranks: right for per-token modules anywhere except on the inputs
    gathered for wq/wk/wv and w1/w3."""
    for name, module in model.named_modules():
        own = [n for n, q in module.named_parameters(recurse=False) if not isinstance(q, DTensor)]
        if not own:
            continue
        if module._forward_pre_hooks or module._forward_hooks:  # already given a style by the plan
            raise ConfigError(f"tensor parallel: parameter {name}.{own[0]} is not in the TP plan "
                              "and its module has a TP style; "
                              "add it to the plan in train.parallelize")
        parallelize_module(module, tp_mesh, SequenceParallel(sequence_dim=0, use_local_output=True))


def layout_independent_normal(seed: int):
    """An init fill for model.init_weights whose values depend on (seed, weight name, position)
    only, so 1 process, FSDP and TP start from identical weights. Each rank fills its own shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def fill(name: str, w: torch.Tensor, std: float):
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if isinstance(w, DTensor):
            _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
            keyed_normal_(w.to_local(), offset, w.shape, seed, name, std)
        else:
            keyed_normal_(w, (0,) * w.ndim, w.shape, seed, name, std)

    return fill
