"""A server's cache directory seen from outside, as the end-to-end and stress tests look at
it: its entries, temp files, when the persister has settled, which entry a lookup must pick.
"""
from __future__ import annotations

import functools
import os
import time

from common import kvfile


def entries(d) -> dict[str, int]:
    """Cache entries in d (only `<40 hex>.kv` names): {sha1: size}; {} for no directory."""
    out = {}
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for name in names:
        if kvfile.is_entry_name(name):
            try:
                out[name[:-3]] = os.path.getsize(os.path.join(d, name))
            except FileNotFoundError:
                pass
    return out


def temp_files(d) -> list[str]:
    try:
        return sorted(n for n in os.listdir(d) if ".kv.tmp." in n)
    except FileNotFoundError:
        return []


def settle(d, trace_path, quiet: float = 1.2, timeout: float = 30.0) -> None:
    """Wait until the directory and the trace stop changing (the persister writes shortly
    after the prefill that asked for a checkpoint)."""
    def state():
        try:
            t = os.path.getsize(trace_path)
        except FileNotFoundError:
            t = 0
        return t, tuple(sorted(entries(d).items())), tuple(temp_files(d))
    last, since = state(), time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = state()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
    raise AssertionError(f"{d} still changing after {timeout} s")


def longest_prefix_entry(d, prompt: bytes) -> str | None:
    """The entry a lookup must pick: the longest cache text that is a byte prefix of prompt."""
    best, best_len = None, -1
    for sha in entries(d):
        try:
            text = kvfile.read_text(os.path.join(d, sha + ".kv"))
        except (OSError, kvfile.KVFileError):
            continue
        if prompt.startswith(text) and len(text) > best_len:
            best, best_len = sha, len(text)
    return best


@functools.lru_cache(maxsize=1)
def text_model():
    """The default model's tokenizer and template (what the renderer uses)."""
    from common.config import Settings
    from common.models import load_text, resolve
    return load_text(resolve("", Settings().models_path()))
