//! volagent's NBD server against real clients (Debian's libnbd-bin and
//! qemu-utils): nbdinfo, nbdcopy, nbdsh, qemu-img, qemu-io. Data written
//! through one client is read back bit-identical through another. No root
//! needed: Unix sockets and files. `scripts/setup` installs the tools.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use volagent::nbd::{ClientAuth, Exports, Listener, Server};
use volagent::sys::export_file::FileExport;
use volagent_test_support::wait_until_or;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn tool(name: &str) -> Command {
    let path = ["/usr/bin", "/usr/local/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} is not installed; scripts/setup installs it"));
    Command::new(path)
}

/// nbdsh is python3 -m nbd; Debian's python3 has the module.
fn nbdsh() -> Command {
    let mut c = tool("python3");
    c.args(["-m", "nbd"]);
    c
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn random_file(path: &Path, bytes: usize, seed: u64) {
    // xorshift: reproducible, incompressible enough for a copy test.
    let mut x = seed | 1;
    let data: Vec<u8> = (0..bytes / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(path, data).unwrap();
}

struct Served {
    // Dropped first: the server stops before its dir goes.
    _server: Server,
    dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Served {
    /// Serve a fresh sparse `mib` MiB file as the default export and "disk",
    /// and the same file read-only as "ro".
    fn new(mib: u64) -> Served {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        std::fs::File::create(&image).unwrap().set_len(mib << 20).unwrap();
        let exports = Exports::default();
        let rw = Arc::new(FileExport::open(&image, false).unwrap());
        exports.insert("", rw.clone());
        exports.insert("disk", rw);
        exports.insert("ro", Arc::new(FileExport::open(&image, true).unwrap()));
        let socket = dir.path().join("nbd.sock");
        let server = Server::start(Listener::unix(&socket).unwrap(), exports, 16, None).unwrap();
        Served { _server: server, dir, socket }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    fn image(&self) -> PathBuf {
        self.dir.path().join("disk.img")
    }
}

#[test]
fn nbdinfo_sees_the_exports_their_flags_and_allocation() {
    let s = Served::new(8);
    let info: serde_json::Value = serde_json::from_str(&ok(
        tool("nbdinfo").arg("--json").arg(s.uri("disk")).output().unwrap(),
        "nbdinfo",
    ))
    .unwrap();
    assert_eq!(info["protocol"], "newstyle-fixed");
    assert_eq!(info["TLS"], false);
    let export = &info["exports"][0];
    assert_eq!(export["export-size"], 8 << 20);
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_multi_conn",
        "can_cache",
        "can_df",
    ] {
        assert_eq!(export[flag], true, "{flag}: {export}");
    }
    assert_eq!(export["is_read_only"], false);
    assert!(
        export["contexts"].as_array().unwrap().iter().any(|c| c == "base:allocation"),
        "{export}"
    );
    assert_eq!(export["block_size_maximum"], 32 << 20);

    let info: serde_json::Value = serde_json::from_str(&ok(
        tool("nbdinfo").arg("--json").arg(s.uri("ro")).output().unwrap(),
        "nbdinfo ro",
    ))
    .unwrap();
    assert_eq!(info["exports"][0]["is_read_only"], true);

    let list = ok(
        tool("nbdinfo").args(["--list", "--json"]).arg(s.uri("")).output().unwrap(),
        "nbdinfo --list",
    );
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let mut names: Vec<&str> = list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["", "disk", "ro"]);

    // A fresh sparse file is all hole.
    let map =
        ok(tool("nbdinfo").arg("--map").arg(s.uri("disk")).output().unwrap(), "nbdinfo --map");
    assert!(map.trim().ends_with("hole,zero"), "{map}");
    let missing = tool("nbdinfo").arg(s.uri("nope")).output().unwrap();
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("nope"),
        "the error names the export"
    );
}

#[test]
fn nbdcopy_in_qemu_img_compares_nbdcopy_out() {
    let s = Served::new(16);
    let src = s.dir.path().join("src.img");
    random_file(&src, 16 << 20, 7);
    // Four connections, many requests in flight on each.
    ok(
        tool("nbdcopy")
            .args(["--connections=4", "--requests=32"])
            .arg(&src)
            .arg(s.uri("disk"))
            .output()
            .unwrap(),
        "nbdcopy in",
    );
    ok(
        tool("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(s.uri("disk"))
            .output()
            .unwrap(),
        "qemu-img compare",
    );
    let out = s.dir.path().join("out.img");
    ok(tool("nbdcopy").arg(s.uri("ro")).arg(&out).output().unwrap(), "nbdcopy out");
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&src).unwrap(), "read back differs");
    assert!(
        std::fs::read(s.image()).unwrap() == std::fs::read(&src).unwrap(),
        "the export's file differs"
    );
}

