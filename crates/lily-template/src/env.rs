//! The minijinja environment, set up to render chat templates the way transformers' jinja2 environment does
//! (`transformers.utils.chat_template_utils._cached_compile_jinja_template`): `trim_blocks` and `lstrip_blocks`,
//! loop controls, `{% generation %}` blocks, its `tojson` filter (Python `json.dumps`, no HTML escaping, key order
//! kept), `raise_exception`, `strftime_now`, and Python's printing of values (`True`, `None`, `1e-05`).

use std::fmt::Write as _;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Environment, Error, ErrorKind, State};

use crate::pyfmt::{self, JsonOptions};

/// Attached as the source of the error that `raise_exception(message)` returns, so that the message can be told apart
/// from minijinja's own errors and handed to the user verbatim.
#[derive(Debug)]
pub(crate) struct RaisedException(pub String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

pub(crate) fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("default delimiters are valid"),
    );
    // Names without an .html/.xml extension: no auto-escaping, as in transformers (autoescape is off there).
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_formatter(|out, _state, value| {
        match value.kind() {
            ValueKind::String => out.write_str(value.as_str().unwrap_or_default()),
            _ => out.write_str(&pyfmt::py_str(value)),
        }
        .map_err(|_| Error::new(ErrorKind::WriteFailure, "formatting failed"))
    });
    env.set_unknown_method_callback(python_methods);

    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: &Value| Value::from(pyfmt::py_str(v)));
    env.add_filter("trim", |v: &Value, chars: Option<&str>| {
        Value::from(pyfmt::py_strip(&pyfmt::py_str(v), chars, true, true))
    });
    // jinja2's tests: `sequence` is anything with len() and [] (strings and dicts too, and Undefined), and bool is a
    // number (Python's bool is an int); `none` is not iterable.
    env.add_test("sequence", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
    });
    env.add_test("number", |v: &Value| {
        matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
    });
    // Python's iter(None) fails; minijinja iterates none as an empty sequence.
    env.add_test("iterable", |v: &Value| !v.is_none() && v.try_iter().is_ok());

    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, Error> {
            let message = pyfmt::py_str(&message);
            Err(Error::new(ErrorKind::InvalidOperation, message.clone())
                .with_source(RaisedException(message)))
        },
    );
    env.add_function("strftime_now", |format: &str| -> Value {
        Value::from(strftime_utc_now(format))
    });
    env
}

