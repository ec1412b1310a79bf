"""Drives `tessera serve` with the official `openai` Python client.

Usage: python3 openai_client.py BASE_URL API_KEY

Every check is an assert (a failure exits non-zero with its traceback); on success it
prints one JSON object with what the Rust test (tests/serve_openai.rs) compares against
raw HTTP requests to the same server.
"""

import json
import sys

import openai

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def main() -> None:
    base_url, key = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    out = {"openai_version": openai.__version__}

    # Chat, whole.
    r = client.chat.completions.create(
        model="tessera", messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion", r
    assert len(r.choices) == 1 and r.choices[0].index == 0, r
    chat = r.choices[0]
    assert chat.message.role == "assistant", r
    assert chat.finish_reason in ("stop", "length"), r
    assert chat.logprobs is None, r
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    out["chat"] = {
        "text": chat.message.content,
        "finish_reason": chat.finish_reason,
        "usage": {"prompt": u.prompt_tokens, "completion": u.completion_tokens},
    }

    # Chat, streamed with usage: the same text, finish reason and usage.
    text, finish, usage, ids = "", None, None, set()
    stream = client.chat.completions.create(
        model="tessera",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index == 0, chunk
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert len(ids) == 1, ids
    assert text == chat.message.content, (text, chat.message.content)
    assert finish == chat.finish_reason, finish
    assert usage is not None and usage.completion_tokens == u.completion_tokens, usage
    assert usage.prompt_tokens == u.prompt_tokens, usage

    # Completions, whole and streamed.
    r = client.completions.create(model="tessera", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion", r
    completion = r.choices[0]
    assert completion.finish_reason in ("stop", "length"), r
    out["completion"] = {
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "completion_tokens": r.usage.completion_tokens,
    }
    text, finish, usage = "", None, None
    for chunk in client.completions.create(
        model="tessera",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == completion.text, (text, completion.text)
    assert finish == completion.finish_reason, finish
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

    # A list of prompts: one choice each, in order; the first equals the prompt alone.
    r = client.completions.create(
        model="tessera", prompt=[PROMPT, "Once upon a time"], max_tokens=8, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1], r
    assert r.choices[0].text == completion.text, r

    # n = 2, greedy: equal choices; usage counts the prompt once and both completions.
    r = client.chat.completions.create(
        model="tessera", messages=MESSAGES, max_tokens=12, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1], r
    assert all(c.message.content == chat.message.content for c in r.choices), r
    assert r.usage.prompt_tokens == u.prompt_tokens, r.usage
    assert r.usage.completion_tokens == 2 * u.completion_tokens, r.usage

    # n = 2, sampled with a seed: reproducible, and the stream gives the same choices.
    def sampled(**kw):
        return client.chat.completions.create(
            model="tessera",
            messages=[{"role": "user", "content": "Tell me a story about a dragon."}],
            max_tokens=16,
            temperature=1.0,
            seed=7,
            n=2,
            **kw,
        )

    first = [c.message.content for c in sampled().choices]
    again = [c.message.content for c in sampled().choices]
    assert first == again, (first, again)
    streamed = ["", ""]
    for chunk in sampled(stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == first, (streamed, first)
    out["sampled_n2"] = first

    # Logprobs (chat): top 3, greedy, so the chosen token is the most likely one.
    r = client.chat.completions.create(
        model="tessera",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    c = r.choices[0]
    assert c.message.content == chat.message.content, r
    content = c.logprobs.content
    assert len(content) > 0, r
    for t in content:
        assert t.logprob <= 0, t
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == 3, t
        assert tops == sorted(tops, reverse=True), t
        assert abs(t.logprob - tops[0]) < 1e-4, t
        assert t.token == t.top_logprobs[0].token, t
    # The tokens' bytes spell the reply exactly.
    spelled = b"".join(bytes(t.bytes) for t in content)
    assert spelled == c.message.content.encode(), (spelled, c.message.content)
    out["chat_logprobs"] = [[t.token, t.logprob] for t in content]

    # Streamed, each chunk carries the logprobs of its tokens: the same list.
    streamed = []
    for chunk in client.chat.completions.create(
        model="tessera",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                streamed.extend([t.token, t.logprob] for t in ch.logprobs.content)
    assert streamed == out["chat_logprobs"], (streamed, out["chat_logprobs"])

    # Logprobs (completions): the legacy shape.
    r = client.completions.create(
        model="tessera", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    n = len(lp.tokens)
    assert n == r.usage.completion_tokens or r.choices[0].finish_reason == "stop", r
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n, lp
    assert "".join(lp.tokens) == r.choices[0].text, lp
    offset = 0
    for tok, logprob, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert at == offset, lp
        offset += len(tok)
        assert logprob <= 0 and 1 <= len(top) <= 2, lp
        assert abs(max(top.values()) - logprob) < 1e-4, lp

    # Penalties are accepted; out of range is a 400 naming the field.
    r = client.completions.create(
        model="tessera",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.5,
    )
    assert r.choices[0].finish_reason in ("stop", "length"), r

    errors = {}
    for name, kw in [
        ("temperature", {"temperature": 5}),
        ("presence_penalty", {"presence_penalty": 3}),
        ("top_p", {"top_p": 0}),
        ("n", {"n": 100}),
    ]:
        try:
            client.completions.create(model="tessera", prompt=PROMPT, max_tokens=2, **kw)
        except openai.BadRequestError as e:
            assert e.status_code == 400, e
            assert e.param == name, (e.param, name, e.body)
            assert e.type == "invalid_request_error", e.body
            assert isinstance(e.body, dict) and e.body["message"] in e.message, e
            errors[name] = e.body["message"]
        else:
            raise AssertionError(f"{kw} was accepted")
    out["errors"] = errors

    # A wrong key.
    wrong = openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0)
    try:
        wrong.models.list()
    except openai.AuthenticationError as e:
        assert e.status_code == 401 and e.code == "invalid_api_key", e
    else:
        raise AssertionError("a wrong key was accepted")
    models = client.models.list()
    out["model"] = models.data[0].id
    assert client.models.retrieve(out["model"]).id == out["model"]
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "model_not_found", e
    else:
        raise AssertionError("an unknown model was found")

    print(json.dumps(out))


if __name__ == "__main__":
    main()
