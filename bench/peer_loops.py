"""The benchmark job (bench/job.py) trained by a peer framework: Lightning's Trainer, Lightning
Fabric, or Hugging Face Accelerate, each used as its documentation shows, on the CPU with DDP
under torchrun. Every one gets the same data loader (DistributedSampler's order, no sampler
replaced), model, optimizer and seed as the plain loop, so that the first losses agree; writes
the same result.json as bench/plain_loop.py.

`--framework dtrain` trains the same job with dtrain itself (its own config keys for it), with the
same clock on its `step_end` hook, so that all of them are timed alike: the wall clock
(`step_ends`, perf_counter), this process's CPU time (`cpu_ends`, process_time: all its threads,
gloo's included) and the training thread's (`thread_ends`, thread_time) at every step's end.
Only the first steps' losses are read (an all-reduce each): the timed steps do no more than the
training itself.

    torchrun --nproc_per_node=2 bench/peer_loops.py --framework fabric --steps 200 --out /tmp/x
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import job  # noqa: E402


class Clock:
    """Step ends (wall and this process's CPU time) and the first step's end, as the plain loop
    records them."""

    def __init__(self, args) -> None:
        self.counter = job.CallCounter(args.count_calls)
        self.step_ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.thread_ends: list[float] = []
        self.first_step_end = None
        self.losses: list[float] = []

    def step(self, loss: torch.Tensor, record_loss: bool) -> None:
        if record_loss:  # the first steps only (a read and an all-reduce): mean over ranks
            value = loss.detach().clone()
            dist.all_reduce(value)
            self.losses.append(value.item() / dist.get_world_size())
        self.end()

    def end(self) -> None:
        self.step_ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.thread_ends.append(time.thread_time())
        if self.first_step_end is None:
            self.first_step_end = time.time()
        self.counter.step_ended(len(self.step_ends))

    def figures(self) -> dict:
        return {"losses": self.losses, "step_ends": self.step_ends, "cpu_ends": self.cpu_ends,
                "thread_ends": self.thread_ends, "first_step_end": self.first_step_end,
                **self.counter.figures()}


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
    clock = Clock(args)
    for step, (x, y) in enumerate(batches(loader, sampler, args.steps)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        clock.step(loss, step < FIRST_LOSSES)
    if fabric.global_rank == 0:
        job.write_result(args, model.module, **clock.figures())


def accelerate_loop(args) -> None:
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = job.model(args)
    optimizer = job.optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader, sampler = job.loader(args, accelerator.process_index, accelerator.num_processes)
    clock = Clock(args)
    for step, (x, y) in enumerate(batches(loader, sampler, args.steps)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        clock.step(loss, step < FIRST_LOSSES)
    if accelerator.is_main_process:
        job.write_result(args, accelerator.unwrap_model(model), **clock.figures())


def trainer_loop(args) -> None:
    import lightning as L

    clock = Clock(args)

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
        job.write_result(args, module.net, **clock.figures())


def dtrain_loop(args) -> None:
    """The job as a dtrain config: its records and checks only where the job's last step ends
    (train.log_every and train.check_every_steps at the run's length), so that no step in
    between reads the device or meets the other ranks, as in the other loops' timed steps."""
    from dtrain import cli
    from dtrain.loop import trainer

    clock = Clock(args)
    fit = trainer.Trainer.fit

    def timed_fit(self) -> str:
        self.callbacks.step_end.append(clock.end)  # after each optimizer step and its bookkeeping
        return fit(self)

    trainer.Trainer.fit = timed_fit
    code = cli.main(["train", f"run.out_dir={args.out}", "run.name=run", "model.name=simple_cnn",
                     f"model.args={{width: {args.width}}}", "data.name=synthetic",
                     f"data.synthetic.train_size={args.train_size}", "data.synthetic.val_size=64",
                     f"data.batch_size={args.batch}",
                     "data.num_workers=0", f"run.seed={args.seed}", f"optim.lr={args.lr}",
                     f"optim.momentum={args.momentum}", f"optim.weight_decay={args.weight_decay}",
                     "sched.name=none", "train.epochs=1", f"train.max_steps={args.steps}",
                     f"train.log_every={args.steps}", f"train.check_every_steps={args.steps}",
                     "train.eval_every_epochs=0", "ckpt.every_epochs=0", "log.progress=lines",
                     "log.every_s=100000"])
    if code == 0 and int(os.environ.get("RANK", "0")) == 0:
        run_dir = Path(args.out) / "run"
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        weights = torch.load(run_dir / "checkpoints" / latest / "checkpoint.pt",
                             weights_only=True)["model"]
        os.makedirs(args.out, exist_ok=True)
        torch.save(weights, os.path.join(args.out, "weights.pt"))
        figures = clock.figures()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        figures["losses"] = [r["loss"] for r in records if "loss" in r and "val_loss" not in r]
        (Path(args.out) / "result.json").write_text(json.dumps(figures))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as dtrain's own entry point ends (cli.entry), and job.finish


LOOPS = {"fabric": fabric_loop, "accelerate": accelerate_loop, "lightning": trainer_loop,
         "dtrain": dtrain_loop}


if __name__ == "__main__":
    framework = sys.argv.pop(sys.argv.index("--framework") + 1)
    sys.argv.remove("--framework")
    LOOPS[framework](job.arguments(__doc__.splitlines()[0]))
    job.finish()
