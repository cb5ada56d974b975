r"""Train Llama 3 with FSDP2 (+ optional tensor parallelism): one CPU process to thousands of GPUs.

    python train.py --config configs/debug_model.toml                          # 1 process (CPU ok)
    torchrun --standalone --nproc_per_node 2 train.py --config configs/debug_model.toml
    torchrun --nproc_per_node 8 train.py --config configs/llama3_8b.toml --training.steps 100
    torchrun --nproc_per_node 8 train.py \
        --config configs/llama3_8b.toml --parallelism.tensor_parallel_degree 2
    sbatch --nodes 4 slurm/multinode.sbatch                                     # see README
    python train.py --help                                                      # every config key

Config precedence: --section.key value on the command line > the TOML file > the defaults below.
One flat main(cfg), top to bottom: config, mesh, model, parallelize, optimizer, data, checkpoint,
loop. What the files beside it do: the README's table.
"""

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import SequenceParallel, loss_parallel, parallelize_module

from data import DataLoader, Tokenizer
from model import Transformer, flavors
from pretrain import config
from pretrain import evals
from pretrain import float8
from pretrain import optimizers
from pretrain import phases
from pretrain import spikes
from pretrain import startup
from pretrain.agreement import StepAgreement
from pretrain.checkpoint import Checkpointer
from pretrain.resume_keys import run_keys
from pretrain.checkpoint_folder import SaveError
from pretrain.config import AT_LEAST_1, MINUS_1_OR_AT_LEAST_1, NON_NEGATIVE, POSITIVE
from pretrain.config import ConfigError, one_of, unknown
from pretrain.data_manifest import manifest_sha256, source_sha256s
from pretrain.distributed import ignore_stop_signals, init_distributed, stop_on_signals
from pretrain.faults import FAULT, RUN, USER, CheckpointError, Fault, is_fault, lost_rank
from pretrain.float8 import Float8
from pretrain.layout import layout_independent_normal, replicate_unplanned
from pretrain.loss import chunked_loss, cross_entropy_and_z, ignore_boundaries
from pretrain.metrics import LogSums, MetricsLogger, Throughput, flops_per_token
from pretrain.muon import Muon, MuonAdamW, is_matrix
from pretrain.phases import Phase
from pretrain.progress import RunClock
from pretrain.sources import DataError, DataSource
from pretrain.spikes import RunError, SpikeGuard, Spikes

logger = logging.getLogger("train")
LEFT_OPEN = []  # main()'s checkpoint saver and metrics logger: an error exit closes them first


# -------------------------------------------------------------------------------------------------
# Config: each field is `name: type = default  # one-line doc` (the doc is what --help prints;
# pretrain/config.py reads it, or a comment line just above a field whose doc is long)
# -------------------------------------------------------------------------------------------------

@dataclass
class Job:
    dump_folder: str = "./outputs"  # where logs, metrics.jsonl, config.toml and checkpoints go
    description: str = ""  # free text, printed at start
    print_config: bool = False  # also print the resolved config (always written to dump_folder/config.toml)


@dataclass
class Model:
    flavor: str = "debugmodel"  # debugmodel, 1B, 3B, 8B, 70B or 405B (see model.py)
    n_layers: int = 0  # 0: the flavor's; N: the flavor's width with N blocks (e.g. an 8B-wide model on one GPU)
    tokenizer_path: str = "assets/tokenizer/tokenizer.model"  # Llama 3 tokenizer.model (tiktoken); sets vocab_size
    vocab_size: int = 0  # 0: the tokenizer's; N above it: the output padded to N rows, never a target (bench.py's Llama 3 step without Meta's tokenizer)
    attn_mask_type: str = "causal"  # causal, or block_causal: attention stays inside each document (Llama 3's recipe)
    converters: list = field(default_factory=list)  # ["float8"]: the blocks' Linear layers train in float8 (torchao; H100+; [float8])
    RULES: ClassVar[dict] = {"n_layers": NON_NEGATIVE, "vocab_size": NON_NEGATIVE,
                             "attn_mask_type": one_of("causal", "block_causal"),
                             "converters": (lambda x: set(x) <= {"float8"}, '[] or ["float8"]')}


@dataclass
class LRScheduler:
    warmup_steps: int = 200  # linear warmup from ~0 to lr
    decay_ratio: float = -1.0  # WSD: fraction of steps spent decaying at the end; -1 decays after warmup
    decay_type: str = "linear"  # linear, cosine or sqrt
    min_lr_factor: float = 0.0  # the lr of the last step is lr * min_lr_factor
    unit: str = "steps"  # steps, or tokens: the decay is placed by tokens (a batch ramp in [[phases]] leaves it there)
    RULES: ClassVar[dict] = {"warmup_steps": NON_NEGATIVE,
                             "decay_ratio": (lambda x: x == -1 or 0 < x <= 1, "-1 or in (0, 1]"),
                             "decay_type": one_of("linear", "cosine", "sqrt"),
                             "min_lr_factor": (lambda x: 0 <= x <= 1, "in [0, 1]"),
                             "unit": one_of("steps", "tokens")}


