"""A user's model that says where each rank runs, for the multi-node tests: the host it runs on,
the rendezvous address it was given and which dtrain it imported, printed once per rank when the
model is built (after the process group exists). Otherwise it is user_code.slow_cnn: the same
weights, the same steps."""

from __future__ import annotations

import os
import socket

from torch import nn

from user_code import slow_cnn

LINE = ("multinode_code: rank {rank} of {world} on host {host} ({address}), MASTER_ADDR={addr} "
        "MASTER_PORT={port} dtrain={package}")


def located_cnn(cfg) -> nn.Module:
    import torch.distributed as dist

    import dtrain

    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "unresolved"
    initialized = dist.is_initialized()
    print(LINE.format(rank=dist.get_rank() if initialized else 0,
                      world=dist.get_world_size() if initialized else 1, host=host,
                      address=address, addr=os.environ.get("MASTER_ADDR"),
                      port=os.environ.get("MASTER_PORT"),
                      package=os.path.dirname(dtrain.__file__)), flush=True)
    return slow_cnn(cfg)
