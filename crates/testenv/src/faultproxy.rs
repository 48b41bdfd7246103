//! An HTTP fault proxy on 127.0.0.1 between one client (a controller replica) and the
//! apiserver, for the chaos suite. The client speaks plain HTTP to it; it forwards each request
//! with an admin client of its own over TLS. Rules chosen per verb and resource delay, hold or
//! refuse requests (409/422/429 with Retry-After/5xx) and delay watch events; watch streams can
//! be cut or silenced for good (a half-open connection), and the whole replica partitioned
//! (every request and open stream stops until healed), also by a rule right after a matching
//! write was answered (a leader lost between two writes).
//! Every request and every injected fault is counted, and every write forwarded is logged with
//! its time so a test can tell which replica wrote when.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use kube::Client;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::TcpListener;
use tokio::sync::watch;

type ProxyBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// What a matching rule does to a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Forward after this long.
    Delay(Duration),
    /// Hold until [`FaultProxy::release_held`] (or the rule is cleared), then forward.
    Hold,
    /// Answer with this status without forwarding (429 carries `Retry-After`).
    Status(u16),
    /// Forward, and deliver each chunk of the answer (watch events) this much later.
    DelayEvents(Duration),
    /// Forward, and shift the answer's `Date` header by this much (an apiserver whose clock
    /// differs from the client's).
    ShiftDate(jiff::SignedDuration),
    /// Forward, read the whole answer, partition the proxy (as [`FaultProxy::cut`]) and then
    /// deliver that answer: the request took effect and the client knows it, but nothing it
    /// sends next arrives until healed (a leader lost right after a write passed).
    CutAfter,
}

/// A rule: requests whose verb and resource match (None matches all) get `action` with
/// probability `chance`; the matching rules are tried in order, the first that fires applies.
#[derive(Debug, Clone)]
pub struct Rule {
    pub verb: Option<&'static str>,
    pub resource: Option<&'static str>,
    pub action: Action,
    pub chance: f64,
}

impl Rule {
    pub fn new(verb: Option<&'static str>, resource: Option<&'static str>, action: Action) -> Rule {
        Rule {
            verb,
            resource,
            action,
            chance: 1.0,
        }
    }

    pub fn sometimes(mut self, chance: f64) -> Rule {
        self.chance = chance;
        self
    }

    fn matches(&self, verb: &str, resource: &str) -> bool {
        self.verb.is_none_or(|v| v == verb) && self.resource.is_none_or(|r| r == resource)
    }
}

/// A write forwarded to the apiserver: when the client sent it, when it left and what it was.
#[derive(Debug, Clone)]
pub struct Write {
    pub entered: Instant,
    pub at: Instant,
    pub verb: String,
    pub resource: String,
    /// The object's name, for a write to one object.
    pub name: Option<String>,
    /// The apiserver's status code and when it came back (`None` while in flight, or when no
    /// answer came).
    pub answer: Option<(u16, Instant)>,
}

struct State {
    rules: Vec<Rule>,
    rng: StdRng,
    /// Requests seen, by "verb resource".
    requests: BTreeMap<String, u64>,
    /// Faults injected, by "action verb resource".
    injected: BTreeMap<String, u64>,
    writes: Vec<Write>,
    /// Watch streams silenced.
    silenced: u64,
}

/// A request to silence open watch streams: the `round`th, of `resource` (all: `None`).
#[derive(Debug, Clone, Default)]
struct Silence {
    round: u64,
    resource: Option<String>,
}

