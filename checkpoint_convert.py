"""Convert Llama 3 checkpoints between Meta's torch.save format, our DCP format, Hugging Face and torchtitan.

    python checkpoint_convert.py torch2dcp --input_dir META_DIR --output_dir DCP_DIR
    python checkpoint_convert.py dcp2torch --input_dir DCP_DIR  --output_dir META_DIR [--dtype bfloat16]
    python checkpoint_convert.py dcp2hf    --input_dir DCP_DIR  --output_dir HF_DIR
    python checkpoint_convert.py hf2dcp    --input_dir HF_DIR   --output_dir DCP_DIR
    python checkpoint_convert.py dcp2titan --input_dir DCP_DIR  --output_dir TITAN_DIR

Tensors keep their dtype and bits (HF's q/k rows are permuted, invertibly); from a DCP folder such as a
trainer's step-N only the model.* tensors are read. DCP_DIR may also be a torchtitan checkpoint (its model at the
top level, no params.json: pass --params); TITAN_DIR is that layout, for torchtitan's initial_load_path.
"""

import argparse
import glob
import itertools
import json
import os
import re
import shutil
import sys
import tomllib
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titan_layout import model_keys
from data import LLAMA3_PAT, NUM_SPECIAL, Tokenizer
from sources import DataError
from model import ModelArgs, Transformer, flavors

MAX_SHARD_BYTES = 5 * 10**9  # per safetensors file, as Hugging Face does by default; tests lower it
META_TO_HF = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
              "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
              "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
              "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm", "tok_embeddings": "embed_tokens", "norm": "norm"}
LLAMA31_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA31_CONTEXT = 131072  # max_position_embeddings of Llama 3.1/3.2 on the Hub
DEFAULT_TOKENIZER = "assets/tokenizer/tokenizer.model"  # train.py's [model] tokenizer_path default


class ConvertError(Exception):
    """A problem with the user's input: printed as one line, no traceback."""


def read_json(path: str, fix: str) -> dict:
    if not os.path.isfile(path):
        raise ConvertError(f"{path} is missing; {fix}")
    with open(path) as f:
        return json.load(f)


def model_args(params: dict, path: str) -> ModelArgs:
    try:
        return ModelArgs.from_dict(params)
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{path}: {e}")


