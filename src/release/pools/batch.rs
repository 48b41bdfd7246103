//! How one pool's batch is shaped, pure: one write per entry (a fence wins), lowest address
//! first, each request told which write answers it; a refused group split until the refused
//! entry is alone.

use std::collections::{BTreeMap, HashMap};

use crate::ipam::cooldown::{cooldown_id, cooling_podref};
use crate::ipam::entry_key::EntryKey;
use crate::ipam::fence::fenced_podref;

use crate::api::IPAllocation;
use crate::release::types::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};

/// Whether `podref` is what `write`, a fence, makes of its entry.
fn fenced_as(write: &EntryWrite, podref: &str) -> bool {
    matches!(write, EntryWrite::Fence(r) if podref == fenced_podref(&r.podref))
}

/// One write per entry, lowest address first, and for each request which write answers it.
/// The sweep and the deletion path may hand in the same entry in one patch window: a second
/// `remove` of it would fail the whole patch. A fence wins over a plain removal.
pub fn one_write_per_entry<R>(
    items: Vec<(ReleaseRequest, R)>,
) -> (Vec<ReleaseRequest>, Vec<(Answer, R)>) {
    let mut reqs: Vec<ReleaseRequest> = Vec::with_capacity(items.len());
    let mut by_key: HashMap<EntryKey, usize> = HashMap::with_capacity(items.len());
    let mut replies = Vec::with_capacity(items.len());
    for (req, reply) in items {
        let answer = match by_key.get(req.judged.entry.key.as_str()) {
            Some(&i) => {
                let same = reqs[i].judged.entry.id == req.judged.entry.id
                    && reqs[i].judged.entry.podref == req.judged.entry.podref;
                if !same {
                    // Two allocations seen at one key: at most one is there; the patch tests
                    // the first, and the other was replaced (its owner looks again later).
                    Answer::Other
                } else {
                    if matches!(req.write, EntryWrite::Fence(_)) {
                        reqs[i] = req;
                    }
                    Answer::By(i)
                }
            }
            None => {
                by_key.insert(req.judged.entry.key.clone(), reqs.len());
                reqs.push(req);
                Answer::By(reqs.len() - 1)
            }
        };
        replies.push((answer, reply));
    }
    // whereabouts hands out the lowest free address that has no reservation, so the
    // reservations go lowest address first: those addresses are reused first.
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| reqs[i].judged.entry.ip);
    let mut at = vec![0; reqs.len()];
    for (new, &old) in order.iter().enumerate() {
        at[old] = new;
    }
    let mut slots: Vec<Option<ReleaseRequest>> = reqs.into_iter().map(Some).collect();
    let reqs = order
        .iter()
        .map(|&i| slots[i].take().expect("each index once"))
        .collect();
    let replies = replies
        .into_iter()
        .map(|(a, r)| match a {
            Answer::By(i) => (Answer::By(at[i]), r),
            other => (other, r),
        })
        .collect();
    (reqs, replies)
}

/// Which write answers a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The write at this index.
    By(usize),
    /// None: another allocation at the same key is written instead.
    Other,
}

/// What a fresh read of the pool (`allocations`) says of a refused `group`: each request's
/// entry gone, changed, or written already (fenced: a first patch that answered late, or
/// another writer completing the same fence) gets its outcome; those still as they were are
/// returned, to be written again.
pub fn settle_against(
    reqs: &[ReleaseRequest],
    group: &[usize],
    allocations: &BTreeMap<String, IPAllocation>,
    outcomes: &mut [Option<Result<ReleaseOutcome, ReleaseError>>],
) -> Vec<usize> {
    let mut still = Vec::with_capacity(group.len());
    for &i in group {
        let e = &reqs[i].judged.entry;
        match allocations.get(e.key.as_str()) {
            None => outcomes[i] = Some(Ok(ReleaseOutcome::AlreadyGone)),
            Some(a) if a.id == e.id && a.podref == e.podref => still.push(i),
            Some(a) if a.id == e.id && fenced_as(&reqs[i].write, &a.podref) => {
                outcomes[i] = Some(Ok(ReleaseOutcome::Released))
            }
            // Cooled already: a first patch that answered late.
            Some(a)
                if reqs[i].cooldown.is_some_and(|u| a.id == cooldown_id(u))
                    && a.podref == cooling_podref(reqs[i].podref()) =>
            {
                outcomes[i] = Some(Ok(ReleaseOutcome::Released))
            }
            Some(_) => outcomes[i] = Some(Ok(ReleaseOutcome::Changed)),
        }
    }
    still
}

