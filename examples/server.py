"""A small serving loop on several ranks (gloo), for arming a live engine with ``tracedump arm``.

Each rank holds the same tiny HF Llama (random weights from a fixed seed) and serves the same
stream of requests: one arrives every few steps, each step runs one forward of the batch of
requests in flight (padded to the longest), and the ranks meet in an ``all_reduce`` every step,
as tensor-parallel ranks do. Started with ``TRACEDUMP_DUMP_DIR`` and ``TRACEDUMP_DUMP_CONTROL=1``
it attaches disarmed and dumps only the steps an operator orders::

    TRACEDUMP_DUMP_DIR=/tmp/live TRACEDUMP_DUMP_CONTROL=1 python examples/server.py --steps 400 &
    tracedump arm /tmp/live --steps 3        # from another shell, any time
    tracedump ls /tmp/live                   # each rank: 3 passes, the order's history

Each rank writes the logits of every step to ``--out/rank<R>.pt``, so a run with tracedump off can
be compared bit for bit. ``--until FILE`` serves until FILE exists (at most ``--steps`` steps; the
ranks agree on the step they stop after), so a test arms and disarms a server that is certain to
be serving, however slow the machine. Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import ModelConfig, build_model

import tracedump


def request_stream(step: int) -> list[int] | None:
    """A new request every 4 steps: a short prompt drawn from the step number."""
    if step % 4:
        return None
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (3 + step % 5,), generator=generator).tolist()


def serve(rank: int, world: int, steps: int, out: Path, pause: float, until: Path | None = None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model(ModelConfig())
    dumper = tracedump.attach(model)
    running: list[list[int]] = []
    outputs = []
    with torch.no_grad():
        for step in range(steps):
            arrived = request_stream(step)
            if arrived is not None:
                running.append(arrived)
            running = [tokens for tokens in running if len(tokens) < 12]  # finished ones leave
            width = max(len(tokens) for tokens in running)
            batch = torch.tensor([[0] * (width - len(t)) + t for t in running])
            with dumper.step() if dumper else contextlib.nullcontext():
                logits = model(input_ids=batch).logits
            agreed = logits[:, -1].argmax(-1)
            dist.all_reduce(agreed.clone(), op=dist.ReduceOp.MAX)  # the ranks meet every step
            running = [[*tokens, int(t)] for tokens, t in zip(running, agreed, strict=True)]
            outputs.append(logits[:, -1].clone())
            if until is not None and _told_to_stop(until):
                break
            time.sleep(pause)
    if dumper is not None:
        dumper.close()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(outputs, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def _told_to_stop(until: Path) -> bool:
    """Whether any rank sees ``until``: every rank stops after the same step, or one would wait
    in the next ``all_reduce`` for ranks that left."""
    seen = torch.tensor([int(until.exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def _worker(
    rank: int, world: int, steps: int, out: str, pause: float, port: int, until: str | None = None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    serve(rank, world, steps, Path(out), pause, Path(until) if until else None)


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a request stream on several gloo ranks.")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between steps (traffic)")
    parser.add_argument("--out", default="server_out", help="where each rank saves its step logits")
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--until", default=None, help="stop once this file exists (at most --steps steps)")
    args = parser.parse_args()
    torch.multiprocessing.spawn(
        _worker,
        args=(args.ranks, args.steps, args.out, args.pause, args.port, args.until),
        nprocs=args.ranks,
    )


if __name__ == "__main__":
    main()
