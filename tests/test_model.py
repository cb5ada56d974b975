"""Tests for model.py: parity with an independent Llama 3 reference, checkpoint format, flavors,
meta-device materialisation, causality, bf16, tensor-parallel readiness.

CPU-only and fast. The reference implementation below is written from Meta's published Llama 3
reference semantics and deliberately shares no code with model.py.
"""

import ast
import copy
import dataclasses
import json
import math
import os
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import model as M  # noqa: E402
from conftest import DEVICES  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


# ----------------------------------------------------------------------------------------------
# Independent reference (Meta's Llama 3 / 3.1 semantics), operating on a plain Meta state dict.
# ----------------------------------------------------------------------------------------------

def ref_ffn_hidden(dim, multiple_of, ffn_dim_multiplier):
    """Meta: hidden = 4*dim; hidden = int(2*hidden/3); times multiplier; round up to multiple_of."""
    hidden = 4 * dim
    hidden = int(2 * hidden / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ref_rope_bands(freqs, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192):
    """Which Llama 3.1 band each frequency falls in: 'keep', 'blend' or 'scale'."""
    bands = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_context_len / high_freq_factor:
            bands.append("keep")
        elif wavelen > old_context_len / low_freq_factor:
            bands.append("scale")
        else:
            bands.append("blend")
    return bands


def ref_scale_freqs(freqs, scale_factor, low_freq_factor=1.0, high_freq_factor=4.0,
                    old_context_len=8192):
    """Llama 3.1 rope scaling, one frequency at a time (Python floats)."""
    out = []
    for f, band in zip(freqs, ref_rope_bands(freqs, low_freq_factor, high_freq_factor,
                                             old_context_len)):
        if band == "keep":
            out.append(f)
        elif band == "scale":
            out.append(f / scale_factor)
        else:
            wavelen = 2 * math.pi / f
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / scale_factor + smooth * f)
    return out


def ref_base_freqs(head_dim, theta):
    # As Meta: 1 / theta^(arange(0, d, 2)/d), in float32.
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)))


def ref_freqs_cis(head_dim, seqlen, theta, use_scaled_rope, scale_factor):
    freqs = ref_base_freqs(head_dim, theta)
    if use_scaled_rope:
        freqs = torch.tensor(ref_scale_freqs(freqs.tolist(), scale_factor), dtype=torch.float32)
    pos = torch.arange(seqlen, dtype=torch.float32)
    angles = torch.outer(pos, freqs)  # (seqlen, head_dim // 2)
    return torch.polar(torch.ones_like(angles), angles)


def ref_rope(x, freqs_cis, layout="interleaved"):
    """x: (bs, seqlen, heads, head_dim). 'interleaved' (Meta): features (2i, 2i+1) form one complex
    number. 'half' (HF-style, WRONG for Meta checkpoints): features (i, i + d/2)."""
    xf = x.float()
    cos = freqs_cis.real[None, :, None, :]
    sin = freqs_cis.imag[None, :, None, :]
    if layout == "interleaved":
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    elif layout == "half":
        h = xf.shape[-1] // 2
        a, b = xf[..., :h], xf[..., h:]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    else:
        raise ValueError(layout)
    return out.type_as(x)


