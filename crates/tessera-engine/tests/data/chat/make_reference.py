#!/usr/bin/env python3
"""Render every chat template in this folder the way Hugging Face transformers does, and
write the expected strings to reference.json for tests/chat_template.rs.

The environment copies transformers' `_compile_jinja_template` / `render_jinja_template`
(src/transformers/utils/chat_template_utils.py):

* `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
  extensions=[AssistantTracker, jinja2.ext.loopcontrols])`
* filter `tojson` = `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)` (replacing Jinja's HTML-escaping one)
* globals `raise_exception(msg)` (raises `TemplateError(msg)`) and `strftime_now(fmt)`,
  here with a FIXED clock so the output is deterministic
* render context: `messages`, `tools=None`, `documents=None`, `add_generation_prompt`,
  plus the tokenizer's special tokens (`bos_token`, `eos_token`).

Run from anywhere with Jinja2 3.x installed (tested with 3.1.6):

    python3 crates/tessera-engine/tests/data/chat/make_reference.py

It needs no network and no model files. The Rust test reads only the committed
templates and reference.json.
"""

import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))

# strftime_now reads this; the Rust test passes the same fields to its clock hook.
FIXED_NOW = datetime(2025, 3, 9, 14, 5, 7)

# template file -> (bos_token, eos_token) as the model's tokenizer config names them.
# Qwen's tokenizers have no BOS text (HF: None); GGUF-side we pass "".
TEMPLATES = {
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "google-gemma-4-31B-it.jinja": ("<bos>", "<eos>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>"),
    "qwen2.5-coder-0.5b-gguf.jinja": ("<|endoftext|>", "<|im_end|>"),  # the GGUF's bos/eos ids
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": (
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
    ),
    "LFM2.5-8B-A1B.jinja": ("<|startoftext|>", "<|im_end|>"),
    # tessera's built-in fallbacks (the Rust test checks they equal the constants in chat.rs)
    "builtin-gemma.jinja": ("<bos>", "<eos>"),
    "builtin-llama3.jinja": ("<|begin_of_text|>", "<|end_of_text|>"),
    "builtin-chatml.jinja": ("", "<|im_end|>"),
    # synthetic probes of engine behaviour (whitespace control, python methods, tojson, ...)
    "probe-whitespace.jinja": ("<s>", "</s>"),
    "probe-python.jinja": ("<s>", "</s>"),
    "probe-tojson.jinja": ("<s>", "</s>"),
    "probe-generation.jinja": ("<s>", "</s>"),
}

# Templates also rendered from a CRLF copy of their source (Jinja normalises newlines).
CRLF_TOO = ["probe-whitespace.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja"]


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = {
    "user": [m("user", "Hello!")],
    "system_user": [m("system", "You are terse."), m("user", "Hello!")],
    "multi_turn": [
        m("user", "Hello!"),
        m("assistant", "Hi. How can I help?"),
        m("user", "Name a prime."),
    ],
    "system_multi_turn": [
        m("system", "You are terse."),
        m("user", "Hello!"),
        m("assistant", "Hi."),
        m("user", "Name a prime."),
    ],
    "ends_with_assistant": [m("user", "2+2?"), m("assistant", "4")],
    "unicode_whitespace": [
        m("system", "  Réponds en français. \n"),
        m("user", "  Grüße — 你好 🌍 \"quotes\" <tag> & 'apos'\n\tindented line\n  "),
        m("assistant", "naïve café ☕\n"),
        m("user", "Ещё раз?  "),
    ],
    "thinking": [
        m("user", "Why?"),
        m("assistant", "<think>\nBecause reasons.\n</think>\n\nBecause."),
        m("user", "And then?"),
    ],
    "not_alternating": [m("user", "one"), m("user", "two")],
    "empty_content": [m("user", "")],
}


class RaisedByTemplate(jinja2.exceptions.TemplateError):
    pass


class AssistantTracker(Extension):
    """HF's `{% generation %}...{% endgeneration %}` block: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def raise_exception(message):
    raise RaisedByTemplate(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return FIXED_NOW.strftime(format)


def compile_template(source):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def main():
    # `--all-in DIR`: a wider, uncommitted sweep: every *.jinja in DIR (e.g. llama.cpp's
    # models/templates), with generic special tokens, written to DIR/reference.json. Point
    # the Rust test at it with TESSERA_CHAT_DATA=DIR.
    folder, templates = HERE, TEMPLATES
    if len(sys.argv) == 3 and sys.argv[1] == "--all-in":
        folder = sys.argv[2]
        templates = {n: ("<s>", "</s>") for n in sorted(os.listdir(folder)) if n.endswith(".jinja")}
    cases = []
    for name, (bos, eos) in templates.items():
        with open(os.path.join(folder, name), encoding="utf-8", newline="") as f:
            source = f.read()
        variants = [(name, False, source)]
        if name in CRLF_TOO and folder == HERE:
            variants.append((name, True, source.replace("\n", "\r\n")))
        for _, crlf, src in variants:
            try:
                template = compile_template(src)
            except jinja2.exceptions.TemplateError as e:
                print(f"{name}: does not compile under jinja2 ({e}); skipped")
                continue
            for conv_name, messages in CONVERSATIONS.items():
                for agp in (True, False):
                    case = {
                        "template": name,
                        "crlf": crlf,
                        "bos_token": bos,
                        "eos_token": eos,
                        "conversation": conv_name,
                        "messages": messages,
                        "add_generation_prompt": agp,
                    }
                    try:
                        case["expected"] = template.render(
                            messages=messages,
                            tools=None,
                            documents=None,
                            add_generation_prompt=agp,
                            bos_token=bos,
                            eos_token=eos,
                        )
                    except RaisedByTemplate as e:
                        case["raises"] = str(e)
                    except Exception as e:
                        # An error the template did not raise itself (e.g. undefined access):
                        # the Rust side must fail too, message wording differs by engine.
                        case["fails"] = f"{type(e).__name__}: {e}"
                    cases.append(case)
    out = {
        "generator": "make_reference.py",
        "jinja2": jinja2.__version__,
        "fixed_now": [FIXED_NOW.year, FIXED_NOW.month, FIXED_NOW.day, FIXED_NOW.hour, FIXED_NOW.minute, FIXED_NOW.second],
        "cases": cases,
    }
    with open(os.path.join(folder, "reference.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    n_ok = sum("expected" in c for c in cases)
    n_raise = sum("raises" in c for c in cases)
    n_fail = sum("fails" in c for c in cases)
    print(f"{len(cases)} cases: {n_ok} rendered, {n_raise} raised, {n_fail} failed otherwise")


if __name__ == "__main__":
    main()
