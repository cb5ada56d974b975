"""Convert Llama 3 checkpoints between Meta's torch.save format, our DCP format, Hugging Face and
torchtitan.

    python checkpoint_convert.py torch2dcp --input_dir META_DIR --output_dir DCP_DIR
    python checkpoint_convert.py dcp2torch --input_dir DCP_DIR  --output_dir META_DIR [--dtype bfloat16]
    python checkpoint_convert.py dcp2hf    --input_dir DCP_DIR  --output_dir HF_DIR
    python checkpoint_convert.py hf2dcp    --input_dir HF_DIR   --output_dir DCP_DIR
    python checkpoint_convert.py dcp2titan --input_dir DCP_DIR  --output_dir TITAN_DIR [--titan_version 0.2.2]
    python checkpoint_convert.py average   STEP_DIR STEP_DIR ... --output DCP_DIR [--ema 0.9]

Tensors keep their dtype and bits (HF's q/k rows are permuted, invertibly); from a DCP folder such
as a trainer's step-N only the model.* tensors are read. DCP_DIR may also be a torchtitan checkpoint
(0.3.0's or 0.2.2's: its model at the top level, no params.json: pass --params); TITAN_DIR is
that layout, for torchtitan's initial_load_path (an absolute path in 0.3.0).
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

from data import Tokenizer
from model import ModelArgs, Transformer, flavors
from pretrain import averaging
from pretrain.hf_layout import args_from_hf, hf_config, hf_name, hf_tokenizer, permute_rope, tokenizer_files
from pretrain.progress import Progress
from pretrain.sources import DataError
from pretrain.titan_layout import model_keys, titan_name

MAX_SHARD_BYTES = 5 * 10**9  # per safetensors file, as Hugging Face does by default; tests lower it
DEFAULT_TOKENIZER = "assets/tokenizer/tokenizer.model"  # train.py's [model] tokenizer_path default


class ConvertError(Exception):
    """A problem with the user's input: printed as one line, no traceback."""


def read_json(path: str, fix: str) -> dict:
    if not os.path.isfile(path):
        raise ConvertError(f"{path} is missing; {fix}")
    with open(path) as f:
        return json.load(f)


def model_args(params: dict, path: str, read=ModelArgs.from_dict) -> ModelArgs:
    """The model's shape from a params.json (or, with read=args_from_hf, a config.json)."""
    try:
        return read(params)
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{path}: {e}")


