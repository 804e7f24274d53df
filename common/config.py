"""The one settings class. Every option is declared once, here: its default, type, help and
which processes read it. The CLI of every process is generated from it, and every flag
`--some-flag` is also read from the environment as `RICORDO_SOME_FLAG` (the CLI wins).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

ALL = ("generate", "web", "renderer", "inference", "persister", "cache")


def opt(default, help: str, procs=ALL, choices=None, aliases=()):
    """aliases: older environment names still read when the main one is unset."""
    return field(default=default, metadata={"help": help, "procs": procs, "choices": choices, "aliases": aliases})


def _default_cache_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "ricordo")


@dataclass
class Settings:
    # model
    model: str = opt("", "GGUF file, Hugging Face dir, or a catalogue name (`ricordo fetch-model --list`) "
                     "fetched into --models-dir; empty = the default model")
    models_dir: str = opt("", "where catalogue models are fetched (default ~/.cache/ricordo/models)",
                          aliases=("RICORDO_MODELS",))
    dtype: str = opt("auto", "compute dtype", ("generate", "inference"), ("auto", "bf16", "f32", "f16"))
    device: str = opt("auto", "torch device (auto = cuda when present)", ("generate", "inference"))
    threads: int = opt(0, "torch CPU threads (0 = torch default)", ("generate", "inference"))
    adapt_threads: bool = opt(True, "decode on the CPU times its own steps and runs them on fewer threads while "
                              "that is faster (another process taking a core), back to --threads when it is not; "
                              "answers are the same at any count", ("generate", "inference"))
    ctx_size: int = opt(0, "context size in tokens (0 = the model's trained context, as far as its K/V fits in a "
                        "quarter of the memory; above the trained context works, with a warning)", ("generate", "renderer", "inference", "web"))
    decode_weights: str = opt("packed", "what decode reads on the CPU: packed copies (int4 groups for 4-bit sources, "
                              "their own levels; int8 groups of 32 for other quantized ones), or the dense weights",
                              ("generate", "inference"), ("packed", "dense"))
    decode_kernels: str = opt("native", "decode on the CPU: a whole step in C kernels built once with this machine's "
                              "gcc (cached under ~/.cache/ricordo/kernels; torch's ops when they cannot be built), "
                              "or torch's ops", ("generate", "inference"), ("native", "torch"))
    cuda_graphs: bool = opt(True, "decode steps on CUDA replay a graph captured per batch size over a pool of K/V "
                            "slots (one launch instead of hundreds); off: torch's ops launched one by one", ("generate", "inference"))
    prefill_attention: str = opt("auto", "prefill's attention on the CPU: the native kernel (f32 FMA tiles; bf16 pairs "
                                 "where the CPU has avx512_bf16 and --prefill-math is bf16), torch's SDPA, or auto: native unless bf16 GEMMs run "
                                 "on AMX and the model has no attention sinks (SDPA takes none; torch's ops are "
                                 "4-13x slower than the kernel)", ("generate", "inference"), ("auto", "native", "sdpa"))
    prefill_math: str = opt("auto", "in bf16 on the CPU, what prefill's GEMMs and native attention multiply in: bf16 "
                            "(the CPU's bf16 dot products), or f32 on the bf16 values widened (K/V, decode and "
                            "memory stay bf16); auto: bf16 where those products outrun f32 FMAs (AMX, or AMD's "
                            "avx512_bf16), else f32", ("generate", "inference"), ("auto", "bf16", "f32"))
    packed_cache_dir: str = opt("", "where the native decoder's packed weights are kept between starts, one file per "
                                "model file and dtype (default ~/.cache/ricordo/packed; off: none)",
                                ("generate", "inference"))
    chunk_size: int = opt(512, "prefill chunk size; chunks end at absolute multiples of it", ("generate", "inference"))
    draft_lookup: int = opt(8, "prompt lookup decoding: a request decoding alone checks, in one step, up to this many "
                            "tokens that followed its last 3 tokens earlier in the conversation, and keeps those the "
                            "model writes: the same answer, fewer steps where it copies (0 = off; not with CUDA "
                            "graphs)", ("inference",))
    deterministic: bool = opt(False, "answers independent of what was cached: every prefill runs as whole "
                              "chunks and an answer's rows are prefilled again after it is sent (slower short prefills)",
                              ("generate", "inference"))
    chat_template_file: str = opt("", "a Jinja chat template used instead of the model's own (as llama.cpp's "
                                  "--chat-template-file); its tool syntax decides how calls are written and parsed",
                                  ("generate", "renderer"))
    chat_template_kwargs: str = opt("", "a JSON object of extra variables for the chat template in every request "
                                    "(as llama.cpp's --chat-template-kwargs), e.g. {\"enable_thinking\": false}; a "
                                    "request's chat_template_kwargs are laid over it", ("generate", "renderer"))
    model_id: str = opt("", "model id served by /v1/models (default: file name without extension)", ("web", "renderer"))
    # process wiring
    run_dir: str = opt("", "directory for sockets and shared-memory names (default: one per user and "
                       "working directory under /tmp)", ("web", "renderer", "inference", "persister"))
    slots: bool = opt(True, "GET /slots lists the resident sessions and running jobs (token counts, no text; "
                      "llama.cpp's --slots)", ("web",))
    max_body_bytes: int = opt(8 << 20, "largest accepted request body", ("web",))
    strict_model_names: bool = opt(False, "404 for a request naming another model (else the loaded model "
                                   "serves any name, and the answer names it)", ("web",))
    n_predict: int = opt(0, "most tokens one answer may have, whatever the request asks (0 = until the context "
                         "is full), as llama.cpp's --n-predict", ("renderer",))
    kv_ram_space_mb: int = opt(0, "memory budget for the K/V of the sessions kept resident (0 = a quarter of the "
                               "memory available when inference starts: the GPU's on CUDA)", ("generate", "inference"))
    max_live_sessions: int = opt(4, "conversations kept resident in memory at most; a session leaving memory "
                                 "is checkpointed (evict) first", ("generate", "renderer", "inference"))
    parallel: int = opt(4, "requests run at once, each in its own session (at most --max-live-sessions): their "
                        "answers are decoded together, one batched step for all, and new prompts are prefilled "
                        "a chunk at a time between those steps (llama.cpp's --parallel)", ("generate", "renderer", "inference"))
    max_queue: int = opt(64, "requests waiting for the model beyond which new ones get 429", ("renderer",))
    # sampling of a request that leaves a field out (llama.cpp's flags); greedy by default, so
    # an answer depends only on the prompt (agents send no temperature: a small model may loop)
    temp: float = opt(0.0, "temperature of a request that sets none (0 = greedy)", ("web",))
    top_k: int = opt(0, "top-k of a request that sets none (0 = off)", ("web",))
    top_p: float = opt(1.0, "top-p of a request that sets none (1 = off)", ("web",))
    min_p: float = opt(0.0, "min-p of a request that sets none (0 = off)", ("web",))
    seed: int = opt(-1, "sampling seed of a request that sets none (-1 = a fresh one each request)", ("web",))
    repeat_penalty: float = opt(1.0, "repeat penalty of a request that sets none (1 = off; Qwen2.5 "
                                "recommends 1.05)", ("web",))
    repeat_last_n: int = opt(64, "tokens the repeat penalty looks back over (-1 = the whole context)", ("web",))
    log_level: str = opt("info", "logging level", choices=("debug", "info", "warning", "error"))
    # disk KV cache (names and defaults of ds4-server, docs/kv-format.md)
    kv_disk_dir: str = opt("", "checkpoint directory; empty disables the disk cache")
    kv_disk_space_mb: int = opt(8192, "disk budget for checkpoints")
    kv_cache_min_tokens: int = opt(512, "smallest checkpoint / reusable prefix in tokens")
    kv_cache_cold_max_tokens: int = opt(30000, "longest prompt that gets a cold checkpoint")
    kv_cache_continued_interval_tokens: int = opt(10000, "continued checkpoint interval")
    kv_cache_boundary_trim_tokens: int = opt(32, "tokens trimmed from a cold checkpoint")
    kv_cache_boundary_align_tokens: int = opt(2048, "checkpoint alignment in tokens")
    kv_cache_reject_different_quant: bool = opt(False, "only reuse checkpoints of the same quant bits")
    trace: str = opt("", "append cache decisions to this file")
    tool_memory_max_ids: int = opt(100000, "tool-call ids remembered for exact replay")
    disable_exact_tool_replay: bool = opt(False, "turn off exact tool-call replay")
    api_key: str = opt("", "require this Bearer token on every endpoint but /health", ("web",))

    @property
    def batch(self) -> int:
        """Requests in flight at once: --parallel, within the sessions memory may hold."""
        return max(1, min(self.parallel, self.max_live_sessions))

    @classmethod
    def parser(cls, proc: str, prog: str | None = None) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(prog=prog or f"ricordo {proc}",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        cls.add_arguments(ap, proc)
        return ap

    @classmethod
    def add_arguments(cls, ap: argparse.ArgumentParser, proc: str) -> None:
        for f in dataclasses.fields(cls):
            if proc not in f.metadata["procs"]:
                continue
            flag = "--" + f.name.replace("_", "-")
            env = "RICORDO_" + f.name.upper()
            default = cls._env(f, env)
            help_ = f"{f.metadata['help']} [env {env}]"
            if f.type in ("bool", bool):
                # a setting on by default is turned off with --no-<name>
                ap.add_argument(flag, action=argparse.BooleanOptionalAction if f.default else "store_true",
                                default=default, help=help_)
            else:
                typ = {"int": int, "str": str, "float": float}[str(f.type)]
                ap.add_argument(flag, type=typ, default=default, help=help_,
                                choices=f.metadata["choices"])

    @staticmethod
    def _env(f, env: str):
        raw = next((os.environ[e] for e in (env, *f.metadata["aliases"]) if e in os.environ), None)
        if raw is None:
            return f.default
        if f.type in ("bool", bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        try:
            return {"int": int, "str": str, "float": float}[str(f.type)](raw)
        except ValueError:
            raise SystemExit(f"error: {env}={raw!r} is not a valid {f.type}") from None

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "Settings":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in known})

    @classmethod
    def load(cls, proc: str, argv=None) -> "Settings":
        return cls.from_args(cls.parser(proc).parse_args(argv))

    @classmethod
    def markdown(cls) -> str:
        """The options as a Markdown table (README's is this text; a test keeps them equal)."""
        rows = ["| flag | environment | default | processes | what |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            env = "`RICORDO_" + f.name.upper() + "`" + "".join(f" (or `{a}`)" for a in f.metadata["aliases"])
            default = f.default if f.default != "" else '""'
            procs = "all" if f.metadata["procs"] == ALL else ", ".join(f.metadata["procs"])
            what = f.metadata["help"] + (f" ({' / '.join(f.metadata['choices'])})" if f.metadata["choices"] else "")
            rows.append(f"| `--{f.name.replace('_', '-')}` | {env} | `{default}` | {procs} | {what} |")
        return "\n".join(rows) + "\n"

    # derived values: computed here so no second place spells them
    def packed_cache_path(self) -> str:
        """'' when the packed-weight cache is off."""
        if self.packed_cache_dir == "off":
            return ""
        return self.packed_cache_dir or os.path.join(_default_cache_root(), "packed")

    def models_path(self) -> str:
        return self.models_dir or os.path.join(_default_cache_root(), "models")
