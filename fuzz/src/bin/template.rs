//! Fuzz target: the chat template with arbitrary messages, tools and kwargs. Any JSON body rendered
//! by the built-in Qwen3.6 template and by the Qwen3.5 checkpoint template of the tests: a prompt or
//! an error, never a panic; a request the server's validation accepts renders (or fails with a
//! request error, which the server turns into a 400).

use std::sync::OnceLock;

use lily_template::ChatTemplate;

fn templates() -> &'static [ChatTemplate; 2] {
    static T: OnceLock<[ChatTemplate; 2]> = OnceLock::new();
    T.get_or_init(|| {
        let qwen35 = lily_fuzz::repo().join("crates/lily-template/tests/data/models/qwen35");
        [ChatTemplate::builtin(), ChatTemplate::from_dir(&qwen35).expect("the Qwen3.5 test template")]
    })
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
        let valid = lily_server::request::parse_chat(&v).is_ok();
        for t in templates() {
            if let Err(e) = t.render_request(&v) {
                // A request the server accepted may still be one the template refuses (a system
                // message that is not first, ...), but never for a reason of the server's own.
                if valid {
                    assert!(e.is_request_error(), "a valid request failed to render: {e}");
                }
            }
        }
    });
}
