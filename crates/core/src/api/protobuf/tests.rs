use kube_core::{ObjectList, Status as KubeStatus};
use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::api::slim::{MAX_NETWORK_STATUS_BYTES, NETWORK_STATUS_ANNOTATION, PodView};

/// The wire format, written the way Go's generated marshalers write it.
fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(tag: u64, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    varint(tag << 3 | 2, &mut out);
    varint(value.len() as u64, &mut out);
    out.extend_from_slice(value);
    out
}

fn varint_field(tag: u64, value: u64) -> Vec<u8> {
    let mut out = Vec::new();
    varint(tag << 3, &mut out);
    varint(value, &mut out);
    out
}

fn message(fields: &[Vec<u8>]) -> Vec<u8> {
    fields.concat()
}

fn envelope_of(kind: &str, raw: &[u8]) -> Vec<u8> {
    let type_meta = message(&[bytes_field(1, b"v1"), bytes_field(2, kind.as_bytes())]);
    let mut body = MAGIC.to_vec();
    body.extend(message(&[
        bytes_field(1, &type_meta),
        bytes_field(2, raw),
        bytes_field(3, b""),
        bytes_field(4, b""),
    ]));
    body
}

fn annotation(key: &str, value: &[u8]) -> Vec<u8> {
    bytes_field(
        12,
        &message(&[bytes_field(1, key.as_bytes()), bytes_field(2, value)]),
    )
}

/// A pod as Go writes it: every string field present (empty ones too), a spec and status
/// with fields this reader skips, a fixed64 and a nested message it never opens.
fn wire_pod(name: &str, annotations: &[(&str, &[u8])], phase: &str, node: &str) -> Vec<u8> {
    let mut meta = vec![
        bytes_field(1, name.as_bytes()),
        bytes_field(2, b""),
        bytes_field(3, b"ns"),
        bytes_field(4, b""),
        bytes_field(5, b"6f1c9d2e-0000-4c3d-9e2f-1a2b3c4d5e6f"),
        bytes_field(6, b"4711"),
        varint_field(7, 0),
        bytes_field(
            8,
            &message(&[varint_field(1, 1_790_000_000), varint_field(2, 5)]),
        ),
        bytes_field(9, b""),
        annotation("team", b"not kept"),
    ];
    meta.extend(annotations.iter().map(|(k, v)| annotation(k, v)));
    meta.push(bytes_field(
        11,
        &message(&[bytes_field(1, b"app"), bytes_field(2, b"web")]),
    ));
    meta.push(bytes_field(17, &message(&[bytes_field(1, b"kubectl")])));
    let container = message(&[bytes_field(1, b"app"), bytes_field(2, b"registry/app:1")]);
    let spec = message(&[
        bytes_field(2, &container),
        varint_field(4, 45),
        bytes_field(10, node.as_bytes()),
        {
            // A fixed64 field: skipped by its width.
            let mut f = Vec::new();
            varint(99 << 3 | 1, &mut f);
            f.extend_from_slice(&[7; 8]);
            f
        },
    ]);
    let status = message(&[
        bytes_field(1, phase.as_bytes()),
        bytes_field(5, b"192.0.2.1"),
    ]);
    message(&[
        bytes_field(1, &message(&meta)),
        bytes_field(2, &spec),
        bytes_field(3, &status),
    ])
}

fn wire_list(pods: &[Vec<u8>], cont: &str, remaining: Option<u64>) -> Vec<u8> {
    let mut list_meta = vec![
        bytes_field(1, b""),
        bytes_field(2, b"9000"),
        bytes_field(3, cont.as_bytes()),
    ];
    if let Some(n) = remaining {
        list_meta.push(varint_field(4, n));
    }
    let mut fields = vec![bytes_field(1, &message(&list_meta))];
    fields.extend(pods.iter().map(|p| bytes_field(2, p)));
    envelope_of("PodList", &message(&fields))
}

