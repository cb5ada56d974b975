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
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from float8 import plain
from titan_layout import load_torchtitan, model_prefix

logger = logging.getLogger("checkpoint")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (incomplete, another model, another run): one line, exit code 2."""


class SaveError(RuntimeError):
    """The save a stop depends on failed (the previous checkpoint is intact): one line, exit code 3."""


def json_tensor(obj) -> torch.Tensor:
    """Plain Python state as a uint8 tensor, so checkpoints hold tensors only (no pickle on load)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def json_from(t: torch.Tensor):
    return json.loads(t.numpy().tobytes())


def why(e: BaseException) -> str:
    """A failed save's reason in one line: DCP gathers (error, traceback) per rank; the first."""
    e = next(iter(e.failures.values()), (e,))[0] if isinstance(e, CheckpointException) else e
    return f"{type(e).__name__}: {str(e)[:300]}".replace("\n", " ")


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

    def __init__(self, cfg, folder: str, run_keys: dict, steps: int, model, optimizer, scheduler, loader, notes: dict):
        self.cfg, self.folder, self.run_keys, self.steps, self.rank = cfg, folder, run_keys, steps, dist.get_rank()
        self.model, self.optimizer, self.scheduler, self.loader, self.notes = model, optimizer, scheduler, loader, notes
        self.sd_options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Saves run DCP's collectives on a gloo group of their own (async ones from a background thread), made now,
        # while the launcher's store answers (a signal may have ended torchrun by the time a save starts): bounded
        # by save_timeout_seconds, as long as a save may take, not by [comm]'s timeout. Not in the dry run's fake group.
        self.group = self.save_group() if cfg.enable and dist.get_backend() != "fake" else None
        self.pending = None  # (future, step, start time) of an async save not yet renamed into place

    def save_group(self):
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.save_timeout_seconds))

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
        cfg = self.cfg
        done = [checkpoints(self.folder, warn=True) if cfg.enable and self.rank == 0 else []]
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
            if "train.tokens_seen" in self.agreed_metadata(path):
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

    def agreed_metadata(self, path: str) -> dict:
        """metadata(path) as rank 0 finds it, on every rank: a node's view of a shared filesystem can be stale, so
        rank 0 alone checks it, and every rank stops with rank 0's line, or with that of a rank that cannot read it."""
        error = ""  # this rank's line, if it cannot read the metadata
        meta = None
        try:
            reader = dcp.FileSystemReader(path)
            meta = self.metadata(path) if self.rank == 0 else reader.read_metadata().state_dict_metadata
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # what DCP's reader raises: any error of the file system or the format
            error = (f"rank {self.rank} cannot read {os.path.join(path, '.metadata')}, which rank 0 found complete "
                     f"({type(e).__name__}: {str(e)[:200]})".replace("\n", " "))
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if error := next((e for e in errors if e), ""):
            raise CheckpointError(error)
        return meta

    def load(self, path: str, model_only: bool):
        meta = self.agreed_metadata(path)
        rank_key = f"rank{self.rank}"  # this rank's RNG state in the checkpoint
        if model_prefix(meta) == "":  # torchtitan's layout
            if not model_only and "train_state.step" not in meta:
                raise CheckpointError(f"{path} is a model-only torchtitan save (its last_save_model_only export): "
                                      "take its weights with checkpoint.initial_load_model_only = true, or "
                                      "continue from one of its full step-N")
            try:
                step = load_torchtitan(path, self.model, None if model_only else self.optimizer, self.scheduler)
            except CheckpointException as e:
                raise CheckpointError(f"cannot load {path}: {why(e)}")
            if not model_only:
                logger.info(f"{path} is torchtitan's: took its weights, AdamW moments, step {step} and lr schedule "
                            f"position; not its data position (another loader): the data starts from its beginning")
            return step, 0
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
        except CheckpointException as e:
            raise CheckpointError(f"cannot load {path}: {why(e)}")
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
        step = int(train["step"])
        steps = int(train.get("steps", self.steps))  # the run's training.steps, as saved
        logger.info(f"resumed from {path} at step {step}")
        saved = json_from(train["notes"]) if "notes" in train else {}  # older checkpoints have none
        if changed := [f"{k} {saved[k]!r} -> {v!r}" for k, v in self.notes.items() if k in saved and saved[k] != v]:
            logger.info(f"this resume changes {'; '.join(changed)} (allowed: the checkpoint's weights are the same)")
        if steps != self.steps and self.rank == 0:  # allowed, but the lr schedule is a function of training.steps
            logger.warning(f"training.steps changed {steps} -> {self.steps}: the lr schedule now ends at "
                           f"step {self.steps} instead of {steps}, and the lr from here on follows it")
        return step, int(train["tokens_seen"])

    def save(self, step: int, tokens_seen: int, final: bool):
        """Write step-N: in the background (async_mode) unless the run stops after it."""
        if self.pending is not None:  # at most one save in flight
            self.finish()
        if self.group is None:  # after a failed save, or in the dry run: every rank saves at the same step
            self.group = self.save_group()
        t0 = time.perf_counter()
        tmp = os.path.join(self.folder, f".step-{step}.tmp")
        if self.rank == 0:  # clear leftovers of crashed saves
            os.makedirs(self.folder, exist_ok=True)
            for d in [d for d in os.listdir(self.folder) if re.fullmatch(r"\.step-\d+\.tmp", d)]:
                shutil.rmtree(os.path.join(self.folder, d), ignore_errors=True)
        dist.barrier()
        # Only the last step's save is the export: a save on a signal (final too) must let the requeued job resume.
        state = self.state(step, tokens_seen, model_only=step == self.steps and self.cfg.last_save_model_only)
        try:
            if self.cfg.async_mode == "async" and not final:
                future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
                self.pending = (future, step, time.monotonic())
                logger.info(f"checkpoint step-{step}: training blocked {time.perf_counter() - t0:.2f}s (async)")
                return
            dcp.save(state, checkpoint_id=tmp, process_group=self.group)
            self.commit(step)
            logger.info(f"saved checkpoint {self.folder}/step-{step}: training blocked {time.perf_counter() - t0:.2f}s")
        except (CheckpointException, OSError, RuntimeError) as e:  # disk full, quota, past save_timeout_seconds (gloo)
            self.group = None  # a timed-out group may be broken: the next save makes a new one
            self.failed(step, why(e), final)

    def finish(self):
        """Wait until every rank's async save has ended (at most save_timeout_seconds from its start), then rename it
        into place if it went well on every rank; else it failed, on every rank alike."""
        (future, step, started), self.pending = self.pending, None
        while True:  # every rank polls in step on the default group (its ranks are all here) until none is writing
            late = time.monotonic() > started + self.cfg.save_timeout_seconds
            state = "late" if late else "writing"
            state = (why(future.exception()) if future.exception() else "") if future.done() else state
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)  # a gather that timed out fails on some ranks only: all learn it
            if "writing" not in states:
                break
            time.sleep(0.1)
        error = "late" if "late" in states else next((s for s in states if s), "")  # the cause, not its effects
        if error == "late":
            error = (f"rank {states.index('late')} was still writing after checkpoint.save_timeout_seconds = "
                     f"{self.cfg.save_timeout_seconds} s")
        if error:
            self.group = None  # a write still running, or a timed-out group: the next save makes a new one
            return self.failed(step, error, final=False)
        try:
            self.commit(step)
            logger.info(f"saved checkpoint {self.folder}/step-{step} (async)")
        except OSError as e:
            self.failed(step, why(e), final=False)

    def close(self):
        """On an error exit, with no collective (a rank may be gone): wait for this rank's async save, at most
        save_timeout_seconds from its start; rank 0 puts it in place if it went well there, which means that every
        rank wrote its files (DCP writes .metadata on rank 0 after gathering every rank's result)."""
        if self.pending is None:
            return
        (future, step, started), self.pending = self.pending, None
        try:
            future.result(timeout=max(0.0, started + self.cfg.save_timeout_seconds - time.monotonic()))
            if self.rank == 0:
                self.put_in_place(step)
                logger.info(f"saved checkpoint {self.folder}/step-{step} (async, before the error exit)")
        except Exception as e:  # its write, its collectives, the time it may take, the rename
            logger.error(f"checkpoint step-{step} failed ({why(e)}); the newest complete checkpoint is still "
                         f"{self.newest()}")

    def commit(self, step: int):
        """Once every rank has written (dcp fsyncs each file): one rename makes step-N appear whole. Rank 0 alone
        renames, and every rank learns how that went: a failure (a stale step-N, a quota) is every rank's."""
        dist.barrier()
        outcome = [""]
        if self.rank == 0:
            try:
                self.put_in_place(step)
            except OSError as e:
                outcome[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(outcome, src=0)  # a string: rank 0's outcome
        if outcome[0]:
            raise OSError(f"putting it in place: {outcome[0]}")
        keep = self.cfg.keep_latest_k  # old checkpoints go only now, after the new one is complete
        for old in (checkpoints(self.folder)[:-keep] if keep > 0 and self.rank == 0 else []):
            shutil.rmtree(os.path.join(self.folder, f"step-{old}"), ignore_errors=True)

    def put_in_place(self, step: int):
        """Rank 0's part of a commit: params.json, then the one rename."""
        tmp = os.path.join(self.folder, f".step-{step}.tmp")
        final = os.path.join(self.folder, f"step-{step}")
        with open(os.path.join(tmp, "params.json"), "w") as f:  # what checkpoint_convert.py needs
            json.dump(self.model.args.params(), f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        dir_fd = os.open(self.folder, os.O_RDONLY)
        os.fsync(dir_fd)  # make the rename itself survive a power loss
        os.close(dir_fd)

    def failed(self, step: int, reason: str, final: bool):
        """The previous checkpoint is untouched; training goes on and the next interval tries again,
        unless this was the save a stop depends on."""
        if self.rank == 0:
            shutil.rmtree(os.path.join(self.folder, f".step-{step}.tmp"), ignore_errors=True)
        msg = f"checkpoint step-{step} failed ({reason}); the newest complete checkpoint is still {self.newest()}"
        if final:
            raise SaveError(msg)
        logger.error(msg)
