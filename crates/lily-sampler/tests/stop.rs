//! Stop conditions: ids, strings across token boundaries, max tokens, held-back text.

use lily_sampler::{Finish, StopChecker, StopReason, StopStep};

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Pushes pieces (ids 100, 101, ...) and returns the emitted text and the finish.
fn run(c: &mut StopChecker, pieces: &[&str]) -> (String, Option<Finish>) {
    let mut out = String::new();
    for (i, p) in pieces.iter().enumerate() {
        let step = c.push(100 + i as u32, p);
        out.push_str(&step.text);
        if step.finish.is_some() {
            return (out, step.finish);
        }
    }
    out.push_str(&c.finish());
    (out, None)
}

fn stop_str(x: &str) -> Option<Finish> {
    Some(Finish::Stop(StopReason::String(x.to_string())))
}

#[test]
fn stop_string_across_token_boundaries() {
    let mut c = StopChecker::new(s(&["llo"]), vec![], None);
    assert_eq!(c.push(1, "Hel"), StopStep { text: "He".into(), finish: None }); // "l" could start "llo"
    assert_eq!(c.push(2, "lo world"), StopStep { text: "".into(), finish: stop_str("llo") });
    assert_eq!(c.finish(), "");
    // Pushing after the end changes nothing.
    assert_eq!(c.push(3, "x"), StopStep { text: "".into(), finish: stop_str("llo") });
    // Split over three tokens, with text before it in the last one.
    let mut c = StopChecker::new(s(&["</stop>"]), vec![], None);
    assert_eq!(run(&mut c, &["a</", "st", "op>b"]), ("a".into(), stop_str("</stop>")));
}

#[test]
fn held_text_is_released_when_the_match_fails() {
    let mut c = StopChecker::new(s(&["llo!"]), vec![], None);
    assert_eq!(c.push(1, "Hel").text, "He");
    assert_eq!(c.push(2, "lo").text, ""); // "llo" still could be "llo!"
    assert_eq!(c.push(3, "?").text, "llo?");
    assert_eq!(c.push(4, "l").text, "");
    assert_eq!(c.finish(), "l"); // end of generation: the held tail is released
                                 // A failed partial match followed by a real one in the same text.
    let mut c = StopChecker::new(s(&["abc"]), vec![], None);
    assert_eq!(run(&mut c, &["xab", "abc"]), ("xab".into(), stop_str("abc")));
}

#[test]
fn overlapping_stop_strings() {
    // The earliest match wins, even if it is a later entry in the list.
    let mut c = StopChecker::new(s(&["abd", "bc"]), vec![], None);
    assert_eq!(c.push(1, "ab").text, ""); // "ab" may be "abd", "b" may be "bc"
    assert_eq!(c.push(2, "c").finish, stop_str("bc"));
    let mut c = StopChecker::new(s(&["abd", "bc"]), vec![], None);
    assert_eq!(run(&mut c, &["xab", "cd"]), ("xa".into(), stop_str("bc")));
    // One stop inside another: earliest start; at the same start, the first listed.
    let mut c = StopChecker::new(s(&["cde", "abcdef"]), vec![], None);
    assert_eq!(run(&mut c, &["zabcdefg"]), ("z".into(), stop_str("abcdef")));
    let mut c = StopChecker::new(s(&["ab", "abc"]), vec![], None);
    assert_eq!(run(&mut c, &["xabc"]), ("x".into(), stop_str("ab")));
    // Overlapping with itself: "aab" in "aaab".
    let mut c = StopChecker::new(s(&["aab"]), vec![], None);
    assert_eq!(run(&mut c, &["a", "a", "a", "b"]), ("a".into(), stop_str("aab")));
}

#[test]
fn stop_at_the_first_token() {
    let mut c = StopChecker::new(s(&["Hello"]), vec![], None);
    assert_eq!(c.push(1, "Hello there"), StopStep { text: "".into(), finish: stop_str("Hello") });
    let mut c = StopChecker::new(vec![], vec![7], None);
    assert_eq!(c.push(7, "<|im_end|>"), StopStep { text: "".into(), finish: Some(Finish::Stop(StopReason::Token(7))) });
}

#[test]
fn stop_token_releases_held_text_and_drops_its_own() {
    let mut c = StopChecker::new(s(&["END"]), vec![248046], None);
    assert_eq!(c.push(1, "the E").text, "the ");
    let step = c.push(248046, "<|im_end|>");
    assert_eq!(step, StopStep { text: "E".into(), finish: Some(Finish::Stop(StopReason::Token(248046))) });
    assert_eq!(c.finished(), Some(&Finish::Stop(StopReason::Token(248046))));
}

#[test]
fn max_tokens_is_length() {
    let mut c = StopChecker::new(s(&["zzz"]), vec![], Some(3));
    assert_eq!(c.push(1, "a").finish, None);
    assert_eq!(c.push(2, "b").finish, None);
    // The last token's text is emitted whole, held-back tail included.
    assert_eq!(c.push(3, "cz"), StopStep { text: "cz".into(), finish: Some(Finish::Length) });
    assert_eq!(c.tokens(), 3);
    assert_eq!(Finish::Length.as_str(), "length");
    // A stop on the last allowed token is a stop, not a length.
    let mut c = StopChecker::new(s(&["c"]), vec![9], Some(2));
    c.push(1, "a");
    assert_eq!(c.push(2, "bc").finish, stop_str("c"));
    let mut c = StopChecker::new(vec![], vec![9], Some(1));
    assert_eq!(c.push(9, "").finish.unwrap().as_str(), "stop");
}

#[test]
fn nothing_is_lost_without_stops_and_utf8_is_respected() {
    let mut c = StopChecker::new(vec![], vec![], None);
    assert_eq!(run(&mut c, &["Hé", "llo ", "wörld"]), ("Héllo wörld".into(), None));
    // A multi-byte stop string: held back on char boundaries only.
    let mut c = StopChecker::new(s(&["ö!", ""]), vec![], None);
    assert_eq!(c.push(1, "wö").text, "w");
    assert_eq!(c.push(2, "rld").text, "örld");
    assert_eq!(run(&mut c, &["ö", "!x"]), ("".into(), stop_str("ö!")));
    // Concatenated output equals the text with everything from the stop string on removed.
    let text = "The quick brown fox jumps over the lazy dog";
    for stop in ["fox", "x j", "dog", "The", "lazy dog!", "o"] {
        for width in 1..6 {
            let pieces: Vec<String> =
                text.as_bytes().chunks(width).map(|b| String::from_utf8(b.to_vec()).unwrap()).collect();
            let refs: Vec<&str> = pieces.iter().map(|x| x.as_str()).collect();
            let mut c = StopChecker::new(s(&[stop]), vec![], None);
            let (out, fin) = run(&mut c, &refs);
            match text.find(stop) {
                Some(i) => assert_eq!((out.as_str(), fin), (&text[..i], stop_str(stop))),
                None => assert_eq!((out.as_str(), fin), (text, None)),
            }
        }
    }
}