/// A running fault proxy; it stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// False while partitioned (also set by a [`Action::CutAfter`] rule).
    open: Arc<watch::Sender<bool>>,
    /// Bumped to end every open watch stream.
    watch_cuts: watch::Sender<u64>,
    /// Bumped to silence open watch streams (of one resource, or all) for good.
    watch_silences: watch::Sender<Silence>,
    /// Bumped to let held requests go.
    releases: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy that forwards with `upstream` (an admin client of the apiserver).
    pub async fn start(upstream: Client, seed: u64) -> Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            rules: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            requests: BTreeMap::new(),
            injected: BTreeMap::new(),
            writes: Vec::new(),
            silenced: 0,
        }));
        let open = Arc::new(watch::channel(true).0);
        let (watch_cuts, _) = watch::channel(0u64);
        let (watch_silences, _) = watch::channel(Silence::default());
        let (releases, _) = watch::channel(0u64);
        let shared = Shared {
            upstream,
            state: state.clone(),
            open: open.subscribe(),
            cutter: open.clone(),
            watch_cuts: watch_cuts.subscribe(),
            watch_silences: watch_silences.subscribe(),
            releases: releases.subscribe(),
        };
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(shared.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(FaultProxy {
            addr,
            state,
            open,
            watch_cuts,
            watch_silences,
            releases,
            task,
        })
    }

    /// `http://127.0.0.1:<port>`: the server URL a client uses to go through the proxy.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the rules.
    pub fn set_rules(&self, rules: Vec<Rule>) {
        self.state.lock().unwrap().rules = rules;
    }

    /// Clears the rules and lets every held request go.
    pub fn clear(&self) {
        self.state.lock().unwrap().rules.clear();
        self.release_held();
    }

    /// Lets the requests held so far go.
    pub fn release_held(&self) {
        self.releases.send_modify(|n| *n += 1);
    }

    /// Ends every open watch stream now (the client sees the stream close and watches again).
    pub fn cut_watches(&self) {
        self.watch_cuts.send_modify(|n| *n += 1);
    }

    /// Every open watch stream of `resource` (all: `None`) stops delivering and is never ended:
    /// the apiserver's end of its connection is gone but no close reached the client (a node
    /// frozen while the apiserver reset the connection, a partition across an apiserver
    /// restart). Watches opened later are not affected.
    pub fn silence_watches(&self, resource: Option<&str>) {
        self.watch_silences.send_modify(|s| {
            s.round += 1;
            s.resource = resource.map(str::to_owned);
        });
    }

    /// Watch streams silenced so far.
    pub fn silenced(&self) -> u64 {
        self.state.lock().unwrap().silenced
    }

    /// Partitions: no request is answered and no open stream delivers until
    /// [`heal`](Self::heal); streams open at the cut are ended when healed.
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    pub fn heal(&self) {
        self.open.send_replace(true);
    }

    /// Whether the proxy is partitioned now (by [`cut`](Self::cut) or a [`Action::CutAfter`]
    /// rule).
    pub fn is_cut(&self) -> bool {
        !*self.open.borrow()
    }

    /// Requests seen, by "verb resource".
    pub fn requests(&self) -> BTreeMap<String, u64> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Faults injected, by "action verb resource".
    pub fn injected(&self) -> BTreeMap<String, u64> {
        self.state.lock().unwrap().injected.clone()
    }

    /// Writes forwarded so far.
    pub fn writes(&self) -> Vec<Write> {
        self.state.lock().unwrap().writes.clone()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Shared {
    upstream: Client,
    state: Arc<Mutex<State>>,
    open: watch::Receiver<bool>,
    /// Partitions the proxy after a [`Action::CutAfter`] write.
    cutter: Arc<watch::Sender<bool>>,
    watch_cuts: watch::Receiver<u64>,
    watch_silences: watch::Receiver<Silence>,
    releases: watch::Receiver<u64>,
}

impl Shared {
    async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let entered = Instant::now();
        let (verb, resource) = classify(req.method(), req.uri());
        // Partitioned: the request is not answered until healed, as if lost in the network.
        let mut open = self.open.clone();
        let _ = open.wait_for(|o| *o).await;
        let action = self.choose(&verb, &resource);
        match &action {
            Some(Action::Delay(d)) => tokio::time::sleep(*d).await,
            Some(Action::Hold) => {
                let mut releases = self.releases.clone();
                releases.mark_unchanged();
                let _ = releases.changed().await;
            }
            Some(Action::Status(code)) => return refusal(*code),
            Some(Action::DelayEvents(_) | Action::ShiftDate(_) | Action::CutAfter) | None => {}
        }
        let _ = open.wait_for(|o| *o).await;
        let (parts, body) = req.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return status(StatusCode::BAD_GATEWAY, &e.to_string()),
        };
        let mut upstream = Request::builder()
            .method(parts.method)
            .uri(parts.uri.path_and_query().map_or("/", |p| p.as_str()));
        for (name, value) in &parts.headers {
            if name != http::header::HOST && name != http::header::AUTHORIZATION {
                upstream = upstream.header(name, value);
            }
        }
        let Ok(upstream) = upstream.body(kube::client::Body::from(body.to_vec())) else {
            return status(StatusCode::BAD_REQUEST, "bad request");
        };
        let write = is_write(&verb).then(|| {
            let mut state = self.state.lock().unwrap();
            state.writes.push(Write {
                entered,
                at: Instant::now(),
                verb: verb.clone(),
                resource: resource.clone(),
                name: object_name(&parts.uri),
                answer: None,
            });
            state.writes.len() - 1
        });
        let answer = match self.upstream.send(upstream).await {
            Ok(a) => a,
            Err(e) => return status(StatusCode::BAD_GATEWAY, &e.to_string()),
        };
        if let Some(i) = write
            && let Some(w) = self.state.lock().unwrap().writes.get_mut(i)
            && w.entered == entered
        {
            w.answer = Some((answer.status().as_u16(), Instant::now()));
        }
        let (mut parts, body) = answer.into_parts();
        if let Some(Action::ShiftDate(by)) = action {
            shift_date(&mut parts.headers, by);
        }
        if action == Some(Action::CutAfter) {
            // The whole answer first: the cut must not swallow it (it ends open streams).
            let whole = match body.collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return status(StatusCode::BAD_GATEWAY, &e.to_string()),
            };
            self.cutter.send_replace(false);
            let full = Full::new(whole).map_err(|never| match never {});
            return Response::from_parts(parts, BodyExt::boxed_unsync(full));
        }
        let event_delay = match action {
            Some(Action::DelayEvents(d)) => Some(d),
            _ => None,
        };
        let watch = (verb == "watch").then_some(resource.as_str());
        let body = self.stream_body(body, watch, event_delay);
        Response::from_parts(parts, body)
    }

    /// Picks the first matching rule's action, by its chance; counts the request and the fault.
    fn choose(&self, verb: &str, resource: &str) -> Option<Action> {
        let mut s = self.state.lock().unwrap();
        *s.requests.entry(format!("{verb} {resource}")).or_default() += 1;
        let matching: Vec<Rule> = s
            .rules
            .iter()
            .filter(|r| r.matches(verb, resource))
            .cloned()
            .collect();
        let rule = matching
            .into_iter()
            .find(|r| s.rng.random_bool(r.chance.clamp(0.0, 1.0)))?;
        let name = match rule.action {
            Action::Delay(_) => "delay".to_string(),
            Action::Hold => "hold".to_string(),
            Action::Status(c) => c.to_string(),
            Action::DelayEvents(_) => "delay-events".to_string(),
            Action::ShiftDate(_) => "shift-date".to_string(),
            Action::CutAfter => "cut-after".to_string(),
        };
        *s.injected
            .entry(format!("{name} {verb} {resource}"))
            .or_default() += 1;
        Some(rule.action)
    }

    /// The answer's body, chunk by chunk: held while partitioned, ended by a watch cut or when a
    /// partition heals, silent for good after a silence of its resource (`watch`: the watched
    /// resource; cuts and silences are for watches only), each chunk delivered `delay` after it
    /// arrived.
    fn stream_body(
        &self,
        body: kube::client::Body,
        watch: Option<&str>,
        delay: Option<Duration>,
    ) -> ProxyBody {
        let is_watch = watch.is_some();
        let watched = watch.map(str::to_owned);
        let state = self.state.clone();
        enum Next {
            Frame(Option<Result<Frame<Bytes>, kube::Error>>),
            Cut,
            Silenced,
            Partitioned,
        }
        let source = match delay {
            Some(d) => lagging(body, d),
            None => futures::stream::unfold(body, |mut b| async move {
                let f = b.frame().await?;
                Some((f, b))
            })
            .boxed(),
        };
        let open = self.open.clone();
        let mut cuts = self.watch_cuts.clone();
        cuts.mark_unchanged();
        let mut silences = self.watch_silences.clone();
        silences.mark_unchanged();
        let watches = (cuts, silences);
        let frames = futures::stream::unfold(Some((source, open, watches)), move |st| {
            let (watched, state) = (watched.clone(), state.clone());
            async move {
                let (mut source, mut open, (mut cuts, mut silences)) = st?;
                let next = loop {
                    tokio::select! {
                        f = source.next() => break Next::Frame(f),
                        _ = cuts.changed(), if is_watch => break Next::Cut,
                        changed = silences.changed(), if is_watch => {
                            // The proxy is gone: the stream ends as with a cut.
                            if changed.is_err() {
                                break Next::Cut;
                            }
                            let target = silences.borrow_and_update().resource.clone();
                            if target.is_none() || target == watched {
                                state.lock().unwrap().silenced += 1;
                                break Next::Silenced;
                            }
                        }
                        _ = open.wait_for(|o| !*o) => break Next::Partitioned,
                    }
                };
                let frame = match next {
                    Next::Frame(f) => f?,
                    Next::Cut => return None,
                    Next::Silenced => return futures::future::pending().await,
                    Next::Partitioned => {
                        let _ = open.wait_for(|o| *o).await;
                        return None;
                    }
                };
                // Cut while this chunk was on its way: it is lost with the stream.
                if !*open.borrow() {
                    let _ = open.wait_for(|o| *o).await;
                    return None;
                }
                let frame = frame.map_err(|e| std::io::Error::other(e.to_string()));
                Some((frame, Some((source, open, (cuts, silences)))))
            }
        });
        BodyExt::boxed_unsync(StreamBody::new(frames))
    }
}

