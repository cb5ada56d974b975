"""The trainer's plumbing: what train.py, model.py and data.py (at the root) stand on. Imported as
`from pretrain.checkpoint import Checkpointer`; nothing here imports a program at the root. A module
takes its own config section or plain values, never train.py's whole Config, except config (which
makes it), dryrun (which hands it to the trainer's own functions) and titan_run (a program).

    config             TOML and `--section.key value` into train.py's dataclasses; --help
    distributed        process group and mesh, bounded waits, one rank's error on all
    faults             whose fault an error is, its exit code; the lost-rank line
    startup            train.py's start-up on every rank alike: dump folder, manifest, first reads
    sources            where each source's files are (Hub or local), bounded Hub reads, retries
    data_manifest      each source's files pinned once per run, shared through the store
    loader_workers     processes that read and tokenize ahead of the trainer (data.num_workers)
    mirror             a local copy of pinned Hub files, per commit; where each file is read from
    data_check         preflight.py check's test that each node reads the run's data
    checkpoint         what a checkpoint holds, resume, initial loads (ours, Meta, torchtitan)
    resume_keys        what a resume must keep, and the changes it may make
    checkpoint_folder  atomic sync/async DCP saves, which step-N are complete, pruning
    titan_layout       torchtitan's checkpoint layout (0.3.0's and 0.2.2's), read as ours
    averaging          the mean of several checkpoints' weights, written a tensor at a time
    hf_layout          Hugging Face's names, config and tokenizer files
    metrics            the log line, metrics.jsonl, TensorBoard, W&B, MFU
    progress           the run's clock (elapsed, ETA); progress bars and lines on long work
    loss               the loss a chunk of positions at a time, without the whole logits; z-loss
    spikes             loss spikes: a step skipped, repeated spikes rewound
    agreement          what every rank agrees on at a step: one all-reduce, one decision
    phases             [[phases]]: the batch, sequence and mixture from a step on; an anneal
    layout             an init identical on every layout; parameters the TP plan leaves out
    optimizers         optimizers beside torch's (AdamW with bf16 moments) and their config rules
    memory             memory per device: estimated from the layout, or counted live
    measure            how bench.py measures: timed commands, side by side, steady rates, profiles
    device_check       preflight.py check's measurements of each node: matmul speed, bus bandwidth
    float8             torchao float8: the config rules, conversion, TP styles
    evals              held-out loss; downstream tasks scored as lm-evaluation-harness does
    dryrun             preflight.py dryrun: the trainer it is handed, set up and two steps at the
                       real world size on fake tensors
    titan_run          torchtitan on our shapes; bench.py titan launches it as
                       `torchrun ... -m pretrain.titan_run` from the repository root
"""
