"""Worker configuration: dataclasses built from the LazarusJob manifest's ``spec.runtime``.

The manifest uses camelCase keys, as Kubernetes manifests do, and never floats (API
conventions): fractional knobs such as the learning rate are decimal strings like
``"3e-4"``. Every bad value raises ``ValueError`` whose message is ``"<field>: <what is
wrong>"``, the field being the key under ``spec.runtime``; ``split_error`` takes it apart,
so the operator's spec parser (job_spec.py) checks ``spec.runtime`` with this very code and
turns each error into a condition naming ``spec.runtime.<field>``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

# Upper bounds of the model's sizes: generous multiples of the largest published models, so
# no real configuration is refused, while a typo (dim 1000000000) is refused at once instead
# of failing every worker at start-up. Largest published, for scale: 126 layers, dim 16,384
# and FFN 53,248 (Llama 3.1 405B), 256 experts per layer (DeepSeek-V3), a 262,144-token
# vocabulary (Gemma 3). crds/lazarusjob.yaml repeats them as the schema's maxima.
MODEL_LIMITS = {
    "layers": 1024, "dim": 65536, "heads": 65536, "experts": 4096, "ffn_dim": 262144,
    "vocab": 1 << 20, "seq_len": 1 << 20,
}
# Seeds feed numpy and torch generators, which take unsigned 32- and 64-bit seeds.
MAX_SEED = (1 << 32) - 1
# One step's batch: 2^20 samples is 60x Llama 3's 16M-token batch at a 1024-token context.
MAX_GLOBAL_BATCH = 1 << 20
# The generated corpus lives in every worker's memory at 8 bytes a token: at most 8 GiB.
MAX_GENERATED_TOKENS = 1 << 30
# Fractional knobs: a plain decimal ("0.001", "3e-4"); no "nan", "inf" or spaces.
_DECIMAL = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$")
# A worker's training state is at least fp32 weights, gradients and AdamW's two moments.
TRAINING_BYTES_PER_PARAMETER = 16


def split_error(error: ValueError) -> tuple[str, str]:
    """(field under spec.runtime, what is wrong) of an error raised here; the field is "" for
    the runtime section as a whole."""
    key, sep, message = str(error).partition(": ")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key):
        return "", str(error)
    return ("", message) if key == "runtime" else (key, message)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the GPT-style MoE decoder. Every layer's feed-forward block is an MoE layer."""

    layers: int
    dim: int
    heads: int
    experts: int
    top_k: int
    ffn_dim: int
    vocab: int
    seq_len: int

    def __post_init__(self):
        for name, most in MODEL_LIMITS.items():
            if not 1 <= getattr(self, name) <= most:
                raise ValueError(f"{_MODEL_KEYS[name]}: must be between 1 and {most}, "
                                 f"got {getattr(self, name)}")
        if self.top_k not in (1, 2):
            raise ValueError(f"topK: must be 1 or 2, got {self.top_k}")
        if self.top_k > self.experts:
            raise ValueError(f"topK: {self.top_k} exceeds the number of experts ({self.experts})")
        if self.dim % self.heads:
            raise ValueError(f"heads: dim {self.dim} is not divisible by {self.heads} heads; "
                             f"choose heads that divide dim")

    def parameters_per_rank(self, expert_slots: int) -> int:
        """Parameters one rank holds: the dense ones (embeddings, attention, gates, output
        head; replicated on every rank) and ``expert_slots`` experts in every layer."""
        dense = (2 * self.vocab * self.dim + self.seq_len * self.dim
                 + self.layers * (4 * self.dim * self.dim + self.dim * self.experts))
        return dense + self.layers * expert_slots * 2 * self.dim * self.ffn_dim