#[test]
fn qemu_io_writes_zeroes_and_trims_and_nbdsh_reads_them_back() {
    let s = Served::new(8);
    ok(
        tool("qemu-io")
            .args([
                "-f",
                "raw",
                "-c",
                "write -P 0xab 0 4M",
                "-c",
                "write -P 0xcd -f 1M 64k",
                "-c",
                "write -z 2M 512k",
                "-c",
                "discard 3M 1M",
                "-c",
                "flush",
            ])
            .arg(s.uri("disk"))
            .output()
            .unwrap(),
        "qemu-io",
    );
    let script = r#"
assert h.pread(65536, 1 << 20) == b"\xcd" * 65536, "FUA write"
assert h.pread(4096, 0) == b"\xab" * 4096, "plain write"
assert h.pread(512 * 1024, 2 << 20) == bytes(512 * 1024), "write zeroes"
assert h.pread(4096, 3 << 20) == bytes(4096), "a trimmed range reads as zeroes"
seen = []
def f(meta, offset, entries, err):
    seen.extend(zip(entries[0::2], entries[1::2]))
h.block_status(8 << 20, 0, f)
offset = 0
holes = []
for length, flags in seen:
    if flags & nbd.STATE_HOLE:
        holes.append((offset, length))
    offset += length
assert offset == 8 << 20, seen
assert (3 << 20, 1 << 20) in holes or any(o <= 3 << 20 and o + l >= 4 << 20 for o, l in holes), holes
assert not any(o < 2 << 20 for o, l in holes), holes
h.pwrite(b"volagent", 5 << 20, nbd.CMD_FLAG_FUA)
print("ok")
"#;
    let out = ok(
        nbdsh()
            .arg("--base-allocation")
            .arg("-u")
            .arg(s.uri("disk"))
            .arg("-c")
            .arg(script)
            .output()
            .unwrap(),
        "nbdsh",
    );
    assert_eq!(out.trim(), "ok");
    let image = std::fs::read(s.image()).unwrap();
    assert_eq!(&image[5 << 20..(5 << 20) + 8], b"volagent");
}

#[test]
fn a_read_only_export_refuses_every_write() {
    let s = Served::new(4);
    // qemu sees the read-only flag and will not open it for writing.
    let out = tool("qemu-io")
        .args(["-f", "raw", "-c", "write -P 1 0 4k"])
        .arg(s.uri("ro"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{out:?}");
    // libnbd without its own checks sends them anyway: the server refuses each.
    let script = r#"
import errno
h.set_strict_mode(0)
for name, op in [("write", lambda: h.pwrite(b"x" * 4096, 0)),
                 ("zero", lambda: h.zero(4096, 0)),
                 ("trim", lambda: h.trim(4096, 0))]:
    try:
        op()
        raise SystemExit(name + " was accepted")
    except nbd.Error as e:
        assert e.errno == "EPERM", (name, e.errno, e.string)
print("refused")
"#;
    let uri = s.uri("ro");
    let out = ok(nbdsh().arg("-u").arg(&uri).arg("-c").arg(script).output().unwrap(), "nbdsh");
    assert_eq!(out.trim(), "refused");
    assert!(std::fs::read(s.image()).unwrap().iter().all(|b| *b == 0), "a write reached the file");
}

#[test]
fn loopback_tcp_serves_and_other_addresses_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    random_file(&image, 1 << 20, 3);
    let exports = Exports::default();
    exports.insert("", Arc::new(FileExport::open(&image, true).unwrap()));
    let listener = Listener::tcp("127.0.0.1:0".parse().unwrap(), ClientAuth::None, false).unwrap();
    let server = Server::start(listener, exports, 4, None).unwrap();
    let out = dir.path().join("out.img");
    ok(
        tool("nbdcopy").arg(format!("nbd://{}/", server.describe())).arg(&out).output().unwrap(),
        "nbdcopy over tcp",
    );
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&image).unwrap());
    let err = Listener::tcp("0.0.0.0:0".parse().unwrap(), ClientAuth::None, false)
        .err()
        .expect("every interface is refused");
    assert!(err.to_string().contains("only over TLS"), "{err}");
}

