"""A tiny random-weight model of tests/procs/inference/tiny_models.py with the default model's
vocabulary and tokenizer, written as a GGUF the way llama.cpp's converter writes one and
served by every process of the Procfile (its answers are nonsense: what such tests assert is
what the server does with its cache), and the chat helpers its tests share."""
from __future__ import annotations

import contextlib

import pytest

from common.config import Settings
from common.models import resolve

from .server import Server


@contextlib.contextmanager
def tiny_server(tmp, case: str, arch: str, ctx: int, name: str, experts_qtype=None):
    """(Server, trace path) of tiny model `case` (GGUF architecture `arch`) at context ctx,
    with a disk cache and a trace under tmp; experts_qtype: the experts' GGUF type (F32)."""
    gguf = pytest.importorskip("gguf")
    from tests.procs.inference.tiny_models import _hf_model, _write_gguf
    default = resolve("", Settings().models_path())
    vocab = gguf.GGUFReader(default).fields["tokenizer.ggml.tokens"].data
    path = str(tmp / f"{case}-tiny.gguf")
    _write_gguf(_hf_model(case, vocab_size=len(vocab), max_position_embeddings=ctx), path, arch,
                experts_qtype=experts_qtype, tokenizer_from=default)
    (tmp / "kv").mkdir()
    srv = Server(env={"RICORDO_MODEL": path, "RICORDO_CTX_SIZE": str(ctx), "RICORDO_KV_DISK_DIR": str(tmp / "kv"),
                      "RICORDO_TRACE": str(tmp / "trace.log")}, name=name)
    with srv:
        yield srv, tmp / "trace.log"


def ask(srv, messages):
    return srv.client().chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0)


def cached(r) -> int:
    d = r.usage.prompt_tokens_details
    return (d.cached_tokens or 0) if d else 0


def live_then_restart(srv, trace, first: list, a) -> None:
    """The turns after `first` (whose answer was a): the next turn reuses the live session
    (its prompt and answer; the answer's last token is re-run), and after a restart the turn
    after is served from the shutdown checkpoint on disk (the trace says so)."""
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And three more."}]
    b = ask(srv, second)
    assert cached(b) >= a.usage.prompt_tokens, (cached(b), a.usage)
    srv.restart()
    before = trace.read_text()
    third = second + [{"role": "assistant", "content": b.choices[0].message.content},
                      {"role": "user", "content": "Thanks."}]
    c = ask(srv, third)
    assert cached(c) >= b.usage.prompt_tokens, (cached(c), b.usage)
    assert "KV cache: hit for sha1=" in trace.read_text()[len(before):]
    assert srv.running()
