"""Muon (torch.optim.Muon's update: momentum orthogonalised by a Newton-Schulz iteration) on the blocks'
matrices, with AdamW on the embeddings, the output layer and the norms, as one optimizer sharded as the
weights are (docs/internals.md#muon); train.py's [muon] section. train.build_optimizer() builds it
for optimizer.name = "Muon"."""

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pretrain.config import NON_NEGATIVE, POSITIVE, one_of


@dataclass
class Muon:  # train.py's [muon] section: torch.optim.Muon's keys, used with optimizer.name = "Muon"
    lr: float = 0.0  # Muon's peak lr; 0: optimizer.lr (with adjust_lr = "match_rms_adamw", AdamW's lr carries over)
    momentum: float = 0.95  # the momentum buffer's decay
    nesterov: bool = True  # Nesterov momentum
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])  # the iteration's (a, b, c)
    eps: float = 1e-7  # the smallest norm a matrix is divided by before the iterations
    adjust_lr: str = "original"  # original: the lr x sqrt(max(1, rows / cols)); match_rms_adamw: x 0.2 sqrt(max(rows, cols)) (Moonlight's)
    ns_dtype: str = "bfloat16"  # Newton-Schulz in bfloat16 (torch's), or float32 (the same on every layout to ~1e-6)
    RULES: ClassVar[dict] = {"lr": NON_NEGATIVE, "momentum": (lambda x: 0 <= x < 1, "in [0, 1)"),
                             "ns_steps": (lambda x: 1 <= x < 100, "in [1, 100)"),
                             "ns_coefficients": (lambda x: len(x) == 3, "three numbers"),
                             "eps": POSITIVE, "adjust_lr": one_of("original", "match_rms_adamw"),
                             "ns_dtype": one_of("bfloat16", "float32")}


