"""The PyTorch side of jdp's benchmark (`jdp_vs_torch_ddp`, `jdp_vs_torch_compile`): trains jdp's GPT or Llama
with torch, eager or `--compile`d.

    python scripts/bench_torch.py --config tiny --nproc 2 --global-batch 32 --steps 10
    torchrun --nproc-per-node 8 scripts/bench_torch.py --config gpt2-small --global-batch 64 --dtype bfloat16

The model is jdp/models/gpt.py's GPT rebuilt in torch, layer for layer and parameter for parameter (pre-norm blocks,
bias-free projections, tanh GELU, tied float32 logits), or jdp/models/llama.py's Llama (`--arch llama`, the
config's model.arch), trained with AdamW + global-norm clipping like jdp's
step, under DistributedDataParallel (gloo on CPU, nccl on GPUs). Data is random tokens made before the clock
starts, so only the training step is timed. Rank 0 prints one line: `BENCH_JSON {...}` with tokens/s.
Run under torchrun (its environment variables) or with `--nproc N`, which spawns N local processes itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

MODEL_DIMS = ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio")
DEFAULTS = dict(vocab_size=320, max_seq_len=128, d_model=128, n_layers=4, n_heads=4, mlp_ratio=4)
DEFAULTS.update(seq_len=None, global_batch=32, dtype="float32", lr=1e-3, arch="gpt", n_kv_heads=0, d_ff=0)


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, mlp_ratio: int, residual_std: float):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, mlp_ratio * d, bias=False), nn.Linear(mlp_ratio * d, d, bias=False)
        for lin, std in ((self.qkv, 0.02), (self.out, residual_std), (self.up, 0.02), (self.down, residual_std)):
            nn.init.normal_(lin.weight, std=std)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = (t.view(B, L, self.n_heads, D // self.n_heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, L, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size, max_seq_len, d_model, n_layers, n_heads, mlp_ratio):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Parameter(torch.randn(max_seq_len, d_model) * 0.01)
        nn.init.normal_(self.embed.weight, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * n_layers)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio, residual_std) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model, eps=1e-5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        # Tied output; like jdp's embed.attend, the matmul runs in the compute dtype and the logits are float32.
        return (self.norm(x) @ self.embed.weight.T).float()


class Llama(nn.Module):
    """jdp/models/llama.py in torch: RMSNorm (float32), rotary positions (theta 10000), grouped-query attention
    through SDPA, SwiGLU of width d_ff, an untied output projection; the same parameter count."""

    def __init__(self, vocab_size, max_seq_len, d_model, n_layers, n_heads, n_kv_heads, d_ff):
        super().__init__()
        self.H, self.G, self.K = n_heads, n_kv_heads, d_model // n_heads
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(
                norm1=nn.RMSNorm(d_model, eps=1e-5), norm2=nn.RMSNorm(d_model, eps=1e-5),
                q=nn.Linear(d_model, n_heads * self.K, bias=False), k=nn.Linear(d_model, n_kv_heads * self.K, bias=False),
                v=nn.Linear(d_model, n_kv_heads * self.K, bias=False), o=nn.Linear(n_heads * self.K, d_model, bias=False),
                gate=nn.Linear(d_model, d_ff, bias=False), up=nn.Linear(d_model, d_ff, bias=False),
                down=nn.Linear(d_ff, d_model, bias=False),
            )) for _ in range(n_layers)
        )  # fmt: skip
        self.norm, self.head = nn.RMSNorm(d_model, eps=1e-5), nn.Linear(d_model, vocab_size, bias=False)
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.K, 2, dtype=torch.float32) / self.K)
        angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def rope(self, x: torch.Tensor) -> torch.Tensor:  # x: B, heads, L, K; pairs (i, i + K/2), as jdp and HF rotate
        L, half = x.shape[2], x.shape[-1] // 2
        cos, sin, a, b = self.cos[:L], self.sin[:L], x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, L = tokens.shape
        x = self.embed(tokens)
        for blk in self.blocks:
            h = blk["norm1"](x)
            q = self.rope(blk["q"](h).view(B, L, self.H, self.K).transpose(1, 2))
            k = self.rope(blk["k"](h).view(B, L, self.G, self.K).transpose(1, 2))
            v = blk["v"](h).view(B, L, self.G, self.K).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.G != self.H)
            x = x + blk["o"](y.transpose(1, 2).reshape(B, L, self.H * self.K))
            h = blk["norm2"](x)
            x = x + blk["down"](F.silu(blk["gate"](h)) * blk["up"](h))
        return self.head(self.norm(x)).float()


def build(args: argparse.Namespace) -> nn.Module:
    if args.arch == "llama":
        d_ff = args.d_ff or -(-8 * args.d_model // (3 * 64)) * 64  # jdp's (and Llama's) default width
        return Llama(args.vocab_size, args.max_seq_len, args.d_model, args.n_layers, args.n_heads,
                     args.n_kv_heads or args.n_heads, d_ff)  # fmt: skip
    return GPT(*(getattr(args, k) for k in MODEL_DIMS))


def make_step(model: nn.Module, ddp: nn.Module, tokens: torch.Tensor, args: argparse.Namespace):
    """step(i): one training step on tokens[i] (forward through `ddp`, the model as wrapped), AdamW as jdp's."""
    # jdp's decay mask: weight decay on matrices only, never on the embeddings or norms.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    phase = torch.profiler.record_function  # the phases, named for scripts/profile_step.py's split

    def step(i: int) -> torch.Tensor:
        with phase("forward"):
            with autocast:
                logits = ddp(tokens[i, :, :-1])
            # Every token weighs 1 and every rank holds as many, so the local mean + DDP's gradient average is the
            # global token-weighted mean.
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens[i, :, 1:].reshape(-1))
        with phase("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with phase("update"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return loss.detach()

    return step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="take model dims from configs/NAME.yaml (explicit flags win)")
    for name in MODEL_DIMS + ("seq_len", "n_kv_heads", "d_ff"):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    p.add_argument("--arch", choices=["gpt", "llama"], help="the model (default: the config's model.arch)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (DDP's graph breaks per bucket)")
    p.add_argument("--global-batch", type=int, help="sequences per step over all processes")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--lr", type=float)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cpu_count // world)")
    p.add_argument("--nproc", type=int, default=1, help="spawn this many local processes (without torchrun)")
    args = p.parse_args(argv)
    cfg = {}
    if args.config:
        path = (
            Path(args.config)
            if args.config.endswith(".yaml")
            else Path(__file__).parents[1] / "configs" / f"{args.config}.yaml"
        )
        raw = yaml.safe_load(path.read_text())
        m = raw.get("model", {})
        cfg = {k: m[k] for k in (*MODEL_DIMS, "n_kv_heads", "d_ff", "arch") if k in m}
        cfg.update(seq_len=raw.get("data", {}).get("seq_len"), dtype=m.get("dtype"), lr=raw.get("optim", {}).get("lr"))
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, cfg.get(key) or default)
    args.seq_len = args.seq_len or args.max_seq_len
    return args


