"""torchtitan on our shapes, 0.3.0 (today's) or 0.2.2 (whichever the Python that runs it has): the
torchrun command for the run train.py does, the tokenizer files it reads, the steady tokens/s its log
reports, and (run as a program) the one torchtitan process torchrun starts. `bench.py titan` runs it
side by side with ours; tests/test_titan.py trains with it. The trainer never imports it, and it
imports nothing of bench.py.

    torchrun ... -m pretrain.titan_run SPEC DEVICE --section.key value ...   # SPEC: our shape etc., as JSON

0.3.0 takes its model from a Python config function (`--module pretrain.titan_run --config
titan_config`, which reads SPEC from the environment), not a flavor name; on CPU its attention is
SDPA (causal, positions 0..seq_len-1, as our causal model) where it allows only FlexAttention, which
has no CPU backward; on a GPU FlexAttention with its document masks (our block_causal).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

from pretrain import measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
# What torchtitan needs of our ModelArgs to build the same model (the same parameter count).
SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
         "ffn_dim_multiplier", "norm_eps", "rope_theta")
SPEC = "TITAN_RUN_SPEC"  # 0.3.0's config function reads the run's SPEC here


def titan_version(python: str = sys.executable) -> str:
    """The torchtitan version that `python` imports ("" for none), without importing it here."""
    ask = "import importlib.metadata as m; print(m.version('torchtitan'))"
    proc = subprocess.run([python, "-c", ask], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


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


def sum_reduce(fsdp_module):
    """torchtitan's FSDP gradient divide factor of 1 asks for PREMUL_SUM, which gloo lacks; SUM is
    the same."""
    def disable_division(model):
        for m in model.modules():
            if isinstance(m, fsdp_module):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    return disable_division


def titan_rank(spec: str, device: str, argv: list):
    """One torchtitan process, on our model's shape. On CPU, patches the installed copy in memory
    first: torchtitan assumes an accelerator and NCCL."""
    import types

    sys.argv = [sys.argv[0], *argv]  # its CLI reads sys.argv[1:]
    os.environ[SPEC] = spec
    if device == "cpu":
        patch_for_cpu()
    from importlib.metadata import version
    old = version("torchtitan").startswith("0.2.")
    if old and importlib.util.find_spec("triton") is None:  # 0.2.2's MoE kernels: imported, unused by llama3
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None
        kernels.fill_indices_wrapper = None
        sys.modules["torchtitan.models.moe.kernels"] = kernels
    import torchtitan.distributed.utils as dist_utils
    if device == "cpu":  # its barrier names a CUDA device; it only shortens timeouts
        dist_utils.set_pg_timeouts = lambda *a, **k: None
    if not old:
        from torchtitan.distributed import fsdp
        from torchtitan.train import Trainer, main
        if device == "cpu":
            fsdp.disable_fsdp_gradient_division = sum_reduce(fsdp.FSDPModule)
            # SDPA's positions are 0..seq_len-1: its per-document positions would need its masks
            process = Trainer.post_dataloading_process
            Trainer.post_dataloading_process = lambda self, inputs, labels: process(
                self, {k: v for k, v in inputs.items() if k != "positions"}, labels)
        return main()
    from torchtitan.models import llama3
    from torchtitan.models.llama3.infra import parallelize
    from torchtitan.train import Trainer, main
    shape = {k: v for k, v in json.loads(spec).items() if k in SHAPE}
    llama3.llama3_args["bench"] = llama3.TransformerModelArgs(**shape)
    if device == "cpu":
        parallelize.disable_fsdp_gradient_division = sum_reduce(parallelize.FSDPModule)
    main(Trainer)


def titan_config():
    """torchtitan 0.3.0's Trainer.Config for the run in SPEC: its debug model's settings with our
    shape (its 8B flavor's init and RoPE), lr and AC; the CLI sets the rest."""
    import dataclasses

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    spec = json.loads(os.environ[SPEC])
    d, vocab, heads = spec["dim"], spec["vocab_size"], spec["n_heads"]
    hidden = compute_ffn_hidden_dim(d, multiple_of=spec["multiple_of"],
                                    ffn_dim_multiplier=spec["ffn_dim_multiplier"])
    rope = ComplexRoPE.Config(dim=d // heads, max_seq_len=131072, theta=spec["rope_theta"], scaling="llama")
    layers = llama3._build_llama3_layers(n_layers=spec["n_layers"], dim=d, n_heads=heads,
                                         n_kv_heads=spec["n_kv_heads"], hidden_dim=hidden, rope=rope,
                                         attn_backend="flex")
    model = llama3.Llama3Model.Config(
        dim=d, vocab_size=vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=d,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=vocab, param_init=llama3._output_linear_init(d)))
    for norm in [model.norm, *(n for b in layers for n in (b.attention_norm, b.ffn_norm))]:
        norm.eps = spec["norm_eps"]
    if spec["device"] == "cpu":  # FlexAttention has no CPU backward
        for block in layers:
            block.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = llama3_debugmodel()
    cfg.model_spec = dataclasses.replace(cfg.model_spec, flavor="bench", model=model)
    cfg.loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    cfg.optimizer = default_adamw(lr=spec["lr"])  # betas, eps and weight decay: ours
    cfg.lr_scheduler.decay_ratio = None  # its debug model's 0.8 (WSD); 0.2.2's and ours decay from warmup's end
    # its selective AC is per op only: every-Nth-block AC runs as full
    cfg.activation_checkpoint = {"none": None, "full": FullAC.Config()}.get(spec["ac"], SelectiveAC.Config())
    if spec["ac"] == "selective" and spec["ac_option"] != "op":
        cfg.activation_checkpoint = FullAC.Config()
    return cfg


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
    compile, in the Python `args.python` (default: this one) and its torchtitan's CLI. Its data: the
    bundled C4 sample through its `c4_test` loader (tokenizing is not the bottleneck)."""
    t = cfg.training
    p = cfg.parallelism
    ac = cfg.activation_checkpoint
    python = getattr(args, "python", None) or sys.executable
    spec = {**{k: getattr(a, k) for k in SHAPE}, "device": args.device, "lr": cfg.optimizer.lr,
            "ac": ac.mode, "ac_option": str(ac.selective_ac_option)}
    flags = {
        "training.local_batch_size": t.local_batch_size,
        "training.global_batch_size": sizes["global_batch_size"],
        "training.seq_len": t.seq_len,
        "training.steps": args.steps,
        "training.max_norm": t.max_norm,
        "training.mixed_precision_param": t.mixed_precision_param,
        "parallelism.data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "parallelism.data_parallel_shard_degree": sizes["dp_shard"],
        "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
        "metrics.log_freq": args.warmup,
    }
    data = os.path.join(ROOT, "assets/data/c4")
    if titan_version(python).startswith("0.2."):
        flags.update({"model.flavor": "bench", "model.hf_assets_path": folder, "job.dump_folder": folder,
                      "training.dataset": "c4_test", "training.dataset_path": data,
                      "optimizer.lr": cfg.optimizer.lr, "activation_checkpoint.mode": ac.mode,
                      "activation_checkpoint.selective_ac_option": ac.selective_ac_option})
    else:  # 0.3.0: the model, lr and AC come from titan_config
        flags.update({"module": "pretrain.titan_run", "config": "titan_config", "hf_assets_path": folder,
                      "dump_folder": folder, "dataloader.dataset": "c4_test", "dataloader.dataset_path": data})
    torchrun = [python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={args.nproc}", "--local-ranks-filter", "0", "--role", "rank",
                "--tee", "3"]
    # this file's __main__ in each process, run from the repository's root (bench.py's cwd)
    rank = ["-m", "pretrain.titan_run", json.dumps(spec), args.device]
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
