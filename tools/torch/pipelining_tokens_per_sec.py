#!/usr/bin/env python3
"""PyTorch reference for `graphpp train` throughput: training tokens/s of graphpp's `tiny` (or,
with --model small, `small`: D=256, 8 layers, 8 heads, SwiGLU inner 688) model under
torch.distributed.pipelining on this CPU.

What it measures: two processes (ranks) joined by a gloo process group, each limited to
`--threads` intra-op threads, train graphpp's `tiny` Llama-style decoder (V=256 byte tokens,
D=64, 4 layers, 4 heads without grouped key/value heads, SwiGLU inner 176, RMSNorm eps 1e-5,
rotate-half RoPE theta 10000, causal attention, untied LM head, no biases; the same math as
`forward` in llama_fixture.py, in f32) split into 2 pipeline stages of 2 layers each:
  stage 0 = embedding + layers 0-1, stage 1 = layers 2-3 + final norm + LM head,
with loss = mean cross-entropy over a microbatch's tokens (the schedule's default
scale_grads=True divides the summed microbatch gradients by m, so the gradient is that of the
mean over the whole batch). One training step is
  schedule.step(...)  (m microbatches of B windows of T tokens; 1F1B by default)
  clip to global L2 norm --clip (1.0) over both ranks' gradients (clip_global: one all_reduce)
  AdamW(lr, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1 on every parameter).step(); zero_grad()
at a constant learning rate. Parameters start as in graphpp (normal(0, 0.02) matrices, norm
weights 1), from torch seed 0. Each step draws m*B windows of T+1 tokens at random positions
(torch generator seeded with --seed, identical on both ranks) from the bytes of --data (a UTF-8
file, or every file under a folder in sorted path order joined by a newline), else from 1 MiB
of random bytes (loss then stays near ln 256 = 5.545).

After --warmup untimed steps, rank 0 times --steps steps with time.perf_counter between two
barriers and prints
  torch pipelining 1F1B p=2 m=8 B=8 T=64 threads=1: X tokens/s (Y s/step), loss first->last
where tokens per step = m*B*T and the losses are the batch mean loss of the first and last
timed step.

The ranks run with OMP_WAIT_POLICY=PASSIVE unless the caller sets it: with --threads 2 on this
2-core machine the default spin-waiting OpenMP threads of the two ranks starve each other (and the
gloo receives), about 14x slower per step. It makes no difference at --threads 1.

--schedule also takes GPipe (2 stages), Interleaved1F1B (4 one-layer stages, rank r holds
stages r and r+2) and ZBVZeroBubble (4 one-layer stages in a V: rank 0 holds stages 0 and 3,
rank 1 holds 1 and 2); for 4 stages the embedding joins stage 0 and the final norm + LM head
join stage 3.

Usage:
  python tools/torch/pipelining_tokens_per_sec.py \
      [--microbatches 8] [--microbatch-size 8] [--seq-len 64] [--steps 30] [--warmup 5] \
      [--lr 3e-3] [--clip 1.0] [--threads 1] [--dtype f32|bf16] [--data PATH] [--schedule 1F1B]
  python tools/torch/pipelining_tokens_per_sec.py --check
--check runs no pipeline: it compares the stage modules, chained, with llama_fixture.forward
(float64) in loss and every gradient, for the 2- and 4-stage splits, and exits non-zero if they
differ.
"""
import argparse
import math
import os
import socket
import sys
import time
import warnings

# This venv has no numpy; torch warns about it at import (in every spawned rank). Not needed here.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_fixture  # noqa: E402
from llama_fixture import rms_norm, rope_tables, rotate_half  # noqa: E402

# graphpp's `tiny` and `small` presets (crates/graphpp-models/src/config.rs, LlamaConfig::tiny,
# LlamaConfig::small).
TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
    "num_attention_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
SMALL = dict(TINY, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8)
MODELS = {"tiny": TINY, "small": SMALL}
WORLD = 2
# schedule name -> (class, stages per rank, placement "loop" (rank r: r, r+p, ...) or "v")
SCHEDULES = {
    "1F1B": (Schedule1F1B, 1, "loop"),
    "GPipe": (ScheduleGPipe, 1, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2, "v"),
}


