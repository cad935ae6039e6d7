"""The export formats: one object each in `FORMATS`, by the name `--format` takes (the CLI's
choices are its keys). The command looks a format up once and asks it everything else.

A format declares what the command needs to know of it:
  `writes_folder(out)`  --out is a folder (an empty one is taken) rather than a file;
  `beside(out)`         the files it writes beside --out, under names made from it;
  `needs`               the optional packages it imports (a missing one: one line naming the extra);
  `reads_data`          its check runs a batch of the run's validation data (data.* overrides
                        steer it, and building the data runs the data's code);
  `runs_code`           the config keys whose code it runs (refused unless --trust-remote-code);
  `shards`              it takes --max-shard-size (`shard_bytes`);
  `keeps_adapters`      a LoRA run's adapters stay apart from their base (else merged into it);
  `quantizes`           the --quantize schemes it writes (quantized.py: the model quantized,
                        then evaluated against the full-precision one on the run's validation
                        split), `runtime` what runs its file when that is not PyTorch;
  `converts_qat`        a quantization-aware run's fake quantization is converted as it trained
                        (False where the format's own tools quantize its full-precision file);
and does its steps in turn: `check_out(out)` before anything is read; `load`: the checkpoint's
model (or, for hf, where its tensors come from); `write(job, out)`; `read_back(job, out,
written)`: loaded back as a user would and compared, the largest difference and the line to
print (a failed check removes what was written, exit 1).

No torch here (the CLI's parser is built from this module): each format's own module is imported
when the format runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dtrain.config import registry
from dtrain.core.errors import UserError
from dtrain.files import outputs

# The keys whose code every export runs: the model, and the task (its example input).
MODEL_AND_TASK = ("model.name", "task.name")


@dataclass(frozen=True)
class Job:
    """One export under way: the checkpoint's model (for hf: the source of its tensors), its
    metadata, the checkpoint as the report line names it, and what the user asked for."""

    model: Any
    meta: dict
    shown: str
    weights: str
    overrides: list[str]
    shard_size: str | None


class ExportFormat:
    """A format that writes one file, merges a LoRA run's adapters, and runs only the model's
    and the task's code; each format below says where it differs."""

    name = ""
    needs: tuple[tuple[str, str, str], ...] = ()  # (module, extra, what the line says needs it)
    reads_data = False
    shards = False
    keeps_adapters = False
    quantizes: tuple[str, ...] = ()
    runtime = ""
    converts_qat = True

    @property
    def runs_code(self) -> tuple[str, ...]:
        return registry.BUILT_BY_READERS if self.reads_data else MODEL_AND_TASK

    def writes_folder(self, out: str) -> bool:
        return False

    def beside(self, out: str) -> list[str]:
        return []

    def require(self) -> None:
        """The optional packages the format needs, before any checkpoint is read."""
        from dtrain.core.imports import require

        for module, extra, feature in self.needs:
            require(module, extra, feature)

    def shard_bytes(self, size: str) -> int:
        """--max-shard-size in bytes, for a format that shards its weights."""
        takes = ", ".join(f"--format {n}" for n, f in FORMATS.items() if f.shards)
        raise UserError(f"export error: --max-shard-size goes with {takes}")

    def check_out(self, out: str) -> None:
        """An export never replaces what it did not make: --out is new (a folder format may take
        an empty folder) and no link, dangling or not; so is each file it writes beside --out."""
        path = out.rstrip(os.sep) or out
        if os.path.islink(path):
            raise UserError(
                f"export error: --out {out} is {outputs.what_is_at(path)}; an export is a new "
                f"file or folder, never written through a link: name another --out"
            )
        folder = self.writes_folder(path)
        found = outputs.what_is_at(path)
        if found and not (folder and found == "a folder" and not os.listdir(path)):
            made = "folder" if folder else "file"
            raise UserError(
                f"export error: --out {out} already exists ({found}); --format {self.name} "
                f"writes a new {made}: name one that is not there{' (or empty)' if folder else ''}"
            )
        for beside in self.beside(path):
            found = outputs.what_is_at(beside)
            if found:
                raise UserError(
                    f"export error: --out {out}: --format {self.name} writes {beside} beside it, "
                    f"and that already exists ({found}); name another --out"
                )

    def load(self, path: str, weights: str, untrusted: tuple[str, ...], shown: str) -> Any:
        """(The model, the checkpoint's metadata) of the checkpoint at `path`, whole in memory."""
        from dtrain.commands.export.checkpoint_model import load_model

        return load_model(path, weights, self.keeps_adapters, untrusted, shown)

    def module_of(self, loaded: Any) -> Any:
        """The model (an nn.Module) in what `load` returned as the model: the layers that
        --quantize quantizes are looked for in it."""
        return loaded

    def write(self, job: Job, out: str) -> Any:
        """Write the export at `out`; returns what `read_back` needs of the writing."""
        raise NotImplementedError

    def check_quantize(self, scheme: str) -> None:
        """One line unless the format writes --quantize `scheme`."""
        if scheme in self.quantizes:
            return
        takes = "; ".join(
            f"--format {n} takes {', '.join(f.quantizes)}"
            for n, f in FORMATS.items()
            if f.quantizes
        )
        does = f"takes only {', '.join(self.quantizes)}" if self.quantizes else "is not quantized"
        raise UserError(f"export error: --quantize {scheme}: --format {self.name} {does} ({takes})")

    def write_quantized(
        self, job: Job, out: str, plain: Any, scheme: str, calibration: list[Any]
    ) -> None:
        """Write the export at `out` quantized by `scheme`: `plain`, what `write_plain` wrote;
        `calibration`, model inputs of training batches for a scheme that calibrates."""
        raise NotImplementedError

    def write_plain(self, job: Job, out: str, example: Any) -> Any:
        """The full-precision export that a quantized one is measured against, at `out`."""
        raise NotImplementedError

    def load_file(self, out: str) -> Any:
        """The export at `out`, loaded as a user would: a callable taking the model's input."""
        raise NotImplementedError

    def read_back(self, job: Job, out: str, written: Any) -> tuple[float, str]:
        """Load `out` back as a user would and compare it with the checkpoint's model: the
        largest difference and the line to print."""
        raise NotImplementedError


