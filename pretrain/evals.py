"""Downstream accuracy in the training loop: multiple-choice tasks scored as lm-evaluation-harness
scores them (0-shot, its prompts, its answer keys), so a number here is the number
`lm_eval --model hf` gives for the same weights exported with `checkpoint_convert.py dcp2hf`.
train.py calls check() with [eval], read_once() at start-up (which reads [validation]'s
held-out windows and load()s the tasks on rank 0 and hands both to every rank: a missing or
malformed task is one error line then, not a crash at step N), evaluate() every [eval] freq steps
and validate() (held-out loss) every [validation] freq steps.

Scoring (lm_eval/api/task.py and models/huggingface.py, v0.4): an example's context is the task's
prompt, each choice is scored as the continuation " " + choice, by the sum of its tokens'
log-probabilities given BOS + context (the text is tokenized whole and split at the context's
length, as lm-eval does). acc: the choice with the highest sum is the answer; acc_norm: the highest
sum per character of the choice. Ties go to the first choice.

To add a task: one entry in TASKS (where its data is, its split, prompt, choices and answer).
"""

import contextlib
import io
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import fsspec
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from data import heldout_windows
from pretrain.config import AT_LEAST_1, MINUS_1_OR_AT_LEAST_1, ConfigError, unknown
from pretrain.data_manifest import source_files
from pretrain.distributed import from_rank0, wait_for_rank0
from pretrain.loss import heldout_loss
from pretrain.mirror import open_file
from pretrain.sources import RETRY_DELAYS, DataError, DataSource, HubFile, retry_or_raise


@dataclass(frozen=True)
class Task:
    """One multiple-choice task as lm-evaluation-harness defines it (lm_eval/tasks/NAME/*.yaml)."""
    path: str  # the Hub dataset lm-eval reads
    config: Optional[str]  # its config (dataset_name), if any
    split: str  # the split lm-eval scores (test_split, else validation_split)
    context: Callable[[dict], str]  # example -> the prompt (doc_to_text)
    choices: Callable[[dict], list]  # example -> the answers (doc_to_choice), scored after a space
    answer: Callable[[dict], int]  # example -> the index of the right answer (doc_to_target)


def hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's [title]/[header] markers out, double spaces one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def arc(config: str) -> Task:
    return Task("allenai/ai2_arc", config, "test", lambda d: f"Question: {d['question']}\nAnswer:",
                lambda d: list(d["choices"]["text"]),
                lambda d: list(d["choices"]["label"]).index(d["answerKey"]))


TASKS = {
    "hellaswag": Task("Rowan/hellaswag", None, "validation",
                      lambda d: hellaswag_text(f"{d['activity_label']}: {d['ctx_a']} {d['ctx_b'].capitalize()}"),
                      lambda d: [hellaswag_text(e) for e in d["endings"]], lambda d: int(d["label"])),
    "arc_easy": arc("ARC-Easy"),
    "arc_challenge": arc("ARC-Challenge"),
    "piqa": Task("baber/piqa", None, "validation", lambda d: f"Question: {d['goal']}\nAnswer:",
                 lambda d: [d["sol1"], d["sol2"]], lambda d: int(d["label"])),
}


@dataclass
class EvalTask:
    name: str = ""  # a task of evals.TASKS: hellaswag, arc_easy, arc_challenge, piqa
    path: str = ""  # where its files are: empty: the task's Hub dataset; else a Hub id or a local copy of that repo
    revision: Optional[str] = None  # Hub revision (commit sha or tag); the run's data manifest pins the commit anyway


@dataclass
class Eval:  # train.py's [eval] section
    enable: bool = False  # score the tasks every freq steps and at the last step (0-shot, as lm-eval does)
    freq: int = 1000  # steps between rounds
    limit: int = 1000  # examples per task: the first ones of its split, the same every round; -1: all of them
    local_batch_size: int = 8  # sequences (one per choice) per forward on each data-parallel rank
    tasks: list[EvalTask] = field(default_factory=list)  # [[eval.tasks]] tables: name, optional path and revision
    RULES: ClassVar[dict] = {"freq": AT_LEAST_1, "limit": MINUS_1_OR_AT_LEAST_1, "local_batch_size": AT_LEAST_1}


