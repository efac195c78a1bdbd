//! Typed readers of request fields. A field of the wrong type, or a number out of its range, is a
//! 400 that names the field (its path in the body, e.g. `messages[2].tool_calls[0].function.name`)
//! and says in plain words what was expected and what came: never serde's Rust wording, never a
//! value silently reinterpreted or wrapped by a cast. `null` means "not set" wherever a field is
//! optional.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// "a string", "an array", ... for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The value as it came, cut short when long (a message never echoes megabytes back).
pub fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.len() <= 60 {
        return s;
    }
    let mut end = 57;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// "`temperature` must be a number, got a string: "0.7"".
pub fn wrong(param: &str, expected: &str, v: &Value) -> ApiError {
    let got = match v {
        Value::Null | Value::Bool(_) | Value::Array(_) | Value::Object(_) if shown(v).len() > 20 => kind(v).to_string(),
        _ => format!("{}: {}", kind(v), shown(v)),
    };
    ApiError::invalid(param, format!("`{param}` must be {expected}, got {got}"))
}

/// The field, unless absent or null.
pub fn get<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

pub fn opt_bool(m: &Map<String, Value>, key: &str, param: &str) -> Result<Option<bool>, ApiError> {
    match get(m, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong(param, "a boolean (true or false)", v)),
    }
}

pub fn opt_str<'a>(m: &'a Map<String, Value>, key: &str, param: &str) -> Result<Option<&'a str>, ApiError> {
    match get(m, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(param, "a string", v)),
    }
}

/// A finite number that fits an f32.
pub fn opt_f32(m: &Map<String, Value>, key: &str, param: &str) -> Result<Option<f32>, ApiError> {
    match get(m, key) {
        None => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_f64() {
            Some(x) if x.is_finite() && x.abs() <= f32::MAX as f64 => Ok(Some(x as f32)),
            _ => Err(wrong(param, "a number in range", v)),
        },
        Some(v) => Err(wrong(param, "a number", v)),
    }
}

/// An integer in `min..=max` (a number with a fractional part, or outside the range, is refused;
/// `2.0` is the integer 2).
pub fn int_in(v: &Value, param: &str, min: i128, max: i128) -> Result<i128, ApiError> {
    let range = || {
        if max == i128::from(u64::MAX) {
            format!("an integer of at least {min}")
        } else {
            format!("an integer from {min} to {max}")
        }
    };
    let Value::Number(n) = v else { return Err(wrong(param, &range(), v)) };
    let i = if let Some(i) = n.as_i64() {
        i128::from(i)
    } else if let Some(u) = n.as_u64() {
        i128::from(u)
    } else {
        match n.as_f64() {
            // Integral and within ±2^64 (beyond that every f64 is integral, and out of any range).
            Some(x) if x.fract() == 0.0 && x.abs() < 1.9e19 => x as i128,
            _ => return Err(wrong(param, &range(), v)),
        }
    };
    if i < min || i > max {
        return Err(wrong(param, &range(), v));
    }
    Ok(i)
}

pub fn opt_int(m: &Map<String, Value>, key: &str, param: &str, min: i128, max: i128) -> Result<Option<i128>, ApiError> {
    get(m, key).map(|v| int_in(v, param, min, max)).transpose()
}

pub fn opt_object<'a>(m: &'a Map<String, Value>, key: &str, param: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
    match get(m, key) {
        None => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(v) => Err(wrong(param, "an object", v)),
    }
}

pub fn opt_array<'a>(m: &'a Map<String, Value>, key: &str, param: &str) -> Result<Option<&'a [Value]>, ApiError> {
    match get(m, key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(wrong(param, "an array", v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn m(v: Value) -> Map<String, Value> {
        json!({ "x": v }).as_object().unwrap().clone()
    }

    #[test]
    fn messages_say_what_was_expected_and_what_came() {
        let e = opt_f32(&m(json!("0.7")), "x", "temperature").unwrap_err();
        assert_eq!(e.message, "`temperature` must be a number, got a string: \"0.7\"");
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = opt_bool(&m(json!([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])), "x", "stream").unwrap_err();
        assert_eq!(e.message, "`stream` must be a boolean (true or false), got an array");
        let long = "y".repeat(1000);
        let e = opt_bool(&m(json!(long)), "x", "stream").unwrap_err();
        assert!(e.message.len() < 140, "{}", e.message);
    }

    #[test]
    fn integers_are_checked_not_cast() {
        let r = |v: Value| opt_int(&m(v), "x", "n", 0, 20);
        assert_eq!(r(json!(20)).unwrap(), Some(20));
        assert_eq!(r(json!(3.0)).unwrap(), Some(3));
        assert_eq!(r(Value::Null).unwrap(), None);
        for bad in [json!(21), json!(-1), json!(2.5), json!(4294967297u64), json!(1e300), json!("3"), json!(true)] {
            assert!(r(bad.clone()).is_err(), "{bad}");
        }
        let seed = |v: Value| opt_int(&m(v), "x", "seed", i128::from(i64::MIN), i128::from(u64::MAX));
        assert_eq!(seed(json!(u64::MAX)).unwrap(), Some(i128::from(u64::MAX)));
        assert_eq!(seed(json!(i64::MIN)).unwrap(), Some(i128::from(i64::MIN)));
        assert!(seed(json!(1e20)).is_err());
    }

    #[test]
    fn numbers_must_be_finite_f32s() {
        assert_eq!(opt_f32(&m(json!(1)), "x", "t").unwrap(), Some(1.0));
        assert!(opt_f32(&m(json!(1e300)), "x", "t").is_err());
        assert!(opt_f32(&m(json!(null)), "x", "t").unwrap().is_none());
    }
}
