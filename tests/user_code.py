"""Users' own models and datasets, loaded by the launcher through `module:function` import paths.

Tests use them to slow a run down, pause inside a save, or record which samples were served,
so that faults are injected from outside the product, as a user's code would cause them.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from dtrain import synthetic
from dtrain.data import ImageDataset
from dtrain.models import SimpleCNN


class SlowCNN(SimpleCNN):
    """SimpleCNN that sleeps in every training forward (to make a run long enough to kill), and
    whose state_dict() waits while the file named by $PAUSE_SAVE_FILE exists (a save in progress
    that a test can kill)."""

    def __init__(self, sleep_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sleep_s = sleep_s
        self.register_state_dict_post_hook(_pause_while_flagged)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.sleep_s:
            time.sleep(self.sleep_s)
        return super().forward(x)


def _pause_while_flagged(module, state_dict, prefix, local_metadata) -> None:
    flag = os.environ.get("PAUSE_SAVE_FILE")
    while flag and os.path.exists(flag):
        time.sleep(0.05)


def slow_cnn(cfg) -> nn.Module:
    args = dict(cfg.args)
    return SlowCNN(sleep_s=args.pop("sleep_s", 0.05), num_classes=10, in_channels=3, **args)


class ServedLog(torch.utils.data.Dataset):
    """Writes every index it serves to $SERVED_DIR/rank<RANK>.<pid>.txt."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        folder = os.environ["SERVED_DIR"]
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.{os.getpid()}.txt"), "a") as f:
            f.write(f"{index}\n")
        return self.dataset[index]


def served_synthetic(cfg):
    """The synthetic dataset, logging which training samples are served."""
    norm = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    train = ImageDataset(*synthetic.generate(cfg.synthetic.train_size, "train"), *norm)
    val = ImageDataset(*synthetic.generate(cfg.synthetic.val_size, "val"), *norm)
    served = ServedLog(train)
    served.num_classes = len(synthetic.CLASSES)
    served.sample_shape = (3, synthetic.IMAGE_SIZE, synthetic.IMAGE_SIZE)
    return served, val
