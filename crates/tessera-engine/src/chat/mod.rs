//! Chat templates: turn a conversation into the prompt text a chat model was trained on.
//!
//! Every GGUF of a chat model carries its Jinja template in `tokenizer.chat_template`.
//! [`ChatTemplate`] renders it with `minijinja`, set up the way Hugging Face transformers
//! sets up `jinja2` for `apply_chat_template` (the reference that llama.cpp `--jinja`,
//! mistral.rs and TGI follow):
//!
//! * `trim_blocks` and `lstrip_blocks` on, one trailing newline of the source dropped,
//!   `\r\n` / `\r` read as `\n`, no HTML escaping;
//! * globals `raise_exception(msg)` (→ [`EngineError::ChatTemplate`] whose text is `msg`),
//!   `strftime_now(fmt)` (the current date; [`ChatTemplate::with_clock`] fixes it),
//!   `namespace()`, `range()`, loop controls (`{% break %}`, `{% continue %}`);
//! * the filter `tojson` as Python's `json.dumps(x, ensure_ascii=False, indent=None,
//!   separators=None, sort_keys=False)` (`", "` / `": "` separators, no HTML escaping,
//!   Python float formatting), with the same keyword arguments;
//! * Python string / dict / list methods (`.strip()`, `.startswith()`, `.split()`,
//!   `.items()`, `.get()`, …) via `minijinja-contrib`'s pycompat, with Python's `.title()`;
//! * jinja2's answers for the tests `iterable` (not none), `sequence` (strings and maps
//!   too) and `number` (bools too);
//! * HF's `{% generation %}…{% endgeneration %}` marker block renders its body;
//! * the render context holds `messages`, `add_generation_prompt`, `bos_token`,
//!   `eos_token`, and `tools` / `documents` set to none (as HF passes them without tools).
//!
//! Known differences from jinja2, all in minijinja's favour of rendering: iterating `none`
//! yields nothing where Python raises `TypeError` (tool-use templates given no tools), and
//! `strftime_now` reads the clock in UTC where Python's `datetime.now()` is local time.
//!
//! A file without a template gets a built-in one ([`BuiltinTemplate`]: Gemma, Llama 3 or
//! ChatML), chosen by which special tokens the vocabulary has
//! ([`ChatTemplate::from_gguf_or_builtin`]); [`ChatTemplate::origin`] says which was used.

mod clock;
mod json;

use std::fmt;
use std::sync::Arc;

use minijinja::value::{Rest, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};

use crate::EngineError;

pub use clock::CivilDateTime;
use json::tojson_filter;

/// The name the template is stored under; errors point at `chat_template:LINE`.
const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation. `role` is usually `system`, `user` or `assistant`; a
/// template sees it as a map with the keys `role` and `content`, in that order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Message::new("assistant", content)
    }
}

/// The chat formats tessera knows without a template in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinTemplate {
    /// `<start_of_turn>user\n…<end_of_turn>\n<start_of_turn>model\n` (a system message is
    /// put in front of the first user turn, as Gemma 3's template does).
    Gemma,
    /// `<|start_header_id|>user<|end_header_id|>\n\n…<|eot_id|>`.
    Llama3,
    /// `<|im_start|>user\n…<|im_end|>\n` (Qwen, SmolLM, many fine-tunes).
    ChatMl,
}

const GEMMA_SOURCE: &str = "{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
";

const LLAMA3_SOURCE: &str = "{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
";

const CHATML_SOURCE: &str = "{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
";

impl BuiltinTemplate {
    /// In the order [`detect`](Self::detect) tries them.
    pub const ALL: [BuiltinTemplate; 3] = [
        BuiltinTemplate::Gemma,
        BuiltinTemplate::Llama3,
        BuiltinTemplate::ChatMl,
    ];

    /// A short name for messages: `Gemma`, `Llama 3`, `ChatML`.
    pub fn name(self) -> &'static str {
        match self {
            BuiltinTemplate::Gemma => "Gemma",
            BuiltinTemplate::Llama3 => "Llama 3",
            BuiltinTemplate::ChatMl => "ChatML",
        }
    }

    /// The Jinja source, rendered like any file's template.
    pub fn source(self) -> &'static str {
        match self {
            BuiltinTemplate::Gemma => GEMMA_SOURCE,
            BuiltinTemplate::Llama3 => LLAMA3_SOURCE,
            BuiltinTemplate::ChatMl => CHATML_SOURCE,
        }
    }

    /// The text that closes every turn (and so ends the model's reply).
    pub fn end_of_turn(self) -> &'static str {
        match self {
            BuiltinTemplate::Gemma => "<end_of_turn>",
            BuiltinTemplate::Llama3 => "<|eot_id|>",
            BuiltinTemplate::ChatMl => "<|im_end|>",
        }
    }

    /// The special tokens the vocabulary must have for this format to be chosen.
    pub fn required_tokens(self) -> &'static [&'static str] {
        match self {
            BuiltinTemplate::Gemma => &["<start_of_turn>", "<end_of_turn>"],
            BuiltinTemplate::Llama3 => &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            BuiltinTemplate::ChatMl => &["<|im_start|>", "<|im_end|>"],
        }
    }

    /// The first format whose tokens the vocabulary has (`has_token(text)` says whether a
    /// token with exactly that text exists); `None` when no format fits.
    pub fn detect(has_token: impl Fn(&str) -> bool) -> Option<BuiltinTemplate> {
        BuiltinTemplate::ALL
            .into_iter()
            .find(|b| b.required_tokens().iter().all(|t| has_token(t)))
    }
}

