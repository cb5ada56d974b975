"""Llama 3 / 3.1 / 3.2 in one file, with Meta's parameter names.

Reads bottom-up like Meta's reference implementation: ModelArgs, RMSNorm, RoPE, Attention,
FeedForward, TransformerBlock, Transformer. A Meta checkpoint loads with strict=True:

    args = ModelArgs(**json.load(open("params.json")))
    model = Transformer(args)
    model.load_state_dict(torch.load("consolidated.00.pth", weights_only=True))
    logits = model(tokens)  # (batch, seq, vocab), float32

For training, build on the meta device (no memory), shard, then `model.to_empty(device=...)` and
`model.init_weights()`. This file imports nothing from torch.distributed: attention infers its (possibly
tensor-parallel sharded) head count from tensor shapes, so TP can shard heads without editing the model.
"""

import functools
import hashlib
import math
import re
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None  # None means n_heads (multi-head attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context frequency scaling
    # Not in Meta's params.json: Llama 3.1 uses 8, Llama 3.2 1B/3B use 32 (add it when loading their
    # params.json; the 1B/3B flavors below have it).
    rope_scaling_factor: float = 8.0
    max_seq_len: int = 2048  # length of the precomputed rope table
    # How training runs the model, not its shape (never in params.json): block_causal keeps
    # attention inside each packed document, as Llama 3 was pretrained; one starts at each bos_id.
    attn_mask_type: str = "causal"  # causal or block_causal
    bos_id: Optional[int] = None  # the tokenizer's <|begin_of_text|>; needed by block_causal

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelArgs: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"ModelArgs: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"ModelArgs: head_dim={self.dim // self.n_heads} must be even for rope")
        if self.attn_mask_type not in ("causal", "block_causal"):
            raise ValueError(f"ModelArgs: attn_mask_type={self.attn_mask_type!r} must be causal or block_causal")

    def params(self) -> dict:  # what params.json holds: the model's shape
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("attn_mask_type", "bos_id")}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """Like ModelArgs(**d) but names the unknown keys (e.g. from a params.json)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelArgs: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**d)


_LLAMA31 = dict(vocab_size=128256, rope_theta=500000.0, use_scaled_rope=True, norm_eps=1e-5,
                max_seq_len=131072)
flavors = {
    # Tiny GQA model for CPU runs and tests; vocab matches the bundled tokenizer (1792 BPE + 256 special).
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048,
                            multiple_of=256, rope_theta=500000.0, use_scaled_rope=True, max_seq_len=2048),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                    multiple_of=256, **{**_LLAMA31, "rope_scaling_factor": 32.0}),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                    multiple_of=256, **{**_LLAMA31, "rope_scaling_factor": 32.0}),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, **_LLAMA31),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, **_LLAMA31),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, **_LLAMA31),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 even under bf16 autocast/mixed precision, as Meta does.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def apply_rope_scaling(freqs: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                       high_freq_factor: float = 4.0, old_context_len: int = 8192) -> torch.Tensor:
    """Llama 3.1 rope scaling: slow down long wavelengths, keep short ones, blend in between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > low_freq_wavelen, freqs / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, out)


def precompute_freqs_cis(args: ModelArgs, device=None) -> torch.Tensor:
    """Complex rotations e^(i * pos * freq), shape (max_seq_len, head_dim // 2)."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if args.use_scaled_rope:
        freqs = apply_rope_scaling(freqs, args.rope_scaling_factor)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Rotate q and k; Meta's layout pairs adjacent features (2i, 2i+1) as one complex number and
    multiplies it by freqs_cis's. The product is written out in real numbers: torch.compile has no
    code generation for complex dtypes, and would run a complex product eagerly, unfused."""
    if freqs_cis.is_complex():  # Transformer.forward passes the real view already
        freqs_cis = torch.view_as_real(freqs_cis)  # (seqlen, head_dim // 2, 2): cos, sin
    cos, sin = freqs_cis[None, :, None].unbind(-1)  # (1, seqlen, 1, head_dim // 2): over batch, heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        re, im = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (bs, seqlen, n_heads, head_dim // 2)
        return torch.stack([re * cos - im * sin, re * sin + im * cos], -1).flatten(3).type_as(x)
    return rotate(xq), rotate(xk)


