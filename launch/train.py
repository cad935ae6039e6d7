"""Entry point for torchrun, srun and plain python:

    torchrun --nproc_per_node=N launch/train.py --config configs/X.yaml [section.key=value ...]
    python launch/train.py --config configs/X.yaml [section.key=value ...]
"""

import os
import sys

try:
    import dtrain  # noqa: F401
except ImportError:  # a checkout that was not pip-installed: use its src/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from dtrain.cli import entry  # noqa: E402

if __name__ == "__main__":
    entry(["train", *sys.argv[1:]])
