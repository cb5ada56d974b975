"""Config loading, validation, the lr schedule and the layout-independent init (CPU, fast)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import model  # noqa: E402
import train  # noqa: E402
from pretrain import config  # noqa: E402

DEBUG = os.path.join(ROOT, "configs", "debug_model.toml")


BAD_INPUT = [
    (["--training.stpes", "5"], "unknown key in [training] 'stpes'; did you mean steps?"),
    (["--trainig.steps", "5"], "unknown config section 'trainig'; did you mean training?"),
    (["--training.steps", "five"], "training.steps: expected int, got 'five'"),
    (["--training.steps", "0"], "training.steps = 0: must be >= 1"),
    (["--optimizer.lr", "-1"], "optimizer.lr = -1.0: must be a positive number"),
    (["--optimizer.lr", "nan"], "optimizer.lr = nan: must be a positive number"),
    (["--optimizer.beta2", "1.0"], "optimizer.beta2 = 1.0: must be in [0, 1)"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio = 1.5: must be -1 or in (0, 1]"),
    (["--lr_scheduler.warmup_steps", "-5"], "lr_scheduler.warmup_steps = -5: must be >= 0"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k = -1: must be >= 0"),
    (["--training.global_batch_size", "0"], "training.global_batch_size = 0: must be -1 or >= 1"),
    (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree = 0: must be -1 or >= 1"),
    (["--model.flavor", "7B"], "unknown model.flavor '7B'"),
    (["--activation_checkpoint.mode", "some"], "activation_checkpoint.mode = 'some': must be one of none, full, selective"),
    (["--training.seq_len", "4096"], "training.seq_len = 4096 exceeds the debugmodel model's max_seq_len 2048"),
    (["--parallelism.tensor_parallel_degree", "2"], "must equal the world size 1"),
    (["stray"], "unexpected argument 'stray'"),
    (["--model.vocab_size", "-1"], "model.vocab_size = -1: must be >= 0"),
    (["--optimizer.state_dtype", "bfloat16", "--optimizer.beta2", "0.999"],
     'optimizer.beta2 = 0.999 with state_dtype = "bfloat16": a bf16 exp_avg_sq cannot decay by 1 - beta2 = 0.001'),
    (["--model.vocab_size", "100"], "model.vocab_size = 100 is below the 2,048 words of assets/tokenizer/tokenizer.model"),
    (["--validation.steps", "20"], "[validation] steps was replaced by sequences = N, the first N windows of each"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_config_error(args, message):
    with pytest.raises(train.ConfigError) as e:
        train.validate(train.load_config(["--config", DEBUG, *args]), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


# Through the real entry point, once for an error parsing finds and once for one that only main() finds
# (the tokenizer file it opens): one `error:` line on stderr, exit 2, no dump folder. Both processes start
# at once: each spends ~3 s importing torch. What each check says: test_bad_input_is_one_config_error.
ENTRY_POINT_CASES = [BAD_INPUT[0], (["--model.tokenizer_path", "missing.model"], "tokenizer file 'missing.model' not found")]


def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path):
    started = []
    for i, (args, message) in enumerate(ENTRY_POINT_CASES):
        dump = str(tmp_path / f"dump{i}")
        proc = subprocess.Popen([sys.executable, "train.py", "--config", DEBUG, "--job.dump_folder", dump, *args],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append((proc, dump, message))
    for proc, dump, message in started:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, stderr
        assert stderr.strip().splitlines() == [f"error: {stderr.strip()[7:]}"]
        assert message in stderr
        assert not os.path.exists(dump)


def test_tp_must_divide_heads_before_any_process_group(tmp_path, monkeypatch):
    # WORLD_SIZE=3 without a launcher: validation has to fail before init_process_group would hang.
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = train.load_config(["--config", DEBUG, "--job.dump_folder", str(tmp_path / "dump"),
                             "--parallelism.tensor_parallel_degree", "3"])
    with pytest.raises(train.ConfigError, match="tensor_parallel_degree = 3 must divide the debugmodel model's n_heads 16"):
        train.main(cfg)
    assert not (tmp_path / "dump").exists()


def test_toml_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = \n")
    with pytest.raises(train.ConfigError, match="not valid TOML"):
        train.load_config(["--config", str(bad)])
    bad.write_text("[training]\nsteps = 'ten'\n")
    with pytest.raises(train.ConfigError, match="training.steps: expected int, got 'ten'"):
        train.load_config(["--config", str(bad)])
    bad.write_text("[[data.sources]]\nname = 'x'\npath = 'y'\nwieght = 1\n")
    with pytest.raises(train.ConfigError, match="did you mean weight"):
        train.load_config(["--config", str(bad)])
    with pytest.raises(train.ConfigError, match="not found"):
        train.load_config(["--config", str(tmp_path / "nope.toml")])
    # An integer where the key takes a string (the README's `selective_ac_option = N`) is that string.
    good = tmp_path / "good.toml"
    good.write_text("[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = 2\n")
    assert train.load_config(["--config", str(good)]).activation_checkpoint.selective_ac_option == "2"


def test_precedence_cli_over_toml_over_defaults():
    cfg = train.load_config(["--config", DEBUG, "--training.steps", "7", "--checkpoint.enable"])
    assert cfg.training.steps == 7  # CLI
    assert cfg.training.seq_len == 256  # TOML
    assert cfg.optimizer.beta2 == 0.95  # default
    assert cfg.checkpoint.enable is True  # bare boolean flag
    assert train.load_config(["--training.steps=9"]).training.steps == 9
    assert [s.name for s in cfg.data.sources] == ["c4", "zyda2_dclm", "zyda2_fwe3", "finemath"]


def test_saved_config_round_trips(tmp_path):
    cfg = train.load_config(["--config", DEBUG, "--optimizer.lr", "1e-3"])
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(cfg))
    assert train.load_config(["--config", str(path)]) == cfg


def test_help_lists_every_key_with_default_and_doc(capsys):
    with pytest.raises(SystemExit) as e:
        train.load_config(["-h"])  # what `python train.py -h` prints
    assert e.value.code == 0
    out = capsys.readouterr().out
    cfg = train.Config()
    for section in train.dataclasses.fields(cfg):
        if isinstance(getattr(cfg, section.name), list):  # top-level tables: [[phases]]
            assert f"--{section.name} {{none}}" in out and f"[[{section.name}]] tables (TOML only): " in out
            continue
        for key in train.dataclasses.fields(getattr(cfg, section.name)):
            if key.name in ("sources", "tasks"):  # tables: documented, set in the TOML
                assert f"[[{section.name}.{key.name}]] (TOML only): " in out
                continue
            line = next((ln for ln in out.splitlines() if ln.strip().startswith(f"--{section.name}.{key.name} ")), None)
            assert line is not None, f"--{section.name}.{key.name} missing from --help"
            doc, default = line.split("  ")[-1].rsplit(" (default: ", 1)
            assert doc.strip() and default.endswith(")"), line


def test_argparse_cli_forms_and_config_given_twice(tmp_path):
    cfg = train.load_config(["--training.steps=9", "--checkpoint.enable", "--optimizer.lr", "1e-3"])
    assert (cfg.training.steps, cfg.checkpoint.enable, cfg.optimizer.lr) == (9, True, 1e-3)
    assert train.load_config(["--checkpoint.enable", "false"]).checkpoint.enable is False
    with pytest.raises(train.ConfigError, match="expected one argument"):
        train.load_config(["--training.steps"])
    with pytest.raises(train.ConfigError, match="unknown key in \\[training\\] 'step'; did you mean steps"):
        train.load_config(["--training.step", "3"])  # no silent abbreviation
    with pytest.raises(train.ConfigError, match="data.sources must be one or more \\[\\[data.sources\\]\\] tables"):
        train.load_config(["--data.sources", "x"])
    other = tmp_path / "other.toml"
    other.write_text("[training]\nsteps = 3\n")
    with pytest.raises(train.ConfigError, match=f"--config given 2 times \\({DEBUG}, {other}\\)"):
        train.load_config(["--config", DEBUG, "--config", str(other)])
    # torchtitan's name for --config (the README names it)
    assert train.load_config(["--job.config_file", str(other)]).training.steps == 3


def test_lr_schedule_warmup_stable_decay():
    cfg = train.load_config(["--training.steps", "100", "--lr_scheduler.warmup_steps", "10",
                             "--lr_scheduler.decay_ratio", "0.2", "--lr_scheduler.min_lr_factor", "0.1"])
    f = [train.lr_factor(s, cfg) for s in range(100)]
    assert f[0] == pytest.approx(1 / 11) and f[9] == pytest.approx(10 / 11)
    assert all(x == 1.0 for x in f[10:80])  # stable
    assert all(a > b for a, b in zip(f[79:], f[80:]))  # decaying
    assert f[99] == pytest.approx(0.1)  # the last step is at lr * min_lr_factor exactly
    for kind in ("cosine", "sqrt"):
        cfg.lr_scheduler.decay_type = kind
        assert 0.1 <= train.lr_factor(99, cfg) < train.lr_factor(90, cfg) < 1.0


def test_layout_independent_init_fills_shards_like_the_whole():
    """Filling row/column shards (what FSDP and TP ranks hold) gives the full tensor's values."""
    full = torch.empty(200, 48)
    train.layout_independent_normal(seed=3)("layers.0.attention.wq.weight", full, 0.02)
    assert 0.015 < full.std() < 0.025 and full.abs().max() <= 0.06
    parts = torch.empty(200, 48)
    # uneven row shards not aligned to the 64-row blocks, each split again by columns (FSDP x TP)
    for r0, r1 in ((0, 70), (70, 133), (133, 200)):
        for c0, c1 in ((0, 24), (24, 48)):
            piece = torch.empty(r1 - r0, c1 - c0)
            model.keyed_normal_(piece, (r0, c0), full.shape, 3, "layers.0.attention.wq.weight", 0.02)
            parts[r0:r1, c0:c1] = piece
    assert torch.equal(parts, full)
    experts = torch.empty(4, 30, 16)  # any shape: 3-D sharded on dim 0 (FSDP) or dim 1, a 1-D one
    train.layout_independent_normal(seed=3)("experts", experts, 0.02)
    piece = torch.empty(2, 30, 16)
    model.keyed_normal_(piece, (2, 0, 0), experts.shape, 3, "experts", 0.02)
    assert torch.equal(piece, experts[2:])
    piece = torch.empty(4, 10, 16)
    model.keyed_normal_(piece, (0, 20, 0), experts.shape, 3, "experts", 0.02)
    assert torch.equal(piece, experts[:, 20:])
    bias, part = torch.empty(100), torch.empty(30)
    train.layout_independent_normal(seed=3)("b", bias, 0.02)
    model.keyed_normal_(part, (70,), bias.shape, 3, "b", 0.02)
    assert torch.equal(part, bias[70:])
    other = torch.empty(200, 48)
    train.layout_independent_normal(seed=3)("layers.1.attention.wq.weight", other, 0.02)
    assert not torch.equal(other, full)  # each weight has its own stream
    train.layout_independent_normal(seed=4)("layers.0.attention.wq.weight", other, 0.02)
    assert not torch.equal(other, full)  # and each seed


