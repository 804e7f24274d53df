"""Tokenizer, token pieces and chat template, built from a GGUF file or a Hugging Face dir.

Invariant: for every token id, `pieces[id]` is the exact byte string that id stands for
(special tokens as their literal text; SentencePiece vocabularies: see tokenizer_spm), so
the concatenation of a prompt's pieces is the prompt's bytes. The cache text of a checkpoint
is built from these pieces.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache

import jinja2
import numpy as np
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from common import templates, tokenizer_spm
from common.gguf_file import GGUFFile

# llama.cpp's pre-tokenizer regexes by tokenizer.ggml.pre (the ones we support)
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2/Qwen3 (tokenizer.ggml.pre "qwen2"): llama3's regex with single digits; llama.cpp
# writes tokenizer.json's (?i:'s|...) as explicit case classes, which onig needs neither way
_QWEN2_RE = _LLAMA3_RE.replace(r"|\p{N}{1,3}|", r"|\p{N}|")
_QWEN2_LIKE = {"qwen2", "stablelm2", "hunyuan"}
# o200k (tokenizer.ggml.pre "gpt-4o": gpt-oss): a word is an optional leading non-letter, then
# capitals then lower case (or capitals alone), with its contraction; up to 3 digits; punctuation
# runs take trailing newlines and slashes
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken (tokenizer.ggml.pre "tekken": Mistral Nemo, Small 3.x, Devstral, Ministral 3): o200k's
# words without their contractions, digits one by one (tekken.json's config.pattern)
_TEKKEN_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT_CACHE_SIZE = 32     # piece_bytes results of tuples kept (a few per resident session)
TEXT_CACHE_MIN = 1024    # ids in a tuple worth keeping its bytes for
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_LIKE = {"gpt2", "default", "olmo", "jais"}
_LLAMA3_LIKE = {"llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe"}
# GLM-4 / 4.5: Llama 3's split without its whole-word shortcut, no BOS (llama.cpp's CHATGLM4;
# the template writes [gMASK]<sop> itself)
_GLM4_LIKE = {"glm4", "chatglm-bpe"}

# end-of-turn markers a chat model may emit instead of its declared EOS
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
              "<|end|>", "</s>", "<|return|>", "<|call|>")
# Harmony (gpt-oss) ends an answer at <|return|> or <|call|>; its <|end|> ends one message of
# several (reasoning, then the answer or a call): no stop there (llama.cpp's rule alike)
_HARMONY_ENDS = ("<|return|>", "<|call|>")


class TokenizerError(ValueError):
    pass


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class TextModel:
    """Everything text-side a process needs: tokenizer, pieces, template, special ids."""
    tokenizer: Tokenizer
    pieces: list[bytes]
    chat_template: str | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: set[int] = field(default_factory=set)
    template_kwargs: dict = field(default_factory=dict)   # the server's extra template variables
    # piece_bytes of tuples of ids (the resident sessions' ids the renderer mirrors, asked
    # for at every plan): id(tuple) -> (the tuple, its bytes). A tuple never changes, and the
    # entry holds it, so its id is not reused while the entry lives.
    _texts: dict = field(default_factory=dict, repr=False, compare=False)
    _lengths: object = field(default=None, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of text, special tokens parsed, never a BOS added. Bytes that are not
        UTF-8 (a suffix that starts or ends inside a character) become single-byte tokens,
        so the pieces of the ids are always exactly the bytes given (SentencePiece: but for
        a U+2581 in the text, which llama.cpp's ids make a space; see tokenizer_spm)."""
        if isinstance(text, str):
            return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []
        ids, rest = [], text
        while rest:
            try:
                return ids + self.encode(rest.decode("utf-8"))
            except UnicodeDecodeError as e:
                ids += self.encode(rest[:e.start].decode("utf-8"))
                ids += [self._byte_id(b) for b in rest[e.start:max(e.end, e.start + 1)]]
                rest = rest[max(e.end, e.start + 1):]
        return ids

    def _byte_id(self, b: int) -> int:
        if not hasattr(self, "_byte_ids"):
            self._byte_ids = {p[0]: i for i, p in enumerate(self.pieces) if len(p) == 1}
        return self._byte_ids[b]

    def piece_bytes(self, ids) -> bytes:
        if not isinstance(ids, tuple):
            return b"".join(map(self.pieces.__getitem__, ids))
        hit = self._texts.get(id(ids))
        if hit is not None and hit[0] is ids:
            return hit[1]
        out = b"".join(map(self.pieces.__getitem__, ids))
        if len(ids) >= TEXT_CACHE_MIN:
            self._texts[id(ids)] = (ids, out)
            while len(self._texts) > TEXT_CACHE_SIZE:
                self._texts.pop(next(iter(self._texts)))
        return out

    def byte_ends(self, ids) -> np.ndarray:
        """The prompt's byte offset after each of ids (int64, cumulative piece lengths)."""
        if self._lengths is None:
            self._lengths = np.fromiter(map(len, self.pieces), dtype=np.int64, count=len(self.pieces))
        return np.cumsum(self._lengths[np.asarray(ids, dtype=np.int64)])

    def bos_text(self) -> bytes:
        """What to put in front of a prompt so that BOS is part of its bytes, if the model wants one."""
        return self.pieces[self.bos_id] if self.add_bos and self.bos_id is not None else b""

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise TokenizerError("the model has no chat template")
        tpl = _compile_template(self.chat_template)
        bos = self.pieces[self.bos_id].decode("utf-8", "replace") if self.bos_id is not None else ""
        eos = self.pieces[self.eos_id].decode("utf-8", "replace") if self.eos_id is not None else ""
        return tpl.render(**{**self.template_kwargs, **extra}, messages=messages,
                          add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)


