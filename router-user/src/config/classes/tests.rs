use super::*;
use crate::config::Config;

/// SHA-256 of "sk-acme", in hex.
fn digest(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn classes(toml_text: &str) -> anyhow::Result<Classes> {
    let cfg: Config = toml::from_str(&format!("backends = [\"http://127.0.0.1:1\"]\n{toml_text}"))?;
    Ok(cfg.classes)
}

fn sample() -> Classes {
    classes(&format!(
        r#"
[classes]
header = "X-Request-Class"
[[classes.tenants]]
name = "support"
class = "priority"
keys_sha256 = ["{}"]
weight = 3
[[classes.tenants]]
name = "outreach"
class = "flex"
users = ["batch-bot"]
max_waiting = 5
"#,
        digest("sk-support")
    ))
    .unwrap()
}

fn user(u: &str) -> Option<u64> {
    Some(xxh3_64(u.as_bytes()))
}

#[test]
fn defaults_read_only_the_body() {
    let c = Classes::default();
    assert!(!c.reads_caller());
    assert_eq!((c.flex_wait_ms, c.max_waiting), (30_000, 1024));
    let p = c.place(&Caller::default(), user("x"), b"flex");
    assert_eq!(
        (p.class, p.tenant, p.source),
        (Class::Flex, None, Source::Body)
    );
    let p = c.place(&Caller::default(), None, b"");
    assert_eq!((p.class, p.source), (Class::Default, Source::None));
    let p = c.place(&Caller::default(), None, b"premium");
    assert_eq!((p.class, p.unknown), (Class::Default, Some(Source::Body)));
    // A header is read only when one is configured.
    let caller = Caller {
        header: Some(b"flex"),
        key: None,
    };
    assert_eq!(c.place(&caller, None, b"").class, Class::Default);
}

#[test]
fn tenants_parse_and_are_found_by_key_and_user() {
    let c = sample();
    assert!(c.reads_caller() && c.reads_keys());
    assert_eq!(c.header, "x-request-class");
    assert_eq!(c.tenant_name(Some(0)), "support");
    assert_eq!(c.tenant_name(None), "-");
    assert_eq!((c.weight(Some(0)), c.weight(None)), (3, 1));
    assert_eq!(
        (c.max_waiting_of(Some(1)), c.max_waiting_of(Some(0))),
        (5, 1024)
    );
    let key = Caller {
        header: None,
        key: Some(b"sk-support"),
    };
    let p = c.place(&key, None, b"");
    assert_eq!(
        (p.class, p.tenant, p.source),
        (Class::Priority, Some(0), Source::Key)
    );
    let p = c.place(&Caller::default(), user("batch-bot"), b"");
    assert_eq!(
        (p.class, p.tenant, p.source),
        (Class::Flex, Some(1), Source::User)
    );
    // The key wins over the user.
    let p = c.place(&key, user("batch-bot"), b"");
    assert_eq!(p.tenant, Some(0));
    // An unknown key and user: tenant `-`, the body decides.
    let stranger = Caller {
        header: None,
        key: Some(b"sk-other"),
    };
    let p = c.place(&stranger, user("someone"), b"priority");
    assert_eq!(
        (p.class, p.tenant, p.source),
        (Class::Priority, None, Source::Body)
    );
    // Debug output never shows a key's digest.
    assert!(!format!("{c:?}").contains(&digest("sk-support")));
}

#[test]
fn a_request_may_lower_its_tenants_class_but_never_raise_it() {
    let c = sample();
    let key = |h: Option<&'static [u8]>| Caller {
        header: h,
        key: Some(b"sk-support"),
    };
    // A priority tenant asking for flex, by header or body: flex.
    let p = c.place(&key(Some(b"flex")), None, b"");
    assert_eq!((p.class, p.source), (Class::Flex, Source::Header));
    let p = c.place(&key(None), None, b"default");
    assert_eq!((p.class, p.source), (Class::Default, Source::Body));
    // `auto` says nothing: the tenant's class.
    assert_eq!(c.place(&key(None), None, b"auto").class, Class::Priority);
    // A flex tenant asking for priority stays flex.
    let p = c.place(&Caller::default(), user("batch-bot"), b"priority");
    assert_eq!((p.class, p.source), (Class::Flex, Source::User));
    let hdr = Caller {
        header: Some(b"priority"),
        key: None,
    };
    assert_eq!(c.place(&hdr, user("batch-bot"), b"").class, Class::Flex);
    // The header is read before the body; an unknown one counts as default.
    let p = c.place(&hdr, None, b"flex");
    assert_eq!((p.class, p.source), (Class::Priority, Source::Header));
    let odd = Caller {
        header: Some(b" gold "),
        key: None,
    };
    let p = c.place(&odd, None, b"flex");
    assert_eq!((p.class, p.unknown), (Class::Default, Some(Source::Header)));
}

