"""diffshard: serve diffusion models sharded across the devices a host has."""

__version__ = "0.1.0"