def template_kwargs(text: str, where: str) -> dict:
    """Extra template variables from JSON text ("" -> none); ValueError saying what is wrong."""
    if not text:
        return {}
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(v, dict):
        raise ValueError(f"{where}: must be a JSON object")
    taken = sorted(templates.RESERVED_VARS & set(v))
    if taken:
        raise ValueError(f"{where}: {', '.join(taken)} are set by the server")
    return v


def _raise(msg):
    raise jinja2.TemplateError(msg)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens
    with it for training masks): its body, rendered as is."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(v, indent=None, separators=None, sort_keys=False):
    return json.dumps(v, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def _compile_template(src: str) -> jinja2.Template:
    """The environment Hugging Face renders chat templates in (models' templates are written
    for it): sandboxed, immutable, trim/lstrip blocks, `{% break %}`/`{% continue %}`,
    `{% generation %}`, `raise_exception`, `strftime_now`, and `tojson` with its keyword
    arguments, non-ASCII kept."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       keep_trailing_newline=True,
                                                       extensions=["jinja2.ext.loopcontrols", _Generation])
    env.globals["raise_exception"] = _raise
    # as llama.cpp and transformers give it: Mistral Small 3.x's templates call it unguarded
    # (without it every request is refused); a template that prints the date changes its
    # prompt, and so misses the cache, once a day
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(src)


def _finish(tok: Tokenizer, pieces, template, bos, eos, add_bos, ends=()) -> TextModel:
    """ends: more ids that end an answer, as the file declares them (GLM: <|user|> and
    <|observation|>, GGUF eot/eom ids or generation_config's eos list)."""
    stop = {eos} if eos is not None else set()
    stop |= {i for i in ends if i is not None and 0 <= i < len(pieces)}
    texts = {}
    for i, p in enumerate(pieces):
        t = p.decode("utf-8", "replace")
        if t in _EOG_TEXTS:
            stop.add(i)
            texts[t] = i
    if all(t in texts for t in _HARMONY_ENDS) and "<|end|>" in texts:
        stop.discard(texts["<|end|>"])
    return TextModel(tok, pieces, template, bos, eos, add_bos, stop)


def from_gguf(g: GGUFFile) -> TextModel:
    m = g.meta
    kind = m.get("tokenizer.ggml.model")
    template = m.get("tokenizer.chat_template") or templates.fallback(g.arch())
    if kind == "llama":
        tok, pieces = tokenizer_spm.build(m)
        return _finish(tok, pieces, template, _opt_id(m, "bos"), _opt_id(m, "eos"),
                       bool(m.get("tokenizer.ggml.add_bos_token", True)), (_opt_id(m, "eot"), _opt_id(m, "eom")))
    if kind != "gpt2":
        raise TokenizerError(f"unsupported tokenizer model {kind!r} "
                             "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)")
    tokens = list(m["tokenizer.ggml.tokens"])
    types = m.get("tokenizer.ggml.token_type")
    merges = [tuple(x.split(" ", 1)) for x in m.get("tokenizer.ggml.merges", [])]
    pre = str(m.get("tokenizer.ggml.pre", "default"))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, ignore_merges=pre in _LLAMA3_LIKE or pre in ("gpt-4o", "tekken"))
    tok = Tokenizer(bpe)
    if pre in _DIGITS_FIRST or pre in _GPT2_LIKE:
        regex = _GPT2_RE
    elif pre in _LLAMA3_LIKE or pre in _GLM4_LIKE:
        regex = _LLAMA3_RE
    elif pre in _QWEN2_LIKE:
        regex = _QWEN2_RE
    elif pre == "gpt-4o":
        regex = _GPT4O_RE
    elif pre == "tekken":
        regex = _TEKKEN_RE
    else:
        raise TokenizerError(f"unsupported pre-tokenizer {pre!r}")
    seq = []
    if pre in _DIGITS_FIRST:
        seq.append(pre_tokenizers.Digits(individual_digits=True))
    seq += [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(seq)
    tok.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(types)] if types is not None else []
    special = [i for i in special if int(types[i]) in (3, 4)]  # CONTROL, USER_DEFINED
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in special])
    bd = _byte_decoder()
    special_set = set(special)
    pieces = []
    for i, t in enumerate(tokens):
        if i in special_set or any(c not in bd for c in t):
            pieces.append(t.encode("utf-8"))
        else:
            pieces.append(bytes(bd[c] for c in t))
    # a tekken file without the key starts with BOS, as llama.cpp's loader defaults it
    add_bos = bool(m.get("tokenizer.ggml.add_bos_token", pre == "tekken")) and pre not in _GLM4_LIKE
    return _finish(tok, pieces, template, None if pre in _GLM4_LIKE else _opt_id(m, "bos"), _opt_id(m, "eos"),
                   add_bos, (_opt_id(m, "eot"), _opt_id(m, "eom")))