def check(e: Eval) -> None:
    """The [eval] tasks' rules (config.check_rules applies RULES), before any process group exists."""
    names = [t.name for t in e.tasks]
    for name in names:
        if name not in TASKS:
            raise unknown("eval task", name, TASKS)
    if len(set(names)) < len(names):
        raise ConfigError(f"eval.tasks names a task twice ({', '.join(names)}): one table per task")
    if e.enable and not names:
        raise ConfigError("eval.enable is set but eval.tasks is empty; add [[eval.tasks]] tables "
                          '(name = "hellaswag")')


def sources(e: Eval) -> list:
    """The enabled tasks' data as sources of the run's data manifest (pinned with the validation
    sources, when first used: a resume may add a task)."""
    tasks = e.tasks if e.enable else []
    return [DataSource(name=t.name, path=t.path or TASKS[t.name].path, config=TASKS[t.name].config,
                       text_column="", split=TASKS[t.name].split, revision=t.revision) for t in tasks]


def read_examples(src: DataSource, manifest: dict, limit: int, timeout: float,
                  budget: float = math.inf) -> list:
    """The first `limit` (-1: all) rows of the task's split, whole, from the files the manifest pinned. A read waits
    `timeout` seconds for a byte; a file's retries stop within `budget` seconds ([comm] init_timeout_seconds)."""
    rows = []
    for path, size in source_files(manifest, src, "validation"):
        started = time.monotonic()
        for failures in range(len(RETRY_DELAYS) + 1):
            try:
                with open_file(path, size, timeout, budget, src.name) as f:
                    if path.endswith(".parquet"):
                        part = pq.ParquetFile(f).read().to_pylist()
                    else:  # json lines, plain or compressed
                        f = io.BufferedReader(f, 1 << 23) if isinstance(f, HubFile) else f
                        compression = fsspec.utils.infer_compression(path)
                        f = fsspec.compression.compr[compression](f, mode="rb") if compression else f
                        part = [json.loads(line) for line in f if line.strip()]
                break
            except Exception as e:  # a next try the Hub ignores fails within one request's `timeout`
                retry_or_raise(src.name, src.path, f"reading {path}", e, failures, started=started,
                               budget=budget, next_try=timeout)
        rows += part
        if 0 <= limit <= len(rows):
            return rows[:limit]
    return rows


def load(e: Eval, tokenizer, max_seq_len: int, manifest: dict, timeout: float,
         budget: float = math.inf) -> dict:
    """Per task: its examples as scoring requests, the same on every rank. A request is (tokens, n):
    BOS + context + continuation, the last n of which are the choice's; a choice's log-likelihood is
    the sum over those n. `timeout`, `budget`: read_examples'."""
    tasks = {}
    for src in sources(e):
        task = TASKS[src.name]
        requests = []  # (tokens, n) per choice of each example
        examples = []  # (choices, answer, each choice's characters) per example
        rows = read_examples(src, manifest, e.limit, timeout, budget)
        for i, row in enumerate(rows):
            try:
                context = task.context(row)
                choices = task.choices(row)
                answer = task.answer(row)
                if not 0 <= answer < len(choices) or not all(isinstance(c, str) for c in choices):
                    raise ValueError(f"answer {answer} of {len(choices)} choices")
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as bad:
                raise DataError(f"eval task {src.name!r}: example {i} of {src.path} is not in the "
                                f"task's layout ({type(bad).__name__}: {str(bad)[:200]}); point "
                                f"[[eval.tasks]] path at a copy of {task.path}".replace("\n", " "))
            # lm-eval moves the context's trailing spaces to the continuation, encodes both whole
            # and takes the tokens after the context's own encoding as the continuation's.
            context_ids = tokenizer.encode(context.rstrip(), bos=True, eos=False)
            for choice in choices:
                ids = tokenizer.encode(context + " " + choice, bos=True, eos=False)
                n = len(ids) - len(context_ids)  # the choice's tokens
                ids = ids[-(max_seq_len + 1):]  # keep the last tokens that fit, as lm-eval does
                requests.append((ids, min(n, len(ids) - 1)))
            examples.append((len(choices), answer, [len(c) for c in choices]))
        if not examples:
            raise DataError(f"eval task {src.name!r}: no examples in the {src.split!r} split of {src.path}")
        tasks[src.name] = (requests, examples)
    return tasks


