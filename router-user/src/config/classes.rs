//! `[classes]`: request classes and the tenants callers belong to.
//!
//! A request's class is its caller's word (a configured header, else the
//! body's `service_tier`) under its tenant's class: a tenant (found by the
//! caller's API key, else the body's `user`) gives its class to requests
//! that say none, and a request may lower its class below its tenant's but
//! never raise it above. A caller no tenant names is tenant `-`, its word
//! alone deciding (no word: `default`). Decision 0051.

use std::sync::Arc;

use anyhow::bail;
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64;

use crate::prompt::extract::Class;

/// Tenants at most: each is a label value on `/metrics` (with `-`).
pub const MAX_TENANTS: usize = 256;
/// The tenant name of a caller no tenant names.
pub const NO_TENANT: &str = "-";

/// Request classes (`priority` above `default`/`auto` above `flex`) and
/// the tenants callers belong to.
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "ClassesFile")]
pub struct Classes {
    /// A `flex` request goes to a backend only while it has fewer requests
    /// in flight than this (0: no limit of its own); otherwise it waits in
    /// the router, behind every waiting request of a higher class. Set it
    /// below the engines' running batch (vLLM's `max_num_seqs`), so the
    /// people waiting always find room.
    pub flex_max_in_flight_per_backend: u32,
    /// How long a `flex` request may wait for room before it is answered
    /// 429 with Retry-After.
    pub flex_wait_ms: u64,
    /// A request header naming the class (`priority`, `default`, `flex`),
    /// read before the body's `service_tier` ("": none), lowercase.
    pub header: String,
    /// Requests of one tenant and class that may wait in the router at
    /// once (0: no bound); past it a `flex` request is answered 429 and
    /// the others 503, both with Retry-After.
    pub max_waiting: u32,
    /// The tenants, in the file's order (a tenant's number is its place).
    pub tenants: Vec<Tenant>,
    /// The `priority` the router adds to the body of each inference request
    /// by its class, for engines that schedule by it (vLLM's
    /// `--scheduling-policy priority`: lower runs first); `None`: off.
    /// Decision 0057.
    pub engine_priority: Option<EnginePriority>,
    /// Who each key and user is, made from `tenants`.
    lookup: Arc<Lookup>,
}

/// `classes.engine_priority`: the engine `priority` of each class. A
/// class whose value is 0 (vLLM's default) is sent unchanged, so engines
/// that do not schedule by priority (vLLM refuses a nonzero one with 400)
/// still take its requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnginePriority {
    pub priority: i32,
    pub default: i32,
    pub flex: i32,
}

impl EnginePriority {
    /// The value requests of `class` are given (0: none is added).
    pub fn of(&self, class: Class) -> i32 {
        match class {
            Class::Priority => self.priority,
            Class::Default => self.default,
            Class::Flex => self.flex,
        }
    }
}

/// `[classes]` as written in the file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ClassesFile {
    flex_max_in_flight_per_backend: u32,
    flex_wait_ms: u64,
    header: String,
    max_waiting: u32,
    tenants: Vec<Tenant>,
    engine_priority: Option<EnginePriority>,
}

impl Default for ClassesFile {
    fn default() -> Self {
        ClassesFile {
            flex_max_in_flight_per_backend: 0,
            flex_wait_ms: 30_000,
            header: String::new(),
            max_waiting: 1024,
            tenants: Vec::new(),
            engine_priority: None,
        }
    }
}

/// One `[[classes.tenants]]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Its label on `/metrics` and in logs: letters, digits, `.`, `_`, `-`.
    pub name: String,
    /// Its requests' class when they say none, and the highest they get.
    #[serde(default, deserialize_with = "class_named")]
    pub class: Class,
    /// Its API keys (the `Authorization: Bearer` token, or `x-api-key`),
    /// each as the SHA-256 of the key in hex (`printf %s KEY | sha256sum`).
    #[serde(default)]
    pub keys_sha256: Vec<String>,
    /// The body's `user` values that are its.
    #[serde(default)]
    pub users: Vec<String>,
    /// Its share of its class's admissions while requests wait, against
    /// the other tenants' weights (1 to 1,000; tenant `-` weighs 1).
    #[serde(default = "one")]
    pub weight: u32,
    /// Overrides `classes.max_waiting` for this tenant.
    #[serde(default)]
    pub max_waiting: Option<u32>,
}

/// Never prints the key digests.
impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.name)
            .field("class", &self.class)
            .field("keys", &self.keys_sha256.len())
            .field("users", &self.users.len())
            .field("weight", &self.weight)
            .finish()
    }
}

fn one() -> u32 {
    1
}

fn class_named<'de, D: Deserializer<'de>>(d: D) -> Result<Class, D::Error> {
    let s = String::deserialize(d)?;
    Class::of_tier(s.as_bytes()).ok_or_else(|| {
        serde::de::Error::custom(format!("unknown class {s:?} (priority, default or flex)"))
    })
}

