use super::*;

fn known(names: &[(&str, Option<&str>)]) -> Served {
    Served::Known(
        names
            .iter()
            .map(|(id, parent)| ServedModel {
                id: (*id).to_owned(),
                parent: parent.map(str::to_owned),
            })
            .collect(),
    )
}

const URLS: [&str; 4] = ["http://a", "http://b", "http://c", "http://d"];

/// a serves chat, b serves small, c serves chat and its adapter `sql`, d is unknown.
fn fleet() -> Vec<Member<'static>> {
    let served = [
        known(&[("chat", None)]),
        known(&[("small", None)]),
        known(&[("chat", None), ("sql", Some("chat"))]),
        Served::Unknown,
    ];
    served
        .into_iter()
        .enumerate()
        .map(|(slot, served)| Member {
            slot,
            generation: 100 + slot as u64,
            url: URLS[slot],
            served,
        })
        .collect()
}

fn table(members: &[Member], spec: &Spec) -> ModelTable {
    ModelTable::build(members, spec, |_| Arc::default(), Arc::default())
}

fn ranks(t: &ModelTable, members: &[Member], model: &str, adapter: &str) -> Vec<u8> {
    let w = t.resolve(model.as_bytes(), adapter.as_bytes()).unwrap();
    members
        .iter()
        .map(|m| w.rank(t, m.slot, m.generation))
        .collect()
}

/// The positions left eligible after the filter, all backends up.
fn chosen(t: &ModelTable, members: &[Member], model: &str, adapter: &str) -> Vec<usize> {
    let r = ranks(t, members, model, adapter);
    let mut loads = vec![
        BackendLoad {
            eligible: true,
            ..Default::default()
        };
        members.len()
    ];
    keep_best(&mut loads, &r);
    (0..loads.len()).filter(|&i| loads[i].eligible).collect()
}

#[test]
fn a_model_goes_only_to_backends_that_serve_it() {
    let f = fleet();
    let t = table(&f, &Spec::default());
    assert_eq!(ranks(&t, &f, "chat", ""), [2, 0, 2, 1]);
    assert_eq!(chosen(&t, &f, "chat", ""), [0, 2]);
    assert_eq!(chosen(&t, &f, "small", ""), [1]);
    // An adapter named in `model`: only where it is listed (loaded).
    assert_eq!(chosen(&t, &f, "sql", ""), [2]);
    // An adapter in `lora_path` on its base: the engine that lists it first.
    assert_eq!(ranks(&t, &f, "chat", "sql"), [2, 0, 3, 1]);
    assert_eq!(chosen(&t, &f, "chat", "sql"), [2]);
    // A name only the unknown backend may serve goes there.
    assert_eq!(chosen(&t, &f, "mystery", ""), [3]);
}

#[test]
fn the_best_rank_with_room_wins_and_unknown_backends_are_the_fallback() {
    let f = fleet();
    let t = table(&f, &Spec::default());
    let r = ranks(&t, &f, "chat", "sql");
    let mut loads = vec![
        BackendLoad {
            eligible: true,
            ..Default::default()
        };
        4
    ];
    // The adapter's engine is full: the other servers of the base take it.
    loads[2].eligible = false;
    keep_best(&mut loads, &r);
    assert_eq!(
        loads.iter().map(|l| l.eligible).collect::<Vec<_>>(),
        [true, false, false, false]
    );
    // Every known server is down: the unknown backend.
    let mut loads = vec![BackendLoad::default(); 4];
    loads[3].eligible = true;
    loads[1].eligible = true;
    keep_best(&mut loads, &r);
    assert_eq!(
        loads.iter().map(|l| l.eligible).collect::<Vec<_>>(),
        [false, false, false, true]
    );
    // Nobody with room serves it: nothing is eligible (a 503, not a wrong engine).
    let r = ranks(&t, &f, "small", "");
    let mut loads = vec![
        BackendLoad {
            eligible: true,
            ..Default::default()
        };
        4
    ];
    loads[1].eligible = false;
    loads[3].eligible = false;
    keep_best(&mut loads, &r);
    assert!(loads.iter().all(|l| !l.eligible));
}

#[test]
fn an_unknown_model_is_a_404_naming_no_backend() {
    let mut f = fleet();
    f[3].served = known(&[("embed", None)]);
    let t = table(&f, &Spec::default());
    let e = t.resolve(b"mystery", b"").unwrap_err();
    assert_eq!(e.kind, Kind::ModelNotFound);
    assert_eq!(e.status(), 404);
    assert!(!e.message.contains("http://"), "{}", e.message);
    let resp = String::from_utf8(e.to_response(false, None, false)).unwrap();
    let body: serde_json::Value =
        serde_json::from_str(resp.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["param"], "model");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    // A huge name is cut in the answer.
    let long = vec![b'x'; 10_000];
    assert!(t.resolve(&long, b"").unwrap_err().message.len() < 300);
    // Known models still resolve; an unknown `lora_path` is no preference.
    assert_eq!(chosen(&t, &f, "embed", "nope"), [3]);
}

