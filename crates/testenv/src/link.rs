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

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that answers each line with the same line.
    fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut out = conn.try_clone().unwrap();
                    let _ = std::io::copy(&mut &conn, &mut out);
                });
            }
        });
        addr
    }

    /// Sends `ping` and reads the answer, waiting at most `limit`.
    fn ping(conn: &mut TcpStream, limit: Duration) -> std::io::Result<Vec<u8>> {
        conn.set_read_timeout(Some(limit))?;
        conn.write_all(b"ping")?;
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf)?;
        Ok(buf.to_vec())
    }

    #[test]
    fn a_cut_closes_open_connections_and_holds_new_ones_until_healed() {
        let link = Link::start(echo_server()).unwrap();
        let mut before = TcpStream::connect(link.addr()).unwrap();
        assert_eq!(ping(&mut before, Duration::from_secs(10)).unwrap(), b"ping");

        link.cut();
        assert!(link.is_cut());
        let mut buf = [0u8; 1];
        before
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // EOF or a reset; a timeout means it stayed open.
        let closed = |r: std::io::Result<usize>| {
            matches!(r, Ok(0)) || r.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset)
        };
        assert!(
            closed(before.read(&mut buf)),
            "the open connection is closed"
        );
        let mut during = TcpStream::connect(link.addr()).unwrap();
        assert!(
            ping(&mut during, Duration::from_millis(300)).is_err(),
            "no answer through a cut link"
        );

        link.heal();
        during
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert!(
            closed(during.read(&mut buf)),
            "a connection held during the cut is closed by the heal"
        );
        let mut after = TcpStream::connect(link.addr()).unwrap();
        assert_eq!(ping(&mut after, Duration::from_secs(10)).unwrap(), b"ping");
    }
}
