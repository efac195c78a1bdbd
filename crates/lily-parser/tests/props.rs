//! Property-style tests: any split of the stream gives the same message, events always agree with
//! the message, nothing panics, and no text is lost except markup.

mod common;

use common::*;
use lily_parser::{ParsedMessage, ParserConfig};
use std::collections::HashMap;

const TAGS: &[&str] = &[
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    // Keys of the JSON call form are markup too.
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
];
const CLOSERS: &[&str] = &["</parameter>", "</function>", "</tool_call>"];

/// Letters (lower-cased) and `&`: what must survive parsing. Digits, punctuation and whitespace
/// are left out because typing may legitimately rewrite them (`4.0` -> `4`, newline trimming).
fn letters(s: &str) -> HashMap<char, i64> {
    let mut m = HashMap::new();
    for c in s.chars() {
        if c.is_alphabetic() || c == '&' {
            let c = c.to_lowercase().next().unwrap_or(c);
            *m.entry(c).or_insert(0) += 1;
        }
    }
    m
}

fn check_lossless(input: &str, msg: &ParsedMessage) {
    let mut need = letters(input);
    for t in TAGS {
        let k = input.matches(t).count() as i64;
        for (c, n) in letters(t) {
            *need.entry(c).or_insert(0) -= k * n;
        }
    }
    // A closing tag cut off by the end of generation is dropped as markup.
    let tail = input.trim_end();
    'outer: for cl in CLOSERS {
        for l in (2..cl.len()).rev() {
            if tail.ends_with(&cl[..l]) {
                for (c, n) in letters(&cl[..l]) {
                    *need.entry(c).or_insert(0) -= n;
                }
                break 'outer;
            }
        }
    }
    let mut out = String::new();
    out.push_str(msg.reasoning.as_deref().unwrap_or(""));
    out.push_str(msg.content.as_deref().unwrap_or(""));
    for c in &msg.tool_calls {
        out.push_str(&c.name);
        out.push_str(&c.arguments);
    }
    let have = letters(&out);
    for (c, n) in need {
        let h = have.get(&c).copied().unwrap_or(0);
        assert!(
            h >= n,
            "lost {c:?} ({h} < {n})\ninput: {input:?}\nmsg: {msg:#?}"
        );
    }
}

fn check_all_splits(cfg_: &ParserConfig, input: &str, rng: &mut Rng, exhaustive: bool) {
    let whole = run_pieces(cfg_.clone(), &[input]).msg;
    check_lossless(input, &whole);
    let mut splits: Vec<Vec<String>> = vec![char_split(input)];
    if exhaustive {
        for (i, _) in input.char_indices().skip(1) {
            splits.push(vec![input[..i].to_string(), input[i..].to_string()]);
        }
    }
    for _ in 0..if exhaustive { 20 } else { 3 } {
        let max = 1 + rng.below(12);
        splits.push(random_split(input, rng, max));
    }
    for pieces in splits {
        let m = run_pieces(cfg_.clone(), &pieces).msg;
        assert_eq!(
            m, whole,
            "split changed the result\ninput: {input:?}\npieces: {pieces:?}"
        );
    }
}

fn configs() -> Vec<ParserConfig> {
    vec![
        cfg(false),
        cfg(true),
        cfg_no_tools(false),
        cfg_no_tools(true),
    ]
}

