"""float8 training with torchao (`[model] converters = ["float8"]`), checked for correctness on the CPU.

On a CPU torchao's float8 matmuls are emulated in fp32 (pretrain/float8.py sets `emulate`): the values are still rounded
to float8 with torchao's scales, the casts, the FSDP float8 all-gather and the scale precompute are the real
code, so the loss moves away from the fp32 run by float8's rounding, and by no more. Speed is not measured here.

Measured before setting the bound (10 steps, the SMALL shape: 2 of the debug model's blocks at seq_len 64,
global batch 8, lr 1e-3, fp32 master weights; 2026-11-26): the largest per-step |loss(float8) -
loss(fp32)| was 0.0045 (tensorwise, 1 process), 0.0043 (FSDP 2, float8 all-gather + precomputed scales),
0.0046 (TP 2, selective AC), 0.0026 (rowwise, 1 process), while the loss falls by 0.98. BOUND is 0.01,
about 2.2x that. (6 blocks gave at most 0.0083 against a fall of 1.5, under a BOUND of 0.02; 20 steps at
seq_len 128 at most 0.0052: the short, small runs keep this file's CPU time down.)
"""

import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import DEVICES, SMALL as SHAPE, start_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from pretrain import config  # noqa: E402
from pretrain import float8  # noqa: E402
import train as T  # noqa: E402

BOUND = 0.01  # largest allowed |loss(float8) - loss(fp32)| per step over 10 steps (measured: <= 0.0046)
# global batch 8 in every layout below; lr 1e-3: at the debug config's 3e-3 these short runs spike (fp32 too),
# and a spike amplifies any difference (fp32 vs float8 then differ by 0.4 at a step: chaos, not float8)
SMALL = ["--training.steps", 10, *SHAPE, "--optimizer.lr", 1e-3]
FSDP_F8 = ["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather",
           "--float8.precompute_float8_dynamic_scale_for_fsdp"]
NOISE = ["Failed to load", "_C.", ".so", "Enum subclass", "Traceback"]  # torchao's import chatter on a CPU machine


def start(dump, *args, nproc=1, device="cpu", env=()):
    """(the run, dump) of train.py started on the debug config (conftest.start_training), on `device` (the CPU
    even where a GPU is: these runs check float8's numbers against the CPU's fp32 run)."""
    argv = ["--config", "configs/debug_model.toml", "--job.dump_folder", dump, "--metrics.log_freq", "1",
            "--validation.enable", "false", *args]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **dict(env)}  # deterministic GPU runs need it
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # train.py takes a GPU when it sees one
    return start_training(argv, nproc, env=env, timeout=900), dump


def finish(started, expect=0):
    """(stdout, stderr, training records) of a run from start(), once it ends."""
    run, dump = started
    proc = run.wait()
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == expect, stdout[-2000:] + stderr[-3000:]
    path = os.path.join(dump, "metrics.jsonl")
    records = [r for r in map(json.loads, open(path)) if "loss" in r] if os.path.exists(path) else []
    return stdout, stderr, records


