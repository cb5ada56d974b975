"""Tests for checkpoint_convert.py: Meta <-> DCP <-> Hugging Face, bit-exact round trips, equal logits
in transformers' LlamaForCausalLM, Meta's model-parallel layouts, the exported tokenizer, trainer step-N
export, torchtitan's layout both ways, the README's sampling snippet, file modes, --help, one-line errors,
peak memory. (tests/test_titan.py runs the real torchtitan.)

    python -m pytest tests/test_convert.py -q

Peak RSS of each direction for a ~800 MB fp32 model (not a test; prints a table):

    python tests/test_convert.py --measure [--dim 1024 --n_layers 12 --vocab_size 32000]
"""

import argparse
import base64
import contextlib
import dataclasses
import glob
import gzip
import json
import logging
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import checkpoint_convert as C  # noqa: E402
from conftest import run_training, titan_names  # noqa: E402
import data as D  # noqa: E402
from pretrain.config import to_toml  # noqa: E402
from pretrain import hf_layout as H  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to")  # DCP without a process group

# Meta's params.json keys only: GQA, Llama 3.1 rope scaling, a vocab that is not Llama 3's.
PARAMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, multiple_of=32,
              ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True)
# Model-parallel split dim per weight in Meta's consolidated.NN.pth: ColumnParallel 0, RowParallel 1; the
# embedding is VocabParallel (dim 0) in Llama 3's reference, ParallelEmbedding (dim 1) in Llama 2's.
# Anything else (the norms) is replicated.
LLAMA3_SPLIT = dict(wq=0, wk=0, wv=0, w1=0, w3=0, output=0, wo=1, w2=1, tok_embeddings=0)
LLAMA2_SPLIT = {**LLAMA3_SPLIT, "tok_embeddings": 1}


def convert(command, src, dst, *extra):
    C.main([command, "--input_dir", str(src), "--output_dir", str(dst), *map(str, extra)])
    return dst


def random_state_dict(args: M.ModelArgs, seed=0, dtype=torch.bfloat16) -> dict:
    """Sharp-ish random weights: large q/k make attention peaked, so a wrong rope layout shows up."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in M.Transformer(args).state_dict().items()}
    sd = {}
    for k, shape in shapes.items():
        if k.endswith("norm.weight"):
            w = 1 + 0.2 * torch.randn(shape, generator=gen)
        elif k.endswith(("wq.weight", "wk.weight")):
            w = torch.randn(shape, generator=gen) * 2.0 / shape[1] ** 0.5
        else:
            w = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        sd[k] = w.to(dtype)
    return sd


def write_meta(dir, params: dict, sd: dict, n_shards=1, split=LLAMA3_SPLIT):
    """Meta's layout, split across model-parallel ranks as Meta's reference code does."""
    os.makedirs(dir)
    with open(os.path.join(dir, "params.json"), "w") as f:
        json.dump(params, f)
    sd = {**sd, "rope.freqs": torch.randn(params["dim"] // params["n_heads"] // 2)}  # Meta ships it; dropped
    for rank in range(n_shards):
        shard = {}
        for k, w in sd.items():
            dim = split.get(k.split(".")[-2])
            shard[k] = w.clone() if dim is None else w.chunk(n_shards, dim=dim)[rank].clone()
        torch.save(shard, os.path.join(dir, f"consolidated.{rank:02d}.pth"))
    return dir


def read_dcp_model(dir) -> dict:
    return C.load_dcp(str(dir), C.dcp_model(str(dir))[1])


def assert_bitwise_equal(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k  # bits, not just values


def assert_same_model(a: dict, b: dict):
    """HF keeps the FFN width, not Meta's rule (multiple_of, ffn_dim_multiplier) that produced it, and a
    scaled rope declares Llama 3.1's context (max_seq_len is only the length of model.py's rope table)."""
    rule = ("multiple_of", "ffn_dim_multiplier", "max_seq_len")
    assert {k: v for k, v in a.items() if k not in rule} == {k: v for k, v in b.items() if k not in rule}
    assert a["max_seq_len"] == max(b["max_seq_len"], H.LLAMA31_CONTEXT if b["use_scaled_rope"] else 0)
    assert C.expected_shapes(M.ModelArgs(**a)) == C.expected_shapes(M.ModelArgs(**b))


@pytest.fixture(scope="module", params=[8.0, 32.0], ids=["rope8", "rope32"])
def meta(request, tmp_path_factory):
    """(Meta params.json dict, bf16 state dict, META_DIR) for rope scaling factors 8 and 32."""
    params = dict(PARAMS) if request.param == 8.0 else {**PARAMS, "rope_scaling_factor": request.param}
    sd = random_state_dict(M.ModelArgs(**params))
    return params, sd, write_meta(tmp_path_factory.mktemp("meta") / "meta", params, sd)


@pytest.fixture(scope="module")
def dcp_dir(meta, tmp_path_factory):
    return convert("torch2dcp", meta[2], tmp_path_factory.mktemp("dcp") / "dcp")


def write_tiktoken(path, tokens: list):
    """A tokenizer.model: base64(token) rank per line, ranks in list order."""
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    return path


@pytest.fixture(scope="module")
def ascii_tokenizer(tmp_path_factory):
    """128 single-byte tokens + 256 special: PARAMS' vocab of 384."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    return write_tiktoken(path, [bytes([b]) for b in range(128)])


