//! The `tojson` filter: Python's `json.dumps` over template values, floats as Python prints them.

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::ErrorKind;

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, with those keywords accepted (positionally too, in
/// that order).
pub(super) fn tojson_filter(
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
