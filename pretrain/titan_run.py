"""torchtitan 0.2.2 on our shapes: the torchrun command for the run train.py does, the tokenizer
files it reads, the steady tokens/s its log reports, and (run as a program) the one torchtitan process
torchrun starts. `bench.py titan` runs it side by side with ours; tests/test_titan.py trains with
it. The trainer never imports it, and it imports nothing of bench.py.

    torchrun ... -m pretrain.titan_run SHAPE DEVICE --section.key value ...   # SHAPE: our model's, as JSON
"""

import importlib.util
import json
import os
import re
import sys

from pretrain import measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
# What torchtitan needs of our ModelArgs to build the same model (the same parameter count).
SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
         "ffn_dim_multiplier", "norm_eps", "rope_theta")


def patch_for_cpu():
    """torchtitan assumes an accelerator: on CPU, the device type "cpu" and its memory monitor's
    torch.cuda calls answered on torch.cpu."""
    import types

    import torch._utils
    torch._utils._get_available_device_type = lambda: "cpu"  # it picks "cuda" when it finds nothing
    pages = os.sysconf("SC_PHYS_PAGES")
    ram = types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * pages)
    none = lambda *a, **k: None  # noqa: E731  (the torch.cuda calls of its memory monitor)
    torch.cpu.get_device_name = str
    torch.cpu.get_device_properties = lambda *a: ram
    torch.cpu.memory_stats = lambda *a: {}
    torch.cpu.reset_peak_memory_stats = none
    torch.cpu.empty_cache = none


def titan_rank(shape: str, device: str, argv: list):
    """One torchtitan process, on our model's shape registered as flavor "bench". On CPU, patches
    the installed copy in memory first: torchtitan assumes an accelerator and NCCL."""
    import types

    sys.argv = [sys.argv[0], *argv]  # its ConfigManager takes sys.argv[1:] as it is at import
    if device == "cpu":
        patch_for_cpu()
    if importlib.util.find_spec("triton") is None:  # MoE kernels: imported, unused by llama3
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None
        kernels.fill_indices_wrapper = None
        sys.modules["torchtitan.models.moe.kernels"] = kernels
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.models import llama3
    from torchtitan.models.llama3.infra import parallelize
    from torchtitan.train import Trainer, main
    llama3.llama3_args["bench"] = llama3.TransformerModelArgs(**json.loads(shape))
    if device == "cpu":
        # its divide factor of 1 asks for PREMUL_SUM, which gloo lacks; SUM is the same
        def sum_reduce(model):
            for m in model.modules():
                if isinstance(m, parallelize.FSDPModule):
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)
        parallelize.disable_fsdp_gradient_division = sum_reduce
        # its barrier names a CUDA device; it only shortens timeouts
        dist_utils.set_pg_timeouts = lambda *a, **k: None
    main(Trainer)


def titan_tokenizer(cfg, folder: str):
    """torchtitan reads Hugging Face tokenizer files: ours converted, with the same ids and
    special tokens."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from data import LLAMA3_PAT, Tokenizer
    ours = Tokenizer(os.path.join(ROOT, cfg.model.tokenizer_path))
    names = sorted(ours.special, key=ours.special.get)
    convert = TikTokenConverter(pattern=LLAMA3_PAT, extra_special_tokens=names)
    # tiktoken's loader caches by path: hand it our ranks
    convert.load_tiktoken_bpe = lambda _: ours.model._mergeable_ranks
    convert.converted().save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": names[0], "eos_token": names[1]}, f)


def titan_command(cfg, a, sizes: dict, args, folder: str) -> list:
    """torchrun + torchtitan's CLI for the run ours does: same shape, tokens per step, dtype, AC,
    compile. Its data: the bundled C4 sample through its `c4_test` loader (tokenizing is not the
    bottleneck)."""
    t = cfg.training
    p = cfg.parallelism
    ac = cfg.activation_checkpoint
    flags = {
        "model.flavor": "bench",
        "model.hf_assets_path": folder,
        "job.dump_folder": folder,
        "training.dataset": "c4_test",
        "training.dataset_path": os.path.join(ROOT, "assets/data/c4"),
        "training.local_batch_size": t.local_batch_size,
        "training.global_batch_size": sizes["global_batch_size"],
        "training.seq_len": t.seq_len,
        "training.steps": args.steps,
        "training.max_norm": t.max_norm,
        "training.mixed_precision_param": t.mixed_precision_param,
        "optimizer.lr": cfg.optimizer.lr,
        "parallelism.data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "parallelism.data_parallel_shard_degree": sizes["dp_shard"],
        "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
        "activation_checkpoint.mode": ac.mode,
        "activation_checkpoint.selective_ac_option": ac.selective_ac_option,
        "metrics.log_freq": args.warmup,
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.nproc}", "--local-ranks-filter", "0", "--role", "rank",
                "--tee", "3"]
    shape = json.dumps({k: getattr(a, k) for k in SHAPE})
    # this file's __main__ in each process, run from the repository's root (bench.py's cwd)
    rank = ["-m", "pretrain.titan_run", shape, args.device]
    cli = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    compiling = ["--compile.enable"] if cfg.compile.enable else []
    return [*torchrun, *rank, *cli, "--metrics.disable_color_printing", *compiling]


def steady_tps(log: str, warmup: int):
    """Steady-state tokens/s per process from torchtitan's log (`step: 20  loss: ... tps: 1,234`),
    as ours is read (measure.steady_tps); None if no step after the warmup."""
    log = re.sub(r"\x1b\[[\d;]*m", "", log)  # its colours, if they were on
    found = re.findall(r"step:\s*(\d+)\s.*?\stps: ([\d,]+)", log)
    records = [{"step": int(step), "tps": float(tps.replace(",", ""))} for step, tps in found]
    return measure.steady_tps(records, warmup) if any(r["step"] > warmup for r in records) else None


if __name__ == "__main__":
    titan_rank(sys.argv[1], sys.argv[2], sys.argv[3:])
