"""Train Llama 3 with FSDP2 (+ optional tensor parallelism), from one CPU process to thousands of GPUs.

    python train.py --config configs/debug_model.toml                          # 1 process (CPU ok)
    torchrun --standalone --nproc_per_node 2 train.py --config configs/debug_model.toml
    torchrun --nproc_per_node 8 train.py --config configs/llama3_8b.toml --training.steps 100
    torchrun --nproc_per_node 8 train.py --config configs/llama3_8b.toml --parallelism.tensor_parallel_degree 2
    sbatch --nodes 4 slurm/multinode.sbatch                                     # see README
    python train.py --help                                                      # every config key

Config precedence: --section.key value on the command line > the TOML file > the defaults below.
One flat main(cfg), top to bottom: config, mesh, model, parallelize, optimizer, data, checkpoint, loop.
"""

import contextlib
import dataclasses
import difflib
import fcntl
import gc
import hashlib
import inspect
import json
import logging
import math
import os
import re
import resource
import shutil
import signal
import sys
import time
import tomllib
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from data import DataError, DataLoader, DataSource, Tokenizer
from model import Transformer, flavors

logger = logging.getLogger("train")


# -------------------------------------------------------------------------------------------------
# Config: each field is `name: type = default  # one-line doc` (the doc is what --help prints)
# -------------------------------------------------------------------------------------------------

@dataclass
class Job:
    dump_folder: str = "./outputs"  # where logs, metrics.jsonl, config.toml and checkpoints go
    description: str = ""  # free text, printed at start


@dataclass
class Model:
    flavor: str = "debugmodel"  # debugmodel, 1B, 3B, 8B, 70B or 405B (see model.py)
    n_layers: int = 0  # 0: the flavor's; N: the flavor's width with N blocks (e.g. an 8B-wide model on one GPU)
    tokenizer_path: str = "assets/tokenizer/tokenizer.model"  # Llama 3 tokenizer.model (tiktoken)


@dataclass
class Optimizer:
    name: str = "AdamW"  # only AdamW
    lr: float = 8e-4  # peak learning rate
    beta1: float = 0.9  # Adam beta1
    beta2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled weight decay (applied to every weight)


@dataclass
class LRScheduler:
    warmup_steps: int = 200  # linear warmup from ~0 to lr
    decay_ratio: float = -1.0  # WSD: fraction of steps spent decaying at the end; -1 decays after warmup
    decay_type: str = "linear"  # linear, cosine or sqrt
    min_lr_factor: float = 0.0  # the decay ends at lr * min_lr_factor


@dataclass
class Training:
    local_batch_size: int = 8  # sequences per data-parallel rank per micro-step
    global_batch_size: int = -1  # sequences per optimizer step; a multiple of local * dp ranks adds accumulation; -1: local * dp
    seq_len: int = 2048  # tokens per sequence
    max_norm: float = 1.0  # gradient clipping by total norm (0 turns it off)
    steps: int = 10000  # optimizer steps to train
    seed: int = 0  # seeds the weight init: the same seed gives the same weights on any parallel layout
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower on GPU)
    mixed_precision_param: str = "bfloat16"  # parameter/compute dtype under FSDP (float32 or bfloat16)
    mixed_precision_reduce: str = "float32"  # gradient reduce-scatter dtype


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # HSDP replicas (each holds a full sharded copy)
    data_parallel_shard_degree: int = -1  # FSDP shards; -1: whatever is left of the world size
    tensor_parallel_degree: int = 1  # DTensor tensor parallel (shards heads and FFN); within a node


@dataclass
class Checkpoint:
    enable: bool = False  # save DCP checkpoints and resume from the newest one
    folder: str = "checkpoint"  # under dump_folder; holds step-N/ folders
    interval: int = 500  # save every this many steps (and at the last step)
    keep_latest_k: int = 0  # delete older checkpoints, keeping this many; 0 keeps all
    async_mode: str = "disabled"  # disabled, or async: write in a background thread while training goes on
    last_save_model_only: bool = False  # the final checkpoint holds only the model weights, for export
    export_dtype: str = "float32"  # dtype of that model-only checkpoint: float32 or bfloat16
    load_step: int = -1  # resume from step-N instead of the newest; -1: newest
    initial_load_path: str = ""  # with nothing to resume: start from this DCP folder (checkpoint_convert.py output or a step-N)
    initial_load_model_only: bool = True  # from initial_load_path take only the weights (fresh optimizer, step 0)


@dataclass
class ActivationCheckpoint:
    mode: str = "selective"  # none, full or selective
    selective_ac_option: str = "op"  # op: keep matmul/attention outputs, recompute the rest; N: full AC every Nth block


@dataclass
class Compile:
    enable: bool = False  # torch.compile each TransformerBlock


@dataclass
class Metrics:
    log_freq: int = 10  # log every this many steps
    enable_tensorboard: bool = False  # also write TensorBoard events to dump_folder/tb
    peak_tflops: float = 0.0  # peak TFLOP/s per device for MFU; 0: look up the GPU (CPU prints n/a)


@dataclass
class Comm:
    init_timeout_seconds: int = 300  # a collective (or the set-up) waiting longer than this fails the run


@dataclass
class Data:
    seed: int = 1234  # seeds the file order of every source (a new order each epoch)
    num_streams: int = 0  # logical data streams (a multiple of the DP degree); 0: the DP degree
    num_workers: int = 0  # loader processes per rank that read and tokenize ahead; 0: in the training process
    sources: list = field(default_factory=list)  # [[data.sources]] tables: name, path, config, data_files, split, revision, text_column, weight


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    data: Data = field(default_factory=Data)


class ConfigError(ValueError):
    """A user mistake in the config or the command line: reported as one line, exit code 2."""