/// `body`'s chunks, each `delay` after it arrived: a lagging watch, whose lag does not grow
/// with the number of events (a chunk read while earlier ones wait is not held back by them).
fn lagging(
    mut body: kube::client::Body,
    delay: Duration,
) -> futures::stream::BoxStream<'static, Result<Frame<Bytes>, kube::Error>> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let frame = tokio::select! {
                f = body.frame() => f,
                // The client went away: stop reading the answer.
                _ = tx.closed() => return,
            };
            let Some(frame) = frame else { return };
            if tx
                .send((tokio::time::Instant::now() + delay, frame))
                .is_err()
            {
                return;
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        let (due, frame) = rx.recv().await?;
        tokio::time::sleep_until(due).await;
        Some((frame, rx))
    })
    .boxed()
}

fn is_write(verb: &str) -> bool {
    matches!(
        verb,
        "create" | "update" | "patch" | "delete" | "deletecollection"
    )
}

/// Shifts the `Date` header of `headers` by `by` (left alone when missing or unreadable).
fn shift_date(headers: &mut http::HeaderMap, by: jiff::SignedDuration) {
    let parser = jiff::fmt::rfc2822::DateTimeParser::new();
    let shifted = headers
        .get(http::header::DATE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parser.parse_timestamp(v).ok())
        .and_then(|t| t.checked_add(by).ok())
        .map(|t| jiff::fmt::rfc2822::DateTimePrinter::new().timestamp_to_rfc9110_string(&t));
    if let Some(Ok(value)) = shifted
        && let Ok(value) = http::HeaderValue::from_str(&value)
    {
        headers.insert(http::header::DATE, value);
    }
}