def worker(rank: int, world: int, local_rank: int, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    assert args.global_batch % world == 0, f"--global-batch {args.global_batch} must divide by world {world}"
    local_batch, n_steps = args.global_batch // world, args.warmup + args.steps

    torch.manual_seed(0)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
    model = build(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[local_rank] if cuda else None) if world > 1 else model  # one: the plain loop
    if args.compile:
        ddp = torch.compile(ddp)
    gen = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, args.vocab_size, (n_steps, local_batch, args.seq_len + 1), generator=gen).to(device)
    step = make_step(model, ddp, tokens, args)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    losses = [step(i) for i in range(args.warmup)]
    sync()
    start = time.perf_counter()
    losses += [step(i) for i in range(args.warmup, n_steps)]
    sync()
    elapsed = time.perf_counter() - start

    ends = torch.stack([losses[0], losses[-1]]).float()
    dist.all_reduce(ends)  # mean loss over ranks, for the report only
    ends = (ends / world).tolist()
    if rank == 0:
        result = dict(
            tokens_per_sec=args.steps * args.global_batch * args.seq_len / elapsed,
            step_s=elapsed / args.steps,
            params=n_params,
            world=world,
            threads=threads,
            arch=args.arch,
            compiled=args.compile,
            loss_first=ends[0],
            loss_last=ends[1],
        )
        print(f"device={device.type} dtype={args.dtype} global_batch={args.global_batch} seq_len={args.seq_len}")
        print("BENCH_JSON " + json.dumps(result), flush=True)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


def spawned(local_rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(local_rank, world, local_rank, args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    if "WORLD_SIZE" in os.environ:  # torchrun (or bench.py) started us
        env = os.environ
        worker(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), args)
    elif args.nproc > 1:
        mp.spawn(spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc)
    else:
        spawned(0, 1, free_port(), args)


if __name__ == "__main__":
    main()
