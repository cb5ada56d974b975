"""torchtitan's DCP checkpoints, read as ours: its model tensors sit at the top level under Meta's
names (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, ...), beside `optimizer.*`,
`lr_scheduler.*`, `dataloader.*` and `train_state.*` in a full save; its last save may hold the
model alone. Ours keep `model.*`. checkpoint.py loads either layout for `initial_load_path`;
checkpoint_convert.py converts from and to it.
"""

import logging

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

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


def model_keys(keys) -> dict:
    """{Meta name: key in the checkpoint} of the model tensors among a checkpoint's keys."""
    prefix = model_prefix(keys)
    return {k.removeprefix(prefix): k for k in keys
            if k.startswith(prefix) and k.split(".")[0] not in TITAN_STATE}


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
    (a full save) also its AdamW moments (the same flattened keys as ours) and its lr schedule's
    position into `scheduler`. Returns its step (0 for the weights alone). Its data position is its
    own loader's and cannot carry over; its token count is one rank's, so a run continued from it
    counts tokens from 0. What cannot be loaded is a CheckpointError's one line."""
    if optimizer is not None and "train_state.step" not in meta:
        raise CheckpointError(f"{path} is a model-only torchtitan save (its last_save_model_only "
                              "export): take its weights with checkpoint.initial_load_model_only = "
                              "true, or continue from one of its full step-N")
    weights = {k: plain(v) for k, v in get_model_state_dict(model).items()}
    state = dict(weights)
    if optimizer is not None:
        opt = get_optimizer_state_dict(model, optimizer, options=FLAT)
        moments = {f"optimizer.{k}": plain(v) for k, v in opt.items() if k.startswith("state.")}
        state.update(moments)
        state.update({"train_state.step": None, "lr_scheduler.last_epoch": None})  # pickled ints
    planner = PlainLoadPlanner()
    try:
        dcp.load(state, checkpoint_id=path, planner=planner)
    except CheckpointException as e:
        raise CheckpointError(f"cannot load {path}: {why(e)}")
    set_model_state_dict(model, {k: state[k] for k in weights})
    if optimizer is None:
        return 0
    saved = {k.removeprefix("optimizer."): state[k] for k in moments}
    set_optimizer_state_dict(model, optimizer, {**opt, **saved}, options=FLAT)
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