def expected_shapes(args: ModelArgs) -> dict:
    """Meta key -> shape, in Meta's order, from model.py itself (meta device: no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(args).state_dict().items()}


def check_shapes(shapes: dict, args: ModelArgs, source: str):  # fail here, not confusingly in the next tool
    want = expected_shapes(args)
    for k in [*want, *(k for k in shapes if k not in want)]:  # missing or misshapen, then unexpected
        if k not in want or k not in shapes or tuple(shapes[k]) != tuple(want[k]):
            got, implied = (tuple(d[k]) if k in d else "absent" for d in (shapes, want))
            raise ConvertError(f"{source}: {k} is {got} in the weights but {implied} in the params; are "
                               f"both from the same model?")


# --- Meta: params.json + consolidated.NN.pth ------------------------------------------------------------
def load_meta(dir: str):
    params_path = os.path.join(dir, "params.json")
    params = read_json(params_path, "Meta ships it next to consolidated.00.pth")
    args = model_args(params, params_path)
    paths = sorted(glob.glob(os.path.join(dir, "consolidated.*.pth")))
    if not paths:
        raise ConvertError(f"{dir} has no consolidated.00.pth (Meta's torch.save checkpoint)")

    def open_shards():
        try:  # mmap: a tensor is read from disk only when touched
            return [torch.load(p, mmap=True, weights_only=True) for p in paths]
        except Exception as e:
            raise ConvertError(f"cannot read {dir}/consolidated.*.pth with torch.load ({e})")

    shards = open_shards()
    if len(shards) > 1:
        # Merge one layer at a time, reopening the mmaps in between: dropping them releases the pages
        # already copied, so peak memory is the merged model plus one layer, not twice the model.
        want = expected_shapes(args)
        merged = {}  # the merged tensors so far
        for _, keys in itertools.groupby(shards[0], lambda k: re.match(r"layers\.\d+|[^.]+", k)[0]):
            shards = shards or open_shards()
            for k in keys:
                missing = [p for p, s in zip(paths, shards) if k not in s]
                if missing:
                    raise ConvertError(f"{missing[0]} has no {k} but {paths[0]} has; are all "
                                       f"consolidated.*.pth from one checkpoint?")
                merged[k] = merge_shards(k, [s[k] for s in shards], paths, want.get(k))
            shards = None
        shards = [merged]
    sd = shards[0]
    sd.pop("rope.freqs", None)  # older Meta files carry the rope table; model.py computes it
    check_shapes({k: v.shape for k, v in sd.items()}, args, f"{dir}/consolidated.*.pth")
    return args, sd


def merge_shards(key: str, pieces: list, paths: list, full) -> torch.Tensor:
    """Concatenate model-parallel pieces on the one dim where their sizes add up to the shape params.json
    implies: Meta's layouts differ by version (tok_embeddings: Llama 2 dim 1, Llama 3 the vocab, dim 0),
    so the shapes decide, not the name. Pieces of the full shape (the norms) are replicated: take one."""
    shapes = [tuple(p.shape) for p in pieces]
    if full is None or all(s == tuple(full) for s in shapes):  # unknown keys: check_shapes names them
        return pieces[0].clone()  # a copy, so that nothing keeps a shard's mmap alive
    full = tuple(full)
    for d in range(len(full)):
        rest = full[:d] + full[d + 1:]
        if all(len(s) == len(full) and s[:d] + s[d + 1:] == rest for s in shapes) and \
                sum(s[d] for s in shapes) == full[d]:
            return torch.cat(pieces, dim=d)
    odd = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
    got = (f"{shapes[0]} in each of the {len(shapes)} shards" if odd is None else
           f"{shapes[0]} in {os.path.basename(paths[0])} but {shapes[odd]} in {os.path.basename(paths[odd])}")
    raise ConvertError(f"{os.path.dirname(paths[0])}: {key} is {got}, which no concatenation dim turns into "
                       f"the {full} params.json implies; are the shards and params.json from one model?")


def save_meta(dcp_dir: str, out: str, params: str, dtype: str = None):
    args, model = dcp_model(dcp_dir, params)
    sd = load_dcp(dcp_dir, model)
    for k in sd if dtype else []:  # one at a time: each original is freed as it is replaced
        sd[k] = sd[k].to(getattr(torch, dtype))
    torch.save(sd, os.path.join(out, "consolidated.00.pth"))
    # Meta's keys: no max_seq_len, and no rope_scaling_factor where it is Meta's 8
    write_json(out, "params.json", {k: v for k, v in args.params().items()
                                    if k != "max_seq_len" and (k, v) != ("rope_scaling_factor", 8.0)})


# --- DCP: our converted models, the trainer's step-N folders, torchtitan's checkpoints ---------------------
def dcp_args(dir: str, params: str) -> ModelArgs:
    """The model's shape: --params (a params.json or a flavor of model.py), else the folder's params.json."""
    if params in flavors:
        return flavors[params]
    path = params or os.path.join(dir, "params.json")
    fix = (f"the trainer and torch2dcp write it; torchtitan saves none: pass --params with the model's params.json "
           f"(Meta's keys) or the flavor of model.py ({', '.join(flavors)}) whose shape the run had")
    return model_args(read_json(path, fix), path)


def dcp_model(dir: str, params: str = None):
    """(args, {Meta key: DCP's metadata for it, i.e. size and dtype}) before any tensor is read."""
    if not os.path.isfile(os.path.join(dir, ".metadata")):
        raise ConvertError(f"{dir} is not a DCP checkpoint (no .metadata file); point --input_dir at a "
                           f"step-N folder, a torch2dcp/hf2dcp output or a torchtitan step-N")
    metadata = dcp.FileSystemReader(dir).read_metadata().state_dict_metadata
    keys = model_keys(metadata)
    if not keys:
        raise ConvertError(f"{dir} has no model.* tensors (only e.g. {sorted(metadata)[:2]}), nor torchtitan's "
                           f"top-level tok_embeddings.weight; export a checkpoint that holds the model, such as "
                           f"a trainer step-N folder")
    model = {k: metadata[key] for k, key in keys.items()}
    args = dcp_args(dir, params)
    check_shapes({k: md.size for k, md in model.items()}, args, dir)
    return args, {k: model[k] for k in expected_shapes(args)}  # in Meta's order


def load_dcp(dir: str, model: dict) -> dict:
    """Read only these model tensors (DCP loads in place, into tensors of the saved size and dtype)."""
    keys = model_keys(dcp.FileSystemReader(dir).read_metadata().state_dict_metadata)  # model.<key> or <key>
    sd = {keys[k]: torch.empty(md.size, dtype=md.properties.dtype) for k, md in model.items()}
    dcp.load(sd, checkpoint_id=dir, no_dist=True)  # single process: no process group needed
    return {k: sd[keys[k]] for k in model}


def save_dcp(args: ModelArgs, sd: dict, dir: str):
    dcp.save({"model": sd}, checkpoint_id=dir, no_dist=True)  # keys "model.<Meta key>", as the trainer's
    write_json(dir, "params.json", args.params())


def save_titan(dcp_dir: str, out: str, params: str):
    """The Meta keys at the top level, as torchtitan's initial_load_path reads them (params.json: for us)."""
    args, model = dcp_model(dcp_dir, params)
    dcp.save(load_dcp(dcp_dir, model), checkpoint_id=out, no_dist=True)
    write_json(out, "params.json", args.params())


# --- Hugging Face: config.json + safetensors shards ------------------------------------------------------
def hf_name(key: str) -> str:
    layer, name = re.fullmatch(r"(layers\.\d+\.)?(.+)\.weight", key).groups()
    return "lm_head.weight" if name == "output" else f"model.{layer or ''}{META_TO_HF[name]}.weight"


def permute_rope(key: str, w: torch.Tensor, args: ModelArgs, to_hf: bool) -> torch.Tensor:
    """Meta's rope rotates feature pairs (2i, 2i+1) of each head, HF's (i, i + head_dim/2): reordering
    the rows of wq and wk per head maps one layout to the other. Other tensors pass through."""
    n_heads = {"wq": args.n_heads, "wk": args.n_kv_heads}.get(key.split(".")[-2])
    if n_heads is None:
        return w
    out_features, dim = w.shape  # (n_heads * head_dim, dim)
    half = out_features // n_heads // 2
    if to_hf:  # rows (head, i, pair) -> (head, pair, i)
        return w.view(n_heads, half, 2, dim).transpose(1, 2).reshape(out_features, dim)
    return w.view(n_heads, 2, half, dim).transpose(1, 2).reshape(out_features, dim)  # the inverse


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    # Legacy names (rope_theta, rope_scaling, torch_dtype) as in the Hub's Llama 3.x configs: transformers
    # 4.x reads them, and 5.x folds them into its rope_parameters and dtype when loading.
    rope = {"factor": args.rope_scaling_factor, "rope_type": "llama3", **LLAMA31_ROPE}
    width = expected_shapes(args)["layers.0.feed_forward.w1.weight"][0]
    # transformers warns unless max_position_embeddings exceeds the scaled rope's original 8192: that rope
    # is Llama 3.1's, made for its 128k context, so the small flavors declare that context too.
    context = max(args.max_seq_len, LLAMA31_CONTEXT) if args.use_scaled_rope else args.max_seq_len
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": width, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "num_hidden_layers": args.n_layers,
            "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "vocab_size": args.vocab_size,
            "max_position_embeddings": context, "tie_word_embeddings": False, "hidden_act": "silu",
            # The 256 special tokens follow the BPE ranks: <|begin_of_text|>, <|end_of_text|>, ...
            "bos_token_id": args.vocab_size - NUM_SPECIAL, "eos_token_id": args.vocab_size - NUM_SPECIAL + 1,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "rope_scaling": rope if args.use_scaled_rope else None}


def args_from_hf(c: dict, path: str) -> ModelArgs:
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}  # transformers 4.x / 5.x name
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3") or any(rope.get(k, v) != v for k, v in LLAMA31_ROPE.items()):
        raise ConvertError(f"{path}: rope {rope} is not Llama 3's (model.py hardcodes {LLAMA31_ROPE})")
    # HF stores the FFN width, Meta a rule for it: round up to a multiple of the width itself (after
    # scaling down where the width is under Meta's 8/3 * dim). Biases would show as unexpected tensors.
    dim = c["hidden_size"]
    width = c["intermediate_size"]  # the feed-forward's hidden width
    theta = c.get("rope_theta") or rope.get("rope_theta", 10000.0)  # HF's default
    return model_args(dict(dim=dim, n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                           n_kv_heads=c.get("num_key_value_heads"), vocab_size=c["vocab_size"],
                           multiple_of=width, ffn_dim_multiplier=min(1.0, width / int(8 * dim / 3)),
                           norm_eps=c["rms_norm_eps"], rope_theta=theta,
                           use_scaled_rope=rope_type == "llama3", rope_scaling_factor=rope.get("factor", 8.0),
                           max_seq_len=c.get("max_position_embeddings", 2048)), path)