fn read(body: &[u8]) -> ObjectList<PodView> {
    let json = pod_list_as_json(body).expect("a pod list");
    serde_json::from_slice(&json).expect("the list PodView reads")
}

#[test]
fn a_pod_reads_as_its_json_reads() {
    let status = br#"[{"name":"ns/net","interface":"net1","ips":["10.1.0.5"]}]"#;
    let body = wire_pod(
        "web-0",
        &[
            (NETWORK_STATUS_ANNOTATION, status),
            ("kubernetes.io/config.mirror", b"abc"),
        ],
        "Running",
        "node-a",
    );
    let list = read(&wire_list(&[body], "", None));
    let from_json: PodView = serde_json::from_value(json!({
        "metadata": {
            "name": "web-0", "namespace": "ns", "uid": "6f1c9d2e-0000-4c3d-9e2f-1a2b3c4d5e6f",
            "resourceVersion": "4711", "creationTimestamp": "2026-09-21T14:13:20Z",
            "labels": {"app": "web"},
            "annotations": {
                "team": "not kept",
                NETWORK_STATUS_ANNOTATION: std::str::from_utf8(status).unwrap(),
                "kubernetes.io/config.mirror": "abc",
            },
        },
        "spec": {"nodeName": "node-a", "terminationGracePeriodSeconds": 45, "containers": []},
        "status": {"phase": "Running", "podIP": "192.0.2.1"},
    }))
    .unwrap();
    assert_eq!(list.items, vec![from_json]);
    assert_eq!(list.metadata.resource_version.as_deref(), Some("9000"));
    assert_eq!(list.metadata.continue_, None);
}

#[test]
fn empty_strings_and_a_zero_time_read_as_absent_as_json_omits_them() {
    let meta = message(&[
        bytes_field(1, b"p"),
        bytes_field(3, b""),
        bytes_field(5, b""),
        bytes_field(8, b""),
    ]);
    let pod = message(&[
        bytes_field(1, &meta),
        bytes_field(2, &message(&[bytes_field(10, b"")])),
        bytes_field(3, &message(&[bytes_field(1, b"")])),
    ]);
    let list = read(&wire_list(&[pod], "", None));
    let expected: PodView = serde_json::from_value(json!({"metadata": {"name": "p"}})).unwrap();
    assert_eq!(list.items, vec![expected]);
    assert_eq!(list.items[0].node, None);
    assert_eq!(list.items[0].phase, None);
}

#[test]
fn a_long_network_status_is_cut_as_from_json() {
    let long = vec![b'x'; MAX_NETWORK_STATUS_BYTES * 2];
    let list = read(&wire_list(
        &[wire_pod("p", &[(NETWORK_STATUS_ANNOTATION, &long)], "", "")],
        "",
        None,
    ));
    let kept = list.items[0].metadata.annotations.as_ref().unwrap();
    assert_eq!(
        kept[NETWORK_STATUS_ANNOTATION].len(),
        MAX_NETWORK_STATUS_BYTES + 1
    );
    assert!(
        !kept.contains_key("team"),
        "an annotation no rule reads is skipped"
    );
}

#[test]
fn invalid_utf8_is_replaced_byte_by_byte_as_the_apiservers_json_does() {
    // Go's encoder writes one U+FFFD per byte that is not valid UTF-8: a 4-byte sequence cut
    // after 3 is 3 of them (from_utf8_lossy would write one).
    let value = b"[\xff,\xf0\x90\x80,\xc3\xa9]";
    let list = read(&wire_list(
        &[wire_pod("p", &[(NETWORK_STATUS_ANNOTATION, value)], "", "")],
        "",
        None,
    ));
    let kept = list.items[0].metadata.annotations.as_ref().unwrap();
    assert_eq!(
        kept[NETWORK_STATUS_ANNOTATION],
        "[\u{fffd},\u{fffd}\u{fffd}\u{fffd},\u{e9}]"
    );
}