#[test]
fn a_request_without_a_model_goes_where_the_config_says() {
    let f = fleet();
    let t = table(&f, &Spec::default());
    assert_eq!(chosen(&t, &f, "", ""), [0, 1, 2, 3], "any backend");
    let reject = Spec {
        without_model: WithoutModel::Reject,
        ..Spec::default()
    };
    let e = table(&f, &reject).resolve(b"", b"").unwrap_err();
    assert_eq!((e.status(), e.kind), (400, Kind::ModelRequired));
    let pool = Spec {
        pools: vec![PoolSpec {
            name: "small".into(),
            models: vec!["small".into()],
            backends: Some(vec!["http://b".into()]),
            policy: Some(Policy::RoundRobin),
        }],
        without_model: WithoutModel::Pool(0),
        ..Spec::default()
    };
    let t = table(&f, &pool);
    assert_eq!(chosen(&t, &f, "", ""), [1]);
    assert_eq!(
        t.resolve(b"", b"").unwrap().policy(),
        Some(Policy::RoundRobin)
    );
}

#[test]
fn pools_restrict_backends_set_the_policy_and_adapters_follow_their_base() {
    let f = fleet();
    let spec = Spec {
        pools: vec![PoolSpec {
            name: "chat".into(),
            models: vec!["chat".into()],
            backends: Some(vec!["http://c".into(), "http://d".into()]),
            policy: Some(Policy::LeastRequest),
        }],
        ..Spec::default()
    };
    let t = table(&f, &spec);
    // a serves chat but is not in the pool; d (unknown) is, as a fallback.
    assert_eq!(ranks(&t, &f, "chat", ""), [0, 0, 2, 1]);
    let w = t.resolve(b"sql", b"").unwrap();
    assert_eq!(
        w.policy(),
        Some(Policy::LeastRequest),
        "the adapter's base's pool"
    );
    assert_eq!(t.resolve(b"small", b"").unwrap().policy(), None);
    // A pool's model nobody in the pool may serve is a 404.
    let spec = Spec {
        pools: vec![PoolSpec {
            name: "p".into(),
            models: vec!["small".into(), "ghost".into()],
            backends: Some(vec!["http://a".into()]),
            policy: None,
        }],
        ..Spec::default()
    };
    let t = table(&f, &spec);
    assert_eq!(t.resolve(b"small", b"").unwrap_err().status(), 404);
    assert_eq!(t.resolve(b"ghost", b"").unwrap_err().status(), 404);
}

#[test]
fn pinned_models_win_over_discovery_and_new_backends_count_as_unknown() {
    let f = fleet();
    let spec = Spec {
        pinned: vec![("http://d".into(), vec!["small".into()])],
        ..Spec::default()
    };
    let t = table(&f, &spec);
    assert_eq!(chosen(&t, &f, "small", ""), [1, 3]);
    assert_eq!(t.resolve(b"mystery", b"").unwrap_err().status(), 404);
    // A backend that took slot 0 after the table was built (a reload).
    let (slot, generation) = (0, 999);
    let w = t.resolve(b"small", b"").unwrap();
    assert_eq!(w.rank(&t, slot, generation), 1);
}

#[test]
fn the_models_list_is_the_healthy_union_deduplicated() {
    let f = fleet();
    let t = table(&f, &Spec::default());
    assert_eq!(
        t.served(|slot| slot != 1),
        [("chat", None), ("sql", Some("chat"))]
    );
}

#[test]
fn model_labels_are_bounded_and_kept_across_rebuilds() {
    let f = fleet();
    let models = Models::new(&f, &Spec::default());
    let before = models
        .table()
        .resolve(b"chat", b"")
        .unwrap()
        .stats()
        .clone();
    before.requested();
    models.rebuild(&f, &Spec::default());
    let after = models
        .table()
        .resolve(b"chat", b"")
        .unwrap()
        .stats()
        .clone();
    assert!(Arc::ptr_eq(&before, &after), "counters survive a rebuild");
    assert_eq!(after.requests(), 1);
    let many: Vec<(&str, Option<&str>)> = Vec::new();
    let names: Vec<String> = (0..MAX_MODEL_LABELS + 10)
        .map(|i| format!("m{i}"))
        .collect();
    let mut many = many;
    many.extend(names.iter().map(|n| (n.as_str(), None)));
    let mut f2 = fleet();
    f2[3].served = known(&many);
    models.rebuild(&f2, &Spec::default());
    let stats = models.stats();
    assert_eq!(stats.len(), MAX_MODEL_LABELS + 1);
    assert_eq!(stats.last().unwrap().0, OTHER_LABEL);
}

#[test]
fn discovered_models_are_kept_per_generation_and_forgotten_with_the_backend() {
    let f: Vec<Member> = fleet()
        .into_iter()
        .map(|m| Member {
            served: Served::Unknown,
            ..m
        })
        .collect();
    let models = Models::new(&f, &Spec::default());
    assert!(models.set_discovered(103, known(&[("late", None)])));
    assert!(
        !models.set_discovered(103, known(&[("late", None)])),
        "no change"
    );
    models.rebuild(&f, &Spec::default());
    assert_eq!(chosen(&models.table(), &f, "late", ""), [3], "known first");
    models.rebuild(&f[..3], &Spec::default());
    assert_eq!(models.discovered(103), Served::Unknown);
}
