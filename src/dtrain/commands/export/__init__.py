"""`dtrain export`: a checkpoint's model as files that load without dtrain (a state dict,
TorchScript, torch.export, ONNX, safetensors, a Hugging Face or peft folder), each checked
against the checkpoint's own outputs."""
