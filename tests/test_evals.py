"""[eval]: downstream accuracy in the training loop equals lm-evaluation-harness's for the same weights exported with
dcp2hf, on fixture copies of the tasks in their real Hub layouts (served by the local test Hub, and as local folders);
1 process, FSDP 2 and TP 2 score alike; training is bitwise the same with and without it; a bad task is one line.
The same runs validate (held-out data from the Hub): the same held-out loss on 1 process, FSDP, HSDP and TP
and on resume is tested here, the rest of [validation] in test_validation.py."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import SMALL, run_training
from hub_fixture import Hub, make_repos, task_repos, write_mirror

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa")
LIMIT = 8  # examples per task
# The arguments of conftest's fsdp_reference and tp_reference (the same runs without [eval]).
COMMON = ("--metrics.log_freq", "1", "--validation.enable", "false", "--training.steps", "10", *SMALL)
FSDP = ("--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "5")
TP = ("--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective")
# One thread, as torchrun gives each rank: MKL picks its thread count by load otherwise, and a run on
# a busy machine can then differ from another in the last bit of a loss.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE"}
HELD_OUT = '[[validation.sources]]\nname = "c4"\npath = "allenai/c4"\nconfig = "en"\nsplit = "validation"\n'


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The local Hub serving the task repos (and C4, for held-out data), a local copy of each task repo (what `hf
    download` makes), and the environment that points a process at the Hub."""
    repos, folder = task_repos(), tmp_path_factory.mktemp("tasks")
    server = Hub({**repos, **make_repos()})
    for repo in repos:
        write_mirror(repos, str(folder / repo), repo)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    yield server, folder, {**env, "HF_ENDPOINT": server.endpoint, "HF_HOME": str(folder / "hf_home")}
    server.close()


def config(dump, tasks: dict) -> str:
    """configs/debug_model.toml with an [eval] section, and C4's validation split on the Hub as its held-out data;
    tasks: name -> path ("" = its Hub dataset)."""
    table = ", ".join(f'{{name = "{name}", path = "{path}"}}' for name, path in tasks.items())
    with open(os.path.join(ROOT, "configs", "debug_model.toml")) as f:
        text = f.read().split("# Held-out data")[0] + HELD_OUT
    text += f"\n[eval]\nenable = true\nfreq = 5\nlimit = {LIMIT}\nlocal_batch_size = 32\n"
    text += f"tasks = [{table}]\n"
    path = os.path.join(dump, "eval.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def train(dump, cfg: str, *args, nproc=1, env=None, expect=0):
    if env is not None:  # the whole environment: what it leaves out is unset
        env = {**{key: None for key in os.environ if key not in env}, **env}
    proc = run_training(["--config", cfg, "--job.dump_folder", dump, *COMMON, *args], nproc, env=env)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(ln) for ln in open(os.path.join(dump, "metrics.jsonl"))] if expect == 0 else []
    return proc, [r for r in records if "loss" in r], [r for r in records if "eval_acc" in r], \
        [r for r in records if "validation_loss" in r]


@pytest.fixture(scope="module")
def runs(hub, tmp_path_factory):
    """The three layouts with [eval] and [validation] (tasks from the Hub for 1 process and FSDP 2, from local folders
    for TP 2; held-out data from the Hub, in validation batches of 8 on 1 process and TP, 2 a rank under
    FSDP): name -> (dump, process, steps, eval rounds, validation rounds, bytes the Hub served of data files,
    all held-out or task files: the training data is local; dataset cards, which resolution reads once per
    HF_HOME, are left out)."""
    server, folder, env = hub
    on_hub = {name: "" for name in TASKS}
    local = {"hellaswag": folder / "Rowan/hellaswag", "arc_easy": folder / "allenai/ai2_arc",
             "arc_challenge": folder / "allenai/ai2_arc", "piqa": folder / "baber/piqa"}
    out = {}
    one = ("--training.local_batch_size", "8", "--metrics.enable_tensorboard")
    fsdp = (*FSDP, "--validation.local_batch_size", "2")
    layouts = (("fsdp", on_hub, fsdp, 2), ("tp", local, TP, 2), ("one", on_hub, one, 1))
    for name, tasks, args, nproc in layouts:
        dump, start = tmp_path_factory.mktemp(f"eval_{name}"), len(server.log)
        out[name] = (dump, *train(dump, config(dump, tasks), *args, "--validation.enable", "true", nproc=nproc,
                                  env={**env, **ONE_THREAD}),
                     sum(r["bytes"] for r in server.log[start:] if r["path"].endswith((".parquet", ".json.gz"))))
    return out


@pytest.mark.slow
def test_rounds_are_logged_and_leave_training_bitwise_unchanged(runs, fsdp_reference, tp_reference):
    for name, reference in (("fsdp", fsdp_reference), ("tp", tp_reference)):
        dump, proc, steps, rounds, _, _ = runs[name]
        assert [r["step"] for r in rounds] == [5, 10]  # every freq steps, and at the last step
        for r in rounds:
            assert set(r) == {"step", "eval_acc", "eval_acc_norm", "eval_examples", "eval_seconds"}
            assert list(r["eval_acc"]) == list(TASKS) and set(r["eval_examples"].values()) == {LIMIT}
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("eval: step 10  acc/acc_norm  hellaswag "))
        assert "  piqa " in line and f"({LIMIT}, {LIMIT}, {LIMIT}, {LIMIT} examples)" in line, proc.stdout
        without = [json.loads(ln) for ln in open(os.path.join(reference[0], "metrics.jsonl"))]
        assert [r["loss"] for r in steps] == [r["loss"] for r in without if "loss" in r]  # bitwise


