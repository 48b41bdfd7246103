//! A TCP link that can be cut: a forwarder on 127.0.0.1 in front of one address. The real
//! node's kubelet reaches its apiserver through one, so that a test can partition the kubelet
//! from the control plane while the kubelet process, and its memory of the pods, lives on (a
//! killed kubelet forgets them). TLS passes through untouched.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};

#[derive(Default)]
struct State {
    cut: bool,
    /// Both ends of every forwarded connection (shut down on a cut).
    open: Vec<TcpStream>,
    /// Connections accepted while cut: held unanswered, as a partition does, until healed.
    held: Vec<TcpStream>,
}

/// A running link (its threads end with the process).
pub struct Link {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("addr", &self.addr).finish()
    }
}

/// Copies `from` to `to` until either ends, then shuts both down.
fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

fn forward(client: TcpStream, upstream: SocketAddr, state: &Mutex<State>) -> Result<()> {
    let server = TcpStream::connect_timeout(&upstream, Duration::from_secs(5))?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    {
        let mut s = state.lock().expect("link state");
        // Forget connections that have ended.
        s.open.retain(|c| c.peer_addr().is_ok());
        s.open.push(client.try_clone()?);
        s.open.push(server.try_clone()?);
    }
    let (c2, s2) = (client.try_clone()?, server.try_clone()?);
    std::thread::spawn(move || pump(client, server));
    std::thread::spawn(move || pump(s2, c2));
    Ok(())
}

impl Link {
    /// Listens on 127.0.0.1 (a free port) and forwards each connection to `upstream`.
    pub fn start(upstream: SocketAddr) -> Result<Link> {
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the link")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        std::thread::Builder::new()
            .name("testenv-link".into())
            .spawn(move || {
                for client in listener.incoming().flatten() {
                    let mut s = shared.lock().expect("link state");
                    if s.cut {
                        s.held.push(client);
                        continue;
                    }
                    drop(s);
                    if let Err(e) = forward(client, upstream, &shared) {
                        eprintln!("testenv: link to {upstream}: {e:#}");
                    }
                }
            })?;
        Ok(Link { addr, state })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Partitions: every open connection is shut down and new ones are held unanswered.
    pub fn cut(&self) {
        let mut s = self.state.lock().expect("link state");
        s.cut = true;
        for c in s.open.drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// Heals: the connections held during the cut are closed (their clients dial again) and
    /// new ones are forwarded.
    pub fn heal(&self) {
        let mut s = self.state.lock().expect("link state");
        s.cut = false;
        for c in s.held.drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// Whether the link is cut.
    pub fn is_cut(&self) -> bool {
        self.state.lock().expect("link state").cut
    }
}
