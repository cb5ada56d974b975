"""Hugging Face's Llama layout, beside ours (Meta's names, as model.py has them): its tensor names,
the row order of wq and wk for its rope, its config.json, and its tokenizer files from a tiktoken
tokenizer.model. checkpoint_convert.py converts from and to it; titan_layout.py holds torchtitan's.
"""

import re

import torch

from data import LLAMA3_PAT, NUM_SPECIAL, Tokenizer
from model import FeedForward, ModelArgs

META_TO_HF = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
              "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
              "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
              "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm", "tok_embeddings": "embed_tokens",
              "norm": "norm"}
LLAMA31_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
LLAMA31_CONTEXT = 131072  # max_position_embeddings of Llama 3.1/3.2 on the Hub


def hf_name(key: str) -> str:
    layer, name = re.fullmatch(r"(layers\.\d+\.)?(.+)\.weight", key).groups()
    return "lm_head.weight" if name == "output" else f"model.{layer or ''}{META_TO_HF[name]}.weight"


def permute_rope(key: str, w: torch.Tensor, args: ModelArgs, to_hf: bool) -> torch.Tensor:
    """Meta's rope rotates feature pairs (2i, 2i+1) of each head, HF's (i, i + head_dim/2):
    reordering the rows of wq and wk per head maps one layout to the other. Other tensors pass
    through."""
    n_heads = {"wq": args.n_heads, "wk": args.n_kv_heads}.get(key.split(".")[-2])
    if n_heads is None:
        return w
    out_features, dim = w.shape  # (n_heads * head_dim, dim)
    half = out_features // n_heads // 2
    if to_hf:  # rows (head, i, pair) -> (head, pair, i)
        return w.view(n_heads, half, 2, dim).transpose(1, 2).reshape(out_features, dim)
    return w.view(n_heads, 2, half, dim).transpose(1, 2).reshape(out_features, dim)  # the inverse


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    # Legacy names (rope_theta, rope_scaling, torch_dtype) as in the Hub's Llama 3.x configs:
    # transformers 4.x reads them, and 5.x folds them into its rope_parameters and dtype when
    # loading.
    rope = {"factor": args.rope_scaling_factor, "rope_type": "llama3", **LLAMA31_ROPE}
    with torch.device("meta"):  # model.py's rule for the width, without memory
        width = FeedForward(args).w1.out_features
    # transformers warns unless max_position_embeddings exceeds the scaled rope's original 8192:
    # that rope is Llama 3.1's, made for its 128k context, so the small flavors declare that context
    # too.
    context = max(args.max_seq_len, LLAMA31_CONTEXT) if args.use_scaled_rope else args.max_seq_len
    # The 256 special tokens follow the BPE ranks: <|begin_of_text|>, <|end_of_text|>, ...
    bos_id = args.vocab_size - NUM_SPECIAL
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": width, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "num_hidden_layers": args.n_layers,
            "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "vocab_size": args.vocab_size, "max_position_embeddings": context,
            "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": bos_id, "eos_token_id": bos_id + 1,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "rope_scaling": rope if args.use_scaled_rope else None}


def args_from_hf(c: dict) -> ModelArgs:
    """The model's shape from a config.json; ValueError where model.py cannot hold it."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}  # transformers 4.x / 5.x name
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    other_rope = any(rope.get(k, v) != v for k, v in LLAMA31_ROPE.items())
    if rope_type not in ("default", "llama3") or other_rope:
        raise ValueError(f"rope {rope} is not Llama 3's (model.py hardcodes {LLAMA31_ROPE})")
    # HF stores the FFN width, Meta a rule for it: round up to a multiple of the width itself (after
    # scaling down where the width is under Meta's 8/3 * dim). Biases would show as unexpected
    # tensors.
    dim = c["hidden_size"]
    width = c["intermediate_size"]  # the feed-forward's hidden width
    theta = c.get("rope_theta") or rope.get("rope_theta", 10000.0)  # HF's default
    context = c.get("max_position_embeddings", 2048)
    return ModelArgs.from_dict(dict(
        dim=dim, n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads"), vocab_size=c["vocab_size"],
        multiple_of=width, ffn_dim_multiplier=min(1.0, width / int(8 * dim / 3)),
        norm_eps=c["rms_norm_eps"], rope_theta=theta, use_scaled_rope=rope_type == "llama3",
        rope_scaling_factor=rope.get("factor", 8.0), max_seq_len=context))


# --- the tokenizer: tokenizer.json and its companions ---------------------------------------------
def byte_chars() -> dict:
    """Byte-level BPE spells each byte as a printable character (GPT-2's table, as Llama 3's files
    do)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = sorted(set(range(256)) - set(keep))
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(shifted)}


def hf_tokenizer(tok: Tokenizer, bos_id: int):
    """A Hugging Face tokenizer that gives tiktoken's ids. tiktoken merges the adjacent pair whose
    concatenation has the lowest rank, so every split of a token into two tokens is a Hugging Face
    BPE merge with that rank as its priority; with ignore_merges (a whole pre-token that is a token
    is taken as is, as tiktoken does) both give the same ids."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    ranks = {t: tok.model.encode_single_token(t) for t in tok.model.token_byte_values()}
    char = byte_chars()
    spell = lambda t: "".join(char[b] for b in t)  # noqa: E731
    merges = sorted((r, t[:i], t[i:]) for t, r in ranks.items() for i in range(1, len(t))
                    if t[:i] in ranks and t[i:] in ranks)
    vocab = {spell(t): r for t, r in ranks.items()}
    pairs = [(spell(a), spell(b)) for _, a, b in merges]
    hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([  # data.py's split regex, then bytes -> characters
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    special = [AddedToken(name, special=True, normalized=False) for name in tok.special]
    hf.add_special_tokens(special)
    bos = hf.id_to_token(bos_id)
    hf.post_processor = processors.TemplateProcessing(  # Llama 3's: BOS first, no EOS
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    return hf


def tokenizer_files(hf, config: dict) -> dict:
    """{file name: its JSON} beside tokenizer.json, as a Llama 3 Hub repo has them."""
    bos = hf.id_to_token(config["bos_token_id"])
    eos = hf.id_to_token(config["eos_token_id"])
    tokenizer_config = dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=bos, eos_token=eos,
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False)  # True would drop spaces before punctuation when decoding
    generation_config = dict(  # Llama 3.1 base's sampling defaults
        bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"], do_sample=True,
        temperature=0.6, top_p=0.9)
    return {"tokenizer_config.json": tokenizer_config,
            "special_tokens_map.json": dict(bos_token=bos, eos_token=eos),
            "generation_config.json": generation_config}
