"""train.py with a research edit it needs no change for: a per-head RMSNorm on q and k (QK-norm), added by a
model subclass here. Launched like train.py: python tests/qknorm_train.py --config ... (or under torchrun)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402
import train  # noqa: E402


class QKNormAttention(model.Attention):
    def __init__(self, args):
        super().__init__(args)
        self.q_norm = model.RMSNorm(self.head_dim, args.norm_eps)  # new parameters the TP plan does not name
        self.k_norm = model.RMSNorm(self.head_dim, args.norm_eps)

    def forward(self, x, freqs_cis, mask=None):
        bs, seqlen, _ = x.shape
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_heads, head_dim)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = model.apply_rotary_emb(xq, xk, freqs_cis)
        return self.wo(model.causal_attention(xq, xk, xv, mask))


model.Attention = QKNormAttention  # TransformerBlock builds its attention from this name

if __name__ == "__main__":
    train.main(train.load_config(sys.argv[1:]))