#[test]
fn writes_acknowledged_with_fua_or_before_a_flush_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(4 << 20).unwrap();
    let socket = dir.path().join("nbd.sock");
    let mut server = Command::new(VOLAGENT)
        .args(["nbd", "serve", "--unix"])
        .arg(&socket)
        .arg(format!("--export=={}", image.display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(server.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("serving on"), "{line}");
    }
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    let script = r#"
h.pwrite(b"fua-write" * 100, 4096, nbd.CMD_FLAG_FUA)
h.pwrite(b"flushed" * 100, 1 << 20)
h.flush()
print("acked")
"#;
    assert_eq!(
        ok(nbdsh().arg("-u").arg(&uri).arg("-c").arg(script).output().unwrap(), "nbdsh").trim(),
        "acked"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    server.wait().unwrap();
    let data = std::fs::read(&image).unwrap();
    assert_eq!(&data[4096..4096 + 900], "fua-write".repeat(100).as_bytes());
    assert_eq!(&data[1 << 20..(1 << 20) + 700], "flushed".repeat(100).as_bytes());
}

/// A CA, a server certificate for localhost and a client certificate, made
/// with openssl; the dir is also the libnbd client's `tls-certificates` dir
/// (it reads ca-cert.pem, and client-cert.pem / client-key.pem when there).
fn pki(dir: &Path) {
    let sh = |script: &str| {
        ok(tool("sh").arg("-ec").arg(script).current_dir(dir).output().unwrap(), "openssl")
    };
    sh("key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out \"$1\" 2>/dev/null; }
        key ca-key.pem
        openssl req -x509 -new -key ca-key.pem -out ca-cert.pem -days 2 -subj /CN=volagent-test-ca
        key server-key.pem
        openssl req -new -key server-key.pem -out server.csr -subj /CN=localhost
        printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' > server.ext
        openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -out server-cert.pem -days 2 -extfile server.ext 2>/dev/null
        key client.key
        openssl req -new -key client.key -out client.csr -subj /CN=node-b
        printf 'extendedKeyUsage=clientAuth\\n' > client.ext
        openssl x509 -req -in client.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -out client.crt -days 2 -extfile client.ext 2>/dev/null");
}

/// A TLS-only server on `bind` for a 4 MiB file of random bytes; without
/// `client_ca`, explicitly open to clients without certificates.
fn tls_server(dir: &Path, bind: &str, client_ca: bool) -> (Server, u16, PathBuf) {
    let image = dir.join("disk.img");
    random_file(&image, 4 << 20, 11);
    let exports = Exports::default();
    exports.insert("disk", Arc::new(FileExport::open(&image, false).unwrap()));
    let ca = dir.join("ca-cert.pem");
    let tls = volagent::nbd::tls::server_config(
        &dir.join("server-cert.pem"),
        &dir.join("server-key.pem"),
        client_ca.then_some(ca.as_path()),
    )
    .unwrap();
    let clients = if client_ca { ClientAuth::Certificates } else { ClientAuth::Tls };
    let listener = Listener::tcp(bind.parse().unwrap(), clients, !client_ca).unwrap();
    let server = Server::start(listener, exports, 8, Some(tls)).unwrap();
    let port = server.describe().rsplit_once(':').unwrap().1.parse().unwrap();
    (server, port, image)
}

#[test]
fn over_tls_clients_copy_bit_identical_data_and_plain_clients_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    // TLS (here without client certificates, as the server was told to
    // allow) makes every interface allowed; plain TCP only loopback.
    let (_server, port, image) = tls_server(dir.path(), "0.0.0.0:0", false);
    let uri = format!("nbds://localhost:{port}/disk?tls-certificates={}", dir.path().display());
    let info: serde_json::Value = serde_json::from_str(&ok(
        tool("nbdinfo").arg("--json").arg(&uri).output().unwrap(),
        "nbdinfo over TLS",
    ))
    .unwrap();
    assert_eq!(info["TLS"], true, "{info}");
    let out = dir.path().join("out.img");
    ok(tool("nbdcopy").arg(&uri).arg(&out).output().unwrap(), "nbdcopy out over TLS");
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(&image).unwrap(),
        "read back over TLS differs"
    );
    let src = dir.path().join("src.img");
    random_file(&src, 4 << 20, 12);
    ok(tool("nbdcopy").arg(&src).arg(&uri).output().unwrap(), "nbdcopy in over TLS");
    assert!(
        std::fs::read(&image).unwrap() == std::fs::read(&src).unwrap(),
        "written over TLS differs"
    );

    let plain = tool("nbdinfo").arg(format!("nbd://localhost:{port}/disk")).output().unwrap();
    assert!(!plain.status.success(), "a plain client was served");
    // libnbd 1.14 words ERR_TLS_REQD as "operation not supported"; the
    // reply itself is checked in the server's unit tests.
    let said = String::from_utf8_lossy(&plain.stderr);
    assert!(said.contains("server replied with error"), "refused by the server, not lost: {said}");
}