@torch.no_grad()
def evaluate(model, tasks: dict, batch: int, device, dp_group, tp: int) -> dict:
    """acc and acc_norm per task. Requests are split over the data-parallel ranks (TP ranks of a
    replica share theirs), each rank runs the same number of forwards (FSDP's collectives), and one
    all-reduce sums the log-likelihoods, so every layout scores the same."""
    model.eval()
    rank = dist.get_rank(dp_group)
    dp = dist.get_world_size(dp_group)
    result = {"eval_acc": {}, "eval_acc_norm": {}, "eval_examples": {}}
    for name, (requests, examples) in tasks.items():
        # A row length per task (a multiple of 64 and tp, which SP splits) limits compiled shapes.
        width = -(-max(len(ids) - 1 for ids, _ in requests) // (64 * tp)) * 64 * tp
        mine = list(range(rank, len(requests), dp))
        lls = torch.zeros(len(requests), dtype=torch.float64, device=device)
        for b in range(0, -(-len(requests) // dp), batch):  # each rank does ceil(requests / dp) rows
            rows = mine[b:b + batch]
            inputs = torch.zeros(batch, width, dtype=torch.long)
            labels = torch.full((batch, width), -100, dtype=torch.long)  # the choices' tokens only
            for r, i in enumerate(rows):
                ids, n = requests[i]
                inputs[r, :len(ids) - 1] = torch.tensor(ids[:-1])
                labels[r, len(ids) - 1 - n:len(ids) - 1] = torch.tensor(ids[-n:])
            inputs = inputs.to(device)
            labels = labels.to(device)
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                nll = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten(), reduction="none")
            nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
            lls[rows] = -nll.view(batch, width).sum(1)[:len(rows)].double()
        dist.all_reduce(lls, group=dp_group)
        acc = norm = 0
        for ll, (n, answer, chars) in zip(lls.cpu().split([n for n, _, _ in examples]), examples):
            acc += int(ll.argmax()) == answer  # the first of equal maxima, as numpy's in lm-eval
            norm += int((ll / torch.tensor(chars, dtype=torch.float64)).argmax()) == answer
        result["eval_acc"][name] = acc / len(examples)
        result["eval_acc_norm"][name] = norm / len(examples)
        result["eval_examples"][name] = len(examples)
    model.train()
    return result


# --------------------------------------------------------------------------------------------------
# Read once per job, and [validation]'s held-out loss
# --------------------------------------------------------------------------------------------------

def read_once(v, e: Eval, tokenizer, manifest: dict, device, *, seq_len: int, max_seq_len: int, data,
              budget: float) -> tuple:
    """[validation]'s (`v`) held-out windows ({source: (sequences, seq_len + 1) tokens}) and [eval]'s requests
    (load()), the same on every rank of the job: rank 0 alone reads and tokenizes them and hands them over in three
    broadcasts, so 2,048 ranks read the Hub once, not 2,048 times. A source or task that cannot be read is rank 0's
    one line, raised on every rank. data: [data], for its read timeouts; budget: comm.init_timeout_seconds."""
    windows = []  # on rank 0, one (sequences, seq_len + 1) tensor per held-out source
    head = {}  # on rank 0, the windows' counts and the tasks, or its error
    store = dist.distributed_c10d._get_default_store()
    key = f"read_once_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"  # a restart keeps old keys
    limits = data.hub_timeout_seconds, budget  # a request's timeout, then a file's budget
    if dist.get_rank() == 0:
        try:
            for src in v.sources if v.enable else []:
                store.set(f"{key}/doing", f"reading the held-out windows of {src.name!r}")
                sequences = None if v.sequences == -1 else v.sequences
                held = heldout_windows(src, tokenizer, seq_len, sequences, manifest, *limits)
                windows.append(torch.tensor(held, dtype=torch.int32))  # (sequences, seq_len + 1)
            store.set(f"{key}/doing", f"reading the eval tasks {[t.name for t in sources(e)]}")
            tasks = load(e, tokenizer, max_seq_len, manifest, *limits)
            head = {"counts": [len(w) for w in windows], "tasks": tasks}
        except DataError as e:
            head = {"error": str(e)}
    # The others wait in the store while rank 0 reads (retries may outlast a collective)
    what = "the held-out windows and eval tasks"
    wait_for_rank0(store, key, dist.get_rank(), data.resolve_timeout_seconds, what)
    # Send JSON, not pickle: what a rank receives is data, never code
    sent = torch.frombuffer(bytearray(json.dumps(head).encode()), dtype=torch.uint8)
    head = json.loads(from_rank0(sent, device).numpy().tobytes())
    if "error" in head:
        raise DataError(head["error"])
    empty = torch.zeros(0, dtype=torch.int32)  # used with no held-out source, or off rank 0
    flat = from_rank0(torch.cat([w.flatten() for w in windows]) if windows else empty, device)
    names = [src.name for src in v.sources] if v.enable else []
    return dict(zip(names, flat.view(-1, seq_len + 1).split(head["counts"]))), head["tasks"]


def heldout_share(windows: dict, batch: int, dp_rank: int, dp: int, ignore: Callable) -> dict:
    """Per validation source, this rank's (inputs, labels): window i goes to dp rank i % dp. Ranks with fewer rows
    are padded with label -100 (ignored) to as many whole batches as every other rank (FSDP's collectives). `ignore`:
    ignore_boundaries (pretrain/loss.py), so the positions training leaves out are left out here too."""
    heldout = {}
    for name, rows in windows.items():
        n = -(-len(rows) // (dp * batch)) * batch  # rows per rank, whole batches
        mine = rows[dp_rank::dp].long()  # (rows, seq_len + 1)
        seq_len = rows.shape[1] - 1
        inputs = torch.zeros(n, seq_len, dtype=torch.long)
        labels = torch.full((n, seq_len), -100, dtype=torch.long)
        inputs[:len(mine)] = mine[:, :-1]
        labels[:len(mine)] = ignore(mine[:, 1:])
        heldout[name] = (inputs, labels)
    return heldout


@torch.no_grad()
def validate(model, heldout: dict, batch: int, device, dp_group, tp: int) -> dict:
    """Mean held-out loss per source and overall (per token), and the tokens evaluated."""
    model.eval()
    sums = torch.zeros(len(heldout), 2, dtype=torch.float64, device=device)  # loss sum, tokens
    for i, (inputs, labels) in enumerate(heldout.values()):
        for b in range(0, len(inputs), batch):
            x = inputs[b:b + batch].to(device)
            y = labels[b:b + batch].to(device)
            sums[i, 0] += heldout_loss(model, x, y, tp)  # labels of -100 are ignored
            sums[i, 1] += (y != -100).sum()
    dist.all_reduce(sums, group=dp_group)
    model.train()
    loss = (sums[:, 0].sum() / sums[:, 1].sum()).item()
    return {"validation_loss": loss, "validation_tokens": int(sums[:, 1].sum()),
            "validation_source_loss": {name: (s[0] / s[1]).item() for name, s in zip(heldout, sums)}}