class TorchFile(ExportFormat):
    """A file that torch writes and reads back itself: `writer` and `reloader` name its two
    functions in torch_files.py (imported only when it runs: this registry imports no torch)."""

    writer = reloader = ""

    def write(self, job: Job, out: str) -> Any:
        from dtrain.commands.export import torch_files

        return getattr(torch_files, self.writer)(job.model, job.meta, out, self.name)

    def read_back(self, job: Job, out: str, written: Any) -> tuple[float, str]:
        from dtrain.commands.export import torch_files

        reload = getattr(torch_files, self.reloader)
        return torch_files.read_back(
            job.model, job.meta, job.shown, out, self.name, written, reload
        )


class StateDict(TorchFile):
    """Plain tensors by parameter name (torch.save)."""

    name = "state_dict"
    writer, reloader = "write_state_dict", "reload_state_dict"


class TorchScript(TorchFile):
    """The model traced by torch.jit.trace on the task's example input."""

    name = "torchscript"
    writer, reloader = "write_torchscript", "reload_torchscript"


class Exported(TorchFile):
    """The model's program by torch.export on the task's example input."""

    name = "exported"
    writer, reloader = "write_exported", "reload_exported"
    quantizes = ("int8-dynamic", "int8-weight", "int8-static", "int4-weight")

    def write_plain(self, job: Job, out: str, example: Any) -> Any:
        from dtrain.commands.export import quantized_files

        return quantized_files.write_program(job.model, job.meta, out, example)

    def write_quantized(
        self, job: Job, out: str, plain: Any, scheme: str, calibration: list[Any]
    ) -> None:
        from dtrain.commands.export import quantized_files

        model = quantized_files.quantized_model(job.model, job.meta, scheme, calibration)
        quantized_files.write_program(model, job.meta, out, plain)

    def load_file(self, out: str) -> Any:
        from dtrain.commands.export import quantized_files

        return quantized_files.Program(out)


class Onnx(ExportFormat):
    """torch.onnx's dynamo exporter, checked under onnxruntime on a validation batch
    (onnx_file.py); a model past 2 GB keeps its weights in `OUT.data`."""

    name = "onnx"
    needs = tuple(
        (module, "export", f"dtrain export --format onnx ({module})")
        for module in ("onnx", "onnxscript", "onnxruntime")
    )
    reads_data = True
    quantizes = ("int8-dynamic", "int8-weight", "int8-static")
    runtime = "onnxruntime"
    converts_qat = False

    def beside(self, out: str) -> list[str]:
        return [out + ".data"]

    def write_plain(self, job: Job, out: str, example: Any) -> Any:
        # The file dtrain writes and checks unquantized: onnxruntime quantizes that file.
        self.read_back(job, out, self.write(job, out))
        return out

    def write_quantized(
        self, job: Job, out: str, plain: Any, scheme: str, calibration: list[Any]
    ) -> None:
        from dtrain.commands.export import quantized_files

        quantized_files.write_onnx(plain, out, scheme, calibration)

    def load_file(self, out: str) -> Any:
        from dtrain.commands.export import quantized_files

        return quantized_files.OnnxSession(out)

    def write(self, job: Job, out: str) -> Any:
        from dtrain.commands.export import onnx_file

        return onnx_file.write(job.model, job.meta, out, job.overrides, job.weights)

    def read_back(self, job: Job, out: str, written: Any) -> tuple[float, str]:
        from dtrain.commands.export import onnx_file

        return onnx_file.read_back(job.model, job.shown, out, written)