impl fmt::Display for BuiltinTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a [`ChatTemplate`]'s source came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// The model file's own template (`tokenizer.chat_template`) or one given by the user.
    File,
    /// A built-in format; `matched` is false when the vocabulary had none of the known
    /// chat tokens and ChatML was taken as the last resort.
    Builtin {
        template: BuiltinTemplate,
        matched: bool,
    },
}

impl fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateOrigin::File => f.write_str("the model's chat template"),
            TemplateOrigin::Builtin { template, matched: true } => {
                write!(f, "the built-in {template} chat template (the file has none)")
            }
            TemplateOrigin::Builtin { template, matched: false } => write!(
                f,
                "the built-in {template} chat template (the file has none, and its vocabulary has no known chat tokens)"
            ),
        }
    }
}

type Clock = Arc<dyn Fn() -> CivilDateTime + Send + Sync>;

/// The error `raise_exception` returns, found again in the error chain after rendering.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template plus the special-token texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: TemplateOrigin,
    bos_token: String,
    eos_token: String,
    end_of_turn: Option<&'static str>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("end_of_turn", &self.end_of_turn)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template). `bos_token` / `eos_token` are the texts of
    /// the vocabulary's BOS / EOS tokens (empty when it has none); templates print them.
    /// A template that does not parse is an [`EngineError::ChatTemplate`] naming the line.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, EngineError> {
        let mut t = ChatTemplate::compile(source, bos_token, eos_token, TemplateOrigin::File)?;
        t.end_of_turn = BuiltinTemplate::ALL
            .into_iter()
            .map(BuiltinTemplate::end_of_turn)
            .find(|eot| source.contains(eot));
        Ok(t)
    }

    /// One of the built-in formats.
    pub fn builtin(template: BuiltinTemplate, bos_token: &str, eos_token: &str) -> Self {
        let origin = TemplateOrigin::Builtin {
            template,
            matched: true,
        };
        let mut t = ChatTemplate::compile(template.source(), bos_token, eos_token, origin)
            .expect("built-in chat templates compile");
        t.end_of_turn = Some(template.end_of_turn());
        t
    }

    /// The model file's template when it has one (`source` is `tokenizer.chat_template`;
    /// `None`, empty or blank counts as none), else the built-in format that
    /// [`BuiltinTemplate::detect`] picks from the vocabulary, else ChatML.
    /// [`origin`](Self::origin) tells which, for a one-line notice.
    pub fn from_gguf_or_builtin(
        source: Option<&str>,
        bos_token: &str,
        eos_token: &str,
        has_token: impl Fn(&str) -> bool,
    ) -> Result<Self, EngineError> {
        match source {
            Some(s) if !s.trim().is_empty() => ChatTemplate::new(s, bos_token, eos_token),
            _ => {
                let detected = BuiltinTemplate::detect(has_token);
                let template = detected.unwrap_or(BuiltinTemplate::ChatMl);
                let mut t = ChatTemplate::builtin(template, bos_token, eos_token);
                t.origin = TemplateOrigin::Builtin {
                    template,
                    matched: detected.is_some(),
                };
                Ok(t)
            }
        }
    }

    /// Makes `strftime_now` read `clock` instead of the system clock (UTC).
    pub fn with_clock(mut self, clock: impl Fn() -> CivilDateTime + Send + Sync + 'static) -> Self {
        register_clock(&mut self.env, Arc::new(clock));
        self
    }

    /// Makes `strftime_now` always see `time` (for reproducible prompts and tests).
    pub fn with_fixed_time(self, time: CivilDateTime) -> Self {
        self.with_clock(move || time)
    }

    /// Where the source came from.
    pub fn origin(&self) -> TemplateOrigin {
        self.origin
    }

    /// The built-in format in use, if this is not the file's own template.
    pub fn builtin_template(&self) -> Option<BuiltinTemplate> {
        match self.origin {
            TemplateOrigin::File => None,
            TemplateOrigin::Builtin { template, .. } => Some(template),
        }
    }

    /// The text that closes a turn: exact for a built-in format; for a file's template, the
    /// end-of-turn marker of a known format (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`)
    /// when its source contains one, else `None`. A hint only: stopping goes by the
    /// vocabulary's EOS / EOT token ids.
    pub fn end_of_turn(&self) -> Option<&str> {
        self.end_of_turn
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders the conversation. With `add_generation_prompt` the text ends with the opening
    /// of an assistant turn, ready for the model to continue. A template that calls
    /// `raise_exception(msg)` yields [`EngineError::ChatTemplate`] with exactly `msg`; other
    /// failures name the problem and the template line.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        let messages: Value = messages
            .iter()
            .map(|m| {
                Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())])
            })
            .collect();
        let ctx = Value::from_pairs([
            ("messages", messages),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ]);
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        template.render(ctx).map_err(template_error)
    }

    fn compile(
        source: &str,
        bos_token: &str,
        eos_token: &str,
        origin: TemplateOrigin,
    ) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        env.set_debug(false);
        // HF's environment does not escape; a name without extension means no auto escape,
        // but say it outright.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(python_methods);
        env.add_filter("tojson", tojson_filter);
        // jinja2's tests where minijinja's answer differs: none is not iterable; strings
        // and maps are sequences (they have len() and []); bools are numbers.
        env.add_test("iterable", |v: &Value| !v.is_none() && v.try_iter().is_ok());
        env.add_test("sequence", |v: &Value| {
            matches!(
                v.kind(),
                ValueKind::Seq
                    | ValueKind::String
                    | ValueKind::Map
                    | ValueKind::Bytes
                    | ValueKind::Undefined
            )
        });
        env.add_test("number", |v: &Value| {
            matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
        });
        env.add_function("raise_exception", raise_exception);
        register_clock(&mut env, Arc::new(CivilDateTime::now_utc));
        env.add_template_owned(TEMPLATE_NAME, prepare_source(source))
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            origin,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            end_of_turn: None,
        })
    }
}

