//! Fuzz target: request parsing and validation. Any bytes as a chat or a text-completion request
//! body: the parsers and the sampler's checks must answer Ok or a 400 naming a field, never panic,
//! and a request they accept must have sampling settings the sampler takes or refuses cleanly.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
        let defaults = lily_sampler::Defaults::default();
        match lily_server::request::parse_chat(&v) {
            Ok(req) => {
                let _ = lily_sampler::Sampler::new(&req.common.sampling, &defaults, 248_320);
            }
            Err(e) => assert!(!e.message.is_empty() && e.status.as_u16() == 400, "{e:?}"),
        }
        match lily_server::request::parse_completion(&v) {
            Ok((_, common)) => {
                let _ = lily_sampler::Sampler::new(&common.sampling, &defaults, 248_320);
            }
            Err(e) => assert!(!e.message.is_empty() && e.status.as_u16() == 400, "{e:?}"),
        }
    });
}
