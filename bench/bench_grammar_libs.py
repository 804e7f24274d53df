"""Constrained-decoding libraries compared on this CPU: llguidance vs xgrammar.

    PYTHONPATH=. python bench/bench_grammar_libs.py [--repeats 7] [--model PATH]

For each importable library: set-up time for the default model's vocabulary, compile time of a
24-tool "tool call" grammar (~64 KB of JSON Schemas, the size of Claude Code's tool list) and of
one small schema, and the per-token mask cost while stepping through a valid call tokenized by
the model's own tokenizer. Every figure is a median over --repeats runs (a shared 2-core machine).

Columns: setup = tokenizer + compiler for the vocabulary; compile = schema text to a usable grammar
(llguidance: a matcher, as it compiles per matcher; xgrammar: a CompiledGrammar); matcher new = a
request's matcher for the compiled tools grammar; 1st mask = the first mask of a fresh matcher
(lazy work lands there); forbidden = tokens of the valid call that a mask ruled out (must be 0).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import cpu_name  # noqa: E402
from common.models import DEFAULT_FILE, load_text  # noqa: E402

SUFFIX = "\n</tool_call>"
TOOL_NAMES = ["Task", "Bash", "Glob", "Grep", "LS", "ExitPlanMode", "Read", "Edit", "MultiEdit",
              "Write", "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput",
              "KillShell", "SlashCommand", "AskUserQuestion", "Skill", "ListMcpResources",
              "ReadMcpResource", "mcp__ide__getDiagnostics", "mcp__ide__executeCode", "NotebookRead"]
WORDS = ("the file path to operate on must be absolute not relative when this parameter is given "
         "results are limited to matching entries and sorted by modification time use it to "
         "narrow the search the default applies if omitted never pass secrets or credentials "
         "only one of these may be set at a time output longer than the limit is truncated").split()
KEYS = ("file_path command timeout pattern path glob output_mode offset limit old_string new_string "
        "replace_all url prompt query description subagent_type todos status content cell_id "
        "edit_mode allowed_domains blocked_domains run_in_background shell_id header options "
        "multi_select server uri language context head_limit case_insensitive line_numbers").split()


def prose(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random but realistic property schema: the shapes that tool schemas really use."""
    kinds = ["string", "string", "integer", "number", "boolean", "enum", "array", "object"]
    kind = rng.choice(kinds if depth < 2 else kinds[:6])
    s: dict = {"description": prose(rng, rng.randint(8, 40))}
    if kind == "enum":
        s.update(type="string", enum=[f"{rng.choice(KEYS)}_{i}" for i in range(rng.randint(2, 6))])
    elif kind in ("integer", "number"):
        s.update(type=kind, minimum=0, maximum=rng.choice([10, 600000, 1e6]))
    elif kind == "array":
        s.update(type="array", items=gen_schema(rng, depth + 1), minItems=rng.randint(0, 1))
    elif kind == "object":
        s.update(gen_object(rng, depth + 1, rng.randint(2, 4)))
    else:
        s["type"] = kind
    return s


def gen_object(rng: random.Random, depth: int, n: int) -> dict:
    props = {f"{rng.choice(KEYS)}_{k}": gen_schema(rng, depth) for k in range(n)}
    req = [k for k in props if rng.random() < 0.5] or [next(iter(props))]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def gen_tools(target_bytes: int = 64_000) -> list[tuple[str, dict]]:
    """24 tool schemas, grown round-robin by one property until their JSON totals target_bytes."""
    rng = random.Random(1234)
    tools = [(name, gen_object(rng, 0, 1)) for name in TOOL_NAMES]
    i = 0
    while sum(len(json.dumps(s)) for _, s in tools) < target_bytes:
        obj = tools[i % len(tools)][1]
        key = f"{rng.choice(KEYS)}_{len(obj['properties'])}"
        obj["properties"][key] = gen_schema(rng)
        if rng.random() < 0.4:
            obj["required"].append(key)
        i += 1
    return tools


def gen_value(s: dict, rng: random.Random):
    """A valid instance; object keys in schema order, which both libraries enforce."""
    if "enum" in s:
        return rng.choice(s["enum"])
    t = s["type"]
    if t == "object":
        return {k: gen_value(v, rng) for k, v in s["properties"].items()
                if k in s["required"] or rng.random() < 0.5}
    if t == "array":
        return [gen_value(s["items"], rng) for _ in range(rng.randint(max(1, s["minItems"]), 3))]
    if t == "integer":
        return rng.randint(0, 10)
    if t == "number":
        return round(rng.uniform(0, 10), 3)
    if t == "boolean":
        return rng.random() < 0.5
    return prose(rng, rng.randint(2, 30)) + ' /src/a "quoted" \u00e9'  # escapes and UTF-8 too


def tool_call_schema(tools) -> dict:
    # one schema for both libraries: the "name" const selects which "arguments" schema applies
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for n, s in tools]}


SMALL = {"type": "object", "additionalProperties": False, "required": ["location"], "properties": {
    "location": {"type": "string", "description": "City and country"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}}}