def ref_rmsnorm(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def ref_repeat_kv(x, n_rep):
    # (bs, s, n_kv, d) -> (bs, s, n_kv * n_rep, d); kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1
    return x if n_rep == 1 else torch.repeat_interleave(x, n_rep, dim=2)


def ref_attention(x, sd, p, cfg, freqs_cis, rope_layout):
    bs, s, dim = x.shape
    n_heads = cfg["n_heads"]
    n_kv = cfg["n_kv_heads"] or n_heads
    hd = dim // n_heads
    q = (x @ sd[p + "wq.weight"].T).view(bs, s, n_heads, hd)
    k = (x @ sd[p + "wk.weight"].T).view(bs, s, n_kv, hd)
    v = (x @ sd[p + "wv.weight"].T).view(bs, s, n_kv, hd)
    q, k = ref_rope(q, freqs_cis, rope_layout), ref_rope(k, freqs_cis, rope_layout)
    k, v = ref_repeat_kv(k, n_heads // n_kv), ref_repeat_kv(v, n_heads // n_kv)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (bs, h, s, hd)
    scores = q @ k.transpose(2, 3) / math.sqrt(hd)
    mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
    probs = torch.softmax((scores + mask).float(), dim=-1).type_as(q)
    out = (probs @ v).transpose(1, 2).reshape(bs, s, n_heads * hd)
    return out @ sd[p + "wo.weight"].T


def ref_ffn(x, sd, p, swap_w1_w3=False):
    w1, w3 = sd[p + "w1.weight"], sd[p + "w3.weight"]
    if swap_w1_w3:
        w1, w3 = w3, w1
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ sd[p + "w2.weight"].T


def ref_forward(sd, cfg, tokens, *, norm_eps=None, use_scaled_rope=None, rope_layout="interleaved",
                swap_w1_w3=False):
    """Meta Llama 3 forward on a plain dict with Meta key names. Keyword overrides make deliberately
    wrong variants for the sensitivity test."""
    eps = cfg["norm_eps"] if norm_eps is None else norm_eps
    scaled = cfg["use_scaled_rope"] if use_scaled_rope is None else use_scaled_rope
    dim, n_heads = cfg["dim"], cfg["n_heads"]
    hidden = ref_ffn_hidden(dim, cfg["multiple_of"], cfg["ffn_dim_multiplier"])
    assert sd["layers.0.feed_forward.w1.weight"].shape == (hidden, dim)
    seqlen = tokens.shape[1]
    freqs_cis = ref_freqs_cis(dim // n_heads, seqlen, cfg["rope_theta"], scaled,
                              cfg.get("rope_scaling_factor", 8.0))  # 8.0: ModelArgs' default
    h = sd["tok_embeddings.weight"][tokens]
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        h = h + ref_attention(ref_rmsnorm(h, sd[p + "attention_norm.weight"], eps), sd,
                              p + "attention.", cfg, freqs_cis, rope_layout)
        h = h + ref_ffn(ref_rmsnorm(h, sd[p + "ffn_norm.weight"], eps), sd, p + "feed_forward.",
                        swap_w1_w3)
    h = ref_rmsnorm(h, sd["norm.weight"], eps)
    return (h @ sd["output.weight"].T).float()


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

PARAMS_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
               "ffn_dim_multiplier", "norm_eps", "rope_theta", "use_scaled_rope")

PRESETS = {
    # 2-layer GQA, Llama 3.1 scaled rope; head_dim 8.
    "gqa_scaled": dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=32,
                       ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=5e5, use_scaled_rope=True,
                       max_seq_len=64, seqlen=48, emb_std=1.0),
    # MHA, plain rope, large eps with a small embedding scale so eps matters.
    "mha_eps": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=None, vocab_size=256, multiple_of=64,
                    ffn_dim_multiplier=None, norm_eps=1e-2, rope_theta=10000.0,
                    use_scaled_rope=False, max_seq_len=64, seqlen=40, emb_std=0.2),
    # Long sequence, head_dim 32 and theta 1e6: frequencies fall in all three scaling bands, two
    # of them in the blend band (wavelengths ~2650 and ~6280). Llama 3.2's scale factor 32.
    "long_scaled": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                        ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=1e6,
                        use_scaled_rope=True, rope_scaling_factor=32.0, max_seq_len=1024,
                        seqlen=320, emb_std=1.0),
}


def preset_args(name):
    cfg = {k: v for k, v in PRESETS[name].items() if k not in ("seqlen", "emb_std")}
    return cfg, M.ModelArgs(**cfg)


@torch.no_grad()
def sharp_init_(model, seed, emb_std=1.0):
    """Init so that attention is peaked, norm weights vary, and logits are O(1-10): any mistake in
    rope, eps, gate/up order etc. moves logits by much more than the parity tolerance."""
    g = torch.Generator().manual_seed(seed)
    gains = {"wq": 2.0, "wk": 2.0, "wv": 1.0, "wo": 1.0, "w1": 1.5, "w3": 1.5, "w2": 1.0,
             "output": 3.0}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        elif name == "tok_embeddings.weight":
            p.copy_(emb_std * torch.randn(p.shape, generator=g))
        else:
            gain = gains[name.split(".")[-2]]
            p.copy_(gain / math.sqrt(p.shape[1]) * torch.randn(p.shape, generator=g))
    return model