#[test]
fn a_kept_annotation_costs_the_page_no_more_than_the_reader_keeps() {
    // 250 KiB of quotes: escaped whole, 500 KiB of JSON for one pod.
    let quotes = vec![b'"'; 250 * 1024];
    let body = wire_list(
        &[wire_pod(
            "p",
            &[(NETWORK_STATUS_ANNOTATION, &quotes)],
            "",
            "",
        )],
        "",
        None,
    );
    let json = pod_list_as_json(&body).unwrap();
    assert!(
        json.len() < 2 * (MAX_NETWORK_STATUS_BYTES + 1) + 1024,
        "{} bytes of JSON for a kept value cut at {}",
        json.len(),
        MAX_NETWORK_STATUS_BYTES + 1
    );
    let list: ObjectList<PodView> = serde_json::from_slice(&json).unwrap();
    let kept = list.items[0].metadata.annotations.as_ref().unwrap();
    assert_eq!(
        kept[NETWORK_STATUS_ANNOTATION].len(),
        MAX_NETWORK_STATUS_BYTES + 1
    );
}

#[test]
fn a_page_keeps_its_continue_token_and_remaining_count() {
    let pods: Vec<_> = (0..3)
        .map(|i| wire_pod(&format!("p-{i}"), &[], "Pending", "n"))
        .collect();
    let list = read(&wire_list(&pods, "tok3n", Some(1_234)));
    assert_eq!(list.metadata.continue_.as_deref(), Some("tok3n"));
    assert_eq!(list.metadata.remaining_item_count, Some(1_234));
    let names: Vec<_> = list
        .items
        .iter()
        .map(|p| p.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["p-0", "p-1", "p-2"]);
}

#[test]
fn a_status_reads_as_kubes_status() {
    let cause = message(&[
        bytes_field(1, b"FieldValueInvalid"),
        bytes_field(3, b"continue"),
    ]);
    let details = message(&[
        bytes_field(3, b"pods"),
        bytes_field(4, &cause),
        varint_field(5, 3),
    ]);
    let raw = message(&[
        bytes_field(1, &message(&[])),
        bytes_field(2, b"Failure"),
        bytes_field(3, b"too old resource version"),
        bytes_field(4, b"Expired"),
        bytes_field(5, &details),
        varint_field(6, 410),
    ]);
    let json = pod_list_as_json(&envelope_of("Status", &raw)).unwrap();
    let status: KubeStatus = serde_json::from_slice(&json).unwrap();
    assert_eq!(status.code, 410);
    assert_eq!(status.reason, "Expired");
    assert_eq!(status.message, "too old resource version");
    let details = status.details.unwrap();
    assert_eq!(details.retry_after_seconds, 3);
    assert_eq!(details.kind, "pods");
    assert_eq!(details.causes[0].field, "continue");
}

#[test]
fn what_is_not_a_plain_pod_list_or_status_is_refused() {
    assert_eq!(
        pod_list_as_json(b"{\"kind\":\"PodList\"}"),
        Err(ProtobufError::NoMagic)
    );
    assert!(matches!(
        pod_list_as_json(&envelope_of("NodeList", &[])),
        Err(ProtobufError::Unexpected(k)) if k == "NodeList"
    ));
    let mut gzipped = MAGIC.to_vec();
    gzipped.extend(message(&[
        bytes_field(1, &message(&[bytes_field(2, b"PodList")])),
        bytes_field(3, b"gzip"),
    ]));
    assert!(matches!(
        pod_list_as_json(&gzipped),
        Err(ProtobufError::Unexpected(_))
    ));
    // A length past the end, a varint that never ends, a group.
    let mut cut = wire_list(&[wire_pod("p", &[], "", "")], "", None);
    cut.truncate(cut.len() - 3);
    assert!(matches!(
        pod_list_as_json(&cut),
        Err(ProtobufError::Malformed(_))
    ));
    let mut endless = MAGIC.to_vec();
    endless.extend([
        0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
    ]);
    assert!(matches!(
        pod_list_as_json(&endless),
        Err(ProtobufError::Malformed(_))
    ));
    let mut group = MAGIC.to_vec();
    group.push(1 << 3 | 3);
    assert_eq!(pod_list_as_json(&group), Err(ProtobufError::WireType(3)));
}

