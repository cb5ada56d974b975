"""[[phases]] (pretrain/phases.py): the batch, sequence and mixture change at a step, the last phase may
anneal, and a resume may add phases to come but not change the past. CPU; the runs are 2 ranks (FSDP) and 1.

One 3-phase run is the reference: phase 0 is the debug config (global batch 8 of 64 tokens), phase 1 from
step 4 doubles the batch and the sequence, phase 2 from the step at 7,000 tokens (step 7) upsamples FineMath
and anneals."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conftest import run_training  # noqa: E402
import train  # noqa: E402
from data import DataLoader, Tokenizer  # noqa: E402
from pretrain import phases  # noqa: E402
from pretrain.resume_keys import changes  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402

DEBUG = os.path.join(ROOT, "configs", "debug_model.toml")
RAMP = """
[[phases]]
start_step = 4
global_batch_size = 16
seq_len = 128
"""
ANNEAL = """
[[phases]]
start_tokens = 7000
weights = { c4 = 0.1, finemath = 0.7 }
anneal = true
"""


def without_phases(text: str) -> str:
    """A config's TOML with its [[phases]] tables left out: each runs to the next blank line."""
    return re.sub(r"^\[\[phases\]\]\n(.+\n)*", "", text, flags=re.M)


def config(tmp_path, *tables, name="phased.toml") -> str:
    """The debug config with these [[phases]] tables instead of its own (TOML only: no --phases flag)."""
    path = tmp_path / name
    path.write_text(without_phases(open(DEBUG).read()) + "".join(tables))
    return str(path)


def load(path, *args):
    return train.load_config(["--config", path, "--training.seq_len", "64", *map(str, args)])


def test_a_config_without_phases_is_one_phase_of_its_own_values(tmp_path):
    cfg = train.load_config(["--config", config(tmp_path)])
    plan = train.validate(cfg, 1)["phases"]
    assert [(s.index, s.first_step, s.global_batch_size, s.seq_len) for s in plan.stages] == [(0, 1, 8, 256)]
    assert plan.stages[0].weights == (0.5, 0.15, 0.15, 0.2) and plan.keys() == []
    assert plan.tokens_through(50) == 50 * 8 * 256


def test_phases_resolve_their_starts_batches_and_weights(tmp_path):
    cfg = load(config(tmp_path, RAMP, ANNEAL))
    plan = train.validate(cfg, 1)["phases"]
    # phase 0 trains 3 steps of 8 x 64; phase 1's 16 x 128 reach 7,000 tokens in 3 more: phase 2 starts at step 7
    assert [(s.first_step, s.global_batch_size, s.seq_len, s.grad_accum) for s in plan.stages] == [
        (1, 8, 64, 1), (4, 16, 128, 2), (7, 16, 128, 2)]
    assert plan.stages[2].weights == (0.1, 0.15, 0.15, 0.7) and plan.stages[2].anneal  # unnamed sources keep theirs
    assert plan.tokens_through(3) == 3 * 512 and plan.tokens_through(6) == 1536 + 3 * 2048
    assert [plan.at(n).index for n in (1, 3, 4, 6, 7, 50)] == [0, 0, 1, 1, 2, 2]
    # the config file round-trips through config.toml, [[phases]] and inline weights included
    (tmp_path / "again.toml").write_text(train.config.to_toml(cfg))
    assert train.load_config(["--config", str(tmp_path / "again.toml")]) == cfg