def test_the_vocabulary_follows_the_tokenizer_and_a_llama3_sized_one_gives_metas(tmp_path):
    """Meta's tokenizer has 128,000 BPE ranks: with the 256 special tokens every flavor gets Meta's 128,256
    (bos 128000); a small tokenizer gives any flavor its own size (the trainer passes n_words)."""
    import base64
    import itertools

    import data
    words = itertools.chain((bytes([b]) for b in range(256)), map(bytes, itertools.product(range(256), repeat=2)),
                            map(bytes, itertools.product(range(48, 123), repeat=3)))
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(w).decode()} {i}\n" for i, w in zip(range(128000), words)))
    tok = data.Tokenizer(str(path))
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (128256, 128000, 128001)
    for flavor in ("1B", "8B", "405B"):
        cfg = train.load_config(["--model.flavor", flavor])
        assert train.flavor_args(cfg, vocab_size=tok.n_words).vocab_size == 128256 == model.flavors[flavor].vocab_size
    small = data.Tokenizer(os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"))
    assert train.flavor_args(train.load_config(["--model.flavor", "8B"]), vocab_size=small.n_words).vocab_size == 2048
    # [model] vocab_size pads the output past the tokenizer's words (bench.py's Llama 3 step without its tokenizer)
    padded = train.model_args(train.load_config(["--config", DEBUG, "--model.vocab_size", "128256"]), small)
    assert (padded.vocab_size, padded.bos_id) == (128256, small.bos_id)
    missing = train.load_config(["--model.tokenizer_path", "missing.model", "--model.vocab_size", "5000"])
    assert train.model_args(missing).vocab_size == 5000
