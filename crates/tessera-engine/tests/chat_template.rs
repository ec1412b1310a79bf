//! Renders real chat templates (from GGUF / HF model repos, via llama.cpp's test data) with
//! tessera's minijinja setup and compares byte for byte with what Python's jinja2, set up as
//! Hugging Face transformers sets it up, produced (tests/data/chat/make_reference.py wrote
//! reference.json). Reads only committed files.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;
use tessera_engine::chat::{BuiltinTemplate, ChatTemplate, CivilDateTime, Message};
use tessera_engine::EngineError;

#[derive(Deserialize)]
struct Reference {
    fixed_now: [u32; 6],
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    template: String,
    crlf: bool,
    bos_token: String,
    eos_token: String,
    conversation: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    expected: Option<String>,
    raises: Option<String>,
    fails: Option<String>,
}

/// The committed templates, or TESSERA_CHAT_DATA (a folder `make_reference.py --all-in`
/// filled) for a wider sweep.
fn data_dir() -> PathBuf {
    match std::env::var_os("TESSERA_CHAT_DATA") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat"),
    }
}

fn sweeping() -> bool {
    std::env::var_os("TESSERA_CHAT_DATA").is_some()
}

fn read(name: &str) -> String {
    std::fs::read_to_string(data_dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn reference() -> Reference {
    serde_json::from_str(&read("reference.json")).expect("reference.json parses")
}

fn fixed_time(r: &Reference) -> CivilDateTime {
    let [year, month, day, hour, minute, second] = r.fixed_now;
    CivilDateTime {
        year: year as i32,
        month,
        day,
        hour,
        minute,
        second,
    }
}

/// Shows where two long strings first differ.
fn first_difference(got: &str, want: &str) -> String {
    let at = got
        .char_indices()
        .zip(want.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i);
    let at = at.unwrap_or(got.len().min(want.len()));
    let from = got[..at].char_indices().rev().nth(40).map_or(0, |(i, _)| i);
    let from_w = want
        .get(from..)
        .map_or(String::new(), |s| s.chars().take(100).collect());
    format!(
        "first difference at byte {at}:\n  got:  {:?}\n  want: {:?}",
        got[from..].chars().take(100).collect::<String>(),
        from_w
    )
}

#[test]
fn templates_render_like_hf_jinja2() {
    let r = reference();
    let now = fixed_time(&r);
    let mut compiled: BTreeMap<(String, bool), ChatTemplate> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut per_template: BTreeMap<&str, usize> = BTreeMap::new();
    let mut lenient = 0;
    for case in &r.cases {
        let key = (case.template.clone(), case.crlf);
        let template = compiled.entry(key).or_insert_with(|| {
            let mut source = read(&case.template);
            if case.crlf {
                source = source.replace('\n', "\r\n");
            }
            ChatTemplate::new(&source, &case.bos_token, &case.eos_token)
                .unwrap_or_else(|e| panic!("{} does not compile: {e}", case.template))
                .with_fixed_time(now)
        });
        assert_eq!(template.bos_token(), case.bos_token);
        let got = template.render(&case.messages, case.add_generation_prompt);
        let label = format!(
            "{}{} / {} / add_generation_prompt={}",
            case.template,
            if case.crlf { " (CRLF)" } else { "" },
            case.conversation,
            case.add_generation_prompt
        );
        let problem = match (&got, &case.expected, &case.raises, &case.fails) {
            (Ok(text), Some(want), _, _) if text == want => None,
            (Ok(text), Some(want), _, _) => Some(first_difference(text, want)),
            (Err(EngineError::ChatTemplate(msg)), None, Some(want), _) if msg == want => None,
            (Err(EngineError::ChatTemplate(_)), None, None, Some(_)) => None,
            // Known leniency, seen only in the wide sweep (tool-use templates rendered with
            // tools=None): jinja2 raises TypeError iterating None, minijinja iterates nothing.
            (Ok(_), None, None, Some(why))
                if sweeping() && why.contains("'NoneType' object is not iterable") =>
            {
                lenient += 1;
                None
            }
            (got, ..) => Some(format!(
                "got {got:?}, want {:?}",
                case.expected
                    .as_ref()
                    .or(case.raises.as_ref())
                    .or(case.fails.as_ref())
            )),
        };
        match problem {
            None => *per_template.entry(&case.template).or_default() += 1,
            Some(p) => failures.push(format!("{label}: {p}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        r.cases.len(),
        failures.join("\n")
    );
    if lenient > 0 {
        eprintln!("{lenient} cases rendered where jinja2 fails iterating None");
    }
    // Every template file in the folder is covered, and each case ran.
    assert_eq!(per_template.values().sum::<usize>(), r.cases.len());
    for entry in std::fs::read_dir(data_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".jinja") {
            assert!(
                per_template.contains_key(name.as_str()),
                "{name} has no reference cases"
            );
        }
    }
}

#[test]
fn raised_errors_carry_the_templates_text() {
    let r = reference();
    let raising: Vec<&Case> = r.cases.iter().filter(|c| c.raises.is_some()).collect();
    assert!(raising
        .iter()
        .any(|c| c.template.contains("gemma-2") && c.conversation == "system_user"));
    let case = raising[0];
    let t = ChatTemplate::new(&read(&case.template), &case.bos_token, &case.eos_token).unwrap();
    let err = t.render(&case.messages, true).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("chat template: {}", case.raises.as_ref().unwrap())
    );
}

#[test]
fn builtin_sources_are_the_checked_files() {
    for (b, file) in [
        (BuiltinTemplate::Gemma, "builtin-gemma.jinja"),
        (BuiltinTemplate::Llama3, "builtin-llama3.jinja"),
        (BuiltinTemplate::ChatMl, "builtin-chatml.jinja"),
    ] {
        assert_eq!(b.source(), read(file), "{b} differs from {file}");
    }
}

#[test]
fn builtin_formats() {
    let conv = [
        Message::system("Be brief."),
        Message::user("Hi"),
        Message::assistant("Hello."),
        Message::user("Bye"),
    ];
    let gemma = ChatTemplate::builtin(BuiltinTemplate::Gemma, "<bos>", "<eos>");
    assert_eq!(
        gemma.render(&conv, true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let llama = ChatTemplate::builtin(
        BuiltinTemplate::Llama3,
        "<|begin_of_text|>",
        "<|end_of_text|>",
    );
    assert_eq!(
        llama.render(&conv[1..2], true).unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let chatml = ChatTemplate::builtin(BuiltinTemplate::ChatMl, "", "<|im_end|>");
    assert_eq!(
        chatml.render(&conv[..2], false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
    for b in BuiltinTemplate::ALL {
        assert_eq!(
            ChatTemplate::builtin(b, "", "").end_of_turn(),
            Some(b.end_of_turn())
        );
    }
}

#[test]
fn gguf_template_is_used_and_reports_its_end_of_turn() {
    let source = read("qwen2.5-coder-0.5b-gguf.jinja");
    let t =
        ChatTemplate::from_gguf_or_builtin(Some(&source), "<|endoftext|>", "<|im_end|>", |_| true)
            .unwrap();
    assert_eq!(t.builtin_template(), None);
    assert_eq!(t.end_of_turn(), Some("<|im_end|>"));
    let out = t.render(&[Message::user("Write fizzbuzz.")], true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWrite fizzbuzz.<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn strftime_now_follows_the_clock_hook() {
    let source = read("meta-llama-Llama-3.2-3B-Instruct.jinja");
    let day = |d| CivilDateTime {
        year: 2031,
        month: 12,
        day: d,
        hour: 0,
        minute: 0,
        second: 0,
    };
    let t = ChatTemplate::new(&source, "<|begin_of_text|>", "<|eot_id|>")
        .unwrap()
        .with_fixed_time(day(1));
    assert!(t
        .render(&[Message::user("x")], true)
        .unwrap()
        .contains("Today Date: 01 Dec 2031\n"));
    let t = t.with_clock(move || day(24));
    assert!(t
        .render(&[Message::user("x")], true)
        .unwrap()
        .contains("Today Date: 24 Dec 2031\n"));
    // Without a hook it reads the system clock (in UTC): some date in the right format.
    let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
    let year: i32 = t.render(&[], false).unwrap().parse().unwrap();
    assert!(year >= 2024, "{year}");
}
