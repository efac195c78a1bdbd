//! Python's way of turning values into text, for the places where a chat template's output depends on it:
//! `{{ value }}` and `|string` (Python `str()`: `True`, `None`, `1e-05`, `{'a': [1, 'x']}`), `|tojson`
//! (transformers' `json.dumps(x, ensure_ascii=False, ...)`), and Python's notion of whitespace and line breaks for
//! `strip`/`split`/`splitlines`/`|trim`.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// `str.isspace()`: Rust's `char::is_whitespace` plus the four ASCII information separators.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The line boundaries of `str.splitlines()` (`\r\n` is handled by the caller).
fn is_py_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\u{0b}'
            | '\u{0c}'
            | '\u{1c}'
            | '\u{1d}'
            | '\u{1e}'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

/// `str.strip(chars)` / `lstrip` / `rstrip`.
pub fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip);
    }
    if right {
        out = out.trim_end_matches(strip);
    }
    out
}

/// `str.split(sep=None, maxsplit=-1)`.
pub fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<String>, Error> {
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    match sep {
        Some("") => Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
        Some(sep) => {
            let mut out = Vec::new();
            let mut rest = s;
            while out.len() < limit {
                match rest.find(sep) {
                    Some(i) => {
                        out.push(rest[..i].to_string());
                        rest = &rest[i + sep.len()..];
                    }
                    None => break,
                }
            }
            out.push(rest.to_string());
            Ok(out)
        }
        None => {
            let mut out = Vec::new();
            let mut rest = s.trim_start_matches(is_py_space);
            while !rest.is_empty() {
                if out.len() == limit {
                    out.push(rest.to_string());
                    break;
                }
                let end = rest.find(is_py_space).unwrap_or(rest.len());
                out.push(rest[..end].to_string());
                rest = rest[end..].trim_start_matches(is_py_space);
            }
            Ok(out)
        }
    }
}

/// `str.splitlines(keepends=False)`.
pub fn py_splitlines(s: &str, keepends: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut iter = s.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        if is_py_line_break(c) {
            let mut end = i + c.len_utf8();
            if c == '\r' {
                if let Some(&(_, '\n')) = iter.peek() {
                    iter.next();
                    end += 1;
                }
            }
            out.push(
                if keepends {
                    &s[start..end]
                } else {
                    &s[start..i]
                }
                .to_string(),
            );
            start = end;
        }
    }
    if start < s.len() {
        out.push(s[start..].to_string());
    }
    out
}

/// `repr(float)` (= `str(float)`): the shortest repr that round-trips, in fixed notation when the decimal exponent is in
/// -4..16 and in exponent notation (`1e-05`, `1.5e+16`) otherwise.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = format!("{:e}", f.abs()); // shortest round-trip digits, e.g. "1.2345e3", "1e-7", "0e0"
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let (int_part, frac_part) = if exp >= 0 {
            let n = exp as usize + 1;
            if digits.len() <= n {
                (
                    format!("{digits}{}", "0".repeat(n - digits.len())),
                    String::new(),
                )
            } else {
                (digits[..n].to_string(), digits[n..].to_string())
            }
        } else {
            (
                "0".to_string(),
                format!("{}{digits}", "0".repeat((-exp - 1) as usize)),
            )
        };
        let frac_part = if frac_part.is_empty() {
            "0".to_string()
        } else {
            frac_part
        };
        format!("{sign}{int_part}.{frac_part}")
    } else {
        let (first, rest) = digits.split_at(1);
        let rest = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{rest}e{esign}{:02}", exp.abs())
    }
}

fn value_f64(v: &Value) -> f64 {
    f64::try_from(v.clone()).unwrap_or(f64::NAN)
}