def train(dump, *args, nproc=1, expect=0, device="cpu"):
    """(stdout, stderr, training records) of train.py: start(), then finish()."""
    return finish(start(dump, *args, nproc=nproc, device=device), expect)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fp32 reference, float8 tensorwise and rowwise on 1 process, FSDP 2 (float8 all-gather, precomputed
    scales, checkpoints at 5 and 10) and TP 2 (selective AC): 10 steps each."""
    d = tmp_path_factory.mktemp("float8")
    # The three 1-process runs side by side, a thread each: on 2 cores one run alone leaves a core idle
    one_thread = {"OMP_NUM_THREADS": "1"}
    f8 = ["--training.local_batch_size", 8, "--model.converters", "float8"]
    alone = {"fp32": start(d / "fp32", *SMALL, "--training.local_batch_size", 8, env=one_thread),
             "one": start(d / "one", *SMALL, *f8, env=one_thread),
             "rowwise": start(d / "rowwise", *SMALL, *f8, "--float8.recipe_name", "rowwise", env=one_thread)}
    return {**{name: finish(started) for name, started in alone.items()},
            "fsdp": train(d / "fsdp", *SMALL, "--training.local_batch_size", 4, *FSDP_F8, "--checkpoint.enable",
                          "--checkpoint.interval", 5, nproc=2) + (d / "fsdp",),
            "tp": train(d / "tp", *SMALL, "--training.local_batch_size", 8, "--model.converters", "float8",
                        "--parallelism.tensor_parallel_degree", 2, "--activation_checkpoint.mode", "selective", nproc=2)}


def gaps(records, reference):
    assert [r["step"] for r in records] == [r["step"] for r in reference] == list(range(1, 11))
    return [abs(a["loss"] - b["loss"]) for a, b in zip(records, reference)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one", "fsdp", "tp"])
def test_tensorwise_trains_within_the_bound_of_fp32(runs, layout):
    out, err, records = runs[layout][:3]
    gap = gaps(records, runs["fp32"][2])
    print(f"{layout}: largest loss gap float8 vs fp32 {max(gap):.4f}")
    assert max(gap) < BOUND
    assert max(gap) > 1e-4  # float8 rounding is really there (an fp32 run matches to ~1e-6)
    assert records[-1]["loss"] < records[0]["loss"] - 0.75  # it learns (measured: by 0.98), 75x the bound
    assert all(math.isfinite(r["grad_norm"]) for r in records)
    assert "float8 tensorwise (torchao); Linear layers kept in high precision: output; on CPU" in out
    assert not [n for n in NOISE if n in out + err], err[-2000:]  # torchao's failed CUDA loads stay out


@pytest.mark.slow
def test_rowwise_on_one_process(runs):
    out, err, records = runs["rowwise"]
    gap = gaps(records, runs["fp32"][2])
    print(f"rowwise: largest loss gap float8 vs fp32 {max(gap):.4f}")
    assert 1e-4 < max(gap) < BOUND
    assert "float8 rowwise (torchao)" in out


@pytest.mark.slow
def test_selective_ac_and_compile_run_with_float8(runs, tmp_path):
    out, err, records = train(tmp_path, "--training.steps", 2, *SHAPE, "--training.local_batch_size", 8,
                              "--model.converters", "float8", "--activation_checkpoint.mode", "selective",
                              "--compile.enable")
    # Step 1 sees the same weights as the eager float8 run (step 2 follows a 2-step lr schedule).
    assert records[0]["loss"] == pytest.approx(runs["one"][2][0]["loss"], abs=1e-3)
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["loss"] < records[0]["loss"]


def test_selective_ac_saves_the_float8_matmul_outputs():
    """The SAC policy sees a Float8Linear's matmul as aten.mm (torchao's tensor subclass turns it into
    _scaled_mm below the policy), so its output is saved, not recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    T.logging.disable(T.logging.WARNING)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    T.logging.disable(T.logging.NOTSET)
    layer = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False)),
                                       config=Float8LinearConfig(emulate=True))
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE
    x = torch.randn(16, 32, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum().backward()
    # the matmul, and the amax reductions of float8's scales (torchtitan keeps both), are on train.py's list
    assert {torch.ops.aten.mm.default, torch.ops.aten.max.default} <= set(seen) & T.AC_SAVE


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_resume_with_float8_is_bitwise_exact(device, tmp_path):
    """1 process (FSDP of one), float8 all-gather with precomputed scales: stop at 2, resume to 4."""
    args = ["--training.steps", 4, *SHAPE, "--training.local_batch_size", 8, *FSDP_F8,
            "--checkpoint.enable", "--checkpoint.interval", 2, "--training.deterministic", "true"]
    out, _, whole = train(tmp_path / "whole", *args, device=device)
    assert ("on CPU the matmuls are emulated" in out) == (device == "cpu")  # it ran where the parameter says
    step = os.path.join("checkpoint", "step-2")
    shutil.copytree(tmp_path / "whole" / step, tmp_path / "resumed" / step)
    out, _, resumed = train(tmp_path / "resumed", *args, device=device)
    assert "resumed from" in out and "this resume changes" not in out
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in whole[2:]]