#[test]
fn with_a_client_ca_only_clients_with_its_certificates_get_in() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let (_server, port, _) = tls_server(dir.path(), "127.0.0.1:0", true);
    let uri = format!("nbds://localhost:{port}/disk?tls-certificates={}", dir.path().display());
    let refused = tool("nbdinfo").arg(&uri).output().unwrap();
    assert!(!refused.status.success(), "a client without a certificate was served");
    std::fs::copy(dir.path().join("client.crt"), dir.path().join("client-cert.pem")).unwrap();
    std::fs::copy(dir.path().join("client.key"), dir.path().join("client-key.pem")).unwrap();
    ok(tool("nbdinfo").arg(&uri).output().unwrap(), "nbdinfo with a client certificate");
}

/// A `volagent nbd serve` process, its log (stderr) in a file; killed on drop.
struct Cli {
    child: std::process::Child,
    log: PathBuf,
    /// What it printed when it began serving: "serving on <where>".
    serving: String,
}

impl Cli {
    /// Start it with `args`; `None` when it exits instead of serving, with
    /// its log.
    fn start(dir: &Path, args: &[&str]) -> Result<Cli, String> {
        let mut cmd = Command::new(VOLAGENT);
        cmd.args(["nbd", "serve"]).args(args);
        Cli::run(dir, cmd)
    }

