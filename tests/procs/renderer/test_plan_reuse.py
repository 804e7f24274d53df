"""plan_reuse (procs/renderer/prompt.py) keeps the live tokens whose text the new prompt starts
with, when the session's text and the prompt part only near its end: a call sampled in
another tokenization than the prompt's text gets (its tokens were the model's), ended by a
stop token the template renders otherwise."""
from __future__ import annotations

from procs.renderer.prompt import plan_reuse


def test_the_live_tokens_whose_text_the_prompt_starts_with_are_kept(text_model):
    t = text_model
    head = t.encode("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    call = '{"city": "Oslo", "unit": "C"}'
    single = {p: i for i, p in enumerate(t.pieces) if len(p) == 1}
    sampled = [single[bytes([b])] for b in call.encode()]       # not how the text tokenizes
    im_end = t.encode("<|im_end|>")
    assert len(im_end) == 1
    live = head + sampled + im_end          # the session: prompt, answer, the stop token run into it
    prompt = t.piece_bytes(head) + call.encode() + b"<|call|>\nthe result"
    full = t.encode(prompt)
    k = next(i for i, (a, b) in enumerate(zip(full, live)) if a != b)
    assert k < len(head) + len(sampled)     # the ids in common end inside the answer
    got, reuse = plan_reuse(t, prompt, full, live, 8)
    assert reuse == len(live) - 1 and got[:reuse] == live[:reuse] and t.piece_bytes(got) == prompt
    # a live token whose text the prompt holds only in part is not kept
    cut = prompt[:len(t.piece_bytes(head)) + 5] + b"X" + prompt[len(t.piece_bytes(head)) + 6:]
    got, reuse = plan_reuse(t, cut, t.encode(cut), live, 8)
    assert reuse == len(head) + 5 and t.piece_bytes(got) == cut
    # under --kv-cache-min-tokens it is the ids in common, as before
    _, reuse = plan_reuse(t, prompt, full, live, len(live))
    assert reuse == 0