@pytest.fixture(scope="module")
def hf_dir(dcp_dir, ascii_tokenizer, tmp_path_factory):
    """Small shards, so the index and several files are exercised."""
    default, C.MAX_SHARD_BYTES = C.MAX_SHARD_BYTES, 60_000
    try:
        return convert("dcp2hf", dcp_dir, tmp_path_factory.mktemp("hf") / "hf",
                       "--tokenizer_path", ascii_tokenizer)
    finally:
        C.MAX_SHARD_BYTES = default


def test_torch2dcp_dcp2torch_bitwise(meta, dcp_dir, tmp_path):
    params, sd, _ = meta
    out = convert("dcp2torch", dcp_dir, tmp_path / "back")
    assert_bitwise_equal(torch.load(out / "consolidated.00.pth", weights_only=True), sd)
    assert json.load(open(out / "params.json")) == params  # Meta's keys, no max_seq_len
    saved = json.load(open(dcp_dir / "params.json"))
    assert saved == M.ModelArgs(**params).params() and "attn_mask_type" not in saved  # Meta's keys only


def test_dcp2torch_dtype(meta, dcp_dir, tmp_path):
    out = convert("dcp2torch", dcp_dir, tmp_path / "fp32", "--dtype", "float32")
    back = torch.load(out / "consolidated.00.pth", weights_only=True)
    assert all(w.dtype == torch.float32 and torch.equal(w, meta[1][k].float()) for k, w in back.items())


def test_long_conversions_say_how_far_they_got_in_plain_lines_in_a_log(meta, dcp_dir, tmp_path, monkeypatch, capsys):
    """Where stderr is a file (a Slurm log), a bar is plain lines: here every update shows (no delay), in a
    long conversion the first after 3 s and then every 15 s. On a terminal it is tqdm's bar."""
    from pretrain import progress
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "EVERY", 0.0)
    monkeypatch.setattr(C, "MAX_SHARD_BYTES", 60_000)
    convert("dcp2hf", dcp_dir, tmp_path / "hf", "--tokenizer_path", "")
    convert("dcp2torch", dcp_dir, tmp_path / "meta")
    lines = capsys.readouterr().err.splitlines()
    shards = len(glob.glob(str(tmp_path / "hf" / "model-*.safetensors")))
    writing = [ln for ln in lines if ln.startswith("writing safetensors: ")]
    reading = [ln for ln in lines if ln.startswith(f"reading {dcp_dir}: ")]
    assert shards > 1 and len(writing) == shards + 1 and len(reading) > 1, lines  # the last line once more
    assert re.fullmatch(rf"writing .*: [\d.]+ KiB of [\d.]+ KiB \(100%\), {shards}/{shards} shards, 0 s", writing[-1])
    assert "(100%), 0 s" in reading[-1]
    monkeypatch.setattr(progress, "DELAY", 3.0)  # a quick one says nothing
    with progress.Progress(10, "quick", "steps") as bar:
        bar.update(10)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("split,n_shards", [(LLAMA3_SPLIT, 8), (LLAMA2_SPLIT, 2)], ids=["llama3", "llama2"])
