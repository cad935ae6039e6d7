"""The benchmark job (bench/job.py) trained by a peer framework: Lightning's Trainer, Lightning
Fabric, or Hugging Face Accelerate, each used as its documentation shows, on the CPU with DDP
under torchrun. Every one gets the same data loader (DistributedSampler's order, no sampler
replaced), model, optimizer and seed as the plain loop, so that the first losses agree; writes
the same result.json as bench/plain_loop.py.

    torchrun --nproc_per_node=2 bench/peer_loops.py --framework fabric --steps 200 --out /tmp/x
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import job  # noqa: E402


class Clock:
    """Step ends and the first step's end, as the plain loop records them."""

    def __init__(self) -> None:
        self.step_ends: list[float] = []
        self.first_step_end = None
        self.losses: list[float] = []

    def step(self, loss: torch.Tensor, record_loss: bool) -> None:
        if record_loss:  # the first steps only (a read and an all-reduce): mean over ranks
            value = loss.detach().clone()
            dist.all_reduce(value)
            self.losses.append(value.item() / dist.get_world_size())
        self.step_ends.append(time.perf_counter())
        if self.first_step_end is None:
            self.first_step_end = time.time()


FIRST_LOSSES = 5


def batches(loader, sampler, steps: int):
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            yield job.normalize(x), y
            step += 1
            if step == steps:
                return
        epoch += 1


def fabric_loop(args) -> None:
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    fabric.launch()
    model = job.model(args)
    optimizer = job.optimizer(model, args)
    model, optimizer = fabric.setup(model, optimizer)
    loader, sampler = job.loader(args, fabric.global_rank, fabric.world_size)
    clock = Clock()
    for step, (x, y) in enumerate(batches(loader, sampler, args.steps)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        clock.step(loss, step < FIRST_LOSSES)
    if fabric.global_rank == 0:
        job.write_result(args, model.module, losses=clock.losses, step_ends=clock.step_ends,
                         first_step_end=clock.first_step_end)


def accelerate_loop(args) -> None:
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = job.model(args)
    optimizer = job.optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader, sampler = job.loader(args, accelerator.process_index, accelerator.num_processes)
    clock = Clock()
    for step, (x, y) in enumerate(batches(loader, sampler, args.steps)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        clock.step(loss, step < FIRST_LOSSES)
    if accelerator.is_main_process:
        job.write_result(args, accelerator.unwrap_model(model), losses=clock.losses,
                         step_ends=clock.step_ends, first_step_end=clock.first_step_end)


def trainer_loop(args) -> None:
    import lightning as L

    clock = Clock()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = job.model(args)

        def training_step(self, batch, index):
            x, y = batch
            return F.cross_entropy(self.net(job.normalize(x)), y)

        def on_train_batch_end(self, outputs, batch, index) -> None:
            clock.step(outputs["loss"], index < FIRST_LOSSES)

        def configure_optimizers(self):
            return job.optimizer(self.net, args)

    module = Module()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loader, _ = job.loader(args, rank, world)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        strategy="ddp", max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, loader)  # the sampler's epochs follow the trainer's (set_epoch)
    if trainer.global_rank == 0:
        job.write_result(args, module.net, losses=clock.losses, step_ends=clock.step_ends,
                         first_step_end=clock.first_step_end)


LOOPS = {"fabric": fabric_loop, "accelerate": accelerate_loop, "lightning": trainer_loop}


if __name__ == "__main__":
    framework = sys.argv.pop(sys.argv.index("--framework") + 1)
    sys.argv.remove("--framework")
    LOOPS[framework](job.arguments(__doc__.splitlines()[0]))
    if dist.is_initialized():
        dist.destroy_process_group()