def build_sharp(name, seed=0):
    cfg, args = preset_args(name)
    model = sharp_init_(M.Transformer(args), seed, PRESETS[name]["emb_std"]).eval()
    tokens = torch.randint(0, cfg["vocab_size"], (2, PRESETS[name]["seqlen"]),
                           generator=torch.Generator().manual_seed(seed + 1))
    return cfg, model, tokens


def meta_state_dict_keys(n_layers):
    keys = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(n_layers):
        for w in ("wq", "wk", "wv", "wo"):
            keys.add(f"layers.{i}.attention.{w}.weight")
        for w in ("w1", "w2", "w3"):
            keys.add(f"layers.{i}.feed_forward.{w}.weight")
        keys.add(f"layers.{i}.attention_norm.weight")
        keys.add(f"layers.{i}.ffn_norm.weight")
    return keys


def small_default_args(**kw):
    base = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=64,
                rope_theta=500000.0, use_scaled_rope=True, max_seq_len=128)
    base.update(kw)
    return M.ModelArgs(**base)


# ----------------------------------------------------------------------------------------------
# 1-2. Parity with the reference, and sensitivity of that check
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["long_scaled", "8B", "1B", "debugmodel"])
def test_rope_table_matches_reference(which):
    """The model's rope table equals the independent per-frequency loop. The configs have
    frequencies in all three Llama 3.1 bands; 1B uses scale factor 32 (Llama 3.2)."""
    if which in PRESETS:
        args = preset_args(which)[1]
    else:  # real flavor, shorter table to keep the test fast
        args = dataclasses.replace(M.flavors[which], max_seq_len=8192)
    hd = args.dim // args.n_heads
    bands = ref_rope_bands(ref_base_freqs(hd, args.rope_theta).tolist())
    assert {"keep", "blend", "scale"} <= set(bands), bands
    want = ref_freqs_cis(hd, args.max_seq_len, args.rope_theta, True, args.rope_scaling_factor)
    got = M.precompute_freqs_cis(args)
    assert got.shape == want.shape and got.dtype == torch.complex64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    unscaled = ref_freqs_cis(hd, args.max_seq_len, args.rope_theta, False, 1.0)
    assert (got - unscaled).abs().max() > 0.5  # scaling is really applied


@pytest.mark.parametrize("name", sorted(PRESETS))
@torch.no_grad()
def test_parity_with_reference(name):
    cfg, model, tokens = build_sharp(name)
    if name == "long_scaled":
        hd = cfg["dim"] // cfg["n_heads"]
        bands = ref_rope_bands(ref_base_freqs(hd, cfg["rope_theta"]).tolist())
        assert {"keep", "blend", "scale"} <= set(bands), bands
        assert tokens.shape[1] > 300
    logits = model(tokens)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    want = ref_forward(sd, cfg, tokens)
    assert logits.dtype == torch.float32 and logits.shape == want.shape
    # Logits must be large enough for the tolerance to mean something.
    assert 1.0 < logits.abs().max() < 100.0, logits.abs().max()
    assert logits.std() > 0.5, logits.std()
    diff = (logits - want).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("name,variant", [
    pytest.param("mha_eps", dict(norm_eps=1e-5), id="mha_eps-wrong_eps"),
    pytest.param("gqa_scaled", dict(swap_w1_w3=True), id="gqa_scaled-swap_w1_w3"),
    pytest.param("gqa_scaled", dict(rope_layout="half"), id="gqa_scaled-half_split_rope"),
    pytest.param("mha_eps", dict(rope_layout="half"), id="mha_eps-half_split_rope"),
    pytest.param("long_scaled", dict(use_scaled_rope=False), id="long_scaled-unscaled_rope"),
])
@torch.no_grad()
def test_parity_is_sensitive(name, variant):
    """A deliberately wrong reference differs from model.py by >> the parity tolerance."""
    cfg, model, tokens = build_sharp(name)
    logits = model(tokens)
    sd = dict(model.state_dict())
    wrong = ref_forward(sd, cfg, tokens, **variant)
    diff = (logits - wrong).abs().max().item()
    assert diff > 1e-2, f"{name} {variant}: only {diff}"