def expected_shapes(args: ModelArgs) -> dict:
    """Meta key -> shape, in Meta's order, from model.py itself (meta device: no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(args).state_dict().items()}


def check_shapes(shapes: dict, args: ModelArgs, source: str):
    """Fail here, not confusingly in the next tool."""
    want = expected_shapes(args)
    unexpected = [k for k in shapes if k not in want]
    for k in [*want, *unexpected]:  # missing or misshapen, then unexpected
        if k not in want or k not in shapes or tuple(shapes[k]) != tuple(want[k]):
            got, implied = (tuple(d[k]) if k in d else "absent" for d in (shapes, want))
            raise ConvertError(f"{source}: {k} is {got} in the weights but {implied} in the "
                               f"params; are both from the same model?")


# --- Meta: params.json + consolidated.NN.pth ------------------------------------------------------
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
        # Merge one layer at a time, reopening the mmaps in between: dropping them releases the
        # pages already copied, so peak memory is the merged model plus one layer, not twice the
        # model.
        want = expected_shapes(args)
        merged = {}  # the merged tensors so far
        layer_of = lambda k: re.match(r"layers\.\d+|[^.]+", k)[0]  # noqa: E731
        groups = [list(keys) for _, keys in itertools.groupby(shards[0], layer_of)]
        with Progress(len(groups), f"merging {len(paths)} shards", "layers") as bar:
            for keys in groups:
                shards = shards or open_shards()
                for k in keys:
                    missing = [p for p, s in zip(paths, shards) if k not in s]
                    if missing:
                        raise ConvertError(f"{missing[0]} has no {k} but {paths[0]} has; are all "
                                           f"consolidated.*.pth from one checkpoint?")
                    merged[k] = merge_shards(k, [s[k] for s in shards], paths, want.get(k))
                shards = None
                bar.update(1)
        shards = [merged]
    sd = shards[0]
    sd.pop("rope.freqs", None)  # older Meta files carry the rope table; model.py computes it
    check_shapes({k: v.shape for k, v in sd.items()}, args, f"{dir}/consolidated.*.pth")
    return args, sd


def merge_shards(key: str, pieces: list, paths: list, full) -> torch.Tensor:
    """Concatenate model-parallel pieces on the one dim where their sizes add up to the shape
    params.json implies: Meta's layouts differ by version (tok_embeddings: Llama 2 dim 1, Llama 3
    the vocab, dim 0), so the shapes decide, not the name. Pieces of the full shape (the norms) are
    replicated: take one."""
    shapes = [tuple(p.shape) for p in pieces]
    # unknown keys (no full shape): check_shapes names them
    if full is None or all(s == tuple(full) for s in shapes):
        return pieces[0].clone()  # a copy, so that nothing keeps a shard's mmap alive
    full = tuple(full)
    for d in range(len(full)):
        rest = full[:d] + full[d + 1:]
        if all(len(s) == len(full) and s[:d] + s[d + 1:] == rest for s in shapes) and \
                sum(s[d] for s in shapes) == full[d]:
            return torch.cat(pieces, dim=d)
    odd = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
    names = [os.path.basename(p) for p in paths]
    got = (f"{shapes[0]} in each of the {len(shapes)} shards" if odd is None else
           f"{shapes[0]} in {names[0]} but {shapes[odd]} in {names[odd]}")
    raise ConvertError(f"{os.path.dirname(paths[0])}: {key} is {got}, which no concatenation dim "
                       f"turns into the {full} params.json implies; are the shards and params.json "
                       f"from one model?")


def save_meta(dcp_dir: str, out: str, params: str, dtype: str = None):
    args, model = dcp_model(dcp_dir, params)
    sd = {}
    groups = byte_groups(model)  # read a group at a time: a bar can say how far it has got
    with Progress(sum(map(tensor_bytes, model.values())), f"reading {dcp_dir}", "B") as bar:
        for keys in groups:
            sd.update(load_dcp(dcp_dir, {k: model[k] for k in keys}))
            bar.update(sum(tensor_bytes(model[k]) for k in keys))
    for k in sd if dtype else []:  # one at a time: each original is freed as it is replaced
        sd[k] = sd[k].to(getattr(torch, dtype))
    torch.save(sd, os.path.join(out, "consolidated.00.pth"))
    # Meta's keys: no max_seq_len, and no rope_scaling_factor where it is Meta's 8
    meta_params = {k: v for k, v in args.params().items() if k != "max_seq_len"}
    if meta_params["rope_scaling_factor"] == 8.0:
        del meta_params["rope_scaling_factor"]
    write_json(out, "params.json", meta_params)


# --- DCP: our converted models, the trainer's step-N folders, torchtitan's checkpoints ------------
def dcp_args(dir: str, params: str) -> ModelArgs:
    """The model's shape: --params (a params.json or a flavor of model.py), else the folder's
    params.json."""
    if params in flavors:
        return flavors[params]
    path = params or os.path.join(dir, "params.json")
    fix = (f"the trainer and torch2dcp write it; torchtitan saves none: pass --params with the "
           f"model's params.json (Meta's keys) or the flavor of model.py ({', '.join(flavors)}) whose "
           f"shape the run had")
    return model_args(read_json(path, fix), path)


def dcp_model(dir: str, params: str = None):
    """(args, {Meta key: DCP's metadata for it, i.e. size and dtype}) before any tensor is read."""
    if not os.path.isfile(os.path.join(dir, ".metadata")):
        raise ConvertError(f"{dir} is not a DCP checkpoint (no .metadata file); point --input_dir "
                           f"at a step-N folder, a torch2dcp/hf2dcp output or a torchtitan step-N")
    metadata = dcp.FileSystemReader(dir).read_metadata().state_dict_metadata
    keys = model_keys(metadata)
    if not keys:
        raise ConvertError(f"{dir} has no model.* tensors (only e.g. {sorted(metadata)[:2]}), nor "
                           f"torchtitan's top-level tok_embeddings.weight; export a checkpoint that "
                           f"holds the model, such as a trainer step-N folder")
    model = {k: metadata[key] for k, key in keys.items()}
    args = dcp_args(dir, params)
    check_shapes({k: md.size for k, md in model.items()}, args, dir)
    return args, {k: model[k] for k in expected_shapes(args)}  # in Meta's order


def tensor_bytes(md) -> int:
    """The size of a tensor DCP's metadata describes."""
    return md.size.numel() * md.properties.dtype.itemsize


def byte_groups(model: dict) -> list:
    """The keys of `model` (DCP metadata) in order, in groups of at most MAX_SHARD_BYTES."""
    groups = [[]]
    held = 0  # the last group's bytes
    for k, md in model.items():
        if groups[-1] and held + tensor_bytes(md) > MAX_SHARD_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(k)
        held += tensor_bytes(md)
    return groups


def load_dcp(dir: str, model: dict) -> dict:
    """Read only these model tensors (DCP loads in place, into tensors of the saved size and
    dtype)."""
    metadata = dcp.FileSystemReader(dir).read_metadata().state_dict_metadata
    keys = model_keys(metadata)  # model.<key> or <key>
    sd = {keys[k]: torch.empty(md.size, dtype=md.properties.dtype) for k, md in model.items()}
    dcp.load(sd, checkpoint_id=dir, no_dist=True)  # single process: no process group needed
    return {k: sd[keys[k]] for k in model}


def save_dcp(args: ModelArgs, sd: dict, dir: str):
    # keys "model.<Meta key>", as the trainer's
    dcp.save({"model": sd}, checkpoint_id=dir, no_dist=True)
    write_json(dir, "params.json", args.params())


def save_titan(dcp_dir: str, out: str, params: str, version: str):
    """The model at the top level under torchtitan's names in `version`, as its initial_load_path
    reads them (params.json: for us)."""
    args, model = dcp_model(dcp_dir, params)
    sd = {titan_name(k, version): w for k, w in load_dcp(dcp_dir, model).items()}
    dcp.save(sd, checkpoint_id=out, no_dist=True)
    write_json(out, "params.json", args.params())


# --- Hugging Face: config.json + safetensors shards (pretrain/hf_layout.py: names, rope, config)
def load_hf(dir: str):
    config_path = os.path.join(dir, "config.json")
    index_path = os.path.join(dir, "model.safetensors.index.json")
    config = read_json(config_path, "a Hugging Face model folder has one")
    args = model_args(config, config_path, read=args_from_hf)
    files = ["model.safetensors"]  # small models come as one file without an index
    if os.path.isfile(index_path):
        files = sorted(set(read_json(index_path, "")["weight_map"].values()))
    meta_name = {hf_name(k): k for k in expected_shapes(args)}
    sd = {}
    for path in (os.path.join(dir, file) for file in files):
        try:
            f = safe_open(path, framework="pt")  # mmapped: pages are read as dcp.save writes them
        except (OSError, SafetensorError) as e:
            raise ConvertError(f"cannot read {path} as safetensors ({e})")
        # old files have rope tables
        names = [n for n in f.keys() if not n.endswith("rotary_emb.inv_freq")]
        # an unknown name keeps its own: check_shapes reports it
        sd.update((meta_name.get(n, n), f.get_tensor(n)) for n in names)
    # Llama 3.2 1B/3B on the Hub tie lm_head to the embedding and store it once; Meta stores both.
    tied = config.get("tie_word_embeddings")
    if "output.weight" not in sd and "tok_embeddings.weight" in sd and tied:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    check_shapes({k: v.shape for k, v in sd.items()}, args, dir)
    return args, {k: permute_rope(k, w, args, to_hf=False) for k, w in sd.items()}


def save_hf(dcp_dir: str, out: str, params: str, tokenizer_path: str):
    """Plan shards from DCP's metadata, then read, permute and write one shard at a time."""
    args, model = dcp_model(dcp_dir, params)
    config = hf_config(args, model["tok_embeddings.weight"].properties.dtype)
    if tokenizer_path:  # first: a wrong tokenizer stops before gigabytes are written
        save_tokenizer(tokenizer_path, config, out)
    total = sum(map(tensor_bytes, model.values()))
    shards = byte_groups(model)
    weight_map = {}
    with Progress(total, "writing safetensors", "B") as bar:
        for i, keys in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            shard = load_dcp(dcp_dir, {k: model[k] for k in keys})
            sd = {hf_name(k): permute_rope(k, w, args, to_hf=True) for k, w in shard.items()}
            # "pt": transformers checks it
            save_file(sd, os.path.join(out, file), metadata={"format": "pt"})
            weight_map.update((name, file) for name in sd)
            del shard, sd  # free this shard before reading the next
            bar.update(sum(tensor_bytes(model[k]) for k in keys), note=f"{i + 1}/{len(shards)} shards")
    write_json(out, "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(out, "config.json", config)


def write_json(dir: str, name: str, content: dict):
    with open(os.path.join(dir, name), "w") as f:
        json.dump(content, f, indent=2)


def find_tokenizer(dcp_dir: str, given) -> str:
    """--tokenizer_path, else the run's: the trainer writes <dump_folder>/config.toml and its
    checkpoints to <dump_folder>/<checkpoint.folder>/step-N; else train.py's default. A relative
    path is tried from here, then from the repo (where train.py runs)."""
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


def save_tokenizer(path: str, config: dict, out: str):
    """The tokenizer files of a Llama 3 Hub repo from a tiktoken tokenizer.model (pretrain/hf_layout.py)."""
    fix = ("pass --tokenizer_path with the run's tokenizer.model, or --tokenizer_path '' for the "
           "weights only")
    if not os.path.isfile(path):
        raise ConvertError(f"tokenizer {path} not found; {fix}")
    try:
        tok = Tokenizer(path)
    except DataError as e:
        raise ConvertError(str(e))
    if tok.n_words != config["vocab_size"]:
        raise ConvertError(f"tokenizer {path} has {tok.n_words:,} tokens but the model "
                           f"{config['vocab_size']:,}; {fix}")
    hf = hf_tokenizer(tok, config["bos_token_id"])
    hf.save(os.path.join(out, "tokenizer.json"))
    for name, content in tokenizer_files(hf, config).items():
        write_json(out, name, content)


# --- the average of several checkpoints' weights (Polyak averaging, model soups) ------------------
def run_of(dir: str) -> dict:
    """The resume keys a trainer's step-N keeps (its run's config), or {} for a converted model."""
    metadata = dcp.FileSystemReader(dir).read_metadata().state_dict_metadata
    if "train.config" not in metadata:
        return {}
    blob = {"train.config": torch.empty(metadata["train.config"].size, dtype=torch.uint8)}
    dcp.load(blob, checkpoint_id=dir, no_dist=True)
    return json.loads(bytes(blob["train.config"].tolist()))


def save_average(dirs: list, out: str, params: str, ema: float = None):
    """The weighted mean of the checkpoints' model tensors as a model-only DCP folder (params.json
    beside it): uniform weights, or with `ema` the newest weighs 1, the one before ema, then ema^2...
    A tensor at a time (pretrain/averaging.py): the peak is about the largest tensor twice, in fp32,
    whatever the model's size. Every input must hold the same model (heads, shapes, dtypes) from one
    run (a trainer step-N's resume keys)."""
    args, model = dcp_model(dirs[0], params)
    run = run_of(dirs[0])
    for d in dirs[1:]:
        other_args, other = dcp_model(d, params)
        mine = {k: (getattr(args, k), getattr(other_args, k)) for k in ("n_heads", "n_kv_heads")}
        mine |= {k: tuple(f"{m[k].properties.dtype} {tuple(m[k].size)}".replace("torch.", "") for m in (model, other))
                 for k in model}
        differ = [(k, a, b) for k, (a, b) in mine.items() if a != b]
        theirs = run_of(d)
        differ += [(k, run[k], theirs[k]) for k in run if k in theirs and theirs[k] != run[k]]
        if differ:
            k, a, b = differ[0]
            raise ConvertError(f"{d}: {k} is {b} there but {a} in {dirs[0]}; average checkpoints of one model "
                               "and one run")
    factors = [1.0] * len(dirs) if ema is None else [ema ** (len(dirs) - 1 - i) for i in range(len(dirs))]
    keys = [model_keys(dcp.FileSystemReader(d).read_metadata().state_dict_metadata) for d in dirs]
    averaging.save_mean(dirs, keys, model, [f / sum(factors) for f in factors], out)
    write_json(out, "params.json", args.params())


# --- command line ---------------------------------------------------------------------------------
HELP = {"torch2dcp": "Meta's params.json + consolidated.*.pth (model-parallel shards merged) "
                     "-> DCP",
        "dcp2torch": "DCP (a converted model or a trainer step-N folder) -> Meta's params.json + "
                     "consolidated.00.pth",
        "dcp2hf": "DCP -> Hugging Face: config.json, safetensors shards, tokenizer and generation "
                  "files",
        "hf2dcp": "Hugging Face config.json + safetensors -> DCP (tokenizer files are not read)",
        "dcp2titan": "DCP -> torchtitan's layout (the model's tensors at the top level under its "
                     "names), which its --checkpoint.initial_load_path loads"}
AVERAGE = ("the mean of several checkpoints' weights (Polyak averaging, as Llama 3's final model) -> a "
           "model-only DCP folder, a tensor at a time")
INPUT = {"torch2dcp": "Meta folder: params.json and consolidated.00.pth (or .00 .. .NN)",
         "dcp2torch": "DCP folder: a torch2dcp/hf2dcp output, a trainer step-N or a torchtitan "
                      "step-N",
         "hf2dcp": "Hugging Face model folder: config.json and model*.safetensors"}


def build_parser() -> argparse.ArgumentParser:
    epilog = "Run `%(prog)s COMMAND --help` for a command's options."
    description = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's first sentence
    parser = argparse.ArgumentParser(description=description, epilog=epilog)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, doc in HELP.items():
        p = sub.add_parser(name, help=doc, description=doc)
        p.add_argument("--input_dir", required=True, help=INPUT.get(name, INPUT["dcp2torch"]))
        p.add_argument("--output_dir", required=True, help="folder to create (or an empty one); "
                       "written to a temp folder beside it and renamed when complete")
    avg = sub.add_parser("average", help=AVERAGE, description=AVERAGE)
    avg.add_argument("inputs", nargs="+", metavar="STEP_DIR", help="DCP folders of one model and run (a trainer's "
                     "step-N, a converted model), oldest first")
    avg.add_argument("--output", "--output_dir", dest="output_dir", required=True,
                     help="folder to create (or an empty one), renamed into place when complete")
    avg.add_argument("--ema", type=float, help="EMA weights: the newest 1, the one before EMA, then EMA^2 ... "
                     "(0 < EMA <= 1; default: uniform)")
    for name in ("dcp2torch", "dcp2hf", "dcp2titan", "average"):
        sub.choices[name].add_argument(
            "--params", help="the model's shape where --input_dir has no params.json (torchtitan's "
            "checkpoints): a params.json with Meta's keys, or a flavor of model.py "
            f"({', '.join(flavors)})")
    sub.choices["dcp2torch"].add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"],
        help="cast every tensor (default: keep each tensor's dtype)")
    sub.choices["dcp2titan"].add_argument(
        "--titan_version", choices=["0.3.0", "0.2.2"], default="0.3.0",
        help="0.3.0 names q, k and v qkv_linear.w* and the output layer lm_head; 0.2.2 Meta's names")
    sub.choices["dcp2hf"].add_argument(
        "--tokenizer_path", default=None, help="the run's tiktoken tokenizer.model, written as "
        "tokenizer.json & co.; '' writes no tokenizer files (default: [model] tokenizer_path of "
        f"the run's config.toml for a trainer step-N folder, else {DEFAULT_TOKENIZER})")
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
                "dcp2titan": lambda src, out, opts: save_titan(src, out, opts.params, opts.titan_version),
                "average": lambda src, out, opts: save_average(opts.inputs, out, opts.params, opts.ema)}
    parser = build_parser()
    opts = parser.parse_args(argv)
    out = opts.output_dir
    # DCP: no process group, yes
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    try:
        averaging = opts.command == "average"
        for given in opts.inputs if averaging else [opts.input_dir]:
            if not os.path.isdir(given):
                name = "STEP_DIR" if averaging else "--input_dir"
                raise ConvertError(f"{name} {given} does not exist or is not a directory")
        if averaging and opts.ema is not None and not 0 < opts.ema <= 1:
            raise ConvertError(f"--ema {opts.ema}: must be in (0, 1]; the newest checkpoint weighs 1, each "
                               "older one EMA times the next")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise ConvertError(f"--output_dir {out} exists and is not empty; remove it or pick "
                               f"another")
        # Write into a temp folder next to output_dir and rename it when done: a failed or
        # interrupted conversion never leaves a folder that looks complete.
        parent, name = os.path.split(os.path.abspath(out))
        tmp = os.path.join(parent, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a killed run
        os.makedirs(tmp)
        try:
            if opts.command == "dcp2hf":
                opts.tokenizer_path = find_tokenizer(opts.input_dir, opts.tokenizer_path)
            commands[opts.command](None if averaging else opts.input_dir, tmp, opts)
            follow_umask(tmp)
            os.rename(tmp, out)  # also replaces an empty output_dir (POSIX rename)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    tokenizer = opts.command == "dcp2hf" and opts.tokenizer_path
    print(f"wrote {out}" + (f" (tokenizer from {opts.tokenizer_path})" if tokenizer else ""))


if __name__ == "__main__":
    main()