class RunError(RuntimeError):
    """The run had to stop (non-finite loss, a final checkpoint that could not be written): one line, exit 3."""


def _docs(cls) -> dict:
    """The trailing `# comment` of each field in a config dataclass's source."""
    return dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))


def _convert(value, typ, where: str):
    """Check/convert a TOML value or a CLI string to the field's type."""
    if isinstance(value, str) and typ is not str:  # from the command line
        try:
            value = {"true": True, "false": False}[value.lower()] if typ is bool else typ(value)
        except (KeyError, ValueError):
            raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is str and isinstance(value, int) and not isinstance(value, bool):  # selective_ac_option = 2
        value = str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}")
    return value


def _unknown(kind: str, name: str, known) -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid: {', '.join(known)}"
    return ConfigError(f"unknown {kind} {name!r}{hint}")


def _set(cfg: Config, section: str, key: str, value, where: str):
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise _unknown("config section", section, sections)
    obj = getattr(cfg, section)
    keys = {f.name: f for f in dataclasses.fields(obj)}
    if key not in keys:
        raise _unknown(f"key in [{section}]", key, keys)
    if (section, key) == ("data", "sources"):
        if not isinstance(value, list) or not all(isinstance(s, dict) for s in value):
            raise ConfigError(f"{where}: data.sources must be [[data.sources]] tables in the TOML")
        value = [_source(s, f"{where}[{i}]") for i, s in enumerate(value)]
    else:
        value = _convert(value, typing.get_type_hints(type(obj))[key], f"{where} {section}.{key}")
    setattr(obj, key, value)


def _source(d: dict, where: str) -> DataSource:
    src = DataSource()
    types = typing.get_type_hints(DataSource)
    for k, v in d.items():
        if k not in types:
            raise _unknown(f"key in {where}", k, types)
        typ = typing.get_args(types[k])[0] if typing.get_origin(types[k]) is typing.Union else types[k]
        setattr(src, k, _convert(v, typ, f"{where}.{k}"))
    return src


def load_config(argv) -> Config:
    """Defaults, then the TOML file (--config), then --section.key value overrides."""
    cfg, overrides, path = Config(), [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:  # `--section.key value`, or a bare boolean flag `--checkpoint.enable`
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"
            else:
                value, i = nxt, i + 1
        if name in ("config", "job.config_file"):
            path = value
        else:
            section, dot, key = name.partition(".")
            if not dot:
                raise ConfigError(f"option --{name}: expected --section.key (e.g. --training.steps)")
            overrides.append((section, key, value))
        i += 1
    if path is not None:
        try:
            with open(path, "rb") as f:
                toml = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found")
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}")
        for section, table in toml.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: {section!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, path)
    for section, key, value in overrides:
        _set(cfg, section, key, value, "command line")
    return cfg


def flavor_args(cfg: Config):
    """The flavor's ModelArgs, with model.n_layers applied."""
    args = flavors[cfg.model.flavor]
    return dataclasses.replace(args, n_layers=cfg.model.n_layers) if cfg.model.n_layers else args


