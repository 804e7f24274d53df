"""The built-in chat templates used when a GGUF carries none (common/templates.py)."""
from __future__ import annotations

from common.templates import GEMMA, fallback
from common.tokenizer import _compile_template


def render(msgs, gen=True):
    return _compile_template(GEMMA).render(messages=msgs, add_generation_prompt=gen)


def test_gemma_turns():
    got = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": " Hello! "}, {"role": "tool", "content": "42"},
                  {"role": "system", "content": "late"}])
    assert got == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                   "<start_of_turn>model\n Hello! <end_of_turn>\n"          # content as is: exact replay
                   "<start_of_turn>user\n<tool_response>\n42\n</tool_response><end_of_turn>\n"
                   "<start_of_turn>user\nlate<end_of_turn>\n<start_of_turn>model\n")
    assert render([{"role": "user", "content": "x"}], gen=False) == "<start_of_turn>user\nx<end_of_turn>\n"
    assert render([{"role": "assistant", "content": None}], gen=False) == "<start_of_turn>model\n<end_of_turn>\n"


def test_gemma_system_alone_is_the_prefix_of_every_conversation_it_starts():
    system = [{"role": "system", "content": "tools..."}]
    whole = render(system + [{"role": "user", "content": "q"}])
    assert whole.startswith(render(system, gen=False))
    assert render(system).endswith("<end_of_turn>\n<start_of_turn>model\n")


def test_fallback_by_architecture():
    assert fallback("gemma3") == GEMMA and fallback("llama") is None


def test_the_environment_models_templates_are_written_for():
    """Loop controls, `{% generation %}` and tojson's keyword arguments, as Hugging Face's
    environment has them (models' templates use them; a missing one is a 400 at render)."""
    src = ("{%- for m in messages -%}{%- if m.role == 'stop' -%}{%- break -%}{%- endif -%}"
           "{%- if m.role == 'skip' -%}{%- continue -%}{%- endif -%}"
           "{{ m | tojson(separators=(',', ':'), sort_keys=true) }}{%- endfor -%}"
           "{% generation %}{{ {'é': 1} | tojson(indent=1) }}{% endgeneration %}")
    got = _compile_template(src).render(messages=[{"role": "u", "b": 1}, {"role": "skip"}, {"role": "stop"},
                                                  {"role": "late"}])
    assert got == '{"b":1,"role":"u"}{\n "é": 1\n}'


def test_strftime_now_is_today():
    import datetime
    assert _compile_template("{{ strftime_now('%Y-%m-%d') }}").render() == datetime.date.today().isoformat()