# The paper's models (paper-notes.md): 12 layers, FFN = 4 x dim, GPT-2 vocabulary and a
# 1024-token context; GPT-S/M/L differ in width and expert count. Top-1 gating as in the
# paper. The tiny ones train on a CPU in seconds on the byte-level generated corpus.
NAMED_MODELS: dict[str, ModelConfig] = {
    "gpt-s": ModelConfig(layers=12, dim=768, heads=12, experts=8, top_k=1, ffn_dim=3072,
                         vocab=50257, seq_len=1024),
    "gpt-m": ModelConfig(layers=12, dim=1024, heads=16, experts=12, top_k=1, ffn_dim=4096,
                         vocab=50257, seq_len=1024),
    "gpt-l": ModelConfig(layers=12, dim=1024, heads=16, experts=16, top_k=1, ffn_dim=4096,
                         vocab=50257, seq_len=1024),
    "tiny": ModelConfig(layers=2, dim=32, heads=2, experts=4, top_k=2, ffn_dim=64,
                        vocab=256, seq_len=32),
    "tiny-8e": ModelConfig(layers=2, dim=32, heads=2, experts=8, top_k=2, ffn_dim=64,
                           vocab=256, seq_len=32),
}

# Manifest key for each field, so errors name what the user wrote.
_MODEL_KEYS = {
    "layers": "layers", "dim": "dim", "heads": "heads", "experts": "experts",
    "top_k": "topK", "ffn_dim": "ffnDim", "vocab": "vocab", "seq_len": "seqLen",
}


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how each step's global batch is drawn.

    ``source`` is ``"generated"`` (the built-in synthetic corpus), a local file path
    (``.txt`` bytes, ``.bin`` uint16 tokens, ``.npy``), or ``"hf:NAME[:CONFIG]"``.
    """

    source: str = "generated"
    global_batch: int = 8
    seed: int = 0
    generated_tokens: int = 200_000

    def __post_init__(self):
        if not self.source:
            raise ValueError("dataset: must not be empty")
        if not 1 <= self.global_batch <= MAX_GLOBAL_BATCH:
            raise ValueError(f"globalBatch: must be between 1 and {MAX_GLOBAL_BATCH}, "
                             f"got {self.global_batch}")
        if not 2 <= self.generated_tokens <= MAX_GENERATED_TOKENS:
            raise ValueError(f"generatedTokens: must be between 2 and {MAX_GENERATED_TOKENS}"
                             f" (the corpus is held in memory), got {self.generated_tokens}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"dataSeed: must be between 0 and {MAX_SEED}, got {self.seed}")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters; the same on every rank and for every expert replica."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"learningRate: must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weightDecay: must be >= 0, got {self.weight_decay}")
        for key, b in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= b < 1:
                raise ValueError(f"{key}: must be in [0, 1), got {b}")


# The compute knobs: manifest key -> (ComputeConfig field, allowed values).
_COMPUTE_KEYS = {
    "precision": ("precision", ("bf16", "fp32")),
    "activationCheckpointing": ("activation_checkpointing", ("none", "attention", "full")),
    "compile": ("compile", ("none", "dense")),
}


@dataclass(frozen=True)
class ComputeConfig:
    """How a worker computes a step; none of it changes what is trained.

    - ``precision``: ``bf16`` keeps fp32 master weights and optimizer state and computes the
      router, its softmax and the loss in fp32; ``fp32`` computes everything in fp32. Unset,
      it is chosen by the device: bf16 on CUDA, fp32 on CPU.
    - ``activation_checkpointing``: recompute in the backward instead of storing: ``attention``
      (each block's attention, norms and router) or ``full`` (those and the expert FFNs). The
      token dispatch, which communicates, is never recomputed.
    - ``compile``: ``dense`` compiles the attention, norms and router of every block with
      torch.compile (one graph shared by all blocks).
    """

    precision: str | None = None
    activation_checkpointing: str = "none"
    compile: str = "none"

    def __post_init__(self):
        for key, (name, allowed) in _COMPUTE_KEYS.items():
            value = getattr(self, name)
            if value not in allowed and not (name == "precision" and value is None):
                raise ValueError(f"{key}: must be one of {', '.join(allowed)}, got {value!r}")

    def precision_on(self, device_type: str) -> str:
        """The precision on a device of this type ("cuda", "cpu"): as set, else by device."""
        if self.precision is not None:
            return self.precision
        return "bf16" if device_type == "cuda" else "fp32"

    @classmethod
    def from_manifest(cls, runtime: dict) -> "ComputeConfig":
        return cls(**{name: runtime[key] for key, (name, _) in _COMPUTE_KEYS.items()
                      if key in runtime})


@dataclass(frozen=True)
class RuntimeConfig:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    # Seeds parameter initialisation; the data order has its own seed.
    seed: int = 0

    @classmethod
    def from_manifest(cls, runtime: dict) -> "RuntimeConfig":
        """Build from ``spec.runtime``, e.g. ``{"model": "tiny", "topK": 1}``.

        ``model`` names a base config; any model field given beside it overrides it.
        """
        if not isinstance(runtime, dict):
            raise ValueError("runtime: must be an object")
        known = {"model", "seed", "dataset", "globalBatch", "dataSeed", "generatedTokens",
                 "learningRate", "weightDecay", "beta1", "beta2", *_MODEL_KEYS.values(),
                 *_COMPUTE_KEYS}
        unknown = sorted(set(runtime) - known)
        if unknown:
            raise ValueError(f"runtime: unknown field(s) {', '.join(unknown)}; "
                             f"known fields are {', '.join(sorted(known))}")
        name = runtime.get("model", "tiny")
        if name not in NAMED_MODELS:
            raise ValueError(f"model: unknown model {name!r}; choose one of "
                             f"{', '.join(NAMED_MODELS)}")
        overrides = {f: _int(runtime, k) for f, k in _MODEL_KEYS.items() if k in runtime}
        model = replace(NAMED_MODELS[name], **overrides)
        data = DataConfig(
            source=_str(runtime, "dataset", "generated"),
            global_batch=_int(runtime, "globalBatch", DataConfig.global_batch),
            seed=_int(runtime, "dataSeed", DataConfig.seed),
            generated_tokens=_int(runtime, "generatedTokens", DataConfig.generated_tokens),
        )
        optim = OptimConfig(
            lr=_real(runtime, "learningRate", OptimConfig.lr),
            weight_decay=_real(runtime, "weightDecay", OptimConfig.weight_decay),
            beta1=_real(runtime, "beta1", OptimConfig.beta1),
            beta2=_real(runtime, "beta2", OptimConfig.beta2),
        )
        seed = _int(runtime, "seed", 0)
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed: must be between 0 and {MAX_SEED}, got {seed}")
        if data.source == "generated" and data.generated_tokens <= model.seq_len:
            raise ValueError(f"generatedTokens: {data.generated_tokens} tokens cannot fill one "
                             f"sample of seqLen {model.seq_len}; raise generatedTokens")
        return cls(model=model, data=data, optim=optim,
                   compute=ComputeConfig.from_manifest(runtime), seed=seed)


def _int(d: dict, key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key}: must be an integer, got {v!r}")
    return v


def _str(d: dict, key: str, default: str) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise ValueError(f"{key}: must be a string, got {v!r}")
    return v


def _real(d: dict, key: str, default: float) -> float:
    """A fractional knob: a decimal string as the API conventions ask ("3e-4"), or an integer
    (a float is refused, as the CRD refuses it: the API conventions allow no floats)."""
    if key not in d:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (str, int)) or not _DECIMAL.match(str(v)):
        hint = f"\"{v!r}\"" if isinstance(v, float) else "\"3e-4\""
        raise ValueError(f"{key}: must be a decimal string such as {hint}, got {v!r}")
    value = float(v)
    if not math.isfinite(value):
        raise ValueError(f"{key}: {v!r} is out of range; write a decimal such as \"3e-4\"")
    return value
