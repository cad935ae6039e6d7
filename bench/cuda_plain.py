"""The plain loop of bench/cuda_check.py: configs/default.yaml's job (SimpleCNN of width 16 on the
built-in synthetic images with CIFAR augmentation, batch 64, SGD with momentum, fused) written by
hand on one GPU, with channels_last and bf16 autocast, the same loader settings as the dtrain run
it is compared with. Prints one JSON line: images/s over the steps after the warm-up.
`--compile`: the model through torch.compile, beside dtrain's model.compile=true. `--device cpu`:
the same loop on the CPU, to try the script without a GPU (its rate means nothing).

    python bench/cuda_plain.py --steps 400 --workers 4 [--compile] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dtrain.data import synthetic  # noqa: E402
from dtrain.data import ImageDataset, Transform  # noqa: E402
from dtrain.models import SimpleCNN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    images, labels = synthetic.generate(20_000, "train")
    dataset = ImageDataset(images, labels, Transform("cifar", 32, True, 0))
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                        num_workers=args.workers, pin_memory=cuda,
                        persistent_workers=args.workers > 0)
    model = SimpleCNN(num_classes=10, in_channels=3, width=16).to(device)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4,
                                fused=cuda)
    forward = torch.compile(model) if args.compile else model
    mean = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1) * 255
    inv_std = 1.0 / (torch.tensor([0.25, 0.25, 0.25], device=device).view(1, 3, 1, 1) * 255)

    step, started = 0, 0.0
    while step < args.steps:
        for x, y in loader:
            x = x.to(device, non_blocking=True).float().sub_(mean).mul_(inv_std)
            x = x.contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(forward(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.warmup:
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
            if step == args.steps:
                break
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    print(json.dumps({"images_per_s": (args.steps - args.warmup) * args.batch / elapsed,
                      "last_loss": float(loss)}))


if __name__ == "__main__":
    main()