fn corpus() -> Vec<String> {
    let call = |city: &str| {
        format!("<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    };
    vec![
        "Let me think.\nOK.\n</think>\n\nThe answer is 4.".to_string(),
        "<think>\nhmm\n</think>\n\nHi".to_string(),
        "</think>\n\nHi <b>there</b> & bye".to_string(),
        format!("Checking.\n\n{}\n{}", call("Paris"), call("Oslo & <Lima>")),
        format!("Reasoning first.\n{}\nmore\n</think>\n\nDone.", call("Rome")),
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/a.txt\n</parameter>\n<parameter=content>\nx </parameters> y </parameter>oops\nClose with </parameter>\nthen more\n\n</parameter>\n</function>\n</tool_call>".to_string(),
        "<tool_call>\n<function=config>\n<parameter=opts>\n{\"a\": {\"b\": [1, 2]}, \"s\": \"x<y\"}\n</parameter>\n<parameter=n>\nabc\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n</function>\n</tool_call>".to_string(),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>".to_string(),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>".to_string(),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nunclosed value\nspanning lines".to_string(),
        "<tool_call>\n<function=get_weather>\n<parameter=ci".to_string(),
        "Sure.\n\n<tool_call>\n<function=get_wea".to_string(),
        "Hi <tool_call>".to_string(),
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>".to_string(),
        "<tool_call>\n<function=get_weather>\n{\"city\": \"Paris\"}\n</function>\n</tool_call>".to_string(),
        "Ok.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>".to_string(),
        "<tool_call>\n<function=get_weather>\n<parameter=\nbroken\n</parameter>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>".to_string(),
        "<tool_call>\n<function=get_weather>\nstray words\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\nafter".to_string(),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</func".to_string(),
        "Use <think> and </think>, also <tool_call> and <function=x>.".to_string(),
        "日本語のテキスト\n</think>\n\né & ü <tool_call>\n<function=get_weather>\n<parameter=city>\n東京\n</parameter>\n</function>\n</tool_call>".to_string(),
    ]
}

#[test]
fn corpus_every_split_gives_the_same_message() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for input in corpus() {
        for c in configs() {
            check_all_splits(&c, &input, &mut rng, true);
        }
    }
}

const ALPHABET: &[&str] = &[
    "<",
    ">",
    "/",
    "=",
    "\n",
    "\n\n",
    " ",
    "\r\n",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "get_weather",
    "config",
    "write_file",
    "zzz",
    "</function>",
    "<parameter=",
    "city",
    "n",
    "opts",
    "flag",
    "days",
    "</parameter>",
    "<think>",
    "</think>",
    "{",
    "}",
    "\"",
    ":",
    ",",
    "[",
    "]",
    "1",
    "2.5",
    "a",
    "b",
    "&",
    "x y",
    "é",
    "日本",
    "true",
    "True",
    "null",
    "<tool_c",
    "</para",
    "<func",
    ">\n",
    "<tool_call>\n<function=get_weather>\n",
    "<parameter=city>\n",
    "<parameter=days>\n",
    "<parameter=opts>\n",
    "\n</parameter>\n",
    "</function>\n</tool_call>",
    "<tool_call>\n<function=config>\n",
    "<function=get_weather>\n",
    "{\"name\": \"config\", \"arguments\": ",
];

fn garbage(rng: &mut Rng) -> String {
    let n = rng.below(60);
    let mut s = String::new();
    for _ in 0..n {
        if rng.below(10) == 0 {
            // Any char, including control and odd unicode.
            let c = char::from_u32((rng.next() % 0x3000) as u32).unwrap_or('?');
            s.push(c);
        } else {
            s.push_str(ALPHABET[rng.below(ALPHABET.len())]);
        }
    }
    s
}

#[test]
fn random_garbage_never_panics_and_is_split_invariant() {
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for i in 0..4000 {
        let input = garbage(&mut rng);
        let c = &configs()[i % 4];
        check_all_splits(c, &input, &mut rng, i % 50 == 0);
    }
}

#[test]
fn random_bytes_as_lossy_text() {
    let mut rng = Rng(42);
    for _ in 0..500 {
        let n = rng.below(300);
        let bytes: Vec<u8> = (0..n).map(|_| (rng.next() & 0xff) as u8).collect();
        let s = String::from_utf8_lossy(&bytes).into_owned();
        for c in configs() {
            let m = run_pieces(c.clone(), &random_split(&s, &mut rng, 9)).msg;
            check_lossless(&s, &m);
        }
    }
}

#[test]
fn long_streams_are_linear_enough() {
    let t0 = std::time::Instant::now();
    // 1 MB string value in 3-byte pieces.
    let body: String = (0..40_000).map(|i| format!("{i} <x> & y\n")).collect();
    let t = format!("<tool_call>\n<function=write_file>\n<parameter=content>\n{body}\n</parameter>\n</function>\n</tool_call>");
    let r = run_pieces(cfg(false), &random_split(&t, &mut Rng(3), 3));
    assert_eq!(r.msg.tool_calls.len(), 1);
    // 300 kB JSON-body call in 3-byte pieces (held until complete).
    let arr: Vec<String> = (0..30_000).map(|i| format!("\"v{i}\"")).collect();
    let t = format!(
        "<tool_call>\n<function=config>\n{{\"tags\": [{}]}}\n</function>\n</tool_call>",
        arr.join(", ")
    );
    let r = run_pieces(cfg(false), &random_split(&t, &mut Rng(4), 3));
    assert_eq!(r.msg.tool_calls.len(), 1);
    // 1 MB of content with many '<'.
    let html: String = (0..50_000).map(|i| format!("<p>{i}</p>\n")).collect();
    let r = run_pieces(cfg(false), &random_split(&html, &mut Rng(5), 3));
    assert_eq!(r.msg.content.as_deref(), Some(html.trim_end()));
    assert!(
        t0.elapsed().as_secs_f64() < 10.0,
        "too slow: {:?}",
        t0.elapsed()
    );
}
