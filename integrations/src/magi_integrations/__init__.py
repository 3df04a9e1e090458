"""magi integrations: HF Transformers (`attn_implementation="magi"`), FSDP2, DeepSpeed, Hydra."""

__version__ = "0.1.0"  # the one place the version is set: pyproject.toml reads it from here