def load_hf(dir: str):
    config_path = os.path.join(dir, "config.json")
    index_path = os.path.join(dir, "model.safetensors.index.json")
    config = read_json(config_path, "a Hugging Face model folder has one")
    args = args_from_hf(config, config_path)
    files = (sorted(set(read_json(index_path, "")["weight_map"].values())) if os.path.isfile(index_path)
             else ["model.safetensors"])  # small models come as one file without an index
    meta_name = {hf_name(k): k for k in expected_shapes(args)}
    sd = {}
    for path in (os.path.join(dir, file) for file in files):
        try:
            f = safe_open(path, framework="pt")  # mmapped: pages are read as dcp.save writes them
        except (OSError, SafetensorError) as e:
            raise ConvertError(f"cannot read {path} as safetensors ({e})")
        names = [n for n in f.keys() if not n.endswith("rotary_emb.inv_freq")]  # old files have rope tables
        sd.update((meta_name.get(n, n), f.get_tensor(n)) for n in names)  # unknown: check_shapes reports it
    # Llama 3.2 1B/3B on the Hub tie lm_head to the embedding and store it once; Meta stores both.
    if "output.weight" not in sd and "tok_embeddings.weight" in sd and config.get("tie_word_embeddings"):
        sd["output.weight"] = sd["tok_embeddings.weight"]
    check_shapes({k: v.shape for k, v in sd.items()}, args, dir)
    return args, {k: permute_rope(k, w, args, to_hf=False) for k, w in sd.items()}


