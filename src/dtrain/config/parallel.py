"""The `parallel` section of the config: how the model is spread over the ranks (DDP, FSDP and
their options, tensor parallelism inside them) and over replica groups (torchft)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.config.fields import AT_LEAST_ONE, DURATION, NON_NEGATIVE, POSITIVE, option


@dataclass(frozen=True)
class DDPConfig:
    """Passed to `DistributedDataParallel` when `parallel.mode` is ddp."""

    bucket_cap_mb: float = option(25.0, check=POSITIVE, doc="DDP's gradient bucket size")
    find_unused_parameters: bool = option(
        False, doc="allow parameters that get no gradient in a step (costs a graph walk per step)"
    )
    static_graph: bool = option(
        False, doc="tell DDP the set of used parameters is the same at every step"
    )
    broadcast_buffers: bool = option(
        True, doc="sync buffers (BatchNorm statistics) from rank 0 at each forward"
    )
    gradient_as_bucket_view: bool = option(
        True,
        doc="gradients are views into DDP's all-reduce buckets: one copy of them per rank, "
        "not two (false: the bucket copy as in plain DDP)",
    )


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 (`fully_shard`) when `parallel.mode` is fsdp: see [FSDP](fsdp.md)."""

    wrap: str | list = option(
        "auto",
        doc="`auto` (a Hugging Face model's own blocks, its `_no_split_modules`; else each "
        "block of the model's sequential stages) or a list of module class names, each "
        "instance its own unit",
    )
    reshard_after_forward: bool = option(
        True, doc="false keeps parameters gathered between forward and backward"
    )
    hybrid_replicas: int = option(
        1,
        check=AT_LEAST_ONE,
        doc="HSDP: a 2-D mesh of this many replica groups, sharded inside each; 1 = plain FSDP",
    )
    cpu_offload: bool = option(
        False, doc="parameters, gradients and optimizer state in host memory (CUDA only)"
    )


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor parallelism: each block's weights split over `size` ranks, the data dimensions
    (DDP or FSDP) over the rest: see [Parallelism](parallelism.md)."""

    size: int = option(
        1,
        check=AT_LEAST_ONE,
        doc="ranks a block's weights are split over (1: off); it divides the world size, and "
        "the model's heads, hidden size and (for gpt) vocabulary",
    )
    plan: str = option(
        "auto",
        doc="`auto`: the built-in gpt's own plan, or a Hugging Face model's `base_model_tp_plan`; "
        "else an import path `module:function` called as function(model, mesh) that "
        "parallelizes the model in place",
    )
    sequence_parallel: bool = option(
        False,
        doc="the built-in gpt's norms and residual stream split by sequence over the tp group "
        "(activations 1/tp of their size between the blocks' splits; the same arithmetic)",
    )
    loss_parallel: bool = option(
        False,
        doc="the logits of the built-in gpt or of a Hugging Face model split by its own plan "
        "left split by vocabulary over the tp group in training, "
        "the language model's cross-entropy computed on the parts (logits 1/tp of their size; "
        "no all-gather of them)",
    )


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism: the model's blocks cut into stages over `size` ranks, each batch
    cut into micro-batches that flow through them: see [Parallelism](parallelism.md)."""

    size: int = option(
        1,
        check=AT_LEAST_ONE,
        doc="ranks the model's stages are spread over (1: off); with tp, their product divides "
        "the world size",
    )
    schedule: str = option(
        "1f1b",
        choices=SCHEDULES,
        doc="the order of the micro-batches' forwards and backwards: gpipe (all forwards, then "
        "all backwards), 1f1b, interleaved_1f1b (several stages per rank), zero_bubble "
        "(interleaved, the weight gradients deferred into the bubble)",
    )
    microbatches: int = option(
        4,
        check=AT_LEAST_ONE,
        doc="micro-batches each batch (data.batch_size, which it divides) is cut into; at least "
        "`size` for 1f1b and the interleaved schedules",
    )
    stages_per_rank: int = option(
        0,
        check=NON_NEGATIVE,
        doc="stages each rank holds (0: 2 for the interleaved schedules and zero_bubble, else "
        "1); the model's blocks are cut into size x stages_per_rank stages",
    )

    split: str = option(
        "auto",
        doc="`auto`: the built-in gpt cut at its blocks, a Hugging Face decoder at its layers "
        "(its config's `base_model_pp_plan`); else an import path `module:function` called as "
        "function(model, stage, stages) that returns the module of one stage, made of the "
        "model's own modules",
    )

    @property
    def local_stages(self) -> int:
        if self.stages_per_rank:
            return self.stages_per_rank
        return 2 if self.schedule in ("interleaved_1f1b", "zero_bubble") else 1


@dataclass(frozen=True)
class ReplicasConfig:
    """Replica groups that train on when one is lost and heal it from a live peer (torchft): see
    [Replica groups](replicas.md). Each launch (a torchrun, a SLURM job step) is one group."""

    groups: int = option(
        0,
        check=NON_NEGATIVE,
        doc="the replica groups the job is launched as; 0 = off (one group, as a plain run)",
    )
    group: int | None = option(
        None,
        doc="this launch's group, 0 to groups - 1 (null: the DTRAIN_REPLICA_GROUP environment "
        "variable); group 0 writes the run directory and its checkpoints",
    )
    lighthouse: str = option(
        "",
        doc="the lighthouse's address, http://HOST:PORT (`dtrain lighthouse` starts one; empty: "
        "the TORCHFT_LIGHTHOUSE environment variable)",
    )
    start_lighthouse: bool = option(
        False,
        doc="the launch on the host the lighthouse's address names starts one there when none "
        "answers (it outlives the launch and stops a minute after the last group); launches "
        "elsewhere wait for it",
    )
    min_groups: int = option(
        1, check=AT_LEAST_ONE, doc="the fewest groups a step may be taken with"
    )
    timeout_s: float = option(
        30.0,
        check=DURATION,
        doc="how long a group waits for the others in an exchange or a heal before the step is "
        "tried again without the missing one",
    )
    sample_log: bool = option(
        False,
        doc="each rank writes the sample keys of every step it took part in to "
        "`replica_samples.rank<r>.jsonl` in its group's run directory: the proof that every "
        "sample of an epoch was trained once (also without replica groups, under any layout)",
    )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over the ranks."""

    mode: str = option(
        "ddp",
        choices=("ddp", "fsdp", "none"),
        doc="none: a bare model, refused with more than one rank",
    )
    sync_batchnorm: bool = option(
        False,
        doc="BatchNorm statistics over all ranks' batches (SyncBatchNorm on GPUs, a cross-rank "
        "BatchNorm on the CPU), DDP and FSDP",
    )
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    tp: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pp: PipelineConfig = field(default_factory=PipelineConfig)
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)
