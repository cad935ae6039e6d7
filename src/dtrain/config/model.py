"""The `model` section of the config: the network, where its first weights come from, and the
low-rank adapters (LoRA) that fine-tune it with its own weights frozen."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.config.fields import AT_LEAST_ONE, FRACTION, POSITIVE, option


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (peft's LoRA, extra `[peft]`): the model's own weights stay frozen and
    only the adapters (and `modules_to_save`) train; checkpoints hold only what trains. See
    [Fine-tuning](fine-tuning.md#lora)."""

    r: int | None = option(
        None, check=AT_LEAST_ONE, doc="the adapters' rank, e.g. 8; null = no LoRA"
    )
    alpha: float = option(16.0, check=POSITIVE, doc="scale: the update is `alpha / r` x B A")
    dropout: float = option(0.0, check=FRACTION, doc="dropout on the adapters' input")
    target_modules: list | None = option(
        None,
        doc="names (or name suffixes) of the layers that get adapters, or `[all-linear]`; "
        "default: peft's choice for a Hugging Face architecture, `[qkv, proj]` for `gpt`",
    )
    modules_to_save: list | None = option(
        None,
        doc="modules trained in full beside the adapters; default: a classifier's head",
    )


@dataclass(frozen=True)
class ModelConfig:
    """The network and where its first weights come from; see [Data and models](data.md)."""

    name: str = option(
        "simple_cnn",
        doc="a built-in model, `tv:NAME` (a torchvision classifier), `timm:NAME`, `hf:PATH` "
        "(a Hugging Face model folder or cached model id, with its weights), `hf-config:PATH` "
        "(its architecture, fresh weights), or a user's `module:function` called with this "
        "config",
    )
    num_classes: int | None = option(None, check=AT_LEAST_ONE, doc="default: from the dataset")
    args: dict = option(
        {},
        doc="keyword arguments for the model builder, e.g. `{width: 32}`; for `hf:` models, "
        "fields of its config.json to override",
    )
    activation_checkpointing: bool = option(
        False, doc="recompute each block's activations in backward"
    )
    compile: bool = option(False, doc="`torch.compile` each block (each FSDP unit)")
    channels_last: bool = option(False, doc="channels-last memory format for model and inputs")
    init_from: str | None = option(
        None,
        doc="start from these weights: a dtrain checkpoint, an exported state_dict, "
        "a torchvision `.pth`",
    )
    init_exclude: list = option(
        [], doc="globs of weights left at their initial values, e.g. `[fc.*]`"
    )
    init_strict: bool = option(
        True, doc="every other weight must be in `init_from`, with its shape"
    )
    pretrained: bool = option(
        False,
        doc="`tv:` models: torchvision's weights from the local torch hub cache; `timm:` "
        "models: timm's from the local Hugging Face cache (never downloaded at run time)",
    )
    trust_remote_code: bool = option(
        False,
        doc="`hf:`/`hf-config:` folders whose config.json or tokenizer_config.json names code of "
        "their own (`auto_map`): import and run that code; off, such a folder is refused. "
        "See [What dtrain trusts](trust.md#code-named-by-a-folder-or-a-config)",
    )
    lora: LoraConfig = field(default_factory=LoraConfig)
