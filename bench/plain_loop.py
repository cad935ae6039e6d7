"""A plain, hand-written PyTorch training loop: the reference dtrain is compared with.

It uses the same data and model code as dtrain's defaults but nothing of dtrain's loop: its own
DistributedSampler, DataLoader, DDP wrapper, SGD and cross-entropy. Run it alone or under
torchrun; it writes the per-step losses (mean over ranks), step times and final weights, and for
the benchmarks the clock at each step's end (`step_ends`, perf_counter: steady-state time per step
including data loading), the process's and the training thread's CPU time there (`cpu_ends`,
process_time; `thread_ends`, thread_time) and the wall-clock time the first step ended
(`first_step_end`, time.time: start-up as seen by whoever launched it); with `--count-calls
FROM:TO`, the Python calls per step over those steps instead of a timed run (job.CallCounter). `--loss-steps K` reads
the loss (an all-reduce and a wait) on the first K steps only, as the peers' loops do, so that
the steps after them do nothing but train.

    python bench/plain_loop.py --steps 20 --out /tmp/plain
    torchrun --nproc_per_node=2 bench/plain_loop.py --steps 20 --out /tmp/plain
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import job  # noqa: E402


def main() -> None:
    loss_steps = None
    if "--loss-steps" in sys.argv:
        loss_steps = int(sys.argv.pop(sys.argv.index("--loss-steps") + 1))
        sys.argv.remove("--loss-steps")
    args = job.arguments(__doc__.splitlines()[0])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    loader, sampler = job.loader(args, rank, world)
    model = job.model(args)
    if distributed:
        model = DistributedDataParallel(model)
    plain = model.module if distributed else model
    optimizer = job.optimizer(plain, args)

    losses, step_times, step_ends, cpu_ends, thread_ends = [], [], [], [], []
    counter = job.CallCounter(args.count_calls)
    step, epoch = 0, 0
    first_step_end = None
    while step < args.steps:
        sampler.set_epoch(epoch)
        model.train()  # once an epoch, as training loops do (a walk over every module)
        for x, y in loader:
            started = time.perf_counter()
            x = job.normalize(x)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if loss_steps is None or step < loss_steps:
                value = loss.detach().clone()
                if distributed:
                    dist.all_reduce(value)
                losses.append(value.item() / world)
            step_times.append(time.perf_counter() - started)
            step_ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            thread_ends.append(time.thread_time())
            if first_step_end is None:
                first_step_end = time.time()
            step += 1
            counter.step_ended(step)
            if step == args.steps:
                break
        epoch += 1

    if rank == 0:
        job.write_result(args, plain, losses=losses, step_times=step_times, step_ends=step_ends,
                         cpu_ends=cpu_ends, thread_ends=thread_ends,
                         first_step_end=first_step_end, **counter.figures())
    job.finish()


if __name__ == "__main__":
    main()