def save_hf(dcp_dir: str, out: str, params: str, tokenizer_path: str):
    """Plan shards from DCP's metadata, then read, permute and write one shard at a time."""
    args, model = dcp_model(dcp_dir, params)
    config = hf_config(args, model["tok_embeddings.weight"].properties.dtype)
    if tokenizer_path:  # first: a wrong tokenizer stops before gigabytes are written
        save_tokenizer(tokenizer_path, config, out)
    nbytes = {k: md.size.numel() * md.properties.dtype.itemsize for k, md in model.items()}
    shards = [[]]
    for k in model:
        if shards[-1] and sum(nbytes[j] for j in shards[-1]) + nbytes[k] > MAX_SHARD_BYTES:
            shards.append([])
        shards[-1].append(k)
    weight_map = {}
    for i, keys in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = load_dcp(dcp_dir, {k: model[k] for k in keys})
        sd = {hf_name(k): permute_rope(k, w, args, to_hf=True) for k, w in shard.items()}
        save_file(sd, os.path.join(out, file), metadata={"format": "pt"})  # "pt": transformers checks it
        weight_map.update((name, file) for name in sd)
        del shard, sd  # free this shard before reading the next
    write_json(out, "model.safetensors.index.json",
               {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map})
    write_json(out, "config.json", config)