@pytest.mark.parametrize("table, line", [
    ("start_step = 4\nstart_tokens = 10", "phase 1 (the [[phases]] table number 1): give start_step or start_tokens"),
    ("start_step = 1", "starts at step 1, not after phase 0's first step 1; the phases' starts must increase"),
    ("start_step = 4\nglobal_batch_size = 12", "global_batch_size = 12 must be a multiple of local_batch_size 8"),
    ("start_step = 4\nseq_len = 4096", "seq_len = 4096 must be at most the model's max_seq_len 2048"),
    ("start_step = 4\nweights = { c5 = 1 }", "phase 1 (the [[phases]] table number 1): weights: unknown source 'c5'; "
                                             "valid: c4, zyda2_dclm"),
    ("start_step = 4\nweights = { c4 = -1 }", "weights.c4 = -1 must be a number >= 0"),
    ("start_step = 4\nweights = { c4 = 0, zyda2_dclm = 0, zyda2_fwe3 = 0, finemath = 0 }", "its weights sum to 0"),
    ("start_step = 4\nanneal = true\n[[phases]]\nstart_step = 6", "anneal = true is for the last phase only"),
    ("start_step = 4\nbatch = 16", "unknown key 'batch' in [[phases]] 0"),
])
def test_each_bad_phase_is_one_line_naming_it(tmp_path, table, line):
    with pytest.raises(ConfigError) as e:
        train.validate(load(config(tmp_path, f"\n[[phases]]\n{table}\n")), 1)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_phases_are_set_in_toml_only_and_left_out_by_phases_none():
    with pytest.raises(ConfigError, match=r"phases is set by \[\[phases\]\] tables in the TOML file only"):
        train.load_config(["--config", DEBUG, "--phases.start_step", "3"])
    assert len(train.load_config(["--config", DEBUG]).phases) == 2
    assert train.load_config(["--config", DEBUG, "--phases", "none"]).phases == []
    with pytest.raises(ConfigError, match="argument --phases: invalid choice: 'all'"):
        train.load_config(["--config", DEBUG, "--phases", "all"])


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"))


@pytest.fixture(scope="module")
def sources():
    srcs = train.load_config(["--config", DEBUG]).data.sources
    for s in srcs:
        s.path = os.path.join(ROOT, s.path)
    return srcs


def shares(loader, before: dict) -> dict:
    now = loader.source_tokens()
    total = sum(now[k] - before[k] for k in now)
    return {k: (now[k] - before[k]) / total for k in now}


def test_a_new_mixture_holds_from_the_phases_first_token_with_no_catch_up(tok, sources):
    """Phase 0 reads C4 alone; phase 1 asks for a quarter each. Counted from step 0, the mixer would owe the
    other three sources every token phase 0 gave C4 and read them alone until their cumulative shares caught
    up: C4 would get nothing for a long while. Counted within the phase, C4 gets its quarter at once, and each
    share is within 1 point over the phase."""
    loader = DataLoader(sources, tok, 256, 4, 0, 1, num_streams=1)
    loader.set_phase(0, 256, [1, 0, 0, 0])
    while sum(loader.source_tokens().values()) < 200_000:
        next(loader)
    assert shares(loader, dict.fromkeys(loader.names, 0))["c4"] > 0.99
    loader.set_phase(1, 128, [1, 1, 1, 1])
    start = loader.source_tokens()
    inputs, _ = next(loader)
    assert inputs.shape == (4, 128)  # the new sequence from the phase's first window
    while sum(loader.source_tokens().values()) - sum(start.values()) < 30_000:
        next(loader)
    early = shares(loader, start)
    assert 0.15 < early["c4"] < 0.35, early  # no burst of the others: C4 reads its quarter from the start
    while sum(loader.source_tokens().values()) - sum(start.values()) < 1_000_000:
        next(loader)
    for name, share in shares(loader, start).items():
        assert abs(share - 0.25) < 0.01, (name, share)


def test_a_resume_inside_a_phase_keeps_its_counts_and_the_document_cut_at_a_boundary_goes_on(tok, sources):
    def make():
        return DataLoader(sources, tok, 64, 4, 0, 1, num_streams=2)

    reference = make()
    for _ in range(5):
        next(reference)
    reference.set_phase(1, 96, [0.1, 0, 0, 0.9])
    expected = [next(reference)[0] for _ in range(40)]
    loader = make()
    for _ in range(5):
        next(loader)
    cut = [(st.cur, st.offset) for st in loader.streams]
    loader.set_phase(1, 96, [0.1, 0, 0, 0.9])
    got = [next(loader)[0] for _ in range(10)]
    state = {s: json.loads(json.dumps(sd)) for s, sd in loader.state_dict().items()}  # as a checkpoint holds it
    loader = make()
    loader.load_state_dict(state)
    loader.set_phase(1, 96, [0.1, 0, 0, 0.9])  # the phase it was in: its counts go on, not from 0
    got += [next(loader)[0] for _ in range(30)]
    assert all(a.equal(b) for a, b in zip(got, expected))
    # each stream's first window of phase 1 went on with the document phase 0 cut, where it was cut
    assert all(cur is not None and offset > 0 for cur, offset in cut)


