"""A plain, hand-written PyTorch training loop: the reference dtrain is compared with.

It uses the same data and model code as dtrain's defaults but nothing of dtrain's loop: its own
DistributedSampler, DataLoader, DDP wrapper, SGD and cross-entropy. Run it alone or under
torchrun; it writes the per-step losses (mean over ranks), step times and final weights, and for
the benchmarks the clock at each step's end (`step_ends`, perf_counter: steady-state time per step
including data loading) and the wall-clock time the first step ended (`first_step_end`, time.time:
start-up as seen by whoever launched it).

    python bench/plain_loop.py --steps 20 --out /tmp/plain
    torchrun --nproc_per_node=2 bench/plain_loop.py --steps 20 --out /tmp/plain
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from dtrain import synthetic  # noqa: E402
from dtrain.data import ImageDataset  # noqa: E402
from dtrain.models import SimpleCNN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--no-augment", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    images, labels = synthetic.generate(args.train_size, "train")
    dataset = ImageDataset(images, labels, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25),
                           augment_seed=None if args.no_augment else args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = SimpleCNN(num_classes=10, in_channels=3, width=args.width)
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    losses, step_times, step_ends, step, epoch = [], [], [], 0, 0
    first_step_end = None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            started = time.perf_counter()
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            value = loss.detach().clone()
            if distributed:
                dist.all_reduce(value)
            losses.append(value.item() / world)
            step_times.append(time.perf_counter() - started)
            step_ends.append(time.perf_counter())
            if first_step_end is None:
                first_step_end = time.time()
            step += 1
            if step == args.steps:
                break
        epoch += 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        plain = model.module if distributed else model
        torch.save(plain.state_dict(), os.path.join(args.out, "weights.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "step_times": step_times, "step_ends": step_ends,
                       "first_step_end": first_step_end}, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