def write_json(dir: str, name: str, content: dict):
    with open(os.path.join(dir, name), "w") as f:
        json.dump(content, f, indent=2)


def find_tokenizer(dcp_dir: str, given) -> str:
    """--tokenizer_path, else the run's: the trainer writes <dump_folder>/config.toml and its checkpoints to
    <dump_folder>/<checkpoint.folder>/step-N; else train.py's default. A relative path is tried from here,
    then from the repo (where train.py runs)."""
    path = DEFAULT_TOKENIZER if given is None else given
    step = os.path.realpath(dcp_dir)
    dump = ckpt_folder = os.path.dirname(step)
    trainer_step = given is None and re.fullmatch(r"step-\d+", os.path.basename(step))
    while trainer_step and dump != os.path.dirname(dump):
        try:
            with open(os.path.join(dump, "config.toml"), "rb") as f:
                run = tomllib.load(f)
            if os.path.realpath(os.path.join(dump, run["checkpoint"]["folder"])) == ckpt_folder:
                path = run["model"]["tokenizer_path"]
                break
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
            pass  # none here, or not this run's
        dump = os.path.dirname(dump)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return here if path and not os.path.isfile(path) and os.path.isfile(here) else path


def byte_chars() -> dict:
    """Byte-level BPE spells each byte as a printable character (GPT-2's table, as Llama 3's files do)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = sorted(set(range(256)) - set(keep))
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(shifted)}


def save_tokenizer(path: str, config: dict, out: str):
    """The tokenizer files of a Llama 3 Hub repo from a tiktoken tokenizer.model. tiktoken merges the
    adjacent pair whose concatenation has the lowest rank, so every split of a token into two tokens is a
    Hugging Face BPE merge with that rank as its priority; with ignore_merges (a whole pre-token that is a
    token is taken as is, as tiktoken does) both give the same ids."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    fix = "pass --tokenizer_path with the run's tokenizer.model, or --tokenizer_path '' for the weights only"
    if not os.path.isfile(path):
        raise ConvertError(f"tokenizer {path} not found; {fix}")
    try:
        tok = Tokenizer(path)
    except DataError as e:
        raise ConvertError(str(e))
    if tok.n_words != config["vocab_size"]:
        raise ConvertError(f"tokenizer {path} has {tok.n_words:,} tokens but the model "
                           f"{config['vocab_size']:,}; {fix}")
    ranks = {t: tok.model.encode_single_token(t) for t in tok.model.token_byte_values()}
    char = byte_chars()
    spell = lambda t: "".join(char[b] for b in t)  # noqa: E731
    merges = sorted((r, t[:i], t[i:]) for t, r in ranks.items() for i in range(1, len(t))
                    if t[:i] in ranks and t[i:] in ranks)
    hf = HFTokenizer(models.BPE({spell(t): r for t, r in ranks.items()},
                                [(spell(a), spell(b)) for _, a, b in merges], ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([  # data.py's split regex, then bytes -> characters
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in tok.special])
    bos, eos = (hf.id_to_token(config[k]) for k in ("bos_token_id", "eos_token_id"))
    hf.post_processor = processors.TemplateProcessing(  # Llama 3's: BOS first, no EOS
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, config["bos_token_id"])])
    hf.save(os.path.join(out, "tokenizer.json"))
    write_json(out, "tokenizer_config.json", dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=bos, eos_token=eos, model_input_names=[
            "input_ids", "attention_mask"], model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False))  # True would drop spaces before punctuation when decoding
    write_json(out, "special_tokens_map.json", dict(bos_token=bos, eos_token=eos))
    write_json(out, "generation_config.json", dict(  # Llama 3.1 base's sampling defaults
        bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"], do_sample=True,
        temperature=0.6, top_p=0.9))


