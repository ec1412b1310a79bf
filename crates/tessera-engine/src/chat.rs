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

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};

use crate::EngineError;

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

/// A calendar date and time of day, as `strftime_now` formats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilDateTime {
    pub year: i32,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl CivilDateTime {
    /// The time `secs` seconds after 1970-01-01 00:00:00 UTC.
    pub fn from_unix_seconds(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        CivilDateTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
        }
    }

    /// The current time in UTC (the system clock; tessera reads no time-zone database).
    pub fn now_utc() -> Self {
        let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_secs() as i64,
            Err(e) => -(e.duration().as_secs() as i64),
        };
        CivilDateTime::from_unix_seconds(secs)
    }

    /// Days since 1970-01-01.
    fn days(&self) -> i64 {
        days_from_civil(self.year, self.month, self.day)
    }

    /// 0 = Sunday … 6 = Saturday.
    fn weekday(&self) -> u32 {
        (self.days() + 4).rem_euclid(7) as u32
    }

    /// 1 = January 1st.
    fn day_of_year(&self) -> u32 {
        (self.days() - days_from_civil(self.year, 1, 1)) as u32 + 1
    }

    /// Formats like C's / Python's `strftime` in the C locale. Supported: `%a %A %b %B %c
    /// %C %d %D %e %F %h %H %I %j %m %M %n %p %R %S %t %T %u %w %x %X %y %Y %z %Z %%`, and
    /// the glibc flags `-` (no padding), `_` (pad with spaces), `0` (pad with zeros). `%z`
    /// and `%Z` are empty (a naive time, as Python's `datetime.now()`); anything else is
    /// copied as written.
    pub fn strftime(&self, fmt: &str) -> String {
        let mut out = String::with_capacity(fmt.len() + 16);
        let mut chars = fmt.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let flag = match chars.peek() {
                Some(&f @ ('-' | '_' | '0')) => {
                    chars.next();
                    Some(f)
                }
                _ => None,
            };
            let Some(spec) = chars.next() else {
                out.push('%');
                if let Some(f) = flag {
                    out.push(f);
                }
                break;
            };
            self.format_spec(&mut out, spec, flag);
        }
        out
    }

    fn format_spec(&self, out: &mut String, spec: char, flag: Option<char>) {
        const DAYS: [&str; 7] = [
            "Sunday",
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
        ];
        const MONTHS: [&str; 12] = [
            "January",
            "February",
            "March",
            "April",
            "May",
            "June",
            "July",
            "August",
            "September",
            "October",
            "November",
            "December",
        ];
        let num = |out: &mut String, v: i64, width: usize, default_pad: char| {
            let pad = match flag {
                Some('-') => None,
                Some('_') => Some(' '),
                Some('0') => Some('0'),
                _ => Some(default_pad),
            };
            let digits = v.unsigned_abs().to_string();
            if v < 0 {
                out.push('-');
            }
            if let Some(p) = pad {
                for _ in digits.len()..width {
                    out.push(p);
                }
            }
            out.push_str(&digits);
        };
        let month_name = MONTHS[(self.month.clamp(1, 12) - 1) as usize];
        let day_name = DAYS[self.weekday() as usize];
        let hour12 = match self.hour % 12 {
            0 => 12,
            h => h,
        };
        match spec {
            'a' => out.push_str(&day_name[..3]),
            'A' => out.push_str(day_name),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'c' => {
                let s = self.strftime("%a %b %e %H:%M:%S %Y");
                out.push_str(&s);
            }
            'C' => num(out, self.year.div_euclid(100) as i64, 2, '0'),
            'd' => num(out, self.day as i64, 2, '0'),
            'D' | 'x' => out.push_str(&self.strftime("%m/%d/%y")),
            'e' => num(out, self.day as i64, 2, ' '),
            'F' => out.push_str(&self.strftime("%Y-%m-%d")),
            'H' => num(out, self.hour as i64, 2, '0'),
            'I' => num(out, hour12 as i64, 2, '0'),
            'j' => num(out, self.day_of_year() as i64, 3, '0'),
            'm' => num(out, self.month as i64, 2, '0'),
            'M' => num(out, self.minute as i64, 2, '0'),
            'n' => out.push('\n'),
            'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
            'R' => out.push_str(&self.strftime("%H:%M")),
            'S' => num(out, self.second as i64, 2, '0'),
            't' => out.push('\t'),
            'T' | 'X' => out.push_str(&self.strftime("%H:%M:%S")),
            'u' => num(out, [7, 1, 2, 3, 4, 5, 6][self.weekday() as usize], 1, '0'),
            'w' => num(out, self.weekday() as i64, 1, '0'),
            'y' => num(out, self.year.rem_euclid(100) as i64, 2, '0'),
            'Y' => num(out, self.year as i64, 1, '0'),
            'z' | 'Z' => {}
            '%' => out.push('%'),
            other => {
                out.push('%');
                if let Some(f) = flag {
                    out.push(f);
                }
                out.push(other);
            }
        }
    }
}