class LLG:
    name = "llguidance"

    def __init__(self, t):
        import llguidance as m
        self.m, self.t = m, t

    def setup(self):
        t = self.t
        special = [i for i, a in t.tokenizer.get_added_tokens_decoder().items() if a.special]

        class Tok:  # the attributes TokenizerWrapper reads; called with bytes
            eos_token_id, bos_token_id, tokens, special_token_ids = t.eos_id, t.bos_id, t.pieces, special

            def __call__(self, b: bytes):
                return t.encode(b)
        self.tok = self.m.LLTokenizer(self.m.TokenizerWrapper(Tok()), eos_token=sorted(t.stop_ids))

    def compile(self, schema, suffix):
        # llguidance compiles when a matcher is made (once per request); the lexer is built lazily
        body = f"start: call {json.dumps(suffix)}\n" if suffix else "start: call\n"
        lark = body + "call: %json " + json.dumps(schema) + "\n"
        if (m := self.matcher(lark)).is_error():
            raise RuntimeError(m.get_error())
        return lark

    def matcher(self, compiled):
        return self.m.LLMatcher(self.tok, self.m.LLMatcher.grammar_from_lark(compiled), log_level=0)

    def mask(self, m):
        return m.compute_bitmask()

    def allowed(self, mask, tid):
        return (mask[tid >> 3] >> (tid & 7)) & 1

    def accept(self, m, tid):
        return m.consume_token(tid) and not m.is_error()


class XGR:
    name = "xgrammar"

    def __init__(self, t):
        import xgrammar as x
        self.x, self.t = x, t

    def setup(self):
        # special tokens as b"" so xgrammar treats them as special (else "<|im_end|>" is text)
        sp = {i for i, a in self.t.tokenizer.get_added_tokens_decoder().items() if a.special}
        vocab = [b"" if i in sp else p for i, p in enumerate(self.t.pieces)]
        info = self.x.TokenizerInfo(vocab, self.x.VocabType.RAW, stop_token_ids=sorted(self.t.stop_ids))
        # no cache, or every repeat after the first would time a cache hit
        self.c = self.x.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.bm = self.x.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema, suffix):
        g = self.x.Grammar.from_json_schema(json.dumps(schema))
        if suffix:
            g = self.x.Grammar.concat(g, self.x.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
        return self.c.compile_grammar(g)

    def matcher(self, compiled):
        return self.x.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.bm)
        return self.bm

    def allowed(self, mask, tid):
        return (int(mask[0, tid >> 5]) >> (tid & 31)) & 1

    def accept(self, m, tid):
        return m.accept_token(tid)


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), res


def step_costs(lib, compiled, ids, eos, repeats):
    """Per-token mask times (µs) over `repeats` passes, each on a fresh matcher as a request gets;
    also the first mask of each pass (cold) and the mismatches (tokens the mask forbade)."""
    times, first, bad = [], [], 0
    for _ in range(repeats):
        m = lib.matcher(compiled)
        for k, tid in enumerate(ids + [eos]):
            t0 = time.perf_counter()
            mask = lib.mask(m)
            (first if k == 0 else times).append((time.perf_counter() - t0) * 1e6)
            bad += not lib.allowed(mask, tid)
            if tid != eos and not lib.accept(m, tid):
                raise RuntimeError(f"{lib.name}: token {k} ({tid}) rejected")
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))], statistics.median(first), bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser(f"~/.cache/ricordo/models/{DEFAULT_FILE}"))
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    t, tools = load_text(a.model), gen_tools()
    big, rng = tool_call_schema(tools), random.Random(7)
    # the call the mask is stepped through: the biggest tool's arguments, model-style spacing
    tname, tschema = max(tools, key=lambda x: len(json.dumps(x[1])))
    big_ids = t.encode(json.dumps({"name": tname, "arguments": gen_value(tschema, rng)},
                                  ensure_ascii=False) + SUFFIX)
    small_ids = t.encode(json.dumps({"location": "Paris, France", "unit": "celsius", "days": 3}))
    print(f"model: {os.path.basename(a.model)}, vocab {len(t.pieces)}; tools: {len(tools)}, "
          f"{sum(len(json.dumps(s)) for _, s in tools)} bytes of schemas; "
          f"stepped call: {tname}, {len(big_ids)} tokens; small: {len(small_ids)} tokens; "
          f"medians of {a.repeats} runs")
    libs = []
    for cls in (LLG, XGR):
        try:
            libs.append(cls(t))
            print(f"{cls.name} {importlib.metadata.version(cls.name)}")
        except ImportError as e:
            print(f"skip {cls.name}: not importable ({e})")
    rows = []
    for lib in libs:
        setup_s, _ = timed(lib.setup, a.repeats)
        big_s, big_c = timed(lambda: lib.compile(big, SUFFIX), a.repeats)
        small_s, small_c = timed(lambda: lib.compile(SMALL, ""), a.repeats)
        mk_s, _ = timed(lambda: lib.matcher(big_c), a.repeats)
        bmed, bp90, bfirst, bbad = step_costs(lib, big_c, big_ids, t.eos_id, a.repeats)
        smed, sp90, _, sbad = step_costs(lib, small_c, small_ids, t.eos_id, a.repeats)
        rows.append((lib.name, setup_s * 1e3, big_s * 1e3, small_s * 1e3, mk_s * 1e3, bfirst,
                     bmed, bp90, smed, sp90, bbad + sbad))
    hdr = ("library", "setup ms", "tools compile ms", "small compile ms", "matcher new ms",
           "tools 1st mask µs", "tools mask med µs", "tools mask p90 µs", "small mask med µs",
           "small mask p90 µs", "forbidden")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in rows:
        print("| " + " | ".join([r[0]] + [f"{v:.1f}" for v in r[1:-1]] + [str(r[-1])]) + " |")


if __name__ == "__main__":
    main()