def test_model_parallel_shards_merge(meta, tmp_path, split, n_shards):
    """Llama 3 (70B, 405B) shards split the embedding on the vocab, Llama 2's on dim: both merge exactly."""
    params, sd, _ = meta
    sharded = write_meta(tmp_path / "mp", params, sd, n_shards, split)
    shard = torch.load(sharded / f"consolidated.{n_shards - 1:02d}.pth", weights_only=True)
    assert shard["output.weight"].shape == (384 // n_shards, 64)
    assert shard["tok_embeddings.weight"].shape == ((384 // 8, 64) if split is LLAMA3_SPLIT else (384, 32))
    back = convert("dcp2torch", convert("torch2dcp", sharded, tmp_path / "dcp"), tmp_path / "back")
    assert_bitwise_equal(torch.load(back / "consolidated.00.pth", weights_only=True), sd)


def test_stock_dcp_to_torch_save_reads_output(meta, dcp_dir, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(dcp_dir), str(tmp_path / "stock.pt"))
    assert_bitwise_equal(torch.load(tmp_path / "stock.pt", weights_only=True)["model"], meta[1])


def test_hf_logits_match(meta, hf_dir):
    from transformers import LlamaForCausalLM
    params, sd, _ = meta
    args = M.ModelArgs(**params)
    ours = M.Transformer(args)
    ours.load_state_dict({k: w.float() for k, w in sd.items()})
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert (got - want).abs().max() < 1e-4
    # The rope scaling reached transformers (at 48 positions the logits alone barely see the factor).
    inv_freq = torch.angle(M.precompute_freqs_cis(args)[1]).double()
    assert torch.allclose(hf.model.rotary_emb.inv_freq.double(), inv_freq, rtol=1e-5)
    # Without the q/k permutation the logits would differ: the test can see a wrong layout.
    with torch.no_grad():
        for layer in ours.layers:
            for name in ("wq", "wk"):
                w = getattr(layer.attention, name).weight
                w.copy_(H.permute_rope(f"attention.{name}.weight", w, args, to_hf=True))
        assert (ours(tokens) - want).abs().max() > 1e-2


def test_hf_files_and_config(meta, dcp_dir, hf_dir, tmp_path):
    params, sd, _ = meta
    index = json.load(open(hf_dir / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")) == files
    assert set(index["weight_map"]) == {H.hf_name(k) for k in sd}
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in sd.values())
    config = json.load(open(hf_dir / "config.json"))
    assert config["intermediate_size"] == sd["layers.0.feed_forward.w1.weight"].shape[0]
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 131072  # Llama 3.1's
    assert (config["bos_token_id"], config["eos_token_id"]) == (128, 129)  # vocab - 256, vocab - 255
    assert config["rope_scaling"]["factor"] == params.get("rope_scaling_factor", 8.0)
    tokenizer_files = ["generation_config.json", "special_tokens_map.json", "tokenizer.json",
                       "tokenizer_config.json"]
    assert sorted(f for f in os.listdir(hf_dir) if not f.startswith("model")) == ["config.json",
                                                                                   *tokenizer_files]
    generation = json.load(open(hf_dir / "generation_config.json"))
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (128, 129)
    tokenizer_config = json.load(open(hf_dir / "tokenizer_config.json"))
    assert tokenizer_config["bos_token"] == "<|begin_of_text|>"
    assert tokenizer_config["eos_token"] == "<|end_of_text|>"
    single = convert("dcp2hf", dcp_dir, tmp_path / "one", "--tokenizer_path", "")  # 5 GB shards: one file
    assert sorted(os.listdir(single)) == ["config.json", "model-00001-of-00001.safetensors",
                                          "model.safetensors.index.json"]


def test_dcp2hf_hf2dcp_bitwise(dcp_dir, hf_dir, tmp_path):
    assert os.path.isfile(hf_dir / "tokenizer.json")  # ignored by hf2dcp
    back = convert("hf2dcp", hf_dir, tmp_path / "back")
    assert_bitwise_equal(read_dcp_model(back), read_dcp_model(dcp_dir))
    assert_same_model(json.load(open(back / "params.json")), json.load(open(dcp_dir / "params.json")))


def test_hf2dcp_reads_transformers5_config(meta, dcp_dir, hf_dir, tmp_path):
    """save_pretrained of transformers 5 writes rope_parameters and dtype, not rope_scaling/torch_dtype."""
    from transformers import LlamaForCausalLM
    LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "saved")
    config = json.load(open(tmp_path / "saved" / "config.json"))
    assert "rope_parameters" in config and "rope_scaling" not in config
    back = convert("hf2dcp", tmp_path / "saved", tmp_path / "back")
    assert_bitwise_equal(read_dcp_model(back), read_dcp_model(dcp_dir))
    assert_same_model(json.load(open(back / "params.json")), json.load(open(dcp_dir / "params.json")))


def test_hf2dcp_tied_embeddings(dcp_dir, hf_dir, tmp_path):
    """Llama 3.2 1B/3B on the Hub store lm_head once, tied to the embedding; Meta's format has both."""
    from safetensors.torch import load_file, save_file
    tied = tmp_path / "tied"
    os.makedirs(tied)
    sd = {}
    for file in set(json.load(open(hf_dir / "model.safetensors.index.json"))["weight_map"].values()):
        sd.update(load_file(hf_dir / file))
    sd["model.embed_tokens.weight"] = sd.pop("lm_head.weight")  # one matrix, used for both
    save_file(sd, tied / "model.safetensors")
    config = {**json.load(open(hf_dir / "config.json")), "tie_word_embeddings": True}
    json.dump(config, open(tied / "config.json", "w"))
    back = read_dcp_model(convert("hf2dcp", tied, tmp_path / "dcp"))
    assert torch.equal(back["output.weight"], back["tok_embeddings.weight"])
    assert torch.equal(back["output.weight"], read_dcp_model(dcp_dir)["output.weight"])


def test_trainer_step_folder_exports_model_only(meta, ascii_tokenizer, tmp_path):
    """Also: dcp2hf takes the tokenizer that the run's config.toml (in the dump folder) names."""
    params, sd, _ = meta
    args = M.ModelArgs(**params)
    fp32 = {k: w.float() for k, w in sd.items()}  # the trainer keeps fp32 weights
    step = tmp_path / "checkpoint" / "step-3"
    dcp.save({"model": fp32,
              "optimizer": {f"state.{k}.exp_avg": torch.randn_like(w) for k, w in fp32.items()},
              "train": {"step": torch.tensor(3), "lr_scheduler": torch.zeros(17, dtype=torch.uint8)},
              "data_dp0": torch.zeros(9, dtype=torch.uint8), "rng_rank0": torch.get_rng_state()},
             checkpoint_id=str(step), no_dist=True)
    json.dump(args.params(), open(step / "params.json", "w"))
    back = convert("dcp2torch", step, tmp_path / "meta") / "consolidated.00.pth"
    assert_bitwise_equal(torch.load(back, weights_only=True), fp32)
    with pytest.raises(SystemExit):  # without config.toml: train.py's default tokenizer, 2048 tokens
        convert("dcp2hf", step, tmp_path / "hf")
    cfg = T.Config()
    cfg.model.tokenizer_path = str(ascii_tokenizer)
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    hf = convert("dcp2hf", step, tmp_path / "hf")
    assert len(json.load(open(hf / "tokenizer.json"))["model"]["vocab"]) == 128
    assert_bitwise_equal(read_dcp_model(convert("hf2dcp", hf, tmp_path / "dcp")), fp32)


def titan_layout(path, sd: dict, full: bool, version: str = "0.2.2"):
    """torchtitan's layout, written with stock DCP: the model at the top level under its names and no
    params.json; a full save adds its flattened optimizer and its pickled lr schedule, step and loader state."""
    sd = titan_names(sd, version)
    state = dict(sd)
    if full:
        state["optimizer"] = {f"state.{k}.exp_avg": torch.randn_like(w, dtype=torch.float32) for k, w in sd.items()}
        state["lr_scheduler"] = {"last_epoch": 5, "base_lrs": [3e-4]}
        state["train_state"] = {"step": 5, "ntokens_seen": 20480}
        state["dataloader"] = {"dp_rank_0": {"token_buffer": [1, 2, 3]}, "world_size": 1}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.parametrize("version", ["0.3.0", "0.2.2"])
def test_torchtitan_layout_in_and_out(tmp_path, version):
    """dcp2torch reads a full torchtitan checkpoint (its model among optimizer.*, lr_scheduler.* ...) with
    --params: bit for bit what stock dcp_to_torch_save finds there (dcp2hf shares the reading). dcp2titan
    writes that layout: the model at the top level under the version's names, where torchtitan's
    initial_load_path reads them (0.3.0 by default)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    sd = random_state_dict(M.ModelArgs(**PARAMS))
    json.dump(PARAMS, open(tmp_path / "params.json", "w"))
    titan = titan_layout(tmp_path / "titan", sd, full=True, version=version)
    dcp_to_torch_save(str(titan), str(tmp_path / "stock.pt"))
    stock = torch.load(tmp_path / "stock.pt", weights_only=True)
    meta = convert("dcp2torch", titan, tmp_path / "meta", "--params", tmp_path / "params.json")
    theirs = titan_names(sd, version)
    assert_bitwise_equal(torch.load(meta / "consolidated.00.pth", weights_only=True),
                         {k: stock[t] for k, t in zip(sd, theirs)})

    ours = tmp_path / "ours"
    dcp.save({"model": sd}, checkpoint_id=str(ours), no_dist=True)
    json.dump(M.ModelArgs(**PARAMS).params(), open(ours / "params.json", "w"))
    which = [] if version == "0.3.0" else ["--titan_version", version]
    out = convert("dcp2titan", ours, tmp_path / "out", *which)
    back = {k: torch.empty_like(w) for k, w in theirs.items()}  # as torchtitan asks for its model's keys
    dcp.load(back, checkpoint_id=str(out), no_dist=True)
    assert_bitwise_equal(back, theirs)
    assert json.load(open(out / "params.json")) == json.load(open(ours / "params.json"))  # for our converters


# --- average: the mean of several checkpoints (Polyak averaging) ------------------------------------------

@pytest.mark.slow
def test_average_is_the_mean_of_the_tensors_and_refuses_other_models_and_runs(tmp_path, capsys):
    """Two checkpoints' average is (a + b) / 2 to the bit, in fp32 and in bf16 (summed in fp32), and of a 2-rank
    run's step-N (chunks); --ema weighs the newest most; the output converts on (dcp2torch). Another model,
    another run, a bad --ema: one line."""
    from pretrain.checkpoint import json_tensor
    args = M.ModelArgs(**PARAMS)
    sds = [random_state_dict(args, seed=i, dtype=torch.float32) for i in range(3)]
    for i, sd in enumerate(sds):  # as trainer step-N folders: the model and the run's resume keys
        run = {"training.seed": 0, "model.flavor": "debugmodel"}
        dcp.save({"model": sd, "train": {"config": json_tensor(run)}}, checkpoint_id=str(tmp_path / f"s{i}"),
                 no_dist=True)
        json.dump(args.params(), open(tmp_path / f"s{i}" / "params.json", "w"))
    C.main(["average", str(tmp_path / "s0"), str(tmp_path / "s1"), "--output", str(tmp_path / "mean")])
    assert_bitwise_equal(read_dcp_model(tmp_path / "mean"), {k: (sds[0][k] + sds[1][k]) / 2 for k in sds[0]})
    C.main(["average", *(str(tmp_path / f"s{i}") for i in range(3)), "--output", str(tmp_path / "ema"), "--ema", "0.5"])
    for k, w in read_dcp_model(tmp_path / "ema").items():  # weights 1/7, 2/7, 4/7
        assert torch.allclose(w, (sds[0][k] + 2 * sds[1][k] + 4 * sds[2][k]) / 7, atol=1e-6), k
    meta = convert("dcp2torch", tmp_path / "mean", tmp_path / "meta")
    assert torch.load(meta / "consolidated.00.pth", weights_only=True).keys() == sds[0].keys()
    halves = [{k: w.bfloat16() for k, w in sd.items()} for sd in sds[:2]]
    for i, sd in enumerate(halves):
        convert("torch2dcp", write_meta(tmp_path / f"bf{i}", PARAMS, sd), tmp_path / f"b{i}")
    C.main(["average", str(tmp_path / "b0"), str(tmp_path / "b1"), "--output", str(tmp_path / "bmean")])
    assert_bitwise_equal(read_dcp_model(tmp_path / "bmean"),
                         {k: ((halves[0][k].float() + halves[1][k].float()) / 2).bfloat16() for k in sds[0]})

    # A trainer's step-N from 2 FSDP ranks holds each tensor in chunks, one a rank: each read into its place.
    dump = tmp_path / "run"
    proc = run_training(["--config", os.path.join(REPO_ROOT, "configs/debug_model.toml"), "--job.dump_folder", dump,
                         "--model.n_layers", "2", "--training.seq_len", "64", "--training.steps", "4",
                         "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--validation.enable", "false"],
                        nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [dump / "checkpoint" / f"step-{n}" for n in (2, 4)]
    C.main(["average", *map(str, steps), "--output", str(tmp_path / "runmean")])
    want = [read_dcp_model(step) for step in steps]
    assert_bitwise_equal(read_dcp_model(tmp_path / "runmean"), {k: (want[0][k] + want[1][k]) / 2 for k in want[0]})

    other_run = {"training.seed": 1, "model.flavor": "debugmodel"}
    dcp.save({"model": sds[2], "train": {"config": json_tensor(other_run)}}, checkpoint_id=str(tmp_path / "r"),
             no_dist=True)
    json.dump(args.params(), open(tmp_path / "r" / "params.json", "w"))
    folder = lambda name: str(tmp_path / name)  # noqa: E731
    cases = [([folder("s0"), folder("b1")],
              ["tok_embeddings.weight is bfloat16 (384, 64) there but float32 (384, 64)"]),
             ([folder("s0"), folder("r")], ["training.seed is 1 there but 0 in", "one model and one run"]),
             ([folder("s0"), folder("s1"), "--ema", "1.5"], ["--ema 1.5: must be in (0, 1]"]),
             ([folder("s0"), folder("nope")], ["STEP_DIR", "nope does not exist"])]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit:
            C.main(["average", *argv, "--output", folder("bad")])
        err = capsys.readouterr().err
        assert exit.value.code == 1 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
        assert not (tmp_path / "bad").exists()


# --- the exported tokenizer, the README's snippet, file modes, rope config, --help --------------------

def bundled_documents() -> list:
    """Every document under assets/data (about 1,500, 4.6 MB of text)."""
    import pyarrow.parquet as pq
    texts = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "assets", "data", "**", "*.*"), recursive=True)):
        if path.endswith(".json.gz"):
            with gzip.open(path, "rt") as f:
                texts += [json.loads(line)["text"] for line in f]
        elif path.endswith(".parquet"):
            texts += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    assert len(texts) > 1000
    return texts


def stdlib_sources() -> list:
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return [open(p, encoding="utf-8").read() for p in paths]


EDGE_TEXTS = ["", " ", "  x  \r\n\n\t", "naïve café — 日本語, Ελληνικά 🙂🙂", "I'M DON'T we'll 12345 3.14159",
              "a\u00a0b\u2028c\x00\x7f\ufffd"]


@contextlib.contextmanager
def transformers_warnings():
    """The warnings transformers logs inside the block (it logs them, it does not warnings.warn them)."""
    records, handler = [], logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("transformers").removeHandler(handler)


@pytest.fixture(scope="module")
def large_tokenizer(tmp_path_factory):
    """8,000 byte-level BPE ranks trained (in Rust, ~1 s) with Llama 3's split regex on the bundled text
    plus Python's standard library source: much larger than the bundled 1,792, with code and Unicode."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(D.LLAMA3_PAT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.train_from_iterator(bundled_documents() + stdlib_sources() + EDGE_TEXTS, trainers.BpeTrainer(
        vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    byte = {c: b for b, c in H.byte_chars().items()}
    vocab = sorted(hf.get_vocab().items(), key=lambda kv: kv[1])  # merges in creation order: valid ranks
    return write_tiktoken(tmp_path_factory.mktemp("large") / "tokenizer.model",
                          [bytes(byte[c] for c in token) for token, _ in vocab])


def hf_tokenizer(path, out):
    """The tokenizer files dcp2hf writes for a model of this tokenizer's vocab, loaded with AutoTokenizer."""
    from transformers import AutoTokenizer
    os.makedirs(out)
    args = dataclasses.replace(M.flavors["debugmodel"], vocab_size=D.Tokenizer(str(path)).n_words)
    C.save_tokenizer(str(path), H.hf_config(args, torch.bfloat16), str(out))
    return AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("which", ["bundled", pytest.param("large", marks=pytest.mark.slow)])
def test_tokenizer_ids_match(which, request, tmp_path):
    """AutoTokenizer on the export gives data.Tokenizer's ids on every bundled document, with BOS first
    (Llama 3's post-processor; the trainer's EOS marks a document end, not a prompt end)."""
    path = (os.path.join(REPO_ROOT, C.DEFAULT_TOKENIZER) if which == "bundled"
            else request.getfixturevalue("large_tokenizer"))
    ours, hf = D.Tokenizer(str(path)), hf_tokenizer(path, tmp_path / "hf")
    assert len(hf) == ours.n_words and (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
    # The large one is also trained on Python's sources: they reach its high ranks.
    texts = bundled_documents() + EDGE_TEXTS + (stdlib_sources() if which == "large" else [])
    ids = hf(texts)["input_ids"]
    for text, got in zip(texts, ids):
        assert got == ours.encode(text, bos=True, eos=False), text[:200]
    assert len({i for doc in ids for i in doc}) > (0.9 if which == "large" else 0.6) * (ours.n_words - 256)
    plain = hf(texts[:50], add_special_tokens=False)["input_ids"]
    assert plain == [ours.encode(t, bos=False, eos=False) for t in texts[:50]]
    assert [hf.decode(i) for i in plain] == texts[:50]
    # Special tokens in the input are special (as in Llama 3's own HF tokenizer, while the trainer reads
    # web text as plain text): each one id, as tiktoken with allowed_special; skipped when decoding.
    for text in ["<|begin_of_text|> as text <|end_of_text|>", "".join(ours.special)]:
        assert hf(text)["input_ids"] == [ours.bos_id] + ours.model.encode(text, allowed_special="all")
    for name, id in ours.special.items():
        assert hf.convert_tokens_to_ids(name) == id and hf.decode([id]) == name
    assert hf.decode(hf("<|eot_id|>hi")["input_ids"], skip_special_tokens=True) == "hi"


def readme_snippet(section: str) -> str:
    readme = open(os.path.join(REPO_ROOT, "README.md")).read()
    body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S)[1]


@pytest.mark.slow
def test_readme_sampling_snippet_on_debug_export(tmp_path, monkeypatch, capsys):
    """The README's dcp2hf of a trainer step-N (tokenizer from its config.toml, a path relative to the repo)
    then its five-line generate snippet, run as is; transformers logs no warning on the way."""
    args = M.flavors["debugmodel"]
    model = M.Transformer(args)
    model.init_weights()
    step = tmp_path / "outputs" / "debug_model" / "checkpoint" / "step-50"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    json.dump(args.params(), open(step / "params.json", "w"))
    (step.parent.parent / "config.toml").write_text(to_toml(T.Config()))  # tokenizer_path assets/...
    monkeypatch.chdir(tmp_path)  # the README's paths; assets/ is found in the repo
    convert("dcp2hf", step.relative_to(tmp_path), "hf_out")
    assert "tokenizer from " + os.path.join(REPO_ROOT, C.DEFAULT_TOKENIZER) in capsys.readouterr().out
    code = readme_snippet("Evaluate and sample")
    assert len(code.strip().splitlines()) == 5 and '"hf_out"' in code
    with transformers_warnings() as records:
        exec(code, {})
    printed = capsys.readouterr().out
    assert printed.startswith("<|begin_of_text|>The capital of France is") and len(printed) > 40, printed
    assert not records, [r.getMessage() for r in records]


@pytest.mark.parametrize("flavor", ["PARAMS", *M.flavors])
def test_hf_config_loads_without_warnings(flavor):
    """transformers warns about a llama3 rope whose original 8192 positions are not below
    max_position_embeddings: the small flavors (2048) used to get that warning."""
    from transformers import LlamaConfig
    args = M.ModelArgs(**PARAMS) if flavor == "PARAMS" else M.flavors[flavor]
    with transformers_warnings() as records:
        config = LlamaConfig(**H.hf_config(args, torch.bfloat16))
    assert not records, [r.getMessage() for r in records]
    assert config.max_position_embeddings >= args.max_seq_len
    if flavor in ("8B", "1B"):  # as on the Hub
        assert config.max_position_embeddings == 131072
        assert config.rope_parameters["factor"] == args.rope_scaling_factor


@pytest.mark.parametrize("umask", [0o022, 0o007], ids=["022", "007"])
def test_output_files_follow_umask(umask, meta, dcp_dir, ascii_tokenizer, tmp_path):
    """safetensors writes mode 600: on a shared filesystem nobody else could read the weights."""
    old = os.umask(umask)
    try:
        outs = [convert("dcp2hf", dcp_dir, tmp_path / "hf", "--tokenizer_path", ascii_tokenizer),
                convert("torch2dcp", meta[2], tmp_path / "dcp"),
                convert("dcp2torch", dcp_dir, tmp_path / "meta")]
        outs.append(convert("hf2dcp", outs[0], tmp_path / "back"))
    finally:
        os.umask(old)
    modes = {str(p): oct(p.stat().st_mode & 0o777) for out in outs for p in out.rglob("*") if p.is_file()}
    assert any(p.endswith(".safetensors") for p in modes) and len(modes) > 12
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert {oct(out.stat().st_mode & 0o777) for out in outs} == {oct(0o777 & ~umask)}


def test_help_documents_every_argument(capsys):
    parser = C.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert [c.dest for c in subparsers._choices_actions] == ["torch2dcp", "dcp2torch", "dcp2hf", "hf2dcp",
                                                             "dcp2titan", "average"]
    assert all(len(c.help) > 20 for c in subparsers._choices_actions)
    for name, sub in subparsers.choices.items():
        options = [a for a in sub._actions if a.dest != "help"]
        assert all(a.help and len(a.help) > 20 for a in options), name
    dcp2hf = subparsers.choices["dcp2hf"]
    assert {a.dest for a in dcp2hf._actions} >= {"input_dir", "output_dir", "tokenizer_path"}
    with pytest.raises(SystemExit) as exit:
        C.main(["dcp2hf", "--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "--tokenizer_path" in out and "config.toml" in out


def error_case(name, tmp_path):
    """Build a bad input for case `name`; return (command, input_dir, output_dir, words in the error)."""
    params, sd = PARAMS, random_state_dict(M.ModelArgs(**PARAMS))
    out = tmp_path / "out"
    if name == "missing_input":
        return "torch2dcp", tmp_path / "nope", out, ["nope", "does not exist"]
    if name == "optimizer_only":
        dcp.save({"optimizer": {"state.w.exp_avg": torch.zeros(3)}}, checkpoint_id=str(tmp_path / "o"),
                 no_dist=True)
        json.dump(M.ModelArgs(**params).params(), open(tmp_path / "o" / "params.json", "w"))
        return "dcp2hf", tmp_path / "o", out, ["no model.* tensors", "step-N"]
    if name == "missing_params":
        dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "p"), no_dist=True)
        return "dcp2torch", tmp_path / "p", out, ["params.json", "missing"]
    if name == "shard_shapes":
        bad = write_meta(tmp_path / "mp", params, sd, n_shards=2)
        shard = torch.load(bad / "consolidated.01.pth", weights_only=True)
        shard["layers.1.attention.wo.weight"] = shard["layers.1.attention.wo.weight"][:-1]
        torch.save(shard, bad / "consolidated.01.pth")
        return "torch2dcp", bad, out, ["layers.1.attention.wo.weight is (64, 32) in consolidated.00.pth but "
                                       "(63, 32) in consolidated.01.pth", "no concatenation dim", "(64, 64)"]
    if name == "shard_vs_params":  # every shard alike, but from a model with another dim
        bad = write_meta(tmp_path / "sp", params, sd, n_shards=2)
        json.dump({**params, "dim": 128}, open(bad / "params.json", "w"))
        return "torch2dcp", bad, out, ["tok_embeddings.weight is (192, 64) in each of the 2 shards",
                                       "(384, 128) params.json implies"]
    if name == "tokenizer_vocab":
        dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "t"), no_dist=True)
        json.dump(M.ModelArgs(**params).params(), open(tmp_path / "t" / "params.json", "w"))
        return "dcp2hf", tmp_path / "t", out, ["tokenizer.model has 2,048 tokens but the model 384",
                                               "--tokenizer_path"]
    if name == "params_mismatch":
        bad = write_meta(tmp_path / "pm", {**params, "n_layers": 3}, sd)
        return "torch2dcp", bad, out, ["layers.2.", "absent in the weights", "same model"]
    if name == "no_safetensors":
        os.makedirs(tmp_path / "hf")
        config = H.hf_config(M.ModelArgs(**params), torch.bfloat16)
        json.dump(config, open(tmp_path / "hf" / "config.json", "w"))
        return "hf2dcp", tmp_path / "hf", out, ["model.safetensors", "No such file"]
    if name == "titan_no_params":  # torchtitan keeps the shape in its config, not beside the weights
        return "dcp2torch", titan_layout(tmp_path / "titan", sd, full=False), out, [
            "titan/params.json is missing", "torchtitan saves none", "--params", "debugmodel"]
    if name == "output_not_empty":
        os.makedirs(out)
        open(out / "keep.txt", "w").write("mine")
        return "torch2dcp", write_meta(tmp_path / "meta", params, sd), out, ["not empty"]
    raise ValueError(name)


# Two through the converter as a user runs it (a subprocess: the user's view, tracebacks included), one that
# stops before any file is read and one that stops at the output; the rest through the same main() in this
# process, which skips torch's 3 s of imports.
ERROR_CASES = ["missing_input", "output_not_empty"]
IN_PROCESS_ERROR_CASES = ["optimizer_only", "missing_params", "shard_shapes", "params_mismatch", "no_safetensors",
                          "shard_vs_params", "tokenizer_vocab", "titan_no_params"]


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory):
    """Each bad input through the converter as a user runs it (a subprocess), all started at once."""
    runs = {}
    for name in ERROR_CASES:
        tmp_path = tmp_path_factory.mktemp(name)
        command, src, out, words = error_case(name, tmp_path)
        proc = subprocess.Popen([sys.executable, "checkpoint_convert.py", command, "--input_dir", str(src),
                                 "--output_dir", str(out)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        runs[name] = (proc, tmp_path, out, words)
    results = {}
    for name, (proc, *rest) in runs.items():
        stderr = proc.communicate()[1]
        results[name] = (proc.returncode, stderr, *rest)
    return results


def check_error(name, returncode, stderr, tmp_path, out, words):
    assert returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert all(w in lines[0] for w in words), lines[0]
    if name == "output_not_empty":
        assert os.listdir(out) == ["keep.txt"]  # untouched
    else:
        assert not out.exists()
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".out.")]  # no temp folder left