/// Howard Hinnant's `days_from_civil`: days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i32, m: u32, d: u32) -> i64 {
    let y = y as i64 - i64::from(m <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(z: i64) -> (i32, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y as i32, m, d)
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

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, with those keywords accepted (positionally too, in
/// that order).
fn tojson_filter(
    value: &Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> Result<String, minijinja::Error> {
    let mut opts = JsonOptions::default();
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(minijinja::Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut given: Vec<(&str, Value)> = names.iter().copied().zip(args.iter().cloned()).collect();
    for name in names {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if given.iter().any(|(n, _)| *n == name) {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            given.push((name, v));
        }
    }
    kwargs.assert_all_used()?;
    let mut separators = None;
    for (name, v) in given {
        match name {
            "ensure_ascii" => opts.ensure_ascii = v.is_true(),
            "sort_keys" => opts.sort_keys = v.is_true(),
            "indent" => {
                opts.indent = match v.kind() {
                    ValueKind::None | ValueKind::Undefined => None,
                    ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
                    ValueKind::Number if v.is_integer() => {
                        let n = i64::try_from(v.clone())?;
                        Some(" ".repeat(n.max(0) as usize))
                    }
                    _ => {
                        return Err(minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "tojson: indent must be an integer or a string, not {}",
                                v.kind()
                            ),
                        ))
                    }
                }
            }
            "separators" => {
                if v.is_none() || v.is_undefined() {
                    continue;
                }
                let parts: Vec<String> = v.try_iter()?.map(|p| p.to_string()).collect();
                if parts.len() != 2 {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be an (item_separator, key_separator) pair",
                    ));
                }
                separators = Some((parts[0].clone(), parts[1].clone()));
            }
            _ => unreachable!(),
        }
    }
    (opts.item_sep, opts.key_sep) = match separators {
        Some(s) => s,
        None if opts.indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(out)
}

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        JsonOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

fn not_serializable(value: &Value) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: a value of type {} is not JSON serializable",
            value.kind()
        ),
    )
}

fn write_newline_indent(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// Python's `json.dumps` encoder over a minijinja value.
fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    level: usize,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(value)?),
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                write_newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            write_newline_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                write_newline_indent(out, opts, level + 1);
                write_json_string(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, item, opts, level + 1)?;
            }
            write_newline_indent(out, opts, level);
            out.push('}');
        }
        ValueKind::Undefined | ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            return Err(not_serializable(value))
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// A map key as `json.dumps` writes it: strings as they are, numbers / bools / None as text.
fn json_key(key: &Value) -> Result<String, minijinja::Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => json_number(key)?,
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ))
        }
    })
}

fn json_number(value: &Value) -> Result<String, minijinja::Error> {
    if value.is_integer() {
        if let Ok(i) = i128::try_from(value.clone()) {
            return Ok(i.to_string());
        }
        if let Ok(u) = u128::try_from(value.clone()) {
            return Ok(u.to_string());
        }
    }
    let f = f64::try_from(value.clone())?;
    Ok(python_float_repr(f))
}

/// Python's `repr(float)` (what `json.dumps` writes), `NaN` / `Infinity` included.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits, as Python's repr does.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1; // position of the decimal point relative to the digits
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            out.push_str("0.");
            for _ in 0..(-decpt) {
                out.push('0');
            }
            out.push_str(&digits);
        } else if decpt as usize >= digits.len() {
            out.push_str(&digits);
            for _ in digits.len()..decpt as usize {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e = decpt - 1;
        out.push('e');
        out.push(if e < 0 { '-' } else { '+' });
        let abs = e.unsigned_abs();
        if abs < 10 {
            out.push('0');
        }
        out.push_str(&abs.to_string());
    }
    out
}