    fn run(dir: &Path, mut cmd: Command) -> Result<Cli, String> {
        use std::io::BufRead;
        let log = dir.join(format!("serve-{}.log", fastrand::u32(..)));
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(std::time::Duration::from_secs(20)).unwrap_or_default();
        if line.starts_with("serving on ") {
            return Ok(Cli { child, log, serving: line.trim().to_string() });
        }
        let _ = child.kill();
        let status = child.wait().unwrap();
        Err(format!("{status}: {}", std::fs::read_to_string(&log).unwrap_or_default()))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn port(&self) -> u16 {
        self.serving.rsplit_once(':').unwrap().1.parse().unwrap()
    }

    /// Waits (20 s at most) for its log to say `what`.
    fn wait_for_log(&self, what: &str) -> String {
        wait_until_or(
            std::time::Duration::from_secs(20),
            &format!("the server to log {what:?}"),
            || {
                let log = self.log();
                log.contains(what).then_some(log)
            },
            || self.log(),
        )
    }

    /// Its peak resident memory, in KiB.
    fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client certificate and key that another CA signed, in a libnbd
/// `tls-certificates` dir that trusts the server's CA.
fn other_ca_client(dir: &Path) -> PathBuf {
    let other = dir.join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::copy(dir.join("ca-cert.pem"), other.join("ca-cert.pem")).unwrap();
    let sh = |script: &str| {
        ok(tool("sh").arg("-ec").arg(script).current_dir(&other).output().unwrap(), "openssl")
    };
    sh("openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out other-ca-key.pem 2>/dev/null
        openssl req -x509 -new -key other-ca-key.pem -out other-ca-cert.pem -days 2 -subj /CN=another-ca
        openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out client-key.pem 2>/dev/null
        openssl req -new -key client-key.pem -out client.csr -subj /CN=node-b
        printf 'extendedKeyUsage=clientAuth\\n' > client.ext
        openssl x509 -req -in client.csr -CA other-ca-cert.pem -CAkey other-ca-key.pem -CAcreateserial -out client-cert.pem -days 2 -extfile client.ext 2>/dev/null");
    other
}

#[test]
fn the_cli_refuses_a_network_listen_without_client_certificates_unless_told() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let image = dir.path().join("disk.img");
    random_file(&image, 1 << 20, 5);
    let export = format!("--export=disk={}", image.display());
    let (cert, key, ca) = (
        dir.path().join("server-cert.pem"),
        dir.path().join("server-key.pem"),
        dir.path().join("ca-cert.pem"),
    );
    let tls = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];

    let refused = Cli::start(dir.path(), &[&["--tcp", "0.0.0.0:0", &export][..], &tls].concat())
        .err()
        .expect("served without client certificates");
    assert!(refused.contains("0.0.0.0:0") && refused.contains("--tls-client-ca"), "{refused}");
    let refused =
        Cli::start(dir.path(), &["--tcp", "0.0.0.0:0", &export, "--allow-unauthenticated-clients"])
            .err()
            .expect("served in the clear");
    assert!(refused.contains("0.0.0.0:0") && refused.contains("only over TLS"), "{refused}");

    // Told to, it serves any TLS client, and says so at start.
    let open = Cli::start(
        dir.path(),
        &[&["--tcp", "0.0.0.0:0", &export, "--allow-unauthenticated-clients"][..], &tls].concat(),
    )
    .unwrap();
    assert!(
        open.log().contains("WARN") && open.log().contains("WITHOUT client authentication"),
        "{}",
        open.log()
    );
    let uri =
        format!("nbds://localhost:{}/disk?tls-certificates={}", open.port(), dir.path().display());
    ok(
        tool("nbdinfo").arg(&uri).output().unwrap(),
        "nbdinfo without a client certificate, allowed",
    );
    drop(open);

    // Loopback is served as before, with or without TLS.
    for args in [
        &["--tcp", "127.0.0.1:0", &export][..],
        &[&["--tcp", "127.0.0.1:0", &export][..], &tls].concat(),
    ] {
        let local = Cli::start(dir.path(), args).unwrap();
        assert!(!local.log().contains("WARN"), "{}", local.log());
    }
    let with_ca = Cli::start(
        dir.path(),
        &[&["--tcp", "0.0.0.0:0", &export, "--tls-client-ca", ca.to_str().unwrap()][..], &tls]
            .concat(),
    )
    .unwrap();
    assert!(!with_ca.log().contains("WARN"), "{}", with_ca.log());
}

/// STARTTLS with rustls as the client, presenting `client` (certificate,
/// key) whatever CAs the server asks for, then LIST inside TLS: the reply
/// type, or why there was none.
fn list_over_tls(port: u16, ca: &Path, client: Option<(&Path, &Path)>) -> Result<u32, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    let option = |kind: u32| {
        let mut m = b"IHAVEOPT".to_vec();
        m.extend_from_slice(&kind.to_be_bytes());
        m.extend_from_slice(&0u32.to_be_bytes());
        m
    };
    let reply = |s: &mut dyn Read| -> std::io::Result<u32> {
        let mut h = [0u8; 20];
        s.read_exact(&mut h)?;
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut data)?;
        Ok(u32::from_be_bytes(h[12..16].try_into().unwrap()))
    };
    let mut greeting = [0u8; 18];
    tcp.read_exact(&mut greeting).unwrap();
    tcp.write_all(&3u32.to_be_bytes()).unwrap();
    tcp.write_all(&option(5)).unwrap(); // STARTTLS
    assert_eq!(reply(&mut tcp).unwrap(), 1, "STARTTLS acknowledged");
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap())
                .unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let conn = rustls::ClientConnection::new(
        std::sync::Arc::new(config),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    tls.write_all(&option(3)).and_then(|_| tls.flush()).map_err(|e| e.to_string())?; // LIST
    let mut kind = reply(&mut tls).map_err(|e| e.to_string())?;
    // One SERVER reply per export, then the ACK.
    while kind == 2 {
        kind = reply(&mut tls).map_err(|e| e.to_string())?;
    }
    Ok(kind)
}

