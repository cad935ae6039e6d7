"""The run's numeric precision, in one object: the compute dtype, how the forward pass gets it
(autocast, or FSDP's mixed-precision policy), and under fp16 the grad scaler with everything
that touches it (scaled backward, unscaling, the step, the overflow verdict EMA reads).

Master weights, optimizer state and gradient reduction stay in fp32 in every mode.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from dtrain.process import compat

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dtrain.process.layout import Layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Entered at every step where nothing is cast: one context that does nothing, made once (a
# nullcontext keeps no state).
_NO_AUTOCAST = contextlib.nullcontext()


class Precision:
    """`train.precision` for one run. Under FSDP the policy casts the sharded parameters
    (`fsdp_policy`) and the forward pass is not autocast as well; every other mode autocasts.
    fp16 adds a grad scaler, which under FSDP and a pipeline agrees over every rank (an inf in
    one rank's gradients skips the step on all)."""

    def __init__(
        self,
        name: str,
        device: torch.device,
        sharded: bool,
        loss_scale_init: float = 65536.0,
        agreed: bool = False,
    ) -> None:
        self.name = name
        self.dtype = DTYPES[name]
        self.device = device
        self.sharded = sharded
        # Where each rank holds some of the gradients (FSDP's shards, a pipeline's stages), what
        # the scaler found is reduced over every rank: an inf in one rank's skips the step on
        # all. (Not torch's ShardedGradScaler: its flag's shape is not the one a fused
        # optimizer's step takes.)
        self.agreed = sharded or agreed
        self.scaler: Any | None = None
        if name == "fp16":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=loss_scale_init)

    @classmethod
    def for_run(cls, name: str, loss_scale_init: float, layout: Layout) -> Precision:
        return cls(name, layout.device, layout.sharded, loss_scale_init, agreed=layout.pp > 1)

    @property
    def scaled(self) -> bool:
        """Whether a grad scaler decides the steps (fp16)."""
        return self.scaler is not None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's context: autocast to the compute dtype, or nothing (fp32; FSDP,
        whose policy casts instead)."""
        if self.dtype == torch.float32 or self.sharded:
            return _NO_AUTOCAST
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """fp32 master weights, computed in the run's dtype, gradients reduced in fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide the gradients by the scale in place, before they are checked or
        clipped (what the optimizer applies is then what is measured)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            if self.agreed:  # what the step reads, made every rank's: one skips, all skip
                import torch.distributed as torch_dist

                found = compat.scaler_found_inf(self.scaler, optimizer)
                if not found:
                    raise RuntimeError(
                        "this torch's grad scaler does not say what it found, which fp16 over "
                        "shards or stages needs; use bf16"
                    )
                for flag in found:
                    # (the largest: a fused optimizer skips a step where the flag is 1, not 2)
                    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """fp16: the optimizer step as the scaler decides (skipped on an overflow, which
        lowers the scale); returns whether it skipped, as a tensor on the device (None where
        the scaler does not say). Only for a scaled precision."""
        assert self.scaler is not None, "an unscaled step is the optimizer's own"
        self.scaler.step(optimizer)
        found = compat.scaler_found_inf(self.scaler, optimizer)  # before update() forgets it
        self.scaler.update()
        return torch.stack([f.reshape(()) for f in found]).sum() > 0 if found else None

    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def checkpoint_parts(self) -> dict[str, Any]:
        """What a checkpoint saves of it to continue exactly: the scaler's scale and counters
        (saved as 'scaler', as before)."""
        return {"scaler": self.scaler} if self.scaler is not None else {}