#[test]
fn a_timestamp_out_of_range_is_refused() {
    let meta = message(&[bytes_field(
        8,
        &message(&[varint_field(1, i64::MAX as u64)]),
    )]);
    let pod = message(&[bytes_field(1, &meta)]);
    assert_eq!(
        pod_list_as_json(&wire_list(&[pod], "", None)),
        Err(ProtobufError::Time(i64::MAX))
    );
}

/// A list of pods of two sizes, three with a long network-status.
fn mixed_list() -> Vec<u8> {
    let long = vec![b'x'; 3000];
    let pods: Vec<Vec<u8>> = (0..6)
        .map(|i| {
            let status: &[u8] = if i % 2 == 0 {
                &long
            } else {
                br#"[{"ips":["192.0.2.1"]}]"#
            };
            wire_pod(
                &format!("p-{i}"),
                &[(NETWORK_STATUS_ANNOTATION, status)],
                "Running",
                "n",
            )
        })
        .collect();
    wire_list(&pods, "next", Some(4))
}

/// `body` pushed `chunk` bytes at a time; the most bytes the reader held unread.
fn read_in_chunks(body: &[u8], chunk: usize) -> (Result<Vec<u8>, ProtobufError>, usize) {
    let mut reader = PodListReader::default();
    let mut most = 0;
    for part in body.chunks(chunk) {
        if let Err(e) = reader.push(part) {
            return (Err(e), most);
        }
        most = most.max(reader.buffered());
    }
    (reader.finish(), most)
}

#[test]
fn a_list_read_as_it_arrives_holds_one_pod_at_most() {
    let body = mixed_list();
    let whole = pod_list_as_json(&body).unwrap();
    let largest_pod = wire_pod(
        "p-2",
        &[(NETWORK_STATUS_ANNOTATION, &[b'x'; 3000])],
        "Running",
        "n",
    )
    .len();
    for chunk in [1, 7, 64, 1000] {
        let (json, most) = read_in_chunks(&body, chunk);
        assert_eq!(json.unwrap(), whole, "in chunks of {chunk}");
        // A pod's bytes and its header, and what came with its last chunk.
        assert!(
            most < largest_pod + 8 + chunk,
            "held {most} bytes in chunks of {chunk}"
        );
    }
    let list: ObjectList<PodView> = serde_json::from_slice(&whole).unwrap();
    assert_eq!(list.items.len(), 6);
    assert_eq!(list.metadata.continue_.as_deref(), Some("next"));
    assert_eq!(list.metadata.remaining_item_count, Some(4));
    assert!(
        body.len() > 3 * largest_pod,
        "the page is larger than what was held"
    );
}