def test_the_anneal_decays_to_zero_and_leaves_the_steps_before_it_alone(tmp_path):
    cfg = load(config(tmp_path, RAMP, ANNEAL), "--training.steps", 12, "--lr_scheduler.warmup_steps", 2,
               "--lr_scheduler.decay_ratio", 0.5)
    plan = train.validate(cfg, 1)["phases"]
    without = phases.Plan(plan.stages[:2], plan.names)
    main = [train.lr_factor(s, cfg, without) for s in range(12)]
    lr = [train.lr_factor(s, cfg, plan) for s in range(12)]
    assert lr[:6] == main[:6]  # steps 1-6, before the anneal's first step 7
    assert lr[6:] == pytest.approx([main[6] * (1 - k / 6) for k in range(1, 7)]) and lr[11] == 0.0
    # over tokens, the decay (the last half of the run's tokens) starts later in steps: phase 1's steps are 4x
    cfg.lr_scheduler.unit = "tokens"
    by_tokens = [train.lr_factor(s, cfg, without) for s in range(12)]
    end = without.tokens_through(12)
    first = next(s for s in range(2, 12) if by_tokens[s] < 1)  # the first step decaying, 0-based
    assert without.tokens_through(first) <= end / 2 < without.tokens_through(first + 1)
    assert first > 6 and by_tokens[11] == pytest.approx(0.1)  # by steps it would decay from step 6, to min_lr_factor
    assert [train.lr_factor(s, cfg) for s in range(12)] == [train.lr_factor(s, load(config(tmp_path), "--training.steps",
        12, "--lr_scheduler.warmup_steps", 2, "--lr_scheduler.decay_ratio", 0.5)) for s in range(12)]  # noqa: E128


def test_a_resume_may_change_phases_to_come_and_append_sources_but_not_the_past(tmp_path):
    keys = train.validate(load(config(tmp_path, RAMP, ANNEAL)), 1)["phases"].keys()
    ramp_only = keys[:1]
    assert changes({"phases": ramp_only}, {"phases": keys}, 5) == []  # the anneal added at step 5: it starts at 7
    assert changes({"phases": keys}, {"phases": ramp_only}, 5) == []  # and dropped again before it began
    assert changes({"phases": keys}, {"phases": ramp_only}, 8) == ["phase 2: begun at step 7 -> dropped"]
    moved = [{**keys[0], "seq_len": 256}]
    assert changes({"phases": ramp_only}, {"phases": moved}, 3) == []  # phase 1 starts at step 4
    assert changes({"phases": ramp_only}, {"phases": moved}, 4) == ["phase 1 seq_len: 128 -> 256"]
    early = [{**keys[0], "first_step": 3}]
    assert changes({"phases": ramp_only}, {"phases": early}, 3) == ["phase 1 first_step: 4 -> 3"]
    c4 = {"name": "c4", "weight": 1.0}
    new = {"name": "recent_web", "weight": 0.0}
    assert changes({"data.sources": [c4]}, {"data.sources": [c4, new]}, 9) == []
    assert changes({"data.sources": [c4]}, {"data.sources": [c4, {**new, "weight": 0.5}]}, 9) == [
        "data.sources: 'recent_web' appended with weight 0.5 (0 until a phase weights it)"]
    assert changes({"data.sources": [c4, new]}, {"data.sources": [c4]}, 9) != []  # a source dropped
    # each source's pins replace the manifest's one sha256, which an appended source changes
    pins = {"data.source_sha256s": ["a"], "data.sources_sha256": "x"}
    assert changes(pins, {"data.source_sha256s": ["a", "b"], "data.sources_sha256": "y"}, 9) == []
    assert changes({"data.sources_sha256": "x"}, {"data.sources_sha256": "y"}, 9) == ["data.sources_sha256: 'x' -> 'y'"]