@dataclass
class Training:
    local_batch_size: int = 8  # sequences per data-parallel rank per micro-step
    global_batch_size: int = -1  # sequences per optimizer step; a multiple of local * dp ranks adds accumulation; -1: local * dp
    seq_len: int = 2048  # tokens per sequence
    max_norm: float = 1.0  # gradient clipping by total norm (0 turns it off)
    z_loss: float = 0.0  # PaLM's z-loss: this x logsumexp(logits)^2 joins each position's loss (1e-4 is usual); 0: off
    steps: int = 10000  # optimizer steps to train
    seed: int = 0  # seeds the weight init: the same seed gives the same weights on any parallel layout
    deterministic: bool = False  # torch.use_deterministic_algorithms (slower on GPU)
    mixed_precision_param: str = "bfloat16"  # parameter/compute dtype under FSDP (float32 or bfloat16)
    mixed_precision_reduce: str = "float32"  # gradient reduce-scatter dtype
    RULES: ClassVar[dict] = {"local_batch_size": AT_LEAST_1, "global_batch_size": MINUS_1_OR_AT_LEAST_1,
                             "seq_len": AT_LEAST_1, "max_norm": NON_NEGATIVE, "z_loss": NON_NEGATIVE,
                             "steps": AT_LEAST_1, "mixed_precision_param": one_of("bfloat16", "float32"),
                             "mixed_precision_reduce": one_of("bfloat16", "float32")}


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # HSDP replicas (each holds a full sharded copy)
    data_parallel_shard_degree: int = -1  # FSDP shards; -1: whatever is left of the world size
    tensor_parallel_degree: int = 1  # DTensor tensor parallel (shards heads and FFN); within a node
    RULES: ClassVar[dict] = {"data_parallel_replicate_degree": AT_LEAST_1,
                             "data_parallel_shard_degree": MINUS_1_OR_AT_LEAST_1,
                             "tensor_parallel_degree": AT_LEAST_1}


@dataclass
class Checkpoint:
    enable: bool = False  # save DCP checkpoints and resume from the newest complete one
    folder: str = "checkpoint"  # under dump_folder; holds step-N/ folders
    interval: int = 500  # save every this many steps (and at the last step)
    keep_latest_k: int = 0  # delete older checkpoints, keeping this many; 0 keeps all
    async_mode: str = "disabled"  # disabled, or async: write in a background thread while training goes on
    last_save_model_only: bool = False  # the final checkpoint holds only the model weights, for export
    export_dtype: str = "float32"  # dtype of that model-only checkpoint: float32 or bfloat16
    load_step: int = -1  # resume from step-N instead of the newest; -1: newest
    initial_load_path: str = ""  # with nothing to resume: start from this DCP folder (checkpoint_convert.py output or a step-N)
    initial_load_model_only: bool = True  # from initial_load_path take only the weights (fresh optimizer, step 0)
    save_timeout_seconds: int = 1800  # a save may take this long (every rank's write and DCP's collectives); then it fails
    RULES: ClassVar[dict] = {"interval": AT_LEAST_1, "keep_latest_k": NON_NEGATIVE,
                             "async_mode": one_of("disabled", "async"),
                             "export_dtype": one_of("float32", "bfloat16"),
                             "load_step": (lambda x: x >= -1, "-1 or >= 0"),
                             "save_timeout_seconds": AT_LEAST_1}


@dataclass
class ActivationCheckpoint:
    mode: str = "selective"  # none, full or selective
    selective_ac_option: str = "op"  # op: keep matmul/attention outputs, recompute the rest; N: full AC every Nth block
    RULES: ClassVar[dict] = {"mode": one_of("none", "full", "selective"),
                             "selective_ac_option": (lambda x: x == "op" or (x.isdigit() and int(x) > 0),
                                                     "'op' or a positive integer")}


@dataclass
class Compile:
    enable: bool = False  # torch.compile each TransformerBlock


@dataclass
class Metrics:
    log_freq: int = 10  # log every this many steps
    enable_tensorboard: bool = False  # also write TensorBoard events to dump_folder/tb
    enable_wandb: bool = False  # also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works without network)
    wandb_project: str = ""  # W&B project; empty: $WANDB_PROJECT, else "llama3-pretrain"
    wandb_run_name: str = ""  # W&B run name; empty: $WANDB_RUN_NAME, else the dump folder's name
    peak_tflops: float = 0.0  # peak TFLOP/s per device for MFU; 0: look up the GPU (CPU prints n/a)
    RULES: ClassVar[dict] = {"log_freq": AT_LEAST_1, "peak_tflops": NON_NEGATIVE}


@dataclass
class Comm:
    init_timeout_seconds: int = 300  # a collective (or the set-up) waiting longer than this fails the run
    RULES: ClassVar[dict] = {"init_timeout_seconds": AT_LEAST_1}


@dataclass
class Data:
    seed: int = 1234  # seeds the file order of every source (a new order each epoch)
    num_streams: int = 0  # logical data streams (a multiple of the DP degree); 0: the DP degree
    num_workers: int = 0  # loader processes per rank that read and tokenize ahead; 0: in the training process
    manifest: str = ""  # from `download_data.py --manifest PATH`; empty: dump_folder/data_manifest.json, made at the first start
    mirror: str = ""  # a folder from `download_data.py --to DIR`: the pinned Hub files it holds are read there, checked
    hub_timeout_seconds: float = 60.0  # a Hub read that gets no byte for this long is retried from where it was
    resolve_timeout_seconds: int = 1800  # the other ranks wait this long for rank 0 to resolve the sources (first start)
    # [[data.sources]] tables: name, path, config, data_files, split, revision, text_column, weight
    sources: list[DataSource] = field(default_factory=list)
    RULES: ClassVar[dict] = {"num_streams": NON_NEGATIVE, "num_workers": NON_NEGATIVE,
                             "hub_timeout_seconds": POSITIVE, "resolve_timeout_seconds": AT_LEAST_1}