def _opt_id(m: dict, name: str) -> int | None:
    v = m.get(f"tokenizer.ggml.{name}_token_id")
    return None if v is None else int(v)


def _template_file(path: str) -> str | None:
    """The chat template a dir keeps beside tokenizer_config.json, as transformers saves it
    now (chat_template.jinja, which it prefers) or a multimodal processor did
    (chat_template.json)."""
    jinja, js = os.path.join(path, "chat_template.jinja"), os.path.join(path, "chat_template.json")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    if os.path.exists(js):
        with open(js) as f:
            return json.load(f).get("chat_template")
    return None


def from_hf_dir(path: str) -> TextModel:
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    cfg = {}
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1
    inv = [""] * n
    for t, i in vocab.items():
        inv[i] = t
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    bd = _byte_decoder()
    pieces = [t.encode() if (t in added or any(c not in bd for c in t)) else bytes(bd[c] for c in t)
              for t in inv]

    def tid(key):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if v else None
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    template = _template_file(path) or template
    ends = ()
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):       # GLM, Llama 3: more than one id ends an answer
        with open(gen_path) as f:
            e = json.load(f).get("eos_token_id")
        ends = tuple(int(x) for x in (e if isinstance(e, list) else [e] if e is not None else []))
    return _finish(tok, pieces, template, tid("bos_token"), tid("eos_token"),
                   bool(cfg.get("add_bos_token", False)), ends)
