//! DeepSeek V4 chat prompts: what the official chat template (as embedded by llama.cpp in
//! `tokenizer.chat_template`) renders for system, user and assistant messages, without tools.
//!
//! ```text
//! BOS  system prompt  <｜User｜>user text<｜Assistant｜></think>answer<｜end▁of▁sentence｜>
//!      <｜User｜>next question<｜Assistant｜><think>          (generation prompt, thinking)
//! ```
//!
//! * Every system message goes into the system prompt right after BOS, wherever it stands in
//!   the conversation, several joined by a blank line (`"\n\n"`).
//! * Consecutive user messages share one `<｜User｜>`, joined by a blank line.
//! * An assistant message is `<｜Assistant｜>`, then `</think>`, then its content and
//!   `<｜end▁of▁sentence｜>`. With thinking on, an assistant message after the last user message
//!   keeps its reasoning: `<think>reasoning</think>` in place of `</think>`; earlier turns' reasoning
//!   is dropped.
//! * The generation prompt is `<｜Assistant｜>` then `<think>` (thinking) or `</think>`.

use std::str::FromStr;

use super::{BOS_TEXT, EOS_TEXT};
use crate::Error;

pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            _ => {
                Err(Error::invalid(format!("unknown chat role {s:?} (expected \"system\", \"user\" or \"assistant\")")))
            }
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// An assistant message's reasoning; rendered only with thinking on, for a message after
    /// the last user message.
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage { role, content: content.into(), reasoning_content: None }
    }
}

/// The prompt text of a conversation (encode it with `allow_special = true`: it starts with
/// the BOS text).
pub fn render_chat(messages: &[ChatMessage], thinking: bool, add_generation_prompt: bool) -> String {
    let mut out = String::from(BOS_TEXT);
    let mut first_system = true;
    for m in messages.iter().filter(|m| m.role == Role::System) {
        if !first_system {
            out.push_str("\n\n");
        }
        first_system = false;
        out.push_str(&m.content);
    }
    let last_user = messages.iter().rposition(|m| m.role == Role::User);
    let mut in_user = false;
    for (i, m) in messages.iter().enumerate() {
        match m.role {
            Role::System => {}
            Role::User => {
                out.push_str(if in_user { "\n\n" } else { USER });
                in_user = true;
                out.push_str(&m.content);
            }
            Role::Assistant => {
                in_user = false;
                out.push_str(ASSISTANT);
                if thinking && last_user.is_none_or(|u| i > u) {
                    out.push_str(THINK_START);
                    out.push_str(m.reasoning_content.as_deref().unwrap_or(""));
                }
                out.push_str(THINK_END);
                out.push_str(&m.content);
                out.push_str(EOS_TEXT);
            }
        }
    }
    if add_generation_prompt {
        out.push_str(ASSISTANT);
        out.push_str(if thinking { THINK_START } else { THINK_END });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_conversation() {
        let msgs = [
            ChatMessage::new(Role::System, "Be brief."),
            ChatMessage::new(Role::User, "Hi"),
            ChatMessage { role: Role::Assistant, content: "Hello!".into(), reasoning_content: Some("greet".into()) },
            ChatMessage::new(Role::User, "2+2?"),
        ];
        assert_eq!(
            render_chat(&msgs, false, true),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>"
        );
        assert_eq!(
            render_chat(&msgs, true, true),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>"
        );
        assert_eq!(render_chat(&msgs[..3], true, false).matches("<think>greet</think>").count(), 1);
        assert!("tool".parse::<Role>().is_err());
    }
}