/// Keys and users to tenant numbers.
#[derive(Default)]
struct Lookup {
    keys: hashbrown::HashMap<[u8; 32], u16>,
    /// By the xxh3 of the `user` value, as `prompt::scan` hashes it.
    users: hashbrown::HashMap<u64, u16>,
}

impl std::fmt::Debug for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Lookup({} keys, {} users)",
            self.keys.len(),
            self.users.len()
        )
    }
}

impl Default for Classes {
    fn default() -> Self {
        Classes::try_from(ClassesFile::default()).expect("the defaults are valid")
    }
}

impl TryFrom<ClassesFile> for Classes {
    type Error = anyhow::Error;

    fn try_from(f: ClassesFile) -> anyhow::Result<Classes> {
        if f.tenants.len() > MAX_TENANTS {
            bail!(
                "classes.tenants: {} tenants, at most {MAX_TENANTS}",
                f.tenants.len()
            );
        }
        if !f.header.is_empty() && !f.header.bytes().all(is_token_byte) {
            bail!("classes.header {:?} is not a header name", f.header);
        }
        let mut lookup = Lookup::default();
        for (i, t) in f.tenants.iter().enumerate() {
            let n = u16::try_from(i).expect("at most MAX_TENANTS");
            let name_ok = !t.name.is_empty()
                && t.name.len() <= 64
                && t.name != NO_TENANT
                && t.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !name_ok {
                bail!(
                    "classes.tenants: name {:?} must be 1 to 64 letters, digits, '.', '_' or '-' (and not \"-\")",
                    t.name
                );
            }
            if f.tenants[..i].iter().any(|o| o.name == t.name) {
                bail!("classes.tenants: {:?} is named twice", t.name);
            }
            if !(1..=1000).contains(&t.weight) {
                bail!("classes.tenants {:?}: weight must be 1 to 1000", t.name);
            }
            for k in &t.keys_sha256 {
                let Some(digest) = hex32(k) else {
                    bail!(
                        "classes.tenants {:?}: keys_sha256 holds a value that is not 64 hex digits (the SHA-256 of a key)",
                        t.name
                    );
                };
                if lookup.keys.insert(digest, n).is_some() {
                    bail!("classes.tenants {:?}: a key is given twice", t.name);
                }
            }
            for u in &t.users {
                if let Some(other) = lookup.users.insert(xxh3_64(u.as_bytes()), n) {
                    bail!(
                        "classes.tenants: user {u:?} is in {:?} and {:?}",
                        f.tenants[usize::from(other)].name,
                        t.name
                    );
                }
            }
        }
        Ok(Classes {
            flex_max_in_flight_per_backend: f.flex_max_in_flight_per_backend,
            flex_wait_ms: f.flex_wait_ms,
            header: f.header.to_ascii_lowercase(),
            max_waiting: f.max_waiting,
            tenants: f.tenants,
            engine_priority: f.engine_priority,
            lookup: Arc::new(lookup),
        })
    }
}

impl Classes {
    /// These classes with the keys file's tenants: each key with a tenant
    /// is one of that tenant's keys; a tenant `[classes]` does not name is
    /// added (its class the key's, weight 1). A key may not name a class
    /// other than its tenant's.
    pub fn with_keys(&self, keys: &[super::keys::KeyEntry]) -> anyhow::Result<Classes> {
        let mut tenants = self.tenants.clone();
        for k in keys {
            let Some(name) = &k.tenant else { continue };
            let class = match &k.class {
                Some(c) => Some(Class::of_tier(c.as_bytes()).ok_or_else(|| {
                    anyhow::anyhow!(
                        "auth.keys_file: key {:?}: unknown class {c:?} (priority, default or flex)",
                        k.name
                    )
                })?),
                None => None,
            };
            let t = match tenants.iter_mut().find(|t| &t.name == name) {
                Some(t) => {
                    if class.is_some_and(|c| c != t.class) {
                        bail!(
                            "auth.keys_file: key {:?} gives tenant {name:?} the class {:?}, [classes] gives it {:?}",
                            k.name,
                            k.class.as_deref().unwrap_or_default(),
                            t.class.name()
                        );
                    }
                    t
                }
                None => {
                    tenants.push(Tenant {
                        name: name.clone(),
                        class: class.unwrap_or_default(),
                        keys_sha256: Vec::new(),
                        users: Vec::new(),
                        weight: 1,
                        max_waiting: None,
                    });
                    tenants.last_mut().expect("just pushed")
                }
            };
            t.keys_sha256.push(k.sha256.clone());
        }
        Classes::try_from(ClassesFile {
            flex_max_in_flight_per_backend: self.flex_max_in_flight_per_backend,
            flex_wait_ms: self.flex_wait_ms,
            header: self.header.clone(),
            max_waiting: self.max_waiting,
            tenants,
            engine_priority: self.engine_priority,
        })
    }
}