/// Python's `str(value)` for the values a template sees (what jinja2 prints for `{{ value }}`).
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr(value)`: strings quoted, containers with `repr` of their items.
pub fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, v);
    out
}

fn write_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&py_float(value_f64(v)));
            }
        }
        ValueKind::String => write_str_repr(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = v.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = v.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    write_repr(out, &v.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
}

/// Characters `repr()` shows as escapes: `str.isprintable()` is false for them (categories Cc, Cf, Cs, Co, Cn, Zl, Zp
/// and Zs other than the space). Covers the control and separator characters exactly and the common format characters.
fn py_unprintable(c: char) -> bool {
    let u = c as u32;
    c.is_control()
        || matches!(
            u,
            0xa0 | 0xad
                | 0x600..=0x605
                | 0x61c
                | 0x6dd
                | 0x70f
                | 0x1680
                | 0x180e
                | 0x2000..=0x200f
                | 0x2028..=0x202f
                | 0x205f..=0x2064
                | 0x2066..=0x206f
                | 0x3000
                | 0xd800..=0xf8ff
                | 0xfeff
                | 0xfff9..=0xfffb
                | 0xe0001
                | 0xe0020..=0xe007f
                | 0xf0000..=0x10ffff
        )
}

fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_unprintable(c) => {
                let u = c as u32;
                if u <= 0xff {
                    out.push_str(&format!("\\x{u:02x}"));
                } else if u <= 0xffff {
                    out.push_str(&format!("\\u{u:04x}"));
                } else {
                    out.push_str(&format!("\\U{u:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Options of Python's `json.dumps` that transformers' `tojson` filter exposes.
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: single line. `Some(s)`: one item per line, each level indented by `s`.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        JsonOptions {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

fn not_serializable(v: &Value) -> Error {
    let what = match v.kind() {
        ValueKind::Undefined => "Undefined".to_string(),
        k => k.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {what} is not JSON serializable"),
    )
}

/// `json.dumps(value, ...)` as Python writes it.
pub fn py_json_dumps(v: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, v, opts, 0)?;
    Ok(out)
}

fn json_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        }
    } else {
        py_float(f)
    }
}

fn newline_indent(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// A dict key as `json.dumps` converts it: strings as they are, numbers, booleans and None to their JSON text.
fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::None => "null".to_string(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => json_float(value_f64(k)),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "keys must be str, int, float, bool or None, not {}",
                    k.kind()
                ),
            ))
        }
    })
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOptions, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&json_float(value_f64(v)));
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                items.push((json_key(&key)?, value));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, value)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline_indent(out, opts, level + 1);
                write_json_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_separator);
                write_json(out, value, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push('}');
        }
        _ => return Err(not_serializable(v)),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
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
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_like_python() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (2500.5, "2500.5"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (1e300, "1e+300"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (-3.25, "-3.25"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn split_like_python() {
        assert_eq!(py_split("  a  b c ", None, -1).unwrap(), ["a", "b", "c"]);
        assert_eq!(py_split(" a  b  c ", None, 1).unwrap(), ["a", "b  c "]);
        assert_eq!(py_split("", None, -1).unwrap(), Vec::<String>::new());
        assert_eq!(
            py_split("a,b,,c", Some(","), -1).unwrap(),
            ["a", "b", "", "c"]
        );
        assert_eq!(py_split("a,b,c", Some(","), 1).unwrap(), ["a", "b,c"]);
        assert_eq!(py_split("", Some(","), -1).unwrap(), [""]);
        assert_eq!(py_splitlines("a\r\nb\x1cc\n", false), ["a", "b", "c"]);
        assert_eq!(
            py_splitlines("a\r\nb\n\nc", true),
            ["a\r\n", "b\n", "\n", "c"]
        );
        assert_eq!(py_strip("\x1f a \u{3000}", None, true, true), "a");
    }

    #[test]
    fn repr_like_python() {
        let v = Value::from(minijinja::value::Serde(serde_json::json!([
            "it's",
            "a\"b",
            "x'y\"z\\\n",
            "\u{a0}é\u{1}",
            1.0,
            null,
            true
        ])));
        assert_eq!(
            py_repr(&v),
            r#"["it's", 'a"b', 'x\'y"z\\\n', '\xa0é\x01', 1.0, None, True]"#
        );
    }
}