@dataclass
class Validation:
    enable: bool = False  # evaluate held-out loss every freq steps and at the last step
    freq: int = 500  # steps between rounds
    sequences: int = 64  # held-out windows per source: its first N, the same set on every layout and resume; -1: all
    local_batch_size: int = 8  # sequences per data-parallel rank per batch
    sources: list[DataSource] = field(default_factory=list)  # [[validation.sources]]: keys as in [[data.sources]] (weight unused)
    # A key that was renamed: its error names the successor.
    RENAMED: ClassVar[dict] = {
        "steps": "sequences = N, the first N windows of each source on every layout "
                 "(steps x local_batch_size x data-parallel ranks gives the old set)"}
    RULES: ClassVar[dict] = {"freq": AT_LEAST_1, "sequences": MINUS_1_OR_AT_LEAST_1,
                             "local_batch_size": AT_LEAST_1}


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: optimizers.Optimizer = field(default_factory=optimizers.Optimizer)  # pretrain/optimizers.py
    muon: Muon = field(default_factory=Muon)  # pretrain/muon.py: Muon's keys (optimizer.name = "Muon")
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)  # pretrain/float8.py: the section and its rules
    spikes: Spikes = field(default_factory=Spikes)  # pretrain/spikes.py: skipped steps, rewinds
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    eval: evals.Eval = field(default_factory=evals.Eval)  # pretrain/evals.py: the section, its rules
    # the batch, sequence and mixture from a step on, and an anneal (pretrain/phases.py; docs/data.md)
    phases: list[Phase] = field(default_factory=list)


def load_config(argv) -> Config:
    """Defaults, then the TOML file (--config), then --section.key overrides (pretrain/config.py)."""
    return config.load(Config, argv, __doc__)


def flavor_args(cfg: Config, vocab_size: int = 0, bos_id=None):
    """The flavor's ModelArgs with [model]'s settings, the tokenizer's vocab and BOS if given."""
    args = flavors[cfg.model.flavor]
    n_layers = cfg.model.n_layers or args.n_layers  # 0: the flavor's
    vocab_size = vocab_size or args.vocab_size  # 0: the flavor's
    return dataclasses.replace(args, n_layers=n_layers, bos_id=bos_id, vocab_size=vocab_size,
                               attn_mask_type=cfg.model.attn_mask_type)


LLAMA3_BOS = 128000  # Meta's <|begin_of_text|>: model_args' BOS when the tokenizer file is absent


def model_args(cfg: Config, tokenizer=None):
    """The model this config trains: the flavor's shapes with the tokenizer's vocabulary and BOS
    (train.py's rule). Programs that plan or measure a run (bench.py, the dry run, preflight) build
    theirs here too, so they count the run's vocabulary; without the tokenizer file, Llama 3's."""
    if tokenizer is None and os.path.exists(cfg.model.tokenizer_path):
        tokenizer = Tokenizer(cfg.model.tokenizer_path)
    if tokenizer is None:
        return flavor_args(cfg, cfg.model.vocab_size, bos_id=LLAMA3_BOS)
    if 0 < cfg.model.vocab_size < tokenizer.n_words:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is below the {tokenizer.n_words:,} "
                          f"words of {cfg.model.tokenizer_path}: 0 takes the tokenizer's")
    return flavor_args(cfg, max(cfg.model.vocab_size, tokenizer.n_words), tokenizer.bos_id)


