"""Reference vectors from llama.cpp (llama-cpp-python) for a GGUF model: token ids, teacher-
forced top-k log-probabilities, greedy continuations. See the README next to each JSON.

    python tests/data/make_vectors.py gemma3 PATH/gemma-3-270m-q4_k_m.gguf

writes tests/data/gemma3-270m-q4_k_m.json. Needs `pip install llama-cpp-python==0.3.36`.
Only the Gemma 3 set is defined here (the SmolLM2 file predates this script).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from common.models import sha256_file  # noqa: E402

TOP_K = 10
GREEDY = 24


def gemma_chat(*turns: tuple[str, str]) -> str:
    """Gemma's chat format (the GGUF carries no template), ending with the model's turn."""
    return "".join(f"<start_of_turn>{role}\n{text}<end_of_turn>\n" for role, text in turns) + \
        "<start_of_turn>model\n"


LONG_CODE = '''import os
import sys
from dataclasses import dataclass, field


@dataclass
class Config:
    """Settings read from the environment."""
    name: str = "ricordo"
    workers: int = 2
    tags: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> "Config":
        cfg = cls()
        if "WORKERS" in os.environ:
            cfg.workers = int(os.environ["WORKERS"])
        for tag in os.environ.get("TAGS", "").split(","):
            if tag.strip():
                cfg.tags.append(tag.strip())
        return cfg


def main(argv: list[str]) -> int:
\tcfg = Config.from_env()
\tif len(argv) > 1 and argv[1] in ("-h", "--help"):
\t\tprint(__doc__)
\t\treturn 0
\tprint(f"{cfg.name}: {cfg.workers} workers, tags={cfg.tags!r}")
\treturn 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''

# ~1,100 tokens: twice the 512-token sliding window, so the windowed layers' mask and the
# global layers' full attention both matter
LONG_LOG = "".join(
    f"{i:03d} INFO worker-{i % 4} handled POST /v1/chat/completions in {(i * 37) % 97 / 10:.1f} ms "
    f"(cache {'hit' if i % 3 else 'miss'}, {i * 113 % 4096} tokens)\n" for i in range(31))

GEMMA3_CASES = [
    ("chat_two_turns", gemma_chat(("user", "Ciao"), ("model", "Ciao! How can I help you today?"),
                                  ("user", "Come stai?"))),
    ("chat_question", gemma_chat(("user", "What is the capital of France? Answer in one word."))),
    ("prose_en", "The history of the printing press begins in the fifteenth century, when Johannes "
                 "Gutenberg combined movable metal type with an oil-based ink and a screw press."),
    ("code_python", "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
                    "    if n < 2:\n        return n\n\ta, b = 0, 1\n\tfor _ in range(n - 1):\n"
                    "\t\ta, b = b, a + b\n    return b\n"),
    ("unicode_mix", "Prices: 3.14€, 42£ and ¥1000 — naïve café ☕ façade; emoji 🙂🚀; CJK 你好世界; "
                    "Русский текст; العربية; हिन्दी; 한국어 문장"),
    ("numbers", "In 2024 the population was 8,118,835,999; by 2050 it may reach 9.7 billion "
                "(+19.5%), i.e. about 0.0123 per 1e3."),
    ("chat_json", gemma_chat(("user", "Reply with JSON: {\"city\": \"Rome\", \"temp_c\": 21}"))),
    ("long_log", LONG_LOG),
]

GEMMA3_TOKENIZER_CASES = [
    "1234567890 12 345 6789.0001 -42e10 0x1F",
    "   leading spaces\n\n\n\ttabs\t\tand trailing   ",
    "a  b   c    d     e" + " " * 40 + "f" + "\n" * 40 + "g" + "\t" * 35 + "h",
    "line one\nline two\r\nline three\r\n\r\n\rend\n",
    "def f(x):\r\n\treturn x**2  # comment\r\n",
    " x", "  x", "\tx", "\nx", "x ", "▁x ▁▁y",
    "<start_of_turn>user\n<end_of_turn><eos><bos>text<start_of_turn>model\nok<end_of_turn>",
    "glued<start_of_turn>text<end_of_turn>more<pad>x<mask>y",
    "<unused5> and <unused50><unused5>x<unused6241>",
    "<start_of_image><end_of_image>[multimodal]",
    "<0x41> <0x0A> literal byte-token texts <0xZZ>",
    "rare CJK 𠜎𠜱𠝹𠱓 𪚥 and control chars \x01\x02\x1b[0m\x7f",
    "emoji 👩\u200d💻🏳️\u200d🌈👨\u200d👩\u200d👧\u200d👦 and zero-width\u200bjoiner and combining e\u0301",
    "ÀÉÎÕÜ àéîõü ß Œ œ Ø ø — – … «guillemets» “quotes” ‘single’",
    "Привет мир. Γειά σου κόσμε. مرحبا بالعالم. שלום עולם. こんにちは世界。ภาษาไทย",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa abababababababab ________________ ----------------",
    "",
    LONG_CODE,
]

SETS = {
    "gemma3": dict(out="gemma3-270m-q4_k_m.json", cases=GEMMA3_CASES,
                   tokenizer_cases=GEMMA3_TOKENIZER_CASES,
                   model="gemma-3-270m-q4_k_m.gguf"),
}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("set", choices=sorted(SETS))
    ap.add_argument("model")
    args = ap.parse_args()
    spec = SETS[args.set]
    import llama_cpp
    import llama_cpp.llama_cpp as lc
    default_params = lc.llama_model_default_params

    def plain_cpu_params():
        # no "extra" buffer types (AMX, CPU repacking): on a CPU that reports AMX in a VM that
        # does not grant the tile state, ggml's AMX matmul dies on its first ldtilecfg
        p = default_params()
        p.use_extra_bufts = False
        return p
    lc.llama_model_default_params = plain_cpu_params   # Llama() takes its defaults from here
    llm = llama_cpp.Llama(args.model, n_ctx=2048, n_batch=2048, logits_all=True, verbose=False,
                          seed=0)

    def tokenize(text: str) -> list[int]:
        # special tokens parsed, no BOS: the text side's encode() contract
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) if text else []

    bos = llm.token_bos()
    cases = []
    for name, text in spec["cases"]:
        ids = tokenize(text)
        # llama.cpp puts BOS in front for this model (add_bos_token true): teacher forcing runs
        # over [BOS] + ids; positions[i] is the distribution after BOS + ids[: i + 1]
        llm.reset()
        llm.eval([bos] + ids)
        lp = log_softmax(np.asarray(llm.scores[1:len(ids) + 1]))
        positions = []
        for row in lp:
            top = np.argsort(-row, kind="stable")[:TOP_K]
            positions.append({"top_ids": [int(i) for i in top],
                              "top_logprobs": [round(float(row[i]), 5) for i in top]})
        # greedy continuation of the same [BOS] + ids, up to GREEDY tokens, stopping before an
        # end-of-generation token (not included)
        out = []
        for tok in llm.generate([bos] + ids, top_k=1, temp=0.0, reset=True):
            if _is_eog(llm, tok):
                break
            out.append(int(tok))
            if len(out) == GREEDY:
                break
        cases.append({"name": name, "text": text, "token_ids": ids, "positions": positions,
                      "greedy_continuation_ids": out,
                      "greedy_continuation_text": llm.detokenize(out, special=True)
                      .decode("utf-8", "replace")})
        print(name, len(ids), repr(cases[-1]["greedy_continuation_text"]))
    tcases = [{"text": t, "token_ids": tokenize(t)} for t in spec["tokenizer_cases"]]
    sha = sha256_file(args.model)
    doc = {"model": f"{os.path.basename(args.model)} (SHA256 {sha})",
           "engine": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}, CPU, n_batch 2048, "
                     "use_extra_bufts false (no AMX, no repacking)",
           "top_k": TOP_K, "cases": cases, "tokenizer_cases": tcases}
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), spec["out"])
    with open(out_path, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote", out_path)


def _is_eog(llm, tok: int) -> bool:
    import llama_cpp
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return bool(llama_cpp.llama_vocab_is_eog(vocab, tok))


if __name__ == "__main__":
    main()