def document_mask_mod(tokens: torch.Tensor, bos_id: int) -> Callable:
    """Block-causal attention as a FlexAttention mask_mod: query position q sees key position kv when kv <= q
    and both lie in the same document. A document starts at each bos_id; the tokens before a window's first
    BOS (a document cut by the packing) are a document of their own. The one definition both paths use."""
    doc = (tokens == bos_id).cumsum(1)  # (bs, seqlen): each position's document number within its window

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (doc[b, q] == doc[b, kv])

    return mask_mod


@functools.cache
def compiled_flex_attention():
    """FlexAttention is fast only compiled (eager, it materialises the scores): compiled once per process."""
    return torch.compile(flex_attention)


def attention_mask(tokens: torch.Tensor, args: ModelArgs):
    """What every layer's attention takes for this batch, built once per forward: None for causal; for
    block_causal a FlexAttention BlockMask on CUDA, else a boolean SDPA mask (bs, 1, seqlen, seqlen) (the
    CPU has no FlexAttention backward). Both come from document_mask_mod."""
    if args.attn_mask_type == "causal":
        return None
    if args.bos_id is None:
        raise ValueError("ModelArgs: attn_mask_type='block_causal' needs bos_id (the token that starts a document)")
    bs, seqlen = tokens.shape
    mask_mod = document_mask_mod(tokens, args.bos_id)
    if tokens.is_cuda:
        return create_block_mask(mask_mod, bs, None, seqlen, seqlen, device=tokens.device, _compile=True)
    return create_mask(mask_mod, bs, None, seqlen, seqlen, device=tokens.device)