def validate(cfg: Config, world_size: int, gpu: bool | None = None) -> dict:
    """Reject configs that cannot work, before a process group or model exists; return the sizes.
    gpu: whether the job's GPUs are H100-class (True: a job modelled elsewhere, float8.check's rule);
    None: this machine runs it, and is asked."""
    t = cfg.training
    p = cfg.parallelism
    v = cfg.validation
    if cfg.model.flavor not in flavors:
        raise unknown("model.flavor", cfg.model.flavor, flavors)
    config.check_rules(cfg)  # each section's RULES, beside its fields
    optimizers.check(cfg.optimizer)
    float8.check(cfg.float8, cfg.model.converters, cfg.training, gpu)
    evals.check(cfg.eval)
    spikes.check(cfg.spikes, checkpoints=cfg.checkpoint.enable)
    # model_args checks model.vocab_size against the tokenizer's
    args = model_args(cfg) if cfg.model.vocab_size else flavor_args(cfg)
    if t.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {t.seq_len} exceeds the {cfg.model.flavor} model's "
                          f"max_seq_len {args.max_seq_len}")
    tp = p.tensor_parallel_degree
    rep = p.data_parallel_replicate_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:  # whatever is left of the world size
        shard = world_size // (tp * rep)
    if shard < 1 or rep * shard * tp != world_size:
        raise ConfigError(f"parallelism: data_parallel_replicate_degree {rep} "
                          f"x data_parallel_shard_degree {p.data_parallel_shard_degree} "
                          f"x tensor_parallel_degree {tp} must equal the world size {world_size}")
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree = {tp} must divide "
                          f"the {cfg.model.flavor} model's n_heads {args.n_heads} "
                          f"and n_kv_heads {args.n_kv_heads}")
    if tp > 1 and t.seq_len % tp:
        raise ConfigError(f"training.seq_len = {t.seq_len} must be divisible by "
                          f"tensor_parallel_degree {tp} (sequence parallelism splits it)")
    dp = rep * shard
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
    if gbs % (t.local_batch_size * dp):
        raise ConfigError(f"training.global_batch_size = {gbs} must be a multiple of "
                          f"local_batch_size {t.local_batch_size} x data-parallel degree {dp}")
    if v.enable and not v.sources:
        raise ConfigError("validation.enable is set but validation.sources is empty; "
                          "add [[validation.sources]] tables")
    # One Hub read's wait (hub_timeout_seconds) must fit in the other ranks' wait in a collective
    in_use = cfg.data.sources + (v.sources if v.enable else []) + evals.sources(cfg.eval)
    hub = [s.name for s in in_use if not os.path.isdir(s.path)]  # not a local folder: a Hub id
    if hub and not cfg.data.hub_timeout_seconds < cfg.comm.init_timeout_seconds:
        raise ConfigError(f"data.hub_timeout_seconds = {cfg.data.hub_timeout_seconds:g} "
                          f"must be below comm.init_timeout_seconds = "
                          f"{cfg.comm.init_timeout_seconds} (source {hub[0]!r} is on the Hub): "
                          "one read that waits that long outlasts the other ranks' wait "
                          "in a collective")
    streams = cfg.data.num_streams or dp
    # A step takes gbs / streams sequences from every stream, whichever rank holds it, so the
    # micro-batches may split the batch any way.
    if streams % dp or gbs % streams:
        raise ConfigError(f"data.num_streams = {streams} must be a multiple of the data-parallel "
                          f"degree {dp} and divide training.global_batch_size {gbs} (a step takes "
                          "as many sequences from every stream)")
    grad_accum = gbs // (t.local_batch_size * dp)  # micro-batches per optimizer step
    plan = phases.plan(cfg.phases, training=t, sources=cfg.data.sources, dp=dp, streams=streams, tp=tp,
                       max_seq_len=args.max_seq_len, global_batch_size=gbs)
    for stage in plan.stages[1:]:  # float8's rule on the tokens of a micro-batch, each phase's
        try:
            float8.check(cfg.float8, cfg.model.converters, dataclasses.replace(t, seq_len=stage.seq_len), gpu)
        except ConfigError as e:
            raise ConfigError(f"phases: phase {stage.index}: {e}")
    # steps between rounds (RunClock's ETA counts the rounds still due), 0: none
    rounds = {"validation": v.freq if v.enable else 0, "eval": cfg.eval.freq if cfg.eval.enable else 0,
              "checkpoint": cfg.checkpoint.interval if cfg.checkpoint.enable else 0}
    return {"dp_shard": shard, "dp": dp, "tp": tp, "global_batch_size": gbs, "grad_accum": grad_accum,
            "num_streams": streams, "tokens_per_step": gbs * t.seq_len, "rounds": rounds, "phases": plan}


def resume_keys(cfg: Config, args, sizes: dict, manifest: dict) -> dict:
    """What a resume must keep (pretrain/resume_keys.py's run_keys): the config's resume keys, and
    the values its layout chose, so that a run may resume on more or fewer GPUs with the same
    global batch and streams."""
    chosen = {"model.n_layers": args.n_layers, "training.global_batch_size": sizes["global_batch_size"],
              "data.num_streams": sizes["num_streams"], "phases": sizes["phases"].keys(),
              "data.sources_sha256": manifest_sha256(manifest, cfg.data.sources),
              "data.source_sha256s": source_sha256s(manifest, cfg.data.sources)}
    return run_keys(dataclasses.asdict(cfg), cfg.model.tokenizer_path, chosen)


def run_summary(cfg: Config, model: Transformer, world_size: int, sizes: dict) -> str:
    """The start-up log line: the model, its size and vocabulary, the layout, the config's file."""
    p = cfg.parallelism
    description = cfg.job.description + ": " if cfg.job.description else ""
    precision = cfg.training.mixed_precision_param
    autocast = " autocast" if precision != "float32" else ""  # apply_autocast's rule
    path = f"FSDP2 in {precision}" if sizes["dp"] > 1 else f"no FSDP (one dp rank), {precision}{autocast}"
    return (f"{description}model {cfg.model.flavor} "
            f"({model.num_params():,} parameters, vocab {model.args.vocab_size:,}), "
            f"world {world_size} = dp_replicate {p.data_parallel_replicate_degree} "
            f"x dp_shard {sizes['dp_shard']} x tp {p.tensor_parallel_degree}, {path}, "
            f"grad accumulation {sizes['grad_accum']}; "
            f"config in {os.path.join(cfg.job.dump_folder, 'config.toml')}")


# -------------------------------------------------------------------------------------------------
# Parallelism: TP plan, activation checkpointing, compile, FSDP2, and a layout-independent init
# -------------------------------------------------------------------------------------------------