@pytest.mark.slow
@pytest.mark.parametrize("name", ERROR_CASES)
def test_errors_are_one_line(name, error_runs):
    check_error(name, *error_runs[name])


@pytest.mark.parametrize("name", IN_PROCESS_ERROR_CASES)
def test_errors_are_one_line_in_process(name, tmp_path, capsys):
    command, src, out, words = error_case(name, tmp_path)
    with pytest.raises(SystemExit) as exit:
        convert(command, src, out)
    check_error(name, exit.value.code, capsys.readouterr().err, tmp_path, out, words)


# --- peak memory ----------------------------------------------------------------------------------------

MEASURE = """if 1:
    import os
    import resource
    import sys
    import checkpoint_convert as C
    workdir, C.MAX_SHARD_BYTES = sys.argv[1], int(sys.argv[2])
    for command, src, dst in [("torch2dcp", "meta", "dcp"), ("dcp2torch", "dcp", "meta2"),
                              ("dcp2hf", "dcp", "hf"), ("hf2dcp", "hf", "dcp2"), ("average", "dcp", "mean")]:
        if os.fork() == 0:  # a fresh peak per command, without paying python + torch startup again
            peaks = []
            for name in ("tiny", "big"):
                src_dir, dst_dir = (os.path.join(workdir, name, d) for d in (src, dst))
                if command == "average":  # the checkpoint with its copy
                    C.main([command, src_dir, os.path.join(workdir, name, "dcp2"), "--output", dst_dir])
                else:
                    C.main([command, "--input_dir", src_dir, "--output_dir", dst_dir,
                            *(["--tokenizer_path", ""] if command == "dcp2hf" else [])])  # weights only
                peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
            print("RSS", command, *peaks, flush=True)
            os._exit(0)
        assert os.wait()[1] == 0, command
"""