def is_matrix(name: str, p) -> bool:
    """Whether Muon takes this parameter: a block's 2-D weight (wq, wk, wv, wo, w1, w2, w3). The
    embeddings and the output layer are matrices too, but map tokens, not features: AdamW takes them."""
    return p.ndim == 2 and name.startswith("layers.")


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def orthogonalize(g: torch.Tensor, cfg: Muon) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration, in cfg.ns_dtype: the whole matrix g made close to
    its nearest semi-orthogonal matrix (singular values to about 1)."""
    a, b, c = cfg.ns_coefficients
    x = g.to(getattr(torch, cfg.ns_dtype), copy=True)
    tall = g.size(0) > g.size(1)
    x = x.T if tall else x  # (short, long): the Gram matrix is the smaller one
    x.div_(x.norm().clamp(min=cfg.eps))  # the spectral norm at most 1
    for _ in range(cfg.ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Shards:
    """Where each rank's piece of one sharded matrix lies, and the group that holds the pieces: the
    mesh dimensions the matrix is sharded on (replicas, as HSDP's, each do their own)."""

    def __init__(self, group, pieces: list):
        self.group = group
        self.pieces = pieces  # (offset, shape) of each group rank's piece in the whole matrix

    def piece(self, full: torch.Tensor, k: int) -> torch.Tensor:
        offset, shape = self.pieces[k]
        return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def shards(matrices: list) -> dict:
    """{matrix: Shards} of the DTensor matrices. Each rank works out every group rank's piece from
    the mesh and the placements, without a collective (the dry run's fake process group has no data
    to exchange); matrices of one shape and layout share theirs. Groups over two sharded mesh
    dimensions are made here, on every rank in the same order."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as piece_of
    groups, layouts, out = {}, {}, {}
    for p in (p for p in matrices if isinstance(p, DTensor)):
        mesh = p.device_mesh
        dims = tuple(i for i, pl in enumerate(p.placements) if not pl.is_replicate())
        if (mesh, dims) not in groups:  # a flattened group's ranks go row-major over its dimensions
            names = tuple(mesh.mesh_dim_names[i] for i in dims)
            groups[mesh, dims] = mesh.get_group(dims[0]) if len(dims) == 1 else mesh[names]._flatten().get_group()
        key = (mesh, dims, tuple(p.shape), tuple(p.placements))
        if key not in layouts:
            pieces = []
            for k in range(math.prod(mesh.shape[d] for d in dims)):
                coordinate = list(mesh.get_coordinate())
                for d in reversed(dims):  # group rank k's coordinates on the sharded dimensions
                    coordinate[d], k = k % mesh.shape[d], k // mesh.shape[d]
                with unset_fake_temporarily():  # it computes with small tensors of its own
                    shape, offset = piece_of(p.shape, mesh.shape, coordinate, p.placements)
                pieces.append((tuple(offset), tuple(shape)))
            layouts[key] = Shards(groups[mesh, dims], pieces)
        out[p] = layouts[key]
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon (torch.optim.Muon's update) on the blocks' matrices and `adamw` (torch's AdamW, or
    AdamWBF16State) on the other parameters, as one optimizer: one state, one schedule, one
    checkpoint layout. AdamW's group is group 0, the one the log's lr is read from.

    Newton-Schulz needs each matrix whole, and a rank holds a shard (FSDP2's rows, TP's rows or
    columns). As nanochat's DistMuon does, each matrix has an owner: the matrices are dealt out over
    the ranks that hold their pieces, G at a time (G ranks); in one all-to-all each rank sends its
    piece of the round's matrices to their owners, each owner orthogonalises its matrix, and a second
    all-to-all sends each rank its piece back. A rank holds one whole matrix at a time, orthogonalises
    1/G of them, and receives about two matrices' worth per round. Unlike DistMuon, the gradients
    arrive already reduce-scattered (FSDP2), so no reduction is added."""

    def __init__(self, adamw: torch.optim.Optimizer, matrices: list, cfg: Muon, *, lr: float,
                 weight_decay: float, state_dtype: str):
        self.adamw, self.cfg = adamw, cfg
        self.state_dtype = getattr(torch, state_dtype)  # the momentum buffers'
        muon = dict(params=matrices, lr=cfg.lr or lr, weight_decay=weight_decay)
        super().__init__([adamw.param_groups[0], muon], {})
        self.link()
        self.shards = shards(matrices)

    def link(self):
        """AdamW steps on this optimizer's own state and group 0 (after a load replaced them)."""
        self.adamw.state, self.adamw.param_groups = self.state, self.param_groups[:1]

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)  # it casts the states to the weights' dtype: undo that
        self.link()
        for state in self.state.values():
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                if key in state and self.state_dtype == torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        group = self.param_groups[1]
        matrices = [p for p in group["params"] if p.grad is not None]
        for p in (p for p in matrices if p not in self.shards):  # one process: each matrix is here
            self.apply(p, orthogonalize(self.momentum(p), self.cfg), group)
        by_group = {}  # the sharded ones, by the group that holds their pieces
        for p in (p for p in matrices if p in self.shards):
            by_group.setdefault(self.shards[p].group, []).append(p)
        for pg, params in by_group.items():
            size = dist.get_world_size(pg)
            for start in range(0, len(params), size):  # a round: its k-th matrix is group rank k's
                round_ = params[start:start + size]
                for p, piece in zip(round_, self.exchange(round_, [self.momentum(p) for p in round_], pg)):
                    self.apply(p, piece, group)

    def momentum(self, p) -> torch.Tensor:
        """torch.optim.Muon's momentum on this rank's piece: the buffer's update, and the update that
        goes to Newton-Schulz (Nesterov's, or the buffer)."""
        state = self.state[p]
        if not state:  # a DTensor as the weight is, so that checkpoints shard it alike
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=self.state_dtype)
        grad, buf = local(p.grad), local(state["momentum_buffer"])
        b = buf.float().lerp_(grad, 1 - self.cfg.momentum)  # in place where the buffer is fp32
        buf.copy_(b)
        return grad.lerp(b, self.cfg.momentum) if self.cfg.nesterov else b

    def exchange(self, round_: list, pieces: list, pg) -> list:
        """This rank's piece of each of the round's matrices orthogonalised by its owner; `pieces`:
        this rank's piece of each matrix's update."""
        me = dist.get_rank(pg)
        size = dist.get_world_size(pg)
        mine = round_[me] if me < len(round_) else None  # the matrix this rank owns this round
        device = pieces[0].device
        numel = [math.prod(shape) for _, shape in self.shards[mine].pieces] if mine is not None else [0] * size
        sent = [t.float().reshape(-1) for t in pieces] + [torch.zeros(0, device=device)] * (size - len(round_))
        received = torch.empty(sum(numel), device=device)
        dist.all_to_all_single(received, torch.cat(sent), output_split_sizes=numel,
                               input_split_sizes=[t.numel() for t in sent], group=pg)
        back = []  # the owner's pieces of its orthogonalised matrix, for each group rank
        if mine is not None:
            full = torch.empty(mine.shape, device=device)
            for k, chunk in enumerate(received.split(numel)):
                self.shards[mine].piece(full, k).copy_(chunk.view(self.shards[mine].pieces[k][1]))
            result = orthogonalize(full, self.cfg)
            back = [self.shards[mine].piece(result, k).reshape(-1) for k in range(size)]
        dtype = getattr(torch, self.cfg.ns_dtype)
        sizes = [t.numel() for t in pieces] + [0] * (size - len(round_))
        returned = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.all_to_all_single(returned, torch.cat(back) if back else torch.zeros(0, dtype=dtype, device=device),
                               output_split_sizes=sizes, input_split_sizes=[t.numel() for t in back] or [0] * size,
                               group=pg)
        return [chunk.view(t.shape) for t, chunk in zip(pieces, returned.split(sizes))]

    def apply(self, p, update: torch.Tensor, group: dict):
        """torch.optim.Muon's step on this rank's piece: decoupled weight decay, then the update at the
        lr adjusted to the whole matrix's shape."""
        rows, cols = p.shape[:2]
        ratio = math.sqrt(max(1, rows / cols)) if self.cfg.adjust_lr == "original" else 0.2 * math.sqrt(max(rows, cols))
        weight = local(p)
        weight.mul_(1 - group["lr"] * group["weight_decay"])
        weight.add_(update, alpha=-group["lr"] * ratio)


def in_flight(block) -> int:
    """Bytes a step holds beyond the weights, gradients and state, at most (fp32 Newton-Schulz; for
    pretrain/memory.py; block: a TransformerBlock): on its owner, one whole matrix (the largest)
    received, assembled, iterated (three matrix-sized and two Gram-sized tensors) and sent back, and
    this rank's pieces of the round's matrices."""
    big = max((q for q in block.parameters() if q.ndim == 2), key=lambda q: q.numel())
    return 4 * (7 * big.numel() + 2 * min(big.shape) ** 2)