# ----------------------------------------------------------------------------------------------
# 3-4. State dict format and strict loading from params.json
# ----------------------------------------------------------------------------------------------

def test_state_dict_matches_meta_format():
    cfg, args = preset_args("gqa_scaled")
    model = M.Transformer(args)
    sd = model.state_dict()
    assert set(sd) == meta_state_dict_keys(args.n_layers)
    assert len(sd) == 9 * args.n_layers + 3
    assert not any("freqs_cis" in k for k in sd)
    dim, hd = args.dim, args.dim // args.n_heads
    hidden = ref_ffn_hidden(dim, args.multiple_of, args.ffn_dim_multiplier)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        assert sd[p + "attention.wq.weight"].shape == (args.n_heads * hd, dim)
        assert sd[p + "attention.wk.weight"].shape == (args.n_kv_heads * hd, dim)
        assert sd[p + "attention.wv.weight"].shape == (args.n_kv_heads * hd, dim)
        assert sd[p + "attention.wo.weight"].shape == (dim, args.n_heads * hd)
        assert sd[p + "feed_forward.w1.weight"].shape == (hidden, dim)
        assert sd[p + "feed_forward.w3.weight"].shape == (hidden, dim)
        assert sd[p + "feed_forward.w2.weight"].shape == (dim, hidden)
        assert sd[p + "attention_norm.weight"].shape == (dim,)
        assert sd[p + "ffn_norm.weight"].shape == (dim,)
    assert sd["tok_embeddings.weight"].shape == (args.vocab_size, dim)
    assert sd["output.weight"].shape == (args.vocab_size, dim)
    assert sd["norm.weight"].shape == (dim,)
    # Untied: distinct storage.
    assert model.output.weight is not model.tok_embeddings.weight
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()


