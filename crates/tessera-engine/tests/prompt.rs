//! `Prompt`: the one tokenization the CLI and the server share, on the real Gemma 3
//! vocabulary and its GGUF chat template. Checked against the vocabulary's own ids: one BOS
//! whichever way the prompt comes (the template writes its own, so a chat prompt must not get
//! a second), and a chat reply ending at the template's end-of-turn token as well as EOS.

mod common;

use tessera_engine::chat::Message;
use tessera_engine::prompt::{chat_stop_tokens, model_chat_template, stop_tokens};
use tessera_engine::{EngineError, Prompt, PromptInput};

#[test]
fn prompts_carry_one_bos_and_the_stop_tokens_of_their_kind() {
    let (_model, tok) = common::load(false);
    let special = tok.special();
    let bos = special.bos.expect("Gemma's vocabulary has a BOS");
    let end_of_turn = tok
        .token_id("<end_of_turn>")
        .expect("Gemma's end-of-turn token");
    let count = |ids: &[u32], id: u32| ids.iter().filter(|&&t| t == id).count();

    let text = Prompt::new(&tok, None, PromptInput::Text("The capital of France is")).unwrap();
    assert_eq!(text.ids[0], bos);
    assert_eq!(count(&text.ids, bos), 1);
    assert_eq!(
        text.ids[1..],
        tok.encode("The capital of France is", false).unwrap()[..]
    );
    assert!(text.stop_tokens.contains(&special.eos));
    assert_eq!(text.stop_tokens, stop_tokens(&tok));

    let ids = [bos, 651, 6037];
    let given = Prompt::new(&tok, None, PromptInput::Tokens(&ids)).unwrap();
    assert_eq!(given.ids, ids, "token ids are used as given");

    let template = model_chat_template(&tok).unwrap();
    let turn = [Message::user("Say hello.")];
    let chat = Prompt::new(&tok, Some(&template), PromptInput::Chat(&turn)).unwrap();
    assert_eq!(chat.ids[0], bos);
    assert_eq!(count(&chat.ids, bos), 1, "the template's BOS only");
    let decoded = tok.decode(&chat.ids).unwrap();
    assert!(decoded.contains("Say hello."), "{decoded:?}");
    assert!(
        decoded.ends_with("model\n"),
        "the assistant's turn is open: {decoded:?}"
    );
    assert!(chat.stop_tokens.contains(&end_of_turn));
    assert!(chat.stop_tokens.contains(&special.eos));
    assert_eq!(chat.stop_tokens, chat_stop_tokens(&tok, &template));

    // A conversation needs a template: refused, not sent as text.
    assert!(matches!(
        Prompt::new(&tok, None, PromptInput::Chat(&turn)),
        Err(EngineError::ChatTemplate(_))
    ));
}