/// A request's path after the API group and version and the namespace:
/// `<resource>[/<name>[/<subresource>]]`.
fn resource_path(uri: &http::Uri) -> Vec<&str> {
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    // /api/v1/... or /apis/<group>/<version>/...
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..).unwrap_or_default(),
        Some(&"apis") => segments.get(3..).unwrap_or_default(),
        _ => &[][..],
    };
    let rest = match rest {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    rest.to_vec()
}

/// The object a request names (`.../<resource>/<name>[/<subresource>]`), if one.
fn object_name(uri: &http::Uri) -> Option<String> {
    resource_path(uri).get(1).map(|n| (*n).to_string())
}

/// The Kubernetes verb and resource (with subresource, "pods/status") of a request.
pub fn classify(method: &http::Method, uri: &http::Uri) -> (String, String) {
    let rest = resource_path(uri);
    let rest = rest.as_slice();
    let (resource, named) = match rest {
        [] => (String::new(), false),
        [r] => ((*r).to_string(), false),
        [r, _name] => ((*r).to_string(), true),
        [r, _name, sub, ..] => (format!("{r}/{sub}"), true),
    };
    let watching = uri
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    let verb = match *method {
        http::Method::GET if watching => "watch",
        http::Method::GET if named => "get",
        http::Method::GET => "list",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if named => "delete",
        http::Method::DELETE => "deletecollection",
        _ => "other",
    };
    (verb.to_string(), resource)
}

fn refusal(code: u16) -> Response<ProxyBody> {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let reason = match code.as_u16() {
        409 => "Conflict",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        _ => "Unknown",
    };
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": format!("injected by the fault proxy: {reason}"),
        "reason": reason, "code": code.as_u16(),
    });
    let mut r = status(code, &body.to_string());
    if code == StatusCode::TOO_MANY_REQUESTS {
        r.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
    }
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn status(code: StatusCode, body: &str) -> Response<ProxyBody> {
    let mut r = Response::new(BodyExt::boxed_unsync(
        Full::new(Bytes::from(body.to_string())).map_err(|never| match never {}),
    ));
    *r.status_mut() = code;
    r
}

#[cfg(test)]
mod tests {
    use super::classify;
    use http::Method;

    #[test]
    fn verbs_and_resources_are_read_from_the_path() {
        let pools = "/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/ns/ippools";
        let cases = [
            (Method::GET, pools.to_string(), "list", "ippools"),
            (
                Method::GET,
                format!("{pools}?watch=true&resourceVersion=5"),
                "watch",
                "ippools",
            ),
            (
                Method::PATCH,
                format!("{pools}/10.64.0.0-16"),
                "patch",
                "ippools",
            ),
            (
                Method::PUT,
                "/api/v1/namespaces/ns/pods/p/status".into(),
                "update",
                "pods/status",
            ),
            (Method::GET, "/api/v1/pods?limit=100".into(), "list", "pods"),
            (
                Method::DELETE,
                "/api/v1/namespaces/ns/pods/p".into(),
                "delete",
                "pods",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/ns".into(),
                "get",
                "namespaces",
            ),
            (Method::GET, "/version".into(), "list", ""),
        ];
        for (method, uri, verb, resource) in cases {
            assert_eq!(
                classify(&method, &uri.parse().unwrap()),
                (verb.to_string(), resource.to_string()),
                "{method} {uri}"
            );
        }
    }
}
