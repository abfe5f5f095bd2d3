"""diffshard: serve diffusion models sharded across the devices a host has."""

import logging

__version__ = "0.1.0"

# Import-time notes that are not problems, quieted before any library loads: transformers and
# diffusers import torchao whenever it is installed, and then torchao names the CUDA kernels its
# CPU wheel lacks, torch notes torchao's Enum registrations, and diffusers' torchao quantizer the
# pickled tensor classes it cannot register (diffshard loads safetensors only).
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)
