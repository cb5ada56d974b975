"""train.py's checkpoints: what one holds, atomic saves (sync or async), which folders are complete, resume.
A checkpoint is <dump_folder>/<checkpoint.folder>/step-N/: DCP files, .metadata and params.json (for
checkpoint_convert.py). A save is written to .step-N.tmp and renamed to step-N once every rank has written, so a
crash at any moment leaves only complete step-N folders behind, and the previous one stays until the new one is
in place. Everything is a tensor (plain state travels as JSON bytes), so loading never unpickles anything."""

import json
import logging
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from float8 import plain

logger = logging.getLogger("checkpoint")
TITAN_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")  # a full torchtitan save, beside the model


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (incomplete, another model, another run): one line, exit code 2."""


class SaveError(RuntimeError):
    """The save a stop depends on failed (the previous checkpoint is intact): one line, exit code 3."""


def json_tensor(obj) -> torch.Tensor:
    """Plain Python state as a uint8 tensor, so checkpoints hold tensors only (no pickle on load)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def json_from(t: torch.Tensor):
    return json.loads(t.numpy().tobytes())


def model_prefix(keys) -> str:
    """How a DCP checkpoint names its model tensors: "model." + Meta's name (ours), or Meta's name alone
    (torchtitan's: its model sits at the top level, beside optimizer.*, lr_scheduler.* and the rest)."""
    titan = "tok_embeddings.weight" in keys and not any(k.startswith("model.") for k in keys)
    return "" if titan else "model."