/// An HTTP token character (RFC 9110 section 5.6.2).
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// 64 hex digits as 32 bytes.
pub(crate) fn hex32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim().as_bytes();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        *o = (hi * 16 + lo) as u8;
    }
    Some(out)
}

/// What a request says of its caller: read from the head and the body.
#[derive(Clone, Copy, Debug, Default)]
pub struct Caller<'a> {
    /// The value of the `classes.header` header.
    pub header: Option<&'a [u8]>,
    /// The API key (the `Authorization: Bearer` token, or `x-api-key`).
    pub key: Option<&'a [u8]>,
}

/// Where a request's class came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Source {
    /// Nothing said one: `default`.
    #[default]
    None,
    /// The body's `service_tier`.
    Body,
    /// The `classes.header` header.
    Header,
    /// Its tenant, found by its API key.
    Key,
    /// Its tenant, found by the body's `user`.
    User,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::None => "none",
            Source::Body => "body",
            Source::Header => "header",
            Source::Key => "key",
            Source::User => "user",
        }
    }
}

/// A request's class, its tenant and where the class came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub class: Class,
    /// Its tenant's number in `classes.tenants` (`None`: tenant `-`).
    pub tenant: Option<u16>,
    pub source: Source,
    /// The header or body named a class the router does not know (it
    /// counted as `default`).
    pub unknown: Option<Source>,
}

impl Classes {
    /// The in-flight limit a request of `class` sees (0: none), under the
    /// fleet's `limits.max_in_flight_per_backend`.
    pub fn max_in_flight(&self, class: Class, all: u32) -> u32 {
        let own = match class {
            Class::Flex => self.flex_max_in_flight_per_backend,
            _ => 0,
        };
        match (own, all) {
            (0, n) | (n, 0) => n,
            (a, b) => a.min(b),
        }
    }

    /// Whether anything but the body decides a class (a header or
    /// tenants): when not, the request's head is not read for it.
    pub fn reads_caller(&self) -> bool {
        !self.header.is_empty() || !self.lookup.keys.is_empty()
    }

    /// Whether the request's API key is looked up.
    pub fn reads_keys(&self) -> bool {
        !self.lookup.keys.is_empty()
    }

    /// A request's class and tenant from its caller's head, the hash of
    /// its body's `user` and its `service_tier` (empty: none). No
    /// allocation; a key is hashed only when tenants have keys.
    pub fn place(&self, caller: &Caller, user: Option<u64>, tier: &[u8]) -> Placed {
        let by_key = caller
            .key
            .filter(|_| !self.lookup.keys.is_empty())
            .and_then(|k| self.lookup.keys.get(&<[u8; 32]>::from(Sha256::digest(k))))
            .map(|&t| (t, Source::Key));
        let tenant = by_key.or_else(|| {
            user.filter(|_| !self.lookup.users.is_empty())
                .and_then(|u| self.lookup.users.get(&u))
                .map(|&t| (t, Source::User))
        });
        let mut unknown = None;
        let mut word = |v: &[u8], from: Source| match Class::of_tier(v) {
            Some(c) => (c, from),
            None => {
                unknown = Some(from);
                (Class::Default, from)
            }
        };
        let said = match caller.header.filter(|_| !self.header.is_empty()) {
            Some(h) => Some(word(h.trim_ascii(), Source::Header)),
            // `auto` (the SDKs' default) says nothing.
            None if tier.is_empty() || tier == b"auto" => None,
            None => Some(word(tier, Source::Body)),
        };
        let ceiling = tenant.map(|(t, from)| (self.tenants[usize::from(t)].class, from));
        // Later in `Class`'s order is lower: the lower of the two wins.
        let (class, source) = match (said, ceiling) {
            (Some(s), Some(c)) => {
                if s.0 >= c.0 {
                    s
                } else {
                    c
                }
            }
            (Some(s), None) | (None, Some(s)) => s,
            (None, None) => (Class::Default, Source::None),
        };
        Placed {
            class,
            tenant: tenant.map(|t| t.0),
            source,
            unknown,
        }
    }

    /// A tenant's name (`-` for none).
    pub fn tenant_name(&self, tenant: Option<u16>) -> &str {
        tenant
            .and_then(|t| self.tenants.get(usize::from(t)))
            .map_or(NO_TENANT, |t| t.name.as_str())
    }

    /// A tenant's weight (1 for none).
    pub fn weight(&self, tenant: Option<u16>) -> u32 {
        tenant
            .and_then(|t| self.tenants.get(usize::from(t)))
            .map_or(1, |t| t.weight)
    }

    /// How many requests of a tenant may wait in one class (0: no bound).
    pub fn max_waiting_of(&self, tenant: Option<u16>) -> u32 {
        tenant
            .and_then(|t| self.tenants.get(usize::from(t)))
            .and_then(|t| t.max_waiting)
            .unwrap_or(self.max_waiting)
    }
}

#[cfg(test)]
mod tests;