# --- command line ---------------------------------------------------------------------------------------
HELP = {"torch2dcp": "Meta's params.json + consolidated.*.pth (model-parallel shards merged) -> DCP",
        "dcp2torch": "DCP (a converted model or a trainer step-N folder) -> Meta's params.json + "
                     "consolidated.00.pth",
        "dcp2hf": "DCP -> Hugging Face: config.json, safetensors shards, tokenizer and generation files",
        "hf2dcp": "Hugging Face config.json + safetensors -> DCP (tokenizer files are not read)",
        "dcp2titan": "DCP -> torchtitan's layout (the model's tensors at the top level under Meta's names), "
                     "which its --checkpoint.initial_load_path loads"}
INPUT = {"torch2dcp": "Meta folder: params.json and consolidated.00.pth (or .00 .. .NN)",
         "dcp2torch": "DCP folder: a torch2dcp/hf2dcp output, a trainer step-N or a torchtitan step-N",
         "hf2dcp": "Hugging Face model folder: config.json and model*.safetensors"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Run `%(prog)s COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, doc in HELP.items():
        p = sub.add_parser(name, help=doc, description=doc)
        p.add_argument("--input_dir", required=True, help=INPUT.get(name, INPUT["dcp2torch"]))
        p.add_argument("--output_dir", required=True, help="folder to create (or an empty one); written "
                       "to a temp folder beside it and renamed when complete")
    for name in ("dcp2torch", "dcp2hf", "dcp2titan"):
        sub.choices[name].add_argument(
            "--params", help="the model's shape where --input_dir has no params.json (torchtitan's "
            f"checkpoints): a params.json with Meta's keys, or a flavor of model.py ({', '.join(flavors)})")
    sub.choices["dcp2torch"].add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                                          help="cast every tensor (default: keep each tensor's dtype)")
    sub.choices["dcp2hf"].add_argument(
        "--tokenizer_path", default=None, help="the run's tiktoken tokenizer.model, written as "
        "tokenizer.json & co.; '' writes no tokenizer files (default: [model] tokenizer_path of the run's "
        f"config.toml for a trainer step-N folder, else {DEFAULT_TOKENIZER})")
    return parser


def follow_umask(dir: str):
    """safetensors writes its files mode 600; give every output file the mode open() would."""
    mask = os.umask(0)
    os.umask(mask)
    for root, _, files in os.walk(dir):
        for file in files:
            os.chmod(os.path.join(root, file), 0o666 & ~mask)


def main(argv=None):
    commands = {"torch2dcp": lambda src, out, opts: save_dcp(*load_meta(src), out),
                "dcp2torch": lambda src, out, opts: save_meta(src, out, opts.params, opts.dtype),
                "dcp2hf": lambda src, out, opts: save_hf(src, out, opts.params, opts.tokenizer_path),
                "hf2dcp": lambda src, out, opts: save_dcp(*load_hf(src), out),
                "dcp2titan": lambda src, out, opts: save_titan(src, out, opts.params)}
    parser = build_parser()
    opts = parser.parse_args(argv)
    out = opts.output_dir
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # DCP: no process group, yes
    try:
        if not os.path.isdir(opts.input_dir):
            raise ConvertError(f"--input_dir {opts.input_dir} does not exist or is not a directory")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise ConvertError(f"--output_dir {out} exists and is not empty; remove it or pick another")
        # Write into a temp folder next to output_dir and rename it when done: a failed or interrupted
        # conversion never leaves a folder that looks complete.
        parent, name = os.path.split(os.path.abspath(out))
        tmp = os.path.join(parent, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a killed run
        os.makedirs(tmp)
        try:
            if opts.command == "dcp2hf":
                opts.tokenizer_path = find_tokenizer(opts.input_dir, opts.tokenizer_path)
            commands[opts.command](opts.input_dir, tmp, opts)
            follow_umask(tmp)
            os.rename(tmp, out)  # also replaces an empty output_dir (POSIX rename)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out}" + (f" (tokenizer from {opts.tokenizer_path})" if opts.command == "dcp2hf" and
                            opts.tokenizer_path else ""))


if __name__ == "__main__":
    main()