/// `str` methods with Python's whitespace and line-break rules (`strip`, `lstrip`, `rstrip`, `split`, `splitlines`);
/// everything else goes to minijinja-contrib's pycompat (`startswith`, `replace`, `dict.get`, `items`, ...).
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let arg_str = |i: usize| -> Result<Option<String>, Error> {
            match args.get(i) {
                None => Ok(None),
                Some(v) if v.is_none() => Ok(None),
                Some(v) if v.kind() == ValueKind::String => {
                    Ok(Some(v.as_str().unwrap_or_default().to_string()))
                }
                Some(v) => Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{method} arg must be None or str, not {}", v.kind()),
                )),
            }
        };
        let no_kwargs = args.iter().all(|a| !a.is_kwargs());
        match method {
            "strip" | "lstrip" | "rstrip" if no_kwargs && args.len() <= 1 => {
                let chars = arg_str(0)?;
                let (left, right) = (method != "rstrip", method != "lstrip");
                return Ok(Value::from(pyfmt::py_strip(
                    s,
                    chars.as_deref(),
                    left,
                    right,
                )));
            }
            "split" if no_kwargs && args.len() <= 2 => {
                let sep = arg_str(0)?;
                let maxsplit = match args.get(1) {
                    None => -1,
                    Some(v) => v.as_i64().ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            "split maxsplit must be an integer",
                        )
                    })?,
                };
                return Ok(Value::from(pyfmt::py_split(s, sep.as_deref(), maxsplit)?));
            }
            "splitlines" if no_kwargs && args.len() <= 1 => {
                let keepends = args.first().is_some_and(|v| v.is_true());
                return Ok(Value::from(pyfmt::py_splitlines(s, keepends)));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, i.e. `json.dumps`
/// with those arguments (positional or keyword).
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let args: Vec<Value> = args.into_values();
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut params: [Option<Value>; 4] = Default::default();
    let mut positional = 0;
    for arg in args.iter() {
        if arg.is_kwargs() {
            for key in arg.try_iter()? {
                let name = key.as_str().unwrap_or_default();
                let idx = NAMES.iter().position(|n| *n == name).ok_or_else(|| {
                    Error::new(
                        ErrorKind::TooManyArguments,
                        format!("tojson() got an unexpected keyword argument '{name}'"),
                    )
                })?;
                params[idx] = Some(arg.get_item(&key)?);
            }
        } else {
            if positional >= NAMES.len() {
                return Err(Error::new(
                    ErrorKind::TooManyArguments,
                    "tojson() takes at most 5 arguments",
                ));
            }
            params[positional] = Some(arg.clone());
            positional += 1;
        }
    }
    let given = |v: &Option<Value>| {
        v.as_ref()
            .filter(|v| !v.is_none() && !v.is_undefined())
            .cloned()
    };
    let mut opts = JsonOptions {
        ensure_ascii: params[0].as_ref().is_some_and(|v| v.is_true()),
        sort_keys: params[3].as_ref().is_some_and(|v| v.is_true()),
        ..JsonOptions::default()
    };
    if let Some(indent) = given(&params[1]) {
        opts.indent = Some(match indent.kind() {
            ValueKind::String => indent.as_str().unwrap_or_default().to_string(),
            _ => {
                let n = indent.as_i64().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson indent must be an integer or a string",
                    )
                })?;
                " ".repeat(n.max(0) as usize)
            }
        });
        opts.item_separator = ",".into();
    }
    if let Some(seps) = given(&params[2]) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_separator = item.as_str().unwrap_or_default().to_string();
                opts.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair of strings",
                ))
            }
        }
    }
    Ok(Value::from_safe_string(pyfmt::py_json_dumps(value, &opts)?))
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` (its AssistantTracker extension: the body renders
/// unchanged) with `{% if true %}` / `{% endif %}`, which trim whitespace the same way.
pub(crate) fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let mut i = 2;
        if tag[i..].starts_with(['-', '+']) {
            i += 1;
        }
        let ws = tag[i..].len() - tag[i..].trim_start().len();
        let word_start = i + ws;
        let word_len = tag[word_start..]
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(0);
        let replacement = match &tag[word_start..word_start + word_len] {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str(&tag[..word_start]);
                out.push_str(r);
                rest = &tag[word_start + word_len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `datetime.now().strftime(format)` for the common directives, in UTC (a server's usual local time zone).
fn strftime_utc_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(format, secs)
}

pub(crate) fn strftime_utc(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (
        secs_of_day / 3600,
        secs_of_day % 3600 / 60,
        secs_of_day % 60,
    );
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:>2}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('u') => {
                let _ = write!(out, "{}", weekday + 1);
            }
            Some('w') => {
                let _ = write!(out, "{}", (weekday + 1) % 7);
            }
            Some('F') => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags() {
        assert_eq!(
            rewrite_generation_tags(
                "a{%- generation -%}b{% endgeneration %}c{% if x %}{%generation%}"
            ),
            "a{%- if true -%}b{% endif %}c{% if x %}{%if true%}"
        );
        assert_eq!(
            rewrite_generation_tags("{% generation_x %}{{ '{%' }}"),
            "{% generation_x %}{{ '{%' }}"
        );
    }

    #[test]
    fn strftime() {
        // 2025-03-01 13:05:09 UTC, a Saturday
        let t = 1_740_834_309;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2025-03-01 13:05:09");
        assert_eq!(
            strftime_utc("%d %b %Y, %A %-d %B %I%p %j %%", t),
            "01 Mar 2025, Saturday 1 March 01PM 060 %"
        );
        assert_eq!(strftime_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert_eq!(strftime_utc("%j", 978_220_800), "366"); // 2000-12-31
    }
}