#[test]
fn beyond_loopback_only_clients_with_the_cas_certificates_get_in() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let other = other_ca_client(dir.path());
    let image = dir.path().join("disk.img");
    random_file(&image, 4 << 20, 9);
    let p = |name: &str| dir.path().join(name);
    let export = format!("--export=disk={}", image.display());
    let server = Cli::start(
        dir.path(),
        &[
            "--tcp",
            "0.0.0.0:0",
            &export,
            "--tls-cert",
            p("server-cert.pem").to_str().unwrap(),
            "--tls-key",
            p("server-key.pem").to_str().unwrap(),
            "--tls-client-ca",
            p("ca-cert.pem").to_str().unwrap(),
        ],
    )
    .unwrap();
    let ca = p("ca-cert.pem");

    // rustls as the client: the server's verifier decides, whatever the
    // client sends.
    let none = list_over_tls(server.port(), &ca, None).expect_err("served without a certificate");
    server.wait_for_log("peer sent no certificates");
    let foreign = list_over_tls(
        server.port(),
        &ca,
        Some((&other.join("client-cert.pem"), &other.join("client-key.pem"))),
    )
    .expect_err("served with another CA's certificate");
    server.wait_for_log("invalid peer certificate: UnknownIssuer");
    assert_eq!(
        list_over_tls(server.port(), &ca, Some((&p("client.crt"), &p("client.key")))),
        Ok(1),
        "with the CA's certificate; refused: {none}; {foreign}"
    );

    // libnbd: refused without a certificate and with another CA's (which
    // it does not even offer, as the server asks for its own CA's), served
    // with the CA's.
    let uri = |certs: &Path| {
        format!("nbds://localhost:{}/disk?tls-certificates={}", server.port(), certs.display())
    };
    assert!(
        !tool("nbdinfo").arg(uri(dir.path())).output().unwrap().status.success(),
        "nbdinfo without a certificate was served"
    );
    assert!(
        !tool("nbdinfo").arg(uri(&other)).output().unwrap().status.success(),
        "nbdinfo with another CA's certificate was served"
    );
    std::fs::copy(p("client.crt"), p("client-cert.pem")).unwrap();
    std::fs::copy(p("client.key"), p("client-key.pem")).unwrap();
    let out = p("out.img");
    ok(
        tool("nbdcopy").arg(uri(dir.path())).arg(&out).output().unwrap(),
        "nbdcopy with the CA's client certificate",
    );
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(&image).unwrap(),
        "read back over mutual TLS differs"
    );
}

/// A raw client at the start of transmission with export "disk".
fn raw_client(socket: &Path) -> std::os::unix::net::UnixStream {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    let mut m = 3u32.to_be_bytes().to_vec(); // fixed newstyle, no zeroes
    m.extend_from_slice(b"IHAVEOPT");
    m.extend_from_slice(&7u32.to_be_bytes()); // GO
    m.extend_from_slice(&10u32.to_be_bytes());
    m.extend_from_slice(&4u32.to_be_bytes());
    m.extend_from_slice(b"disk");
    m.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&m).unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut data).unwrap();
        match kind {
            1 => return s, // ACK
            3 => {}        // INFO
            other => panic!("GO answered {other:#x}"),
        }
    }
}

/// A request header.
fn request(kind: u16, offset: u64, length: u32) -> Vec<u8> {
    let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&kind.to_be_bytes());
    r.extend_from_slice(&1u64.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&length.to_be_bytes());
    r
}

/// How long until the server closes `s` (reads nothing more), at most 10 s.
fn closed_after(s: &mut std::os::unix::net::UnixStream) -> std::time::Duration {
    use std::io::Read;
    let since = std::time::Instant::now();
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => {
            panic!("the server did not close the connection: {other:?} after {:?}", since.elapsed())
        }
    }
    since.elapsed()
}