@pytest.mark.slow
def test_resume_may_turn_float8_off_and_on(runs, tmp_path):
    """From the FSDP float8 run's step-5: float8 off for step 6, then on again for step 7, 1 process."""
    shutil.copytree(runs["fsdp"][3] / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    args = [*SHAPE, "--training.local_batch_size", 8, "--checkpoint.enable"]
    out, _, off = train(tmp_path, *args, "--training.steps", 6)
    assert "this resume changes model.converters ['float8'] -> []" in out
    assert off[0]["loss"] == pytest.approx(runs["fsdp"][2][5]["loss"], abs=BOUND)
    out, _, on = train(tmp_path, *args, "--training.steps", 7, "--model.converters", "float8")
    assert "this resume changes model.converters [] -> ['float8']" in out
    assert on[-1]["step"] == 7 and math.isfinite(on[-1]["loss"])


@pytest.mark.slow
def test_float8_checkpoint_exports_to_hugging_face(runs, tmp_path):
    """dcp2hf of the float8 run's step-10: plain fp32 weights under Meta's names, same logits in transformers."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM
    from model import ModelArgs, Transformer
    step = runs["fsdp"][3] / "checkpoint" / "step-10"
    meta = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    args = ModelArgs(**json.load(open(step / "params.json")))
    ours = Transformer(args)
    sd = {f"model.{k}": torch.empty_like(w) for k, w in ours.state_dict().items()}
    assert {k for k in meta if k.startswith("model.")} == set(sd) and len(sd) == 9 * args.n_layers + 3
    assert all(meta[k].properties.dtype == torch.float32 for k in sd)
    dcp.load(sd, checkpoint_id=str(step), no_dist=True)
    ours.load_state_dict({k[len("model."):]: w for k, w in sd.items()})
    proc = subprocess.run([sys.executable, "checkpoint_convert.py", "dcp2hf", "--input_dir", str(step),
                           "--output_dir", str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max() < 1e-4


H100 = ("torch.cuda.is_available = lambda: True; torch.cuda.get_device_capability = lambda i: (9, 0); "
        "torch.cuda.get_device_name = lambda i: 'NVIDIA H100 80GB HBM3'")
ERRORS = {  # name: (python prelude that fakes the machine, extra args, the one line's text)
    "rowwise_all_gather": ("", ["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
                           "float8.enable_fsdp_float8_all_gather = True: must be false unless float8.recipe_name is tensorwise"),
    "unknown_converter": ("", ["--model.converters", "float8,fp4"], "model.converters = ['float8', 'fp4']: must be"),
    "no_torchao": ("sys.modules['torchao'] = None", [], "needs torchao: pip install torchao==0.18.0"),
    "a100": ("torch.cuda.is_available = lambda: True; torch.cuda.get_device_capability = lambda i: (8, 0); "
             "torch.cuda.get_device_name = lambda i: 'NVIDIA A100-SXM4-80GB'", [],
             "float8 needs float8 matmuls (H100, H200, B200, MI300 or newer), which this NVIDIA A100-SXM4-80GB lacks"),
    "auto_filter_gw_hp": ("", ["--float8.recipe_name", "rowwise_with_gw_hp", "--float8.filter_fqns",
                               "output,auto_filter_small_kn"],
                          "float8.filter_fqns: torchao has no 'auto_filter_small_kn' table for rowwise_with_gw_hp"),
    "precompute_alone": ("", ["--float8.precompute_float8_dynamic_scale_for_fsdp"],
                         "precompute_float8_dynamic_scale_for_fsdp = True needs float8.enable_fsdp_float8_all_gather"),
    "rowwise_fp32_on_h100": (H100, ["--float8.recipe_name", "rowwise", "--training.mixed_precision_param", "float32"],
                             "float8.recipe_name = 'rowwise' needs training.mixed_precision_param = bfloat16 on a GPU"),
    "tokens_on_h100": (H100, ["--training.seq_len", 255, "--training.local_batch_size", 1],
                       "training.local_batch_size x seq_len = 255 tokens per micro-batch: float8 matmuls on a GPU"),
    "mi250x": ("torch.cuda.is_available = lambda: True; torch.cuda.get_device_capability = lambda i: (9, 0); "
               "torch.version.hip = '6.2'; torch.cuda.get_device_name = lambda i: 'AMD Instinct MI250X'", [],
               "which this AMD Instinct MI250X lacks"),
}


# One process imports torch and torchao once; each case runs train.py as __main__ in a forked child of it, with
# its prelude, and writes its exit code, stdout and stderr (a fork keeps one case's fakes out of the next).
FORKED = """import json, os, runpy, sys, tempfile, torch, torchao
for name, (prelude, argv) in json.loads(sys.argv[1]).items():
    out = [tempfile.TemporaryFile(mode="w+") for _ in "12"]
    pid = os.fork()
    if pid == 0:
        os.dup2(out[0].fileno(), 1), os.dup2(out[1].fileno(), 2)
        exec(prelude)
        sys.argv = argv
        runpy.run_path("train.py", run_name="__main__")
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps([name, code, *[(f.seek(0), f.read())[1] for f in out]]))
"""


@pytest.fixture(scope="module")
def config_errors(tmp_path_factory):
    """{case: (exit code, stdout, stderr, its dump folder)} of train.py with each case of ERRORS."""
    root, cases = tmp_path_factory.mktemp("errors"), {}
    for name, (prelude, extra, _) in ERRORS.items():
        cases[name] = (prelude, ["train.py", "--config", "configs/debug_model.toml", "--job.dump_folder",
                                 str(root / name), "--model.converters", "float8", *map(str, extra)])
    proc = subprocess.run([sys.executable, "-c", FORKED, json.dumps(cases)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {x[0]: (*x[1:], root / x[0]) for x in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("name", ERRORS)
def test_float8_errors_are_one_line_at_config_time(name, config_errors):
    code, stdout, stderr, dump = config_errors[name]
    assert code == 2, stderr[-2000:]
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and ERRORS[name][2] in stderr, stderr
    assert stdout == "" and not dump.exists()  # nothing half-written


def test_config_lists_and_the_conversion_keep_meta_names():
    cfg = T.load_config(["--config", "configs/debug_model.toml", "--model.converters", "float8",
                         "--float8.filter_fqns", "output,w2"])
    assert cfg.model.converters == ["float8"] and cfg.float8.filter_fqns == ["output", "w2"]
    assert T.load_config(["--float8.filter_fqns", "[]"]).float8.filter_fqns == []
    assert T.Config().float8.filter_fqns == ["output"] and T.Config().model.converters == []
    with pytest.raises(T.ConfigError, match="filter_fqns: expected list"):
        config._set(T.Config(), "float8", "filter_fqns", [1], "x.toml")
    with torch.device("meta"):
        model = T.Transformer(T.flavor_args(cfg, vocab_size=2048))
    names = list(model.state_dict())
    float8.convert(model, cfg.float8, cfg.model.converters, False, torch.device("cpu"))
    assert list(model.state_dict()) == names  # checkpoints, converters and the HF export see the same keys
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["output"] == kinds["layers.0.feed_forward.w2"] == "Linear"
    assert kinds["layers.0.attention.wq"] == kinds["layers.5.feed_forward.w3"] == "Float8Linear"


def test_auto_filter_keeps_the_layers_float8_does_not_speed_up(caplog):
    """torchtitan's "auto_filter_small_kn" in filter_fqns: torchao's H100 table of the matmul sizes each recipe speeds
    up. At the 1B width (dim 2048, hidden 8192, 8 KV heads), rowwise converts only w1 and w3 (N 8192 x K 2048); the
    attention's and w2 (N 2048) stay in bf16. tensorwise converts every block's Linear but wk and wv (N 512, K 2048)."""
    kept = {}
    for recipe in ("rowwise", "tensorwise"):
        cfg = T.load_config(["--config", "configs/debug_model.toml", "--model.flavor", "1B", "--model.converters",
                             "float8", "--float8.recipe_name", recipe, "--float8.filter_fqns",
                             "output,auto_filter_small_kn"])
        with torch.device("meta"):
            model = T.Transformer(T.flavor_args(cfg, vocab_size=2048))
        with caplog.at_level(logging.INFO, logger="train"):
            float8.convert(model, cfg.float8, cfg.model.converters, False, torch.device("cpu"))
        kept[recipe] = {n.split(".")[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear}
        assert f"float8 {recipe} (torchao); Linear layers kept in high precision: layers.*.attention.wk" in caplog.text
    assert kept == {"rowwise": {"wq", "wk", "wv", "wo", "w2", "output"}, "tensorwise": {"wk", "wv", "output"}}


def test_memory_estimate_counts_the_float8_all_gather():
    import bench
    from pretrain import memory
    base = ["--config", "configs/llama3_8b.toml", "--training.mixed_precision_param", "bfloat16"]
    cfg, model, sizes = bench.planned(base, 8)
    plain = bench.estimated(cfg, model, sizes, cuda=True)
    cfg, model, sizes = bench.planned(base + FSDP_F8, 8)
    f8 = bench.estimated(cfg, model, sizes, cuda=True)
    linear = sum(q.numel() for q in model.layers[0].parameters() if q.ndim == 2)  # one block's Linear weights
    assert plain["gathered"] - f8["gathered"] == linear  # 2 bytes -> 1 for the gathered block
    assert plain["activations"] == f8["activations"]


def test_gpu_rules_that_follow_torchtitan(monkeypatch, caplog):
    """What a GPU run gets that the CPU's emulation does not need: inductor's precision casts for rowwise, a
    warning for float8 without compile, and the float8 TP styles on CUDA only (ROCm keeps the plain ones)."""
    import torch._inductor.config as inductor
    monkeypatch.setattr(inductor, "emulate_precision_casts", False)
    cfg = T.load_config(["--config", "configs/debug_model.toml", "--model.converters", "float8"])

    def converted(*args):
        with torch.device("meta"):
            model = T.Transformer(T.flavor_args(T.load_config(["--config", "configs/debug_model.toml", *args]),
                                                vocab_size=2048))
        cfg = T.load_config(["--config", "configs/debug_model.toml", "--model.converters", "float8", *args])
        float8.convert(model, cfg.float8, cfg.model.converters, cfg.compile.enable, torch.device("cuda"))
        return model

    model = converted()
    assert not inductor.emulate_precision_casts
    assert "float8 without compile.enable is slower than bf16" in caplog.text
    assert float8.tp_styles(model, "cuda", "tensorwise") is not None
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert float8.tp_styles(model, "cuda", "tensorwise") is None
    caplog.clear()
    converted("--float8.recipe_name", "rowwise", "--compile.enable")
    assert inductor.emulate_precision_casts and "without compile" not in caplog.text
    assert cfg.model.converters == ["float8"]


def test_checkpoints_unwrap_only_torchaos_float8_weight():
    """Another tensor subclass in the state dict is an error, not its first inner tensor saved as the weight."""
    from torch.testing._internal.two_tensor import TwoTensor
    T.logging.disable(T.logging.WARNING)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    T.logging.disable(T.logging.NOTSET)
    w = torch.randn(16, 16)
    wrapped = WeightWithDynamicFloat8CastTensor(w, None, torch.float8_e4m3fn)
    assert type(float8.plain(wrapped)) is torch.Tensor and float8.plain(wrapped).data_ptr() == w.data_ptr()
    with pytest.raises(TypeError, match="a TwoTensor in the state dict: checkpoints unwrap only torchao's "):
        float8.plain(TwoTensor(torch.randn(4), torch.randn(4)))
