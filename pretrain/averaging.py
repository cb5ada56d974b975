"""The weighted mean of several DCP checkpoints' model tensors, written as a model-only DCP folder a
tensor at a time: Polyak averaging, as Meta made Llama 3's final model from its annealing's
checkpoints, and model soups. `checkpoint_convert.py average` checks its inputs and calls save_mean.

Memory: the sum of one tensor in fp32, plus one saved chunk of it at a time. DCP's own reader would
add a third copy (it deserialises a chunk, then copies it into the destination), so the chunks are
read here, each `torch.load`ed from its place in the file that DCP's metadata names.
"""

import io
import os

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


class FileView(io.RawIOBase):
    """`length` bytes of a file from `offset`, as a file of their own: torch.load reads a chunk's
    zip record into the tensor's storage straight from the file, with no copy of its bytes."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos: int, whence: int = 0):
        self.pos = {0: 0, 1: self.pos, 2: self.length}[whence] + pos
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def add_into(total: torch.Tensor, folder: str, metadata, key: str, weight: float):
    """total += weight x the tensor saved as `key` in `folder`, a saved chunk at a time."""
    chunks = [(i.offset, info) for i, info in metadata.storage_data.items() if i.fqn == key]
    if any(getattr(info, "transform_descriptors", None) for _, info in chunks):  # compressed: DCP reads it
        whole = {key: torch.empty(total.shape, dtype=metadata.state_dict_metadata[key].properties.dtype)}
        dcp.load(whole, checkpoint_id=folder, no_dist=True)
        chunks = [((0,) * total.ndim, whole.pop(key))]
    for offsets, info in chunks:
        if isinstance(info, torch.Tensor):
            chunk = info
        else:
            with open(os.path.join(folder, info.relative_path), "rb") as f:
                chunk = torch.load(FileView(f, info.offset, info.length), map_location="cpu", weights_only=True)
        region = total[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))]
        region.add_(chunk, alpha=weight)  # add_ widens a bf16 chunk element by element
        del chunk  # before the next chunk is read


def save_mean(dirs: list, keys: list, tensors: dict, weights: list, out: str):
    """{"model": the mean} into `out`, DCP: each of `tensors` ({name: DCP metadata}) read from every
    folder in turn (`keys[i]`: name -> its key in dirs[i]), summed in fp32 with `weights`, then cast
    to its dtype."""
    metadata = [dcp.FileSystemReader(d).read_metadata() for d in dirs]

    def mean(fqn: str) -> torch.Tensor:
        name = fqn.removeprefix("model.")
        total = torch.zeros(tensors[name].size, dtype=torch.float32)
        for folder, meta, key, w in zip(dirs, metadata, keys, weights):
            add_into(total, folder, meta, key[name], w)
        return total.to(tensors[name].properties.dtype)

    with torch.device("meta"):
        shapes = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in tensors.items()}
    # A file per tensor: DCP's writer keeps a file's tensors until the file is written.
    writer = dcp.FileSystemWriter(out, single_file_per_rank=False)
    dcp.save({"model": shapes}, storage_writer=writer, planner=MeanPlanner(mean), no_dist=True)