def causal_attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask=None) -> torch.Tensor:
    """Causal attention with grouped kv heads, within documents when given attention_mask()'s mask:
    (bs, seqlen, heads, head_dim) in, (bs, seqlen, n_heads * head_dim) out."""
    bs, seqlen, n_heads, _ = xq.shape
    n_rep = n_heads // xk.shape[2]
    if isinstance(mask, BlockMask):  # FlexAttention reads each kv head in place for its n_rep query heads
        # Inside a compiled block the compiler captures flex_attention itself; eager CUDA calls the
        # compiled one (the CPU, forward only, runs it eagerly).
        eager = torch.compiler.is_compiling() or not xq.is_cuda
        flex = flex_attention if eager else compiled_flex_attention()
        out = flex(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), block_mask=mask, enable_gqa=n_rep > 1)
        return out.transpose(1, 2).reshape(bs, seqlen, -1)  # (bs, seqlen, n_heads * head_dim)
    # The flash kernels (the CPU's, and CUDA's in bf16/fp16) read each kv head in place for its n_rep query
    # heads (enable_gqa), which saves copying k and v and summing their gradients back. CUDA's fp32 kernel
    # (memory-efficient) cannot, and SDPA would fall back to the O(seqlen^2)-memory math path: copy there.
    copy_kv = n_rep > 1 and xq.is_cuda and xq.dtype == torch.float32
    if copy_kv:
        xk, xv = xk.repeat_interleave(n_rep, 2), xv.repeat_interleave(n_rep, 2)  # (bs, seqlen, n_heads, head_dim)
    # SDPA wants (bs, n_heads, seqlen, head_dim)
    out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                         attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=n_rep > 1 and not copy_kv)
    return out.transpose(1, 2).reshape(bs, seqlen, -1)  # (bs, seqlen, n_heads * head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask=None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds only its share of heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_heads, head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        return self.wo(causal_attention(xq, xk, xv, mask))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # Meta's rule: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of.
        hidden = int(2 * 4 * args.dim / 3)
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, args.dim, bias=False)  # down
        self.w3 = nn.Linear(args.dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)  # not tied to tok_embeddings
        # Non-persistent: derived from args, so not part of Meta's state dict (9 * n_layers + 3 keys).
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would cast the complex rope table to a real dtype, silently
        # dropping its sin half: keep it complex64 and let only its device follow.
        freqs_cis = self.freqs_cis
        super()._apply(fn, recurse)
        if not self.freqs_cis.is_complex():
            self.freqs_cis = freqs_cis.to(self.freqs_cis.device)
        return self

    def forward(self, tokens: torch.Tensor, last_hidden: bool = False) -> torch.Tensor:
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len={self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (bs, seqlen, dim)
        freqs_cis = torch.view_as_real(self.freqs_cis[:seqlen])  # compiled blocks get no complex input
        mask = attention_mask(tokens, self.args)  # all layers share one mask
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        h = self.norm(h)
        if last_hidden:  # the trainer's loss takes the output layer a chunk of positions at a time
            return h  # (bs, seqlen, dim)
        return self.output(h).float()  # (bs, seqlen, vocab_size); fp32 for a stable loss

    @torch.no_grad()
    def init_weights(self, normal_: Optional[Callable] = None, buffer_device=None):
        """Initialise every weight in place (after to_empty()); deterministic for a given seed.

        - tok_embeddings.weight: normal(0, 1)
        - attention.wq/wk/wv, feed_forward.w1: normal(0, 0.02)
        - attention.wo, feed_forward.w2/w3: normal(0, 0.02 / sqrt(2 * (layer_id + 1))), so deeper
          layers add less to the residual stream at the start
        - output.weight: normal(0, dim ** -0.5)
        - attention_norm, ffn_norm, norm: ones
        - any other parameter (one a research edit adds), by name: `*norm.weight` ones (a q/k norm),
          `*.bias` zeros, anything else normal(0, 0.02) whatever its shape (a gate, a 3-D expert
          weight, a 0-D scale); give it its own rule here when that is wrong for it
        - freqs_cis (buffer): recomputed from args on buffer_device (default: where it lives now)
        Every normal is truncated at 3 std. `normal_(name, tensor, std)` draws them; the default
        uses torch's global RNG. train.py passes one whose values do not depend on the sharding.
        """
        normal_ = normal_ or (lambda name, w, std: nn.init.trunc_normal_(w, 0.0, std, -3 * std, 3 * std))
        self.freqs_cis = precompute_freqs_cis(self.args, device=buffer_device or self.freqs_cis.device)
        for name, p in self.named_parameters():
            layer = re.match(r"layers\.(\d+)\.", name)
            out_std = 0.02 / math.sqrt(2 * (int(layer.group(1)) + 1)) if layer else None
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name == "tok_embeddings.weight":
                normal_(name, p, 1.0)
            elif name == "output.weight":
                normal_(name, p, self.args.dim ** -0.5)
            elif name.endswith(("wo.weight", "w2.weight", "w3.weight")):
                normal_(name, p, out_std)
            elif name.endswith(".bias"):  # wq/wk/wv/w1 and new weights fall through to the default rules
                nn.init.zeros_(p)
            else:
                normal_(name, p, 0.02)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n


def keyed_normal_(local: torch.Tensor, offset, full_shape, seed: int, name: str, std: float, rows_per_block: int = 64):
    """Fill `local`, the block of a weight of `full_shape` starting at `offset` (one index per dim), with
    truncated normals whose values depend on (seed, name, position) only, so a shard gets the same values as
    the whole tensor. Any shape: a 0-D tensor is one row, a 1-D one a column, 3-D ones (experts) carry their
    trailing dims along.

    Rows (dim 0) are drawn in blocks of 64 from generators keyed by (seed, name, block): a shard draws the
    blocks its rows touch, at full width, and keeps its own rows and columns.
    """
    if local.ndim == 0:
        local, offset, full_shape = local.view(1), (0,), (1,)
    r0, r1 = offset[0], offset[0] + local.shape[0]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))  # this shard's other dims
    for b in range(r0 // rows_per_block, -(-r1 // rows_per_block)):
        digest = hashlib.sha256(f"{seed}/{name}/{b}".encode()).digest()
        g = torch.Generator(device=local.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        lo, hi = b * rows_per_block, min((b + 1) * rows_per_block, full_shape[0])
        block = torch.empty(hi - lo, *full_shape[1:], device=local.device, dtype=local.dtype)
        nn.init.trunc_normal_(block, 0.0, std, -3 * std, 3 * std, generator=g)
        a, z = max(lo, r0), min(hi, r1)
        local[a - r0:z - r0].copy_(block[(slice(a - lo, z - lo), *cols)])
