"""Where contract v1 plugins found the torch tensor plumbing; it is public now as
`infer.primitives.torch_tensors.TorchTensors`. Kept so those plugins still import."""

from ...primitives.torch_tensors import TORCH_DTYPES, TorchTensors as TorchPlumbing

__all__ = ["TORCH_DTYPES", "TorchPlumbing"]