def parallelize(model: Transformer, mesh, cfg: Config):
    """torchtitan's order: tensor parallel, activation checkpointing, compile, then FSDP2 (which
    must wrap the modules the steps before produced), or autocast where one data-parallel rank has
    nothing to shard. Each step takes only what it needs."""
    ac = cfg.activation_checkpoint
    if mesh["tp"].size() > 1:
        styles = float8.tp_styles(model, mesh.device_type, cfg.float8.recipe_name)
        apply_tp(model, mesh["tp"], styles)
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if cfg.compile.enable:  # a graph for each phase's batch, the held-out windows and each eval task's width
        apply_compile(model, shapes=1 + len(cfg.phases) + 1 + len(cfg.eval.tasks))
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    param_dtype = dtypes[cfg.training.mixed_precision_param]
    reduce_dtype = dtypes[cfg.training.mixed_precision_reduce]
    if mesh["dp_replicate"].size() * mesh["dp_shard"].size() == 1:
        return apply_autocast(model, mesh.device_type, param_dtype)
    hsdp = mesh["dp_replicate"].size() > 1  # HSDP: shard within dp_shard, replicate across groups
    dp_mesh = mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"]
    apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype)


def apply_tp(model: Transformer, tp_mesh, float8_styles=None):
    """The tensor-parallel plan, keyed by Meta's weight names, with sequence parallel between
    blocks: activations are sharded on seq (Shard(1)) for norms and residual adds, gathered before
    attention and the FFN, reduce-scattered after wo and w2. float8_styles: float8.tp_styles'."""
    col, row, prepare = float8_styles or (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Logits stay sharded on the vocab (loss parallel): no rank holds (tokens x vocab) whole. Its
        # input arrives replicated (below), so the loss can take it a chunk of positions at a time.
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                  use_local_output=False),
    }
    block_plan = {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis, mask): the mask (None, or one for the whole sequence) stays as it is
        "attention": prepare(input_layouts=(Shard(1), None, None),
                             desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": col(),
        "attention.wk": col(),
        "attention.wv": col(),
        "attention.wo": row(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": col(),
        "feed_forward.w2": row(output_layouts=Shard(1)),
        "feed_forward.w3": col(),
    }
    parallelize_module(model, tp_mesh, root_plan)
    gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                 use_local_output=False)  # the final norm's output, whole
    parallelize_module(model.norm, tp_mesh, gather)
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
    replicate_unplanned(model, tp_mesh)


# Selective AC keeps these ops' outputs (costly to recompute), recomputes the cheap elementwise rest
AC_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.max.default,  # float8's amaxes (torchtitan keeps them): recomputing costs a pass
    torch.ops.aten._scaled_mm.default,  # float8 matmuls on a GPU
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,  # block_causal on CUDA
}