/// A refused group split in two: fences apart from the rest first (a fence grows the pool;
/// a removal never does), else halves.
pub fn split(reqs: &[ReleaseRequest], group: Vec<usize>) -> Vec<Vec<usize>> {
    let (fences, rest): (Vec<usize>, Vec<usize>) = group
        .iter()
        .partition(|&&i| matches!(reqs[i].write, EntryWrite::Fence(_)));
    if !fences.is_empty() && !rest.is_empty() {
        return vec![fences, rest];
    }
    let mut first = group;
    let second = first.split_off(first.len() / 2);
    vec![first, second]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::fixtures::{record, request};

    /// A reply channel stands for itself here: a unit.
    fn reply() {}

    /// Requests for keys 1 to 4 of pods `ns/a` to `ns/d`: fences at the indexes `fences`,
    /// removals elsewhere.
    fn four_requests(fences: &[usize]) -> Vec<ReleaseRequest> {
        ["a", "b", "c", "d"]
            .into_iter()
            .enumerate()
            .map(|(i, pod)| {
                let write = if fences.contains(&i) {
                    EntryWrite::Fence(record())
                } else {
                    EntryWrite::Remove
                };
                request(&(i + 1).to_string(), &format!("ns/{pod}"), write)
            })
            .collect()
    }

    #[test]
    fn each_entry_is_written_once_a_fence_wins_and_another_allocation_at_the_key_is_answered_apart()
    {
        let mut other = request("5", "ns/db-0", EntryWrite::Remove);
        other.judged.entry.id = "sb-other".into();
        let mut low = request("3", "ns/a-0", EntryWrite::Remove);
        low.judged.entry.ip = "192.0.2.3".parse().unwrap();
        let items = vec![
            (request("5", "ns/web-0", EntryWrite::Remove), reply()),
            (
                request("5", "ns/web-0", EntryWrite::Fence(record())),
                reply(),
            ),
            (other, reply()),
            (low, reply()),
        ];
        let (reqs, replies) = one_write_per_entry(items);
        let keys: Vec<&str> = reqs.iter().map(|r| r.judged.entry.key.as_str()).collect();
        assert_eq!(keys, ["3", "5"], "lowest address first, one write per key");
        assert!(
            matches!(reqs[1].write, EntryWrite::Fence(_)),
            "the fence wins"
        );
        let answers: Vec<Answer> = replies.into_iter().map(|(a, ())| a).collect();
        assert_eq!(
            answers,
            [Answer::By(1), Answer::By(1), Answer::Other, Answer::By(0)]
        );
    }

    #[test]
    fn an_entry_already_marked_for_the_fence_counts_as_fenced_on_a_re_read() {
        let fence = EntryWrite::Fence(record());
        assert!(fenced_as(&fence, "ns/web-0:fenced"));
        assert!(!fenced_as(&fence, "ns/web-0"));
        assert!(!fenced_as(&fence, "ns/db-0:fenced"));
        assert!(!fenced_as(&EntryWrite::Remove, "ns/web-0:fenced"));
    }

    #[test]
    fn a_refused_group_splits_fences_from_removals_then_in_halves() {
        let reqs = four_requests(&[1, 3]);
        assert_eq!(split(&reqs, vec![0, 1, 2, 3]), [vec![1, 3], vec![0, 2]]);
        assert_eq!(split(&reqs, vec![1, 3]), [vec![1], vec![3]]);
        assert_eq!(split(&reqs, vec![0, 2]), [vec![0], vec![2]]);
    }

    #[test]
    fn a_fresh_read_settles_what_changed_and_keeps_what_did_not() {
        let reqs = four_requests(&[1]);
        let alloc = |id: &str, podref: &str| IPAllocation {
            id: id.into(),
            podref: podref.into(),
            ifname: None,
            ipamclaimref: None,
        };
        let allocations = BTreeMap::from([
            // 1 is gone; 2 is fenced already; 3 is another sandbox's now; 4 is as it was.
            ("2".to_string(), alloc("sb", "ns/web-0:fenced")),
            ("3".to_string(), alloc("sb-new", "ns/c")),
            ("4".to_string(), alloc("sb", "ns/d")),
        ]);
        let mut outcomes = vec![None; 4];
        let still = settle_against(&reqs, &[0, 1, 2, 3], &allocations, &mut outcomes);
        assert_eq!(still, [3]);
        assert_eq!(
            outcomes,
            [
                Some(Ok(ReleaseOutcome::AlreadyGone)),
                Some(Ok(ReleaseOutcome::Released)),
                Some(Ok(ReleaseOutcome::Changed)),
                None
            ]
        );
    }
}