@pytest.mark.slow
def test_one_process_fsdp_and_tp_score_alike(runs):
    dump, _, _, rounds, _, _ = runs["one"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(dump / "tb"))
    tb.Reload()
    for task in TASKS:  # a scalar per task and metric, as W&B gets them (pretrain/metrics.py sends both the same dict)
        assert [(e.step, e.value) for e in tb.Scalars(f"eval_acc_norm/{task}")] == \
            [(r["step"], pytest.approx(r["eval_acc_norm"][task])) for r in rounds]
    one = [(r["eval_acc"], r["eval_acc_norm"]) for r in rounds]
    assert one == [(r["eval_acc"], r["eval_acc_norm"]) for r in runs["fsdp"][3]]
    assert one == [(r["eval_acc"], r["eval_acc_norm"]) for r in runs["tp"][3]]


@pytest.mark.slow
def test_heldout_and_task_files_are_read_once_per_job_and_validate_alike(runs):
    """Rank 0 alone reads the held-out windows and the task files and hands them to the other ranks: the Hub serves
    a 2-rank job the bytes it serves one process, and both evaluate the same sequences (validation.sequences of the
    source, whatever the layout and batch), so the same loss."""
    one, fsdp = runs["one"], runs["fsdp"]
    print(f"held-out and task bytes the Hub served: 1 rank {one[5]:,}, 2 ranks {fsdp[5]:,}")
    assert one[5] == fsdp[5] > 0, (one[5], fsdp[5])
    assert [r["validation_tokens"] for r in one[4]] == [r["validation_tokens"] for r in fsdp[4]] == [8 * 64]
    assert [r["validation_loss"] for r in fsdp[4]] == pytest.approx([r["validation_loss"] for r in one[4]], rel=1e-5)


@pytest.mark.slow
def test_validation_loss_is_the_same_on_fsdp_hsdp_and_tp_and_on_resume(runs, hub, tmp_path):
    """The step-10 held-out loss of the runs above, of HSDP (validation batches of 4 a rank), and of the
    FSDP run resumed from its step-5 checkpoint, which replays steps 6-10 and the round exactly. [eval] is
    off in the two runs here: they test validation only."""
    env = {**hub[2], **ONE_THREAD}
    on_hub = {name: "" for name in TASKS}
    no_eval = ("--validation.enable", "true", "--eval.enable", "false")
    (tmp_path / "hsdp").mkdir()
    _, _, _, hsdp = train(tmp_path / "hsdp", config(tmp_path / "hsdp", on_hub), *no_eval,
                          "--training.local_batch_size", "4", "--validation.local_batch_size", "4",
                          "--parallelism.data_parallel_replicate_degree", "2", nproc=2, env=env)
    one = runs["one"][4]
    want = [r["validation_loss"] for r in one]
    for other in (runs["fsdp"][4], hsdp, runs["tp"][4]):
        assert [r["validation_loss"] for r in other] == pytest.approx(want, rel=1e-5)
        assert [r["validation_tokens"] for r in other] == [r["validation_tokens"] for r in one]
    # A copy of the FSDP run less its step-10 checkpoint: the other tests read that run's own folder
    fsdp_dump = runs["fsdp"][0]
    again_dump = tmp_path / "resumed"
    shutil.copytree(fsdp_dump, again_dump, ignore=shutil.ignore_patterns("step-10"))
    _, steps, _, again = train(again_dump, config(again_dump, on_hub), *FSDP, *no_eval,
                               "--validation.local_batch_size", "2", "--checkpoint.load_step", "5",
                               nproc=2, env=env)
    # the first run's steps, then the replay
    assert [r["step"] for r in steps] == [*range(1, 11), *range(6, 11)]
    assert [r["loss"] for r in steps[10:]] == [r["loss"] for r in steps[5:10]]  # bitwise
    assert [r["validation_loss"] for r in again] == [r["validation_loss"] for r in runs["fsdp"][4]] * 2


LM_EVAL = """
import json
import sys

import lm_eval
out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={sys.argv[1]},dtype=float32", tasks=sys.argv[3:],
                              limit=int(sys.argv[2]), device="cpu", batch_size=8)
print("RESULTS " + json.dumps({t: out["results"][t] for t in sys.argv[3:]}))
"""


