"""zbv-auto from measured costs against PyTorch's ScheduleZBVZeroBubble, on the same stages.

The stage model makes the weight gradient W much dearer than the input gradient I, where
PyTorch's fixed ZB-V order (built for F = I = W) can leave bubbles: each stage is
``x + tanh(x @ (A @ B @ C))`` with three DIM x DIM parameter matrices. F multiplies the chain
once, I is one small product with the saved chain, and W back-propagates through the chain
(several DIM^3 products), so W >> I at few rows per microbatch.

``--emulate F,I,W`` replaces that compute by waits of F, I and W milliseconds (a forward that
sleeps F, an input-gradient node that sleeps I, a weight-gradient node that sleeps W), as a
device's kernels would occupy it while the host idles: PyTorch's runtime, its I/W split, gloo
and the schedules run for real, but p ranks need no p cores. Use it where the host has fewer
cores than ranks (p = 4 on 2 cores).

Runs p gloo processes on this host (``--ranks``, default 2; 1 thread each: give it p cores,
unless ``--emulate``).
Each rank profiles its stages with graphpp.torch.profile, builds zbv-auto from the measured
costs, then times ROUNDS alternating steps of each schedule (a barrier before each; the step time is rank 0's wall clock) and prints
the medians, their ratio, and graphpp's predicted step time for zbv-auto and for PyTorch's order
(both simulated with the measured costs).

Usage: python python/bench/zbv_auto_vs_pytorch.py [--ranks 2] [--dim 512] [--rows 16] [--microbatches 8]
           [--rounds 10] [--mem-cap M_B] [--emulate F,I,W]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

import graphpp
import graphpp.torch as gt


class ChainLinear(nn.Module):
    """``x + tanh(x @ (A @ B @ C))``: a linear whose weight is a product of three matrices."""

    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.randn(dim, dim) / dim**0.5) for _ in range(3))

    def forward(self, x):
        return x + torch.tanh(x @ (self.a @ self.b @ self.c))


class Wait(torch.autograd.Function):
    """Identity that sleeps ``forward_ms`` in the forward and ``backward_ms`` in the backward."""

    @staticmethod
    def forward(ctx, x, forward_ms: float, backward_ms: float):
        ctx.backward_ms = backward_ms
        time.sleep(forward_ms / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_ms / 1e3)
        return grad, None, None


class EmulatedLinear(nn.Module):
    """``x * w`` whose input path waits F ms forward and I ms backward, and whose weight path
    waits W ms backward: PyTorch's ``stage_backward_input`` runs only the first wait and
    ``stage_backward_weight`` only the second, so the profiler measures F, I and W as given."""

    def __init__(self, dim: int, f_ms: float, i_ms: float, w_ms: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.ms = (f_ms, i_ms, w_ms)

    def forward(self, x):
        f_ms, i_ms, w_ms = self.ms
        return Wait.apply(x, f_ms, i_ms) * Wait.apply(self.w, 0.0, w_ms)


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def worker(rank: int, p: int, port: int, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=p)
    S, m = 2 * p, args.microbatches
    torch.manual_seed(0)
    mods = [EmulatedLinear(args.dim, *args.emulate) if args.emulate else ChainLinear(args.dim) for _ in range(S)]
    placed = [rank, S - 1 - rank]  # the V placement of ZB-V
    stages = [PipelineStage(mods[s], s, S, torch.device("cpu")) for s in placed]
    x = torch.randn(m * args.rows, args.dim)
    y = torch.randn(m * args.rows, args.dim)
    inputs = (x,) if 0 in placed else ()
    target = y if S - 1 in placed else None

    prof = gt.profile(stages, *inputs, target=target, loss_fn=loss_fn, n_microbatches=m, steps=3)
    ours = gt.schedule("zbv-auto", stages, m, loss_fn=loss_fn, costs=prof.costs, mem_cap=args.mem_cap)
    theirs = ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
    times = {"graphpp zbv-auto": [], "PyTorch ScheduleZBVZeroBubble": []}
    for i in range(args.rounds + 1):
        for name, sched in times.items():
            runtime = ours if name.startswith("graphpp") else theirs
            dist.barrier()
            t0 = time.perf_counter()
            runtime.step(*inputs, target=target)
            dist.barrier()
            if i > 0:  # the first round is a warm-up
                sched.append(time.perf_counter() - t0)
            for st in stages:
                st.submod.zero_grad(set_to_none=True)
    if rank == 0:
        c = prof.costs
        print(f"measured costs per action (ms): F={c.F:.3f} I={c.I:.3f} W={c.W:.3f} C={c.C:.3f}  (W/I = {c.W / c.I:.1f})")
        pytorch_order = gt.as_schedule(theirs.pipeline_order)
        predicted = {
            "graphpp zbv-auto": graphpp.simulate(ours.graphpp_schedule, costs=c, chunk_factor=1.0).makespan,
            "PyTorch ScheduleZBVZeroBubble": graphpp.simulate(pytorch_order, costs=c, chunk_factor=1.0).makespan,
        }
        peak = {
            "graphpp zbv-auto": graphpp.simulate(ours.graphpp_schedule).peak_activations,
            "PyTorch ScheduleZBVZeroBubble": graphpp.simulate(pytorch_order).peak_activations,
        }
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        for k in times:
            print(f"{k:32s} median {med[k]:8.2f} ms over {args.rounds} steps; graphpp predicts {predicted[k]:8.2f} ms "
                  f"({(predicted[k] - med[k]) / med[k]:+.1%}); peak activations per rank {peak[k]} M_B")
        ratio = med["graphpp zbv-auto"] / med["PyTorch ScheduleZBVZeroBubble"]
        print(f"zbv-auto / ScheduleZBVZeroBubble step time: {ratio:.3f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mem-cap", type=float, default=None,
                    help="zbv-auto's activation cap per rank in M_B units (default p: ZB-V's own peak)")
    ap.add_argument("--emulate", type=lambda t: tuple(float(x) for x in t.split(",")), default=None,
                    metavar="F,I,W", help="replace the stage's compute by waits of F, I and W ms (see above)")
    args = ap.parse_args()
    if args.emulate is not None and len(args.emulate) != 3:
        ap.error("--emulate takes three durations in ms: F,I,W")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if os.cpu_count() < args.ranks and not args.emulate:
        print(f"warning: {args.ranks} ranks on {os.cpu_count()} cores: the ranks share cores, the times are not a pipeline's")
    mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    sys.exit(main())