#[test]
fn bad_tenants_are_refused() {
    let d = digest("k");
    for (bad, why) in [
        ("[[classes.tenants]]\nname = \"-\"\n", "name"),
        ("[[classes.tenants]]\nname = \"a b\"\n", "name"),
        (
            "[[classes.tenants]]\nname = \"a\"\nclass = \"gold\"\n",
            "unknown class",
        ),
        ("[[classes.tenants]]\nname = \"a\"\nweight = 0\n", "weight"),
        (
            "[[classes.tenants]]\nname = \"a\"\nkeys_sha256 = [\"sk-plain\"]\n",
            "64 hex",
        ),
        (
            "[[classes.tenants]]\nname = \"a\"\n[[classes.tenants]]\nname = \"a\"\n",
            "twice",
        ),
        (
            &format!(
                "[[classes.tenants]]\nname = \"a\"\nkeys_sha256 = [\"{d}\"]\n[[classes.tenants]]\nname = \"b\"\nkeys_sha256 = [\"{d}\"]\n"
            ),
            "twice",
        ),
        (
            "[[classes.tenants]]\nname = \"a\"\nusers = [\"u\"]\n[[classes.tenants]]\nname = \"b\"\nusers = [\"u\"]\n",
            "user",
        ),
        ("[classes]\nheader = \"x class\"\n", "header name"),
        ("[classes]\nheadr = \"x\"\n", "unknown field"),
    ] {
        let err = format!("{:#}", classes(bad).map(|_| ()).unwrap_err());
        assert!(err.contains(why), "{bad}: {err}");
        // A key written in clear by mistake is not echoed.
        assert!(!err.contains("sk-plain"), "{err}");
    }
    // Upper-case digests are fine.
    classes(&format!(
        "[[classes.tenants]]\nname = \"a\"\nkeys_sha256 = [\"{}\"]\n",
        d.to_uppercase()
    ))
    .unwrap();
}

#[test]
fn the_example_config_says_the_defaults_and_its_commented_tenant_is_valid() {
    let text = include_str!("../../../prefix-router.example.toml");
    let cfg: Config = toml::from_str(text).unwrap();
    let (got, want) = (&cfg.classes, Classes::default());
    assert_eq!(
        (got.flex_max_in_flight_per_backend, got.flex_wait_ms),
        (want.flex_max_in_flight_per_backend, want.flex_wait_ms)
    );
    assert_eq!(
        (&got.header, got.max_waiting),
        (&want.header, want.max_waiting)
    );
    assert!(got.tenants.is_empty());
    let section: String = text
        .lines()
        .skip_while(|l| !l.starts_with("[classes]"))
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .filter(|l| l.contains(" = ") || l.starts_with('['))
        .map(|l| format!("{l}\n"))
        .collect();
    let on = classes(&section).unwrap();
    assert_eq!(on.header, "x-request-class");
    assert_eq!(on.tenants.len(), 1);
    let key = Caller {
        header: None,
        key: Some(b"sk-support"),
    };
    let p = on.place(&key, user("nobody"), b"");
    assert_eq!((p.class, p.tenant), (Class::Priority, Some(0)));
    assert_eq!((on.weight(Some(0)), on.max_waiting_of(Some(0))), (4, 256));
}

/// A keys file's keys join their tenants: an existing tenant gets the key
/// (and its class), a new tenant is made with the key's class; a key may
/// not give an existing tenant another class.
#[test]
fn keys_from_the_keys_file_join_their_tenants() {
    use crate::config::keys::KeyEntry;
    let entry = |name: &str, key: &str, tenant: &str, class: Option<&str>| KeyEntry {
        name: name.into(),
        sha256: digest(key),
        tenant: Some(tenant.into()),
        class: class.map(str::to_owned),
    };
    let merged = sample()
        .with_keys(&[
            entry("a", "sk-outreach-2", "outreach", None),
            entry("b", "sk-nightly", "nightly", Some("flex")),
        ])
        .unwrap();
    let by_key = |k: &'static [u8]| {
        let p = merged.place(
            &Caller {
                header: None,
                key: Some(k),
            },
            None,
            b"",
        );
        (p.class, merged.tenant_name(p.tenant).to_owned())
    };
    assert_eq!(by_key(b"sk-outreach-2"), (Class::Flex, "outreach".into()));
    assert_eq!(by_key(b"sk-nightly"), (Class::Flex, "nightly".into()));
    assert_eq!(by_key(b"sk-support"), (Class::Priority, "support".into()));
    let err = sample()
        .with_keys(&[entry("c", "sk-x", "support", Some("flex"))])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("support") && !err.contains(&digest("sk-x")),
        "{err}"
    );
}

#[test]
fn engine_priority_is_off_unless_set_and_each_class_defaults_to_0() {
    assert_eq!(Classes::default().engine_priority, None);
    let c = classes("[classes]\nengine_priority = { priority = -3, flex = 7 }\n").unwrap();
    let ep = c.engine_priority.unwrap();
    assert_eq!(
        (
            ep.of(Class::Priority),
            ep.of(Class::Default),
            ep.of(Class::Flex)
        ),
        (-3, 0, 7)
    );
    // A keys file's keys leave it as it is.
    assert_eq!(c.with_keys(&[]).unwrap().engine_priority, Some(ep));
    // A misspelt class or a value that is no integer is refused.
    for bad in [
        "engine_priority = { urgent = -1 }",
        "engine_priority = { flex = \"1\" }",
        "engine_priority = { flex = 1.5 }",
        "engine_priority = { flex = 3000000000 }",
    ] {
        assert!(classes(&format!("[classes]\n{bad}\n")).is_err(), "{bad}");
    }
}
