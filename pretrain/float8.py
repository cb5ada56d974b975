"""float8 training with torchao, as torchtitan v0.2 does it: `[model] converters = ["float8"]`
and the `[float8]` keys. train.py calls check() before any process group exists, convert() on the
meta-device model before parallelize(), tp_styles() for the TP plan. Checkpoints hold plain weights
under Meta's names (plain()), so float8 may be turned on or off on a resume."""

import dataclasses
import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from pretrain.config import ConfigError

logger = logging.getLogger("train")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # Float8LinearConfig.from_recipe_name's
AUTO_FILTER = "auto_filter_small_kn"  # torchtitan's filter_fqns flag for torchao's table of sizes


@dataclass
class Float8:  # train.py's [float8] section, used when model.converters has "float8"
    recipe_name: str = "tensorwise"  # tensorwise (fastest), rowwise or rowwise_with_gw_hp (more accurate)
    enable_fsdp_float8_all_gather: bool = False  # FSDP all-gathers weights in float8, 1 byte not 2 (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # all weights' scales in one all-reduce per step (needs the float8 all-gather)
    filter_fqns: list = field(default_factory=lambda: ["output"])  # Linear layers named with one of these stay in high precision; "auto_filter_small_kn": small ones too


def check(f8: Float8, converters: list, training, gpu: bool | None = None) -> None:
    """The [float8] rules (`f8`), with model.converters and [training], before any process group
    exists. float8 needs torchao, and on a GPU float8 matmuls: CUDA SM 8.9+ or ROCm MI300+ (gfx942
    reports 9.4). `gpu`: whether the job runs on GPUs; None (train.py) asks this machine; True
    (dryrun.py): the job's GPUs are taken to be H100-class, whatever this machine has."""
    if f8.recipe_name not in RECIPES:
        recipes = ", ".join(RECIPES)
        raise ConfigError(f"float8.recipe_name = {f8.recipe_name!r}: must be one of {recipes}")
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError("float8.enable_fsdp_float8_all_gather = True: must be false unless "
                          "float8.recipe_name is tensorwise (torchao's rule)")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError("float8.precompute_float8_dynamic_scale_for_fsdp = True needs "
                          "float8.enable_fsdp_float8_all_gather = true: "
                          "the scales it computes are the all-gather's")
    if AUTO_FILTER in f8.filter_fqns and f8.recipe_name == "rowwise_with_gw_hp":
        raise ConfigError(f"float8.filter_fqns: torchao has no {AUTO_FILTER!r} table for "
                          "rowwise_with_gw_hp; remove it, or name the layers to keep")
    if "float8" not in converters:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("model.converters = [\"float8\"] needs torchao: "
                          "pip install torchao==0.18.0")
    here = gpu is None  # under train.py, this machine is the job's
    index = int(os.environ.get("LOCAL_RANK", 0))  # this process's GPU
    gpu = torch.cuda.is_available() if here else gpu
    needs = (9, 4) if torch.version.hip else (8, 9)
    if here and gpu and torch.cuda.get_device_capability(index) < needs:
        name = torch.cuda.get_device_name(index)
        raise ConfigError("float8 needs float8 matmuls (H100, H200, B200, MI300 or newer), "
                          f"which this {name} lacks: remove \"float8\" from model.converters")
    # torch._scaled_mm enforces two rules on a GPU (the CPU's emulation multiplies in fp32 and
    # enforces neither): rowwise scaling writes bf16 only, and the tokens are the inner dimension
    # of the weight-gradient matmul.
    param_dtype = training.mixed_precision_param
    if gpu and f8.recipe_name != "tensorwise" and param_dtype != "bfloat16":
        raise ConfigError(f"float8.recipe_name = {f8.recipe_name!r} needs "
                          "training.mixed_precision_param = bfloat16 on a GPU "
                          f"(rowwise float8 matmuls write bf16; it is {param_dtype})")
    tokens = training.local_batch_size * training.seq_len
    if gpu and tokens % 16:
        raise ConfigError(f"training.local_batch_size x seq_len = {tokens} tokens per micro-batch: "
                          "float8 matmuls on a GPU need a multiple of 16")


