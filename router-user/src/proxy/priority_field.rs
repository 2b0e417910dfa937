//! `classes.engine_priority`: the `"priority":N` the router adds to the
//! JSON body it forwards, so an engine that schedules by priority (vLLM's
//! `--scheduling-policy priority`) runs the request by its class
//! (decision 0057).
//!
//! The field goes right after the body's opening brace, with a comma
//! unless the object is empty. The body itself is not copied for it: the
//! forwarded head takes the bytes up to the brace and the field, and the
//! rest is sent from where it lies (`forward::finish_request_head`).

/// Bytes before the opening brace (whitespace) the router copies to insert
/// the field; a body that opens later is sent as it is.
const MAX_LEAD: usize = 4096;

/// The longest field: `"priority":-2147483648,`.
const MAX_FIELD: usize = 24;

/// The field to write into a body, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insert {
    /// The offset in the body it goes before (just past the brace).
    at: usize,
    bytes: [u8; MAX_FIELD],
    len: u8,
}

impl Insert {
    /// `"priority":value` into the object `body` holds, after its opening
    /// brace; `None` when the body does not open with one (after at most
    /// `MAX_LEAD` bytes of whitespace).
    pub fn priority(body: &[u8], value: i32) -> Option<Insert> {
        let brace = body
            .iter()
            .take(MAX_LEAD + 1)
            .position(|b| !b.is_ascii_whitespace())?;
        if body[brace] != b'{' {
            return None;
        }
        let at = brace + 1;
        let empty = body[at..]
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .is_some_and(|&b| b == b'}');
        let mut bytes = [0u8; MAX_FIELD];
        let mut len = 0;
        let mut put = |s: &[u8]| {
            bytes[len..len + s.len()].copy_from_slice(s);
            len += s.len();
        };
        put(b"\"priority\":");
        put(itoa::Buffer::new().format(value).as_bytes());
        if !empty {
            put(b",");
        }
        Some(Insert {
            at,
            bytes,
            len: len as u8,
        })
    }

    /// The offset in the body the field goes before.
    pub fn at(&self) -> usize {
        self.at
    }

    /// The field's bytes, comma included when one is needed.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// `body` with the field in place (tests, and the small bodies copied
    /// behind the head).
    pub fn write(&self, body: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(&body[..self.at]);
        out.extend_from_slice(self.bytes());
        out.extend_from_slice(&body[self.at..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(body: &str, value: i32) -> Option<String> {
        let i = Insert::priority(body.as_bytes(), value)?;
        let mut out = Vec::new();
        i.write(body.as_bytes(), &mut out);
        Some(String::from_utf8(out).unwrap())
    }

    #[test]
    fn the_field_opens_the_object_and_it_stays_json() {
        for (body, want) in [
            ("{}", r#"{"priority":1}"#),
            ("{ \n }", "{\"priority\":1 \n }"),
            (r#"{"a":1}"#, r#"{"priority":1,"a":1}"#),
            (
                " \r\n\t{ \"a\" : [1] }",
                " \r\n\t{\"priority\":1, \"a\" : [1] }",
            ),
        ] {
            let got = with(body, 1).unwrap();
            assert_eq!(got, want);
            let v: serde_json::Value = serde_json::from_str(&got).unwrap();
            assert_eq!(v["priority"], 1);
        }
    }

    #[test]
    fn extreme_values_fit() {
        for v in [i32::MIN, -1, 0, i32::MAX] {
            let got = with(r#"{"messages":[]}"#, v).unwrap();
            let parsed: serde_json::Value = serde_json::from_str(&got).unwrap();
            assert_eq!(parsed["priority"], i64::from(v));
        }
    }

    #[test]
    fn a_body_that_is_no_object_is_left_alone() {
        for body in ["", "   ", "[1]", "\"x\"", "null"] {
            assert_eq!(with(body, 1), None, "{body:?}");
        }
        let late = format!("{}{{}}", " ".repeat(MAX_LEAD + 1));
        assert_eq!(with(&late, 1), None);
        let just = format!("{}{{}}", " ".repeat(MAX_LEAD));
        assert!(with(&just, 1).is_some());
    }
}
