"""train.py's checkpoints: what one holds, and resume. A checkpoint is
<dump_folder>/<checkpoint.folder>/step-N/: DCP files, .metadata and params.json (for
checkpoint_convert.py); checkpoint_folder.py writes it atomically (sync or async) and says which
folders are complete. Everything is a tensor (plain state travels as JSON bytes), so loading never
unpickles anything."""

import contextlib
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from pretrain import checkpoint_folder
from pretrain.distributed import raise_first, wait_for_rank0
from pretrain.faults import CheckpointError, node_name
from pretrain.float8 import plain
from pretrain.optimizers import set_schedule
from pretrain.resume_keys import changes
from pretrain.titan_layout import load_torchtitan, model_keys, model_prefix

logger = logging.getLogger("checkpoint")


def json_tensor(obj) -> torch.Tensor:
    """Plain Python state as a uint8 tensor: checkpoints hold tensors only (no pickle on load)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def json_from(t: torch.Tensor):
    return json.loads(t.numpy().tobytes())


class Checkpointer:
    """Saves and resumes one run, in <dump_folder>/<cfg.folder>. `cfg` is train.py's [checkpoint]
    section; `run_keys` are the values a resume must not change (a resume with others is refused);
    `steps` is training.steps; `notes` are values a resume may change, saved so that the log can
    say when one did (model.converters: float8 on or off); `guard` is the run's SpikeGuard
    (pretrain/spikes.py). `saver` writes the step-N folders."""

    def __init__(self, cfg, dump_folder: str, *, run_keys: dict, steps: int, model, optimizer,
                 scheduler, loader, notes: dict, guard):
        self.cfg = cfg
        self.folder = os.path.join(dump_folder, cfg.folder)
        self.run_keys = run_keys
        self.steps = steps
        self.rank = dist.get_rank()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loader = loader
        self.notes = notes
        self.guard = guard
        self.sd_options = StateDictOptions(flatten_optimizer_state_dict=True)
        self.saver = checkpoint_folder.Saver(cfg, self.folder, model.args.params)
        self.chosen = 0  # how many times a step-N was chosen so far

    def state(self, step: int, tokens_seen: int, model_only: bool = False) -> dict:
        """Everything a resume needs, as tensors only: DCP then never unpickles anything on load."""
        model = {k: plain(v) for k, v in get_model_state_dict(self.model).items()}
        state = {"model": model, "train": {"step": torch.tensor(step)}}
        if model_only:  # this is the export at the end of training
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.export_dtype]
            return {**state, "model": {k: v.to(dtype) for k, v in model.items()}}
        opt = get_optimizer_state_dict(self.model, self.optimizer, options=self.sd_options)
        # param_groups (lr, betas) come from the config and the scheduler, not the checkpoint
        state["optimizer"] = {k: plain(v) for k, v in opt.items() if k.startswith("state.")}
        state["train"].update(tokens_seen=torch.tensor(tokens_seen),
                              steps=torch.tensor(self.steps),
                              config=json_tensor(self.run_keys),
                              lr_scheduler=json_tensor(self.scheduler.state_dict()),
                              notes=json_tensor(self.notes),
                              spikes=json_tensor(self.guard.state_dict()))
        streams = self.loader.state_dict().items()
        state["data"] = {f"stream{s}": json_tensor(sd) for s, sd in streams}
        state["rng"] = {f"rank{self.rank}": torch.get_rng_state()}
        return state

    def save(self, step: int, tokens_seen: int, final: bool):
        """Write step-N: in the background (async_mode) unless the run stops after it."""
        # Only the last step's save is the export: a save on a signal (final too) must let the
        # requeued job resume.
        model_only = step == self.steps and self.cfg.last_save_model_only
        self.saver.save(step, lambda: self.state(step, tokens_seen, model_only), final)

    def choose(self, below: float = math.inf) -> list:
        """[step, why] as rank 0 finds them: load_step's (or None, and why it cannot be loaded), else
        the newest complete step-N below `below` (None: none). The other ranks wait for it in the
        job's store, as for the other reads at start-up (a busy filesystem's listing may outlast a
        collective's timeout); every rank then loads what rank 0 chose (NFS listings can differ)."""
        self.chosen += 1  # each choice gets a key of its own (a rewind chooses again)
        key = f"checkpoint_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}_{self.chosen}"
        store = dist.distributed_c10d._get_default_store()
        if self.rank == 0:
            found = [None, ""]
            path = os.path.join(self.folder, f"step-{self.cfg.load_step}")
            if self.cfg.enable and self.cfg.load_step >= 0 and below == math.inf:
                why = checkpoint_folder.incomplete(path) if os.path.isdir(path) else "no such folder"
                found = [None if why else self.cfg.load_step, why]
            elif self.cfg.enable:
                found[0] = checkpoint_folder.newest_complete(self.folder, below, warn=True)
            store.set(f"{key}/found", json.dumps(found))
        wait_for_rank0(store, key, self.rank, self.cfg.save_timeout_seconds,
                       f"the checkpoint folder {self.folder}", "checkpoint.save_timeout_seconds")
        return json.loads(store.get(f"{key}/found"))

    def resume(self):
        """(step, tokens_seen) from the newest complete step-N (or load_step), else initial_load_path;
        logged when nothing is left to train."""
        step, tokens_seen = self.start()
        if step >= self.steps:
            logger.info(f"the run is at step {step} of training.steps = {self.steps}: nothing left "
                        "to do (raise --training.steps to train further)")
        return step, tokens_seen

    def start(self):
        """resume()'s (step, tokens_seen)."""
        cfg = self.cfg
        step, why = self.choose()
        if why:
            path = os.path.join(self.folder, f"step-{cfg.load_step}")
            raise CheckpointError(f"checkpoint.load_step = {cfg.load_step}: {path} cannot be "
                                  f"loaded ({why})")
        if step is not None:
            path = os.path.join(self.folder, f"step-{step}")
            if "train.tokens_seen" in (meta := self.agreed_metadata(path)):
                return self.load(path, model_only=False, meta=meta)
            if step < self.steps:
                raise CheckpointError(f"{path} holds only model weights (a last_save_model_only "
                                      "export); start from it with checkpoint.initial_load_path "
                                      "in a new dump_folder")
            logger.info(f"{path} is the final export of a finished run: nothing to do")
            return step, 0
        if cfg.initial_load_path:
            model_only = cfg.initial_load_model_only
            step, tokens = self.load(cfg.initial_load_path, model_only=model_only)
            logger.info(f"loaded {'weights' if model_only else 'state'} from "
                        f"{cfg.initial_load_path}, starting at step {step}")
            return step, tokens
        return 0, 0

    def metadata(self, path: str) -> dict:
        """Sizes of the tensors in a DCP folder, after checking that it is complete and fits our model
        (its .metadata read once)."""
        try:
            whole = dcp.FileSystemReader(path).read_metadata()
        except Exception:  # the folder is missing, truncated or not DCP; incomplete() says which
            whole = None
        if reason := checkpoint_folder.incomplete(path, whole):
            raise CheckpointError(f"{path} is not a complete DCP checkpoint: {reason}")
        meta = whole.state_dict_metadata
        names = model_keys(meta)  # Meta name -> its key: model.<name>, or torchtitan's
        prefix = model_prefix(meta)
        ours = {names.get(k, prefix + k): tuple(v.shape) for k, v in get_model_state_dict(self.model).items()}
        bad = [f"{k} {tuple(meta[k].size)} vs ours {s}" for k, s in ours.items()
               if k in meta and tuple(meta[k].size) != s]
        bad += [f"{k} missing" for k in ours if k not in meta]
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise CheckpointError(f"checkpoint {path} does not fit this model: "
                                  f"{'; '.join(bad[:5])}{more}")
        return meta

    def agreed_metadata(self, path: str) -> dict:
        """metadata(path) as rank 0 finds it, on every rank: a node's view of a shared filesystem
        can be stale, so rank 0 alone checks it, and every rank stops with rank 0's line, or with
        that of a rank that cannot read it."""
        error = ("", False)  # its line if it cannot read the metadata, and whether it is a fault
        meta = None
        try:
            if self.rank == 0:
                meta = self.metadata(path)
            else:
                meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        except CheckpointError as e:
            error = (str(e), False)
        except Exception as e:  # DCP's reader raises any error of the file system or format
            metadata = os.path.join(path, ".metadata")
            error = (f"rank {self.rank} cannot read {metadata}, which rank 0 found complete "  # its view is stale
                     f"({type(e).__name__}: {str(e)[:200]})".replace("\n", " "), "node")
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, (*error, node_name()))
        if any(line for line, _, _ in errors):
            raise_first(errors, CheckpointError)
        return meta

    def load(self, path: str, model_only: bool, rewind: bool = False, meta: dict | None = None):
        """(step, tokens_seen) of the checkpoint at `path` (`meta`: its metadata, if read), loaded.
        rewind: the data loader keeps its place and the spike guard its counters (SpikeGuard.rewind)."""
        meta = meta or self.agreed_metadata(path)
        if model_prefix(meta) == "":  # an empty prefix is torchtitan's layout
            optimizer = None if model_only else self.optimizer  # its data position is another loader's
            return load_torchtitan(path, meta, self.model, optimizer, self.scheduler), 0
        rank_key = f"rank{self.rank}"  # this rank's RNG state in the checkpoint
        model = {k: plain(v) for k, v in get_model_state_dict(self.model).items()}
        state = {"model": model} if model_only else self.state(0, 0)
        for key in meta if not model_only else ():  # JSON blobs are allocated at their saved size
            section, _, name = key.partition(".")
            if section in ("train", "data") and meta[key].properties.dtype == torch.uint8:
                state[section][name] = torch.empty(meta[key].size, dtype=torch.uint8)
        if not model_only:
            # older runs lack some of these
            state["train"] = {k: v for k, v in state["train"].items() if f"train.{k}" in meta}
            if f"rng.{rank_key}" not in meta:  # the run resumes on more ranks than before
                del state["rng"]
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:
            if not model_only:  # another optimizer's state is missing: name the change, not a key
                keys = {k: state["train"][k] for k in ("config", "step")}
                with contextlib.suppress(CheckpointException):
                    dcp.load({"train": keys}, checkpoint_id=path)
                    self.refuse_changes(path, keys)
            raise CheckpointError(f"cannot load {path}: {checkpoint_folder.why(e)}")
        set_model_state_dict(self.model, state["model"])
        if model_only:
            return 0, 0
        train = state["train"]
        self.refuse_changes(path, train)
        opt = get_optimizer_state_dict(self.model, self.optimizer, options=self.sd_options)
        opt = {**opt, **state["optimizer"]}
        set_optimizer_state_dict(self.model, self.optimizer, opt, options=self.sd_options)
        # the schedule's position alone loads: optimizer.lr and its shape may change on a resume
        set_schedule(self.scheduler, self.optimizer, json_from(train["lr_scheduler"])["last_epoch"])
        step = int(train["step"])
        if "spikes" in train:  # older checkpoints have none
            self.guard.load_state_dict(json_from(train["spikes"]), window_only=rewind)
        if rewind:
            return step, int(train["tokens_seen"])
        self.guard.cut_lr(self.optimizer, step + 1)  # it sets the next step's lr in a rewind's cut
        streams = {s: json_from(state["data"][f"stream{s}"]) for s in self.loader.stream_ids}
        self.loader.load_state_dict(streams)
        if "rng" in state:
            torch.set_rng_state(state["rng"][rank_key])
        steps = int(train.get("steps", self.steps))  # the run's training.steps, as saved
        logger.info(f"resumed from {path} at step {step}")
        self.log_changes(train, steps)
        return step, int(train["tokens_seen"])

    def refuse_changes(self, path: str, train: dict):
        """One line naming each run key a resume from `path` would change (pretrain/resume_keys.py).
        train: the checkpoint's config and step, loaded."""
        diff = changes(json_from(train["config"]), self.run_keys, int(train["step"]))
        if diff:
            raise CheckpointError(f"refusing to resume from {path}: the run changed "
                                  f"{'; '.join(diff)} (use a new dump_folder, or take only the "
                                  "weights with checkpoint.initial_load_path)")

    def log_changes(self, train: dict, steps: int):
        """Logs what this resume changes of the values it may change: notes, training.steps."""
        saved = json_from(train["notes"]) if "notes" in train else {}  # older checkpoints have none
        changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in self.notes.items()
                   if k in saved and saved[k] != v]
        if changed:
            logger.info(f"this resume changes {'; '.join(changed)} (allowed: the checkpoint's "
                        "weights are the same)")
        # a change is allowed, but the lr schedule is a function of training.steps
        if steps != self.steps and self.rank == 0:
            logger.warning(f"training.steps changed {steps} -> {self.steps}: the lr schedule now "
                           f"ends at step {self.steps} instead of {steps}, and the lr from here "
                           "on follows it")