class RMSNorm(nn.Module):
    """RMSNorm over the last dim [.., D] with a learned [D] weight (init 1)."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + SwiGLU(norm(x)); [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg):
        super().__init__()
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads = cfg["num_attention_heads"]
        self.input_layernorm = RMSNorm(d, cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(d, cfg["rms_norm_eps"])
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin, causal):
        b, t, d = x.shape
        h = self.heads
        hd = d // h
        hs = self.input_layernorm(x)
        q, k, v = (p(hs).view(b, t, h, hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        s = s.masked_fill(causal, float("-inf"))
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(o)
        hs = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(hs)) * self.up_proj(hs))


class StageModule(nn.Module):
    """One pipeline stage: optional embedding ([B, T] int64 -> [B, T, D]), some decoder layers,
    optional final norm + LM head ([B, T, D] -> [B, T, V] logits)."""

    def __init__(self, cfg, layers, first, last, seq_len):
        super().__init__()
        d, v = cfg["hidden_size"], cfg["vocab_size"]
        self.embed_tokens = nn.Embedding(v, d) if first else None
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(d, cfg["rms_norm_eps"]) if last else None
        self.lm_head = nn.Linear(d, v, bias=False) if last else None
        cos, sin = rope_tables(seq_len, d // cfg["num_attention_heads"], cfg["rope_theta"])
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)
        causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    # --dtype bf16: the forward under bf16 autocast (f32 master weights, bf16 matmuls), as
    # PyTorch AMP users train; the logits leave the last stage in f32.
    bf16 = False

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            if self.embed_tokens is not None:
                x = self.embed_tokens(x)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin, self.causal)
            if self.lm_head is not None:
                x = self.lm_head(self.norm(x)).float()
        return x


def build_stages(cfg, n_stages, seq_len):
    """All n_stages stage modules of the full model, initialised like graphpp (seed 0)."""
    torch.manual_seed(0)
    n_layers = cfg["num_hidden_layers"]
    per = n_layers // n_stages
    stages = []
    for s in range(n_stages):
        layers = [DecoderLayer(cfg) for _ in range(per)]
        stages.append(StageModule(cfg, layers, s == 0, s == n_stages - 1, seq_len))
    for m in stages:
        for name, p in m.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    return stages


def stage_ids(rank, per_rank, placement):
    """Global stage indices held by `rank` (p = WORLD ranks)."""
    if per_rank == 1:
        return [rank]
    if placement == "v":
        return [rank, 2 * WORLD - 1 - rank]
    return [rank + i * WORLD for i in range(per_rank)]


def stage_meta(a, boundary, n_stages):
    """Static microbatch shape at a stage boundary (0: tokens [B, T] int64; n_stages: logits
    [B, T, V]; between: hidden [B, T, D] f32), so the stages skip the runtime shape exchange
    (which in 2.15 pickles through numpy, absent from this venv). Float boundaries must say
    requires_grad=True: static mode derives the gradient buffers from it, and a False one
    silently makes the gradient sent back None."""
    b, t, cfg = a.microbatch_size, a.seq_len, MODELS[a.model]
    if boundary == 0:
        return torch.empty(b, t, dtype=torch.long, device="meta")
    if boundary == n_stages:
        return torch.empty(b, t, cfg["vocab_size"], device="meta", requires_grad=True)
    return torch.empty(b, t, cfg["hidden_size"], device="meta", requires_grad=True)


def read_corpus(path):
    """Bytes of a UTF-8 file, or of every file under a folder (sorted, joined by a newline)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
    else:
        files = [path]
    texts = []
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read()
        raw.decode("utf-8")  # raises UnicodeDecodeError naming the offset
        texts.append(raw)
    data = b"\n".join(texts)
    if not data:
        raise SystemExit(f"--data {path}: no bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def clip_global(params, max_norm):
    """clip_grad_norm_ over the parameters of both ranks: the local L2 norms are combined by an
    all_reduce of their squares (one scalar per step), then every gradient is scaled by
    min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ on the whole model would."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.nn.utils.get_total_norm(grads, 2.0) ** 2
    dist.all_reduce(sq)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())


def hf_params(stages):
    """The stage modules' parameters under llama_fixture's Hugging Face names."""
    per = len(stages[0].layers)
    out = {}
    for s, m in enumerate(stages):
        for name, p in m.named_parameters():
            if name.startswith("layers."):
                _, j, rest = name.split(".", 2)
                sub = "self_attn." if rest[0] in "qkvo" else "mlp." if "proj" in rest else ""
                name = f"layers.{s * per + int(j)}.{sub}{rest}"
            out[name if name == "lm_head.weight" else f"model.{name}"] = p
    return out


def check_against_fixture(model):
    """The stage modules of `model` chained (f32) equal llama_fixture.forward (f64) in loss and
    every gradient, for the 2- and 4-stage splits; exits non-zero otherwise."""
    base = MODELS[model]
    cfg = dict(base, num_key_value_heads=base["num_attention_heads"])
    for n_stages in (2, 4):
        stages = build_stages(base, n_stages, 16)
        with torch.no_grad():  # perturb norms so they matter
            for m in stages:
                for name, p in m.named_parameters():
                    if p.dim() == 1:
                        p.add_(0.1 * torch.randn_like(p))
        x = torch.randint(0, 256, (3, 16))
        y = torch.randint(0, 256, (3, 16))
        h = x
        for m in stages:
            h = m(h)
        loss = loss_fn(h, y)
        named = hf_params(stages)
        grads = torch.autograd.grad(loss, list(named.values()))
        ref_p = {k: v.detach().double().requires_grad_(True) for k, v in named.items()}
        ref = llama_fixture.forward(ref_p, cfg, x, y)
        ref_g = torch.autograd.grad(ref, list(ref_p.values()))
        worst = max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_g))
        print(f"check {n_stages} stages: loss {loss.item():.6f} vs fixture {ref.item():.6f}, "
              f"max |grad diff| {worst:.2e}")
        if abs(loss.item() - ref.item()) > 1e-5 or worst > 1e-5:
            raise SystemExit("check failed: stage modules differ from llama_fixture.forward")


def loss_fn(logits, target):
    """Mean cross-entropy over a microbatch's tokens; logits [B, T, V], target [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def worker(rank, a, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(a.threads)
    cls, per_rank, placement = SCHEDULES[a.schedule]
    n_stages = WORLD * per_rank
    all_stages = build_stages(MODELS[a.model], n_stages, a.seq_len)
    for m in all_stages:
        m.bf16 = a.dtype == "bf16"
    mine = stage_ids(rank, per_rank, placement)
    modules = [all_stages[i] for i in mine]
    pstages = [PipelineStage(m, i, n_stages, torch.device("cpu"),
                             input_args=stage_meta(a, i, 0), output_args=stage_meta(a, i + 1, n_stages))
               for m, i in zip(modules, mine)]
    if per_rank == 1:
        sched = cls(pstages[0], n_microbatches=a.microbatches, loss_fn=loss_fn)
    else:
        sched = cls(pstages, n_microbatches=a.microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    has_first, has_last = 0 in mine, n_stages - 1 in mine

    tokens = read_corpus(a.data) if a.data else torch.randint(
        0, 256, (1 << 20,), generator=torch.Generator().manual_seed(1))
    n = a.microbatches * a.microbatch_size
    if tokens.numel() < a.seq_len + 1:
        raise SystemExit(f"--data has {tokens.numel()} bytes, fewer than seq_len+1")
    gen = torch.Generator().manual_seed(a.seed)
    offs = torch.arange(a.seq_len + 1)

    def step():
        starts = torch.randint(0, tokens.numel() - a.seq_len, (n,), generator=gen)
        win = tokens[starts[:, None] + offs]
        x, y = win[:, :-1].contiguous(), win[:, 1:].contiguous()
        losses = []
        args = (x,) if has_first else ()
        kw = {"target": y, "losses": losses} if has_last else {}
        sched.step(*args, **kw)
        clip_global(params, a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item() if has_last else 0.0

    for _ in range(a.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    losses = [step() for _ in range(a.steps)]
    dist.barrier()
    dt = time.perf_counter() - t0
    fl = torch.tensor([losses[0], losses[-1]], dtype=torch.float64)
    dist.all_reduce(fl)  # only the rank holding the last stage contributes non-zero losses
    if rank == 0:
        tok = a.microbatches * a.microbatch_size * a.seq_len
        print(f"torch pipelining {a.model} {a.schedule} p={WORLD} m={a.microbatches} B={a.microbatch_size} "
              f"T={a.seq_len} threads={a.threads} {a.dtype}: {tok * a.steps / dt:.0f} tokens/s "
              f"({dt / a.steps:.4f} s/step), loss {fl[0]:.4f}->{fl[1]:.4f}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max_norm (per rank)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bf16: the stages' forward under bf16 autocast (f32 weights and optimizer)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the window sampler")
    ap.add_argument("--data", default=None, help="UTF-8 text file or folder; default random bytes")
    ap.add_argument("--schedule", default="1F1B", choices=sorted(SCHEDULES))
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS),
                    help="graphpp's preset (`graphpp train --model`)")
    ap.add_argument("--check", action="store_true",
                    help="only compare the stage modules with llama_fixture.forward, then exit")
    a = ap.parse_args()
    if a.check:
        return check_against_fixture(a.model)
    for name in ("microbatches", "microbatch_size", "seq_len", "steps", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        ap.error("--warmup must be >= 0")
    if a.microbatches < WORLD:
        ap.error(f"--microbatches must be >= {WORLD} (the number of ranks)")
    if a.data and not os.path.exists(a.data):
        ap.error(f"--data {a.data}: no such file or folder")
    # Two ranks x K OpenMP threads spin-waiting on 2 busy cores ran 14x slower (threads=2:
    # 4.7 s/step active vs 0.29 passive); an explicit OMP_WAIT_POLICY in the caller's env wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    mp.spawn(worker, args=(a, free_port()), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
