"""Run under torchrun with 2 ranks: builds each model of the test the way an FSDP run does (each
rank only its own rows, sharded on the meta device, then materialised) and compares the gathered
weights with the same model built whole in one process. Prints one JSON line per model."""

import json
import sys

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dtrain import config, models, parallel
from dtrain.parallel import sharded_init
from dtrain.parallel.precision import Precision
from dtrain.process import dist, env, layout
from dtrain.run.pieces import layout_of

# Every tensor above 4 KiB is "large" here, so that even these small models are built row by row.
sharded_init.FULL_BYTES = 4096

IMAGES = {"num_classes": 10, "in_channels": 3, "image_size": 32}
CASES = [
    ("simple_cnn", "{width: 16}", IMAGES),
    ("resnet_small", "{width: 16}", IMAGES),
    ("transformer", "{dim: 64, depth: 2, heads: 2}", IMAGES),
    ("gpt", "{dim: 64, depth: 2, heads: 2, seq_len: 32}", {"vocab_size": 256, "seq_len": 32}),
    ("tv:resnet18", "{}", IMAGES),
    ("user_tasks:init_weights_net", "{width: 96}", IMAGES),
    ("user_tasks:orthogonal_net", "{width: 96}", IMAGES),
]


def _layout(cfg: config.Config, launch: env.Env) -> layout.Layout:
    return layout_of(cfg, launch)


def main() -> None:
    launch = env.detect()
    cfg = config.load(None, ["parallel.mode=fsdp"])
    dist.init(_layout(cfg, launch), cfg.dist)
    for name, args, info in CASES:
        cfg = config.load(None, [f"model.name={name}", f"model.args={args}", "parallel.mode=fsdp"])
        resolved = _layout(cfg, launch)
        precision = Precision.for_run(cfg.train.precision, cfg.train.loss_scale_init, resolved)
        strategy = parallel.strategy(cfg.parallel, resolved)
        wrapped, count, notes = strategy.build(cfg.model, info, cfg.run.seed, precision)
        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
        if dist.is_main():
            eager = models.build(cfg.model, info, cfg.run.seed).state_dict()
            differ = [k for k in eager if not torch.equal(eager[k], full[k])]
            print(json.dumps({"model": name, "tensors": len(eager), "differ": differ,
                              "notes": notes, "params": count}), flush=True)
    torch_dist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    sys.exit(main())