@pytest.mark.slow
def test_accuracies_equal_lm_evaluation_harness_on_the_exported_weights(runs, hub, tmp_path, monkeypatch):
    """The FSDP run's step-10 checkpoint exported with dcp2hf, scored by lm-eval reading the same task files from the
    local Hub: the same number of right answers per task, for acc and acc_norm."""
    dump, _, _, rounds, _, _ = runs["fsdp"]
    sys.path.insert(0, ROOT)
    monkeypatch.chdir(ROOT)  # the run's config.toml names its tokenizer relative to the repository
    import checkpoint_convert  # its main() here: a launch would spend 4 s importing torch (test_convert launches it)
    checkpoint_convert.main(["dcp2hf", "--input_dir", str(dump / "checkpoint" / "step-10"),
                             "--output_dir", str(tmp_path / "hf")])
    proc = subprocess.run([sys.executable, "-c", LM_EVAL, str(tmp_path / "hf"), str(LIMIT), *TASKS], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=hub[2])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    ours = rounds[-1]
    for task in TASKS:
        assert round(theirs[task]["acc,none"] * LIMIT) == round(ours["eval_acc"][task] * LIMIT), task
        assert round(theirs[task]["acc_norm,none"] * LIMIT) == round(ours["eval_acc_norm"][task] * LIMIT), task
    assert not [r["path"] for r in hub[0].log if r.get("unhandled")]


@pytest.mark.slow
def test_a_missing_or_malformed_task_is_one_line_at_start_up(hub, tmp_path):
    """A missing folder through train.py (exit 2 before step 1); a task pointed at another task's files (the
    columns are not its own) through the same load() train.py calls at start-up."""
    _, folder, env = hub
    (tmp_path / "empty").mkdir()
    proc, *_ = train(tmp_path, config(tmp_path, {"arc_easy": tmp_path / "empty"}), env=env, expect=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data source 'arc_easy': no 'test' files")
    assert "Traceback" not in proc.stderr and "step: 1 " not in proc.stdout
    sys.path.insert(0, ROOT)
    from pretrain import evals
    from pretrain import data_manifest
    from pretrain import sources
    from data import Tokenizer
    e = evals.Eval(enable=True, limit=2, tasks=[evals.EvalTask(name="hellaswag", path=str(folder / "baber/piqa"))])
    manifest = data_manifest.make_manifest([], evals.sources(e))
    with pytest.raises(sources.DataError, match=r"^eval task 'hellaswag': example 0 of .*baber/piqa is not in the "
                       r"task's layout \(KeyError: 'activity_label'\); point \[\[eval.tasks\]\] path at a copy of "
                       r"Rowan/hellaswag$"):
        evals.load(e, Tokenizer(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")), 2048, manifest, 5.0)


def test_an_unknown_task_or_a_bad_key_is_a_config_error(tmp_path):
    sys.path.insert(0, ROOT)
    import train
    from pretrain.config import ConfigError
    for extra, says in (('tasks = [{name = "hellaswg"}]', "unknown eval task 'hellaswg'; did you mean hellaswag?"),
                        ('limit = 0\ntasks = [{name = "piqa"}]', "eval.limit = 0: must be -1 or >= 1"),
                        ("", "eval.enable is set but eval.tasks is empty")):
        cfg = tmp_path / "c.toml"
        cfg.write_text(f"[eval]\nenable = true\n{extra}\n")
        with pytest.raises(ConfigError, match="^" + says.replace("?", r"\?")):
            train.validate(train.load_config(["--config", str(cfg)]), 1)


def test_scoring_sums_each_choices_tokens_and_normalises_by_characters():
    """evaluate() on a model whose next-token guess is known (the input id + 1, near-certain; a miss costs ~5 nats): a
    choice's log-likelihood is the sum over its own tokens only, whatever the batching and padding; acc takes the
    largest, acc_norm the largest per character. One process, a 1-rank gloo group."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    from pretrain import evals

    class NextId(torch.nn.Module):  # logits (bs, seqlen, vocab): 5 at input + 1, 0 elsewhere
        def forward(self, ids):
            return 5 * torch.nn.functional.one_hot((ids + 1) % 16, 16).float()

    # (context after BOS, choices, answer, characters per choice) -> acc right?, acc_norm right?
    examples = [([5, 6], [[7, 8], [9, 3], [7, 3]], 0, [2, 2, 2]),  # 2 hits beat 0 and 1: both right
                ([6], [[7], [7, 8, 9]], 1, [1, 30]),  # 1 hit beats 3 (each a little below 0); per character, 3 win
                ([2], [[3], [3, 4, 5]], 0, [1, 30]),  # the same, the other answer: acc right, acc_norm wrong
                ([4], [[5, 9], [5, 6]], 1, [2, 2]),  # only the choices' last tokens differ: both right
                ([4], [[5], [5, 6, 7]], 1, [1, 30])]  # acc wrong, acc_norm right
    requests = [([0, *context, *choice], len(choice)) for context, choices, _, _ in examples for choice in choices]
    tasks = {"t": (requests, [(len(choices), answer, chars) for _, choices, answer, chars in examples])}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for batch in (1, 4, 16):
            got = evals.evaluate(NextId(), tasks, batch, torch.device("cpu"), dist.group.WORLD, 1)
            assert got == {"eval_acc": {"t": 3 / 5}, "eval_acc_norm": {"t": 4 / 5}, "eval_examples": {"t": 5}}, batch
    finally:
        dist.destroy_process_group()