fn register_clock(env: &mut Environment<'static>, clock: Clock) {
    env.add_function("strftime_now", move |format: &str| -> String {
        clock().strftime(format)
    });
}

/// Python methods on template values: minijinja-contrib's pycompat, except `str.title()`,
/// which pycompat borrows from Jinja's `title` filter (new words only after spaces and
/// brackets) where Python starts one after every character that is not a letter.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    if let (Some(s), "title", []) = (value.as_str(), method, args) {
        return Ok(Value::from(python_title(s)));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.title()`: a cased character after an uncased one is upper-cased, one
/// after a cased one lower-cased.
fn python_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut previous_cased = false;
    for c in s.chars() {
        if previous_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        previous_cased = c.is_lowercase() || c.is_uppercase();
    }
    out
}

/// `raise_exception(msg)`: fails the render with the template's own message.
fn raise_exception(args: Rest<Value>) -> Result<Value, minijinja::Error> {
    let msg = args.first().map(|v| v.to_string()).unwrap_or_default();
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

/// Maps a minijinja error to a one-line [`EngineError::ChatTemplate`]: the raised text for
/// `raise_exception`, else minijinja's message (kind, detail, template line).
fn template_error(err: minijinja::Error) -> EngineError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(Raised(msg)) = e.downcast_ref::<Raised>() {
            return EngineError::ChatTemplate(one_line(msg));
        }
        source = e.source();
    }
    EngineError::ChatTemplate(one_line(&err.to_string()))
}

fn one_line(s: &str) -> String {
    s.split(['\n', '\r'])
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// What jinja2 does to the source before lexing, and HF's `{% generation %}` block:
/// * newlines: `\r\n` and `\r` become `\n` (jinja2's `newline_sequence`);
/// * `{% generation %}` / `{% endgeneration %}` (transformers' AssistantTracker, which only
///   records where the assistant's text is) become `{% if true %}` / `{% endif %}`, keeping
///   their whitespace-control marks.
fn prepare_source(source: &str) -> String {
    let source = source.replace("\r\n", "\n").replace('\r', "\n");
    if !source.contains("generation") {
        return source;
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source.as_str();
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            rest = "";
            break;
        };
        let inner = &tag[2..end];
        let (open_mark, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (Some(c), &inner[1..]),
            _ => (None, inner),
        };
        let (body, close_mark) = match body.chars().last() {
            Some(c @ ('-' | '+')) => (&body[..body.len() - 1], Some(c)),
            _ => (body, None),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => {
                out.push_str("{%");
                out.extend(open_mark);
                out.push(' ');
                out.push_str(word);
                out.push(' ');
                out.extend(close_mark);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests;