def apply_ac(model: Transformer, mode: str, selective_ac_option: str):
    """Activation checkpointing per block: "full", or "selective" with option "op" (keep AC_SAVE's
    outputs) or N (full AC on every Nth block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in AC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    for i, block in enumerate(model.layers):
        if mode == "selective" and selective_ac_option == "op":
            context_fn = partial(create_selective_checkpoint_contexts, policy)
            model.layers[i] = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        elif mode == "full" or i % int(selective_ac_option) == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer, shapes: int):
    """torch.compile each block (alike: one graph serves them all), static shapes: by default a second size (a
    phase's) turns dynamic, and a resume past it would compile a static graph, whose reductions a GPU may sum in
    another order. A fullgraph compile raises past dynamo's limit of graphs (8 by default): room for `shapes`."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes)
    for block in model.layers:
        block.compile(fullgraph=True, dynamic=False)  # in place, so parameter names stay Meta's


def apply_fsdp(model: Transformer, dp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
    """FSDP2 per block, then the root (embeddings, final norm, output)."""
    scalar = next((n for n, q in model.named_parameters() if q.ndim == 0), None)
    if scalar:  # fully_shard splits dim 0
        raise ConfigError(f"parameter {scalar} has shape (): FSDP2 cannot shard a scalar; "
                          "give it shape (1,)")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again right away by backward: don't free them.
        last = i == len(model.layers) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def apply_autocast(model: Transformer, device_type: str, param_dtype: torch.dtype):
    """One data-parallel rank (one GPU, or TP alone): FSDP would only cast every weight to bf16 twice
    a step and copy the gradients. Instead the forward runs under torch.autocast at param_dtype over
    fp32 weights, as torchtitan does: the model's, and its output layer's, which the loss calls a
    chunk at a time (pretrain/loss.py). Backward runs outside it, as autocast asks."""
    if param_dtype != torch.float32:
        for module in (model, model.output):
            module.forward = torch.autocast(device_type, dtype=param_dtype)(module.forward)


# -------------------------------------------------------------------------------------------------
# Optimizer, lr schedule, the data loader, the loss (validation and evals: pretrain/evals.py;
# where the numbers go: pretrain/metrics.py)
# -------------------------------------------------------------------------------------------------

def build_optimizer(model, cfg: Config, device: torch.device, plan: phases.Plan | None = None):
    """The optimizer and its lr schedule (plan: the run's phases; None: one). Checkpointing saves
    whatever state the optimizer keeps."""
    o = cfg.optimizer
    kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    muon = o.name == "Muon"  # the blocks' matrices take Muon, the rest AdamW (pretrain/muon.py)
    params = [q for n, q in model.named_parameters() if not (muon and is_matrix(n, q))]
    if o.state_dtype == "bfloat16":
        optimizer = optimizers.AdamWBF16State(params, **kwargs)
    else:  # fused: one kernel per step on CUDA and CPU (the debug model's CPU step: ~10x foreach's)
        optimizer = torch.optim.AdamW(params, **kwargs, fused=True)
    if muon:
        matrices = [q for n, q in model.named_parameters() if is_matrix(n, q)]
        optimizer = MuonAdamW(optimizer, matrices, cfg.muon, lr=o.lr, weight_decay=o.weight_decay,
                              state_dtype=o.state_dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, plan=plan))
    return optimizer, scheduler


def build_loader(cfg: Config, tokenizer, dp_rank: int, dp: int, manifest: dict) -> DataLoader:
    """This dp rank's batches: its own streams of [data]'s mixture (TP ranks read the same)."""
    d = cfg.data
    return DataLoader(d.sources, tokenizer, cfg.training.seq_len, cfg.training.local_batch_size,
                      dp_rank, dp, num_streams=d.num_streams, seed=d.seed, num_workers=d.num_workers,
                      manifest=manifest, timeout=d.hub_timeout_seconds,
                      budget=cfg.comm.init_timeout_seconds)  # a step's reads, in all


def read_step(loader: DataLoader, phase: phases.Stage, args, device) -> tuple:
    """(batches, data_error, seconds): the step's micro-batches on the device, with the positions
    that carry no signal ignored; this rank's first failed read (its DataError), after which its
    batches are zeros so that it keeps in step with the other ranks' collectives (all stop after
    the step); and the seconds spent waiting for the loader."""
    batches, data_error, seconds = [], "", 0.0
    with loader.reads_within():  # the step's reads, all micro-batches, within comm's timeout
        for _ in range(phase.grad_accum):  # micro-batches
            started = time.perf_counter()
            try:
                inputs, labels = next(loader)  # (local_batch_size, seq_len) each
            except DataError as e:
                zeros = torch.zeros(loader.local_batch_size, phase.seq_len)
                inputs = labels = zeros.long()
                data_error = data_error or e
            seconds += time.perf_counter() - started
            batches.append((inputs.to(device, non_blocking=True),
                            ignore_boundaries(labels, args).to(device, non_blocking=True)))
    return batches, data_error, seconds


def begin_phase(plan: phases.Plan, step: int, *, loader: DataLoader, guard: SpikeGuard, model,
                announce: bool) -> tuple:
    """(phase, its forward and backward FLOPs a token, for MFU) of `step`: from here its windows and
    mixture (the batch is read_step's), and its line (announce: the run has [[phases]]). At a later
    phase's first step the spike window starts afresh: the loss of another batch, sequence or
    mixture is a new level, not a spike."""
    phase = plan.at(step)
    loader.set_phase(phase.index, phase.seq_len, phase.weights)
    if step == phase.first_step > 1:
        guard.restart_window()
    if announce:
        logger.info(plan.describe(phase))
    return phase, flops_per_token(model, phase.seq_len)


def count_valid_tokens(batches: list, dp_group) -> torch.Tensor:
    """The positions the loss counts (label != -100) in the global batch: every micro-batch of every
    dp rank (TP ranks hold the same). One all-reduce of a scalar, before the first forward."""
    counted = sum((labels != -100).sum() for _, labels in batches).float()
    dist.all_reduce(counted, group=dp_group)
    return counted.clamp(min=1)


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Clip the gradients by their total norm over every shard (max_norm 0: no clipping) and return
    that norm, whole on every rank."""
    params = [q for q in model.parameters() if q.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf, foreach=True)
    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def rewind(guard: SpikeGuard, checkpointer: Checkpointer, metrics: MetricsLogger, clock: RunClock,
           step: int, tokens_seen: int) -> tuple:
    """Repeated spikes: back to the newest checkpoint before them, their data left out
    (SpikeGuard.rewind). Returns the run's (step, tokens_seen) from there; its time is its own."""
    with clock.timed("rewind"):
        record = guard.rewind(checkpointer, step, tokens_seen)
    metrics.log(record)
    clock.lap(0)  # the next log line's time starts here
    return record["rewound_to"], record["tokens_seen"]


def forward_backward(model, inputs, labels, global_tokens: torch.Tensor, dp: int, tp: int,
                     z_loss: float = 0.0) -> torch.Tensor:
    """One micro-batch: forward, loss, backward. The loss is this micro-batch's share of the global
    batch's mean: its summed cross-entropy over the positions that count (label != -100) divided by
    global_tokens, those of the whole global batch (every micro-batch on every dp rank), so 1
    process, FSDP, TP and accumulation give the same loss; z_loss adds PaLM's z term. Returns the
    (2,) shares of the cross-entropy and the z term (detached, plain) for the log. The place to
    change the objective: the loop only accumulates and steps."""
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        h = model(inputs, last_hidden=True)  # (local_batch_size, seq_len, dim)
        # The output layer and the loss take a chunk of positions at a time (pretrain/loss.py): under
        # TP the logits are sharded on the vocabulary, and FSDP2 keeps the root's weights gathered.
        loss_fn = partial(cross_entropy_and_z, z_loss=z_loss)
        shares = chunked_loss(model.output, h, labels, loss_fn) / global_tokens  # (2,): ce, z
        # FSDP averages the gradients over the dp ranks: undo its division by dp
        (shares.sum() * dp).backward()
    shares = shares.detach()
    return shares.to_local() if isinstance(shares, DTensor) else shares  # replicated over TP


def lr_factor(step: int, cfg: Config, plan: phases.Plan | None = None) -> float:
    """The peak lr's multiplier at step `step` (0-based): warmup, stable, decay to min_lr_factor; an
    annealing last phase then decays linearly to 0 from where this schedule was at its start, so
    the steps before it are the same with or without it. plan: the run's phases (None: one)."""
    if plan and plan.stages[-1].anneal:
        main = phases.Plan(plan.stages[:-1], plan.names)  # the run as it would be without the anneal
        start = plan.stages[-1].first_step - 1  # the anneal's first step, 0-based
        if step < start or start >= cfg.training.steps:  # before it, or it begins after the run
            return lr_factor(step, cfg, main)
        progress = min(1.0, (step - start + 1) / (cfg.training.steps - start))  # 1.0 at the last step
        return lr_factor(start, cfg, main) * (1 - progress)
    s = cfg.lr_scheduler
    total = cfg.training.steps
    warmup = min(s.warmup_steps, total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    # Where a step ends in the run: its count, or the tokens trained up to it (lr_scheduler.unit)
    at = plan.tokens_through if plan and s.unit == "tokens" else (lambda n: n)
    end = at(total)
    decay = end - at(warmup) if s.decay_ratio < 0 else max(1, round(end * s.decay_ratio))
    decay_start = end - decay
    if at(step + 1) <= decay_start or decay == 0:
        return 1.0
    progress = min(1.0, (at(step + 1) - decay_start) / decay)  # 1.0 at the last step
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[s.decay_type]
    return s.min_lr_factor + (1 - s.min_lr_factor) * shape


# -------------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------------

def main(cfg: Config):
    # --- 1. config: validated before any process group or model exists, on every rank alike -----
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    sizes = validate(cfg, world_size)
    clock = RunClock(cfg.training.steps, sizes["rounds"])  # elapsed time and the ETA, from here
    level = logging.INFO if rank == 0 else logging.WARNING  # rank 0 logs; the others only warn
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stdout, force=True)
    stop = stop_on_signals()  # before the slow start-up, so an early signal is not lost
    tokenizer = Tokenizer(cfg.model.tokenizer_path)

    # --- 2. device, process group, mesh, dump folder ---------------------------------------------
    device, mesh = init_distributed(cfg.parallelism, sizes, cfg.comm.init_timeout_seconds)
    lock = startup.open_dump_folder(cfg.job, config.to_toml(cfg), rank, device)  # noqa: F841 (kept)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")  # the ranks that each read their own data
    dp_rank = dp_mesh.get_local_rank()
    torch.use_deterministic_algorithms(cfg.training.deterministic)
    torch.manual_seed(cfg.training.seed)

    # --- 3. model: on the meta device, so no rank ever holds the full unsharded weights ----------
    with torch.device("meta"):
        model = Transformer(model_args(cfg, tokenizer))  # the vocabulary follows the tokenizer
    logger.info(run_summary(cfg, model, world_size, sizes))

    # --- 4. parallelize, then materialise this rank's shards -------------------------------------
    float8_scales = float8.convert(model, cfg.float8, cfg.model.converters, cfg.compile.enable, device,
                                   sharded=sizes["dp"] > 1)
    parallelize(model, mesh, cfg)
    model.to_empty(device=device)
    model.init_weights(normal_=layout_independent_normal(cfg.training.seed), buffer_device=device)

    # --- 5. optimizer, lr schedule, data (each dp rank reads its own streams; TP ranks the same) -
    plan = sizes["phases"]  # each step's batch, sequence and mixture (pretrain/phases.py)
    optimizer, scheduler = build_optimizer(model, cfg, device, plan)
    manifest = startup.share_manifest(cfg.data, startup.held_out(cfg.validation, cfg.eval),
                                      cfg.job.dump_folder, cfg.comm.init_timeout_seconds, rank, device)
    loader = build_loader(cfg, tokenizer, dp_rank, sizes["dp"], manifest)

    # --- 6. checkpoint: resume from the newest complete step-N, or start from initial_load_path --
    guard = SpikeGuard(cfg.spikes, device)  # the window of recent steps that spikes stand out of
    checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, steps=cfg.training.steps,
                                run_keys=resume_keys(cfg, model.args, sizes, manifest), model=model,
                                optimizer=optimizer, scheduler=scheduler, loader=loader, guard=guard,
                                notes={"model.converters": cfg.model.converters})
    step, tokens_seen = checkpointer.resume()
    startup.check_sources(loader, rank, cfg.data.resolve_timeout_seconds)  # before step 1, all alike
    windows, tasks = evals.read_once(cfg.validation, cfg.eval, tokenizer, manifest, device,
                                     seq_len=cfg.training.seq_len, max_seq_len=model.args.max_seq_len,
                                     data=cfg.data, budget=cfg.comm.init_timeout_seconds)
    heldout = evals.heldout_share(windows, cfg.validation.local_batch_size, dp_rank, sizes["dp"],
                                  partial(ignore_boundaries, args=model.args))

    # --- 7. training loop ------------------------------------------------------------------------
    metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, rank, clock, dataclasses.asdict(cfg))
    LEFT_OPEN[:] = [checkpointer.saver, metrics]  # an error exit finishes their save and logs first
    dp_group = dp_mesh.get_group()
    speed = Throughput(device, world_size, cfg.metrics.peak_tflops)
    agreement = StepAgreement(stop, guard, checkpointer.saver, device, dp_group)
    sums = LogSums(device, z_loss=bool(cfg.training.z_loss))  # the next line's
    phase = None  # the phase of the step being trained
    clock.lap(0)  # the first log line's time starts here

    while step < cfg.training.steps:
        if guard.rewind_due():  # repeated spikes: back to a checkpoint from before them
            step, tokens_seen = rewind(guard, checkpointer, metrics, clock, step, tokens_seen)
            float8_scales(model)  # the scales cached for the next all-gathers are the old weights'
            sums.reset()  # the next log line covers the steps trained from here on
        step += 1
        if phase is not plan.at(step):  # the first step, or a phase's first: its batch, sequence, mixture
            phase, flops = begin_phase(plan, step, loader=loader, guard=guard, model=model,
                                       announce=bool(cfg.phases))
        optimizer.zero_grad(set_to_none=True)
        # Every micro-batch first: the loss divides by the positions it counts in the global batch.
        batches, data_error, data_seconds = read_step(loader, phase, model.args, device)
        global_valid_tokens = count_valid_tokens(batches, dp_group)
        loss_shares = [forward_backward(model, inputs, labels, global_valid_tokens, sizes["dp"],
                                        sizes["tp"], z_loss=cfg.training.z_loss)
                       for inputs, labels in batches]
        grad_norm = clip_grad_norm(model, cfg.training.max_norm)
        decision = agreement.on_step(loss_shares, grad_norm, data_error)  # the step's one host sync
        lr = optimizer.param_groups[0]["lr"]  # the lr this step used
        if decision.skip:  # neither the weights nor AdamW's state move; the data goes on
            metrics.log(guard.skip(step, decision.not_finite))
            guard.stop_if_too_many(step, checkpointer)
        else:
            optimizer.step()
            float8_scales(model)  # every float8 weight's scale, for the next step's all-gathers
            guard.keep()
        scheduler.step()
        guard.cut_lr(optimizer, step + 1)  # within a rewind's lr cut
        tokens_seen += phase.tokens_per_step
        sums.add(loss_shares, global_valid_tokens, data_seconds, kept=not decision.skip,
                 tokens=phase.tokens_per_step, flops_per_token=flops)
        last = step == cfg.training.steps

        if (step % cfg.metrics.log_freq == 0 or step == phase.first_step or last) and not decision.skip:
            # The loss and speed of the steps since the last line (clock.lap() leaves the rounds out)
            metrics.log({"step": step, **sums.reduce(loader.source_tokens(), dp_group),
                         "grad_norm": grad_norm.item(), "lr": lr,
                         **speed.over(sums, clock.lap(sums.steps)),
                         "tokens_seen": tokens_seen, "skipped_steps": guard.skipped, "phase": phase.index})
            sums.reset()

        if cfg.validation.enable and (step % cfg.validation.freq == 0 or last):
            with clock.timed("validation") as took:
                result = evals.validate(model, heldout, cfg.validation.local_batch_size, device, dp_group, sizes["tp"])
            metrics.log({"step": step, **result, "validation_seconds": took.seconds})
        if cfg.eval.enable and (step % cfg.eval.freq == 0 or last):
            with clock.timed("eval") as took:
                result = evals.evaluate(model, tasks, cfg.eval.local_batch_size, device, dp_group, sizes["tp"])
            metrics.log({"step": step, **result, "eval_seconds": took.seconds})

        if decision.save_done:  # an async save, written on every rank: put it in place
            checkpointer.saver.finish()
        at_interval = step % cfg.checkpoint.interval == 0
        if cfg.checkpoint.enable and (at_interval and not decision.skip or last or decision.stop):
            with clock.timed("checkpoint"):
                checkpointer.save(step, tokens_seen, final=last or decision.stop)
        if decision.stop:
            logger.info(f"stopping at step {step} on signal")
            break

    metrics.summary()  # steps, tokens, wall time, the last losses, peak memory, the rounds' time
    ignore_stop_signals()  # a second preemption signal must not kill a rank that has saved
    loader.close()
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(load_config(sys.argv[1:]))
    except (Exception, KeyboardInterrupt) as e:
        user = (ConfigError, DataError, CheckpointError)  # one line each (pretrain/faults.py)
        line = str(e) if isinstance(e, (*user, RunError, SaveError, Fault)) else lost_rank(e)
        if line:
            print(f"error: {line}", file=sys.stderr, flush=True)
        else:  # a bug, or Ctrl-C: its traceback
            traceback.print_exc()
        # Close what main() left open: an async save of an earlier step (its wait is bounded) and
        # TensorBoard's buffered events.
        for held in LEFT_OPEN:
            with contextlib.suppress(Exception):
                held.close()
        sys.stdout.flush()  # stderr is line-buffered
        # Then leave at once: a rank lingering in teardown gets torchrun's SIGTERM, a process group
        # freed at shutdown can abort in gloo's threads, and Python's exit would wait forever for the
        # loader workers, which ignore its SIGTERM. They end by themselves when their rank is gone.
        os._exit(FAULT if is_fault(e) else USER if isinstance(e, user) else RUN if line else 1)
    # main() closed the loader, the logs and the process group: skip torch's teardown (0.7 s a run)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