def measure_peak_rss(workdir, params: dict, dtype=torch.float32, n_shards=1,
                     max_shard_bytes=C.MAX_SHARD_BYTES) -> dict:
    """{command: (peak RSS growth, checkpoint size)} in bytes for each direction, in a subprocess.

    The baseline is the peak after converting a tiny checkpoint in the same process first, so imports
    and one-off allocations made on first use do not count as the conversion's memory."""
    for name, p in (("tiny", PARAMS), ("big", params)):
        write_meta(os.path.join(workdir, name, "meta"), p, random_state_dict(M.ModelArgs(**p), dtype=dtype),
                   n_shards)
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(workdir, "big", "meta", "*.pth")))
    result = subprocess.run([sys.executable, "-c", MEASURE, str(workdir), str(max_shard_bytes)],
                            capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RSS ")]
    return {command: ((int(peak) - int(base)) * 1024, size) for command, base, peak in rows}


@pytest.mark.slow
def test_peak_rss_small(tmp_path):
    params = dict(PARAMS, dim=256, n_heads=8, n_kv_heads=4, n_layers=8, vocab_size=4096, multiple_of=64)
    largest = 4 * params["vocab_size"] * params["dim"]  # the embedding's fp32 bytes
    for command, (growth, size) in measure_peak_rss(tmp_path, params).items():
        report = f"{command}: peak RSS grew {growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB checkpoint"
        print(report)  # visible with pytest -s
        assert 15e6 < size and growth < 1.5 * size, report
        if command == "average":  # a tensor at a time: its sum and one input's copy, not the model
            assert growth < 2 * largest + 12e6 and growth < size / 2, report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure", action="store_true", required=True)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n_layers", type=int, default=12)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--n_shards", type=int, default=1, help="model-parallel consolidated.NN.pth files")
    parser.add_argument("--max_shard_bytes", type=int, default=C.MAX_SHARD_BYTES, help="dcp2hf's file size")
    parser.add_argument("--workdir", default=None, help="default: a temp folder, removed afterwards")
    opts = parser.parse_args()
    params = dict(PARAMS, dim=opts.dim, n_layers=opts.n_layers, n_heads=16, n_kv_heads=4,
                  vocab_size=opts.vocab_size, multiple_of=256, ffn_dim_multiplier=None)
    with tempfile.TemporaryDirectory(dir=opts.workdir) as workdir:
        for command, (growth, size) in measure_peak_rss(workdir, params, torch.float32, opts.n_shards,
                                                        opts.max_shard_bytes).items():
            print(f"{command:10s} checkpoint {size / 2**20:5.0f} MiB  peak RSS growth "
                  f"{growth / 2**20:5.0f} MiB ({growth / size:.2f}x)")
