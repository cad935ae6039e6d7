"""The job every hand-written loop of the benchmarks trains (the plain loop and the peers'):
dtrain's built-in synthetic images with CIFAR-style augmentation, DistributedSampler's order, a
SimpleCNN built from the seed, SGD with momentum (fused) and no weight decay for biases and norm
weights. Only the training loop differs between them."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from dtrain.data import synthetic  # noqa: E402
from dtrain.data import ImageDataset, Transform  # noqa: E402
from dtrain.models import SimpleCNN  # noqa: E402


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
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
    parser.add_argument("--count-calls", metavar="FROM:TO",
                        help="count the Python calls per step over these steps (not timed)")
    return parser.parse_args()


def loader(args: argparse.Namespace, rank: int, world: int) -> tuple[DataLoader, DistributedSampler]:
    """uint8 images in DistributedSampler's order; `normalize` them before the model."""
    images, labels = synthetic.generate(args.train_size, "train")
    dataset = ImageDataset(images, labels, Transform("cifar", 32, not args.no_augment, args.seed))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    return DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True), sampler


MEAN = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1) * 255
INV_STD = 1.0 / (torch.tensor([0.25, 0.25, 0.25]).view(3, 1, 1) * 255)


def normalize(images: torch.Tensor) -> torch.Tensor:
    return images.float().sub_(MEAN).mul_(INV_STD)


def model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return SimpleCNN(num_classes=10, in_channels=3, width=args.width)


def optimizer(plain: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """As AdamW recipes do (and dtrain by default): no weight decay for biases and norm weights."""
    norms = [p for m in plain.modules() if isinstance(m, torch.nn.GroupNorm) for p in m.parameters()]
    biases = [p for n, p in plain.named_parameters() if n.endswith("bias")]
    exempt = [p for p in plain.parameters() if any(p is q for q in norms + biases)]
    decayed = [p for p in plain.parameters() if all(p is not q for q in exempt)]
    return torch.optim.SGD([{"params": decayed, "weight_decay": args.weight_decay},
                            {"params": exempt, "weight_decay": 0.0}],
                           lr=args.lr, momentum=args.momentum, fused=True)


def write_result(args: argparse.Namespace, plain: torch.nn.Module, **figures) -> None:
    """Rank 0: the final weights and the figures (losses, step ends, first step's end)."""
    os.makedirs(args.out, exist_ok=True)
    torch.save(plain.state_dict(), os.path.join(args.out, "weights.pt"))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(figures, f)


class CallCounter:
    """Python function calls (Python and C functions alike) made by the training thread between
    two steps' ends: how much code each framework runs per step besides the shared model, data
    and optimizer. A count, not a time: the same on a busy machine as on an idle one. Counting
    slows the steps it covers, so it runs only where asked (`--count-calls FROM:TO`), in a run of
    its own that is not timed."""

    def __init__(self, span: str | None) -> None:
        self.start, self.stop = (int(s) for s in span.split(":")) if span else (-1, -1)
        self.calls = 0

    def _count(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def step_ended(self, step: int) -> None:
        """Called at the end of step `step` (1-based): counting covers steps start+1 to stop."""
        if step == self.start:
            sys.setprofile(self._count)
        elif step == self.stop:
            sys.setprofile(None)

    def figures(self) -> dict:
        if self.start < 0:
            return {}
        return {"calls_per_step": self.calls / (self.stop - self.start)}


def finish() -> None:
    """End the process at once, as dtrain's own entry point does: torch's gloo threads can abort
    the interpreter's ordinary exit ("terminate called without an active exception", SIGABRT)
    after everything was written, which would read as a failed run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