# --- runs: the reference, and resumes of copies of it -------------------------------------------------------

def train_args(cfg_path, dump, *args):
    return ["--config", cfg_path, "--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--validation.enable",
            "false", "--training.steps", "9", "--model.n_layers", "2", "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--training.global_batch_size", "8", "--checkpoint.enable",
            "--checkpoint.interval", "2", *map(str, args)]


def run(cfg_path, dump, *args, nproc=2, expect=0) -> str:
    proc = run_training(train_args(cfg_path, dump, *args), nproc)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect, out[-3000:]
    return out


def records(dump) -> dict:
    """step -> its training record, the latest where a resume trained a step again."""
    lines = (json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl")))
    return {r["step"]: r for r in lines if "loss" in r}


def resumed_from(reference, tmp_path, step: int):
    """A copy of the reference run with its checkpoints after step-`step` gone: the next start resumes there."""
    dump = shutil.copytree(reference, tmp_path / "run")
    for name in os.listdir(dump / "checkpoint"):
        if int(name.split("-")[1]) > step:
            shutil.rmtree(dump / "checkpoint" / name)
    return dump


@pytest.fixture(scope="module")
def phased(tmp_path_factory):
    """(config, dump, output) of the 3-phase reference on 2 ranks, checkpoints at 2, 4, 6, 8 and 9."""
    tmp = tmp_path_factory.mktemp("phased")
    cfg = config(tmp, RAMP, ANNEAL)
    return cfg, tmp / "run", run(cfg, tmp / "run")


@pytest.mark.slow
def test_a_phased_run_changes_batch_sequence_and_mixture_at_its_boundaries(phased):
    _, dump, out = phased
    r = records(dump)
    assert [r[s]["phase"] for s in range(1, 10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r[s]["tokens_seen"] for s in (3, 4, 6, 7, 9)] == [3 * 512, 1536 + 2048, 1536 + 3 * 2048, 9728, 13824]
    assert "phase 1 from step 4: global batch 16 x seq_len 128 = 2,048 tokens a step, grad accumulation 2;" in out
    assert "phase 2 from step 7: " in out and "finemath 0.64; the lr anneals linearly to 0 from here" in out
    assert any(line.startswith("step: 7  ") and "  phase: 2  " in line for line in out.splitlines())
    assert r[9]["lr"] == 0.0 and r[7]["lr"] < r[6]["lr"]
    # phase 2's tokens: FineMath's weight went 0.2 -> 0.64 (3 steps of 2,048 tokens: within a document or so)
    fm = (r[9]["source_tokens"]["finemath"] - r[6]["source_tokens"]["finemath"]) / (3 * 2048)
    assert fm > 0.4, fm


@pytest.mark.slow
@pytest.mark.parametrize("step, nproc", [(2, 2), (6, 1), (8, 2)])
def test_a_resume_inside_each_phase_continues_it_exactly(phased, tmp_path, step, nproc):
    """From phase 0 (its boundaries still ahead), phase 1 on one rank (num_streams 2: the same data) and the anneal."""
    cfg, reference, _ = phased
    dump = resumed_from(reference, tmp_path, step)
    out = run(cfg, dump, nproc=nproc)
    assert f"resumed from {dump}/checkpoint/step-{step}" in out
    want, got = records(reference), records(dump)
    for s in range(step + 1, 10):
        assert (got[s]["tokens_seen"], got[s]["source_tokens"]) == (want[s]["tokens_seen"], want[s]["source_tokens"])
        if nproc == 2:
            assert got[s]["loss"] == want[s]["loss"], s  # bit for bit
        else:  # 1 rank sums the batch in another order
            assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5), s


@pytest.mark.slow
def test_an_anneal_added_at_a_resume_changes_nothing_before_it(phased, tmp_path):
    cfg, reference, _ = phased
    ramp = config(tmp_path, RAMP, name="ramp.toml")
    run(ramp, tmp_path / "ramp")  # the run as it was planned before the team decided to anneal
    want, before = records(reference), records(tmp_path / "ramp")
    assert [before[s]["loss"] for s in range(1, 7)] == [want[s]["loss"] for s in range(1, 7)]
    dump = resumed_from(tmp_path / "ramp", tmp_path / "added", 6)
    out = run(cfg, dump)  # the anneal from step 7, added at the resume from step-6
    assert "resumed from" in out and "phase 2 from step 7" in out
    assert [records(dump)[s]["loss"] for s in range(7, 10)] == [want[s]["loss"] for s in range(7, 10)]


@pytest.mark.slow
def test_a_resume_that_changes_a_begun_phase_is_refused_with_one_line(phased, tmp_path):
    _, reference, _ = phased
    dump = resumed_from(reference, tmp_path, 6)
    longer = config(tmp_path, RAMP.replace("seq_len = 128", "seq_len = 256"), ANNEAL, name="changed.toml")
    out = run(longer, dump, nproc=1, expect=2)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "refusing to resume" in errors[0] and "phase 1 seq_len: 128 -> 256" in errors[0]
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2", "step-4", "step-6"]


@pytest.mark.slow
def test_plot_marks_each_phases_first_step_and_counts_its_tokens(phased, tmp_path):
    import plot

    _, dump, _ = phased
    train_records = plot.read_run(str(dump))["train"]
    assert plot.phase_starts(train_records) == {4: 1, 7: 2}
    at = plot.tokens_at(train_records)
    assert [at(s) for s in (3, 4, 9)] == [1536, 3584, 13824]  # each step its phase's tokens, not the last's
    assert plot.main([str(dump), "--x", "tokens", "--out", str(tmp_path / "curves.png")]) == 0


BEFORE_ISSUE_63 = "01397c1"  # the last commit before [[phases]]


@pytest.mark.slow
def test_a_run_without_phases_logs_the_losses_it_did_before_them(tmp_path):
    """The same 4 steps, one process, by the code before [[phases]] and by this code, without [[phases]]: the same
    losses to the last bit; and this code resumes the old code's step-2 (its streams hold no phase) to them too."""
    git = ["git", "-C", ROOT]
    if subprocess.run([*git, "cat-file", "-e", f"{BEFORE_ISSUE_63}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"commit {BEFORE_ISSUE_63} is not in this clone's history")
    plain = config(tmp_path, name="plain.toml")  # the debug config without its [[phases]]
    args = ["--training.steps", "4", "--checkpoint.interval", "2"]
    before = tmp_path / "before"
    subprocess.run([*git, "worktree", "add", "--detach", str(before), BEFORE_ISSUE_63], check=True, capture_output=True)
    try:
        argv = [sys.executable, "train.py", *train_args(plain, tmp_path / "old", *args)]
        proc = subprocess.run(argv, cwd=before, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(before)], capture_output=True)
    old = {s: r["loss"] for s, r in records(tmp_path / "old").items()}
    run(plain, tmp_path / "new", *args, nproc=1)
    assert {s: r["loss"] for s, r in records(tmp_path / "new").items()} == old
    shutil.copytree(tmp_path / "old", tmp_path / "resumed", ignore=shutil.ignore_patterns("step-4", "metrics.jsonl"))
    out = run(plain, tmp_path / "resumed", *args, nproc=1)
    assert "at step 2" in out and {s: r["loss"] for s, r in records(tmp_path / "resumed").items()} == {3: old[3], 4: old[4]}


def test_a_phases_micro_batch_keeps_float8s_rule():
    """float8 matmuls on a GPU take a multiple of 16 tokens a micro-batch: in each phase, not only the first."""
    cfg = train.load_config(["--config", DEBUG, "--model.converters", "float8", "--training.mixed_precision_param",
                             "bfloat16"])
    cfg.phases[0].seq_len = 509  # 8 x 509 tokens
    with pytest.raises(ConfigError, match=r"^phases: phase 1: training.local_batch_size x seq_len = 4072 tokens"):
        train.validate(cfg, 1, gpu=True)


def test_a_source_appended_at_a_resume_starts_unread_and_changes_nothing_before_its_phase(tok, sources):
    """A loader of three sources, saved; resumed with a fourth appended at weight 0: the same batches, until a
    phase weights it."""
    three, four = sources[:3], [dataclasses.replace(s) for s in sources]
    four[3].weight = 0.0
    reference = DataLoader(three, tok, 64, 4, 0, 1, num_streams=1)
    for _ in range(5):
        next(reference)
    state = {s: json.loads(json.dumps(sd)) for s, sd in reference.state_dict().items()}
    expected = [next(reference)[0] for _ in range(10)]
    resumed = DataLoader(four, tok, 64, 4, 0, 1, num_streams=1)
    resumed.load_state_dict(state)
    resumed.check()  # the new source is opened too
    assert all(a.equal(next(resumed)[0]) for a in expected) and resumed.source_tokens()["finemath"] == 0
    resumed.set_phase(1, 64, [1, 0, 0, 1])
    for _ in range(20):
        next(resumed)
    assert resumed.source_tokens()["finemath"] > 0


def test_the_manifests_sha256_covers_the_configured_sources_only(tmp_path, sources):
    from pretrain import data_manifest
    manifest = data_manifest.make_manifest(sources[:3])
    before = data_manifest.manifest_sha256(manifest, sources[:3])
    assert before == data_manifest.manifest_sha256(manifest)  # as checkpoints before [[phases]] hold it
    manifest["data"] += data_manifest.make_manifest(sources[3:])["data"]  # pinned by a resume, then refused
    assert data_manifest.manifest_sha256(manifest, sources[:3]) == before


def test_the_spike_window_restarts_at_a_phases_first_step_only(tmp_path):
    from pretrain import spikes
    cfg = load(config(tmp_path, RAMP))
    plan = train.validate(cfg, 1)["phases"]
    with torch.device("meta"):
        model = train.Transformer(train.flavor_args(cfg))

    class Loader:
        def set_phase(self, *args):
            pass

    guard = spikes.SpikeGuard(spikes.Spikes(window=8), "cpu")
    for step in (1, 2, 3, 4, 5):  # a run's first step; phase 1's first; a resume inside phase 1
        guard.kept = 6
        phase, flops = train.begin_phase(plan, step, loader=Loader(), guard=guard, model=model, announce=False)
        assert (phase.index, guard.kept) == ((0, 6) if step < 4 else (1, 0 if step == 4 else 6)), step
        assert flops == train.flops_per_token(model, 64 if step < 4 else 128)


@pytest.mark.slow
def test_a_source_appended_at_a_resume_is_pinned_then_and_read_by_the_phase_that_weights_it(phased, tmp_path):
    _, reference, _ = phased
    dump = resumed_from(reference, tmp_path, 6)
    held = '\n[[data.sources]]\nname = "c4_more"\npath = "assets/data/c4"\ndata_files = "en/c4-validation.*.json.gz"\nweight = 0\n'
    text = without_phases(open(DEBUG).read()).replace("\n# Held-out data", held + "\n# Held-out data", 1)
    (tmp_path / "more.toml").write_text(text + RAMP + ANNEAL.replace("finemath = 0.7", "finemath = 0.7, c4_more = 0.5"))
    out = run(str(tmp_path / "more.toml"), dump)
    assert "resumed from" in out and "training source(s) c4_more pinned now" in out, out[-2000:]
    got = records(dump)
    assert got[6]["source_tokens"] == records(reference)[6]["source_tokens"]  # the steps before: as they were
    assert got[9]["source_tokens"]["c4_more"] > 0 and "c4_more" not in got[6]["source_tokens"]
    assert [e["name"] for e in json.load(open(dump / "data_manifest.json"))["data"]][-1] == "c4_more"