/// A JSON string literal as Python's encoder writes it.
fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_str(source: &str) -> String {
        ChatTemplate::new(source, "<s>", "</s>")
            .unwrap()
            .render(&[Message::user("hi")], true)
            .unwrap()
    }

    #[test]
    fn templates_can_be_shared_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
        check::<Message>();
    }

    #[test]
    fn civil_dates_round_trip() {
        for days in [
            -800_000i64,
            -1,
            0,
            1,
            59,
            60,
            365,
            11_016,
            20_156,
            2_932_896,
        ] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
        let t = CivilDateTime::from_unix_seconds(1_741_529_107); // 2025-03-09 14:05:07 UTC
        assert_eq!(
            t,
            CivilDateTime {
                year: 2025,
                month: 3,
                day: 9,
                hour: 14,
                minute: 5,
                second: 7
            }
        );
        assert_eq!(
            t.strftime("%A %d %b %Y %j %-d %e %I%p %u %w %%"),
            "Sunday 09 Mar 2025 068 9  9 02PM 7 0 %"
        );
        assert_eq!(
            CivilDateTime::from_unix_seconds(0).strftime("%F %T %a"),
            "1970-01-01 00:00:00 Thu"
        );
        assert_eq!(
            CivilDateTime::from_unix_seconds(951_782_400).strftime("%F %j"),
            "2000-02-29 060"
        );
    }

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (3.0, "3.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (123456789.125, "123456789.125"),
            (1.5e100, "1.5e+100"),
            (2.5e-10, "2.5e-10"),
            (0.0001, "0.0001"),
            (-1.25e-7, "-1.25e-07"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn generation_tags_become_plain_blocks() {
        assert_eq!(
            prepare_source("a{%- generation -%}b{% endgeneration %}c"),
            "a{%- if true -%}b{% endif %}c"
        );
        assert_eq!(
            prepare_source("{%+ generation %}\r\nx{%endgeneration+%}"),
            "{%+ if true %}\nx{% endif +%}"
        );
        assert_eq!(
            prepare_source("{% if generation %}{{ '{%' }}"),
            "{% if generation %}{{ '{%' }}"
        );
    }

    #[test]
    fn raise_and_syntax_errors_are_one_line() {
        let t = ChatTemplate::new("{{ raise_exception('No system role') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(
            matches!(&err, EngineError::ChatTemplate(m) if m == "No system role"),
            "{err:?}"
        );
        let err =
            ChatTemplate::new("{% for m in messages %}\n{{ m.content }}", "", "").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("syntax error")
                && text.contains("chat_template:")
                && !text.contains('\n'),
            "{text}"
        );
        let err = ChatTemplate::new("{{ messages[0].x.y }}", "", "")
            .unwrap()
            .render(&[], false)
            .unwrap_err();
        assert!(!err.to_string().contains('\n'), "{err}");
    }

    #[test]
    fn builtin_detection_prefers_specific_formats() {
        let vocab = |toks: &'static [&'static str]| move |t: &str| toks.contains(&t);
        assert_eq!(
            BuiltinTemplate::detect(vocab(&[
                "<start_of_turn>",
                "<end_of_turn>",
                "<|im_start|>",
                "<|im_end|>"
            ])),
            Some(BuiltinTemplate::Gemma)
        );
        assert_eq!(
            BuiltinTemplate::detect(vocab(&[
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>"
            ])),
            Some(BuiltinTemplate::Llama3)
        );
        assert_eq!(
            BuiltinTemplate::detect(vocab(&["<|im_start|>", "<|im_end|>"])),
            Some(BuiltinTemplate::ChatMl)
        );
        assert_eq!(BuiltinTemplate::detect(vocab(&["<|im_start|>"])), None);
        let t = ChatTemplate::from_gguf_or_builtin(Some("  \n"), "", "", vocab(&[])).unwrap();
        assert_eq!(
            t.origin(),
            TemplateOrigin::Builtin {
                template: BuiltinTemplate::ChatMl,
                matched: false
            }
        );
        let t = ChatTemplate::from_gguf_or_builtin(
            None,
            "<bos>",
            "<eos>",
            vocab(&["<start_of_turn>", "<end_of_turn>"]),
        )
        .unwrap();
        assert_eq!(t.builtin_template(), Some(BuiltinTemplate::Gemma));
        assert_eq!(t.end_of_turn(), Some("<end_of_turn>"));
        let t = ChatTemplate::from_gguf_or_builtin(
            Some("{{ messages[0].content }}"),
            "",
            "",
            vocab(&[]),
        )
        .unwrap();
        assert_eq!(t.origin(), TemplateOrigin::File);
        assert_eq!(t.end_of_turn(), None);
    }

    #[test]
    fn python_printing_and_context() {
        assert_eq!(render_str("{{ none }} {{ true }} {{ false }} {{ tools }} {{ tools is none }} [{{ undefined_x }}]"), "None True False None True []");
        assert_eq!(
            render_str("{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}"),
            "<s></s>True"
        );
        assert_eq!(
            render_str("{{ 'a\"<&>' | tojson }} {{ {'k': [1, 2.0]} | tojson }}"),
            "\"a\\\"<&>\" {\"k\": [1, 2.0]}"
        );
    }
}