def convert(model: torch.nn.Module, f8: Float8, converters: list, compiled: bool, device: torch.device,
            sharded: bool = True):
    """With model.converters = ["float8"] (`converters`), swap the Linear layers for torchao's
    Float8Linear, as [float8] (`f8`) says: the same weights under the same names, so checkpoints
    do not change. compiled: compile.enable.
    Returns the per-step weight-scale precompute if asked for (one all-reduce after optimizer.step
    for every weight's scale), else a no-op. Unless `sharded` (FSDP), the FSDP settings are off."""
    if "float8" not in converters:
        return lambda model: None
    if f8.recipe_name == "rowwise":  # as torchtitan does (pytorch/pytorch#150859)
        import torch._inductor.config as inductor
        inductor.emulate_precision_casts = True
    if device.type == "cuda" and not compiled:  # torchao's casts then run as separate kernels
        logger.warning("float8 without compile.enable is slower than bf16: "
                       "turn on --compile.enable")
    logging.disable(logging.WARNING)  # hide torchao's CUDA kernels failing to load on CPU
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8 import _auto_filter_for_recipe, precompute_float8_dynamic_scale_for_fsdp
    logging.disable(logging.NOTSET)
    recipe = Float8LinearConfig.from_recipe_name(f8.recipe_name)
    # on CPU, torch._scaled_mm takes ~1000x an fp32 matmul, so the float8 values multiply in fp32
    gather = f8.enable_fsdp_float8_all_gather and sharded
    config = dataclasses.replace(recipe, emulate=device.type == "cpu",
                                 enable_fsdp_float8_all_gather=gather)

    def convertible(m: torch.nn.Linear, fqn: str) -> bool:  # float8 matmuls need multiples of 16
        kept = any(f in fqn for f in f8.filter_fqns)  # filter_fqns' layers stay in high precision
        return not kept and m.in_features % 16 == 0 and m.out_features % 16 == 0

    auto = AUTO_FILTER in f8.filter_fqns  # like torchtitan, use torchao's H100 thresholds, kept up to date there
    chosen = _auto_filter_for_recipe(f8.recipe_name, f8.filter_fqns) if auto else convertible
    convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    high = sorted({re.sub(r"layers\.\d+\.", "layers.*.", n) for n, m in model.named_modules()
                   if type(m) is torch.nn.Linear})
    emulated = "; on CPU the matmuls are emulated in fp32: for correctness, not speed"
    cpu = emulated if device.type == "cpu" else ""
    logger.info(f"float8 {f8.recipe_name} (torchao); Linear layers kept in high precision: "
                f"{', '.join(high) or 'none'}{cpu}")
    precompute = f8.precompute_float8_dynamic_scale_for_fsdp and sharded  # asked for in [float8]
    return precompute_float8_dynamic_scale_for_fsdp if precompute else lambda model: None


def tp_styles(model: torch.nn.Module, device_type: str, recipe_name: str):
    """torchao's (colwise, rowwise, prepare-input) TP styles when every Linear of the blocks is
    float8 with the tensorwise recipe on CUDA: their all-gathers move 1 byte per value. None
    otherwise (gloo has no float8; on ROCm they are not used): the plan's plain styles."""
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    all_float8 = all(type(m).__name__ == "Float8Linear" for m in linears)
    on_cuda = device_type == "cuda" and not torch.version.hip  # a ROCm build's "cuda" is not CUDA
    if not on_cuda or recipe_name != "tensorwise" or not all_float8:
        return None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def plain(t):
    """The fp32 tensor inside torchao's float8 all-gather wrapper, sharing its memory: checkpoints
    hold plain tensors, loadable without torchao; a load into the plain view fills the parameter."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    float8_weight = "WeightWithDynamicFloat8CastTensor"  # the one wrapper unwrapped here
    is_wrapper = torch.utils._python_dispatch.is_traceable_wrapper_subclass(local)
    if not is_wrapper:  # a plain tensor (or a dry run's fake one)
        return t
    kind = type(local)
    if f"{kind.__module__}.{kind.__name__}" != f"torchao.float8.fsdp_utils.{float8_weight}":
        # by type: another subclass's inner tensors need not be the value (saving one loses it)
        raise TypeError(f"a {kind.__name__} in the state dict: checkpoints unwrap only "
                        f"torchao's {float8_weight}; "
                        "teach float8.plain which of its tensors holds the value")
    inner = local._tensor
    if not isinstance(t, DTensor):
        return inner
    return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())
