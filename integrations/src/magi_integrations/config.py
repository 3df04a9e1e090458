"""Structured (dataclass) configs of the Hydra training app, with validation that names the
field and the fix. Group fields are typed ``Any`` so Hydra keeps the chosen option's class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

DTYPES = ("float32", "float64", "bfloat16")
LM_MASKS = ("varlen_causal", "causal")
CP_BACKENDS = ("magi", "none")
DEVICES = ("cpu", "cuda")


def _path(obj: object, name: str) -> str:
    """The config path of field ``name`` of a group config (``parallel.cp``), as a user writes it."""
    group = getattr(obj, "group", "")
    return f"{group}.{name}" if group else name


def _positive(obj: object, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{_path(obj, n)} must be a positive int, got {v!r}")


@dataclass
class ModelConfig:
    """A Llama-style decoder built from a config (no downloads)."""

    group: ClassVar[str] = "model"
    name: str = "tiny_llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 65536

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} must be a multiple of model.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}")


@dataclass
class MaskConfig:
    """Packed synthetic documents: ``varlen_causal`` (lengths from the embedded distribution) or
    ``causal`` (one document)."""

    group: ClassVar[str] = "mask"
    name: str = "varlen_causal"
    seqlen: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in LM_MASKS:
            raise ValueError(f"mask.name must be one of {LM_MASKS}, got {self.name!r}")
        _positive(self, "seqlen")
        if self.seqlen < 2:
            raise ValueError(f"mask.seqlen={self.seqlen} is too short to train: a token needs a next token to predict")


@dataclass
class CPConfig:
    """Context parallelism: ``magi`` (dispatch + distributed attention) or ``none``. The number of
    CP ranks is ``parallel.cp``; ``overlap_degree`` is the number of overlap stages of remote KV
    (0 = no overlap), not a parallel size."""

    group: ClassVar[str] = "cp"
    backend: str = "magi"
    overlap_degree: int = 1
    chunk_size: Optional[int] = None
    kernel_backend: str = "auto"
    comm_backend: str = "a2a"  # a2a | ipc | hier (node-aware two hops, see ranks_per_node)
    ranks_per_node: Optional[int] = None
    comm_timeout_s: float = 300.0  # a rank whose peer fails raises after this (DistAttnConfig.comm_timeout_s)
    deterministic: bool = False  # bitwise-reproducible attention on GPU (DistAttnConfig.deterministic)

    def __post_init__(self) -> None:
        from magi_attn import COMM_BACKENDS
        from magi_kernels import BACKENDS

        if self.backend not in CP_BACKENDS:
            raise ValueError(f"cp.backend must be one of {CP_BACKENDS}, got {self.backend!r}")
        if isinstance(self.overlap_degree, bool) or not isinstance(self.overlap_degree, int) or self.overlap_degree < 0:
            raise ValueError(f"cp.overlap_degree must be an int >= 0, got {self.overlap_degree!r}")
        if not (isinstance(self.comm_timeout_s, (int, float)) and 0 < self.comm_timeout_s < math.inf):
            raise ValueError(f"cp.comm_timeout_s must be a finite number of seconds > 0, got {self.comm_timeout_s!r}")
        if self.chunk_size is not None:
            _positive(self, "chunk_size")
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"cp.kernel_backend must be one of {BACKENDS}, got {self.kernel_backend!r}")
        if self.comm_backend not in COMM_BACKENDS:
            raise ValueError(f"cp.comm_backend must be one of {COMM_BACKENDS}, got {self.comm_backend!r}")
        if self.ranks_per_node is not None:
            _positive(self, "ranks_per_node")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"cp.deterministic must be true or false, got {self.deterministic!r}")


@dataclass
class ParallelConfig:
    """Process layout: ``dp * cp`` processes. ``fsdp``: FSDP2 shards over all of them; without it
    the model is replicated and DDP averages the gradients over all of them."""

    group: ClassVar[str] = "parallel"
    dp: int = 1
    cp: int = 2
    device: str = "cpu"
    fsdp: bool = True

    def __post_init__(self) -> None:
        _positive(self, "dp", "cp")
        if self.device not in DEVICES:
            raise ValueError(f"parallel.device must be one of {DEVICES}, got {self.device!r}")


@dataclass
class TrainConfig:
    model: Any = MISSING
    mask: Any = MISSING
    cp: Any = MISSING
    parallel: Any = MISSING
    steps: int = 20
    lr: float = 3e-3
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self, "steps")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def validate(self) -> "TrainConfig":
        """Cross-field rules (run after the groups are resolved)."""
        p, c, m = self.parallel, self.cp, self.mask
        if c.backend == "none" and p.cp != 1:
            raise ValueError(f"cp.backend=none needs parallel.cp=1, got parallel.cp={p.cp}; use cp=magi for CP")
        if m.seqlen < p.cp:
            raise ValueError(f"mask.seqlen={m.seqlen} must be >= parallel.cp={p.cp}")
        if m.seqlen > self.model.max_position_embeddings:
            raise ValueError(
                f"mask.seqlen={m.seqlen} exceeds model.max_position_embeddings={self.model.max_position_embeddings}"
            )
        return self


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="tiny_llama_schema", node=ModelConfig)
    cs.store(group="mask", name="mask_schema", node=MaskConfig)
    cs.store(group="cp", name="cp_schema", node=CPConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