class Safetensors(ExportFormat):
    """The weights with the config beside them (safetensors_file.py): a folder, or a
    `NAME.safetensors` file with `NAME.config.yaml`."""

    name = "safetensors"
    needs = (("safetensors", "export", "dtrain export --format safetensors (safetensors)"),)

    def writes_folder(self, out: str) -> bool:
        return not out.endswith(".safetensors")

    def beside(self, out: str) -> list[str]:
        if self.writes_folder(out):
            return []
        from dtrain.commands.export import safetensors_file

        return [safetensors_file.paths(out)[1]]

    def write(self, job: Job, out: str) -> Any:
        from dtrain.commands.export import safetensors_file

        return safetensors_file.write(job.model, job.meta, out, job.weights)

    def read_back(self, job: Job, out: str, written: Any) -> tuple[float, str]:
        from dtrain.commands.export import safetensors_file

        return safetensors_file.read_back(job.model, job.shown, out)


class HuggingFace(ExportFormat):
    """A Hugging Face model's folder (hf_folder.py): the weights from the whole model, the
    sharded checkpoint file by file, or a LoRA run's merge tensor by tensor. Quantized, the
    full-precision folder is quantized by transformers with torchao as it loads it
    (quantized_files.py), which cannot convert a quantization-aware run's training."""

    name = "hf"
    needs = (("transformers", "transformers", "dtrain export --format hf"),)
    shards = True
    quantizes = ("int8-dynamic", "int8-weight")
    converts_qat = False

    def writes_folder(self, out: str) -> bool:
        return True

    def shard_bytes(self, size: str) -> int:
        from dtrain.commands.export import hf_files

        return hf_files.shard_bytes(size)

    def load(self, path: str, weights: str, untrusted: tuple[str, ...], shown: str) -> Any:
        from dtrain.commands.export import hf_folder

        return hf_folder.source_of(path, weights, untrusted, shown)

    def module_of(self, loaded: Any) -> Any:
        return loaded.model  # the source's model: whole, or its shapes on the meta device

    def write_plain(self, job: Job, out: str, example: Any) -> Any:
        # The folder dtrain writes and checks unquantized: transformers quantizes that folder.
        self.read_back(job, out, self.write(job, out))
        return out

    def write_quantized(
        self, job: Job, out: str, plain: Any, scheme: str, calibration: list[Any]
    ) -> None:
        from dtrain.commands.export import hf_files, quantized_files

        size = hf_files.shard_bytes(job.shard_size or hf_files.SHARD_SIZE)
        quantized_files.write_hf_folder(plain, out, scheme, size)

    def load_file(self, out: str) -> Any:
        from dtrain.commands.export import quantized_files

        return quantized_files.load_hf_folder(out)

    def write(self, job: Job, out: str) -> Any:
        from dtrain.commands.export import hf_files, hf_folder

        size = hf_files.shard_bytes(job.shard_size or hf_files.SHARD_SIZE)
        return hf_folder.write(job.model, job.meta, out, size)

    def read_back(self, job: Job, out: str, written: Any) -> tuple[float, str]:
        from dtrain.commands.export import hf_folder

        return hf_folder.read_back(job.model, job.meta, job.shown, out, written)


class Peft(ExportFormat):
    """A LoRA run's adapters as peft's folder (peft_folder.py), apart from their base."""

    name = "peft"
    needs = (("peft", "peft", "dtrain export --format peft"),)
    keeps_adapters = True

    def writes_folder(self, out: str) -> bool:
        return True

    def load(self, path: str, weights: str, untrusted: tuple[str, ...], shown: str) -> Any:
        from dtrain.commands.export import peft_folder

        model, meta = super().load(path, weights, untrusted, shown)
        peft_folder.check_model(meta)
        return model, meta

    def write(self, job: Job, out: str) -> Any:
        from dtrain.commands.export import peft_folder

        peft_folder.write(job.model, out)

    def read_back(self, job: Job, out: str, written: Any) -> tuple[float, str]:
        from dtrain.commands.export import peft_folder

        return peft_folder.read_back(job.model, job.meta, job.shown, out)


FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (StateDict(), TorchScript(), Exported(), Onnx(), Safetensors(), HuggingFace(), Peft())
}
# --quantize's schemes, in the order the formats name them (models/quantize.py's SCHEMES: this
# module imports no torch, and a test keeps the two the same).
QUANTIZE_SCHEMES = tuple(dict.fromkeys(s for f in FORMATS.values() for s in f.quantizes))
