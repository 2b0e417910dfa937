use super::*;

fn enc(v: &Value) -> Vec<u8> {
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, v).unwrap();
    b
}

fn arr(v: Vec<Value>) -> Value {
    Value::Array(v)
}

fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::Map(fields.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

fn decode(v: &Value) -> Batch {
    decode_batch(&enc(v), &mut Groups::default()).unwrap()
}

const BIG: u64 = u64::MAX - 5;

fn stored_array() -> Value {
    arr(vec![
        "BlockStored".into(),
        arr(vec![Value::from(BIG), Value::from(2u64)]),
        Value::Nil,
        arr((0..32u32).map(Value::from).collect()),
        Value::from(16),
        Value::Nil,
        "GPU".into(),
        Value::Nil,
        arr(vec![arr(vec!["salt".into()]), Value::Nil]),
        Value::from(0),
        "full_attention".into(),
        Value::Nil,
    ])
}

fn expected_stored() -> Event {
    Event::Stored {
        hashes: vec![BIG, 2],
        parent: None,
        token_ids: (0..32).collect(),
        block_size: Some(16),
        lora_name: None,
        extra_keys: vec![vec![b"salt".to_vec()], vec![]],
    }
}

#[test]
fn array_batches_of_array_events() {
    let b = decode(&arr(vec![
        Value::F64(1.25),
        arr(vec![
            stored_array(),
            arr(vec![
                "BlockRemoved".into(),
                arr(vec![Value::from(BIG)]),
                "GPU".into(),
            ]),
            arr(vec!["AllBlocksCleared".into()]),
        ]),
        Value::Nil,
    ]));
    assert_eq!(b.ts, 1.25);
    assert_eq!(b.dp_rank, None);
    assert_eq!(
        b.events,
        vec![
            expected_stored(),
            Event::Removed { hashes: vec![BIG] },
            Event::Cleared
        ]
    );
    assert_eq!(b.skipped, Skipped::default());
}

#[test]
fn map_batches_of_map_events_with_defaults_left_out() {
    let b = decode(&map(vec![
        ("ts", Value::F64(2.0)),
        (
            "events",
            arr(vec![
                map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", arr(vec![Value::from(BIG), Value::from(2)])),
                    ("token_ids", arr((0..32u32).map(Value::from).collect())),
                    ("block_size", Value::from(16)),
                    (
                        "extra_keys",
                        arr(vec![arr(vec!["salt".into()]), Value::Nil]),
                    ),
                ]),
                map(vec![("type", "AllBlocksCleared".into())]),
            ]),
        ),
        ("data_parallel_rank", Value::from(3)),
    ]));
    assert_eq!(b.events, vec![expected_stored(), Event::Cleared]);
    assert_eq!(b.dp_rank, Some(3));
}

#[test]
fn encodings_mix_at_each_level() {
    // A map batch of array events, and an array batch of map events.
    let a = decode(&map(vec![
        ("ts", Value::from(5)),
        ("events", arr(vec![stored_array()])),
    ]));
    assert_eq!(a.events, vec![expected_stored()]);
    let b = decode(&arr(vec![
        Value::F64(1.0),
        arr(vec![map(vec![
            ("type", "BlockRemoved".into()),
            ("block_hashes", arr(vec![Value::from(7)])),
        ])]),
    ]));
    assert_eq!(b.events, vec![Event::Removed { hashes: vec![7] }]);
}

#[test]
fn unknown_kinds_and_fields_are_counted_and_skipped() {
    let b = decode(&arr(vec![
        Value::F64(1.0),
        arr(vec![
            arr(vec!["BlockMoved".into(), arr(vec![])]),
            map(vec![
                ("type", "BlockRemoved".into()),
                ("block_hashes", arr(vec![Value::from(9)])),
                ("tier", "cpu".into()),
            ]),
            Value::from(42),
            // An older array event that stops early, and a newer one with
            // an extra trailing field.
            arr(vec![
                "BlockStored".into(),
                arr(vec![Value::from(1)]),
                Value::Nil,
                arr((0..16u32).map(Value::from).collect()),
            ]),
            arr(vec![
                "BlockRemoved".into(),
                arr(vec![Value::from(1)]),
                "GPU".into(),
                Value::from(0),
                "future".into(),
            ]),
        ]),
        Value::Nil,
        "extra batch field".into(),
    ]));
    assert_eq!(b.skipped.unknown_kinds, 2);
    assert_eq!(b.skipped.unknown_fields, 3);
    assert_eq!(b.events.len(), 3);
    assert!(matches!(
        &b.events[1],
        Event::Stored {
            block_size: None,
            ..
        }
    ));
}

#[test]
fn byte_hashes_are_opaque_ids() {
    let h = vec![0xab; 32];
    let b = decode(&arr(vec![
        Value::F64(1.0),
        arr(vec![
            arr(vec![
                "BlockStored".into(),
                arr(vec![Value::Binary(h.clone())]),
                Value::Binary(vec![0xcd; 32]),
                arr((0..16u32).map(Value::from).collect()),
                Value::from(16),
            ]),
            arr(vec![
                "BlockRemoved".into(),
                arr(vec![Value::Binary(h.clone())]),
            ]),
        ]),
    ]));
    let Event::Stored { hashes, parent, .. } = &b.events[0] else {
        panic!("{:?}", b.events);
    };
    assert_eq!(hashes[0], xxh3_64(&h));
    assert_eq!(*parent, Some(xxh3_64(&[0xcd; 32])));
    assert_eq!(
        b.events[1],
        Event::Removed {
            hashes: vec![xxh3_64(&h)]
        }
    );
}

#[test]
fn sliding_window_groups_are_ignored_removals_included() {
    let mut groups = Groups::default();
    let sliding = arr(vec![
        "BlockStored".into(),
        arr(vec![Value::from(1)]),
        Value::Nil,
        arr((0..16u32).map(Value::from).collect()),
        Value::from(16),
        Value::Nil,
        "GPU".into(),
        Value::Nil,
        Value::Nil,
        Value::from(1),
        "sliding_window".into(),
        Value::from(4096),
    ]);
    let removed_g1 = arr(vec![
        "BlockRemoved".into(),
        arr(vec![Value::from(1)]),
        "GPU".into(),
        Value::from(1),
    ]);
    let removed_g0 = arr(vec![
        "BlockRemoved".into(),
        arr(vec![Value::from(2)]),
        "GPU".into(),
        Value::from(0),
    ]);
    let payload = enc(&arr(vec![
        Value::F64(1.0),
        arr(vec![sliding, removed_g1, removed_g0]),
    ]));
    let b = decode_batch(&payload, &mut groups).unwrap();
    assert_eq!(b.skipped.other_groups, 2);
    assert_eq!(b.events, vec![Event::Removed { hashes: vec![2] }]);
}

#[test]
fn what_is_not_a_batch_is_an_error_not_a_panic() {
    let mut g = Groups::default();
    assert!(matches!(
        decode_batch(b"\x92\xcb\x3f", &mut g),
        Err(DecodeError::NotMsgpack(_))
    ));
    assert!(decode_batch(b"\xc1", &mut g).is_err());
    assert!(decode_batch(&enc(&Value::from(3)), &mut g).is_err());
    assert!(decode_batch(&enc(&arr(vec![Value::F64(1.0)])), &mut g).is_err());
    assert!(decode_batch(&[], &mut g).is_err());
}
