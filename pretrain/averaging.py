"""The weighted mean of several DCP checkpoints' model tensors, written as a model-only DCP folder a
tensor at a time: Polyak averaging, as Meta made Llama 3's final model from its annealing's
checkpoints, and model soups. `checkpoint_convert.py average` checks its inputs and calls save_mean.
"""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


class MeanPlanner(DefaultSavePlanner):
    """DCP's save planner over meta tensors (shapes only): the writer asks for each tensor's data
    (resolve_data) as it writes that tensor's file, so that one mean is in memory at a time."""

    def __init__(self, make):
        super().__init__()
        self.make = make  # its key -> the tensor

    def resolve_data(self, write_item):
        return self.make(write_item.index.fqn)


def save_mean(dirs: list, keys: list, tensors: dict, weights: list, out: str):
    """{"model": the mean} into `out`, DCP: each of `tensors` ({name: DCP metadata}) read from every
    folder in turn (`keys[i]`: name -> its key in dirs[i]), summed in fp32 with `weights`, then cast
    to its dtype. The peak is one tensor's fp32 sum plus one input's copy of it."""

    def mean(fqn: str) -> torch.Tensor:
        name = fqn.removeprefix("model.")
        md = tensors[name]
        total = None
        for folder, key, w in zip(dirs, keys, weights):
            one = {key[name]: torch.empty(md.size, dtype=md.properties.dtype)}
            dcp.load(one, checkpoint_id=folder, no_dist=True)
            x = one.popitem()[1]
            # add_ widens a bf16 x element by element, without an fp32 copy of it
            total = x.float().mul_(w) if total is None else total.add_(x, alpha=w)
            del x, one  # before the next folder's copy
        return total.to(md.properties.dtype)

    with torch.device("meta"):
        shapes = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in tensors.items()}
    # A file per tensor: DCP's writer keeps a file's tensors until the file is written.
    writer = dcp.FileSystemWriter(out, single_file_per_rank=False)
    dcp.save({"model": shapes}, storage_writer=writer, planner=MeanPlanner(mean), no_dist=True)
