"""torchtitan's DCP checkpoints, read as ours: its model tensors sit at the top level (no `model.`),
beside `optimizer.*`, `lr_scheduler.*`, `dataloader.*` and `train_state.*` in a full save; its last
save may hold the model alone. 0.2.2 names them as Meta does (`tok_embeddings.weight`,
`layers.0.attention.wq.weight`, `output.weight`); 0.3.0 puts q, k and v under `qkv_linear.` and
calls the output layer `lm_head`, and its AdamW moments of q, k and v are one fused matrix a layer
(`qkv_linear.wqkv.weight`, rows grouped by kv head: each group's query heads, then its key and its
value head). checkpoint.py loads either layout for `initial_load_path`; checkpoint_convert.py
converts from and to it.
"""

import logging
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from pretrain.checkpoint_folder import why
from pretrain.faults import CheckpointError
from pretrain.float8 import plain
from pretrain.optimizers import set_schedule

logger = logging.getLogger("checkpoint")

# a full torchtitan save, beside the model
TITAN_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's optimizer keys, as ours


def model_prefix(keys) -> str:
    """How a DCP checkpoint names its model tensors: "model." + Meta's name (ours), or Meta's name
    alone (torchtitan's: its model sits at the top level, beside optimizer.*, lr_scheduler.* and the
    rest)."""
    titan = "tok_embeddings.weight" in keys and not any(k.startswith("model.") for k in keys)
    return "" if titan else "model."


def meta_name(key: str) -> str:
    """Meta's name of a torchtitan 0.3.0 model tensor (0.2.2's and ours are Meta's already)."""
    return key.replace(".attention.qkv_linear.", ".attention.").replace("lm_head.", "output.")


def titan_name(key: str, version: str) -> str:
    """torchtitan's name of a model tensor, in its `version` (meta_name's inverse for 0.3)."""
    if version.startswith("0.2"):
        return key
    return re.sub(r"\.attention\.(w[qkv])\.", r".attention.qkv_linear.\1.", key).replace("output.", "lm_head.")


def model_keys(keys) -> dict:
    """{Meta name: key in the checkpoint} of the model tensors among a checkpoint's keys."""
    prefix = model_prefix(keys)
    return {meta_name(k.removeprefix(prefix)): k for k in keys
            if k.startswith(prefix) and k.split(".")[0] not in TITAN_STATE}


def split_qkv(fused: torch.Tensor, n_heads: int, n_kv_heads: int) -> dict:
    """{"wq", "wk", "wv": rows} of torchtitan 0.3.0's fused q/k/v matrix (or its moments), in Meta's
    row order: (n_kv_heads, its query heads + key + value, head_dim, dim)."""
    per_kv = n_heads // n_kv_heads
    w = fused.view(n_kv_heads, per_kv + 2, -1, fused.shape[-1])
    return {"wq": w[:, :per_kv].reshape(-1, fused.shape[-1]), "wk": w[:, per_kv].reshape(-1, fused.shape[-1]),
            "wv": w[:, per_kv + 1].reshape(-1, fused.shape[-1])}


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's planner (flat keys), but what was pickled (torchtitan's step and lr schedule: ints) is
    read with weights_only=True, as everything else here, into `values`: dcp.load hands the planner
    a copy of the state dict, so that copy's non-tensor entries never reach the caller's."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.values = {}

    def load_bytes(self, read_item, value):
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def load_torchtitan(path: str, meta: dict, model, optimizer=None, scheduler=None) -> int:
    """Loads a torchtitan checkpoint's model into `model` (`meta`: its tensors); with an `optimizer`
    (a full save) also its AdamW moments and its lr schedule's position into `scheduler`. Returns its
    step (0 for the weights alone). Its data position is its own loader's and cannot carry over; its
    token count is one rank's, so a run continued from it counts tokens from 0. What cannot be
    loaded is a CheckpointError's one line."""
    if optimizer is not None and "train_state.step" not in meta:
        raise CheckpointError(f"{path} is a model-only torchtitan save (its last_save_model_only "
                              "export): take its weights with checkpoint.initial_load_model_only = "
                              "true, or continue from one of its full step-N")
    names = model_keys(meta)  # Meta name -> its key
    weights = {k: plain(v) for k, v in get_model_state_dict(model).items()}
    state = {names.get(k, k): v for k, v in weights.items()}
    fused = {}  # 0.3.0: our q/k/v moment key -> (its fused key, "wq" / "wk" / "wv")
    if optimizer is not None:
        opt = get_optimizer_state_dict(model, optimizer, options=FLAT)
        moments = {k: plain(v) for k, v in opt.items() if k.startswith("state.")}
        for k, v in moments.items():  # state.<Meta name>.<exp_avg, exp_avg_sq or step>
            fqn, kind = k.removeprefix("state.").rsplit(".", 1)
            theirs = f"optimizer.state.{titan_name(fqn, '0.3')}.{kind}"
            proj = re.search(r"\.qkv_linear\.(w[qkv])\.", theirs)
            if proj:  # 0.3.0 keeps the layer's q, k and v moments as one
                theirs = theirs.replace(proj[0], ".qkv_linear.wqkv.")
            if f"optimizer.{k}" in meta or theirs not in meta:  # 0.2.2's, or missing: DCP says so
                state[f"optimizer.{k}"] = v
            elif proj:
                fused[k] = (theirs, proj[1])
            else:  # lm_head
                state[theirs] = v
        state.update({"train_state.step": None, "lr_scheduler.last_epoch": None})  # pickled ints
    planner = PlainLoadPlanner()
    try:
        dcp.load(state, checkpoint_id=path, planner=planner)
        load_fused(path, meta, fused, opt if fused else {}, model.args)
    except CheckpointException as e:
        raise CheckpointError(f"cannot load {path}: {why(e)}")
    set_model_state_dict(model, {k: state[names.get(k, k)] for k in weights})
    if optimizer is None:
        return 0
    set_optimizer_state_dict(model, optimizer, opt, options=FLAT)
    # torchtitan steps it once per step too
    position = int(planner.values["lr_scheduler.last_epoch"])
    # Our schedule at its position (torchtitan's own lr curve differs slightly: its warmup reaches
    # the peak one step earlier), so the lr continues rather than restarting warm-up.
    set_schedule(scheduler, optimizer, position)
    step = int(planner.values["train_state.step"])
    logger.info(f"{path} is torchtitan's: took its weights, AdamW moments, step {step} and lr "
                "schedule position; not its data position (another loader): the data starts from "
                "its beginning")
    return step


def load_fused(path: str, meta: dict, fused: dict, opt: dict, args):
    """torchtitan 0.3.0's fused q/k/v moments into ours (`fused`: our key -> (its key, which of q, k
    and v)), a layer at a time: every rank reads a layer's fused matrices whole (3 x its q/k/v
    moments' bytes), splits them and keeps its shard of each."""
    layers = {}
    for k, (theirs, proj) in fused.items():
        layers.setdefault(theirs.split(".attention.")[0], {})[k] = (theirs, proj)
    for parts in layers.values():
        whole = {t: torch.empty(meta[t].size, dtype=meta[t].properties.dtype) for t, _ in parts.values()}
        dcp.load(whole, checkpoint_id=path)
        for k, (theirs, proj) in parts.items():
            full = whole[theirs] if whole[theirs].ndim == 0 else split_qkv(  # a step is one number
                whole[theirs], args.n_heads, args.n_kv_heads or args.n_heads)[proj]
            target = opt[k]
            if isinstance(target, DTensor):  # this rank's shard, cut locally (no communication)
                full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target = target.to_local()
                full = full.to_local()
            target.copy_(full)
