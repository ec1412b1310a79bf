//! Unit tests of the chat template module.

use super::clock::{civil_from_days, days_from_civil};
use super::json::python_float_repr;
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
    let err = ChatTemplate::new("{% for m in messages %}\n{{ m.content }}", "", "").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("syntax error") && text.contains("chat_template:") && !text.contains('\n'),
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
    let t =
        ChatTemplate::from_gguf_or_builtin(Some("{{ messages[0].content }}"), "", "", vocab(&[]))
            .unwrap();
    assert_eq!(t.origin(), TemplateOrigin::File);
    assert_eq!(t.end_of_turn(), None);
}

#[test]
fn python_printing_and_context() {
    assert_eq!(
        render_str(
            "{{ none }} {{ true }} {{ false }} {{ tools }} {{ tools is none }} [{{ undefined_x }}]"
        ),
        "None True False None True []"
    );
    assert_eq!(
        render_str("{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}"),
        "<s></s>True"
    );
    assert_eq!(
        render_str("{{ 'a\"<&>' | tojson }} {{ {'k': [1, 2.0]} | tojson }}"),
        "\"a\\\"<&>\" {\"k\": [1, 2.0]}"
    );
}