#[test]
fn a_list_whose_kind_comes_after_it_or_that_ends_early_is_refused() {
    let raw = message(&[bytes_field(2, &wire_pod("p", &[], "", ""))]);
    let mut late_kind = MAGIC.to_vec();
    late_kind.extend(message(&[
        bytes_field(2, &raw),
        bytes_field(1, &message(&[bytes_field(2, b"PodList")])),
    ]));
    assert!(matches!(
        pod_list_as_json(&late_kind),
        Err(ProtobufError::Unexpected(_))
    ));
    let body = mixed_list();
    // The magic alone has no kind.
    assert_eq!(
        read_in_chunks(&body[..4], 16).0,
        Err(ProtobufError::Unexpected(String::new()))
    );
    for end in [2, 30, body.len() / 2, body.len() - 1] {
        let (json, _) = read_in_chunks(&body[..end], 16);
        let expected = if end < 4 {
            ProtobufError::NoMagic
        } else {
            ProtobufError::Malformed(0)
        };
        assert_eq!(
            std::mem::discriminant(&json.unwrap_err()),
            std::mem::discriminant(&expected),
            "cut at {end}"
        );
    }
    // A second kind after the object it named.
    let mut renamed = MAGIC.to_vec();
    renamed.extend(message(&[
        bytes_field(1, &message(&[bytes_field(2, b"PodList")])),
        bytes_field(2, &raw),
        bytes_field(1, &message(&[bytes_field(2, b"Status")])),
    ]));
    assert!(matches!(
        pod_list_as_json(&renamed),
        Err(ProtobufError::Unexpected(_))
    ));
    // A length as long as a varint goes, at the envelope and inside the list.
    let mut endless = MAGIC.to_vec();
    endless.extend([
        0x2a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
    ]);
    assert!(matches!(
        pod_list_as_json(&endless),
        Err(ProtobufError::Malformed(_))
    ));
    let mut endless_item = MAGIC.to_vec();
    endless_item.extend(bytes_field(1, &message(&[bytes_field(2, b"PodList")])));
    varint(2 << 3 | 2, &mut endless_item);
    varint(u64::MAX, &mut endless_item);
    varint(2 << 3 | 2, &mut endless_item);
    varint(u64::MAX, &mut endless_item);
    assert!(matches!(
        pod_list_as_json(&endless_item),
        Err(ProtobufError::Malformed(_))
    ));
    // A pod said to be larger than any the reader takes whole is refused at its header.
    let mut huge = MAGIC.to_vec();
    huge.extend(bytes_field(1, &message(&[bytes_field(2, b"PodList")])));
    varint(2 << 3 | 2, &mut huge);
    varint(u64::MAX >> 1, &mut huge);
    varint(2 << 3 | 2, &mut huge);
    varint((MAX_FIELD + 1) as u64, &mut huge);
    let mut reader = PodListReader::default();
    assert!(matches!(
        reader.push(&huge),
        Err(ProtobufError::Malformed(_))
    ));
}

#[test]
fn a_page_larger_than_any_field_read_whole_is_read() {
    // Pods of 1 MiB each (an annotation nobody keeps): the page is past MAX_FIELD, each pod
    // under it.
    let blob = vec![b'b'; 1 << 20];
    let pods: Vec<Vec<u8>> = (0..MAX_FIELD / blob.len() + 2)
        .map(|i| wire_pod(&format!("p-{i}"), &[("blob", &blob)], "Running", "n"))
        .collect();
    let body = wire_list(&pods, "", None);
    assert!(body.len() > MAX_FIELD);
    let (json, most) = read_in_chunks(&body, 16 * 1024);
    let list: ObjectList<PodView> = serde_json::from_slice(&json.unwrap()).unwrap();
    assert_eq!(list.items.len(), pods.len());
    assert!(most < 2 * blob.len(), "held {most} bytes");
}

proptest! {
    /// A list cut anywhere into parts reads as it reads whole.
    #[test]
    fn a_list_in_any_parts_reads_as_whole(cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..12)) {
        let body = mixed_list();
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(body.len())).collect();
        at.sort();
        let mut reader = PodListReader::default();
        let mut from = 0;
        for to in at.into_iter().chain([body.len()]) {
            reader.push(&body[from..to]).unwrap();
            from = to;
        }
        prop_assert_eq!(reader.finish().unwrap(), pod_list_as_json(&body).unwrap());
    }

    /// Any bytes after the magic: an error or a list, never a panic.
    #[test]
    fn any_bytes_read_without_a_panic(tail in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut body = MAGIC.to_vec();
        body.extend(tail);
        let _ = pod_list_as_json(&body);
    }

    /// A valid list with a byte flipped: an error or a list, never a panic.
    #[test]
    fn a_flipped_byte_reads_without_a_panic(at in 0usize..2000, bit in 0u8..8) {
        let mut body = wire_list(&[wire_pod("p", &[(NETWORK_STATUS_ANNOTATION, b"[]")], "Running", "n")], "c", Some(1));
        let at = at % body.len();
        body[at] ^= 1 << bit;
        let _ = pod_list_as_json(&body);
    }
}