def model_keys(keys) -> dict:
    """{Meta name: key in the checkpoint} of the model tensors among a checkpoint's keys."""
    prefix = model_prefix(keys)
    return {k.removeprefix(prefix): k for k in keys
            if k.startswith(prefix) and k.split(".")[0] not in TITAN_STATE}


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's planner (flat keys), but what was pickled (torchtitan's step and lr schedule: ints) is read with
    weights_only=True, as everything else here, into `values`: dcp.load hands the planner a copy of the state
    dict, so that copy's non-tensor entries never reach the caller's."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.values = {}

    def load_bytes(self, read_item, value):
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def incomplete(path: str):
    """Why a step-N folder cannot be loaded (None if it can): DCP's .metadata must be readable and every
    file it names at least as long as the data it records there (an rsync cut short, a full disk)."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # missing, truncated, or not DCP at all
        return f"{os.path.join(path, '.metadata')} is missing or unreadable ({type(e).__name__})"
    need = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        have = os.path.getsize(os.path.join(path, name)) if os.path.exists(os.path.join(path, name)) else None
        if have is None or have < size:
            what = "missing" if have is None else f"{have} bytes, the metadata needs {size}"
            return f"{os.path.join(path, name)} is {what}"


def checkpoints(folder: str, warn: bool = False) -> list:
    """Steps of the complete checkpoints, oldest first; `warn` logs each step-N that is not complete."""
    steps = sorted(int(m.group(1)) for d in (os.listdir(folder) if os.path.isdir(folder) else [])
                   if (m := re.fullmatch(r"step-(\d+)", d)))
    reasons = {s: incomplete(os.path.join(folder, f"step-{s}")) for s in steps}
    for s in [s for s in steps if reasons[s] and warn]:
        logger.warning(f"skipping incomplete checkpoint step-{s}: {reasons[s]}")
    return [s for s in steps if not reasons[s]]


class Checkpointer:
    """Saves and resumes one run. `cfg` is train.py's [checkpoint] section; `run_keys` are the values a resume
    must not change (a resume with others is refused); `steps` is training.steps; `notes` are values a resume
    may change, saved so that the log can say when one did (model.converters: float8 on or off)."""

    def __init__(self, cfg, folder: str, run_keys: dict, steps: int, model, optimizer, scheduler, loader, notes: dict,
                 timeout=None):
        self.cfg, self.folder, self.run_keys, self.steps, self.rank = cfg, folder, run_keys, steps, dist.get_rank()
        self.model, self.optimizer, self.scheduler, self.loader, self.notes = model, optimizer, scheduler, loader, notes
        self.sd_options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Async saves write from a background thread on a gloo group of their own, bounded by [comm]'s timeout too.
        async_saves = cfg.enable and cfg.async_mode == "async"
        self.group = dist.new_group(backend="gloo", timeout=timeout) if async_saves else None
        self.pending = None  # (future, step) of an async save not yet renamed into place

    def state(self, step: int, tokens_seen: int, model_only: bool = False) -> dict:
        """Everything a resume needs, as tensors only: DCP then never unpickles anything on load."""
        state = {"model": {k: plain(v) for k, v in get_model_state_dict(self.model).items()},
                 "train": {"step": torch.tensor(step)}}
        if model_only:  # the export at the end of training
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.export_dtype]
            return {**state, "model": {k: v.to(dtype) for k, v in state["model"].items()}}
        opt = get_optimizer_state_dict(self.model, self.optimizer, options=self.sd_options)
        # param_groups (lr, betas) come from the config and the scheduler, not the checkpoint
        state["optimizer"] = {k: plain(v) for k, v in opt.items() if k.startswith("state.")}
        state["train"].update(tokens_seen=torch.tensor(tokens_seen), steps=torch.tensor(self.steps),
                              config=json_tensor(self.run_keys), lr_scheduler=json_tensor(self.scheduler.state_dict()),
                              notes=json_tensor(self.notes))
        state["data"] = {f"stream{s}": json_tensor(sd) for s, sd in self.loader.state_dict().items()}
        state["rng"] = {f"rank{self.rank}": torch.get_rng_state()}
        return state

    def newest(self) -> str:
        done = checkpoints(self.folder)
        return os.path.join(self.folder, f"step-{done[-1]}") if done else "none"

    def resume(self):
        """(step, tokens_seen): from the newest complete step-N (or load_step), else initial_load_path."""
        cfg, done = self.cfg, [checkpoints(self.folder, warn=True) if self.cfg.enable and self.rank == 0 else []]
        dist.broadcast_object_list(done, src=0)  # rank 0 lists, every rank loads what it chose: NFS listings can differ
        done = done[0]
        if cfg.load_step >= 0 and cfg.load_step not in done:
            path = os.path.join(self.folder, f"step-{cfg.load_step}")
            why = incomplete(path) if os.path.isdir(path) else "no such folder"
            raise CheckpointError(f"checkpoint.load_step = {cfg.load_step}: {path} cannot be loaded ({why}); "
                                  f"complete: {done}")
        if done:
            step = cfg.load_step if cfg.load_step >= 0 else done[-1]
            path = os.path.join(self.folder, f"step-{step}")
            if "train.tokens_seen" in self.metadata(path):
                return self.load(path, model_only=False)
            if step < self.steps:
                raise CheckpointError(f"{path} holds only model weights (a last_save_model_only export); start "
                                      "from it with checkpoint.initial_load_path in a new dump_folder")
            logger.info(f"{path} is the final export of a finished run: nothing to do")
            return step, 0
        if cfg.initial_load_path:
            step, tokens = self.load(cfg.initial_load_path, model_only=cfg.initial_load_model_only)
            logger.info(f"loaded {'weights' if cfg.initial_load_model_only else 'state'} from "
                        f"{cfg.initial_load_path}, starting at step {step}")
            return step, tokens
        return 0, 0

    def metadata(self, path: str) -> dict:
        """Sizes of the tensors in a DCP folder, after checking that it is complete and fits our model."""
        if reason := incomplete(path):
            raise CheckpointError(f"{path} is not a complete DCP checkpoint: {reason}")
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        prefix = model_prefix(meta)
        ours = {f"{prefix}{k}": tuple(v.shape) for k, v in get_model_state_dict(self.model).items()}
        bad = [f"{k} {tuple(meta[k].size)} vs ours {s}" for k, s in ours.items()
               if k in meta and tuple(meta[k].size) != s] + [f"{k} missing" for k in ours if k not in meta]
        if bad:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {'; '.join(bad[:5])}"
                                  + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""))
        return meta

    def load(self, path: str, model_only: bool):
        meta, rank_key = self.metadata(path), f"rank{self.rank}"
        if model_prefix(meta) == "":
            return self.load_torchtitan(path, meta, model_only)
        model = {k: plain(v) for k, v in get_model_state_dict(self.model).items()}
        state = {"model": model} if model_only else self.state(0, 0)
        for key in meta if not model_only else ():  # JSON blobs: allocate what was saved
            section, _, name = key.partition(".")
            if section in ("train", "data") and meta[key].properties.dtype == torch.uint8:
                state[section][name] = torch.empty(meta[key].size, dtype=torch.uint8)
        if not model_only:
            state["train"] = {k: v for k, v in state["train"].items() if f"train.{k}" in meta}  # older runs lack some
            if f"rng.{rank_key}" not in meta:  # resuming on more ranks than before
                del state["rng"]
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:  # DCP gathers (error, traceback) per rank: show the first
            e = next(iter(e.failures.values()), (e,))[0]
            raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {str(e)[:300]}".replace("\n", " "))
        set_model_state_dict(self.model, state["model"])
        if model_only:
            return 0, 0
        train, saved = state["train"], json_from(state["train"]["config"])
        diff = [f"{k}: {saved[k]!r} -> {self.run_keys[k]!r}" for k in saved
                if saved[k] != self.run_keys.get(k, saved[k])]
        if diff:
            raise CheckpointError(f"refusing to resume from {path}: the run changed {'; '.join(diff)} (use a new "
                                  "dump_folder, or take only the weights with checkpoint.initial_load_path)")
        opt = get_optimizer_state_dict(self.model, self.optimizer, options=self.sd_options)
        set_optimizer_state_dict(self.model, self.optimizer, {**opt, **state["optimizer"]}, options=self.sd_options)
        self.scheduler.load_state_dict(json_from(train["lr_scheduler"]))
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # load_state_dict restores the scheduler, not the lr it last set
        self.loader.load_state_dict({s: json_from(state["data"][f"stream{s}"]) for s in self.loader.stream_ids})
        if "rng" in state:
            torch.set_rng_state(state["rng"][rank_key])
        step, steps = int(train["step"]), int(train.get("steps", self.steps))
        logger.info(f"resumed from {path} at step {step}")
        saved = json_from(train["notes"]) if "notes" in train else {}  # older checkpoints have none
        if changed := [f"{k} {saved[k]!r} -> {v!r}" for k, v in self.notes.items() if k in saved and saved[k] != v]:
            logger.info(f"this resume changes {'; '.join(changed)} (allowed: the checkpoint's weights are the same)")
        if steps != self.steps and self.rank == 0:  # allowed, but the lr schedule is a function of training.steps
            logger.warning(f"training.steps changed {steps} -> {self.steps}: the lr schedule now ends at "
                           f"step {self.steps} instead of {steps}, and the lr from here on follows it")
        return step, int(train["tokens_seen"])

    def load_torchtitan(self, path: str, meta: dict, model_only: bool):
        """(step, 0) from torchtitan's layout: the model; unless model_only also the AdamW moments (the same
        flattened optimizer keys as ours), its step and its lr schedule's position. Its data position is its
        own loader's and cannot carry over; its token count is one rank's, so ours restarts at 0."""
        model = {k: plain(v) for k, v in get_model_state_dict(self.model).items()}
        state = dict(model)
        if not model_only:
            if "train_state.step" not in meta:
                raise CheckpointError(f"{path} is a model-only torchtitan save (its last_save_model_only export): "
                                      "take its weights with checkpoint.initial_load_model_only = true, or "
                                      "continue from one of its full step-N")
            opt = get_optimizer_state_dict(self.model, self.optimizer, options=self.sd_options)
            moments = {f"optimizer.{k}": plain(v) for k, v in opt.items() if k.startswith("state.")}
            state.update(moments)
            state.update({"train_state.step": None, "lr_scheduler.last_epoch": None})  # pickled ints
        planner = PlainLoadPlanner()
        try:
            dcp.load(state, checkpoint_id=path, planner=planner)
        except CheckpointException as e:  # as in load()
            e = next(iter(e.failures.values()), (e,))[0]
            raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {str(e)[:300]}".replace("\n", " "))
        set_model_state_dict(self.model, {k: state[k] for k in model})
        if model_only:
            return 0, 0
        saved = {k.removeprefix("optimizer."): state[k] for k in moments}
        set_optimizer_state_dict(self.model, self.optimizer, {**opt, **saved}, options=self.sd_options)
        step = int(planner.values["train_state.step"])
        position = int(planner.values["lr_scheduler.last_epoch"])  # torchtitan steps it once per step too
        # Our schedule at its position (torchtitan's own lr curve differs slightly: its warmup reaches the
        # peak one step earlier), so the lr continues rather than restarting warm-up.
        lrs = [base * f(position) for base, f in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), "last_epoch": position,
                                        "_step_count": position + 1, "_last_lr": lrs})
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        logger.info(f"{path} is torchtitan's: took its weights, AdamW moments, step {step} and lr schedule "
                    f"position; not its data position (another loader): the data starts from its beginning")
        return step, 0

    def save(self, step: int, tokens_seen: int, final: bool):
        """Write step-N: in the background (async_mode) unless the run stops after it."""
        if self.pending is not None:  # at most one save in flight
            self.finish()
        t0, tmp = time.perf_counter(), os.path.join(self.folder, f".step-{step}.tmp")
        if self.rank == 0:  # clear leftovers of crashed saves
            os.makedirs(self.folder, exist_ok=True)
            for d in [d for d in os.listdir(self.folder) if re.fullmatch(r"\.step-\d+\.tmp", d)]:
                shutil.rmtree(os.path.join(self.folder, d), ignore_errors=True)
        dist.barrier()
        # Only the last step's save is the export: a save on a signal (final too) must let the requeued job resume.
        state = self.state(step, tokens_seen, model_only=step == self.steps and self.cfg.last_save_model_only)
        try:
            if self.group is not None and not final:
                self.pending = (dcp.async_save(state, checkpoint_id=tmp, process_group=self.group), step)
                logger.info(f"checkpoint step-{step}: training blocked {time.perf_counter() - t0:.2f}s (async)")
                return
            dcp.save(state, checkpoint_id=tmp)
            self.commit(step)
            logger.info(f"saved checkpoint {self.folder}/step-{step}: training blocked {time.perf_counter() - t0:.2f}s")
        except (CheckpointException, OSError) as e:  # disk full, quota, permissions: DCP raises on every rank
            self.failed(step, e, final)

    def finish(self):
        """Wait for the async save in flight and rename it into place."""
        (future, step), self.pending = self.pending, None
        try:
            future.result()
            self.commit(step)
            logger.info(f"saved checkpoint {self.folder}/step-{step} (async)")
        except (CheckpointException, OSError) as e:
            self.failed(step, e, final=False)

    def commit(self, step: int):
        """Once every rank has written (dcp fsyncs each file): one rename makes step-N appear whole. Rank 0 alone
        renames, and every rank learns how that went: a failure (a stale step-N, a quota) is every rank's."""
        dist.barrier()
        outcome = [""]
        if self.rank == 0:
            tmp, final = os.path.join(self.folder, f".step-{step}.tmp"), os.path.join(self.folder, f"step-{step}")
            try:
                with open(os.path.join(tmp, "params.json"), "w") as f:  # what checkpoint_convert.py needs
                    json.dump(self.model.args.params(), f, indent=2)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                dir_fd = os.open(self.folder, os.O_RDONLY)
                os.fsync(dir_fd)  # make the rename itself survive a power loss
                os.close(dir_fd)
            except OSError as e:
                outcome[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(outcome, src=0)  # a string: rank 0's outcome
        if outcome[0]:
            raise OSError(f"putting it in place: {outcome[0]}")
        keep = self.cfg.keep_latest_k  # old checkpoints go only now, after the new one is complete
        for old in (checkpoints(self.folder)[:-keep] if keep > 0 and self.rank == 0 else []):
            shutil.rmtree(os.path.join(self.folder, f"step-{old}"), ignore_errors=True)

    def failed(self, step: int, e: BaseException, final: bool):
        """The previous checkpoint is untouched; training goes on and the next interval tries again,
        unless this was the save a stop depends on."""
        if self.rank == 0:
            shutil.rmtree(os.path.join(self.folder, f".step-{step}.tmp"), ignore_errors=True)
        e = next(iter(e.failures.values()), (e,))[0] if isinstance(e, CheckpointException) else e
        msg = (f"checkpoint step-{step} failed ({type(e).__name__}: {str(e)[:300]}); the newest complete "
               f"checkpoint is still {self.newest()}")
        if final:
            raise SaveError(msg)
        logger.error(msg)
