"""launch/train.py with oneDNN (mkldnn) off: convolutions run on PyTorch's own CPU kernels, which
sum in another order (bench/headline.py --kernels "oneDNN off").

    torchrun --nproc_per_node=2 bench/kernels_off.py launch/train.py --config ...
"""

import runpy
import sys

import torch

if __name__ == "__main__":
    torch.backends.mkldnn.enabled = False
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
