//! `generate --chat-template` and `chat` through the model file's own chat template.

use candle_core::quantized::gguf_file;
use candle_core::Device;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::qwen;

fn tessera(args: &[&str], stdin: &str) -> (i32, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    // The process may exit (an error, say) before it reads its input: a broken pipe here is
    // its choice, not a failure; what it printed and its status are what is checked.
    if let Err(e) = child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe,
            "writing stdin: {e}"
        );
    }
    let out = child.wait_with_output().expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-cli-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn chat_template_replies_stop_at_the_end_of_turn() {
    let (code, out, err) = tessera(
        &[
            "generate",
            "--model",
            qwen().to_str().unwrap(),
            "--chat-template",
            "--prompt",
            "Say hi.",
            "--max-tokens",
            "40",
            "--temperature",
            "0",
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty(), "a reply: {out:?}");
    // The file's own template: no built-in notice.
    assert!(!err.contains("built-in"), "{err}");
    assert!(err.contains("stop: end of turn <|im_end|>"), "{err}");
    assert!(
        !out.contains("<|im"),
        "control tokens are not printed: {out:?}"
    );
}

#[test]
fn chat_keeps_the_conversation_and_reset_clears_it() {
    let (code, out, err) = tessera(
        &[
            "chat",
            "--model",
            qwen().to_str().unwrap(),
            "--max-tokens",
            "12",
            "--temperature",
            "0",
        ],
        "My name is Ada. Reply with one word.\nWhat is my name? One word.\n/reset\n/quit\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("(conversation reset)"), "{err}");
    assert!(
        out.contains("Ada"),
        "the second turn sees the first: {out:?}"
    );
}

/// A copy of a tiny synthetic model whose `tokenizer.chat_template` is `template`.
fn model_with_template(name: &str, template: &str) -> PathBuf {
    let base = scratch(&format!("{name}-base.gguf"));
    let (code, _, err) = tessera(
        &[
            "model",
            "synth",
            "--arch",
            "qwen2",
            "--preset",
            "tiny",
            "--out",
            base.to_str().unwrap(),
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    let out = scratch(&format!("{name}.gguf"));
    rewrite_with_template(&base, &out, template);
    out
}

fn rewrite_with_template(src: &Path, dst: &Path, template: &str) {
    let mut r = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut r).unwrap();
    let mut metadata: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.push((
        "tokenizer.chat_template".into(),
        gguf_file::Value::String(template.into()),
    ));
    let tensors: Vec<(String, _)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let t = content.tensor(&mut r, name, &Device::Cpu).unwrap();
            (name.clone(), t)
        })
        .collect();
    let md: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &_)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(dst).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
}

#[test]
fn a_template_that_raises_is_a_one_line_error() {
    let model = model_with_template(
        "raises",
        "{% for m in messages %}{% if m.role == 'user' %}\
         {{ raise_exception('This model does not take user messages!') }}\
         {% endif %}{% endfor %}",
    );
    for args in [
        &["generate", "--prompt", "hi", "--chat-template"][..],
        &["chat"][..],
    ] {
        let mut all = args.to_vec();
        all.extend(["--model", model.to_str().unwrap(), "--max-tokens", "2"]);
        let (code, _, err) = tessera(&all, "hi\n/quit\n");
        if args[0] == "generate" {
            assert_eq!(code, 1, "{err}");
            assert!(err.starts_with("error: "), "{err}");
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        } else {
            // `chat` reports the turn's error and reads on.
            assert_eq!(code, 0, "{err}");
            assert_eq!(
                err.lines().filter(|l| l.starts_with("error: ")).count(),
                1,
                "{err}"
            );
        }
        assert!(
            err.contains("chat template: This model does not take user messages!"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_file_without_a_template_says_which_built_in_it_uses() {
    // The synthetic vocabulary has Gemma's turn tokens and no template: the built-in
    // Gemma format, announced once.
    let model = scratch("plain.gguf");
    let (code, _, err) = tessera(
        &[
            "model",
            "synth",
            "--arch",
            "qwen2",
            "--preset",
            "tiny",
            "--out",
            model.to_str().unwrap(),
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = tessera(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--chat-template",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ],
        "",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("tessera: using the built-in Gemma chat template (the file has none)"),
        "{err}"
    );
    assert_eq!(err.matches("built-in").count(), 1, "{err}");
}
