"""What a resume must keep: the run keys a checkpoint holds (the config's values, the tokenizer's and
the data's sha256, the phases) and the changes a resume may make to them (pretrain/checkpoint.py
compares them at a resume; docs/checkpoints.md#resume)."""

import hashlib

from pretrain import phases


# A resume must keep every key of these sections of train.py's config (a new hyperparameter is a
# resume key with no edit here; [muon]'s too under AdamW, where it is unused)...
RESUME_CHECKED = ("model", "training", "optimizer", "muon", "lr_scheduler", "data")
# ...except these, which a resume may change: how long and how fast to train, clipping, precision
# (float8 included: the weights are the same), the layout's batch split, workers, and where the
# tokenizer, the data manifest and its mirror live (their sha256 is checked).
RESUME_MAY_CHANGE = {
    "training.steps", "training.local_batch_size", "training.max_norm", "training.z_loss",
    "training.seed",
    "training.deterministic", "training.mixed_precision_param", "training.mixed_precision_reduce",
    "optimizer.lr", "muon.lr", "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio",
    "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor", "model.tokenizer_path",
    "model.converters", "data.num_workers", "data.manifest", "data.mirror",
    "data.hub_timeout_seconds", "data.resolve_timeout_seconds", "lr_scheduler.unit",
}


def run_keys(config: dict, tokenizer_path: str, chosen: dict) -> dict:
    """What a resume must not change: the keys of `config` (train.py's, as dataclasses.asdict gives
    it) in RESUME_CHECKED less RESUME_MAY_CHANGE, the tokenizer file's sha256, and `chosen`, the
    values the layout would otherwise choose (a run may resume on more or fewer GPUs if the global
    batch and num_streams stay). A checkpoint is checked on the keys it holds (old: fewer)."""
    keys = {f"{sec}.{k}": v for sec in RESUME_CHECKED for k, v in config[sec].items()}
    keys = {key: v for key, v in keys.items() if key not in RESUME_MAY_CHANGE}
    with open(tokenizer_path, "rb") as f:
        keys["model.tokenizer_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return {**keys, **chosen}


def changes(saved: dict, keys: dict, step: int) -> list:
    """'key: old -> new' for each run key that a resume at `step` with `keys` changes. A list of
    sources may grow by sources of weight 0 (a phase to come weights them); [[phases]] that have not
    begun may change (phases.changed_past)."""
    if "data.source_sha256s" in saved:  # each source's files are checked: the manifest may grow
        saved = {k: v for k, v in saved.items() if k != "data.sources_sha256"}
    saved = {"phases": [], **saved}  # a checkpoint from before [[phases]] had none
    out = []
    for k, old in saved.items():
        new = keys.get(k, old)
        if k == "phases":
            out += phases.changed_past(old, new, step)
        elif k in ("data.sources", "data.source_sha256s") and new[:len(old)] == old:
            out += [f"{k}: {s['name']!r} appended with weight {s['weight']} (0 until a phase weights it)"
                    for s in new[len(old):] if isinstance(s, dict) and s["weight"]]
        elif new != old:
            out.append(f"{k}: {old!r} -> {new!r}")
    return out