@torch.no_grad()
def test_strict_load_from_params_json(tmp_path):
    cfg, src = build_sharp("gqa_scaled")[:2]
    params = {k: cfg[k] for k in PARAMS_KEYS}
    (tmp_path / "params.json").write_text(json.dumps(params))
    torch.save(src.state_dict(), tmp_path / "consolidated.00.pth")

    loaded_params = json.loads((tmp_path / "params.json").read_text())
    dst = M.Transformer(M.ModelArgs.from_dict(loaded_params))
    result = dst.load_state_dict(
        torch.load(tmp_path / "consolidated.00.pth", weights_only=True), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    tokens = torch.randint(0, cfg["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(dst(tokens), src(tokens))


def test_model_args_validation():
    with pytest.raises(ValueError, match="bogus_key"):
        M.ModelArgs.from_dict({"dim": 64, "n_heads": 8, "bogus_key": 1})
    with pytest.raises(ValueError, match="divisible"):
        M.ModelArgs(dim=65, n_heads=8)
    with pytest.raises(ValueError, match="divisible"):
        M.ModelArgs(dim=64, n_heads=8, n_kv_heads=3)
    assert M.ModelArgs(dim=64, n_heads=8).n_kv_heads == 8


# ----------------------------------------------------------------------------------------------
# 5. Flavors on the meta device
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavor,hidden", [
    ("1B", 8192), ("3B", 8192), ("8B", 14336), ("70B", 28672), ("405B", 53248)])
def test_flavor_ffn_hidden(flavor, hidden):
    args = M.flavors[flavor]
    assert ref_ffn_hidden(args.dim, args.multiple_of, args.ffn_dim_multiplier) == hidden
    with torch.device("meta"):
        ff = M.FeedForward(args)
    assert ff.w1.weight.shape == (hidden, args.dim)
    assert ff.w2.weight.shape == (args.dim, hidden)
    assert ff.w3.weight.shape == (hidden, args.dim)


@pytest.mark.parametrize("flavor,n_params", [
    ("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.8e9)])
def test_flavor_param_count_on_meta(flavor, n_params):
    args = M.flavors[flavor]
    with torch.device("meta"):
        model = M.Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    n = model.num_params()
    assert abs(n - n_params) / n_params < 5e-3, n
    assert model.num_params(exclude_embedding=True) == n - args.vocab_size * args.dim
    assert args.vocab_size == 128256
    assert args.rope_theta == 500000.0
    assert args.use_scaled_rope is True
    assert args.n_kv_heads == 8


def test_flavor_common_fields_and_debugmodel():
    for name in ("1B", "3B", "8B", "70B", "405B"):
        a = M.flavors[name]
        assert (a.vocab_size, a.rope_theta, a.use_scaled_rope, a.n_kv_heads) == (
            128256, 500000.0, True, 8), name
    with torch.device("meta"):
        model = M.Transformer(M.flavors["debugmodel"])
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() < 20e6


# ----------------------------------------------------------------------------------------------
# 6. Meta-device materialisation and init_weights
# ----------------------------------------------------------------------------------------------

def materialise(args, seed):
    with torch.device("meta"):
        model = M.Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@torch.no_grad()
def test_meta_materialise_init_weights():
    # debugmodel-like but smaller, so three inits stay fast on CPU
    args = dataclasses.replace(M.flavors["debugmodel"], n_layers=2, vocab_size=512, max_seq_len=256)
    a, b, c = materialise(args, 0), materialise(args, 0), materialise(args, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for k in sa:
        assert sa[k].device.type == "cpu"
        assert torch.equal(sa[k], sb[k]), k
        if not k.endswith("norm.weight"):
            assert not torch.equal(sa[k], sc[k]), k
        else:
            assert torch.equal(sa[k], torch.ones_like(sa[k])), k

    direct = M.Transformer(args)
    assert a.freqs_cis.device.type == "cpu"
    assert a.freqs_cis.dtype == direct.freqs_cis.dtype == torch.complex64
    assert torch.equal(a.freqs_cis, direct.freqs_cis)

    wq = sa["layers.0.attention.wq.weight"]
    assert abs(wq.std().item() - 0.02) < 0.002
    assert abs(wq.mean().item()) < 0.001
    assert abs(sa["tok_embeddings.weight"].std().item() - 1.0) < 0.05

    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = a(tokens)
    assert logits.shape == (2, 32, args.vocab_size)
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------------------------
# 7. Causality
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def test_causality():
    cfg, model, tokens = build_sharp("gqa_scaled")
    tokens = tokens[:1]
    base = model(tokens)
    for t in (0, 5, tokens.shape[1] - 1):
        changed = tokens.clone()
        changed[0, t] = (changed[0, t] + 1) % cfg["vocab_size"]
        out = model(changed)
        assert torch.equal(out[:, :t], base[:, :t]), t
        assert not torch.equal(out[:, t], base[:, t]), t


# ----------------------------------------------------------------------------------------------
# 7b. Block-causal attention: each document of a packed window attends only to itself
# ----------------------------------------------------------------------------------------------

BOS = 1


def packed_windows(seqlen=96, vocab=256):
    """Two packed windows (2, seqlen) and each one's documents: the first starts mid-document (no BOS: a
    document of its own), the second with a BOS; documents of 1 to 40 tokens, as data.py packs them."""
    g = torch.Generator().manual_seed(1)
    rows, docs = [], []
    for lengths in ((13, 1, 40, 17, 25), (30, 9, 2, 55)):
        parts = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
        for i, p in enumerate(parts):
            if i or len(rows) == 1:
                p[0] = BOS
        rows.append(torch.cat(parts))
        docs.append(parts)
    return torch.stack(rows), docs


@torch.no_grad()
def test_block_causal_logits_are_each_documents_logits_run_alone():
    """RoPE is relative, so a document's logits do not depend on where it starts in the window: under block_causal
    the packed window's logits equal its documents' logits run one by one; under causal they do not."""
    torch.manual_seed(0)
    model = M.Transformer(small_default_args()).eval()  # the trainer's init: logits of order 1
    model.init_weights()
    tokens, docs = packed_windows(vocab=model.args.vocab_size)
    alone = [torch.cat([model(d[None])[0] for d in row]) for row in docs]  # (seqlen, vocab) per row
    model.args = dataclasses.replace(model.args, attn_mask_type="block_causal", bos_id=BOS)
    packed = model(tokens)
    for row in range(2):
        assert (packed[row] - alone[row]).abs().max() <= 1e-5
    model.args = dataclasses.replace(model.args, attn_mask_type="causal")
    causal = model(tokens)
    first = len(docs[0][0])  # a window's first document is the same either way; the later ones are not
    assert (causal[0, :first] - alone[0][:first]).abs().max() <= 1e-5
    assert (causal[0, first:] - alone[0][first:]).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_flex_attention_block_mask_matches_the_sdpa_mask(device):
    """One mask definition (document_mask_mod), two paths: FlexAttention with a BlockMask (what CUDA trains with)
    and SDPA with a boolean mask (what the CPU trains with) give the same attention. The CPU has no FlexAttention
    backward: forward only there; on CUDA (python -m pytest -m gpu) forward and backward, flex compiled."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask
    tokens, _ = packed_windows(seqlen=96)
    tokens = torch.cat([tokens, tokens.flip(1)], dim=1).to(device)  # (2, 192): not a multiple of flex's 128 blocks
    bs, seqlen = tokens.shape
    args = M.ModelArgs(dim=128, n_heads=8, n_kv_heads=2, attn_mask_type="block_causal", bos_id=BOS)
    assert isinstance(M.attention_mask(tokens, args), BlockMask if device == "cuda" else torch.Tensor)
    mask_mod = M.document_mask_mod(tokens, BOS)
    sdpa_mask = create_mask(mask_mod, bs, None, seqlen, seqlen, device=device)  # (bs, 1, seqlen, seqlen)
    block_mask = create_block_mask(mask_mod, bs, None, seqlen, seqlen, device=device)
    grad = device == "cuda"
    torch.manual_seed(0)
    q = torch.randn(bs, seqlen, 8, 16, device=device, requires_grad=grad)  # (bs, seqlen, n_heads, head_dim)
    k, v = (torch.randn(bs, seqlen, 2, 16, device=device, requires_grad=grad) for _ in range(2))
    ref = M.causal_attention(q, k, v, sdpa_mask)
    out = M.causal_attention(q, k, v, block_mask)
    assert out.shape == ref.shape == (bs, seqlen, 8 * 16)
    # fp32; CUDA's kernels may use TF32 matmuls (the bound there is not measured on this CPU-only project)
    bound = 1e-6 if device == "cpu" else 1e-3
    assert (out - ref).norm() <= bound * ref.norm()
    if grad:
        for a, b in zip(torch.autograd.grad(out.square().sum(), [q, k, v]),
                        torch.autograd.grad(ref.square().sum(), [q, k, v])):
            assert (a - b).norm() <= bound * b.norm()
    causal = M.causal_attention(q, k, v)
    assert (causal - ref).norm() > 1e-2 * ref.norm()  # the mask does something


def test_block_causal_settings_stay_out_of_params_json():
    args = M.ModelArgs(attn_mask_type="block_causal", bos_id=128000)
    assert "attn_mask_type" not in args.params() and "bos_id" not in args.params()
    assert M.ModelArgs.from_dict(args.params()) == M.ModelArgs()
    with pytest.raises(ValueError, match="needs bos_id"):
        M.attention_mask(torch.zeros(1, 4, dtype=torch.long), M.ModelArgs(attn_mask_type="block_causal"))


# ----------------------------------------------------------------------------------------------
# 8. bf16
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("init", ["default", "sharp"])
@torch.no_grad()
def test_bf16_forward_close_to_fp32(init):
    """model.to(bfloat16) gives logits close to fp32. With the default init attention is nearly
    uniform, so rope barely matters; the sharp init also checks that rope survives the cast."""
    if init == "default":
        args = small_default_args()
        torch.manual_seed(0)
        model = M.Transformer(args)
        model.init_weights()
        tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        max_rel, min_agree = 5e-2, 0.9
    else:
        _, model, tokens = build_sharp("gqa_scaled")
        max_rel, min_agree = 0.1, 0.85  # fp32 vs bf16 here: ~0.03 and ~0.95
    ref = model(tokens)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert model_bf16.tok_embeddings.weight.dtype == torch.bfloat16
    assert model_bf16.layers[0].attention.wq.weight.dtype == torch.bfloat16
    out = model_bf16(tokens)
    assert out.dtype == torch.float32
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel < max_rel, rel
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > min_agree, agree


@torch.no_grad()
def test_rmsnorm_bf16_semantics():
    """Meta: normalise in fp32, cast back to the input dtype, then multiply by the weight."""
    g = torch.Generator().manual_seed(0)
    norm = M.RMSNorm(64, eps=1e-5)
    norm.weight.copy_(1 + 0.5 * torch.randn(64, generator=g))
    norm.to(torch.bfloat16)
    x = (3 * torch.randn(4, 64, generator=g)).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_rmsnorm(x, norm.weight, 1e-5))


def test_to_bf16_keeps_rope_table():
    """model.to(bfloat16) must not touch the complex rope table. nn.Module.to(dtype) casts complex
    buffers too, so a complex64 freqs_cis buffer would become real bf16 (imaginary part, i.e. the
    sin half of every rotation, silently dropped)."""
    args = small_default_args()
    model = M.Transformer(args)
    want = model.freqs_cis.clone()
    model.to(torch.bfloat16)
    assert model.freqs_cis.is_complex(), model.freqs_cis.dtype
    torch.testing.assert_close(model.freqs_cis.to(want.dtype), want)


# ----------------------------------------------------------------------------------------------
# 9. Tensor-parallel readiness: attention infers its head count from weight shapes
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def test_attention_head_sharding_sums_to_full():
    args = M.ModelArgs(dim=64, n_heads=8, n_kv_heads=2, max_seq_len=32, rope_theta=100.0)
    g = torch.Generator().manual_seed(0)
    attn = M.Attention(args)
    for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(lin.weight.shape[1]))
    hd = args.dim // args.n_heads
    x = torch.randn(2, 32, args.dim, generator=g)
    freqs_cis = M.precompute_freqs_cis(args)[:32]
    full = attn(x, freqs_cis)

    tp = 2
    q_per, kv_per = args.n_heads // tp * hd, args.n_kv_heads // tp * hd
    total = torch.zeros_like(full)
    for r in range(tp):
        shard = copy.deepcopy(attn)
        shard.wq.weight = torch.nn.Parameter(attn.wq.weight[r * q_per:(r + 1) * q_per].clone())
        shard.wk.weight = torch.nn.Parameter(attn.wk.weight[r * kv_per:(r + 1) * kv_per].clone())
        shard.wv.weight = torch.nn.Parameter(attn.wv.weight[r * kv_per:(r + 1) * kv_per].clone())
        shard.wo.weight = torch.nn.Parameter(attn.wo.weight[:, r * q_per:(r + 1) * q_per].clone())
        part = shard(x, freqs_cis)
        assert part.shape == full.shape
        assert (part - full).abs().max() > 1e-2  # each shard alone is not the answer
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_kv_heads_are_read_in_place(device, dtype, monkeypatch):
    """GQA: SDPA reads each kv head for its query heads in place (enable_gqa), with the values and gradients of
    copying the heads first. Only CUDA's fp32 kernel cannot, and there the heads are copied (else: math path)."""
    args = M.ModelArgs(dim=128, n_heads=8, n_kv_heads=2, max_seq_len=64, rope_theta=100.0)
    torch.manual_seed(0)
    attn = M.Attention(args).to(device, dtype)
    x = torch.randn(2, 64, args.dim, device=device, dtype=dtype, requires_grad=True)
    freqs_cis = M.precompute_freqs_cis(args, device)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, **kw):
        calls.append((k.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out = attn(x, freqs_cis)
    copied = device == "cuda" and dtype == torch.float32
    assert calls == ([(8, False)] if copied else [(2, True)])

    def copy_heads(q, k, v, **kw):  # what the model did before: k and v repeated for every query head
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return sdpa(q, k, v, **{**kw, "enable_gqa": False})

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", copy_heads)
    ref = attn(x, freqs_cis)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *attn.parameters()])
    ref_grads = torch.autograd.grad(ref.float().square().sum(), [x, *attn.parameters()])
    # bf16: copying sums each kv head's gradient over its query heads in bf16, the GQA kernel in fp32
    bound = 1e-6 if dtype == torch.float32 else 2e-2  # measured on the CPU: 1.1e-7 and 5.3e-3
    for a, b in zip([out, *grads], [ref, *ref_grads]):
        assert (a.float() - b.float()).norm() <= bound * b.float().norm()


# ----------------------------------------------------------------------------------------------
# 10. No torch.distributed in model.py
# ----------------------------------------------------------------------------------------------

def test_model_imports_no_torch_distributed():
    with open(os.path.join(REPO_ROOT, "model.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("torch.distributed"), alias.name
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            assert not mod.startswith("torch.distributed"), mod
            if mod == "torch":
                assert all(a.name != "distributed" for a in node.names)
        elif isinstance(node, ast.Attribute):
            assert not (node.attr == "distributed" and isinstance(node.value, ast.Name)
                        and node.value.id == "torch"), "torch.distributed used"


def meta_rotary(xq, xk, freqs_cis):
    """Meta's apply_rotary_emb (llama-models, llama3 reference model.py): features (2i, 2i+1) as one complex number,
    times freqs_cis (seqlen, head_dim // 2), complex."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (bs, seqlen, heads, head_dim // 2)
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])  # Meta's reshape_for_broadcast
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


@torch.no_grad()
def test_the_blocks_compute_in_real_numbers(monkeypatch):
    """torch.compile has no code generation for complex dtypes: on an H100 (2026-11-26) inductor warned and ran
    the rope product eagerly, outside the block's fused kernels. The blocks get the rope table as real (cos, sin)
    pairs and no op in them makes a complex tensor; the complex table still works when passed directly; and the
    rotation they compute is Meta's complex product, with Llama 3.1's scaling of the table."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.update(t.dtype for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    # seq 64, head_dim 16: Llama 3.1's scaling moves the blended frequency's last angle from 0.089 to 0.033 rad
    args = M.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32, max_seq_len=64,
                       use_scaled_rope=True)
    model = M.Transformer(args)
    model.init_weights()
    calls = []
    model.layers[0].register_forward_pre_hook(lambda mod, inputs: calls.append(inputs))
    tokens = torch.randint(0, 32, (2, 64))
    model(tokens)
    h, freqs_cis, mask = calls[0]
    assert freqs_cis.dtype == torch.float32 and freqs_cis.shape == (64, 8, 2)  # (seqlen, head_dim // 2, cos/sin)
    seen = set()
    with Dtypes():
        real = model.layers[0](h, freqs_cis, mask)
    assert not any(d.is_complex for d in seen), seen
    torch.testing.assert_close(model.layers[0](h, model.freqs_cis[:64], mask), real, rtol=0, atol=0)
    # The q and k the block rotates, and how: against Meta's formula on Meta's table (ref_freqs_cis: torch.polar
    # of positions x frequencies, scaled as Llama 3.1), not the same arithmetic on two inputs
    rotations = []
    rotate = M.apply_rotary_emb

    def recorded(xq, xk, freqs_cis):
        out = rotate(xq, xk, freqs_cis)
        rotations.append((xq, xk, out))
        return out
    monkeypatch.setattr(M, "apply_rotary_emb", recorded)
    model.layers[0](h, freqs_cis, mask)
    xq, xk, (q, k) = rotations[0]
    meta = ref_freqs_cis(16, 64, args.rope_theta, True, args.rope_scaling_factor)
    q_meta, k_meta = meta_rotary(xq, xk, meta)
    assert xq.shape == (2, 64, 4, 16) and xk.shape == (2, 64, 2, 16)
    torch.testing.assert_close(q, q_meta, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, k_meta, rtol=1e-5, atol=1e-6)