#[test]
fn writes_announced_and_never_sent_cost_the_server_no_memory() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
    let socket = dir.path().join("nbd.sock");
    let server = Cli::start(
        dir.path(),
        &[
            "--unix",
            socket.to_str().unwrap(),
            &format!("--export=disk={}", image.display()),
            "--request-timeout",
            "2s",
        ],
    )
    .unwrap();
    let mut clients: Vec<_> = (0..4).map(|_| raw_client(&socket)).collect();
    let before = server.peak_rss_kib();
    for c in &mut clients {
        // 32 MiB announced, one byte sent.
        let mut r = request(1, 0, 32 << 20);
        r.push(0xee);
        c.write_all(&r).unwrap();
    }
    // Each is closed once its request has stalled for the request timeout:
    // by then the server has read the header and waited for the payload.
    for c in &mut clients {
        let took = closed_after(c);
        assert!(took < std::time::Duration::from_secs(8), "{took:?}");
    }
    let grew = server.peak_rss_kib().saturating_sub(before);
    assert!(
        grew < 16 << 10,
        "the server's peak memory grew by {grew} KiB for 4 writes of 1 byte announced at 32 MiB"
    );
    server.wait_for_log("a request stalled");
    assert!(
        std::fs::read(&image).unwrap().iter().all(|b| *b == 0),
        "a partial write reached the file"
    );
    ok(
        tool("nbdinfo")
            .arg(format!("nbd+unix:///disk?socket={}", socket.display()))
            .output()
            .unwrap(),
        "nbdinfo after",
    );
}

#[test]
fn a_stalled_request_is_dropped_and_an_idle_client_only_past_the_idle_timeout() {
    use std::io::Write;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    random_file(&image, 1 << 20, 4);
    let export = format!("--export=disk={}", image.display());
    let idle_check = r#"
import time
h.pread(512, 0)
time.sleep(3.5)
try:
    h.pread(512, 4096)
    print("served")
except nbd.Error:
    print("closed")
"#;

    // By default: a request cut short is dropped after the request timeout,
    // a client idle for longer is served.
    let socket = dir.path().join("default.sock");
    let server = Cli::start(
        dir.path(),
        &["--unix", socket.to_str().unwrap(), &export, "--request-timeout", "1s"],
    )
    .unwrap();
    let mut partial = raw_client(&socket);
    partial.write_all(&request(0, 0, 512)[..10]).unwrap();
    let took = closed_after(&mut partial);
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(5),
        "a partial header closed after {took:?}"
    );
    let mut payload = raw_client(&socket);
    let mut r = request(1, 0, 4096);
    r.extend_from_slice(&[1u8; 100]);
    payload.write_all(&r).unwrap();
    let took = closed_after(&mut payload);
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(5),
        "a partial payload closed after {took:?}"
    );
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    assert_eq!(
        ok(nbdsh().arg("-u").arg(&uri).arg("-c").arg(idle_check).output().unwrap(), "nbdsh").trim(),
        "served"
    );
    assert!(!server.log().contains("idle"), "{}", server.log());
    drop(server);

    // With --idle-timeout, a client that sends nothing for that long is closed.
    let socket = dir.path().join("idle.sock");
    let server = Cli::start(
        dir.path(),
        &[
            "--unix",
            socket.to_str().unwrap(),
            &export,
            "--request-timeout",
            "1s",
            "--idle-timeout",
            "2s",
        ],
    )
    .unwrap();
    let mut silent = raw_client(&socket);
    let took = closed_after(&mut silent);
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_secs(6),
        "an idle client closed after {took:?}"
    );
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    assert_eq!(
        ok(nbdsh().arg("-u").arg(&uri).arg("-c").arg(idle_check).output().unwrap(), "nbdsh").trim(),
        "closed"
    );
    server.wait_for_log("closing the idle connection");
}

#[test]
fn a_unix_socket_is_made_0600_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(1 << 20).unwrap();
    let socket = dir.path().join("nbd.sock");
    let mut cmd = tool("sh");
    cmd.arg("-c")
        .arg("umask 000; exec \"$0\" nbd serve --unix \"$1\" --export=disk=\"$2\"")
        .arg(VOLAGENT)
        .arg(&socket)
        .arg(&image);
    let _server = Cli::run(dir.path(), cmd).unwrap();
    let mode = std::fs::symlink_metadata(&socket).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600, "a socket made under umask 000 is {mode:o}");
    let mut left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.ends_with(".log"))
        .collect();
    left.sort();
    assert_eq!(left, ["disk.img", "nbd.sock"], "no private dir is left behind");
}
