"""`ricordo` command: generate, fetch-model, cache, config, and the process entry points."""
from __future__ import annotations

import sys
import time


def _generate(argv) -> int:
    from common.config import Settings
    from common.messages import SamplingParams
    from common.params import ParamError, validate_sampling
    from common.models import ModelError, load_text, resolve
    from common.tokenizer import template_kwargs
    from procs.inference.loader import ModelLoadError

    ap = Settings.parser("generate", "ricordo generate")
    ap.add_argument("--prompt", required=True, help="prompt text (raw, or a user message with --chat)")
    ap.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    s = Settings.from_args(a)
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                top_k=a.top_k, min_p=a.min_p, seed=a.seed)
        validate_sampling(params)
        if a.seed is not None and not -2**63 <= a.seed < 2**64:
            raise ValueError("--seed must fit in 64 bits")
        if s.chunk_size < 1:
            raise ValueError("--chunk-size must be >= 1")
        import torch
        from procs.inference.runtime import build, pick_device, pick_dtype
        pick_dtype(s.dtype, "cpu")
        try:
            device = torch.device(pick_device(s.device))
        except RuntimeError:
            raise ValueError(f"unknown device {s.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available")
        path = resolve(s.model, s.models_path())
        text = load_text(path, s.chat_template_file)
        text.template_kwargs = template_kwargs(s.chat_template_kwargs, "--chat-template-kwargs")
        model, ctx, load_s = build(s)
    except (ParamError, ModelError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from common.detok import Detokenizer
    from procs.inference.kvsession import KVSession
    from procs.inference.steps import decode_many
    from procs.inference.sampling import Sampler
    from procs.inference.threads import DecodeThreads

    prompt = a.prompt
    if a.chat:
        prompt = text.render_chat([{"role": "user", "content": prompt}])
    ids = text.encode(text.bos_text() + prompt.encode())
    if not ids:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    if len(ids) >= ctx:
        print(f"error: prompt of {len(ids)} tokens does not fit the context of {ctx}", file=sys.stderr)
        return 2
    sess = KVSession(model, ctx, s.chunk_size, exact=s.deterministic)
    threads = DecodeThreads.for_model(s, model)
    t0 = time.perf_counter()
    sess.prefill(ids)
    t1 = time.perf_counter()
    sampler, detok, n = Sampler(params, ids), Detokenizer(text.pieces), 0
    logits = sess.logits
    for _ in range(min(params.max_tokens, ctx - len(ids))):
        tok, _, _ = sampler(logits)
        if tok in text.stop_ids:
            break
        n += 1
        sys.stdout.write(detok.push(tok))
        sys.stdout.flush()
        if len(sess) >= ctx:
            break
        logits = threads.step(lambda: decode_many([sess], [tok])[0])   # a batch of one: CUDA replays its graph
    t2 = time.perf_counter()
    sys.stdout.write(detok.flush() + "\n")
    print(f"[load {load_s:.2f} s | prefill {len(ids)} tok {len(ids) / (t1 - t0):.1f} tok/s | "
          f"decode {n} tok {n / max(t2 - t1, 1e-9):.1f} tok/s | {model.dtype} on {model.device}]",
          file=sys.stderr)
    return 0


def _fetch(argv) -> int:
    from common.config import Settings
    from common.models import CATALOG, DEFAULT_NAME, ModelError, fetch
    ap = Settings.parser("generate", "ricordo fetch-model")
    ap.add_argument("name", nargs="?", default=DEFAULT_NAME, choices=list(CATALOG),
                    help="which model of the catalogue (--list shows them)")
    ap.add_argument("--list", action="store_true", help="list the catalogue and exit")
    a = ap.parse_args(argv)
    if a.list:
        for n, spec in CATALOG.items():
            print(f"{n:14} {spec.file:36} {spec.about}")
        return 0
    try:
        print(fetch(a.name, Settings.from_args(a).models_path()))
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _proc(name: str):
    def start(argv) -> int:
        import importlib
        import logging
        import os
        import zmq
        rc = importlib.import_module(f"procs.{name}.server").run(argv)
        # deliver what is queued (at most 300 ms), then skip the interpreter's slow teardown
        # of torch and friends, so every process exits well within honcho's 5 s
        zmq.Context.instance().destroy(linger=300)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return start


# gunicorn's arguments for the web process; the HTTP limits answer 414/431 before the app
GUNICORN = ["-k", "asgi", "--asgi-loop", "uvloop", "--graceful-timeout", "3", "--no-control-socket",
            "--limit-request-line", "8190", "--limit-request-fields", "100",
            "--limit-request-field_size", "8190"]


def _web(argv) -> int:
    """The web process: its options are flags here, handed to gunicorn's workers as RICORDO_*
    (gunicorn owns their argv); then this process becomes gunicorn (same pid, so a process
    manager's signals reach it)."""
    import dataclasses
    import os
    import shutil
    from common.config import Settings
    ap = Settings.parser("web", "ricordo web")
    ap.add_argument("--host", default=os.environ.get("RICORDO_HOST", "127.0.0.1"),
                    help="bind address [env RICORDO_HOST]")
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")), help="HTTP port [env PORT]")
    ap.add_argument("--workers", type=int, default=int(os.environ.get("WEB_CONCURRENCY", "1")),
                    help="gunicorn worker processes [env WEB_CONCURRENCY]")
    a = ap.parse_args(argv)
    s = Settings.from_args(a)
    env = dict(os.environ)
    for f in dataclasses.fields(Settings):
        if "web" in f.metadata["procs"]:
            v = getattr(s, f.name)
            env["RICORDO_" + f.name.upper()] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    env["WEB_CONCURRENCY"] = str(a.workers)
    exe = os.path.join(os.path.dirname(sys.executable), "gunicorn")
    exe = exe if os.path.exists(exe) else shutil.which("gunicorn") or "gunicorn"
    os.execve(exe, [exe, *GUNICORN, "--bind", f"{a.host}:{a.port}", "procs.frontend.app:get_app()"], env)


def _config(argv) -> int:
    """Every option as a Markdown table (the README's table is this output)."""
    from common.config import Settings
    if argv not in ([], ["--markdown"]):
        print("usage: ricordo config [--markdown]", file=sys.stderr)
        return 2
    sys.stdout.write(Settings.markdown())
    return 0


def _cache(argv) -> int:
    from procs import cachecli     # imported on use: the other commands do not need it
    return cachecli.main(argv)


COMMANDS = {"generate": _generate, "fetch-model": _fetch, "cache": _cache, "config": _config, "web": _web,
            "renderer": _proc("renderer"), "inference": _proc("inference"),
            "persister": _proc("persister")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: ricordo {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