def validate(cfg: Config, world_size: int) -> dict:
    """Reject configs that cannot work, before any process group or model exists. Returns derived sizes."""
    t, p = cfg.training, cfg.parallelism
    if cfg.model.flavor not in flavors:
        raise _unknown("model.flavor", cfg.model.flavor, flavors)
    args = flavor_args(cfg)
    o, s, c = cfg.optimizer, cfg.lr_scheduler, cfg.checkpoint
    at_least_1, at_least_0 = (lambda v: v >= 1, ">= 1"), (lambda v: v >= 0, ">= 0")
    for key, value, (ok, allowed) in [
            ("training.steps", t.steps, at_least_1), ("training.local_batch_size", t.local_batch_size, at_least_1),
            ("training.seq_len", t.seq_len, at_least_1), ("metrics.log_freq", cfg.metrics.log_freq, at_least_1),
            ("checkpoint.interval", c.interval, at_least_1),
            ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree, at_least_1),
            ("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree, at_least_1),
            ("parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree, (lambda v: v == -1 or v >= 1, "-1 or >= 1")),
            ("training.global_batch_size", t.global_batch_size, (lambda v: v == -1 or v >= 1, "-1 or >= 1")),
            ("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds, at_least_1),
            ("optimizer.lr", o.lr, (lambda v: 0 < v < math.inf, "a positive number")),
            ("optimizer.eps", o.eps, (lambda v: 0 < v < math.inf, "a positive number")),
            ("optimizer.beta1", o.beta1, (lambda v: 0 <= v < 1, "in [0, 1)")),
            ("optimizer.beta2", o.beta2, (lambda v: 0 <= v < 1, "in [0, 1)")),
            ("optimizer.weight_decay", o.weight_decay, at_least_0), ("training.max_norm", t.max_norm, at_least_0),
            ("lr_scheduler.warmup_steps", s.warmup_steps, at_least_0),
            ("lr_scheduler.decay_ratio", s.decay_ratio, (lambda v: v == -1 or 0 < v <= 1, "-1 or in (0, 1]")),
            ("lr_scheduler.min_lr_factor", s.min_lr_factor, (lambda v: 0 <= v <= 1, "in [0, 1]")),
            ("checkpoint.keep_latest_k", c.keep_latest_k, at_least_0),
            ("checkpoint.load_step", c.load_step, (lambda v: v >= -1, "-1 or >= 0")),
            ("metrics.peak_tflops", cfg.metrics.peak_tflops, at_least_0),
            ("data.num_streams", cfg.data.num_streams, at_least_0),
            ("data.num_workers", cfg.data.num_workers, at_least_0), ("model.n_layers", cfg.model.n_layers, at_least_0)]:
        if not ok(value):  # NaN fails every comparison, so it lands here too
            raise ConfigError(f"{key} = {value}: must be {allowed}")
    if t.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {t.seq_len} exceeds the {cfg.model.flavor} model's "
                          f"max_seq_len {args.max_seq_len}")
    for key, value, allowed in [
            ("activation_checkpoint.mode", cfg.activation_checkpoint.mode, ("none", "full", "selective")),
            ("lr_scheduler.decay_type", cfg.lr_scheduler.decay_type, ("linear", "cosine", "sqrt")),
            ("training.mixed_precision_param", t.mixed_precision_param, ("bfloat16", "float32")),
            ("training.mixed_precision_reduce", t.mixed_precision_reduce, ("bfloat16", "float32")),
            ("optimizer.name", cfg.optimizer.name, ("AdamW",)),
            ("checkpoint.async_mode", cfg.checkpoint.async_mode, ("disabled", "async")),
            ("checkpoint.export_dtype", cfg.checkpoint.export_dtype, ("float32", "bfloat16"))]:
        if value not in allowed:
            raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(allowed)}")
    sac = cfg.activation_checkpoint.selective_ac_option
    if cfg.activation_checkpoint.mode == "selective" and not (sac == "op" or (sac.isdigit() and int(sac) > 0)):
        raise ConfigError(f"activation_checkpoint.selective_ac_option = {sac!r}: must be 'op' or a positive integer")
    tp, rep = p.tensor_parallel_degree, p.data_parallel_replicate_degree
    shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree != -1 else world_size // (tp * rep)
    if shard < 1 or rep * shard * tp != world_size:
        raise ConfigError(f"parallelism: data_parallel_replicate_degree {rep} x data_parallel_shard_degree "
                          f"{p.data_parallel_shard_degree} x tensor_parallel_degree {tp} must equal the "
                          f"world size {world_size}")
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree = {tp} must divide the {cfg.model.flavor} "
                          f"model's n_heads {args.n_heads} and n_kv_heads {args.n_kv_heads}")
    if tp > 1 and t.seq_len % tp:
        raise ConfigError(f"training.seq_len = {t.seq_len} must be divisible by tensor_parallel_degree {tp} "
                          "(sequence parallelism splits it)")
    dp = rep * shard
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
    if gbs < 1 or gbs % (t.local_batch_size * dp):
        raise ConfigError(f"training.global_batch_size = {gbs} must be a multiple of local_batch_size "
                          f"{t.local_batch_size} x data-parallel degree {dp}")
    if not cfg.data.sources:
        raise ConfigError("data.sources is empty; add [[data.sources]] tables to the TOML")
    for s in cfg.data.sources:
        if not s.name or not s.path:
            raise ConfigError(f"data.sources: every source needs a name and a path (got {s})")
        if not (s.weight >= 0 and math.isfinite(s.weight)):
            raise ConfigError(f"data.sources {s.name!r}: weight = {s.weight} must be >= 0")
    if sum(s.weight for s in cfg.data.sources) <= 0:
        raise ConfigError("data.sources: the weights sum to 0; give at least one source a positive weight")
    streams = cfg.data.num_streams or dp
    if streams % dp or t.local_batch_size % (streams // dp):
        raise ConfigError(f"data.num_streams = {streams} must be a multiple of the data-parallel degree {dp} "
                          f"and divide into local_batch_size {t.local_batch_size} per rank")
    return {"dp_shard": shard, "dp": dp, "global_batch_size": gbs,
            "grad_accum": gbs // (t.local_batch_size * dp)}


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that --config accepts back (None values are left out)."""
    def fmt(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()
    out = []
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        out.append(f"[{f.name}]")
        out += [f"{k} = {fmt(v)}" for k, v in dataclasses.asdict(sec).items() if k != "sources" and v is not None]
        for s in getattr(sec, "sources", []):
            out.append(f"\n[[{f.name}.sources]]")
            out += [f"{k} = {fmt(v)}" for k, v in dataclasses.asdict(s).items() if v is not None]
        out.append("")
    return "\n".join(out)


def print_help():
    print(__doc__)
    for f in dataclasses.fields(Config):
        cls = type(getattr(Config(), f.name))
        print(f"[{f.name}]")
        for k, doc in _docs(cls).items():
            print(f"  --{f.name}.{k} (default {getattr(cls(), k)!r}): {doc}")


# -------------------------------------------------------------------------------------------------
# Parallelism: TP plan, activation checkpointing, compile, FSDP2, and a layout-independent init
# -------------------------------------------------------------------------------------------------

def parallelize(model: Transformer, mesh, cfg: Config, device_type: str):
    tp_mesh = mesh["tp"]
    if tp_mesh.size() > 1:
        # Sequence parallel between blocks: activations are sharded on seq (Shard(1)) for norms and
        # residual adds, gathered before attention / FFN, and reduce-scattered after wo / w2.
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # Logits stay sharded on the vocab (loss parallel): no rank ever holds (tokens x vocab) whole.
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
        block_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        for block in model.layers:
            parallelize_module(block, tp_mesh, block_plan)

    ac = cfg.activation_checkpoint
    if ac.mode != "none":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
        # Keep matmul and attention outputs (expensive to recompute), recompute cheap elementwise ops.
        save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops.aten._scaled_dot_product_cudnn_attention.default}

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        for i, block in enumerate(model.layers):
            if ac.mode == "selective" and ac.selective_ac_option == "op":
                context_fn = partial(create_selective_checkpoint_contexts, policy)
                model.layers[i] = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
            elif ac.mode == "full" or i % int(ac.selective_ac_option) == 0:
                model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)

    if cfg.compile.enable:
        for block in model.layers:
            block.compile(fullgraph=True)  # in place, so parameter names stay Meta's

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    mp = MixedPrecisionPolicy(param_dtype=dtypes[cfg.training.mixed_precision_param],
                              reduce_dtype=dtypes[cfg.training.mixed_precision_reduce])
    # HSDP: shard within dp_shard, replicate across dp_replicate.
    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again right away by backward: don't free them.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def layout_independent_normal(seed: int):
    """An init fill for model.init_weights whose values depend on (seed, weight name, position) only,
    so 1 process, FSDP and TP start from identical weights. Each rank fills only its own shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def fill(name: str, w: torch.Tensor, std: float):
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if isinstance(w, DTensor):
            _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
            fill_normal_region(w.to_local(), offset, w.shape, seed, name, std)
        else:
            fill_normal_region(w, (0, 0), w.shape, seed, name, std)

    return fill


def fill_normal_region(local: torch.Tensor, offset, full_shape, seed: int, name: str, std: float,
                       rows_per_block: int = 64):
    """Fill `local`, the block of a (rows, cols) weight starting at `offset`, with truncated normals.

    Rows are drawn in blocks of 64 from generators keyed by (seed, name, block): a shard draws the
    blocks its rows touch, at full width, and keeps its own rows and columns.
    """
    r0, r1 = offset[0], offset[0] + local.shape[0]
    c0, c1 = offset[1], offset[1] + local.shape[1]
    for b in range(r0 // rows_per_block, -(-r1 // rows_per_block)):
        digest = hashlib.sha256(f"{seed}/{name}/{b}".encode()).digest()
        g = torch.Generator(device=local.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        lo, hi = b * rows_per_block, min((b + 1) * rows_per_block, full_shape[0])
        block = torch.empty(hi - lo, full_shape[1], device=local.device, dtype=local.dtype)
        torch.nn.init.trunc_normal_(block, 0.0, std, -3 * std, 3 * std, generator=g)
        a, z = max(lo, r0), min(hi, r1)
        local[a - r0:z - r0].copy_(block[a - lo:z - lo, c0:c1])


# -------------------------------------------------------------------------------------------------
# Schedule, metrics, checkpoint helpers
# -------------------------------------------------------------------------------------------------

def lr_factor(step: int, cfg: Config) -> float:
    """Multiplier on the peak lr at optimizer step `step` (0-based): warmup, stable, decay."""
    s, total = cfg.lr_scheduler, cfg.training.steps
    warmup = min(s.warmup_steps, total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = total - warmup if s.decay_ratio < 0 else max(1, round(total * s.decay_ratio))
    decay_start = total - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / (decay_steps + 1))
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[s.decay_type]
    return s.min_lr_factor + (1 - s.min_lr_factor) * shape


# Dense bf16 peak TFLOP/s per device, matched against torch.cuda.get_device_name (first match wins).
PEAK_TFLOPS = [("GB200", 2500.0), ("B200", 2250.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0),
               ("H800", 989.0), ("A100", 312.0), ("MI300X", 1307.0), ("MI250X", 191.5)]


def peak_tflops(cfg: Config, device: torch.device) -> float:
    if cfg.metrics.peak_tflops > 0:
        return cfg.metrics.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((p for key, p in PEAK_TFLOPS if key in name), 0.0)
    return 0.0


def memory_stats(device: torch.device):
    """(GiB, % of device, allocated GiB). GPU: the caching allocator's reserved and allocated peaks since
    the last call; CPU: the process's peak RSS since it started (allocated is None)."""
    if device.type == "cuda":
        peak, allocated = torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30, 100 * peak / total, allocated / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB on Linux
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return peak / 2**30, 100 * peak / total, None


def resident_bytes() -> int:
    """The process's resident memory now (Linux), or its peak so far elsewhere (close to it at start-up)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return int(memory_stats(torch.device("cpu"))[0] * 2**30)


def estimate_memory(model: Transformer, cfg: Config, sizes: dict, cuda: bool) -> dict:
    """Bytes per device at the peak of a training step, by part, for eager mode (compile keeps less).

    Weights, gradients and AdamW's two moments are fp32, sharded over dp_shard x tp. At the peak FSDP
    holds the root's weights (embedding, norm, output) and the last block gathered in the param dtype. Per
    block and token, backward keeps (counted from model.py's ops; b: bytes of the param dtype, d: dim,
    kv: kv heads x head_dim, f: FFN hidden; the fp32 copies in RMSNorm and rope are 4 bytes each):
      AC none 7bd + 12d + 4kv + 4bf + 4 n_heads; selective op b(5d + 2kv + 2f) (the matmul and attention
      outputs); full bd (the block input). With AC one block's full set comes back during its backward.
    The loss keeps fp32 log-probs (tokens x vocab) and its backward holds two more such tensors.
    CPU adds the process's resident memory before the model exists (Python, torch, tokenizer).
    """
    a, t, p = model.args, cfg.training, cfg.parallelism
    tp, shards = p.tensor_parallel_degree, sizes["dp_shard"] * p.tensor_parallel_degree
    b = 2 if t.mixed_precision_param == "bfloat16" else 4
    n_total, n_block = model.num_params(), sum(q.numel() for q in model.layers[0].parameters())
    d, kv, f = a.dim, model.layers[0].attention.wk.out_features, model.layers[0].feed_forward.w1.out_features
    tokens = t.local_batch_size * t.seq_len
    # With sequence parallelism the norms see tokens / tp; attention and FFN see a tp-th of the heads and
    # hidden units over all tokens; the inputs gathered for wq/wk/wv and w1/w3 and the partial sums out of
    # wo and w2 are full size.
    norm = 2 * (b * d + 4 * d) / tp
    full_block = norm + (5 * b * d + 4 * d + 4 * kv + 4 * b * f + 4 * a.n_heads) / tp + (2 * b * d if tp > 1 else 0)
    saved = {"none": full_block, "full": b * d / tp,  # op: wq, attention, wk, wv, w1, w3 | input | wo, w2
             "op": b * (2 * d + 2 * kv + 2 * f) / tp + b * d / tp + 2 * b * d}
    ac = cfg.activation_checkpoint
    mode = "op" if ac.mode == "selective" and ac.selective_ac_option == "op" else ac.mode
    if mode == "selective":  # full AC on every Nth block, none on the others
        n_ac = len(range(0, a.n_layers, int(ac.selective_ac_option)))
        all_blocks = n_ac * saved["full"] + (a.n_layers - n_ac) * full_block
    else:
        all_blocks = a.n_layers * saved[mode]
    parts = {
        "weights": 4 * n_total / shards,
        "optimizer": 8 * n_total / shards,
        "gradients": 4 * n_total / shards,
        "gathered": b * (n_total - (a.n_layers - 1) * n_block) / tp,  # the root and the last block
        "activations": tokens * (all_blocks + (4 * d + b * d) / tp),  # + the final norm
        "loss": tokens * 12 * a.vocab_size / tp,  # vocab-sharded under TP (loss parallel)
        "runtime": 0 if cuda else resident_bytes(),
    }
    # Two candidate peaks. (1) The loss's backward: every block's activations and the loss tensors (and
    # the gradients under accumulation; otherwise zero_grad(set_to_none) freed them). (2) A block's
    # backward: gradients of the blocks above, activations of the blocks below, and the block's own
    # working set (what AC recomputes, plus about two FFN-sized gradients). It peaks at the top or the
    # bottom block: linear in between.
    at_loss = parts["activations"] + parts["loss"] + (parts["gradients"] if sizes["grad_accum"] > 1 else 0)
    working = tokens * (full_block - (saved[mode] if mode in saved else all_blocks / a.n_layers) + 2 * b * f / tp)
    grad_out, grad_block = 4 * (model.output.weight.numel() + d) / shards, 4 * n_block / shards
    if sizes["grad_accum"] > 1:
        in_blocks = parts["gradients"] + parts["activations"] + working
    else:
        in_blocks = working + grad_out + max(grad_block + parts["activations"],
                                             a.n_layers * grad_block + parts["activations"] / a.n_layers)
    parts["total"] = (parts["weights"] + parts["optimizer"] + parts["gathered"] + parts["runtime"]
                      + max(at_loss, in_blocks, parts["gradients"]))
    return parts


def format_estimate(parts: dict) -> str:
    items = "  ".join(f"{k} {v / 2**30:.2f}" for k, v in parts.items() if k != "total" and v)
    return f"memory estimate per device: {parts['total'] / 2**30:.2f} GiB ({items} GiB)"


def json_tensor(obj) -> torch.Tensor:
    """Plain Python state as a uint8 tensor, so checkpoints hold tensors only (no pickle on load)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def checkpoints(folder: str) -> list:
    """Steps of the complete checkpoints, oldest first. Saves land in .tmp folders and are renamed when done."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", d)))


def begin_save(folder: str, step: int, rank: int) -> str:
    """Clear leftovers of crashed saves; every rank then writes into the returned .tmp folder."""
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        for d in os.listdir(folder):
            if re.fullmatch(r"\.step-\d+\.tmp", d):
                shutil.rmtree(os.path.join(folder, d), ignore_errors=True)
    dist.barrier()
    return os.path.join(folder, f".step-{step}.tmp")


def commit_save(folder: str, step: int, params: dict, keep_latest_k: int, rank: int):
    """Once every rank has written (dcp fsyncs each file): one rename makes step-N appear whole."""
    dist.barrier()
    if rank == 0:
        tmp, final = os.path.join(folder, f".step-{step}.tmp"), os.path.join(folder, f"step-{step}")
        with open(os.path.join(tmp, "params.json"), "w") as f:  # what checkpoint_convert.py needs
            json.dump(params, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        dir_fd = os.open(folder, os.O_RDONLY)
        os.fsync(dir_fd)  # make the rename itself survive a power loss
        os.close(dir_fd)
        # Old checkpoints go only now, after the new one is complete.
        for old in (checkpoints(folder)[:-keep_latest_k] if keep_latest_k > 0 else []):
            shutil.rmtree(os.path.join(folder, f"step-{old}"), ignore_errors=True)
    dist.barrier()


def read_checkpoint_metadata(path: str, model) -> dict:
    """Sizes of the tensors in a DCP folder, after checking that its model fits ours (one-line errors)."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # a missing folder, or not a DCP checkpoint
        raise ConfigError(f"{path} is not a DCP checkpoint ({type(e).__name__}: {e})".replace("\n", " "))
    ours = {f"model.{k}": tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    bad = [f"{k} {tuple(meta[k].size)} vs ours {s}" for k, s in ours.items() if k in meta and tuple(meta[k].size) != s]
    bad += [f"{k} missing" for k in ours if k not in meta]
    if bad:
        raise ConfigError(f"checkpoint {path} does not fit this model: {'; '.join(bad[:5])}"
                          + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""))
    return meta


def json_from(t: torch.Tensor):
    return json.loads(bytes(t.tolist()))


# -------------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------------

def main(cfg: Config):
    # --- config: validated before any process group or model exists, on every rank alike ----------
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    sizes = validate(cfg, world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s",
                        stream=sys.stdout, force=True)
    # Preemption (Slurm's warning signal, or a plain kill): finish the step, save, exit 0.
    # Installed before the slow start-up, so a signal that comes early is not lost either.
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, on_signal)

    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    try:  # every rank checks, so every rank fails alike instead of waiting for rank 0 until a timeout
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        if not os.access(cfg.job.dump_folder, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise ConfigError(f"job.dump_folder = {cfg.job.dump_folder!r} cannot be used: {e}")

    # --- device and mesh -------------------------------------------------------------------------------
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=cfg.comm.init_timeout_seconds)
    if "RANK" in os.environ:  # torchrun / srun
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    else:  # plain `python train.py`: a one-process group, no ports needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # One run per dump folder: rank 0 holds an flock for the whole run (released by the OS however the
    # process ends), so a second job pointed here stops before it touches config or checkpoints.
    lock = open(os.path.join(cfg.job.dump_folder, ".lock"), "a") if rank == 0 else None
    try:
        locked = lock is None or fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB) is None
    except BlockingIOError:
        locked = False
    ok = torch.tensor(int(locked), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok:
        raise ConfigError(f"job.dump_folder = {cfg.job.dump_folder!r} is in use by another run (its .lock is "
                          "held); wait for that run to end or choose another dump_folder")
    if rank == 0:
        with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
        logger.info(f"{cfg.job.description}\n{to_toml(cfg)}".strip())
    p = cfg.parallelism
    mesh = init_device_mesh(device.type, (p.data_parallel_replicate_degree, sizes["dp_shard"],
                                          p.tensor_parallel_degree),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")  # all ranks that see different data
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.training.seed)

    # --- model: on the meta device, so no rank ever holds the full unsharded weights ---------------------
    model_args = flavor_args(cfg)
    if tokenizer.n_words > model_args.vocab_size:
        raise ConfigError(f"tokenizer {cfg.model.tokenizer_path} has {tokenizer.n_words} tokens but model "
                          f"{cfg.model.flavor} has vocab_size {model_args.vocab_size}")
    with torch.device("meta"):
        model = Transformer(model_args)
    n_params = model.num_params()
    # FLOPs per token, forward + backward: 6 per non-embedding weight plus attention scores (causal
    # attention counted as full, as in the PaLM/torchtitan MFU convention).
    head_dim = model_args.dim // model_args.n_heads
    flops_per_token = (6 * model.num_params(exclude_embedding=True)
                       + 12 * model_args.n_layers * model_args.n_heads * head_dim * cfg.training.seq_len)
    logger.info(f"model {cfg.model.flavor}: {n_params:,} parameters, world {world_size} = "
                f"dp_replicate {p.data_parallel_replicate_degree} x dp_shard {sizes['dp_shard']} x "
                f"tp {p.tensor_parallel_degree}, grad accumulation {sizes['grad_accum']}")
    estimate = estimate_memory(model, cfg, sizes, cuda=device.type == "cuda")
    logger.info(format_estimate(estimate))

    # --- parallelize, then materialise this rank's shards -----------------------------------------------
    parallelize(model, mesh, cfg, device.type)
    model.to_empty(device=device)
    model.init_weights(normal_=layout_independent_normal(cfg.training.seed), buffer_device=device)
    model.train()

    # --- optimizer and lr schedule ----------------------------------------------------------------------
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=device.type == "cuda" or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))

    # --- data: each dp rank reads its own streams; TP ranks of a replica read the same ones -------------
    loader = DataLoader(cfg.data.sources, tokenizer, cfg.training.seq_len, cfg.training.local_batch_size,
                        dp_rank, dp, cfg.data.num_streams, cfg.data.seed, cfg.data.num_workers)

    # --- checkpoint: resume from the newest complete step-N, or start from initial_load_path -----------
    ckpt = cfg.checkpoint
    ckpt_folder = os.path.join(cfg.job.dump_folder, ckpt.folder)
    step, tokens_seen = 0, 0
    sd_options = StateDictOptions(flatten_optimizer_state_dict=True)
    # Keys that change the math or the data order: a resume with other values is refused. The DP degree
    # is not among them: a run may resume on more or fewer GPUs as long as num_streams stays the same.
    run_keys = {"model.flavor": cfg.model.flavor, "training.seq_len": cfg.training.seq_len,
                "training.global_batch_size": sizes["global_batch_size"], "data.seed": cfg.data.seed,
                "data.num_streams": cfg.data.num_streams or dp,
                "data.sources": [dataclasses.asdict(s) for s in cfg.data.sources],
                # Only a real change of depth: runs without the key (older ones too) compare as before.
                **({"model.n_layers": model_args.n_layers} if model_args.n_layers != flavors[cfg.model.flavor].n_layers
                   else {})}

    def train_state(model_only=False):
        """Everything a resume needs, as tensors only: DCP then never unpickles anything on load."""
        state = {"model": get_model_state_dict(model), "train": {"step": torch.tensor(step)}}
        if model_only:  # the export at the end of training
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[ckpt.export_dtype]
            return {**state, "model": {k: v.to(dtype) for k, v in state["model"].items()}}
        opt_sd = get_optimizer_state_dict(model, optimizer, options=sd_options)
        # param_groups (lr, betas) come from the config and the scheduler, not the checkpoint
        state["optimizer"] = {k: v for k, v in opt_sd.items() if k.startswith("state.")}
        state["train"].update(tokens_seen=torch.tensor(tokens_seen), config=json_tensor(run_keys),
                              lr_scheduler=json_tensor(scheduler.state_dict()))
        state["data"] = {f"stream{s}": json_tensor(sd) for s, sd in loader.state_dict().items()}
        state["rng"] = {f"rank{dist.get_rank()}": torch.get_rng_state()}
        return state

    def load(path: str, model_only: bool):
        meta = read_checkpoint_metadata(path, model)
        if model_only:
            state = {"model": get_model_state_dict(model)}
        else:
            if not any(k.startswith("optimizer.") for k in meta):
                raise ConfigError(f"{path} holds only model weights (a last_save_model_only export); start "
                                  "from it with checkpoint.initial_load_path in a new dump_folder")
            state = train_state()
            for key in meta:  # JSON blobs: allocate the size they were saved with
                section, _, name = key.partition(".")
                if meta[key].properties.dtype == torch.uint8 and section in ("train", "data"):
                    state[section][name] = torch.empty(meta[key].size, dtype=torch.uint8)
            if f"rng.rank{dist.get_rank()}" not in meta:  # resuming on more ranks than before
                del state["rng"]
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        if model_only:
            return 0, 0
        saved = json_from(state["train"]["config"])
        diff = [f"{k}: {saved.get(k)!r} -> {run_keys.get(k)!r}" for k in {**saved, **run_keys}
                if saved.get(k) != run_keys.get(k)]
        if diff:
            raise ConfigError(f"refusing to resume from {path}: the run changed {'; '.join(diff)} (use a new "
                              "dump_folder, or take only the weights with checkpoint.initial_load_path)")
        opt_sd = get_optimizer_state_dict(model, optimizer, options=sd_options)
        opt_sd.update(state["optimizer"])
        set_optimizer_state_dict(model, optimizer, opt_sd, options=sd_options)
        scheduler.load_state_dict(json_from(state["train"]["lr_scheduler"]))
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr  # load_state_dict restores the scheduler, not the lr it last set
        loader.load_state_dict({s: json_from(state["data"][f"stream{s}"]) for s in loader.stream_ids})
        if "rng" in state:
            torch.set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
        return int(state["train"]["step"]), int(state["train"]["tokens_seen"])

    done = checkpoints(ckpt_folder) if ckpt.enable else []
    load_step = ckpt.load_step if ckpt.load_step >= 0 else (done[-1] if done else None)
    if load_step is not None and load_step not in done:
        raise ConfigError(f"checkpoint.load_step = {load_step}: no complete checkpoint {ckpt_folder}/"
                          f"step-{load_step} (have {done})")
    if load_step is not None:
        path = os.path.join(ckpt_folder, f"step-{load_step}")
        if load_step >= cfg.training.steps and "train.tokens_seen" not in read_checkpoint_metadata(path, model):
            step = load_step  # the loop below has nothing left to do
            logger.info(f"{path} is the final export of a finished run: nothing to do")
        else:
            step, tokens_seen = load(path, model_only=False)
            logger.info(f"resumed from {path} at step {step}")
    elif ckpt.initial_load_path:
        step, tokens_seen = load(ckpt.initial_load_path, model_only=ckpt.initial_load_model_only)
        logger.info(f"loaded {'weights' if ckpt.initial_load_model_only else 'state'} from "
                    f"{ckpt.initial_load_path}, starting at step {step}")
    # Async saves stage the state in CPU memory, then write from a background thread on their own gloo
    # group so they never share a communicator with training's collectives.
    ckpt_group = dist.new_group(backend="gloo") if ckpt.enable and ckpt.async_mode == "async" else None
    pending = None  # (future, step) of an async save whose folder is not renamed into place yet
    params_json = dataclasses.asdict(model_args)  # written next to each checkpoint

    def save_failed(failed_step: int, e: BaseException, final: bool = False):
        """The previous checkpoint is untouched; training goes on and the next interval tries again,
        unless this was the save a stop depends on."""
        if rank == 0:
            shutil.rmtree(os.path.join(ckpt_folder, f".step-{failed_step}.tmp"), ignore_errors=True)
        if isinstance(e, CheckpointException):  # DCP gathers (error, traceback) per rank: show the first
            e = next(iter(e.failures.values()), (e,))[0]
        done = checkpoints(ckpt_folder)
        msg = (f"checkpoint step-{failed_step} failed ({type(e).__name__}: {str(e)[:300]}); the newest "
               f"complete checkpoint is still {os.path.join(ckpt_folder, f'step-{done[-1]}') if done else 'none'}")
        if final:
            raise RunError(msg)
        logger.error(msg)

    def finish_async_save():
        nonlocal pending
        try:
            pending[0].result()
            commit_save(ckpt_folder, pending[1], params_json, ckpt.keep_latest_k, rank)
            logger.info(f"saved checkpoint {ckpt_folder}/step-{pending[1]} (async)")
        except (CheckpointException, OSError) as e:
            save_failed(pending[1], e)
        pending = None

    # --- training loop ------------------------------------------------------------------------------------
    metrics_file = open(os.path.join(cfg.job.dump_folder, "metrics.jsonl"), "a") if rank == 0 else None
    tb = None
    if cfg.metrics.enable_tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(os.path.join(cfg.job.dump_folder, "tb"))
    peak = peak_tflops(cfg, device)
    tokens_per_step = sizes["global_batch_size"] * cfg.training.seq_len
    grad_accum = sizes["grad_accum"]
    params = [q for q in model.parameters() if q.requires_grad]
    log_t0, log_tokens, log_steps, data_time = time.perf_counter(), 0, 0, 0.0
    memory_stats(device)  # reset the GPU peak so the first log covers training only
    peak_gib, peak_allocated_gib = 0.0, 0.0  # the largest figures logged, compared with the estimate at the end
    # Fixed-length loss accumulator on the device: no host sync per step except at log time.
    loss_sum = torch.zeros((), device=device)

    while step < cfg.training.steps:
        step += 1
        optimizer.zero_grad(set_to_none=True)
        for _ in range(grad_accum):
            t0 = time.perf_counter()
            inputs, labels = next(loader)
            data_time += time.perf_counter() - t0
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with loss_parallel() if p.tensor_parallel_degree > 1 else contextlib.nullcontext():
                logits = model(inputs)  # (local_batch_size, seq_len, vocab_size), vocab-sharded under TP
                # Every position is a real token (packed data), so the mean per micro-batch divided by the
                # number of micro-batches is the mean over the global batch once FSDP averages over dp.
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / grad_accum
                del logits
                loss.backward()
            loss_sum += loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()  # replicated
        max_norm = cfg.training.max_norm if cfg.training.max_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()

        # Every rank must agree at the same step to stop, that an async save is complete, and that the
        # step is finite, or the saves below would deadlock: one tiny all-reduce, and one host sync, per
        # step. It comes before optimizer.step() so that a non-finite step never reaches the weights.
        flags = torch.stack([torch.tensor(stop["signal"] is not None, device=device),
                             torch.tensor(pending is not None and not pending[0].done(), device=device),
                             ~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)]).int()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stopping, save_running, diverged = flags.tolist()
        if diverged:
            done = checkpoints(ckpt_folder)
            raise RunError(f"step {step}: the loss or the gradient norm is not finite (grad_norm "
                                f"{grad_norm.item():.4g}); nothing was saved from this step. Last good checkpoint: "
                                f"{os.path.join(ckpt_folder, f'step-{done[-1]}') if done else 'none'}")
        lr = scheduler.get_last_lr()[0]  # the lr this step used
        optimizer.step()
        scheduler.step()
        tokens_seen += tokens_per_step
        log_tokens += tokens_per_step
        log_steps += 1

        if step % cfg.metrics.log_freq == 0 or step == 1 or step == cfg.training.steps:
            loss_avg = loss_sum.clone()
            dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM, group=dp_mesh.get_group())
            source = torch.tensor(list(loader.source_tokens().values()), dtype=torch.float64, device=device)
            dist.all_reduce(source, group=dp_mesh.get_group())
            dt = time.perf_counter() - log_t0
            tps = log_tokens / dt / world_size
            tflops = flops_per_token * tps / 1e12
            mem_gib, mem_pct, allocated_gib = memory_stats(device)
            peak_gib, peak_allocated_gib = max(peak_gib, mem_gib), max(peak_allocated_gib, allocated_gib or 0.0)
            record = {"step": step, "loss": loss_avg.item() / dp / log_steps,
                      "grad_norm": grad_norm.item(), "lr": lr, "memory_gib": mem_gib, "memory_pct": mem_pct,
                      "memory_allocated_gib": allocated_gib,
                      "tps": tps, "tflops": tflops, "mfu": 100 * tflops / peak if peak else None,
                      "data_wait_pct": 100 * data_time / dt, "tokens_seen": tokens_seen,
                      "source_tokens": dict(zip(loader.names, [int(x) for x in source.tolist()]))}
            mfu = f"{record['mfu']:.1f}%" if peak else "n/a"
            logger.info(f"step: {step}  loss: {record['loss']:.4f}  grad_norm: {record['grad_norm']:.4f}  "
                        f"lr: {lr:.1e}  memory: {mem_gib:.2f}GiB({mem_pct:.1f}%)  tps: {tps:,.0f}  "
                        f"tflops: {tflops:.1f}  mfu: {mfu}  data_wait: {record['data_wait_pct']:.1f}%")
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if tb:
                for k in ("loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu"):
                    if record[k] is not None:
                        tb.add_scalar(k, record[k], step)
            loss_sum.zero_()
            log_t0, log_tokens, log_steps, data_time = time.perf_counter(), 0, 0, 0.0

        if pending is not None and not save_running:
            finish_async_save()
        last = step == cfg.training.steps
        if ckpt.enable and (step % ckpt.interval == 0 or last or stopping):
            if pending is not None:  # at most one save in flight
                finish_async_save()
            t0 = time.perf_counter()
            tmp = begin_save(ckpt_folder, step, rank)
            state = train_state(model_only=last and ckpt.last_save_model_only)
            try:
                if ckpt_group is not None and not (last or stopping):
                    pending = (dcp.async_save(state, checkpoint_id=tmp, process_group=ckpt_group), step)
                    logger.info(f"checkpoint step-{step}: training blocked {time.perf_counter() - t0:.2f}s (async)")
                else:
                    dcp.save(state, checkpoint_id=tmp)
                    commit_save(ckpt_folder, step, params_json, ckpt.keep_latest_k, rank)
                    logger.info(f"saved checkpoint {ckpt_folder}/step-{step}: training blocked "
                                f"{time.perf_counter() - t0:.2f}s")
            except (CheckpointException, OSError) as e:  # disk full, quota, permissions: DCP raises on every rank
                save_failed(step, e, final=last or stopping)
        if stopping:
            logger.info(f"stopping at step {step} on signal")
            break

    if peak_gib:  # the estimate counts tensors: on GPU it compares with the allocated peak, on CPU with RSS
        measured = peak_allocated_gib or peak_gib
        what = f"{peak_allocated_gib:.2f} GiB allocated, {peak_gib:.2f} GiB reserved" if peak_allocated_gib else \
            f"{peak_gib:.2f} GiB RSS"
        logger.info(f"memory: peak {what}; start-up estimate {estimate['total'] / 2**30:.2f} GiB "
                    f"({100 * (estimate['total'] / 2**30 / measured - 1):+.0f}%)")
    # A second preemption signal during shutdown must not kill a rank that already saved (Python would
    # restore the default, fatal, handler while exiting): ignore them from here on.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    loader.close()
    if metrics_file:
        metrics_file.close()
    if tb:
        tb.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print_help()
        sys.exit(0)
    try:
        config = load_config(sys.argv[1:])
        main(config)
        # FSDP's state outlives main() in reference cycles, holding process groups and collective handles.
        # Free it now, not during interpreter shutdown, where freeing them can abort the process (gloo's
        # threads touching Python objects that are being torn down).
        gc.collect()
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
