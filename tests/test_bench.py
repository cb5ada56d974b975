"""bench.py runs end to end on CPU (its numbers go to the README; here only that it works and reports)."""

import argparse
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import DEVICES, SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Each bench.py run below trains 2 steps, the first untimed (one timed step is a rate), mostly of the SMALL
# shape: each launch costs ~4.5 s of imports, more than the steps.
def bench(*args):
    proc = subprocess.run([sys.executable, "bench.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_matrix_runs_every_combination_and_reports_failures():
    # 2 blocks at the config's seq 256, not SMALL: at seq 64 the activations full AC saves round away in the
    # estimate's 2 decimals (0.38 GiB both)
    out = bench("matrix", "--config", "configs/debug_model.toml", "--model.n_layers", "2", "--steps", "2",
                "--warmup", "1", "--vary", "activation_checkpoint.mode=none,full",
                "--vary", "training.local_batch_size=4,3")  # 3 is not a multiple of the 2 data streams
    rows = [ln for ln in out.splitlines() if ln.startswith("| none") or ln.startswith("| full")]
    assert len(rows) == 4, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[1] == "3":  # a bad combination is a row that says why, and the next one still runs
            assert "failed: error: data.num_streams = 2 must be a multiple" in cells[2] and cells[-1] == "-"
        else:
            assert re.fullmatch(r"[\d,]+", cells[2]) and cells[4] == "n/a" and float(cells[5]) > 0, row
    est = {tuple(c.strip() for c in r.strip("|").split("|")[:2]): r.strip("|").split("|")[-1] for r in rows}
    assert float(est[("full", "4")]) < float(est[("none", "4")])  # bench.py's estimate, per run


def test_memory_prints_the_estimate_for_a_big_flavor_with_fewer_layers(capsys):
    import bench as b

    def memory(*args):
        b.main(["memory", "--config", os.path.join(ROOT, "configs/llama3_8b.toml"), *args])
        return capsys.readouterr().out

    full, short = memory("--world_size", "8"), memory("--world_size", "1", "--model.n_layers", "8")
    gib = [float(re.search(r"estimate per device: ([\d.]+) GiB", o).group(1)) for o in (full, short)]
    assert 20 < gib[0] < 80 and gib[1] > gib[0]  # one GPU holds all states of the 8-layer model
    # Whether it fits the two GPUs the configs are written for: "fits" leaves a fifth to the allocator.
    assert re.search(r"^H100 80 GB: fits \(\d+% of its memory\)\nH200 141 GB: fits \(\d+% of its memory\)$", full, re.M)
    # 167 GiB: 8B's states alone are 120 GiB; one GPU trains without FSDP, under autocast, which keeps a bf16 copy of
    # the blocks' weights and an fp32 residual stream for backward
    whole = memory("--world_size", "1")
    assert "H100 80 GB: too big (209%" in whole and "H200 141 GB: too big (119%" in whole, whole
    assert "H100" not in memory("--world_size", "1", "--device", "cpu")


def test_memory_refuses_a_missing_world_size_for_real_flavors(capsys):
    import bench as b

    with pytest.raises(SystemExit) as e:
        b.main(["memory", "--config", os.path.join(ROOT, "configs/llama3_8b.toml")])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.startswith("error: --world_size is missing"), out + err
    assert len(err.strip().splitlines()) == 1
    b.main(["memory", "--config", os.path.join(ROOT, "configs/debug_model.toml")])  # 1 process is the default
    assert "estimate per device" in capsys.readouterr().out


def test_help_documents_every_option_the_readme_uses(capsys):
    """`bench.py WHAT --help` lists every option the README and the docstring use with that WHAT."""
    import bench as b

    with open(os.path.join(ROOT, "README.md")) as f:
        docs = f.read() + b.__doc__
    uses = {}
    for what, command in re.findall(r"bench\.py ([a-z]+)((?:[^`|#\\\n]|\\\n)*)", docs):  # to its end or a comment
        options = {t.partition("=")[0] for t in command.split() if t[:2] == "--" and "." not in t}  # not config keys
        uses[what] = uses.get(what, set()) | options
    assert {"memory", "overhead", "titan"} <= set(uses), uses
    for what, options in uses.items():
        with pytest.raises(SystemExit) as e:
            b.main([what, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith(f"usage: bench.py {what}"), out
        assert all(o in out for o in options | {"--config"}), (what, options, out)
    with pytest.raises(SystemExit):
        b.main(["--help"])
    out = capsys.readouterr().out
    assert all(w in out for w in ("overhead", "startup", "memory", "matrix", "titan")), out


@pytest.mark.slow
def test_overhead_and_startup_run():
    out = bench("overhead", "--config", "configs/debug_model.toml", *SMALL, "--steps", "2", "--warmup", "1",
                "--repeats", "1")
    assert re.search(r"trainer / bare loop: [\d.]+ \(median of 1 pair ratios [\d.]+; medians [\d,]+ / [\d,]+ = "
                     r"[\d.]+ tokens/s\); 1-minute load average [\d.]+-[\d.]+ on \d+ cores", out), out
    out = bench("startup", "--config", "configs/debug_model.toml", "--model.n_layers", "2", "--repeats", "1")
    assert re.search(r"[\d.]+s beyond importing torch", out)


@pytest.mark.slow
def test_matrix_under_torchrun():
    out = bench("matrix", "--nproc", "2", "--config", "configs/debug_model.toml", *SMALL, "--steps", "2",
                "--warmup", "1", "--vary", "parallelism.tensor_parallel_degree=1,2")
    rows = [ln for ln in out.splitlines() if re.match(r"\| [12] \|", ln)]
    assert len(rows) == 2 and all(re.match(r"\| [12] \| [\d,]+ \|", r) for r in rows), out


@pytest.mark.parametrize("args, message", [
    (["matrix", "--vary", "training.steps"], "--vary training.steps: expected section.key="),
    (["matrix"], "--vary (none given)"),
    (["memory", "--config", "nope.toml"], "config file 'nope.toml' not found"),
    (["overhead", "--warmup", "0"], "--warmup 0: must be >= 1"),
    (["matrix", "--vary", "training.steps=5,10"], "training.steps is set by bench.py"),
    (["overhead", "--config", "configs/debug_model.toml", "--training.stpes", "3"],
     "unknown key in [training] 'stpes'"),
    (["memory", "--config", "configs/debug_model.toml", "--config", "configs/llama3_8b.toml"],
     "--config given 2 times (configs/debug_model.toml, configs/llama3_8b.toml)")])
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys, monkeypatch):
    """In this process, not a bench.py launch each (~4 s of imports): main() is what __main__ runs."""
    import bench as b

    monkeypatch.chdir(ROOT)  # the config paths are relative to the repo root, as for bench.py
    with pytest.raises(SystemExit) as e:
        b.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


# --- bench.py titan: the parts that need no torchtitan, then one real run where it is installed

def test_side_by_side_alternates_and_reports_medians_and_load(capsys):
    from pretrain import measure

    calls, loads = [], iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])

    def side(name, values):
        values = iter(values)
        return lambda: calls.append(name) or next(values)

    got = measure.side_by_side({"ours": side("ours", [100, 90, 120]), "theirs": side("theirs", [100, 100, 60])}, 3,
                               load=lambda: (next(loads), 0, 0))
    assert calls == ["ours", "theirs"] * 3  # A B A B: a change in load hits both sides
    assert got["ratios"] == [1.0, 0.9, 2.0] and got["ratio"] == 1.0  # the median pair, not the outlier
    assert got["medians"] == {"ours": 100, "theirs": 100} and got["load"] == (1.0, 9.0)
    out = capsys.readouterr().out
    assert "pair 2: ours 90, theirs 100 tokens/s per process, ratio 0.900, load 4.0 5.0 6.0" in out
    assert "ours / theirs: 1.000 (median of 3 pair ratios 1.000, 0.900, 2.000; medians 100 / 100 = 1.000" in out
    assert "1-minute load average 1.0-9.0 on" in out


def test_titan_log_parsing_takes_the_steps_after_the_warmup():
    from pretrain import titan_run

    head = "[rank0]:[titan] 2026-11-23 02:19:33,259 - root - INFO - "
    log = "\n".join([
        head + "Model llama3 bench size: 5,770,496 total parameters",
        head + "\x1b[31mstep:  1  \x1b[32mloss:  8.15635  grad_norm:  0.5575  memory: -0.00GiB(-0.00%)  "
               "\x1b[34mtps: 566  tflops: 0.02  mfu: 0.01%\x1b[39m",
        head + "step:  5  loss:  7.96  grad_norm:  0.83  memory: 0.00GiB(0.00%)  tps: 1,380  tflops: 0.05",
        head + "step: 10  loss:  7.61  grad_norm:  0.76  memory: 0.00GiB(0.00%)  tps: 1,000  tflops: 0.05",
        head + "step: 15  loss:  6.53  grad_norm:  1.28  memory: 0.00GiB(0.00%)  tps: 1,500  tflops: 0.05"])
    assert titan_run.steady_tps(log, 5) == pytest.approx(1200)  # harmonic mean of 1,000 and 1,500: equal tokens per record
    assert titan_run.steady_tps(log, 15) is None  # nothing after the warmup: a failed or cut-short run


def test_titan_runs_torchtitan_on_our_shapes_and_tokens_per_step(tmp_path, monkeypatch):
    import argparse
    import gzip
    import json

    import bench as b
    import data
    from pretrain import titan_run

    cfg, model, sizes = b.planned(["--config", os.path.join(ROOT, "configs/debug_model.toml"),
                                           "--training.seq_len", "512", "--activation_checkpoint.mode", "selective"], 2)
    for version in ("0.3.0", "0.2.2"):  # the CLI of the torchtitan the Python has
        monkeypatch.setattr(titan_run, "titan_version", lambda python: version)
        args = argparse.Namespace(nproc=2, steps=30, warmup=10, device="cpu")
        cmd = titan_run.titan_command(cfg, model.args, sizes, args, str(tmp_path))
        assert cmd[cmd.index("pretrain.titan_run") - 1] == "-m"  # run as a module from the root: it imports model.py
        assert cmd[cmd.index("pretrain.titan_run") + 2] == "cpu"
        spec = json.loads(cmd[cmd.index("pretrain.titan_run") + 1])
        assert spec == {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 2048,
                        "multiple_of": 256, "ffn_dim_multiplier": None, "norm_eps": 1e-5, "rope_theta": 500000.0,
                        "device": "cpu", "lr": cfg.optimizer.lr, "ac": "selective", "ac_option": "op"}
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--training.local_batch_size"] == "8" and flags["--training.global_batch_size"] == "16"
        assert flags["--training.seq_len"] == "512" and flags["--parallelism.data_parallel_shard_degree"] == "2"
        assert flags["--training.mixed_precision_param"] == "float32"
        assert flags["--metrics.log_freq"] == "10" and flags["--training.steps"] == "30" and "--compile.enable" not in cmd
        if version == "0.2.2":
            assert flags["--activation_checkpoint.mode"] == "selective" and flags["--model.flavor"] == "bench"
        else:  # its model, lr and AC from titan_config (the spec), its data under [dataloader]
            assert flags["--module"] == "pretrain.titan_run" and flags["--config"] == "titan_config"
            assert flags["--dataloader.dataset"] == "c4_test" and flags["--dump_folder"] == str(tmp_path)
    # Its tokenizer files give our ids (transformers converts; torchtitan reads them with `tokenizers`).
    from tokenizers import Tokenizer

    titan_run.titan_tokenizer(cfg, str(tmp_path))
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = data.Tokenizer(os.path.join(ROOT, cfg.model.tokenizer_path))
    with gzip.open(os.path.join(ROOT, "assets/data/c4/en/c4-train.00000-of-00002.json.gz"), "rt") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(50))]
    assert [theirs.encode(t).ids for t in texts] == [ours.encode(t, bos=False, eos=False) for t in texts]
    special = [theirs.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>")]
    assert special == [ours.bos_id, ours.eos_id]


def test_titan_refuses_without_torchtitan_and_bad_counts(monkeypatch, capsys):
    import bench as b

    from pretrain import titan_run
    monkeypatch.setattr(titan_run, "titan_version", lambda python: "")
    for argv, message in [(["titan"], "has no torchtitan: pip install --no-deps -r requirements-bench.txt"),
                          (["titan", "--nproc", "0"], "--nproc 0: must be >= 1"),
                          (["titan", "--steps", "15"], "--steps must be a multiple of --warmup")]:
        with pytest.raises(SystemExit) as e:
            b.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan (requirements-bench.txt)")
def test_titan_side_by_side_runs():
    # One process a side: the 2-process command is checked by
    # test_titan_runs_torchtitan_on_our_shapes_and_tokens_per_step
    out = bench("titan", "--config", "configs/debug_model.toml", *SMALL, "--nproc", "1", "--steps", "2",
                "--warmup", "1", "--repeats", "1", "--device", "cpu")
    assert "debugmodel 2 layers, seq 64, 512 tokens per step, 1 processes on cpu; torchtitan 0." in out, out
    assert re.search(r"pair 1: ours [\d,]+, torchtitan [\d,]+ tokens/s per process, ratio [\d.]+", out), out
    assert re.search(r"ours / torchtitan: [\d.]+ \(median of 1 pair ratios", out), out


# --- the vocabulary bench.py counts is the run's (train.model_args: the tokenizer's)

def test_memory_and_the_bare_loop_take_the_tokenizers_vocabulary(capsys, monkeypatch):
    """With the bundled 2,048-token tokenizer the loss is over 2,048 words, not the flavor's 128,256: an 8B-wide
    run here is estimated (memory, matrix, gpu) and built (titan, the bare loop) with the vocabulary it trains."""
    import bench as b
    import model
    import train

    debug = ["--config", os.path.join(ROOT, "configs/debug_model.toml")]
    b.main(["memory", *debug])
    loss = float(re.search(r"\bloss ([\d.]+)", capsys.readouterr().out).group(1))
    # fp32 log-probs and their backward at the longest sequence of the config's [[phases]], 512: 0.09, not 5.9 GiB
    assert loss == round(8 * 512 * 12 * 2048 / 2**30, 2)
    monkeypatch.chdir(ROOT)  # the config's tokenizer path is relative to the repo root, as for train.py
    cfg, wide, sizes = b.planned([*debug, "--model.flavor", "8B", "--model.n_layers", "1"], 1)
    assert (wide.args.dim, wide.args.vocab_size) == (4096, 2048)  # 8B's width, the tokenizer's words
    assert b.estimated(cfg, wide, sizes, cuda=True)["loss"] == 8 * 256 * 12 * 2048
    built = []  # the bare loop's model
    monkeypatch.setattr(model, "Transformer", lambda args, real=model.Transformer: built.append(args) or real(args))
    tiny = ["--model.n_layers", "1", "--training.seq_len", "8", "--training.local_batch_size", "1"]
    cfg = train.load_config([*debug, *tiny])
    assert b.bare_tps(cfg, steps=1, warmup=0) > 0 and built[0].vocab_size == 2048


# --- bench.py gpu: the one command for a GPU node, run here at tiny shapes

def summary_rows(folder) -> dict:
    """{step: its cells after the name} of summary.md's table."""
    with open(os.path.join(folder, "summary.md")) as f:
        rows = [ln.strip().strip("|").split("|") for ln in f if ln.startswith("| ") and not ln.startswith("| step")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


STEPS = ["self-test", "1B", "8B-wide", "8B-wide-float8-rowwise", "8B-wide-float8-tensorwise", "8B-wide-block-causal",
         "8B-wide-muon", "8B-full-ac"]


def test_gpu_skips_what_no_longer_fits_the_budget_and_says_so(tmp_path, monkeypatch, capsys):
    import bench as b

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # bench.py gpu --device cpu hides any GPU from its runs
    monkeypatch.chdir(ROOT)
    b.main(["gpu", "--device", "cpu", "--budget", "1", "--out", str(tmp_path)])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    rows = summary_rows(tmp_path)
    assert list(rows) == STEPS
    kinds = {step: kind for step, kind, _ in b.gpu_plan(b.GPU_SHAPES["cpu"], 3, 5)}
    for step, cells in rows.items():  # nothing ran: no log, a line that says why
        need = b.STEP_SECONDS["cpu"][kinds[step]]
        assert re.fullmatch(rf"skipped: [01] s of the 1 s budget left, it needs about {need} s", cells[0]), cells
        assert not os.path.exists(tmp_path / f"{step}.log")
    summary = (tmp_path / "summary.md").read_text()
    assert "The debugmodel width: 3 blocks fit 0.1 GiB by the estimate" in summary, summary
    assert "MFU counts attention in full (PaLM's, torchtitan's)." in summary  # the convention beside the figures
    debug = ["--config", "configs/debug_model.toml", *b.GPU_SHAPES["cpu"]["flags"], *b.GPU_SHARED]
    assert b.blocks_that_fit([*debug, "--model.n_layers", "2"], b.CPU_CAPACITY) == 2  # at most the user's count
    assert summary.rstrip().endswith("of the 1 s budget.") and capsys.readouterr().out.count("skipped") == 8
    with pytest.raises(SystemExit) as e:
        b.main(["gpu", "--device", "cpu", "--only", "8B", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--only 8B: the steps are self-test, 1B, 8B-wide, " in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_runs_every_step_end_to_end_on_the_cpu(tmp_path):
    """bench.py gpu --device cpu: the self-test and every run at tiny shapes, a row each and each step's log."""
    out = bench("gpu", "--device", "cpu", "--budget", "1200", "--out", str(tmp_path))  # a loaded machine skips none
    rows = summary_rows(tmp_path)
    assert list(rows) == STEPS, out
    assert re.fullmatch(r"`pytest -m gpu` passed: \d+ skipped, \d+ deselected in [\d.]+s", rows["self-test"][0])
    blocks = re.search(r"debugmodel width: (\d+) blocks fit", out).group(1)
    for step in STEPS[1:]:
        what, tps, tflops, mfu, peak, allocated, estimate, seconds = rows[step]
        assert re.fullmatch(r"[\d,]+", tps) and mfu == "n/a" and allocated == "n/a", (step, rows[step])
        assert float(peak) > 0 and float(estimate) > 0 and int(seconds) >= 0
        assert ("8B-wide" not in step or f"{blocks} blocks" in what) and "vocab 2,048, seq 64 x 2, fp32, eager" in what
        assert os.path.getsize(tmp_path / f"{step}.log") > 0
    assert "float8 rowwise, small layers bf16" in rows["8B-wide-float8-rowwise"][0]  # torchao's filter: its setting
    assert "block_causal" in rows["8B-wide-block-causal"][0] and "small" not in rows["8B-wide-float8-tensorwise"][0]
    assert "Muon" in rows["8B-wide-muon"][0] and "Muon" not in rows["8B-wide"][0]
    # the most blocks that fit with bf16 optimizer states and full AC: 5 of the debug model's 6 (8B's 32 on an H200)
    assert rows["8B-full-ac"][0].startswith("debugmodel width, 5 blocks,") and blocks == "3"
    assert "AC full, bf16 optimizer states" in rows["8B-full-ac"][0] and "bf16 optimizer" not in rows["8B-wide"][0]
    assert re.search(r"\d+ skipped, \d+ deselected", (tmp_path / "self-test.log").read_text())  # no GPU: skipped
    assert "Vocabulary 2,048 words." in (tmp_path / "summary.md").read_text()  # the header names it


def test_device_timeline_counts_overlaps_once_and_finds_the_gaps():
    from pretrain import measure
    kernels = [(20, 30, "c"), (0, 10, "a"), (5, 12, "b"), (31, 35, "d"), (32, 33, "e")]  # (start, end, name)
    busy, span, gaps = measure.device_timeline(kernels)
    assert (busy, span) == (10 + 2 + 10 + 4, 35)
    assert gaps == [(8, "b", "c"), (1, "c", "d")]  # longest first, between the kernels that bound them


def test_the_profile_counts_the_device_idle_around_the_loops_host_sync():
    """The agreement's host sync drains the device's queue: the device then waits for the host to launch the
    optimizer step. The report counts that gap, a step at a time, beside the host's time in the sync."""
    from pretrain import measure
    kernels = [(0, 100, "backward"), (140, 400, "optimizer"), (400, 900, "forward")]  # one step of 1,000 us
    assert [measure.idle_at(kernels, t) for t in (50, 120, 400, 950)] == [0, 40, 0, 0]
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 5},
              {"ph": "X", "cat": "user_annotation", "name": "StepAgreement.on_step", "ts": 90, "dur": 30}]
    line = measure.agreement_cost(events, kernels, active=1)
    assert line == ("The loop's host sync (`StepAgreement.on_step`): 0.03 ms a step on the host (3.0%); "
                    "the device idle around its end 0.04 ms a step (4.00%).")
    assert measure.agreement_cost(events, [], active=1).endswith("0.03 ms a step on the host (3.0%).")
    assert measure.agreement_cost(events[:2], kernels, 1) == "No `StepAgreement.on_step` range in the profiled steps."


@pytest.mark.parametrize("device", DEVICES)
def test_profile_says_where_the_steps_time_goes(device, tmp_path, monkeypatch, capsys):
    """bench.py profile: train.py in-process, profiled for --active steps; on a GPU its kernels, how busy the
    device was and the allocator's retries, on the CPU its ops; and the Chrome trace. With Muon, whose inner AdamW
    steps too: the profiler still steps once a training step."""
    import gzip
    import json

    import bench as b

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # restored after
    monkeypatch.chdir(ROOT)
    b.main(["profile", "--device", device, "--config", "configs/debug_model.toml", *SMALL, "--optimizer.name", "Muon",
            "--warmup", "2", "--active", "2", "--top", "5", "--out", str(tmp_path)])
    report = (tmp_path / "profile.md").read_text()
    assert report.startswith("# bench.py profile: steps 3-4") and report in capsys.readouterr().out
    sync = r"The loop's host sync \(`StepAgreement.on_step`\): [\d.]+ ms a step on the host \([\d.]+%\)"
    assert re.search(sync + (r"; the device idle around its end [\d.]+ ms" if device == "cuda" else r"\.\n"), report)
    if device == "cuda":
        busy = float(re.search(r"Device busy ([\d.]+)% of [\d,.]+ ms", report).group(1))
        assert 0 < busy <= 100 and "Allocator: " in report and "| kernel | calls | ms a step |" in report
    else:
        assert re.search(r"aten::mm +[\d.]+%", report), report
    with gzip.open(tmp_path / "trace.json.gz") as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if e["name"].startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps  # the profiler counts from 0: steps 3 and 4
    agreements = [e for e in events if e["name"] == "StepAgreement.on_step" and e.get("cat") == "user_annotation"]
    assert len(agreements) == 2  # one a training step: two steps, not one step's two optimizers


def test_gpu_runs_measure_metas_vocabulary(monkeypatch):
    """On a GPU every run trains Llama 3's 128,256 words (llama-models' tokenizer.model), not the bundled 2,048,
    unless --model.tokenizer_path or --model.vocab_size says otherwise; without llama-models, the bundled
    tokenizer's output padded to 128,256 words, and the summary's header says so."""
    import bench as b
    from pretrain import measure
    meta = measure.meta_tokenizer()
    assert meta.endswith("llama3/tokenizer.model")  # requirements-dev.txt installs llama-models
    assert b.meta_vocabulary(["--config", "x"], "cuda") == ["--model.tokenizer_path", meta]
    assert b.meta_vocabulary(["--model.tokenizer_path", "mine"], "cuda") == []
    assert b.meta_vocabulary([], "cpu") == []  # --device cpu: the bundled data's own, tiny shapes
    assert b.meta_vocabulary(["--model.vocab_size", "4096"], "cuda") == []
    monkeypatch.setattr(measure, "meta_tokenizer", lambda: "")
    padded = b.meta_vocabulary(["--config", "configs/debug_model.toml"], "cuda")
    assert padded == ["--model.vocab_size", "128256"]
    args = argparse.Namespace(device="cpu", budget=1)
    shape = {"steps": 20, "warmup": 10, "wide": "8B"}
    header = "\n".join(b.summary_header("x", args, ["--config", "configs/debug_model.toml", *padded], shape, 1, 2**30))
    assert "Vocabulary 128,256 words padded from the bundled tokenizer's (Llama 3's step and memory, not its loss)." in header


def test_a_gpu_profile_trains_metas_vocabulary(tmp_path, monkeypatch):
    """bench.py profile on a GPU profiles the step users train, with 128,256 words, as the gpu, matrix and titan runs
    do (here CUDA is pretended, and the profiled run only has its config taken)."""
    import torch

    import bench as b
    import train
    from pretrain import measure
    profiled = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # restored after
    monkeypatch.setattr(measure, "profile_steps", lambda run, *_: profiled.append(run) or ([], None))
    monkeypatch.setattr(measure, "report", lambda *_: [])
    monkeypatch.setattr(train, "main", lambda cfg: cfg)
    b.main(["profile", "--config", os.path.join(ROOT, "configs/debug_model.toml"), "--out", str(tmp_path)])
    cfg = profiled[0]()  # the run profile_steps was handed: train.main(cfg)
    assert cfg.model.tokenizer_path == measure.meta_tokenizer() != ""
